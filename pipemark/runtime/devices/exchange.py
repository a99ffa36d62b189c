"""The values stages hand to each other within one process: :class:`Exchange`, shared
by the workers of one pipeline call."""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Cancelled", "Exchange"]


class Cancelled(Exception):
    """Raised in a worker waiting for a value when another worker has failed."""


class Exchange:
    """The values stages hand to each other, shared by the device workers.

    A producer publishes its outputs as soon as it has dispatched the program that
    computes them (an array not yet computed is a future: a reader can dispatch its own
    program against it, which XLA starts once the value is there), already copied to
    each reader's device; a reader takes its copy, waiting on its worker's condition if
    the producer has not dispatched yet. A copy is dropped once the last reader on its
    device has taken it (the runtime keeps the buffer alive while a program that reads
    it is pending).

    It also hands out turns (:meth:`wait_turn`, :meth:`pass_turn`): the threads of a
    call that must dispatch their programs in one order take turn 0, 1, ... in it.

    >>> exchange = Exchange(1)
    >>> exchange.wait_turn(0); exchange.pass_turn(); exchange.wait_turn(1)
    """

    def __init__(self, num_workers: int) -> None:
        self._lock = threading.Lock()
        self._arrived = [threading.Condition(self._lock) for _ in range(num_workers)]
        self._values: dict[tuple[tuple[int, int, int], int], list[Any]] = {}
        self.peak = 0
        self.error: BaseException | None = None
        self._turn = 0
        self._turned = threading.Condition(self._lock)

    def publish(self, entries: list[tuple[tuple[int, int, int], int, Any, int]]) -> None:
        with self._lock:
            for key, worker, value, count in entries:
                self._values[(key, worker)] = [value, count]
                self._arrived[worker].notify()  # one worker waits per condition
            self.peak = max(self.peak, len(self._values))

    def take(self, key: tuple[int, int, int], worker: int) -> tuple[Any, float]:
        """The copy of a value for ``worker`` (on its device), and the seconds spent
        waiting for its producer."""
        waited = 0.0
        with self._lock:
            slot = self._values.get((key, worker))
            if slot is None and self.error is None:
                start = time.perf_counter()
                arrived = self._arrived[worker]
                while slot is None and self.error is None:
                    arrived.wait()
                    slot = self._values.get((key, worker))
                waited = time.perf_counter() - start
            if self.error is not None:
                raise Cancelled
            slot[1] -= 1
            if not slot[1]:  # the last reader on this device has it
                del self._values[(key, worker)]
        return slot[0], waited

    def wait_turn(self, turn: int) -> None:
        """Wait until the turns before ``turn`` are passed (:meth:`pass_turn`)."""
        with self._lock:
            while self._turn != turn and self.error is None:
                self._turned.wait()
            if self.error is not None:
                raise Cancelled

    def pass_turn(self) -> None:
        """End the current turn: the thread waiting for the next one goes on."""
        with self._lock:
            self._turn += 1
            self._turned.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record the first error and wake every waiting worker so that it stops."""
        with self._lock:
            if self.error is None:
                self.error = error
            for arrived in self._arrived:
                arrived.notify_all()
            self._turned.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
