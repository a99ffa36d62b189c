"""A pipeline within a memory budget: :func:`plan_within_budget`.

``pm.pipeline_value_and_grad(..., memory_budget=bytes)`` (and ``pipeline_train_step``)
asks that every device slot's predicted peak (:meth:`pipemark.Pipeline.memory`:
parameters, batch, accumulators, the values the schedule keeps in flight, the largest
program temporaries) stay within ``bytes``. The plan is made as usual first; where a
slot is over, the forward stages it runs are rematerialised (their backward stages
recompute them from their inputs, as ``jax.checkpoint`` of the whole stage would:
:func:`pipemark.passes.recompute_residuals` with ``rematerialize``), and the plan is
made again, keeping a rematerialisation only where it brings the plan closer to the
budget (recomputing a forward can need more temporaries than the residuals it
saves), until every slot fits. When a slot is still over and every forward stage of
the slots over has been tried, :class:`~pipemark.MemoryBudgetError` says which slot, by
how much, and what its peak is made of.

Not chosen yet by the budget: the stage cuts and the number of microbatches a schedule
keeps in flight (a schedule builder may read ``ScheduleProblem.memory_limit`` for that;
see docs/runtime.md, "Adding a schedule").
"""

from __future__ import annotations

from collections.abc import Callable

from pipemark.errors import MemoryBudgetError
from pipemark.runtime.memory import SlotMemory, format_bytes, plan_memory
from pipemark.runtime.plan import PipelinePlan

__all__ = ["plan_within_budget"]


def plan_within_budget(
    make_plan: Callable[[frozenset[str]], PipelinePlan], budget: int
) -> PipelinePlan:
    """The first plan ``make_plan(rematerialize)`` makes whose every slot's predicted
    peak is within ``budget`` bytes: none rematerialised, then, round by round, also the
    forward stages of the slots still over, kept where the plan comes closer to the
    budget. Raises :class:`MemoryBudgetError` when slots are still over and each of
    their forward stages has been tried.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> loss_fn, params, batch = examples.mlp(num_layers=2, width=256, batch=64)
    >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2,
    ...     devices=jax.devices()[:1], schedule="interleaved", memory_budget=10_000)
    >>> pipe(params, batch)
    Traceback (most recent call last):
    ...
    pipemark.errors.MemoryBudgetError: ...
    """
    rematerialize: frozenset[str] = frozenset()
    tried: frozenset[str] = frozenset()
    plan = make_plan(rematerialize)
    slots = plan_memory(plan).slots
    while True:
        over = [s for s in slots if s.predicted_peak > budget]
        if not over:
            return plan
        more = _forward_stages_on(plan, {s.slot for s in over}) - tried
        if not more:
            raise MemoryBudgetError(_over_message(over, budget, rematerialize))
        tried |= more
        trial = make_plan(rematerialize | more)
        trial_slots = plan_memory(trial).slots
        # Kept only where it helps: recomputing a stage's forward in its backward can
        # need more temporaries than the residuals it saves.
        if _excess(trial_slots, budget) < _excess(slots, budget):
            plan, slots, rematerialize = trial, trial_slots, rematerialize | more


def _excess(slots: tuple[SlotMemory, ...], budget: int) -> int:
    return sum(max(0, s.predicted_peak - budget) for s in slots)


def _forward_stages_on(plan: PipelinePlan, slots: set[int]) -> frozenset[str]:
    """The names of the forward stages run on these slots (by index)."""
    stage_slots = plan.placement.stage_slots
    return frozenset(
        plan.staged.stages[index].name
        for k, index in enumerate(plan.forward_stages)
        if stage_slots[k] in slots and plan.backward_stages[k] is not None
    )


def _over_message(over: list[SlotMemory], budget: int, rematerialize: frozenset[str]) -> str:
    worst = max(over, key=lambda s: s.predicted_peak)
    parts = ", ".join(
        f"{name} {format_bytes(getattr(worst, name) or 0)}"
        for name in ("parameters", "batch", "accumulators", "in_flight", "temporaries")
    )
    done = (
        f"with the forward stages {', '.join(sorted(rematerialize))} rematerialised"
        if rematerialize
        else "and runs no forward stage to rematerialise"
    )
    return (
        f"Slot {worst.slot} ({worst.devices}) needs {format_bytes(worst.predicted_peak)}, "
        f"{format_bytes(worst.predicted_peak - budget)} over memory_budget={budget} "
        f"({format_bytes(budget)}) {done}: {parts}. Give the pipeline more devices or stages, "
        "more microbatches (fewer rows each), or a larger budget."
    )
