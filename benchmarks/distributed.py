"""Benchmark of the pipeline runtime with its stages in separate processes
(``jax.distributed``, gloo on CPU), side by side with the same stages in one process.

    python benchmarks/distributed.py                 # 2 and 4 processes
    python benchmarks/distributed.py --processes 2 --quick

For each process count ``S`` it runs, in one go: the single-process pipeline (``S`` host
CPU devices in one process, a thread each) and the multi-process one (``S`` processes
started by ``python -m pipemark.launch``, one CPU device each), on the same tanh MLP of
``S`` equal stages, over ``M`` microbatches, three ways (calls alternate between them):
1F1B; 1F1B with one more forward in flight before each stage's first backward
(``one_f_one_b_schedule(..., extra_in_flight=1)``, which hides a transfer's latency);
1F1B with each process keeping its own stages' results (``gather_results=False``). It
prints two markdown tables.

Steps, per schedule:

* time per step (the best of ``--repeat`` calls) in one process and in ``S``, and
  their ratio;
* the latency of one transfer (a raw ``ppermute`` of one boundary value, median) and
  the ``S``-process step as ``pm.simulate_schedule`` predicts it from the actions'
  costs measured in one process and that latency: what waiting for transfers costs;
* the CPU time per step (all threads of the processes, from the call to its results,
  the median call), in one process and summed over the ``S``, and the floor that sets:
  no step on this machine is shorter than its CPU time spread over all the cores. On a
  machine whose cores the one-process step already keeps busy, the extra CPU time of
  moving values between processes (gloo over TCP: copies at both ends) is extra time.

Transfers:

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


#: What is timed, by table label: (forwards in flight beyond 1F1B's, whether every
#: process gets every result). 1F1B; 1F1B with one more forward in flight before each
#: stage's first backward (which hides a transfer's latency); 1F1B with each process
#: keeping its own stages' results (``gather_results=False``: nothing moves after the
#: last action).
SCHEDULES = {"1f1b": (0, True), "1f1b +1 in flight": (1, True), "1f1b, results kept": (0, False)}


def _step_times(args, stages: int) -> dict:
    """Per schedule: the best step of ``args.repeat`` calls (calls of the schedules
    alternate, so a burst of other work hits both alike), its timings, and the bytes
    into this process; in one process also each action's cost (for the simulation)."""
    import jax

    import pipemark as pm

    loss_fn, params, batch = _model(stages, args.width, args.rows)
    steps = {
        label: pm.pipeline_value_and_grad(
            loss_fn,
            num_microbatches=args.microbatches,
            schedule=pm.runtime.one_f_one_b_schedule(
                stages, args.microbatches, extra_in_flight=extra
            ),
            timeout_s=120,
            gather_results=gather,
        )
        for label, (extra, gather) in SCHEDULES.items()
    }
    result: dict = {}
    for label, step in steps.items():
        jax.block_until_ready(step(params, batch))  # compile
        boundary = step.plan(params, batch).bytes_into_process(jax.process_index())
        result[label] = {"step_s": float("inf"), "boundary": boundary}
    cpu: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(args.repeat):
        for label, step in steps.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            out, timings = step.timed_call(params, batch)
            jax.block_until_ready(out)
            took = time.perf_counter() - start
            # The process's CPU time (every thread: XLA's, gloo's, the runtime's) from
            # the call to its results computed.
            cpu[label].append(time.process_time() - cpu_start)
            if took < result[label]["step_s"]:
                result[label].update(step_s=took, timings=timings)
    for label, seconds in cpu.items():
        result[label]["cpu_s"] = sorted(seconds)[len(seconds) // 2]
    if jax.process_count() == 1:
        result["costs"] = steps["1f1b"].action_costs(params, batch)
    result["value_bytes"] = args.rows // args.microbatches * args.width * 4
    return result


def _latency(nbytes: int, repeat: int) -> float:
    """The median time of a raw ``shard_map(ppermute)`` of ``nbytes`` from process 0 to
    process 1 (``10 x repeat`` calls after a warm-up): a transfer's latency."""
    import jax
    import numpy as np

    mesh, raw = _raw_ppermute()
    glob = _pair_array(mesh, _float_block((nbytes // 4,)))
    jax.block_until_ready(raw(glob))
    times = []
    for _ in range(10 * repeat):
        start = time.perf_counter()
        jax.block_until_ready(raw(glob))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _float_block(shape: tuple[int, ...]):
    """A float32 block of ``shape`` on this process's device, holding its index."""
    import jax
    import numpy as np

    return jax.device_put(np.full(shape, jax.process_index(), np.float32), jax.local_devices()[0])


def _pair_array(mesh, block):
    """The global array over ``mesh``'s two devices whose shard here is ``block``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shape = (2 * block.shape[0], *block.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P("pair")), [block])


def _raw_ppermute():
    """A two-device mesh (process 0's device, process 1's) and a jitted ppermute over it."""
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from pipemark._compat import shard_map

    devices = jax.devices()
    mesh = Mesh(np.array([devices[0], devices[1]]), ("pair",))
    raw = jax.jit(
        shard_map(
            lambda x: lax.ppermute(x, "pair", [(0, 1)]), mesh=mesh, in_specs=P("pair"),
            out_specs=P("pair"),
        )
    )  # fmt: skip
    return mesh, raw


def _transfers(repeat: int) -> dict:
    """Per MiB: the runtime's transport and a raw ppermute, process 0 -> process 1."""
    import jax
    import numpy as np

    from pipemark.runtime.devices.transport import CollectiveTransport, Watchdog

    devices = jax.devices()
    source, target = devices[0], devices[1]
    me = jax.process_index()
    transport = CollectiveTransport(Watchdog(120, me), me)
    mesh, raw = _raw_ppermute()
    result = {}
    for mib in SIZES_MIB:
        shape = (mib * 1024 * 256,)
        block = _float_block(shape)
        glob = _pair_array(mesh, block)

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
        result["latency_s"] = _latency(result["value_bytes"], args.repeat)
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
    steps, transfers = [], []
    for processes in args.processes:
        with tempfile.TemporaryDirectory() as out:
            _run_mode(args, "single", processes, out)
            _run_mode(args, "multi", processes, out)
            single = json.loads(Path(out, "single-0.json").read_text())
            multi = [json.loads(Path(out, f"multi-{p}.json").read_text()) for p in range(processes)]
        steps.extend(_step_rows(processes, args.microbatches, single, multi))
        moved = sum(m["1f1b"]["timings"]["bytes_received"] for m in multi)
        boundary = sum(m["1f1b"]["boundary"] for m in multi)
        for mib, per in multi[1]["transfer_s_per_mib"].items():
            transfers.append(
                f"| {processes} | {moved:,} | {boundary:,} | "
                f"{1e3 * per['transport']:.2f} ({mib} MiB) | {1e3 * per['raw']:.2f} | "
                f"{per['transport'] / per['raw']:.2f} |"
            )
    print(
        "| processes | schedule | step, 1 process (ms) | step, S processes (ms) "
        "| S processes / 1 | transfer latency (ms) | simulated, S processes (ms) "
        "| simulated / 1 process | CPU per step, 1 process (ms) "
        "| CPU per step, S processes (ms) | CPU floor, S processes (ms) | floor / 1 process |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(steps))
    print()
    print(
        "| processes | bytes moved per step | boundary bytes per step | transport (ms/MiB) "
        "| raw ppermute (ms/MiB) | transport / raw |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(transfers))


def _step_rows(processes: int, micro: int, single: dict, multi: list[dict]) -> list[str]:
    """A row per schedule: measured in 1 and S processes; the S-process step as
    ``simulate_schedule`` predicts it from the 1-process action costs and a transfer's
    measured latency (a raw ppermute of one boundary value); the CPU time per step
    (the median call's, summed over the processes) and the floor it sets on this
    machine: that CPU time spread over all its cores (or the 1-process step)."""
    import pipemark as pm

    latency = multi[1]["latency_s"]
    cores = os.cpu_count() or 1
    rows = []
    for label, (extra, _) in SCHEDULES.items():
        step_1 = single[label]["step_s"]
        step_s = max(m[label]["step_s"] for m in multi)
        schedule = pm.runtime.one_f_one_b_schedule(processes, micro, extra_in_flight=extra)
        costs = single["costs"]
        free = pm.simulate_schedule(schedule, costs).makespan
        simulated = pm.simulate_schedule(schedule, costs, transfer=latency).makespan
        cpu_1 = single[label]["cpu_s"]
        cpu_s = sum(m[label]["cpu_s"] for m in multi)
        # No step can be shorter than its CPU time spread over every core of the machine.
        floor = max(cpu_s / cores, step_1)
        rows.append(
            f"| {processes} | {label} | {1e3 * step_1:.2f} | {1e3 * step_s:.2f} | "
            f"{step_s / step_1:.2f} | {1e3 * latency:.2f} | {1e3 * simulated:.2f} | "
            f"{simulated / free:.2f} | {1e3 * cpu_1:.1f} | {1e3 * cpu_s:.1f} | "
            f"{1e3 * floor:.2f} | {floor / step_1:.2f} |"
        )
    return rows


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
