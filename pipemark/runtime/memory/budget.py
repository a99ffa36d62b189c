"""A pipeline within a memory budget: :func:`plan_within_budget`.

``pm.pipeline_value_and_grad(..., memory_budget=bytes)`` (and ``pipeline_train_step``)
asks that every device slot's predicted peak (:meth:`pipemark.Pipeline.memory`:
parameters, batch, accumulators, the values the schedule keeps in flight, the largest
program temporaries) stay within ``bytes``. The plan is made as the options ask first;
while a slot is over, the budget tries the changes that lower memory:

* **parameters gathered per microbatch**: with ``fsdp_gather=None`` and parameters
  sharded over the data axis (FSDP), each stage program gathers its parameters itself
  and reduce-scatters its gradients (``fsdp_gather="per_microbatch"``) instead of a
  copy gathered once per call and whole gradients per replica; tried before the others;
* **fewer microbatches in flight**: the schedule run in waves of fewer microbatches
  (``microbatches_in_flight``, :func:`pipemark.runtime.schedules.in_waves`), so that a
  device holds fewer microbatches' residuals at once;
* **rematerialisation**: the forward stages of the slots over recomputed by their
  backward stages from their inputs, as ``jax.checkpoint`` of the whole stage would
  (:func:`pipemark.passes.recompute_residuals` with ``rematerialize``);
* **other stage cuts**: in a program marked with more layers than stages, one marked
  layer moved off a stage of a slot over to its neighbour on another slot
  (``stage_layers``: the layer's parameters, residuals and temporaries move with it).

Each round, of the changes that bring the plan closer to the budget (the bytes over it,
summed over the slots), it keeps the one whose schedule is expected to take the least
time (simulated with unit action costs, a backward costing two, a rematerialised one
three, each times the stage's share of the layers), a change that fits before any that
does not; it plans (and compiles) the changes in the order of their expected time, up to
the first that fits. Waves on one device cost nothing, so they come first there; on
several devices each wave fills and drains the pipeline. A plan is compiled (for its
programs' temporaries) only once the rest of its peak fits. When no change comes
closer, :class:`~pipemark.MemoryBudgetError` says which slot is over, by how much,
and what its peak is made of, before running anything, and before compiling anything
where the rest is over already.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from pipemark.errors import MemoryBudgetError, PipemarkError
from pipemark.runtime.devices.agreement import from_every_process
from pipemark.runtime.devices.placement import Slot
from pipemark.runtime.devices.sharding import gathered_spec
from pipemark.runtime.memory.estimate import SlotMemory, estimate_memory, format_bytes, plan_memory
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.schedules.core import Schedule
from pipemark.runtime.schedules.registry import build_schedule
from pipemark.runtime.schedules.simulation import simulate_schedule

__all__ = ["check_update_within", "plan_within_budget"]

#: ``make_plan(options, rematerialize)``: the plan for these options, with the forward
#: stages named in ``rematerialize`` recomputed whole by their backward stages.
PlanMaker = Callable[[PipelineOptions, frozenset], PipelinePlan]


@dataclasses.dataclass(frozen=True)
class _Trial:
    """A plan the budget made, with what it is judged by."""

    options: PipelineOptions
    rematerialize: frozenset[str]
    plan: PipelinePlan
    slots: tuple[SlotMemory, ...]
    excess: int  # bytes over the budget, summed over the slots
    time: float  # the schedule's makespan at unit costs

    def over(self, budget: int) -> list[SlotMemory]:
        return [s for s in self.slots if s.predicted_peak > budget]


#: ``arguments(plan)``: per slot of ``plan``, the bytes of the caller's arrays there
#: that the plan does not count (:func:`pipemark.runtime.memory.argument_bytes`).
Arguments = Callable[[PipelinePlan], Sequence[int]]


def plan_within_budget(
    make_plan: PlanMaker, options: PipelineOptions, arguments: Arguments | None = None
) -> PipelinePlan:
    """The plan ``make_plan`` makes for ``options``, changed round by round (fewer
    microbatches in flight, forward stages rematerialised, marked layers moved
    between stages) until
    every slot's predicted peak (with the caller's ``arguments`` where given: the arrays
    it passes lie on the devices too) is within ``options.memory_budget`` bytes. Raises
    :class:`MemoryBudgetError` when no change brings it closer.

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
    budget = options.memory_budget
    if budget is None:
        raise PipemarkError(
            "plan_within_budget needs options.memory_budget (bytes per device); these "
            "options have none. Plan them with make_plan(options, frozenset()) instead."
        )
    trial = _try(make_plan, options, frozenset(), budget, arguments)
    while trial.excess:  # each round brings it closer: at most as many as bytes over
        trial = _next_trial(make_plan, trial, budget, arguments)
    return trial.plan


def _next_trial(
    make_plan: PlanMaker, trial: _Trial, budget: int, arguments: Arguments | None
) -> _Trial:
    """Of the plans one change away from ``trial`` that come closer to the budget, one
    that fits, else the one expected to take least time. The changes are planned (and
    compiled) in the order of their expected time, up to the first that fits: any later
    one would take longer."""
    changes = sorted(_changes(trial, budget), key=lambda change: change.time)
    best = None
    for change in changes:
        tried = _try(make_plan, change.options, change.rematerialize, budget, arguments)
        if tried.excess < trial.excess and (
            best is None or (tried.excess > 0, tried.time) < (best.excess > 0, best.time)
        ):
            best = tried
        if not tried.excess:
            break
    if best is None:
        raise MemoryBudgetError(_over_message(trial, budget))
    return best


def check_update_within(
    updates: Mapping[int, int],
    slots: Sequence[Slot],
    budget: int,
    *,
    distributed: bool = False,
    timeout_s: float | None = None,
) -> None:
    """A :class:`MemoryBudgetError` where a training step's update needs more than
    ``budget`` bytes on a slot (``updates``: per slot index, what its part holds, as
    ``SlotMemory.update`` counts it: the parameters, gradients and optimizer state it
    reads, its results and temporaries): none of the budget's changes to the pipeline
    lowers it. ``distributed``: ``updates`` are this process's slots' (under
    ``jax.distributed``); each slot is judged by the most any process saw there, so
    that every process refuses, or none.

    >>> import jax
    >>> from pipemark.runtime.devices.placement import device_slot
    >>> check_update_within({0: 64}, [device_slot(jax.devices()[0])], budget=32)
    Traceback (most recent call last):
    ...
    pipemark.errors.MemoryBudgetError: The training step's update needs 64 B on slot 0 ...
    """
    if distributed:
        seen = from_every_process("its update's memory", sorted(updates.items()), timeout_s)
        most: dict[int, int] = {}
        for worker, update in (pair for view in seen for pair in view):
            most[worker] = max(most.get(worker, 0), update)
        updates = most
    for worker, update in sorted(updates.items()):
        if update > budget:
            raise MemoryBudgetError(
                f"The training step's update needs {format_bytes(update)} on slot "
                f"{worker} ({slots[worker]}), {format_bytes(update - budget)} over "
                f"memory_budget={budget} ({format_bytes(budget)}): the parameters, "
                "gradients and optimizer state it reads, its results and temporaries, "
                "which fewer microbatches in flight or rematerialisation do not lower. "
                "Give the pipeline more stages or devices (each updates its own "
                "parameters), or a larger budget."
            )


def _try(
    make_plan: PlanMaker,
    options: PipelineOptions,
    remat: frozenset[str],
    budget: int,
    arguments: Arguments | None = None,
) -> _Trial:
    plan = make_plan(options, remat)
    given = arguments(plan) if arguments else None
    # Without the temporaries first, which need the programs compiled: a plan over the
    # budget already is refused (or changed) before anything compiles, and a program
    # too large for the device never reaches its compiler.
    slots = _agreed(plan, estimate_memory(plan, None, given).slots, options.timeout_s)
    if all(s.predicted_peak <= budget for s in slots):
        slots = _agreed(plan, plan_memory(plan, given).slots, options.timeout_s)
    excess = sum(max(0, s.predicted_peak - budget) for s in slots)
    time = _unit_time(plan.schedule, _forward_names(plan), plan.stage_layers, remat)
    return _Trial(options, remat, plan, slots, excess, time)


def _agreed(
    plan: PipelinePlan, slots: tuple[SlotMemory, ...], timeout_s: float | None
) -> tuple[SlotMemory, ...]:
    """``slots`` as every process will judge them: under ``jax.distributed`` each
    process sees the caller's arrays on its own devices alone (and compiles its own
    slots' programs), so each slot's estimate is the one of the process that predicts
    the most there (the first such). Every process then makes the same changes, and
    refuses the same plan with the same message."""
    if not plan.placement.distributed:
        return slots
    views = [dataclasses.asdict(s) for s in slots]
    seen = from_every_process("its memory estimate", views, timeout_s)
    return tuple(
        SlotMemory(**max((view[k] for view in seen), key=lambda s: s["predicted_peak"]))
        for k in range(len(slots))
    )


class _Change(NamedTuple):
    """A change to a trial's plan, not planned yet: its options, the forward stages it
    rematerialises, and the time its schedule is expected to take."""

    options: PipelineOptions
    rematerialize: frozenset[str]
    time: float


def _changes(trial: _Trial, budget: int) -> Iterator[_Change]:
    """The changes one step away from ``trial``: the next fewer microbatches in
    flight, the forward stages of the slots over rematerialised, and each move of a
    marked layer off a stage of a slot over."""
    plan, remat, names = trial.plan, trial.rematerialize, _forward_names(trial.plan)
    if trial.options.fsdp_gather is None and _gathers_once(plan) and not plan.placement.spanning:
        # (Not on a stage that spans processes: its stage programs run one at a time
        # there, PipelinePlan.ordered, which the unit costs do not count.)
        # Parameters sharded over the data axis gathered in each program instead of
        # once per call: no whole copy held, the gradients accumulated in shards. The
        # schedule is the same (its collectives are not in the unit costs): tried first.
        options = dataclasses.replace(trial.options, fsdp_gather="per_microbatch")
        yield _Change(options, remat, trial.time)
    fewer = _fewer_in_flight(trial)
    if fewer is not None:
        options, schedule = fewer
        yield _Change(options, remat, _unit_time(schedule, names, plan.stage_layers, remat))
    over = {s.slot for s in trial.over(budget)}
    more = _forward_stages_on(plan, over) - remat
    if more:
        time = _unit_time(plan.schedule, names, plan.stage_layers, remat | more)
        yield _Change(trial.options, remat | more, time)
    for moved in _layer_moves(plan, over):
        options = dataclasses.replace(trial.options, stage_layers=moved)
        yield _Change(options, remat, _unit_time(plan.schedule, names, moved, remat))


def _shards_over_data(plan: PipelinePlan) -> bool:
    """Whether ``plan`` has parameters sharded over a data axis longer than 1 (FSDP)."""
    slot = plan.placement.slots[0]
    if plan.param_specs is None or slot.mesh is None:
        return False
    if slot.mesh.shape.get(plan.data_axis, 1) == 1:
        return False
    return any(gathered_spec(spec, plan.data_axis) != spec for spec in plan.param_specs)


def _gathers_once(plan: PipelinePlan) -> bool:
    """Whether ``plan`` gathers parameters sharded over the data axis once per call."""
    return plan.fsdp_gather == "once" and _shards_over_data(plan)


def _layer_moves(plan: PipelinePlan, over: set[int]) -> Iterator[tuple[int, ...]]:
    """``plan``'s layers per stage with one marked layer moved off a stage on a slot in
    ``over`` to a neighbouring stage on a slot that is not (the stage before gets its
    first layer, the stage after its last); none where the stages are not merged from
    marked layers."""
    layers, slots = plan.stage_layers, plan.placement.stage_slots
    if layers is None:
        return
    for k, count in enumerate(layers):
        if slots[k] not in over or count < 2:
            continue
        for j in (k - 1, k + 1):
            if 0 <= j < len(layers) and slots[j] not in over:
                moved = list(layers)
                moved[k], moved[j] = count - 1, layers[j] + 1
                yield tuple(moved)


def _fewer_in_flight(trial: _Trial) -> tuple[PipelineOptions, Schedule] | None:
    """``trial``'s options with the largest ``microbatches_in_flight`` below what its
    schedule holds at once that the schedule can be built for, and that schedule;
    ``None`` when there is none (a schedule given made, or one microbatch in flight
    already)."""
    options, plan = trial.options, trial.plan
    if isinstance(options.schedule, Schedule):
        return None
    held = max(plan.schedule.in_flight())
    for wave in range(held - 1, 0, -1):
        problem = dataclasses.replace(plan.problem, microbatches_in_flight=wave)
        try:
            schedule = build_schedule(options.schedule, problem)
        except PipemarkError:
            continue  # e.g. an interleaved schedule's waves must fill every device
        if max(schedule.in_flight()) < held:
            return dataclasses.replace(options, microbatches_in_flight=wave), schedule
    return None


def _unit_time(
    schedule: Schedule,
    names: list[str],
    layers: tuple[int, ...] | None,
    remat: frozenset[str],
) -> float:
    """The schedule's makespan when a forward costs 1 and a backward 2 (3 where it
    recomputes its forward: its stage's name is in ``remat``), each times the stage's
    share of the marked ``layers`` (1 on average): what the budget weighs its changes
    by."""
    layers = layers or (1,) * len(names)
    share = [n * len(layers) / sum(layers) for n in layers]
    backward = [(3.0 if name in remat else 2.0) * f for name, f in zip(names, share)]
    weight = [f if schedule.splits_backward else 0.0 for f in share]
    costs = {
        "forward": tuple(share),
        "backward": tuple(b - w for b, w in zip(backward, weight)),
        "weight": tuple(weight),
    }
    return simulate_schedule(schedule, costs).makespan


def _forward_names(plan: PipelinePlan) -> list[str]:
    return [plan.staged.stages[i].name for i in plan.forward_stages]


def _forward_stages_on(plan: PipelinePlan, slots: set[int]) -> frozenset[str]:
    """The names of the forward stages run on these slots (by index)."""
    stage_slots = plan.placement.stage_slots
    return frozenset(
        plan.staged.stages[index].name
        for k, index in enumerate(plan.forward_stages)
        if stage_slots[k] in slots and plan.backward_stages[k] is not None
    )


#: What a slot's predicted peak is made of, as the refusal lists it.
_PARTS = ("parameters", "batch", "accumulators", "arguments", "in_flight", "temporaries")


def _over_message(trial: _Trial, budget: int) -> str:
    worst = max(trial.over(budget), key=lambda s: s.predicted_peak)
    parts = ", ".join(f"{name} {format_bytes(getattr(worst, name))}" for name in _PARTS)
    if worst.temporaries is None:
        parts += " (not compiled: the rest is over already)"
    done = []
    if trial.rematerialize:
        done.append(f"the forward stages {', '.join(sorted(trial.rematerialize))} rematerialised")
    if trial.plan.fsdp_gather == "per_microbatch" and _shards_over_data(trial.plan):
        done.append("the FSDP parameters gathered per microbatch")
    held = max(trial.plan.schedule.in_flight())
    done.append(f"{held} microbatch{'es' if held > 1 else ''} in flight at most")
    if trial.plan.stage_layers is not None:
        done.append(f"stage_layers={trial.plan.stage_layers}")
    # Unbounded, a slot is counted as holding what every one of its actions makes
    # (the host may dispatch them all before the device runs one): a bound lowers it.
    bound = (
        "a dispatch bound (dispatch_ahead=2: with None every action of a slot counts as "
        "dispatched and not yet run), "
        if trial.plan.dispatch_ahead is None
        else ""
    )
    return (
        f"Slot {worst.slot} ({worst.devices}) needs "
        f"{'at least ' if worst.temporaries is None else ''}{format_bytes(worst.predicted_peak)}, "
        f"{format_bytes(worst.predicted_peak - budget)} over memory_budget={budget} "
        f"({format_bytes(budget)}) with {' and '.join(done)}: {parts}. Give the pipeline "
        f"{bound}more devices or stages, more microbatches (fewer rows each), or a larger "
        "budget."
    )


def within_budget(
    make_plan: PlanMaker, options: PipelineOptions, arguments: Arguments | None = None
) -> PipelinePlan:
    """``make_plan(options, frozenset())``, or with a ``memory_budget``, the plan
    within it (:func:`pipemark.runtime.memory.budget.plan_within_budget`)."""
    if options.memory_budget is None:
        return make_plan(options, frozenset())
    return plan_within_budget(make_plan, options, arguments)
