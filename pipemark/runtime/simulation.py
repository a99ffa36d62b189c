"""Compare pipeline schedules before running them: :func:`simulate_schedule` gives the makespan
and bubble fraction of any :class:`~pipemark.runtime.schedules.Schedule` for given
per-action costs, and :func:`zero_bubble_schedule` builds the zero-bubble schedules
(ZB-H1, ZB-V) that a backward split in two (:func:`pipemark.passes.split_backward`)
makes possible.

Costs are per kind of action: ``forward`` (F), ``backward`` (B: the activation
cotangents) and ``weight`` (W: the parameter gradients), each a number or one number per
stage. In a schedule that does not split its backward, a backward action costs B + W.

>>> from pipemark.runtime.schedules import one_f_one_b_schedule
>>> costs = {"forward": 1.0, "backward": 1.0, "weight": 1.0}
>>> round(simulate_schedule(one_f_one_b_schedule(4, 8), costs).bubble_fraction, 3)
0.273
>>> round(simulate_schedule(zero_bubble_schedule(4, 8, costs=costs), costs).bubble_fraction, 3)
0.111
>>> simulate_schedule(one_f_one_b_schedule(4, 8), costs).bubble  # idle time per device
9.0
>>> simulate_schedule(zero_bubble_schedule(4, 8, costs=costs), costs).bubble  # a third of it
3.0

``bound`` is the least makespan that any order of the same actions on the same devices
could reach (from the dependencies alone), so a schedule whose makespan equals it is
optimal on paper. 1F1B reaches its own bound; splitting the backward lowers the bound
itself, and the zero-bubble schedules reach the lower one:

>>> one = simulate_schedule(one_f_one_b_schedule(4, 8), costs)
>>> zb = simulate_schedule(zero_bubble_schedule(4, 8, costs=costs), costs)
>>> one.makespan, one.bound, zb.makespan, zb.bound
(33.0, 33.0, 27.0, 27.0)
>>> zbv = simulate_schedule(zero_bubble_schedule(8, 8, variant="zb-v", costs=costs), costs)
>>> zbv.makespan, zbv.bound  # 6 M + D - 1: device D - 1 can start no sooner than D - 1
(51.0, 51.0)
"""

from __future__ import annotations

import graphlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.runtime.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    dependencies,
    normalize_stage_graph,
    schedule_from_orders,
    stage_successors,
)

__all__ = ["Simulation", "simulate_schedule", "zero_bubble_schedule"]

# The variants zero_bubble_schedule builds; the names a pipeline takes live in
# pipemark.runtime.registry.
_VARIANTS: tuple[str, ...] = ("zb-h1", "zb-v")

Costs = Mapping[str, float | Sequence[float]] | Callable[[Action], float] | None
Latency = float | Callable[[Action, Action], float]


class Simulation(NamedTuple):
    """What :func:`simulate_schedule` found: when each action starts and ends (in cost units),
    the makespan, the busy time per device, the idle fraction of devices × makespan,
    the idle time per device (the *bubble*, in cost units, averaged over devices), and
    ``bound``: no order of the same actions on the same devices has a shorter makespan
    (the longer of the critical path and, per device, its busy time plus the least time
    before its first action can start and after its last one must end)."""

    start: dict[Action, float]
    finish: dict[Action, float]
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble: float
    bound: float


def _cost_function(costs: Costs, split: bool, num_stages: int) -> Callable[[Action], float]:
    """``costs`` as a function of an action (an unsplit backward costs B + W)."""
    if callable(costs):
        return costs
    if costs is not None and not isinstance(costs, Mapping):
        raise PipemarkError(
            f"costs is {type(costs).__name__}; give a dict {{'forward': F, 'backward': B, "
            "'weight': W} (numbers, or one per stage) or a function of an Action."
        )
    table = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0, **(costs or {})}
    for kind, value in table.items():
        values = value if isinstance(value, Sequence) else [value]
        if kind not in (FORWARD, BACKWARD, WEIGHT) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)
            for v in values
        ):
            raise PipemarkError(
                f"costs[{kind!r}] = {value!r}: give 'forward', 'backward' and 'weight' "
                "each a non-negative number, or one per stage."
            )
        if isinstance(value, Sequence) and len(value) != num_stages:
            raise PipemarkError(
                f"costs[{kind!r}] has {len(value)} entries but the schedule has "
                f"{num_stages} stages; give one per stage, or one number for all."
            )

    def of(kind: str, stage: int) -> float:
        value = table[kind]
        return float(value[stage] if isinstance(value, Sequence) else value)

    def cost(action: Action) -> float:
        own = of(action.kind, action.stage)
        if action.kind == BACKWARD and not split:
            own += of(WEIGHT, action.stage)
        return own

    return cost


def _delay_function(
    transfer: Latency, stage_devices: Sequence[int]
) -> Callable[[Action, Action], float]:
    """``transfer`` as the delay from a producing action to a reading one: 0 on one
    device."""
    seconds = 0.0
    if not callable(transfer):
        if isinstance(transfer, bool) or not isinstance(transfer, (int, float)):
            raise PipemarkError(
                f"transfer is {type(transfer).__name__}; give a number (the latency of a "
                "transfer between devices, in the costs' unit) or a function of "
                "(producer, reader) actions."
            )
        if not (transfer >= 0 and math.isfinite(transfer)):
            raise PipemarkError(f"transfer = {transfer!r}: give a non-negative, finite number.")
        seconds = float(transfer)

    def delay(producer: Action, reader: Action) -> float:
        if stage_devices[producer.stage] == stage_devices[reader.stage]:
            return 0.0
        return transfer(producer, reader) if callable(transfer) else seconds

    return delay


def simulate_schedule(
    schedule: Schedule, costs: Costs = None, *, transfer: Latency = 0.0
) -> Simulation:
    """Run ``schedule`` on paper: each device runs its actions in the schedule's order,
    each as soon as the device is free and everything it needs has finished (and, for
    what another device computed, has arrived).

    Parameters
    ----------
    schedule:
        Any schedule (GPipe, 1F1B, interleaved, zero-bubble, your own).
    costs:
        ``{"forward": F, "backward": B, "weight": W}`` (numbers, or one per stage;
        1 by default), or a function of an :class:`Action`. A schedule that does not
        split its backward pays B + W per backward action.
    transfer:
        How long a value takes to reach another device (the latency of a transfer
        between stages, in the costs' unit; 0 by default): a number, or a function of
        ``(producer, reader)`` actions. Values read on their own device arrive at once.
        With it, the simulation shows how much of a schedule's time is spent waiting
        for transfers on its critical path (:mod:`pipemark.runtime.simulation`).
    """
    cost = _cost_function(costs, schedule.splits_backward, len(schedule.stage_devices))
    preds = schedule.predecessors
    succ = schedule.successors
    orders = schedule.device_orders()
    needs = {a: dependencies(a, preds, succ) for order in orders for a in order}
    delay = _delay_function(transfer, schedule.stage_devices)
    position = [0] * len(orders)
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d, order in enumerate(orders):
            while position[d] < len(order):
                action = order[position[d]]
                if any(n not in finish for n in needs[action]):
                    break
                begin = max([free[d], *(finish[n] + delay(n, action) for n in needs[action])])
                length = cost(action)
                start[action], finish[action] = begin, begin + length
                free[d] = begin + length
                busy[d] += length
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a valid schedule never deadlocks
            raise StageGraphError("The schedule's device orders deadlock.")
    makespan = max(finish.values(), default=0.0)
    idle = 1.0 - sum(busy) / (len(orders) * makespan) if makespan else 0.0
    bubble = makespan - sum(busy) / len(orders)
    bound = _makespan_bound(orders, cost, needs, delay)
    return Simulation(start, finish, makespan, tuple(busy), idle, bubble, bound)


def _makespan_bound(orders, cost, needs, delay) -> float:
    """The least makespan of any order of these actions on these devices (``needs``:
    what each action needs first; ``delay``: how long a value takes from one action to
    another): the longest chain of dependencies, and per device the earliest any of its
    actions can start, plus its work, plus the least any of its actions leaves to run
    after it."""
    readers: dict[Action, list[Action]] = {a: [] for a in needs}
    for a, ns in needs.items():
        for n in ns:
            readers[n].append(a)
    ranked = list(graphlib.TopologicalSorter(needs).static_order())
    head: dict[Action, float] = {}
    for a in ranked:  # the earliest each action can start
        head[a] = max((head[n] + cost(n) + delay(n, a) for n in needs[a]), default=0.0)
    tail: dict[Action, float] = {}
    for a in reversed(ranked):  # the least that must run after each action ends
        tail[a] = max((delay(a, r) + cost(r) + tail[r] for r in readers[a]), default=0.0)
    chain = max((head[a] + cost(a) + tail[a] for a in needs), default=0.0)
    per_device = (
        min(head[a] for a in order) + sum(map(cost, order)) + min(tail[a] for a in order)
        for order in orders
        if order
    )
    return max([chain, *per_device])


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

    The order is found by running the pipeline on paper (:func:`simulate_schedule`'s model)
    with ``costs`` (1 each by default): whenever a device is free it runs a ready B,
    else a ready F (within the in-flight limit), else a pending W.
    """
    if variant not in _VARIANTS:
        raise PipemarkError(
            f"Unknown zero-bubble variant {variant!r}; choose one of "
            f"{', '.join(map(repr, _VARIANTS))}."
        )
    for value, what in ((num_stages, "num_stages"), (num_microbatches, "num_microbatches")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipemarkError(f"{what} must be a positive int, got {value!r}.")
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
    preds = normalize_stage_graph(stage_graph, num_stages)
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
    cost = _cost_function(costs, True, len(devices))
    orders = _greedy_orders(devices, preds, num_microbatches, cost, (limit, owed))
    return schedule_from_orders(
        orders,
        stage_devices=devices,
        num_microbatches=num_microbatches,
        stage_graph=dict(enumerate(preds)),
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
