"""Compare pipeline schedules before running them: :func:`simulate_schedule` gives the
makespan and bubble fraction of any :class:`~pipemark.runtime.schedules.Schedule` for
given per-action costs (:data:`~pipemark.runtime.schedules.problem.Costs`: ``forward``,
``backward``, ``weight``, each a number or one per stage; in a schedule that does not
split its backward, a backward action costs B + W).

>>> from pipemark.runtime.schedules.core import one_f_one_b_schedule
>>> from pipemark.runtime.schedules.zero_bubble import zero_bubble_schedule
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
from pipemark.runtime.schedules.core import BACKWARD, WEIGHT, Action, Schedule, dependencies
from pipemark.runtime.schedules.problem import Costs, cost_function

__all__ = ["Simulation", "simulate_schedule"]

Latency = float | Callable[[Action, Action], float]


class Simulation(NamedTuple):
    """What :func:`simulate_schedule` found: when each action starts and ends (in cost units),
    the makespan, the busy time per device, the idle fraction of devices × makespan,
    the idle time per device (the *bubble*, in cost units, averaged over devices), and
    ``bound``: no order of the same actions on the same devices has a shorter makespan
    (the longer of the critical path and, per device, its busy time plus the least time
    before its first action can start and after its last one must end; the host's
    dispatching left out). With a host that dispatches (``dispatch``), ``dispatched``:
    when the host has dispatched each action, and ``host_wait``: per device, the time
    it idled with everything its next action reads there, waiting for the host to
    dispatch it."""

    start: dict[Action, float]
    finish: dict[Action, float]
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble: float
    bound: float
    dispatched: dict[Action, float]
    host_wait: tuple[float, ...]


def _delay_function(
    transfer: Latency, stage_devices: Sequence[int]
) -> Callable[[Action, Action], float]:
    """``transfer`` as the delay from a producing action to a reading one: 0 on one
    device."""
    seconds = 0.0
    if not callable(transfer):
        seconds = _non_negative("transfer", transfer, "the latency of a transfer between devices")

    def delay(producer: Action, reader: Action) -> float:
        if stage_devices[producer.stage] == stage_devices[reader.stage]:
            return 0.0
        return transfer(producer, reader) if callable(transfer) else seconds

    return delay


def _non_negative(name: str, value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PipemarkError(
            f"{name} is {type(value).__name__}; give a number ({what}, in the costs' unit)"
            + (" or a function of (producer, reader) actions." if name == "transfer" else ".")
        )
    if not (value >= 0 and math.isfinite(value)):
        raise PipemarkError(f"{name} = {value!r}: give a non-negative, finite number.")
    return float(value)


class _Host:
    """The host's dispatching of each device's programs (:func:`simulate_schedule`):
    one dispatcher a device, as the runtime's worker a device slot, taking ``cost`` a
    program; with ``ahead`` (``dispatch_ahead``), after dispatching a device's program
    ``j`` it waits until program ``j - ahead`` has run, and resumes ``wake`` after."""

    def __init__(self, devices: int, cost: float, ahead: int | None, wake: float) -> None:
        self.cost, self.ahead, self.wake = cost, ahead, wake
        self.free = [0.0] * devices
        self.ends: list[list[float]] = [[] for _ in range(devices)]  # each program's end
        self.dispatched: dict[Action, float] = {}

    def dispatch(self, device: int, unit: tuple[Action, ...], producers: list[Action]) -> float:
        """When the host has dispatched ``unit`` on ``device`` (one program): after its
        previous one, after the programs that make what it reads (a worker waits for a
        value until its producer is dispatched), and within ``ahead`` of the device."""
        begin = max([self.free[device], *(self.dispatched[n] for n in producers)])
        ends = self.ends[device]
        if self.ahead is not None and len(ends) > self.ahead:
            awaited = ends[len(ends) - 1 - self.ahead]
            if awaited > begin:  # the host blocked on the device, then wakes up
                begin = awaited + self.wake
        self.free[device] = begin + self.cost
        for action in unit:
            self.dispatched[action] = self.free[device]
        return self.free[device]


def simulate_schedule(
    schedule: Schedule,
    costs: Costs = None,
    *,
    transfer: Latency = 0.0,
    dispatch: float = 0.0,
    dispatch_ahead: int | None = None,
    wake: float = 0.0,
    programs: Mapping[Action, Sequence[Action]] | None = None,
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
        for transfers on its critical path (:mod:`pipemark.runtime.schedules.simulation`).
    dispatch:
        The host's time to dispatch one program (an action, or an overlapped pair),
        in the costs' unit (0 by default: the host is never late). Each device's
        programs are dispatched one after another in the schedule's order, each once
        the programs that make what it reads are dispatched, and a device starts a
        program no sooner than it is dispatched: actions shorter than their dispatch
        leave the device waiting for the host (``Simulation.host_wait``).
    dispatch_ahead:
        As the runtime's option (:class:`~pipemark.PipelineOptions`): after
        dispatching a device's program ``j`` the host waits until program
        ``j - dispatch_ahead`` has run (``None``: it never waits).
    wake:
        When the host waited for the device (``dispatch_ahead``), how long after that
        program ends it dispatches again (0 by default).
    programs:
        The actions that run as one program, each program keyed by its first action
        (:func:`pipemark.runtime.planning.dispatches.programs`: as the runtime fuses them); a
        program runs as an overlapped pair does, in its first action's place. By
        default each action is a program, but the schedule's overlapped pairs.

    >>> from pipemark.runtime.schedules.core import one_f_one_b_schedule
    >>> one = one_f_one_b_schedule(1, 8)  # one device, 16 actions of 1
    >>> unit = {"forward": 1.0, "backward": 1.0, "weight": 0.0}
    >>> simulate_schedule(one, unit, dispatch=0.5).makespan  # the device is the bottleneck
    16.5
    >>> simulate_schedule(one, unit, dispatch=2.0).makespan  # the host is: 16 dispatches
    33.0
    >>> sim = simulate_schedule(one, unit, dispatch=0.5, dispatch_ahead=1, wake=1.0)
    >>> sim.makespan, sim.host_wait  # every other program waits for a wake-up
    (20.0, (4.0,))
    """
    cost = _schedule_cost(schedule, costs)
    preds, succ = schedule.predecessors, schedule.successors
    orders = schedule.device_orders()
    needs = {a: dependencies(a, preds, succ) for order in orders for a in order}
    delay = _delay_function(transfer, schedule.stage_devices)
    host = _host(len(orders), dispatch, dispatch_ahead, wake)
    columns = _columns(orders, dict(schedule.overlapped), programs)
    start, finish, busy, waits = _run(columns, cost, needs, delay, host)
    makespan = max(finish.values(), default=0.0)
    idle = 1.0 - sum(busy) / (len(orders) * makespan) if makespan else 0.0
    bubble = makespan - sum(busy) / len(orders)
    bound = _makespan_bound(orders, cost, needs, delay)
    return Simulation(
        start, finish, makespan, tuple(busy), idle, bubble, bound, host.dispatched, tuple(waits)
    )


def _columns(orders, pairs: dict, programs: Mapping | None) -> list[list[tuple[Action, ...]]]:
    """Each device's programs in order: ``programs``' (else each action, but the
    overlapped ``pairs``), each in its first action's place."""
    if programs is None:
        programs = {first: (first, second) for first, second in pairs.items()}
    inside = {a for unit in programs.values() for a in unit[1:]}
    return [[tuple(programs.get(a, (a,))) for a in order if a not in inside] for order in orders]


def _run(columns, cost, needs, delay, host: _Host):
    """Each device's programs in order (see :func:`simulate_schedule`): when each
    action starts and ends, and per device its busy time and its waits for the host."""
    position = [0] * len(columns)
    free, busy, waits = [0.0] * len(columns), [0.0] * len(columns), [0.0] * len(columns)
    start: dict[Action, float] = {}
    finish: dict[Action, float] = {}
    remaining = sum(len(c) for c in columns)
    while remaining:
        progressed = False
        for d, column in enumerate(columns):
            while position[d] < len(column):
                unit = column[position[d]]
                reads = [(n, a) for a in unit for n in needs[a] if n not in unit]
                if any(n not in finish for n, _ in reads):
                    break
                # A program starts once everything its actions read has arrived and
                # the host has dispatched it, and its results leave together when it
                # ends.
                ready = max([free[d], *(finish[n] + delay(n, a) for n, a in reads)])
                begin = max(ready, host.dispatch(d, unit, [n for n, _ in reads]))
                waits[d] += begin - ready
                length = sum(map(cost, unit))
                offset = begin
                for action in unit:
                    start[action], finish[action] = offset, begin + length
                    offset += cost(action)
                free[d] = begin + length
                host.ends[d].append(free[d])
                busy[d] += length
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a valid schedule never deadlocks
            raise StageGraphError("The schedule's device orders deadlock.")
    return start, finish, busy, waits


def _host(devices: int, dispatch: Any, ahead: Any, wake: Any) -> _Host:
    """The host of :func:`simulate_schedule`'s arguments, checked."""
    cost = _non_negative("dispatch", dispatch, "the host's time to dispatch a program")
    wake = _non_negative("wake", wake, "how long the host takes to resume after a wait")
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
        raise PipemarkError(f"dispatch_ahead = {ahead!r}: give an int >= 1, or None (no bound).")
    return _Host(devices, cost, ahead, wake)


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
