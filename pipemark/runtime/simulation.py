"""Compare pipeline schedules before running them: :func:`simulate_schedule` gives the
makespan and bubble fraction of any :class:`~pipemark.runtime.schedules.Schedule` for
given per-action costs (:data:`~pipemark.runtime.problem.Costs`: ``forward``,
``backward``, ``weight``, each a number or one per stage; in a schedule that does not
split its backward, a backward action costs B + W).

>>> from pipemark.runtime.schedules import one_f_one_b_schedule
>>> from pipemark.runtime.zero_bubble import zero_bubble_schedule
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
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.runtime.problem import Costs, cost_function
from pipemark.runtime.schedules import BACKWARD, WEIGHT, Action, Schedule, dependencies

__all__ = ["Simulation", "simulate_schedule"]

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
    what another device computed, has arrived). An overlapped pair
    (:attr:`~pipemark.runtime.Schedule.overlapped`) runs as one unit: it starts once
    what both read has arrived, takes the sum of their costs, and both results are out
    when it ends.

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
    cost = _schedule_cost(schedule, costs)
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
    pairs = dict(schedule.overlapped)  # first -> second: one unit, one program
    while remaining:
        progressed = False
        for d, order in enumerate(orders):
            while position[d] < len(order):
                unit = (order[position[d]],)
                unit += (pairs[unit[0]],) if unit[0] in pairs else ()
                reads = [(n, a) for a in unit for n in needs[a] if n not in unit]
                if any(n not in finish for n, _ in reads):
                    break
                # A unit starts once everything its actions read has arrived, and its
                # results leave together when it ends (an overlapped pair is one program).
                begin = max([free[d], *(finish[n] + delay(n, a) for n, a in reads)])
                length = sum(map(cost, unit))
                offset = begin
                for action in unit:
                    start[action], finish[action] = offset, begin + length
                    offset += cost(action)
                free[d] = begin + length
                busy[d] += length
                position[d] += len(unit)
                remaining -= len(unit)
                progressed = True
        if not progressed:  # a valid schedule never deadlocks
            raise StageGraphError("The schedule's device orders deadlock.")
    makespan = max(finish.values(), default=0.0)
    idle = 1.0 - sum(busy) / (len(orders) * makespan) if makespan else 0.0
    bubble = makespan - sum(busy) / len(orders)
    bound = _makespan_bound(orders, cost, needs, delay)
    return Simulation(start, finish, makespan, tuple(busy), idle, bubble, bound)


def _schedule_cost(schedule: Schedule, costs: Costs) -> Callable[[Action], float]:
    """Each action's cost in ``schedule``: a backward pays B + W where it is whole (the
    schedule splits none, or not this stage and microbatch's)."""
    cost = cost_function(costs, schedule.splits_backward, len(schedule.stage_devices))
    whole = schedule.whole_backwards
    if not whole:
        return cost

    def mixed(action: Action) -> float:
        if action.kind == BACKWARD and (action.stage, action.microbatch) in whole:
            return cost(action) + cost(action._replace(kind=WEIGHT))
        return cost(action)

    return mixed


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
