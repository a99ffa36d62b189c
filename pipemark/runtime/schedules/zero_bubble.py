"""Zero-bubble schedules (ZB-H1, ZB-V): the backward split in two
(:func:`pipemark.passes.split_backward`: B, the activation cotangents, and W, the
parameter gradients), and each W run where a device would otherwise idle.
:func:`zero_bubble_schedule` builds one for given sizes and costs;
:func:`build_zero_bubble` for a :class:`~pipemark.runtime.ScheduleProblem`, with its
times (what ``schedule="zb-h1"`` and ``"zb-v"`` run).

>>> from pipemark.runtime.schedules.simulation import simulate_schedule
>>> costs = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
>>> zb = simulate_schedule(zero_bubble_schedule(4, 8, costs=costs), costs)
>>> zb.makespan, zb.bound, round(zb.bubble_fraction, 3)
(27.0, 27.0, 0.111)
>>> slow_last = ScheduleProblem(4, 8, forward_time=(1.0, 1.0, 1.0, 3.0))
>>> tuned = build_zero_bubble(slow_last)
>>> simulate_schedule(tuned, slow_last.costs).makespan
43.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.runtime.schedules.core import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    dependencies,
    schedule_from_orders,
    stage_successors,
)
from pipemark.runtime.schedules.problem import Costs, ScheduleProblem, cost_function

__all__ = ["ZERO_BUBBLE_KINDS", "build_zero_bubble", "zero_bubble_schedule"]

#: The variants these builders make; the names a pipeline takes live in
#: :mod:`pipemark.runtime.schedules.registry`.
ZERO_BUBBLE_KINDS: tuple[str, ...] = ("zb-h1", "zb-v")


def zero_bubble_schedule(
    num_stages: int,
    num_microbatches: int,
    *,
    variant: str = "zb-h1",
    costs: Costs = None,
    stage_graph: Any = None,
) -> Schedule:
    """A zero-bubble schedule: the backward split into B and W, each W run where the
    device would otherwise idle.

    ``"zb-h1"``: one stage per device (``num_stages`` devices); 1F1B's order with W
    deferred until the device has nothing else ready, no more microbatches in flight
    per device (forward run, backward not) than 1F1B, so 1F1B's activation memory, and
    at most about ``num_stages`` deferred W per device (each holds its layer's input
    and cotangent).
    ``"zb-v"``: ``num_stages`` must be even; two stages per device in a V (device ``d``
    holds stages ``d`` and ``num_stages - 1 - d``), so that the first and last stages,
    which bound the pipeline's fill and drain, share a device.

    The order is found by running the pipeline on paper
    (:func:`~pipemark.runtime.simulate_schedule`'s model) with ``costs`` (1 each by
    default; a table or a function of an :class:`~pipemark.runtime.Action`): whenever
    a device is free it runs a ready B, else a ready F (within the in-flight limit),
    else a pending W.

    >>> zero_bubble_schedule(8, 8, variant="zb-v").stage_devices
    (0, 1, 2, 3, 3, 2, 1, 0)
    """
    _check_variant(variant)
    problem = ScheduleProblem(
        num_stages, num_microbatches, stage_graph=stage_graph, splits_backward=True
    )
    return _zero_bubble(problem, variant, cost_function(costs, True, num_stages))


def build_zero_bubble(problem: ScheduleProblem, variant: str = "zb-h1") -> Schedule:
    """The zero-bubble schedule ``variant`` for ``problem``, ordered with its forward,
    backward and weight times (:func:`zero_bubble_schedule` says how): the builder of
    the registered ``"zb-h1"`` and ``"zb-v"``.

    >>> build_zero_bubble(ScheduleProblem(2, 4), "zb-v").num_devices
    1
    """
    _check_variant(variant)
    return _zero_bubble(problem, variant, cost_function(problem.costs, True, problem.num_stages))


def _check_variant(variant: str) -> None:
    if variant not in ZERO_BUBBLE_KINDS:
        raise PipemarkError(
            f"Unknown zero-bubble variant {variant!r}; choose one of "
            f"{', '.join(map(repr, ZERO_BUBBLE_KINDS))}."
        )


def _zero_bubble(
    problem: ScheduleProblem, variant: str, cost: Callable[[Action], float]
) -> Schedule:
    num_stages = problem.num_stages
    if variant == "zb-v":
        if num_stages % 2:
            raise PipemarkError(
                f"zb-v puts two stages on each device in a V, so num_stages must be even, "
                f"got {num_stages}."
            )
        half = num_stages // 2
        devices = tuple(j if j < half else num_stages - 1 - j for j in range(num_stages))
    else:
        devices = tuple(range(num_stages))
    # In flight per device (forwards whose backward has not run): 1F1B's count for
    # ZB-H1, so 1F1B's activation memory; for the V, twice the device count (a device
    # holds two stages). Deferred W actions (each holding only its input and cotangent)
    # are capped too: past the cap a W runs before the next forward. With equal costs
    # these caps reach the makespan bound (Simulation.bound) for every M >= 2 x devices
    # tried (tests/runtime/test_simulation.py); a V owed only 2 x devices W missed it
    # by one unit at 8 devices, 32 microbatches.
    count = max(devices) + 1
    zb_h1 = variant == "zb-h1"
    limit = [count - d for d in range(count)] if zb_h1 else [2 * count] * count
    owed = [count if zb_h1 else 3 * count] * count
    preds = problem.predecessors
    orders = _greedy_orders(devices, preds, problem.num_microbatches, cost, (limit, owed))
    return schedule_from_orders(
        orders,
        stage_devices=devices,
        num_microbatches=problem.num_microbatches,
        stage_graph=problem.stage_graph,
        name=variant,
    )


def _greedy_orders(
    devices: tuple[int, ...],
    preds: Sequence[Sequence[int]],
    num_micro: int,
    cost: Callable[[Action], float],
    caps: tuple[list[int], list[int]],
) -> list[list[Action]]:
    """Each device's order, from list scheduling on paper (see
    :func:`zero_bubble_schedule`). Long: one event loop; its pick is
    :func:`_pick`."""
    num_devices = max(devices) + 1
    succ = stage_successors(preds)
    pending = [
        {Action(j, m, k) for j in range(len(devices)) if devices[j] == d for m in range(num_micro)
         for k in (FORWARD, BACKWARD, WEIGHT)}
        for d in range(num_devices)
    ]  # fmt: skip
    limit, w_cap = caps
    in_flight = [0] * num_devices  # forwards whose backward has not run
    owed = [0] * num_devices  # backwards whose weight action has not run
    stuck = False  # nothing could run: let forwards past the limit rather than deadlock
    finish: dict[Action, float] = {}
    free = [0.0] * num_devices
    orders: list[list[Action]] = [[] for _ in range(num_devices)]
    time = 0.0
    while any(pending):
        ran = False
        for d in range(num_devices):
            if free[d] > time or not pending[d]:
                continue
            may_start = stuck or in_flight[d] < limit[d]
            w_first = owed[d] > w_cap[d]
            action = _pick(pending[d], finish, time, preds, succ, may_start, w_first)
            if action is None:
                continue
            ran = True
            pending[d].discard(action)
            finish[action] = free[d] = time + cost(action)
            orders[d].append(action)
            in_flight[d] += {FORWARD: 1, BACKWARD: -1}.get(action.kind, 0)
            owed[d] += {BACKWARD: 1, WEIGHT: -1}.get(action.kind, 0)
        if ran:  # look again at the same time: an action of cost 0 may have freed more
            stuck = False
            continue
        later = [t for t in (*free, *finish.values()) if t > time]
        if later:
            time, stuck = min(later), False
        elif stuck:
            raise StageGraphError("zero_bubble_schedule: no action can run (a bug).")
        else:
            stuck = True
    return orders


def _pick(pending, finish, time, preds, succ, may_start, w_first) -> Action | None:
    """The action a free device runs now: a ready B, else a ready F (when it may start
    another microbatch), else a pending W whose B is done (before the F when
    ``w_first``: too many W are owed); the earliest microbatch first, and among a
    device's stages the one nearer the loss for B."""
    ready = [
        a
        for a in pending
        if all(finish.get(n, math.inf) <= time for n in dependencies(a, preds, succ))
    ]
    kinds = [
        (BACKWARD, lambda a: (a.microbatch, -a.stage)),
        (FORWARD, lambda a: (a.microbatch, a.stage)),
        (WEIGHT, lambda a: (a.microbatch, -a.stage)),
    ]
    if w_first:
        kinds = [kinds[0], kinds[2], kinds[1]]
    for kind, order in kinds:
        if kind == FORWARD and not may_start:
            continue
        chosen = [a for a in ready if a.kind == kind]
        if chosen:
            return min(chosen, key=order)
    return None
