"""pipemark.failures without processes: how an error is worded, published to the
launcher's directory and to a store, read back and named. A store here is a stand-in
for the coordinator's (``key_value_set``, ``key_value_dir_get``); the real one is
exercised by the multi-process tests (tests/runtime/test_distributed.py,
tests/test_launch.py)."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from pipemark import failures
from pipemark.errors import ProcessError
from pipemark.failures import Failure


class Store:
    """A key-value store like the coordinator's: ``key_value_dir_get`` lists the
    entries under a prefix; ``after`` entries appear only from that many reads on."""

    def __init__(self, after: int = 0) -> None:
        self.entries: dict[str, str] = {}
        self.reads = 0
        self.after = after

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if key in self.entries and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.entries[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        self.reads += 1
        if self.reads <= self.after:
            return []
        return [(k, v) for k, v in self.entries.items() if k.startswith(prefix)]


@pytest.fixture
def store(monkeypatch):
    store = Store()
    monkeypatch.setattr(failures, "_client", lambda: store)
    return store


def test_an_error_is_its_type_and_first_line():
    assert failures.error_line(ValueError("boom in process 1\nmore")) == (
        "ValueError: boom in process 1"
    )
    assert failures.error_line(RuntimeError()) == "RuntimeError"
    long = failures.error_line(ValueError("x" * 1000))
    assert long.startswith("ValueError: xxx") and long.endswith("...") and len(long) < 320
    failure = failures.failure_of(ValueError("boom"), 1)
    assert (failure.process, failure.text, failure.raised, failure.reaction) == (
        1,
        "ValueError: boom",
        True,
        False,
    )
    # A ProcessError follows another process's failure: not the cause.
    assert failures.failure_of(ProcessError("process 0: lost"), 0).reaction


def test_failures_are_named_the_cause_first():
    own = Failure(2, "ValueError: boom", time=5.0)
    reaction = Failure(1, "ProcessError: process 1: lost", reaction=True, time=4.0)
    stopped = Failure(3, "waited more than 5 s for x from process 2", False, True, 6.0)
    assert str(own) == "process 2 raised ValueError: boom"
    assert str(stopped) == "process 3 waited more than 5 s for x from process 2"
    ordered = failures._ordered([stopped, reaction, own])
    assert ordered == [own, reaction, stopped]
    assert failures.name_failures(ordered) == (
        "process 2 raised ValueError: boom (processes 1, 3 failed too)"
    )


def test_a_published_failure_reaches_the_launcher_and_the_store(tmp_path, monkeypatch, store):
    monkeypatch.setenv(failures.FAILURES_DIR, str(tmp_path))
    first = Failure(1, "ValueError: boom in process 1", time=1.0)
    failures.publish(first)
    failures.publish(Failure(1, "ProcessError: later", time=2.0))  # the first stays
    failures.publish(Failure(0, "KeyError: 'x'", time=3.0))
    assert failures.launched_failures(str(tmp_path)) == {
        1: first,
        0: Failure(0, "KeyError: 'x'", time=3.0),
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]  # no part left
    assert json.loads(store.entries["pipemark/failure/1"])["text"] == first.text
    # Each process reads the others' only.
    assert failures.peer_failures(0, wait_s=0) == [first]
    assert [f.process for f in failures.peer_failures(2, wait_s=0)] == [1, 0]


def test_nothing_is_read_where_nothing_was_written(tmp_path):
    (tmp_path / "1.part").write_text("{")
    (tmp_path / "2").write_text("not ours")
    assert failures.launched_failures(str(tmp_path)) == {}
    assert failures.launched_failures(str(tmp_path / "absent")) == {}


def test_a_reader_waits_for_a_failure_being_published(store):
    store.after = 3  # published while the reader looks
    failures.publish(Failure(1, "ValueError: boom"))
    assert failures.peer_failures(0, wait_s=60) == [Failure(1, "ValueError: boom")]
    assert store.reads == 4
    store.after, store.reads = 10**9, 0  # never: the wait ends
    assert failures.peer_failures(0, wait_s=0.2) == []


def test_a_store_that_fails_or_blocks_is_no_failure(monkeypatch):
    class Gone:
        def key_value_dir_get(self, prefix):
            raise RuntimeError("UNAVAILABLE: Socket closed")

        key_value_set = key_value_dir_get

    monkeypatch.setattr(failures, "_client", Gone)
    failures.publish(Failure(1, "ValueError: boom"))
    assert failures.peer_failures(0) == []
    release = threading.Event()

    class Blocked:
        def key_value_dir_get(self, prefix):
            release.wait()
            return []

    monkeypatch.setattr(failures, "_client", Blocked)
    try:
        assert failures.peer_failures(0, wait_s=0.1) == []
    finally:
        release.set()


def test_an_uncaught_error_is_published_after_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv(failures.FAILURES_DIR, str(tmp_path))
    monkeypatch.setattr(failures, "_installed", False)
    monkeypatch.setattr(failures, "_process", lambda: 1)
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: printed.append(args[1]))
    failures.install()
    hook = sys.excepthook
    failures.install()  # once per process
    assert sys.excepthook is hook
    error = ValueError("boom in process 1")
    sys.excepthook(ValueError, error, None)
    assert printed == [error]
    assert failures.launched_failures(str(tmp_path))[1].text == "ValueError: boom in process 1"
