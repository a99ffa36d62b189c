"""What a schedule is built for: :class:`ScheduleProblem`, the one argument every
registered schedule builder takes (:func:`pipemark.runtime.register_schedule`).

A problem says how many pipeline stages and microbatches there are, the stage graph,
whether the backward is split into B and W (:func:`pipemark.passes.split_backward`),
the device slots available, how long each stage's forward, backward and weight
actions take, how many bytes of residuals (activations its backward reads) a stage
holds per microbatch in flight, and how many bytes a device has for them. The planner
builds one per pipeline (``pipe.plan(params, batch).problem``); a builder reads what it
needs and ignores the rest.

Costs are per kind of action: ``forward`` (F), ``backward`` (B: the activation
cotangents) and ``weight`` (W: the parameter gradients), each a number or one number
per stage; in a schedule that does not split its backward, a backward action costs
B + W (:func:`cost_function`).

>>> problem = ScheduleProblem(num_stages=3, num_microbatches=4, forward_time=2.0)
>>> problem.stage_graph, problem.forward_time, problem.num_devices
({0: (), 1: (0,), 2: (1,)}, (2.0, 2.0, 2.0), None)
>>> problem.with_costs({"backward": (1.0, 2.0, 3.0)}).costs["backward"]
(1.0, 2.0, 3.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.roles import ACTION_KINDS, BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.schedules.core import Action, normalize_stage_graph, stage_successors

__all__ = ["Costs", "ScheduleProblem", "cost_function", "stage_times"]

#: Costs of actions: ``{"forward": F, "backward": B, "weight": W}`` (numbers, or one per
#: stage; 1 where left out), a function of an :class:`~pipemark.runtime.Action`, or
#: ``None`` (1 each).
Costs = Mapping[str, float | Sequence[float]] | Callable[[Action], float] | None


def _is_time(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value >= 0
        and math.isfinite(value)
    )


def _per_stage(value: Any, num_stages: int, what: str) -> tuple[float, ...]:
    """``value`` (a number, or one per stage) as one float per stage; ``what`` names it
    in the error."""
    values = value if isinstance(value, Sequence) else [value]
    if not all(_is_time(v) for v in values):
        raise PipemarkError(
            f"{what} = {value!r}: give 'forward', 'backward' and 'weight' each a "
            "non-negative number, or one per stage."
        )
    if not isinstance(value, Sequence):
        return (float(value),) * num_stages
    if len(value) != num_stages:
        raise PipemarkError(
            f"{what} has {len(value)} entries but the schedule has {num_stages} stages; "
            "give one per stage, or one number for all."
        )
    return tuple(float(v) for v in value)


def stage_times(costs: Costs, num_stages: int) -> dict[str, tuple[float, ...]]:
    """A costs table (not a function) as one time per kind and stage, 1 where it says
    nothing; a :class:`~pipemark.PipemarkError` naming a bad entry.

    >>> stage_times({"forward": [1.0, 2.0]}, 2)
    {'forward': (1.0, 2.0), 'backward': (1.0, 1.0), 'weight': (1.0, 1.0)}
    """
    if costs is not None and not isinstance(costs, Mapping):
        raise PipemarkError(
            f"costs is {type(costs).__name__}; give a dict {{'forward': F, 'backward': B, "
            "'weight': W} (numbers, or one per stage) or a function of an Action."
        )
    table = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0, **(costs or {})}
    for kind, value in table.items():
        if kind not in ACTION_KINDS:
            raise PipemarkError(
                f"costs[{kind!r}] = {value!r}: give 'forward', 'backward' and 'weight' "
                "each a non-negative number, or one per stage."
            )
    return {kind: _per_stage(table[kind], num_stages, f"costs[{kind!r}]") for kind in ACTION_KINDS}


def cost_function(costs: Costs, split: bool, num_stages: int) -> Callable[[Action], float]:
    """``costs`` as a function of an action; where the backward is not ``split``, a
    backward action costs B + W.

    >>> cost = cost_function({"backward": 2.0, "weight": 1.0}, False, 2)
    >>> cost(Action(0, 0, "backward")), cost(Action(1, 3, "forward"))
    (3.0, 1.0)
    """
    if callable(costs):
        return costs
    table = stage_times(costs, num_stages)

    def cost(action: Action) -> float:
        own = table[action.kind][action.stage]
        if action.kind == BACKWARD and not split:
            own += table[WEIGHT][action.stage]
        return own

    return cost


def _check_optional_count(value: Any, what: str, positive: bool) -> None:
    least = 1 if positive else 0
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        raise PipemarkError(f"{what} must be an int >= {least} or None, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class ScheduleProblem:
    """What a schedule builder is given.

    Attributes
    ----------
    num_stages, num_microbatches:
        The pipeline's stages and microbatches.
    stage_graph:
        ``{stage: its predecessors}``, the stages each forward stage reads from, as
        :attr:`~pipemark.runtime.Schedule.stage_graph` gives it and every schedule
        builder takes it (given as anything
        :func:`~pipemark.runtime.schedules.normalize_stage_graph` reads: ``None`` for a
        chain, ``(source, target)`` edges, a mapping, a ``networkx.DiGraph``).
    splits_backward:
        Whether each backward runs as B and W (weight actions), as the planner split
        it for a schedule registered with ``splits_backward=True``.
    num_devices:
        The device slots available (``None``: not known, as for
        :func:`~pipemark.runtime.make_schedule` without ``num_devices``). A schedule
        that puts one stage on each device uses ``num_stages`` of them.
    slots:
        The available slots themselves (:class:`~pipemark.runtime.devices.placement.Slot`,
        a device or a sub-mesh each) where the planner knows them, for messages and
        placement; empty otherwise.
    forward_time, backward_time, weight_time:
        Each stage's F, B and W (a number for all, or one per stage; 1 by default: a
        tick each). Measured ones come from ``pipe.action_costs(params, batch)``, or
        estimated ones from :func:`pipemark.cost.estimate_cost` of the stage programs, through
        :meth:`with_costs`.
    activation_bytes:
        Per stage, the bytes its backward (and weight) program reads from its forward
        for one microbatch: what a microbatch in flight (forward run, backward not)
        holds on the stage's device. The planner counts them from the stage programs
        (on sub-meshes, for one data-parallel replica); ``None``: not known.
    memory_limit:
        The bytes each device has for those residuals; ``None``: not known (the
        planner leaves it so; a builder that needs one is given it by whoever
        registers it, e.g. ``dataclasses.replace(problem, memory_limit=...)``).
    microbatches_in_flight:
        At most this many microbatches in the pipeline at once (``None``: as many as
        the schedule keeps): :func:`~pipemark.runtime.build_schedule` then builds the
        schedule for waves of this many microbatches and runs them one after another
        (:func:`~pipemark.runtime.schedules.in_waves`); a builder never sees it. The
        planner sets it from ``microbatches_in_flight=``, or the memory budget does.

    >>> ScheduleProblem(2, 4, stage_graph=[(0, 1)], activation_bytes=(64, 32)).costs
    {'forward': (1.0, 1.0), 'backward': (1.0, 1.0), 'weight': (1.0, 1.0)}
    """

    num_stages: int
    num_microbatches: int
    stage_graph: Any = None
    splits_backward: bool = False
    num_devices: int | None = None
    slots: tuple[Any, ...] = dataclasses.field(default=(), repr=False)
    forward_time: Any = 1.0
    backward_time: Any = 1.0
    weight_time: Any = 1.0
    activation_bytes: tuple[int, ...] | None = None
    memory_limit: int | None = None
    microbatches_in_flight: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipemarkError(f"{name} must be a positive int, got {value!r}.")
        count = self.num_stages
        graph = normalize_stage_graph(self.stage_graph, count)
        self._set("stage_graph", dict(enumerate(graph)))
        if not isinstance(self.splits_backward, bool):
            raise PipemarkError(
                f"splits_backward must be True or False, got {self.splits_backward!r}."
            )
        self._set("slots", tuple(self.slots))
        if self.slots and self.num_devices is None:
            self._set("num_devices", len(self.slots))
        _check_optional_count(self.num_devices, "num_devices", positive=True)
        if self.slots and self.num_devices != len(self.slots):
            raise PipemarkError(
                f"num_devices={self.num_devices} but {len(self.slots)} slots are given; "
                "give one of them, or both equal."
            )
        for kind in ACTION_KINDS:
            name = f"{kind}_time"
            self._set(name, _per_stage(getattr(self, name), count, name))
        self._check_memory()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass's field

    def _check_memory(self) -> None:
        _check_optional_count(self.memory_limit, "memory_limit", positive=True)
        _check_optional_count(self.microbatches_in_flight, "microbatches_in_flight", positive=True)
        if self.activation_bytes is None:
            return
        sizes = tuple(self.activation_bytes)
        for size in sizes:
            _check_optional_count(size, "each of activation_bytes", positive=False)
        if len(sizes) != self.num_stages:
            raise PipemarkError(
                f"activation_bytes has {len(sizes)} entries but the pipeline has "
                f"{self.num_stages} stages; give one per stage (bytes per microbatch)."
            )
        self._set("activation_bytes", sizes)

    @property
    def predecessors(self) -> tuple[tuple[int, ...], ...]:
        """The stage graph as a tuple: ``predecessors[j]``, the stages stage ``j`` reads."""
        return tuple(self.stage_graph[j] for j in range(self.num_stages))

    @property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """The stages that read each stage."""
        return stage_successors(self.predecessors)

    @property
    def costs(self) -> dict[str, tuple[float, ...]]:
        """The times as a costs table, ``{"forward": (per stage), "backward": ...,
        "weight": ...}``, as :func:`~pipemark.runtime.simulate_schedule` takes it."""
        return {kind: getattr(self, f"{kind}_time") for kind in ACTION_KINDS}

    def cost(self, action: Action) -> float:
        """How long ``action`` takes (a backward B + W where the backward is not
        split)."""
        return cost_function(self.costs, self.splits_backward, self.num_stages)(action)

    def with_costs(self, costs: Mapping[str, Any]) -> ScheduleProblem:
        """The same problem with the times of ``costs`` (a table as
        ``pipe.action_costs`` returns it; the kinds it leaves out keep theirs)."""
        if not isinstance(costs, Mapping):
            raise PipemarkError(
                f"with_costs takes a table {{'forward': F, 'backward': B, 'weight': W}} "
                f"(numbers, or one per stage), got {type(costs).__name__}."
            )
        table = stage_times({**self.costs, **costs}, self.num_stages)
        return dataclasses.replace(
            self,
            forward_time=table[FORWARD],
            backward_time=table[BACKWARD],
            weight_time=table[WEIGHT],
        )
