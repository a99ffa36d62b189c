"""DualPipeV (DeepSeek's DualPipe cut in half, by Sea AI Lab): :func:`dualpipev_schedule`
for given sizes, :func:`build_dualpipev` for a :class:`~pipemark.runtime.ScheduleProblem`
(what ``schedule="dualpipev"`` runs).

``2D`` stages on ``D`` devices in a V (device ``d`` holds stages ``d`` and
``2D - 1 - d``, as ZB-V places them). In its steady state each device runs the forward
of one microbatch on one of its stages overlapped with the whole backward of another
microbatch on its other stage, as one dispatched unit
(:attr:`~pipemark.runtime.Schedule.overlapped`); warm-up and cool-down split some
backwards into B and W (a schedule may mix whole and split backwards) and run each W
where the device would idle. The order is DeepSeek's (``dualpipe/dualpipev.py``, as
``torch.distributed.pipelining.ScheduleDualPipeV`` also writes it). On paper each
device idles DeepSeek's ``(D - 1)(F&B + B - 3W)``, with ``B`` a whole backward and
``F&B`` an overlapped pair (``F + B``: the simulator runs a pair as one unit, its two
costs back to back), where the forward takes as long as the backward's first half
(``F = B - W``, the costs a zero-bubble schedule is designed for) and ``W`` no longer
than ``F``; with ``F`` apart from ``B - W`` it idles ``(D - 1)(2F + (B - W) - W)`` in
this order:

>>> from pipemark.runtime.schedules.simulation import simulate_schedule
>>> costs = {"forward": 1.0, "backward": 1.0, "weight": 0.5}  # whole backward: 1.5
>>> simulate_schedule(dualpipev_schedule(8, 16), costs).bubble  # (4 - 1)(2.5 + 1.5 - 1.5)
7.5
"""

from __future__ import annotations

from typing import Any

from pipemark.errors import PipemarkError
from pipemark.runtime.schedules.core import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    Schedule,
    schedule_from_orders,
)
from pipemark.runtime.schedules.problem import ScheduleProblem

__all__ = ["build_dualpipev", "dualpipev_schedule"]


def dualpipev_schedule(
    num_stages: int, num_microbatches: int, *, stage_graph: Any = None
) -> Schedule:
    """DualPipeV for ``num_stages`` stages (even) on ``num_stages / 2`` devices and at
    least ``num_stages`` microbatches (see the module docstring).

    >>> s = dualpipev_schedule(4, 4)
    >>> s.stage_devices, s.num_devices, len(s.overlapped), sorted(s.whole_backwards)[:2]
    ((0, 1, 1, 0), 2, 6, [(0, 0), (0, 1)])
    """
    _check_sizes(num_stages, num_microbatches)
    devices = num_stages // 2
    orders, pairs = [], []
    for d in range(devices):
        order, overlapped = _device_order(d, devices, num_microbatches)
        orders.append(order)
        pairs += overlapped
    return schedule_from_orders(
        orders,
        stage_devices=tuple(min(j, num_stages - 1 - j) for j in range(num_stages)),
        num_microbatches=num_microbatches,
        stage_graph=stage_graph,
        name="dualpipev",
        overlapped=pairs,
    )


def build_dualpipev(problem: ScheduleProblem) -> Schedule:
    """DualPipeV for ``problem``'s stages, microbatches and stage graph, on half as many
    devices as stages (a :class:`~pipemark.PipemarkError` when ``problem`` has fewer):
    the builder of the registered ``"dualpipev"``. Its order does not depend on the
    times; ``simulate_schedule(schedule, problem.costs)`` predicts it with them.

    >>> build_dualpipev(ScheduleProblem(4, 4, splits_backward=True)).num_devices
    2
    """
    _check_sizes(problem.num_stages, problem.num_microbatches)
    needed = problem.num_stages // 2
    if problem.num_devices is not None and problem.num_devices < needed:
        raise PipemarkError(
            f"dualpipev puts two stages on each device: {problem.num_stages} stages need "
            f"{needed} devices, but {problem.num_devices} are available."
        )
    return dualpipev_schedule(
        problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph
    )


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    for value, what in ((num_stages, "num_stages"), (num_microbatches, "num_microbatches")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PipemarkError(f"{what} must be a positive int, got {value!r}.")
    if num_stages % 2:
        raise PipemarkError(
            f"dualpipev puts two stages on each device in a V, so num_stages must be even, "
            f"got {num_stages}."
        )
    if num_microbatches < num_stages:
        raise PipemarkError(
            f"dualpipev needs at least as many microbatches as stages ({num_stages}), got "
            f"num_microbatches={num_microbatches}."
        )


class _Order:
    """One device's order as DualPipeV builds it: the next microbatch of each stage and
    kind, the W owed (run where the device would idle), the overlapped pairs."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []
        self.next: dict[tuple[int, str], int] = {}
        self.owed: list[Action] = []

    def take(self, stage: int, kind: str) -> Action:
        m = self.next.get((stage, kind), 0)
        self.next[(stage, kind)] = m + 1
        return Action(stage, m, kind)

    def forward(self, stage: int) -> None:
        self.actions.append(self.take(stage, FORWARD))

    def backward(self, stage: int, split: bool = False) -> None:
        """A whole backward, or (``split``) its first half with its W owed."""
        action = self.take(stage, BACKWARD)
        self.actions.append(action)
        if split:
            self.owed.append(action._replace(kind=WEIGHT))

    def weight(self) -> None:
        """The oldest W owed, if any."""
        if self.owed:
            self.actions.append(self.owed.pop(0))

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        pair = (self.take(forward_stage, FORWARD), self.take(backward_stage, BACKWARD))
        self.actions += pair
        self.pairs.append(pair)


def _device_order(d: int, devices: int, micro: int) -> tuple[list[Action], list]:
    """Device ``d``'s actions and overlapped pairs, in DualPipeV's eight steps (``first``
    is its stage on the way down the V, ``second`` on the way back up)."""
    first, second = d, 2 * devices - 1 - d
    order = _Order()
    for _ in range(2 * (devices - d - 1)):  # 1: forwards of the first stage
        order.forward(first)
    for _ in range(d + 1):  # 2: both stages' forwards
        order.forward(first)
        order.forward(second)
    for _ in range(devices - d - 1):  # 3: B and W of the second stage, zero-bubble style
        order.backward(second, split=True)
        order.weight()
        order.forward(second)
    for i in range(micro - 2 * devices + d + 1):  # 4: overlapped F and B, both ways
        if i == 0 and d == devices - 1:  # the V's tip: apart, for a smaller bubble
            order.forward(first)
            order.backward(second)
        else:
            order.overlap(first, second)
        order.overlap(second, first)
    for _ in range(devices - d - 1):  # 5: B of the second stage, then F and B overlapped
        order.backward(second)
        order.overlap(second, first)
    split = False
    for i in range(d + 1):  # 6: backwards of both stages, split from half-way on
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        order.backward(second, split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        order.backward(first, split)
    for _ in range(devices - d - 1):  # 7: a W owed, then the first stage's backward
        order.weight()
        order.backward(first, split)
    for _ in range(d + 1):  # 8: the W still owed
        order.weight()
    return order.actions, order.pairs
