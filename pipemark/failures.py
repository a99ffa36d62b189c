"""What a process of a ``jax.distributed`` job that fails tells the others: its error,
published where they can read it, so that a process left waiting for it (and the
launcher, :mod:`pipemark.launch`) names that error instead of guessing that the process
"died, raised or hangs".

A process that raises publishes a :class:`Failure` (its index, the error's type and
first line, when) from ``sys.excepthook``, which :func:`install` sets (chaining the one
before it); :func:`pipemark.launch.initialize` installs it, and so does a pipeline the
first time it runs across processes (for a script a cluster's launcher started). A
process that its pipeline's watchdog stops publishes what it waited for. It goes to the
coordinator's key-value store, which every process of the job reaches, and, under
``python -m pipemark.launch``, to a file in the directory the launcher names in
``PIPEMARK_FAILURES``. A message telling of another process's failure reads the others'
(:func:`peer_failures`, which waits a moment for one: the other may be publishing right
then) and names them (:func:`name_failures`); with none published it keeps its guess.

The store lives in process 0, the coordinator: when process 0 itself fails, the others
cannot read it (JAX stops them itself then: "the JAX distributed service detected fatal
errors"), and only the launcher, reading process 0's file, names its error. Publishing
and reading are bounded (:data:`WAIT_S`): a store that cannot be reached costs at most
that, never a hang.

>>> failure = Failure(1, "ValueError: boom in process 1")
>>> name_failures([failure])
'process 1 raised ValueError: boom in process 1'
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "FAILURES_DIR",
    "WAIT_S",
    "Failure",
    "error_line",
    "failure_of",
    "install",
    "launched_failures",
    "name_failures",
    "peer_failures",
    "publish",
]

#: The environment variable in which :mod:`pipemark.launch` names the directory its
#: processes write their failures to (one file each, named by the process index).
FAILURES_DIR = "PIPEMARK_FAILURES"

#: The most seconds publishing a failure, or waiting for another process's, takes.
WAIT_S = 2.0

# Each process's failure on the coordinator's store: the prefix, then its index.
_PREFIX = "pipemark/failure/"
# The longest first line a failure keeps: a message names it among other words.
_LONGEST = 300


@dataclasses.dataclass(frozen=True)
class Failure:
    """How process ``process`` failed: ``text`` is the error it raised, its type and
    first line (``"ValueError: boom"``), or, where it stopped without raising
    (``raised`` false), what it did (``"waited more than 5 s for ..."``).
    ``reaction``: it followed another process's failure (a
    :class:`~pipemark.errors.ProcessError`: a transfer with a process that was gone, a process
    that did not answer). ``time``: when, in seconds since the epoch."""

    process: int
    text: str
    raised: bool = True
    reaction: bool = False
    time: float = 0.0

    def __str__(self) -> str:
        return f"process {self.process} {'raised ' if self.raised else ''}{self.text}"


def error_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message, in a few hundred characters
    at most.

    >>> error_line(KeyError("batch"))
    "KeyError: 'batch'"
    """
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if len(first) > _LONGEST:
        first = first[: _LONGEST - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def failure_of(error: BaseException, process: int) -> Failure:
    """``error``, raised in process ``process`` now, as a :class:`Failure`.

    >>> failure_of(ValueError("boom"), 1).text
    'ValueError: boom'
    """
    from pipemark.errors import ProcessError

    reaction = isinstance(error, ProcessError)
    return Failure(process, error_line(error), True, reaction, time.time())


def publish(failure: Failure) -> None:
    """Tell the other processes (and the launcher) about ``failure``, this process's:
    within :data:`WAIT_S`, never raising (the process is failing already). The first
    failure a process publishes stays: a later one is its consequence.

    >>> publish(Failure(1, "ValueError: boom"))  # alone: nobody to tell, nothing done
    """
    text = json.dumps(dataclasses.asdict(failure))
    directory = os.environ.get(FAILURES_DIR)
    if directory:
        path = os.path.join(directory, str(failure.process))
        if not os.path.exists(path):
            try:  # whole or not at all: the launcher may read it any time
                with open(f"{path}.part", "w") as file:
                    file.write(text)
                os.replace(f"{path}.part", path)
            except OSError:
                pass
    client = _client()
    if client is not None:
        _bounded(lambda: client.key_value_set(f"{_PREFIX}{failure.process}", text), WAIT_S)


def install() -> None:
    """Have an exception that nothing catches publish this process's :class:`Failure`
    after the hook before prints it; once per process (a later call does nothing).
    Only under ``jax.distributed``, which says this process's index.

    >>> install()  # pipemark.launch.initialize() and a pipeline across processes do
    """
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        process = _process()
        if process is not None and isinstance(value, BaseException):
            publish(failure_of(value, process))

    sys.excepthook = hook


_installed = False


def peer_failures(me: int, wait_s: float = WAIT_S) -> list[Failure]:
    """The failures the processes other than ``me`` published, a process's own error
    before one that followed another's, each kind earliest first; where there is none
    yet, waits up to ``wait_s`` for one. Empty outside ``jax.distributed`` and where
    the store cannot be reached (its process is gone).

    >>> peer_failures(0)  # not under jax.distributed
    []
    """
    client = _client()
    if client is None:
        return []
    deadline = time.monotonic() + wait_s

    def read() -> list[Failure]:
        while True:
            # The client's error type differs by jaxlib; an error: the store is gone.
            entries = client.key_value_dir_get(_PREFIX)
            found = [f for f in (_parse(v) for _, v in entries) if f and f.process != me]
            if found or time.monotonic() >= deadline:
                return _ordered(found)
            time.sleep(0.05)

    return _bounded(read, wait_s) or []


def name_failures(failures: Iterable[Failure]) -> str:
    """The first of ``failures`` (:func:`peer_failures` orders them), and which other
    processes failed too.

    >>> name_failures([Failure(2, "ValueError: boom"), Failure(1, "ProcessError: lost")])
    'process 2 raised ValueError: boom (process 1 failed too)'
    """
    first, *rest = failures
    if not rest:
        return str(first)
    which = ", ".join(str(f.process) for f in rest)
    return f"{first} (process{'es' if len(rest) > 1 else ''} {which} failed too)"


def launched_failures(directory: str) -> dict[int, Failure]:
    """The failures the launched processes wrote to ``directory``, by process index
    (:data:`FAILURES_DIR`).

    >>> launched_failures("/no/such/directory")
    {}
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    found = {}
    for name in names:
        if name.isdigit():
            try:
                with open(os.path.join(directory, name)) as file:
                    failure = _parse(file.read())
            except OSError:
                continue
            if failure is not None:
                found[int(name)] = failure
    return found


def _ordered(failures: Iterable[Failure]) -> list[Failure]:
    """A process's own error first (the likelier cause), then by time."""
    return sorted(failures, key=lambda f: (f.reaction, f.time))


def _parse(text: str) -> Failure | None:
    try:
        return Failure(**json.loads(text))
    except (TypeError, ValueError):  # not one of ours
        return None


def _client() -> Any:
    if "jax" not in sys.modules:  # not a JAX process (the launcher): no store
        return None
    from pipemark._compat import coordination_client

    return coordination_client()


def _process() -> int | None:
    """This process's index under ``jax.distributed``, else ``None``."""
    if "jax" not in sys.modules:
        return None
    from pipemark._compat import coordination_process

    return coordination_process()


def _bounded(function: Callable[[], Any], seconds: float) -> Any:
    """``function()``, or ``None`` where it raises or takes much more than ``seconds``
    (a call to a store that cannot be reached may block): run on a thread of its own,
    left behind if it does not return."""
    done: list[Any] = []

    def run() -> None:
        with contextlib.suppress(Exception):  # the client's error type differs by jaxlib
            done.append(function())

    thread = threading.Thread(target=run, name="pipemark-failures", daemon=True)
    thread.start()
    thread.join(seconds + 0.5)
    return done[0] if done else None
