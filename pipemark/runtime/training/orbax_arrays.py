"""orbax's ``jax.Array`` handler, told which process holds a pipeline's results.

``orbax.checkpoint`` saves a pytree of global ``jax.Array`` objects: every process
passes the same tree, and each writes the shards it holds. Under ``jax.distributed`` a
pipeline's state does not look like that (:mod:`pipemark.runtime.training.holdings`): an array
another process keeps has no shard here (orbax's handler fails on it), and an array
this process keeps alone, or a copy every process keeps, is fully addressable (orbax
refuses it: "Cannot serialize host local jax.Array"). What orbax cannot know is which
of those a pipeline's result is; pipemark records it, and :func:`install` registers,
once per process, a handler that wraps the one registered for ``jax.Array`` and, for a
pipeline's results only:

- skips an array held elsewhere: the process holding it writes it;
- writes an array held alone from this process: the array, seen as one replica of a
  global array whose other replica is on another process's devices (never read, never
  written: that process's view of it has no shard), is written by a handler whose every
  process writes its own arrays' metadata and data (orbax's ``primary_host=None``),
  one replica, no sharding file;
- writes copies once: each process's copy seen as one replica of a global array
  replicated over one device per process, which orbax writes as it writes any
  replicated array.

For any array of the global program that the primary host (process 0, which orbax
has write every array's metadata) holds no shard of (a stage whose sub-mesh spans
processes 2 and 3 of 4), the array's first process writes its metadata: orbax's own
handler would leave it unwritten, and the checkpoint unfinished.

orbax also records, per process, how each array of a save is written (its
``ArrayMetadata`` store), and the checkpoint's finalization checks that every process's
records agree and that the primary host's name every array. The wrapped handler records
the arrays it writes; this one records, in each process, every other array of the save
(those skipped here too), each shard written whole. The store is the wrapped handler's,
so that a checkpointer made before :func:`install` (whose handlers took orbax's store
when they were made) and one made after read and write the same records.

It restores an array whose target sharding has no device in this process as an array
held elsewhere (orbax's reader needs a shard to read into), and everything else through
the wrapped handler, so a checkpoint restores onto any layout: each process reads what
its devices hold. Every other array goes to the wrapped handler unchanged. The arrays a
restore gives are recorded as a pipeline's results are (one exchange among the
processes says which of them restored each here), so a restored state saves again
before any step.

The pipeline calls :func:`install` when it first returns results under
``jax.distributed``, if orbax is installed (``pip install pipemark[checkpoint]``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, make_single_device_sharding

from pipemark._compat import is_single_device_sharding
from pipemark.errors import PipemarkError
from pipemark.runtime.devices.agreement import from_every_process
from pipemark.runtime.devices.placement import held_elsewhere
from pipemark.runtime.training.holdings import (
    ALONE,
    COPIES,
    FIRST_COPY,
    OTHER_COPY,
    Holding,
    holding,
    record,
)

__all__ = ["available", "install", "view_for_saving"]

# The longest a process waits for the others' part of a restore's exchange: they
# restore the same checkpoint, each at its own pace.
_RESTORE_TIMEOUT_S = 600.0
# A mesh axis of the views below: the replicas of an array held alone or in copies.
_HOLDERS = "pipemark_holders"


def available() -> bool:
    """Whether ``orbax.checkpoint`` is installed."""
    try:
        return importlib.util.find_spec("orbax.checkpoint") is not None
    except ModuleNotFoundError:
        return False


def _foreign_devices(count: int) -> list[Any]:
    me = jax.process_index()
    others = [d for d in jax.devices() if d.process_index != me]
    if len(others) < count:
        raise PipemarkError(
            f"An array held alone by process {me} lies on {count} devices, but the other "
            f"processes have {len(others)}: orbax cannot be shown it as a global array. "
            "Save with results gathered (gather_results=True)."
        )
    return others[:count]


def _alone_view(array: jax.Array) -> jax.Array:
    """``array`` (this process's alone) as one replica of a global array whose second
    replica lies on other processes' devices: not fully addressable, so orbax takes it;
    the shards here keep their replica ids, the foreign ones come after them."""
    sharding = array.sharding
    if is_single_device_sharding(sharding):
        (device,) = sharding.device_set
        mesh = Mesh(np.array([device, *_foreign_devices(1)]), (_HOLDERS,))
        view = NamedSharding(mesh, PartitionSpec())
    elif isinstance(sharding, NamedSharding):
        devices = sharding.mesh.devices
        foreign = np.array(_foreign_devices(devices.size)).reshape(devices.shape)
        mesh = Mesh(np.stack([devices, foreign]), (_HOLDERS, *sharding.mesh.axis_names))
        view = NamedSharding(mesh, sharding.spec)
    else:
        raise PipemarkError(
            f"A pipeline's result laid out by a {type(sharding).__name__} cannot be saved "
            "by orbax from one process; save with results gathered."
        )
    shards = [shard.data for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, view, shards)


def _copies_view(array: jax.Array, devices: Sequence[Any]) -> jax.Array:
    """This process's copy as its replica of the array replicated over ``devices``, one
    per process (every process builds the same global array from its own copy)."""
    mine = devices[jax.process_index()]
    if array.sharding != make_single_device_sharding(mine):
        array = jax.device_put(array, mine)
    view = NamedSharding(Mesh(np.array(devices), (_HOLDERS,)), PartitionSpec())
    return jax.make_array_from_single_device_arrays(array.shape, view, [array])


def first_process(array: Any) -> int:
    """The first process holding a shard of ``array`` (an array of the global
    program): where its metadata is written when the primary host holds none."""
    return min(getattr(d, "process_index", 0) for d in array.sharding.device_set)


def view_for_saving(array: Any) -> tuple[str, Any]:
    """How :func:`install`'s handler saves ``array``: ``("skip", None)`` for an array
    with no shard in this process, ``("alone", view)`` or ``("copies", view)`` for a pipeline's result
    held alone or in copies, ``("as is", array)`` for anything else."""
    if not isinstance(array, jax.Array) or jax.process_count() == 1:
        return "as is", array
    if not array.addressable_shards:  # whoever holds it writes it (orbax would fail here)
        return "skip", None
    held: Holding | None = holding(array)
    if held is None:
        return "as is", array
    if held.kind in (ALONE, FIRST_COPY):
        return ALONE, _alone_view(array)
    if held.kind == OTHER_COPY:  # the first process holding a copy writes it
        return "skip", None
    if held.kind != COPIES:
        raise ValueError(f"a result held as {held.kind!r}, not one of holdings.py's kinds")
    return COPIES, _copies_view(array, held.devices)


def _writer(kind: str, view: Any) -> str | int:
    """Which of :func:`install`'s handler's inner handlers writes an array that
    :func:`view_for_saving` gave as ``(kind, view)``: ``"skip"`` (none here),
    ``"alone"``, ``"wrapped"`` (the handler registered before, for an array every
    process writes a part of), or the number of the first process of an array of the
    global program that only some processes hold (they write it, that one its
    metadata)."""
    if kind == "skip" or kind == ALONE:
        return kind
    if kind == COPIES or not isinstance(view, jax.Array) or view.is_fully_addressable:
        return "wrapped"
    processes = {getattr(d, "process_index", 0) for d in view.sharding.device_set}
    if len(processes) == jax.process_count():
        return "wrapped"
    return first_process(view)


def _array_metadata(value: Any, info: Any, arg: Any) -> Any:
    """orbax's record of how ``value`` (this process's view of an array its handler
    does not give the wrapped one) is written: each of its shards whole (the writers of
    such arrays write no replica-parallel slices), so that every process, with a shard
    or without, describes it alike. orbax checks that every process's records agree and
    that the primary host's name every array of the save.

    orbax 0.12: its ``tensorstore_utils.build_array_write_spec`` computes it (what its
    ``ArrayHandler`` records for the arrays it writes); no public name has it."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    shape = tuple(value.shape)
    spec = tensorstore_utils.build_array_write_spec(
        info=info,
        arg=arg,
        global_shape=shape,
        local_shape=tuple(value.sharding.shard_shape(shape)),
        dtype=value.dtype,
        use_ocdbt=bool(info.is_ocdbt_checkpoint),
        process_index=jax.process_index(),
    )
    return spec.metadata


def _record_restored(arrays: Sequence[Any]) -> None:
    """Record how each of ``arrays`` (what a restore gave this process) is held, as a
    pipeline records its results, so that a restored state saves again before any
    step: an array whose every shard is here is held alone where no other process
    restored it here too, in copies where every process did, and written by the first
    of them where some did. One exchange with every process, which restores the same
    tree (:func:`~pipemark.runtime.devices.agreement.from_every_process`)."""
    local = {
        k: min(array.sharding.device_set, key=lambda d: d.id).id
        for k, array in enumerate(arrays)
        if isinstance(array, jax.Array) and array.is_fully_addressable
    }
    seen = from_every_process(
        f"the {len(arrays)} arrays a checkpoint restored in it",
        sorted(local.items()),
        timeout_s=_RESTORE_TIMEOUT_S,
    )
    placed = [dict(map(tuple, pairs)) for pairs in seen]
    devices = {d.id: d for d in jax.devices()}
    me = jax.process_index()
    holdings: list[Holding | None] = []
    for k in range(len(arrays)):
        holders = [p for p, here in enumerate(placed) if k in here]
        if k not in local:
            holdings.append(None)
        elif len(holders) == 1:
            holdings.append(Holding(ALONE))
        elif len(holders) == len(placed):
            holdings.append(Holding(COPIES, tuple(devices[placed[p][k]] for p in holders)))
        else:
            holdings.append(Holding(FIRST_COPY if holders[0] == me else OTHER_COPY))
    record(arrays, holdings)


def _grouped(
    values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any]
) -> tuple[dict[str | int, tuple[list, list, list]], list[Any]]:
    """The arrays of a save by the inner handler that writes each (:func:`_writer`):
    per handler, the views, infos and save arguments it writes; and the records of
    every array the wrapped handler does not write in this process, skipped ones too."""
    groups: dict[str | int, tuple[list, list, list]] = {}
    described: list[Any] = []
    for value, info, arg in zip(values, infos, args):
        kind, view = view_for_saving(value)
        name = _writer(kind, view)
        if name != "wrapped":
            described.append(_array_metadata(value, info, arg))
        if kind == "skip":
            continue
        group = groups.setdefault(name, ([], [], []))
        for items, item in zip(group, (view, info, arg)):
            items.append(item)
    return groups, described


def _one_write_at_a_time(store: Any) -> Any:
    """A copy of orbax's array metadata store ``store`` (``None``: none) whose writes
    take turns, across threads and event loops: a write reads the process's file and
    writes it again with its records added, and two at once would lose one's."""
    if store is None:
        return None
    base = type(store)
    turn = threading.Lock()

    class OneWriteAtATime(base):
        async def write(self, *args: Any, **kwargs: Any) -> None:
            # Waited for in a worker thread: the event loop goes on meanwhile.
            await asyncio.to_thread(turn.acquire)
            try:
                await base.write(self, *args, **kwargs)
            finally:
                turn.release()

    copy = OneWriteAtATime.__new__(OneWriteAtATime)
    copy.__dict__.update(store.__dict__)
    return copy


def _records_written(store: Any, infos: Sequence[Any], described: list[Any]) -> Any:
    """The future of writing ``described`` (records of a save's arrays) to ``store``,
    as orbax's own ``ArrayHandler`` writes its records: in the background, once the
    checkpoint's temporary directory is made. Writing it earlier would make the
    directory, which the primary host, finding it there, deletes and makes again,
    failing when it is made in between.

    orbax 0.12: its ``CommitFutureAwaitingContractedSignals`` waits for the directory's
    signals, as its handlers' futures do; no public name has it."""
    from orbax.checkpoint._src.futures import future

    async def write() -> None:
        await asyncio.gather(*(info.await_path_creation() for info in infos))
        await store.write(infos[0].parent_dir, described, jax.process_index())

    return future.CommitFutureAwaitingContractedSignals(write(), name="pipemark_array_metadata")


@functools.cache
def install() -> None:
    """Register the handler for ``jax.Array`` in orbax's global registry, wrapping the
    one registered there (once per process; a no-op without orbax)."""
    if not available():
        return
    import orbax.checkpoint as ocp

    wrapped = ocp.type_handlers.get_type_handler(jax.Array)
    handler = _handler_class(ocp)(wrapped)
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _restored_elsewhere(arg: Any) -> Any:
    """For restore arguments ``arg`` whose target sharding has no device in this
    process, the array held elsewhere that stands for the leaf here; else ``None``."""
    sharding = getattr(arg, "sharding", None)
    shape = getattr(arg, "global_shape", None)
    dtype = getattr(arg, "dtype", None)
    if (
        isinstance(sharding, jax.sharding.Sharding)
        and not sharding.addressable_devices
        and shape is not None
        and dtype is not None
    ):
        return held_elsewhere(jax.ShapeDtypeStruct(tuple(shape), dtype), sharding)
    return None


def _alone_handler(ocp: Any) -> Any:
    """The handler of the arrays this process holds alone: each process writes their
    metadata and data, one replica, no sharding file."""
    return ocp.type_handlers.ArrayHandler(
        primary_host=None,
        replica_id=None,
        use_replica_parallel=False,
        enable_write_sharding_file=False,
    )


def _handler_class(ocp: Any) -> type:
    class PipelineArrayHandler(ocp.type_handlers.ArrayHandler):
        """orbax's ``jax.Array`` handler for a pipeline's results (see the module)."""

        def __init__(self, wrapped: Any) -> None:
            # orbax's checkpoint handlers take the array metadata store of the handler
            # registered for jax.Array, whether they were made before install() or
            # after: the wrapped handler's, which it writes to. Both write to one file
            # per process, each in a thread of its own, by reading and rewriting it:
            # the writes take turns. (The wrapped handler is no longer in orbax's
            # registry; this handler is its only user.)
            store = _one_write_at_a_time(getattr(wrapped, "_array_metadata_store", None))
            super().__init__(array_metadata_store=store)
            if store is not None:
                wrapped._array_metadata_store = store
            self._wrapped = wrapped
            self._alone = _alone_handler(ocp)
            # Per process, the handler for arrays whose first process it is.
            self._primaries: dict[int, Any] = {}

        def typestr(self) -> str:
            return self._wrapped.typestr()

        async def metadata(self, infos: Sequence[Any]) -> Any:
            return await self._wrapped.metadata(infos)

        def finalize(self, directory: Any) -> None:
            self._wrapped.finalize(directory)

        async def serialize(self, values: Sequence[Any], infos: Sequence[Any], args=None):
            args = args or [ocp.type_handlers.SaveArgs()] * len(values)
            groups, described = _grouped(values, infos, args)
            # The records of the arrays the wrapped handler does not write here (the
            # inner handlers made here have no store), written as orbax's handlers
            # write theirs (_records_written).
            store = self._array_metadata_store
            futures = []
            if store is not None and described and infos:
                futures.append(_records_written(store, infos, described))
            for name, group in groups.items():
                futures.extend(await self._handler(name).serialize(*group))
            return futures

        def _handler(self, name: str | int) -> Any:
            """The handler writing the group ``name``: the wrapped one, the one for
            arrays held alone, or the one whose primary host is process ``name``."""
            if name == "wrapped":
                return self._wrapped
            if name == "alone":
                return self._alone
            if name not in self._primaries:
                # Each shard written as it is (no replica-parallel slices), so that a
                # process with no shard describes the array as its writers write it.
                self._primaries[name] = ocp.type_handlers.ArrayHandler(
                    primary_host=name, use_replica_parallel=False
                )
            return self._primaries[name]

        async def deserialize(self, infos: Sequence[Any], args=None):
            if args is None:
                return await self._wrapped.deserialize(infos, args)
            results: list[Any] = [None] * len(infos)
            here = []
            for k, arg in enumerate(args):
                results[k] = _restored_elsewhere(arg)
                if results[k] is None:
                    here.append(k)
            if here:
                got = await self._wrapped.deserialize(
                    [infos[k] for k in here], [args[k] for k in here]
                )
                for k, value in zip(here, got):
                    results[k] = value
            if jax.process_count() > 1:  # every process, each restore: an exchange
                await asyncio.to_thread(_record_restored, results)
            return results

    return PipelineArrayHandler
