"""Start a script in several local processes under ``jax.distributed``, and stop them
all when one fails.

    python -m pipemark.launch -n 4 train.py --steps 10

starts ``train.py --steps 10`` four times, with the environment telling each its
process id, the process count and the coordinator's address (a free local port). The
script calls :func:`initialize` before anything else touches JAX (a script that also
runs alone calls it where :func:`launched` says it was launched; :func:`start_jax` does
both, and gives a CPU process its host devices). When a process exits
with an error (or is killed), the launcher says which, and the error it raised
(:mod:`pipemark.failures`), and stops the others, so a pipeline never waits on a
process that is gone; its exit status is that process's. A process that raises exits
at once (it does not wait for its peers at JAX's shutdown barrier), so the launcher
names it, not a peer it left waiting. SIGINT or SIGTERM sent to the launcher goes on to
every process; those still running 5 s later are killed.

    python -m pipemark.launch -n 2 -m my_package.train --steps 10   # a module

On a cluster, start the script the cluster's way (SLURM's ``srun``, ``mpirun``, a
Kubernetes job): :func:`initialize` then calls ``jax.distributed.initialize()``, which
reads the cluster's environment itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from pipemark import failures
from pipemark.errors import PipemarkError

__all__ = ["initialize", "launched", "start_jax", "launch", "main"]

_COORDINATOR = "PIPEMARK_COORDINATOR"
_NUM_PROCESSES = "PIPEMARK_NUM_PROCESSES"
_PROCESS_ID = "PIPEMARK_PROCESS_ID"
_INIT_TIMEOUT = "PIPEMARK_INIT_TIMEOUT"
_GRACE_S = 5.0  # how long a stopped process may take to exit before it is killed


def initialize() -> None:
    """``jax.distributed.initialize`` for this process: with the coordinator, process
    count and id :mod:`pipemark.launch` set, or else as the cluster says (SLURM, Open
    MPI, ... : ``jax.distributed.initialize()`` with no arguments).

    Call it once, before JAX creates its backends (before ``jax.devices()``).

    An exception that nothing catches is published for the other processes and the
    launcher, which name it (:mod:`pipemark.failures`); under the launcher it then ends
    the process at once, after printing its traceback, with status 1: JAX would
    otherwise hold it at the shutdown barrier for its peers (30 s, then a C++ abort),
    and the peers would report a process that hangs instead of the one that raised."""
    import jax

    coordinator = os.environ.get(_COORDINATOR)
    if coordinator is None:
        jax.distributed.initialize()
        failures.install()
        return
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ[_NUM_PROCESSES]),
        process_id=int(os.environ[_PROCESS_ID]),
        initialization_timeout=int(os.environ.get(_INIT_TIMEOUT, "60")),
        # A process that raised waits at exit for the others at a shutdown barrier;
        # a dead peer must not hold it there for JAX's default 5 minutes.
        shutdown_timeout_seconds=30,
    )
    failures.install()
    _exit_on_uncaught_exception()


def launched() -> bool:
    """Whether ``python -m pipemark.launch`` started this process: a script that runs
    alone as well as under the launcher calls :func:`initialize` only then.

    >>> from pipemark import launch
    >>> launch.launched()  # this process was not started by the launcher
    False
    """
    return _COORDINATOR in os.environ


def start_jax(cpu_devices: int | None = None) -> None:
    """Start JAX for a script that runs alone as well as under ``python -m
    pipemark.launch``: join the other processes where :func:`launched` says so
    (:func:`initialize`), and give this process ``cpu_devices`` host CPU devices unless
    the environment already says how many (``JAX_NUM_CPU_DEVICES``, or
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``). On an accelerator
    the CPU devices are not the ones JAX uses, and the setting changes nothing there.

    Call it first, before anything asks JAX for devices or runs an operation.

    >>> from pipemark import launch
    >>> launch.start_jax()  # alone, with no device count to set: nothing to do
    """
    if launched():
        initialize()
    told = "JAX_NUM_CPU_DEVICES" in os.environ or (
        "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    )
    if cpu_devices is None or told:
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    except RuntimeError as error:  # JAX started its backends already
        raise PipemarkError(
            f"launch.start_jax(cpu_devices={cpu_devices}) came after JAX started (something "
            "asked for devices or ran an operation first): call it at the top of the "
            "script, right after the imports, or set JAX_NUM_CPU_DEVICES in the environment."
        ) from error


def _exit_on_uncaught_exception() -> None:
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    port: int | None = None,
    timeout_s: float | None = None,
    init_timeout_s: int = 60,
    stream=None,
) -> int:
    """Run ``command`` (an argument list) in ``num_processes`` local processes; return
    0 when all succeed, else the exit status of the first that failed (or 124 when
    ``timeout_s`` passed). Messages go to ``stream`` (standard error)."""
    stream = sys.stderr if stream is None else stream
    if port is None:
        port = _free_port()
    elif _port_in_use(port):
        print(f"pipemark.launch: port {port} is in use; pick another with --port.", file=stream)
        return 2
    env = dict(os.environ)
    env.update({
        _COORDINATOR: f"127.0.0.1:{port}",
        _NUM_PROCESSES: str(num_processes),
        _INIT_TIMEOUT: str(init_timeout_s),
    })  # fmt: skip
    # Where each process writes the error it fails with, for the line naming it.
    env[failures.FAILURES_DIR] = written = tempfile.mkdtemp(prefix="pipemark-launch-")
    received: list[int] = []
    restore = _forward_signals(received)
    try:
        processes = [
            subprocess.Popen(list(command), env={**env, _PROCESS_ID: str(i)})
            for i in range(num_processes)
        ]
        return _watch(processes, timeout_s, stream, received, written)
    finally:
        restore()
        shutil.rmtree(written, ignore_errors=True)


def _forward_signals(received: list[int]):
    """Record SIGINT and SIGTERM sent to the launcher in ``received`` (the watcher
    passes them on) instead of dying and leaving the processes behind; returns what
    restores the previous handlers. Only the main thread can set handlers."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    wanted = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.getsignal(number) for number in wanted}
    for number in wanted:
        signal.signal(number, lambda number, frame: received.append(number))

    def restore() -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)

    return restore


def _watch(
    processes: list[subprocess.Popen],
    timeout_s: float | None,
    stream,
    received: list[int],
    written: str | None = None,
) -> int:
    """Wait for the processes; on the first failure, a signal to the launcher or the
    timeout, stop the rest. Of the processes found failed at once, the likeliest cause
    (:func:`_blame`) is named first, with the error it wrote to ``written`` (the
    directory of :data:`pipemark.failures.FAILURES_DIR`), and its exit status
    returned."""
    start = time.monotonic()
    while True:
        if received:
            number = received[0]
            running = [p for p in processes if p.poll() is None]
            print(
                f"pipemark.launch: received {signal.Signals(number).name}; passing it on to "
                f"the {len(running)} processes still running.",
                file=stream,
                flush=True,
            )
            _stop(running, number)
            return 128 + number
        codes = [p.poll() for p in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            known = failures.launched_failures(written) if written else {}
            (i, code), *also = sorted(failed, key=lambda f: _blame(f[1], known.get(f[0])))
            running = [p for p in processes if p.poll() is None]
            said = f" ({known[i].text})" if i in known else ""
            words = [f"process {k} {_ended(c)}" for k, c in also]
            too = f", and {', '.join(words)}" if words else ""
            print(
                f"pipemark.launch: process {i} {_ended(code)}{said}{too}; stopping the "
                f"{len(running)} still running.",
                file=stream,
                flush=True,
            )
            _stop(running)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            waiting = [i for i, c in enumerate(codes) if c is None]
            print(
                f"pipemark.launch: processes {waiting} still running after {timeout_s:g} s "
                "(--timeout); stopping them.",
                file=stream,
                flush=True,
            )
            _stop([processes[i] for i in waiting])
            return 124
        time.sleep(0.05)


def _blame(code: int, failure: failures.Failure | None) -> tuple[int, float]:
    """Of processes found ended at once, which caused the others' failures; lowest
    first. An error of its own, earliest first: when process 0, the coordinator, raises,
    JAX aborts the others (a signal). Then a process killed by a signal: the others'
    errors that the same look finds are likely their reaction to it (a peer gone from a
    collective). Then one that ended without a word (``failure`` is ``None``). Then an
    error that followed another process's failure."""
    if failure is not None and not failure.reaction:
        return (0, failure.time)
    if code < 0:
        return (1, 0.0)
    return (2, 0.0) if failure is None else (3, failure.time)


def _ended(code: int) -> str:
    """How a process ended: ``"was killed by signal 9"``, ``"exited with status 1"``."""
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _stop(processes: list[subprocess.Popen], number: int = signal.SIGTERM) -> None:
    """Send ``number`` to each process; kill those still running after the grace period
    (JAX catches SIGTERM, so a process may not stop by itself)."""
    for p in processes:
        p.send_signal(number)
    deadline = time.monotonic() + _GRACE_S
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# The launcher's own options that take a value; the command starts at the first other
# word (a script, or -m and a module), or after "--".
_VALUED = frozenset(("-n", "--num-processes", "--port", "--timeout", "--init-timeout"))


def _split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (the launcher's options, the command): ``-m`` and everything after
    the script belong to the command, wherever they stand."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word == "-m" or not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        i += 1 if "=" in word or word not in _VALUED else 2
    return argv, []


def _positive(kind: type, what: str, upper: float | None = None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not value > 0 or (upper is not None and value > upper):
            bound = f"between 1 and {upper}" if upper is not None else "greater than 0"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {text}")
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipemark.launch",
        usage="%(prog)s -n N [options] (SCRIPT | -m MODULE) [ARGS ...]",
        description="Run a script (or a module, with -m) in N local processes under "
        "jax.distributed.",
    )
    parser.add_argument("-n", "--num-processes", type=_positive(int, "-n"), required=True)
    parser.add_argument(
        "--port",
        type=_positive(int, "--port", 65535),
        help="the coordinator's port, 1-65535 (default: a free one)",
    )
    parser.add_argument(
        "--timeout", type=_positive(float, "--timeout"), help="stop every process after this many s"
    )
    parser.add_argument(
        "--init-timeout",
        type=_positive(int, "--init-timeout"),
        default=60,
        help="s to wait for every process to join",
    )
    options, command = _split_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(options)
    if not command or command == ["-m"]:
        parser.error("give a script to run, or -m and a module")
    if command[0] == "-m":
        command = [sys.executable, *command]
    elif not os.path.exists(command[0]):
        print(f"pipemark.launch: no such script: {command[0]}", file=sys.stderr)
        return 2
    else:
        command = [sys.executable, *command]
    return launch(
        command,
        args.num_processes,
        port=args.port,
        timeout_s=args.timeout,
        init_timeout_s=args.init_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
