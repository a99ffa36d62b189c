"""Moving arrays between the processes of a multi-controller JAX program
(``jax.distributed``): :class:`Transport`, and :class:`Watchdog`, which stops a process
that waits too long for another.

A transfer is one point-to-point collective: both processes call the same compiled
program, ``shard_map`` of ``lax.ppermute`` over a two-device mesh (the sender's device,
the receiver's), on a global array whose shard on the sender's device is the value and
whose shard on the receiver's device is a placeholder of the same type. After it, the
receiver's shard holds the value. On CPU the collectives run over gloo (JAX's default
for CPU), on GPU over NCCL; nothing here depends on which. Cross-process
``jax.device_put`` would do the same but needs experimental flags
(``jax_cross_host_transfer_socket_address``, ``jax_cross_host_transport_addresses``).

Every process must run the transfers it takes part in in the same order; the runtime
walks one global order (the schedule's) in every process for that.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipemark._compat import shard_map
from pipemark.caches import register_cache
from pipemark.errors import ProcessError

__all__ = ["Transport", "Watchdog"]


class Watchdog:
    """Stops this process, with ``message`` on standard error, when a wait started by
    :meth:`waiting` lasts longer than ``timeout_s``. A process blocked in a collective
    whose peer died or raised cannot be interrupted from Python: exiting is the only
    bounded way out (the launcher, :mod:`pipemark.launch`, then stops the others)."""

    #: The exit status of a process the watchdog stopped.
    EXIT_STATUS = 75

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._deadline: float | None = None
        self._message = ""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def waiting(self, message: str) -> _Wait:
        """A context manager around one blocking wait; ``message`` says what for."""
        return _Wait(self, message)

    def _arm(self, message: str) -> None:
        if self.timeout_s is None:
            return
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s
            self._message = message
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="pipemark-watchdog", daemon=True
                )
                self._thread.start()

    def _disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.timeout_s or 1.0, 0.05) / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                message = self._message
            if late:
                print(
                    f"pipemark: process {jax.process_index()} waited more than "
                    f"{self.timeout_s:g} s {message}; that process has died, raised or "
                    "hangs. Stopping this process (PipelineOptions.timeout_s).",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(self.EXIT_STATUS)


class _Wait:
    def __init__(self, watchdog: Watchdog, message: str) -> None:
        self.watchdog, self.message = watchdog, message

    def __enter__(self) -> None:
        self.watchdog._arm(self.message)

    def __exit__(self, *exc: Any) -> None:
        self.watchdog._disarm()


class Transport:
    """Point-to-point transfers between two devices of different processes, and the
    bytes they moved (:attr:`bytes_sent`, :attr:`bytes_received`)."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0

    def send(self, values: Sequence[Any], source: Any, target: Any, what: str) -> None:
        """Send ``values`` (on ``source``, a device of this process) to ``target``;
        the process owning ``target`` calls :meth:`receive` at the same point."""
        types = tuple((tuple(v.shape), np.dtype(v.dtype)) for v in values)
        shards = [_as_block(v) for v in values]
        self._transfer(
            shards, types, source, target, f"sending {what} to process {target.process_index}"
        )
        self.bytes_sent += sum(v.nbytes for v in values)

    def receive(self, types: Sequence[tuple], source: Any, target: Any, what: str) -> list[Any]:
        """The values ``source``'s process sends with :meth:`send`, on ``target`` (a
        device of this process); ``types`` are their ``(shape, dtype)``."""
        types = tuple((tuple(s), np.dtype(d)) for s, d in types)
        shards = [_placeholder(s, d, target) for s, d in types]
        what = f"for {what} from process {source.process_index}"
        out = self._transfer(shards, types, source, target, what)
        values = [a.addressable_data(0) for a in out]
        values = [v.reshape(s) if v.shape != s else v for v, (s, _) in zip(values, types)]
        self.bytes_received += sum(v.nbytes for v in values)
        return values

    def _transfer(
        self, shards: list[Any], types: tuple, source: Any, target: Any, what: str
    ) -> list[Any]:
        """Run the transfer and wait for it to finish. A collective that fails, or
        never ends, because the other process is gone becomes a clear error (starting
        one may block too: the first transfer between two processes connects them)."""
        start = time.perf_counter()
        with self.watchdog.waiting(what):
            try:
                sharding, program = _transfer_program(source, target, types)
                arrays = [
                    jax.make_array_from_single_device_arrays(
                        (2 * shard.shape[0], *shard.shape[1:]), sharding, [shard]
                    )
                    for shard in shards
                ]
                out = jax.block_until_ready(program(arrays))
            except Exception as error:
                first = str(error).splitlines()[0] if str(error) else ""
                raise ProcessError(
                    f"process {jax.process_index()}: the transfer {what} failed; that "
                    f"process has probably died or raised ({type(error).__name__}: {first})."
                ) from error
        self.seconds += time.perf_counter() - start
        return out


def _as_block(value: Any) -> Any:
    """``value`` with at least one axis (the pair's shards split the first)."""
    return value.reshape(1) if value.ndim == 0 else value


@functools.lru_cache(maxsize=256)
def _placeholder(shape: tuple, dtype: Any, device: Any) -> Any:
    # Immutable: one placeholder per type serves every transfer that receives it.
    block = shape or (1,)
    return jax.device_put(np.zeros(block, dtype), device)


@functools.lru_cache(maxsize=256)
def _transfer_program(source: Any, target: Any, types: tuple) -> tuple[NamedSharding, Any]:
    """The sharding of a transfer's global arrays over the two devices, and the compiled
    transfer of values of ``types``. One sharding object per pair and types: jit's fast
    dispatch path recognises an argument's sharding by identity, and a new (equal)
    one each call sent every transfer down the slow path (about 0.15 ms each)."""
    del types  # part of the key: one compiled program per list of types
    mesh = Mesh(np.array([source, target]), ("pair",))

    def move(blocks: list[Any]) -> list[Any]:
        return [lax.ppermute(b, "pair", perm=[(0, 1)]) for b in blocks]

    spec = P("pair")
    program = jax.jit(shard_map(move, mesh=mesh, in_specs=(spec,), out_specs=spec))
    return NamedSharding(mesh, spec), program


register_cache(_placeholder.cache_clear)
register_cache(_transfer_program.cache_clear)
