"""Start a script in several local processes under ``jax.distributed``, and stop them
all when one fails.

    python -m pipemark.launch -n 4 train.py --steps 10

starts ``train.py --steps 10`` four times, with the environment telling each its
process id, the process count and the coordinator's address (a free local port). The
script calls :func:`initialize` before anything else touches JAX. When a process exits
with an error (or is killed), the launcher says which and stops the others, so a
pipeline never waits on a process that is gone; its exit status is that process's.

On a cluster, start the script the cluster's way (SLURM's ``srun``, ``mpirun``, a
Kubernetes job): :func:`initialize` then calls ``jax.distributed.initialize()``, which
reads the cluster's environment itself.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["initialize", "launch", "main"]

_COORDINATOR = "PIPEMARK_COORDINATOR"
_NUM_PROCESSES = "PIPEMARK_NUM_PROCESSES"
_PROCESS_ID = "PIPEMARK_PROCESS_ID"
_INIT_TIMEOUT = "PIPEMARK_INIT_TIMEOUT"


def initialize() -> None:
    """``jax.distributed.initialize`` for this process: with the coordinator, process
    count and id :mod:`pipemark.launch` set, or else as the cluster says (SLURM, Open
    MPI, ... : ``jax.distributed.initialize()`` with no arguments).

    Call it once, before JAX creates its backends (before ``jax.devices()``)."""
    import jax

    coordinator = os.environ.get(_COORDINATOR)
    if coordinator is None:
        jax.distributed.initialize()
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
    processes = [
        subprocess.Popen(list(command), env={**env, _PROCESS_ID: str(i)})
        for i in range(num_processes)
    ]
    return _watch(processes, timeout_s, stream)


def _watch(processes: list[subprocess.Popen], timeout_s: float | None, stream) -> int:
    """Wait for the processes; on the first failure (or the timeout) stop the rest."""
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            running = [p for p in processes if p.poll() is None]
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            print(
                f"pipemark.launch: process {i} {how}; stopping the {len(running)} still running.",
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


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipemark.launch",
        description="Run a script in N local processes under jax.distributed.",
    )
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, help="the coordinator's port (default: a free one)")
    parser.add_argument("--timeout", type=float, help="stop every process after this many s")
    parser.add_argument(
        "--init-timeout", type=int, default=60, help="s to wait for every process to join"
    )
    parser.add_argument("script", help="a Python file, or -m module")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.num_processes < 1:
        parser.error("-n must be at least 1")
    command = [sys.executable, args.script, *args.args]
    if args.script == "-m":
        command = [sys.executable, "-m", *args.args]
    elif not os.path.exists(args.script):
        print(f"pipemark.launch: no such script: {args.script}", file=sys.stderr)
        return 2
    return launch(
        command,
        args.num_processes,
        port=args.port,
        timeout_s=args.timeout,
        init_timeout_s=args.init_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
