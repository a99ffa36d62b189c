"""The schedules a pipeline can name: one registry, name -> :class:`ScheduleEntry`.

An entry says how to build the schedule for a :class:`~pipemark.runtime.ScheduleProblem`
(the pipeline's sizes, stage graph, devices, times and memory), whether it puts one
stage on each device or several (interleaved, ZB-V), and whether it splits each
backward into B and W (:func:`pipemark.passes.split_backward`). The options
(:class:`~pipemark.runtime.PipelineOptions`), the planner and :func:`make_schedule` read
it, so adding a schedule is one builder and one call to :func:`register_schedule`:

>>> from pipemark.runtime.schedules.core import gpipe_schedule
>>> entry = register_schedule("gpipe-again", lambda problem: gpipe_schedule(
...     problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph))
>>> "gpipe-again" in SCHEDULES, make_schedule("gpipe-again", 2, 2).num_ticks
(True, 6)
>>> unregister_schedule("gpipe-again")
>>> SCHEDULES
('gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v', 'dualpipev')
>>> ZERO_BUBBLE_VARIANTS
('zb-h1', 'zb-v', 'dualpipev')
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.runtime.schedules.core import (
    Schedule,
    check_schedule_fits,
    gpipe_schedule,
    in_waves,
    interleaved_schedule,
    one_f_one_b_schedule,
)
from pipemark.runtime.schedules.dualpipe import build_dualpipev
from pipemark.runtime.schedules.problem import ScheduleProblem
from pipemark.runtime.schedules.zero_bubble import build_zero_bubble

__all__ = [
    "SCHEDULES",
    "ZERO_BUBBLE_VARIANTS",
    "ScheduleBuilder",
    "ScheduleEntry",
    "build_schedule",
    "make_schedule",
    "register_schedule",
    "schedule_entry",
    "unregister_schedule",
]

#: ``build(problem) -> Schedule``: a schedule for a
#: :class:`~pipemark.runtime.ScheduleProblem`.
ScheduleBuilder = Callable[[ScheduleProblem], Schedule]


@dataclass(frozen=True)
class ScheduleEntry:
    """A named schedule.

    Attributes
    ----------
    name:
        What ``schedule=`` names it by.
    build:
        ``build(problem) -> Schedule`` for a :class:`~pipemark.runtime.ScheduleProblem`
        (stage graph, devices available, times, residual bytes and memory).
    one_stage_per_device:
        ``True``: pipeline stage ``j`` runs on device ``j``, so the pipeline needs as
        many devices as stages (:meth:`schedule` checks it). ``False``: the schedule
        places several stages on a device (interleaved, ZB-V) and gets every available
        device.
    splits_backward:
        Whether the schedule runs each backward as B and W (weight actions), so the
        planner splits the backward stages first.
    """

    name: str
    build: ScheduleBuilder
    one_stage_per_device: bool = True
    splits_backward: bool = False

    def schedule(self, problem: ScheduleProblem) -> Schedule:
        """The schedule for ``problem``: the devices it has checked against what this
        schedule needs (one each per stage, when it puts one stage on each device),
        then built, then its devices checked against those available.

        >>> schedule_entry("1f1b").schedule(ScheduleProblem(2, 3)).num_ticks
        8
        """
        if self.one_stage_per_device:
            _check_one_device_per_stage(problem)
        schedule = self.build(problem)
        if not isinstance(schedule, Schedule):
            raise PipemarkError(
                f"The builder of schedule {self.name!r} returned {type(schedule).__name__}, "
                "not a pm.Schedule; return one (pm.runtime.schedule_from_orders builds it from "
                "each device's order of actions)."
            )
        _check_devices_used(schedule, problem)
        return schedule


def _check_one_device_per_stage(problem: ScheduleProblem) -> None:
    """A :class:`PipemarkError` when a schedule with one stage per device has fewer
    devices than stages."""
    count, available = problem.num_stages, problem.num_devices
    if available is None or count <= available:
        return
    sharing = " or ".join(
        repr(name) for name in SCHEDULES if not schedule_entry(name).one_stage_per_device
    )
    listed = f" ({', '.join(str(s) for s in problem.slots)})" if problem.slots else ""
    raise PipemarkError(
        f"The pipeline has {count} stages but only {available} device(s){listed}; each "
        f"stage needs its own device. Pass num_stages={available} (consecutive marked "
        "stages are merged), give more devices (on CPU, set XLA_FLAGS="
        f"--xla_force_host_platform_device_count={count} before JAX starts), or use "
        f"schedule={sharing} to put several stages on each device."
    )


def _check_devices_used(schedule: Schedule, problem: ScheduleProblem) -> None:
    if problem.num_devices is not None and schedule.num_devices > problem.num_devices:
        raise PipemarkError(
            f"The schedule {schedule.name!r} uses {schedule.num_devices} devices "
            f"but only {problem.num_devices} are available; pass devices= with enough "
            "devices."
        )


_REGISTRY: dict[str, ScheduleEntry] = {}


def register_schedule(
    name: str,
    build: ScheduleBuilder,
    *,
    one_stage_per_device: bool = True,
    splits_backward: bool = False,
) -> ScheduleEntry:
    """Make ``schedule=name`` build its schedule with ``build(problem) -> Schedule``
    (``problem`` a :class:`~pipemark.runtime.ScheduleProblem`); returns the entry.

    Raises :class:`~pipemark.PipemarkError` for a name that is not a non-empty str, one
    already registered (:func:`unregister_schedule` it first), or a ``build`` that is
    not callable. A ``build(num_stages, num_microbatches, *, stage_graph, num_devices)``
    (the form before :class:`~pipemark.runtime.ScheduleProblem`) still works, with a
    ``DeprecationWarning``: it is called with the problem's fields.

    >>> from pipemark.runtime.schedules.core import one_f_one_b_schedule
    >>> register_schedule("my-1f1b", lambda problem: one_f_one_b_schedule(
    ...     problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph,
    ...     extra_in_flight=1)).splits_backward
    False
    >>> unregister_schedule("my-1f1b")
    """
    if not isinstance(name, str) or not name:
        raise PipemarkError(f"register_schedule: name must be a non-empty str, got {name!r}.")
    if name in _REGISTRY:
        raise PipemarkError(
            f"register_schedule: a schedule named {name!r} is registered already; "
            "unregister_schedule it first, or choose another name."
        )
    if not callable(build):
        raise PipemarkError(
            f"register_schedule: build must be callable (problem: pm.runtime.ScheduleProblem) -> "
            f"Schedule, got {build!r}."
        )
    if _takes_sizes(build):
        warnings.warn(
            f"register_schedule({name!r}): build(num_stages, num_microbatches, *, "
            "stage_graph, num_devices) is deprecated; write build(problem) -> Schedule, "
            "reading problem.num_stages, problem.num_microbatches, problem.stage_graph "
            "and problem.num_devices (a pm.runtime.ScheduleProblem, which also has the stage "
            "times and residual bytes).",
            DeprecationWarning,
            stacklevel=2,
        )
        build = functools.partial(_call_with_sizes, build, bool(one_stage_per_device))
    entry = ScheduleEntry(name, build, bool(one_stage_per_device), bool(splits_backward))
    _REGISTRY[name] = entry
    return entry


def _takes_sizes(build: Callable[..., Any]) -> bool:
    """Whether ``build`` is a builder of the old form, which cannot be called with the
    problem alone."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):  # a builtin without a signature: called as given
        return False
    try:
        signature.bind(None)
    except TypeError:
        return True
    return False


def _call_with_sizes(
    build: Callable[..., Schedule], one_stage_per_device: bool, problem: ScheduleProblem
) -> Schedule:
    """A builder of the old form called for ``problem``, with the ``num_devices`` the
    planner gave it (the stage count for one stage per device)."""
    num_devices = problem.num_stages if one_stage_per_device else problem.num_devices
    return build(
        problem.num_stages,
        problem.num_microbatches,
        stage_graph=problem.stage_graph,
        num_devices=num_devices,
    )


def unregister_schedule(name: str) -> None:
    """Forget the schedule ``name`` (a :class:`~pipemark.PipemarkError` if unknown)."""
    schedule_entry(name)
    del _REGISTRY[name]


def schedule_entry(name: str) -> ScheduleEntry:
    """The entry of schedule ``name``, or a :class:`~pipemark.PipemarkError` that lists
    the registered names.

    >>> schedule_entry("zb-v").one_stage_per_device
    False
    """
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise PipemarkError(
            f"Unknown schedule {name!r}; choose one of {', '.join(map(repr, SCHEDULES))}, "
            "pass a pm.Schedule, or register one with pm.runtime.register_schedule."
        )
    return entry


class _Names(Sequence[str]):
    """The registered names (those ``keep`` accepts), read at each use, so a schedule
    registered later is in it. Compares equal to the tuple of the names."""

    def __init__(self, keep: Callable[[ScheduleEntry], bool]) -> None:
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, entry in _REGISTRY.items() if self._keep(entry))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        entry = _REGISTRY.get(name) if isinstance(name, str) else None
        return entry is not None and self._keep(entry)

    def __eq__(self, other: object) -> bool:
        return self._names() == (tuple(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]  # it changes as schedules register

    def __repr__(self) -> str:
        return repr(self._names())


#: The names ``schedule=`` takes, in registration order.
SCHEDULES: Sequence[str] = _Names(lambda entry: True)
#: The registered schedules that split the backward into B and W.
ZERO_BUBBLE_VARIANTS: Sequence[str] = _Names(lambda entry: entry.splits_backward)


def build_schedule(kind: str | Schedule, problem: ScheduleProblem) -> Schedule:
    """The schedule ``kind`` for ``problem``: a registered name's entry builds it
    (:meth:`ScheduleEntry.schedule`, which checks the devices); a
    :class:`~pipemark.runtime.Schedule` is checked against the problem's sizes and
    devices, and that its order meets the problem's stage graph, and returned with that
    graph (:func:`~pipemark.runtime.schedules.check_schedule_fits`). The planner calls
    it with the pipeline's problem (``pipe.plan(params, batch).problem``); with
    measured costs, it rebuilds a zero-bubble schedule for them:

    >>> problem = ScheduleProblem(2, 4, backward_time=2.0)
    >>> build_schedule("zb-h1", problem.with_costs({"weight": (0.0, 3.0)})).name
    'zb-h1'
    """
    if isinstance(kind, Schedule):
        schedule = check_schedule_fits(
            kind, problem.num_stages, problem.num_microbatches, problem.stage_graph
        )
        _check_devices_used(schedule, problem)
        wave = problem.microbatches_in_flight
        if wave is not None and wave < problem.num_microbatches:
            raise PipemarkError(
                f"microbatches_in_flight={problem.microbatches_in_flight} is for a schedule "
                f"the pipeline builds; the schedule {kind.name!r} was given made. Build it "
                "in waves yourself (pm.runtime.schedules.in_waves), or name a schedule."
            )
        return schedule
    entry = schedule_entry(kind)
    wave, count = problem.microbatches_in_flight, problem.num_microbatches
    if wave is None or wave >= count:
        return entry.schedule(problem)
    return in_waves(
        [
            _wave(entry, problem, start, min(wave, count - start), wave)
            for start in range(0, count, wave)
        ],
        name=f"{entry.name}, waves of {wave}",
    )


def _wave(
    entry: ScheduleEntry, problem: ScheduleProblem, start: int, size: int, wave: int
) -> Schedule:
    """Schedule ``entry`` for microbatches ``start .. start + size - 1`` of ``problem``
    (numbered from 0), one wave of ``microbatches_in_flight=wave``."""
    part = dataclasses.replace(problem, num_microbatches=size, microbatches_in_flight=None)
    try:
        return entry.schedule(part)
    except PipemarkError as error:
        raise PipemarkError(
            f"microbatches_in_flight={wave}: the schedule {entry.name!r} cannot run "
            f"microbatches {start}..{start + size - 1} as one wave of {size}: {error} "
            f"Pick microbatches_in_flight so that every wave can be scheduled (a divisor "
            f"of num_microbatches={problem.num_microbatches} that the schedule takes)."
        ) from error


def make_schedule(
    kind: str | Schedule,
    num_stages: int,
    num_microbatches: int,
    *,
    stage_graph: Any = None,
    num_devices: int | None = None,
) -> Schedule:
    """Build a registered schedule by name (:data:`SCHEDULES`: ``"gpipe"``,
    ``"1f1b"``, ``"interleaved"`` (which needs ``num_devices``), ``"zb-h1"``,
    ``"zb-v"``, ...) for these sizes, with unit times (:func:`build_schedule` takes a
    whole :class:`~pipemark.runtime.ScheduleProblem`). A
    :class:`~pipemark.runtime.Schedule` is checked against the sizes and the stage
    graph and returned with that graph (:func:`build_schedule`).

    >>> make_schedule("gpipe", 2, 4).name
    'gpipe'
    """
    if isinstance(kind, Schedule):
        split = kind.splits_backward
    else:
        split = schedule_entry(kind).splits_backward
    problem = ScheduleProblem(
        num_stages,
        num_microbatches,
        stage_graph=stage_graph,
        splits_backward=split,
        num_devices=num_devices,
    )
    return build_schedule(kind, problem)


def _interleaved(problem: ScheduleProblem) -> Schedule:
    if problem.num_devices is None:
        raise PipemarkError(
            "The interleaved schedule needs num_devices (it puts several stages on "
            "each device); pass num_devices= or devices=."
        )
    return interleaved_schedule(
        problem.num_stages,
        problem.num_microbatches,
        num_devices=problem.num_devices,
        stage_graph=problem.stage_graph,
    )


def _gpipe(problem: ScheduleProblem) -> Schedule:
    return gpipe_schedule(
        problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph
    )


def _one_f_one_b(problem: ScheduleProblem) -> Schedule:
    return one_f_one_b_schedule(
        problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph
    )


register_schedule("gpipe", _gpipe)
register_schedule("1f1b", _one_f_one_b)
register_schedule("interleaved", _interleaved, one_stage_per_device=False)
register_schedule(
    "zb-h1", functools.partial(build_zero_bubble, variant="zb-h1"), splits_backward=True
)
register_schedule(
    "zb-v",
    functools.partial(build_zero_bubble, variant="zb-v"),
    one_stage_per_device=False,
    splits_backward=True,
)
register_schedule("dualpipev", build_dualpipev, one_stage_per_device=False, splits_backward=True)
