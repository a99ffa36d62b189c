"""Which process holds each array a pipeline returned, under ``jax.distributed``.

JAX has one kind of array for a value on some devices, and a checkpointer needs to
know more than that to write it once and whole. Under ``jax.distributed`` a
pipeline's result is, in each process, one of three things:

- **held elsewhere**: another process's stage or update computed it and keeps it (with
  ``gather_results=False``); here it is an array of the global program with no data;
- **held alone**: this process's slot computed it, and no other process has it;
- **held in copies**: every process has an identical copy (results gathered, which is
  the default; scalars such as the loss; results no stage owns, such as Adam's count).

The first is visible on the array (no addressable shard). The other two look alike, a
fully addressable array, and orbax refuses both in a multi-process job ("Cannot
serialize host local jax.Array"), since for an array it knows nothing of, a
process-local value could differ between processes. A pipeline records which of the two
each of its results is (:func:`record`), and :mod:`pipemark.runtime.training.orbax_arrays`
reads it (:func:`holding`) to save each once: a copy by one process, an array held
alone by its process.

The record is kept per array object, weakly: it ends with the array. An array made from
a pipeline's result (``x + 0``, a ``jax.tree.map``) is the user's, and orbax treats it
as it treats any array.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from pipemark.runtime.devices.placement import Placement

__all__ = [
    "ALONE",
    "COPIES",
    "FIRST_COPY",
    "OTHER_COPY",
    "Holding",
    "holding",
    "record",
    "record_results",
]

#: This process's slot holds the array; no other process has it.
ALONE = "alone"
#: Every process holds an identical copy of the array.
COPIES = "copies"
#: Some processes, not all, hold identical copies of an array restored from a
#: checkpoint; this process is the first of them, and saves it as if held alone.
FIRST_COPY = "first copy"
#: Some processes, not all, hold identical copies of an array restored from a
#: checkpoint; another, the first of them, saves it.
OTHER_COPY = "other copy"


class Holding(NamedTuple):
    """How a pipeline's result is held (``kind``: :data:`ALONE` or :data:`COPIES`;
    for an array a checkpoint restored, also :data:`FIRST_COPY` or
    :data:`OTHER_COPY`); for copies, the device each process keeps its copy on, in
    process order (the same list in every process)."""

    kind: str
    devices: tuple[Any, ...] = ()


# id(array) -> (a weak reference to it, its Holding). The weak reference tells a live
# array from a new one that took a dead one's id, and its callback drops the entry.
_RECORDS: dict[int, tuple[weakref.ref, Holding]] = {}
_LOCK = threading.Lock()


def record(arrays: Sequence[Any], holdings: Sequence[Holding | None]) -> None:
    """Record how each of ``arrays`` (a pipeline's results in this process) is held;
    ``None`` records nothing (an array held elsewhere, or in one process)."""
    for array, held in zip(arrays, holdings):
        if held is None:
            continue
        key = id(array)

        def forget(_ref: weakref.ref, key: int = key) -> None:
            with _LOCK:
                entry = _RECORDS.get(key)
                if entry is not None and entry[0] is _ref:
                    del _RECORDS[key]

        with _LOCK:
            _RECORDS[key] = (weakref.ref(array, forget), held)


def holding(array: Any) -> Holding | None:
    """How a pipeline's result ``array`` is held, or ``None`` for an array no pipeline
    returned (or returned in one process)."""
    with _LOCK:
        entry = _RECORDS.get(id(array))
    if entry is None or entry[0]() is not array:
        return None
    return entry[1]


def record_results(
    placement: Placement, arrays: Sequence[Any], holders: Sequence[int | None]
) -> None:
    """Record a call's results under ``jax.distributed`` (nothing in one process):
    ``holders`` gives, per array, the slot whose process alone holds it, or ``None``
    where every process holds a copy (on its receiving device,
    :meth:`~pipemark.runtime.devices.placement.Placement.receivers`)."""
    if not placement.distributed:
        return
    receivers = placement.receivers()
    devices = tuple(receivers[p] for p in sorted(receivers))
    holdings: list[Holding | None] = []
    for holder in holders:
        if holder is None:
            holdings.append(Holding(COPIES, devices))
        elif len(placement.slots[holder].processes) > 1:
            # Held by the processes of a sub-mesh that spans several: an array of the
            # global program with a shard in each, which orbax saves as it is.
            holdings.append(None)
        else:  # held alone here, or by another process (no data here: nothing to say)
            holdings.append(Holding(ALONE) if placement.local[holder] else None)
    record(arrays, holdings)
