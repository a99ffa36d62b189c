"""How a process waits for another's value on the coordinator's store, without
processes: a store that times out, one that is gone, and another process's failure
published meanwhile (pipemark.failures), which ends the wait at once. The agreement
itself, between processes: tests/runtime/test_distributed.py."""

from __future__ import annotations

import pytest

from pipemark.errors import ProcessError
from pipemark.failures import Failure
from pipemark.runtime.devices import agreement

HEAD = "process 0: process 1 did not start pipeline call 3"
GUESS = "it died, hangs, or reused an earlier input shape"


class Store:
    """``blocking_key_value_get`` times out (after its timeout, on a clock of its own:
    no test sleeps) ``waits`` times, then answers; with ``gone``, it fails at once."""

    def __init__(self, waits: int = 0, gone: bool = False) -> None:
        self.waits, self.gone, self.calls = waits, gone, []

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        self.calls.append(timeout_in_ms)
        if self.gone:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        if len(self.calls) <= self.waits:
            _clock[0] += timeout_in_ms / 1000
            raise TimeoutError("DEADLINE_EXCEEDED")
        return '"theirs"'


_clock = [0.0]


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    _clock[0] = 0.0
    monkeypatch.setattr(agreement.time, "monotonic", lambda: _clock[0])


def test_a_value_published_in_time_is_read(monkeypatch):
    monkeypatch.setattr(agreement, "peer_failures", lambda me, wait_s: [])
    store = Store(waits=3)
    assert agreement._published(store, "k", 0, 10.0, HEAD, GUESS) == '"theirs"'
    assert store.calls == [1000] * 4  # in slices of a second


def test_a_value_never_published_is_named_after_the_timeout(monkeypatch):
    monkeypatch.setattr(agreement, "peer_failures", lambda me, wait_s: [])
    store = Store(waits=10**9)
    with pytest.raises(ProcessError) as raised:
        agreement._published(store, "k", 0, 2.5, HEAD, GUESS)
    assert str(raised.value) == f"{HEAD} within 2.5 s: {GUESS} (TimeoutError)."
    assert store.calls == [1000, 1000, 500]


def test_a_store_that_is_gone_ends_the_wait_at_once(monkeypatch):
    monkeypatch.setattr(agreement, "peer_failures", lambda me, wait_s: [])
    store = Store(gone=True)
    with pytest.raises(ProcessError) as raised:
        agreement._published(store, "k", 0, 60.0, HEAD, GUESS)
    assert str(raised.value) == f"{HEAD} within 60 s: {GUESS} (RuntimeError)."
    assert len(store.calls) == 1


def test_a_failure_another_process_published_ends_the_wait(monkeypatch):
    boom = Failure(1, "ValueError: boom in process 1")
    store = Store(waits=10**9)
    monkeypatch.setattr(
        agreement, "peer_failures", lambda me, wait_s: [boom] if len(store.calls) >= 2 else []
    )
    with pytest.raises(ProcessError) as raised:
        agreement._published(store, "k", 0, 60.0, HEAD, GUESS)
    assert str(raised.value) == f"{HEAD}: process 1 raised ValueError: boom in process 1."
    assert len(store.calls) == 2  # not the whole minute
