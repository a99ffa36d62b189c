"""How values move between the slots of a pipeline: the :class:`Transport` protocol and
its two transports, :class:`InProcessTransport` (a copy onto the reader's slot, within
one process) and :class:`CollectiveTransport` (between the processes of a
multi-controller JAX program, ``jax.distributed``), and :class:`Watchdog`, which stops a
process that waits too long for another. A new transport is a class here with
:meth:`Transport.move`.

Across processes, a transfer is one point-to-point collective: both processes call the same compiled
program, ``shard_map`` of ``lax.ppermute`` over a two-device mesh (the sender's device,
the receiver's), on a global array whose shard on the sender's device is the value and
whose shard on the receiver's device is a placeholder of the same type. After it, the
receiver's shard holds the value. On CPU the collectives run over gloo (JAX's default
for CPU), on GPU over NCCL; nothing here depends on which. Cross-process
``jax.device_put`` would do the same but needs experimental flags
(``jax_cross_host_transfer_socket_address``, ``jax_cross_host_transport_addresses``).

Every process must run the transfers it takes part in in the same order; the runtime
walks one global order (the schedule's) in every process for that, on a thread of its
own. A transfer is waited for (:meth:`CollectiveTransport.move` returns once it is
done) with the :class:`Watchdog` armed: on CPU, dispatching the collective already
blocks until the other process arrives (XLA runs it on the dispatching thread), so
returning earlier would gain nothing, and waiting keeps the order of collectives
that of the calls. The runtime's workers never wait for a transfer: they dispatch
their next actions meanwhile.

The program of a transfer is built in one function, ``_pair(source, target, types)``:
for slots of one device each; slots on sub-meshes generalise it. Both compile it ahead,
on a thread of their own, and call the compiled program: both ends then run the same
executable whichever lines of the caller's code send and receive (a program carries the
source line that traced it, and on JAX 0.12.1 two processes whose programs differ in it
never meet).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipemark._compat import global_array_maker, shard_map
from pipemark.caches import register_cache
from pipemark.errors import ProcessError
from pipemark.failures import Failure, error_line, name_failures, peer_failures, publish
from pipemark.runtime.devices.placement import Slot, put_on

__all__ = ["CollectiveTransport", "InProcessTransport", "Transport", "Watchdog"]


class Transport(Protocol):
    """Moves values from one slot to another; counts what it moved."""

    bytes_sent: int
    bytes_received: int
    seconds: float

    def move(
        self, values: Sequence[Any] | None, types: tuple, source: Slot, target: Slot, what: Any
    ) -> list[Any] | None:
        """Move ``values`` (of ``(shape, dtype)`` ``types``) from ``source`` to
        ``target``. A process owning (devices of) ``source`` passes the values (its
        view of them); a process owning devices of ``target`` gets the values on the
        slot (``None`` elsewhere). ``what`` names what moves, for a message: a string,
        or a function giving one.

        Every process calls it for every move it may be an end of, in the same order; a
        process that is neither end passes it by. Sending a stage's results to every
        other process (a gather) is one move to each receiving process's device."""
        ...


class InProcessTransport:
    """Copies onto the target slot, in this process: enqueued behind the programs
    computing the values, so nothing waits here. Counts the bytes it copied (each
    value's global size, as the stage graph counts them: a value replicated over some
    of the target's devices is counted once)."""

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.seconds = 0.0
        # The worker threads of one call share the transport: += on an attribute is not
        # atomic across threads.
        self._lock = threading.Lock()

    def move(
        self, values: Sequence[Any] | None, types: tuple, source: Slot, target: Slot, what: Any
    ) -> list[Any] | None:
        values = list(values or ())
        nbytes = sum(v.nbytes for v in values)
        with self._lock:
            self.bytes_sent += nbytes
            self.bytes_received += nbytes
        if target.mesh is None:
            return put_on(values, target)
        # Onto the target sub-mesh in the value's own layout (same axes, same shape).
        return jax.device_put(values, [_layout_on(target, v) for v in values])


def _layout_on(target: Slot, value: Any) -> Any:
    """``value``'s layout on ``target``'s sub-mesh: its ``NamedSharding`` spec there, or
    the slot's own layout for a value without one."""
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape == target.mesh.shape:
        return NamedSharding(target.mesh, sharding.spec)
    return target.sharding


class Watchdog:
    """Stops this process (``process``, the placement's index of it), saying on standard
    error what it waited for, and the error another process failed with where one
    published it (:mod:`pipemark.failures`), when a wait started by :meth:`arm` lasts
    longer than ``timeout_s``; what it waited for is published in turn. A process
    blocked in a collective whose peer died or raised cannot be interrupted from
    Python: exiting is the only bounded way out (the launcher, :mod:`pipemark.launch`,
    then stops the others)."""

    #: The exit status of a process the watchdog stopped.
    EXIT_STATUS = 75

    def __init__(self, timeout_s: float | None, process: int) -> None:
        self.timeout_s = timeout_s
        self.process = process
        # What the current wait is for and when it times out, as one tuple (or None):
        # one attribute store arms or disarms, so the hot path (a wait per transfer)
        # takes no lock, and the watching thread reads a consistent pair.
        self._waiting: tuple[float, Any] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, what: Any) -> None:
        """A blocking wait starts; ``what`` (a string, or a function giving one, called
        only on a timeout) says what it waits for. :meth:`disarm` when it ends."""
        if self.timeout_s is None:
            return
        self._waiting = (time.monotonic() + self.timeout_s, what)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="pipemark-watchdog", daemon=True
            )
            self._thread.start()

    def disarm(self) -> None:
        self._waiting = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.timeout_s or 1.0, 0.05) / 4))
            waiting = self._waiting
            if waiting is not None and time.monotonic() > waiting[0]:
                message, failure = self._stopping(waiting[1])
                print(message, file=sys.stderr, flush=True)
                publish(failure)
                os._exit(self.EXIT_STATUS)

    def _stopping(self, what: Any) -> tuple[str, Failure]:
        """What this process says as it stops after waiting too long for ``what``, and
        the failure it publishes for the others."""
        waited = f"waited more than {self.timeout_s:g} s "
        waited += what() if callable(what) else what
        failed = peer_failures(self.process)
        why = name_failures(failed) if failed else "that process has died, raised or hangs"
        message = (
            f"pipemark: process {self.process} {waited}; {why}. Stopping this process "
            "(PipelineOptions.timeout_s)."
        )
        return message, Failure(self.process, waited, False, True, time.time())


class CollectiveTransport:
    """Point-to-point transfers between two devices of different processes, and the
    bytes they moved (:attr:`bytes_sent`, :attr:`bytes_received`), made by process
    ``process`` (the placement's index of this process); ``watchdog`` stops it when a
    transfer waits too long."""

    def __init__(self, watchdog: Watchdog, process: int) -> None:
        self.watchdog = watchdog
        self.process = process
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0

    def move(
        self, values: Sequence[Any] | None, types: tuple, source: Slot, target: Slot, what: Any
    ) -> list[Any] | None:
        if source.mesh is not None:
            return self._move_between_meshes(values, types, source, target, what)
        if source.process == self.process:
            self.send(values, source.device, target.device, what)
            return None
        if target.process == self.process:
            return self.receive(types, source.device, target.device, what)
        return None

    def _move_between_meshes(
        self, values: Sequence[Any] | None, types: tuple, source: Slot, target: Slot, what: Any
    ) -> list[Any] | None:
        """One collective over both sub-meshes: each device of ``source`` sends its
        shard to the device at the same position of ``target`` (both slots have the
        same mesh shape, and the values their ``sharding``). Every process owning
        devices of either slot takes part: with its shards of the values where it owns
        some of ``source`` (then ``values`` are this process's view of them), with
        placeholders on its devices of ``target``, where it gets its shards of the
        results (a sub-mesh may span processes)."""
        types = tuple((tuple(s), np.dtype(d)) for s, d in types)
        me = self.process
        if me not in source.processes | target.processes:
            return None
        pair = _mesh_pair(source, target, types, me)
        arrays = pair.placeholders
        if me in source.processes:
            # Both ends agree on the slot's layout (the receiver cannot see the
            # sender's): a value in another one is resharded first, over the source.
            values = [
                v if v.sharding == source.sharding else jax.device_put(v, source.sharding)
                for v in values or ()
            ]
            arrays = [
                make([*(s.data.reshape(1, *s.data.shape) for s in v.addressable_shards), *held])
                for make, v, held in zip(pair.makers, values, pair.placeholders)
            ]
        # A message names another process of the collective (a receiver, where there
        # is one: a sender waits for those).
        ends = (*target.devices, *source.devices) if me in source.processes else source.devices
        peer = next((d for d in ends if d.process_index != me), target.device)
        verb = (
            ("sending", what, "to", peer) if me in source.processes else ("for", what, "from", peer)
        )
        out = self._transfer(pair.program, arrays, verb)
        if me in source.processes:
            self.bytes_sent += pair.nbytes
        if me not in target.processes:
            return None
        self.bytes_received += pair.nbytes
        mine = set(target.devices)
        return [
            jax.make_array_from_single_device_arrays(
                shape,
                target.sharding,
                [
                    s.data.reshape(s.data.shape[1:])
                    for s in array.addressable_shards
                    if s.device in mine
                ],
            )
            for array, (shape, _) in zip(out, types)
        ]

    def send(self, values: Sequence[Any], source: Any, target: Any, what: Any) -> None:
        """Send ``values`` (on ``source``, a device of this process: the runtime's come
        from programs compiled for it) to ``target``; the process owning ``target``
        calls :meth:`receive` at the same point. ``what`` names what moves, for a
        message: a string, or a function giving one."""
        types = tuple((tuple(v.shape), np.dtype(v.dtype)) for v in values)
        pair = _pair(source, target, types, self.process)
        arrays = [make([_as_block(v)]) for make, v in zip(pair.makers, values)]
        self._transfer(pair.program, arrays, ("sending", what, "to", target))
        self.bytes_sent += pair.nbytes

    def receive(self, types: Sequence[tuple], source: Any, target: Any, what: Any) -> list[Any]:
        """The values ``source``'s process sends with :meth:`send`, on ``target`` (a
        device of this process); ``types`` are their ``(shape, dtype)``."""
        types = tuple((tuple(s), np.dtype(d)) for s, d in types)
        pair = _pair(source, target, types, self.process)
        out = self._transfer(pair.program, pair.placeholders, ("for", what, "from", source))
        values = [a.addressable_data(0) for a in out]
        values = [v.reshape(s) if v.shape != s else v for v, (s, _) in zip(values, types)]
        self.bytes_received += pair.nbytes
        return values

    def _transfer(self, program: Any, arrays: list[Any], what: tuple) -> list[Any]:
        """Run the transfer and wait for it to finish. A collective that fails, or
        never ends, because the other process is gone becomes a clear error (starting
        one may block too: the first transfer between two processes connects them),
        naming the error another process published where one did
        (:mod:`pipemark.failures`). ``what`` says what moves, to or from which device;
        the message is only built when it is needed."""
        start = time.perf_counter()
        watchdog = self.watchdog
        watchdog.arm(functools.partial(_says, what))
        try:
            out = program(arrays)
            for array in out:
                array.block_until_ready()
        except Exception as error:
            failed = peer_failures(self.process)
            if failed:
                why = f": {name_failures(failed)}"
            else:
                why = f"; that process has probably died or raised ({error_line(error)})"
            raise ProcessError(
                f"process {self.process}: the transfer {_says(what)} failed{why}."
            ) from error
        finally:
            watchdog.disarm()
        self.seconds += time.perf_counter() - start
        return out


def _says(what: tuple) -> str:
    """``("sending", "x", "to", device)`` -> ``"sending x to process 1"``; ``"x"`` may
    be a function giving it (the runtime's, which words it only when needed)."""
    verb, value, way, device = what
    value = value() if callable(value) else value
    return f"{verb} {value} {way} process {device.process_index}"


def _as_block(value: Any) -> Any:
    """``value`` with at least one axis (the pair's shards split the first)."""
    return value.reshape(1) if value.ndim == 0 else value


class _Pair(NamedTuple):
    """What transfers of values of some types between two devices share."""

    program: Any  # the compiled transfer
    makers: list[Any]  # per value: its global array from the sender's shard
    # The receiving end's arguments (on its process); between sub-meshes, in a process
    # that also sends, per value its blocks on its devices of the receiving sub-mesh.
    placeholders: list[Any] | None
    nbytes: int  # the bytes one transfer moves (jax.Array.nbytes costs ~10 µs a value)


@functools.lru_cache(maxsize=256)
def _pair(source: Any, target: Any, types: tuple, process: int) -> _Pair:
    """The compiled transfer of values of ``types`` from ``source`` to ``target``, how
    the sender makes its global arrays, and, where this process (``process``) owns
    ``target``, the
    global arrays the receiving end passes (placeholders of those types: immutable, so
    one set serves every transfer). One sharding object per pair and types: jit's fast
    dispatch path recognises an argument's sharding by identity, and a new (equal) one
    each call sent every transfer down the slow path (about 0.15 ms each)."""
    mesh = Mesh(np.array([source, target]), ("pair",))

    def move(blocks: list[Any]) -> list[Any]:
        return [lax.ppermute(b, "pair", perm=[(0, 1)]) for b in blocks]

    spec = P("pair")
    sharding = NamedSharding(mesh, spec)
    # Each global array holds a value's block on each device: the first axis doubles.
    blocks = [shape or (1,) for shape, _ in types]
    program = _compiled(
        shard_map(move, mesh=mesh, in_specs=(spec,), out_specs=spec),
        [((2 * b[0], *b[1:]), dtype) for b, (_, dtype) in zip(blocks, types)],
        sharding,
    )
    makers = [
        global_array_maker((2 * b[0], *b[1:]), dtype, sharding)
        for b, (_, dtype) in zip(blocks, types)
    ]
    placeholders = None
    if target.process_index == process:
        placeholders = [
            make([jax.device_put(np.zeros(b, dtype), target)])
            for make, b, (_, dtype) in zip(makers, blocks, types)
        ]
    nbytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in types)
    return _Pair(program, makers, placeholders, nbytes)


register_cache(_pair.cache_clear)


def _compiled(move: Any, types: list[tuple], sharding: NamedSharding) -> Any:
    """``jax.jit(move)`` compiled for a list of global arrays of ``types`` laid out by
    ``sharding``, the same executable in every process: lowered on a thread of its own.

    XLA's programs carry the source line of the Python code that traced them, and on
    JAX 0.12.1 two processes whose collective programs differ in those lines alone
    never meet (the transfer waits forever). Traced where the sender calls
    :meth:`CollectiveTransport.send` and the receiver :meth:`~CollectiveTransport.receive`,
    from different lines of a script, they would differ. On a new thread every frame
    above the tracing is the standard library's, pipemark's or JAX's, which JAX leaves
    out of the locations: the programs are alike whoever calls. (The runtime's own
    transfers ran on such a thread already.) Calling the compiled program, not the
    ``jit``, guarantees no call traces it again from the caller's line."""
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in types]
    done: dict[str, Any] = {}

    def compile_() -> None:
        try:
            done["program"] = jax.jit(move).lower(specs).compile()
        except BaseException as error:  # raised in the caller's thread below
            done["error"] = error

    thread = threading.Thread(target=compile_, name="pipemark-transfer-compile")
    thread.start()
    thread.join()
    if "error" in done:
        raise done["error"]
    return done["program"]


@functools.lru_cache(maxsize=256)
def _mesh_pair(source: Slot, target: Slot, types: tuple, process: int) -> _Pair:
    """The compiled transfer of values of ``types``, each laid out by its slot's
    ``sharding``, from sub-mesh ``source`` to sub-mesh ``target`` (of the same shape):
    ``shard_map`` of ``lax.ppermute`` over a mesh that stacks the two along a new
    ``pair`` axis, on global arrays whose first axis (size 2) is that one."""
    names = tuple(source.mesh.axis_names)
    mesh = Mesh(np.stack([source.mesh.devices, target.mesh.devices]), ("pair", *names))
    spec = P("pair", *source.sharding.spec)
    sharding = NamedSharding(mesh, spec)

    def move(blocks: list[Any]) -> list[Any]:
        return [lax.ppermute(b, "pair", perm=[(0, 1)]) for b in blocks]

    program = _compiled(
        shard_map(move, mesh=mesh, in_specs=(spec,), out_specs=spec),
        [((2, *shape), dtype) for shape, dtype in types],
        sharding,
    )
    # The public constructor, which places each shard by its device (the shards come in
    # the source array's order).
    makers = [
        functools.partial(jax.make_array_from_single_device_arrays, (2, *shape), sharding)
        for shape, _ in types
    ]
    # Per value, the blocks this process passes on its devices of ``target`` (none
    # where it owns none): placeholders of the values' type, where the results land.
    mine = [d for d in target.devices if d.process_index == process]
    placeholders = []
    for shape, dtype in types:
        block = np.zeros((1, *target.sharding.shard_shape(shape)), dtype)
        placeholders.append([jax.device_put(block, d) for d in mine])
    if process not in source.processes:  # the whole arguments: placeholders alone
        placeholders = [make(held) for make, held in zip(makers, placeholders)]
    nbytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in types)
    return _Pair(program, makers, placeholders, nbytes)


register_cache(_mesh_pair.cache_clear)
