"""Benchmark of the pipeline runtime with its stages in separate processes
(``jax.distributed``, gloo on CPU), side by side with the same stages in one process.

    python benchmarks/distributed.py                 # 2 and 4 processes
    python benchmarks/distributed.py --processes 2 --quick

For each process count ``S`` it runs, in one go: the single-process pipeline (``S`` host
CPU devices in one process, a thread each) and the multi-process one (``S`` processes
started by ``python -m pipemark.launch``, one CPU device each), on the same tanh MLP of
``S`` equal stages, 1F1B over ``M`` microbatches. It prints a markdown table:

* time per step (the best of ``--repeat`` calls) in one process and in ``S``, and the
  overhead per step of running in processes;
* bytes moved between processes per step, summed over the processes, and the stage
  graph's boundary bytes (each value crossing a process boundary once per microbatch and
  reading device): equal when the runtime makes no extra copies;
* the time a point-to-point transfer between two processes takes per MiB, through the
  runtime's transport and as a raw ``shard_map(ppermute)`` of the same bytes (a global
  array built once), in the same run: the median of ``10 x --repeat`` calls each way,
  alternating which goes first (target: transport <= 1.2 x raw).

Numbers come from a shared 2-core machine: with more processes than cores the
processes take turns on the cores, and the multi-process times say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES_MIB = (1, 16)


def _model(stages: int, width: int, rows: int):
    import jax.numpy as jnp
    import numpy as np

    import pipemark as pm

    rng = np.random.default_rng(0)
    params = [
        (jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),)
        for _ in range(stages)
    ]
    batch = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)

    def loss_fn(params, x):
        for i, (w,) in enumerate(params):
            x, w = pm.mark((x, w), name=f"s{i}", mark_type="start")
            x = pm.mark(jnp.tanh(x @ w), name=f"s{i}", mark_type="end")
        return jnp.mean(x**2)

    return loss_fn, params, batch


def _step_times(args, stages: int) -> dict:
    import jax

    import pipemark as pm

    loss_fn, params, batch = _model(stages, args.width, args.rows)
    step = pm.pipeline_value_and_grad(
        loss_fn, num_microbatches=args.microbatches, schedule="1f1b", timeout_s=120
    )
    jax.block_until_ready(step(params, batch))  # compile
    best, timings = float("inf"), {}
    for _ in range(args.repeat):
        start = time.perf_counter()
        out, timings = step.timed_call(params, batch)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - start)
    boundary = step.plan(params, batch).bytes_into_process(jax.process_index())
    return {"step_s": best, "timings": timings, "boundary": boundary}


def _transfers(repeat: int) -> dict:
    """Per MiB: the runtime's transport and a raw ppermute, process 0 -> process 1."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipemark._compat import shard_map
    from pipemark.runtime.transport import CollectiveTransport, Watchdog

    devices = jax.devices()
    source, target = devices[0], devices[1]
    me, local = jax.process_index(), jax.local_devices()[0]
    transport = CollectiveTransport(Watchdog(120))
    mesh = Mesh(np.array([source, target]), ("pair",))
    raw = jax.jit(
        shard_map(
            lambda x: lax.ppermute(x, "pair", [(0, 1)]), mesh=mesh, in_specs=P("pair"),
            out_specs=P("pair"),
        )
    )  # fmt: skip
    result = {}
    for mib in SIZES_MIB:
        shape = (mib * 1024 * 256,)
        block = jax.device_put(np.full(shape, me, np.float32), local)
        glob = jax.make_array_from_single_device_arrays(
            (2 * shape[0],), NamedSharding(mesh, P("pair")), [block]
        )

        def by_transport(block=block, shape=shape) -> None:
            if me == 0:
                transport.send([block], source, target, "benchmark")
            elif me == 1:
                transport.receive([(shape, np.float32)], source, target, "benchmark")

        def by_raw(glob=glob) -> None:
            if me in (0, 1):
                jax.block_until_ready(raw(glob))

        # Call by call, alternating which way goes first (the two processes meet at
        # each transfer, so a call's time includes waiting for the other end: with
        # the order alternating, both ways wait alike), 10 x ``repeat`` calls each way
        # after a warm-up; the median call counts. On a shared 2-core machine bursts
        # of other work slow some calls by 2x, which medians of whole blocks of calls
        # did not smooth out (0.7-1.5x between runs at 1 MiB).
        times: dict[str, list[float]] = {"transport": [], "raw": []}
        ways = [("raw", by_raw), ("transport", by_transport)]
        for _, move in ways:
            move()  # compiles
        for call in range(10 * repeat):
            for name, move in ways if call % 2 else ways[::-1]:
                start = time.perf_counter()
                move()
                times[name].append(time.perf_counter() - start)
        result[mib] = {k: float(np.median(v)) / mib for k, v in times.items()}
    return result


def _worker(args) -> None:
    from pipemark.launch import initialize

    initialize()
    import jax

    result = _step_times(args, jax.process_count())
    if jax.process_count() > 1 and jax.process_index() < 2:
        result["transfer_s_per_mib"] = _transfers(args.repeat)
    Path(args.out, f"{args.mode}-{jax.process_index()}.json").write_text(json.dumps(result))


def _run_mode(args, mode: str, processes: int, out: str) -> None:
    script = [__file__, "--mode", mode, "--out", out, *_forwarded(args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")}
    env["JAX_PLATFORMS"] = "cpu"
    flags = "--xla_cpu_multi_thread_eigen=false"
    if mode == "single":
        flags += f" --xla_force_host_platform_device_count={processes}"
        command = [sys.executable, *script]
        env["PIPEMARK_SINGLE"] = str(processes)
    else:
        command = [sys.executable, "-m", "pipemark.launch", "-n", str(processes), *script]
    env["XLA_FLAGS"] = flags
    subprocess.run(command, env=env, check=True, timeout=1800)


def _forwarded(args) -> list[str]:
    return [
        f"--width={args.width}",
        f"--rows={args.rows}",
        f"--microbatches={args.microbatches}",
        f"--repeat={args.repeat}",
    ]


def _table(args) -> None:
    print(
        "| processes | step, 1 process (ms) | step, S processes (ms) | overhead per step (ms) "
        "| bytes moved per step | boundary bytes per step | transport (ms/MiB) "
        "| raw ppermute (ms/MiB) | transport / raw |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for processes in args.processes:
        with tempfile.TemporaryDirectory() as out:
            _run_mode(args, "single", processes, out)
            _run_mode(args, "multi", processes, out)
            single = json.loads(Path(out, "single-0.json").read_text())
            multi = [json.loads(Path(out, f"multi-{p}.json").read_text()) for p in range(processes)]
        step_1, step_s = single["step_s"], max(m["step_s"] for m in multi)
        moved = sum(m["timings"]["bytes_received"] for m in multi)
        boundary = sum(m["boundary"] for m in multi)
        for mib, per in multi[1]["transfer_s_per_mib"].items():
            print(
                f"| {processes} | {1e3 * step_1:.2f} | {1e3 * step_s:.2f} | "
                f"{1e3 * (step_s - step_1):.2f} | {moved:,} | {boundary:,} | "
                f"{1e3 * per['transport']:.2f} ({mib} MiB) | {1e3 * per['raw']:.2f} | "
                f"{per['transport'] / per['raw']:.2f} |"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small and short")
    parser.add_argument("--mode", choices=["single", "multi"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.rows, args.microbatches, args.repeat = 64, 16, 4, 2
    if args.mode is None:
        _table(args)
    elif args.mode == "single":
        result = _step_times(args, int(os.environ["PIPEMARK_SINGLE"]))
        Path(args.out, "single-0.json").write_text(json.dumps(result))
    else:
        _worker(args)


if __name__ == "__main__":
    main()
