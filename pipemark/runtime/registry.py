"""The schedules a pipeline can name: one registry, name -> :class:`ScheduleEntry`.

An entry says how to build the schedule for a pipeline's sizes, whether it puts one
stage on each device or several (interleaved, ZB-V), and whether it splits each
backward into B and W (:func:`pipemark.passes.split_backward`). The options
(:class:`~pipemark.runtime.PipelineOptions`), the planner and :func:`make_schedule` read
it, so adding a schedule is one call to :func:`register_schedule`:

>>> from pipemark.runtime.schedules import gpipe_schedule
>>> entry = register_schedule(
...     "gpipe-again", lambda s, m, *, stage_graph, num_devices: gpipe_schedule(
...         s, m, stage_graph=stage_graph))
>>> "gpipe-again" in SCHEDULES, make_schedule("gpipe-again", 2, 2).num_ticks
(True, 6)
>>> unregister_schedule("gpipe-again")
>>> SCHEDULES
('gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v')
>>> ZERO_BUBBLE_VARIANTS
('zb-h1', 'zb-v')
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.runtime.schedules import (
    Schedule,
    check_schedule_fits,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
)
from pipemark.runtime.simulation import zero_bubble_schedule

__all__ = [
    "SCHEDULES",
    "ZERO_BUBBLE_VARIANTS",
    "ScheduleEntry",
    "make_schedule",
    "register_schedule",
    "schedule_entry",
    "unregister_schedule",
]

#: ``build(num_stages, num_microbatches, *, stage_graph, num_devices) -> Schedule``;
#: ``num_devices`` is ``None`` when the caller gives none.
ScheduleBuilder = Callable[..., Schedule]


@dataclass(frozen=True)
class ScheduleEntry:
    """A named schedule.

    Attributes
    ----------
    name:
        What ``schedule=`` names it by.
    build:
        ``build(num_stages, num_microbatches, *, stage_graph, num_devices)`` returns the
        :class:`~pipemark.runtime.Schedule`. ``stage_graph`` is the pipeline's (edges
        between forward stages, or ``None`` for a chain); ``num_devices`` the devices
        available (``None`` when not known; equal to ``num_stages`` for a schedule with
        one stage per device).
    one_stage_per_device:
        ``True``: pipeline stage ``j`` runs on device ``j``, so the pipeline needs as
        many devices as stages. ``False``: the schedule places several stages on a
        device (interleaved, ZB-V) and gets every available device.
    splits_backward:
        Whether the schedule runs each backward as B and W (weight actions), so the
        planner splits the backward stages first.
    """

    name: str
    build: ScheduleBuilder
    one_stage_per_device: bool = True
    splits_backward: bool = False


_REGISTRY: dict[str, ScheduleEntry] = {}


def register_schedule(
    name: str,
    build: ScheduleBuilder,
    *,
    one_stage_per_device: bool = True,
    splits_backward: bool = False,
) -> ScheduleEntry:
    """Make ``schedule=name`` build its schedule with ``build``; returns the entry.

    Raises :class:`~pipemark.PipemarkError` for a name that is not a non-empty str, one
    already registered (:func:`unregister_schedule` it first), or a ``build`` that is
    not callable.

    >>> from pipemark.runtime.schedules import one_f_one_b_schedule
    >>> register_schedule("my-1f1b", lambda s, m, *, stage_graph, num_devices:
    ...     one_f_one_b_schedule(s, m, stage_graph=stage_graph)).splits_backward
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
            f"register_schedule: build must be callable (num_stages, num_microbatches, *, "
            f"stage_graph, num_devices) -> Schedule, got {build!r}."
        )
    entry = ScheduleEntry(name, build, bool(one_stage_per_device), bool(splits_backward))
    _REGISTRY[name] = entry
    return entry


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
    ``"zb-v"``, ...). A :class:`~pipemark.runtime.Schedule` is checked against the
    sizes and the stage graph and returned as is.

    >>> make_schedule("gpipe", 2, 4).name
    'gpipe'
    """
    if isinstance(kind, Schedule):
        check_schedule_fits(kind, num_stages, num_microbatches, stage_graph)
        return kind
    entry = schedule_entry(kind)
    return entry.build(
        num_stages, num_microbatches, stage_graph=stage_graph, num_devices=num_devices
    )


def _interleaved(
    num_stages: int, num_microbatches: int, *, stage_graph: Any, num_devices: int | None
) -> Schedule:
    if num_devices is None:
        raise PipemarkError(
            "The interleaved schedule needs num_devices (it puts several stages on "
            "each device); pass num_devices= or devices=."
        )
    return interleaved_schedule(
        num_stages, num_microbatches, num_devices=num_devices, stage_graph=stage_graph
    )


def _zero_bubble(variant: str) -> ScheduleBuilder:
    def build(
        num_stages: int, num_microbatches: int, *, stage_graph: Any, num_devices: int | None
    ) -> Schedule:
        return zero_bubble_schedule(
            num_stages, num_microbatches, variant=variant, stage_graph=stage_graph
        )

    return build


register_schedule(
    "gpipe",
    lambda s, m, *, stage_graph, num_devices: gpipe_schedule(s, m, stage_graph=stage_graph),
)
register_schedule(
    "1f1b",
    lambda s, m, *, stage_graph, num_devices: one_f_one_b_schedule(s, m, stage_graph=stage_graph),
)
register_schedule("interleaved", _interleaved, one_stage_per_device=False)
register_schedule("zb-h1", _zero_bubble("zb-h1"), splits_backward=True)
register_schedule("zb-v", _zero_bubble("zb-v"), one_stage_per_device=False, splits_backward=True)
