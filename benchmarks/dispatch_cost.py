"""The host's cost of dispatching a pipeline's actions, on the platform it runs on: what
the layout planner's dispatch model takes (``pm.planner.Cluster.dispatch_seconds``,
``bounded_dispatch_seconds`` and ``wake_seconds``, docs/scale.md; ``pm.planner.tpu_v5e``'s
are from ``benchmarks/results/dispatch-tpu-v5e.json``).

    python benchmarks/dispatch_cost.py --out results/dispatch.json   # on a TPU
    python benchmarks/dispatch_cost.py --size tiny                   # a quick look on CPU

Measured, for the GPT of ``benchmarks/accelerator.py`` (``--size``) as an S-stage
interleaved pipeline on one device (``--stages``, 8 microbatches):

* ``dispatch_s``: the runtime's host time per program dispatched
  (``Pipeline.timed_call``'s ``host_s`` over ``num_programs``, with
  ``dispatch_ahead=None``, so that no wait for the device is in it: placing the
  inputs, dispatching, publishing), the median of ``--repeat`` calls;
* ``wake_s``: what a host that waits for the device loses before it dispatches again:
  one jitted program of about a millisecond dispatched and waited for, less its time
  on the device (the same program run ``--repeat`` × 20 times back to back, per
  program) and less its dispatch (the call's own return);
* ``steps``: the pipeline's step with each ``dispatch_ahead`` of ``--ahead``, as
  ``accelerator.py`` times it (median of ``--repeat``, each waited for);
* ``host_s`` and ``host_cpu_s``: with each ``dispatch_ahead``, the runtime's host
  time per program (wall time, with the bounded host's waits for the device) and the
  walking thread's CPU time per program (without them). With a bound, ``host_s`` is
  ``bounded_dispatch_seconds`` where the CPU time rose as much as the wall time (the
  waits then took no measurable time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _pipeline(ex, stages: int, microbatches: int, ahead: int | None, device):
    import pipemark as pm

    return pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=stages, num_microbatches=microbatches,
        schedule="interleaved", devices=[device], dispatch_ahead=ahead,
    )  # fmt: skip


def pipeline_costs(sizes: dict, stages: int, microbatches: int, repeat: int, aheads) -> dict:
    """The runtime's host time per program and the step with each ``dispatch_ahead``."""
    import accelerator
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")
    device = jax.devices()[0]
    ex = accelerator.gpt_example(sizes, sizes["batch"], "boundary")
    params, batch = jax.block_until_ready(jax.device_put(ex.args, device))
    out: dict = {"stages": stages, "microbatches": microbatches, "steps": {}}
    for ahead in aheads:
        pipe = _pipeline(ex, stages, microbatches, ahead, device)
        jax.block_until_ready(pipe(params, batch))  # compiles
        jax.block_until_ready(pipe(params, batch))
        seconds, per_program, cpu = [], [], []
        for _ in range(repeat):
            start = time.perf_counter()
            result, timings = pipe.timed_call(params, batch)
            jax.block_until_ready(result)
            seconds.append(time.perf_counter() - start)
            per_program.append(timings["host_s"] / timings["num_programs"])
            cpu.append(timings.get("host_cpu_s", 0.0) / timings["num_programs"])
        out["steps"][str(ahead)] = statistics.median(seconds)
        # Host seconds a program, its waits for the device included where bounded, and
        # the walking thread's CPU seconds a program (without its waits).
        out.setdefault("host_s", {})[str(ahead)] = statistics.median(per_program)
        out.setdefault("host_cpu_s", {})[str(ahead)] = statistics.median(cpu)
        if ahead is None:
            out["dispatch_s"] = statistics.median(per_program)
            out["dispatch_s_all"] = per_program
            out["num_programs"] = timings["num_programs"]
        print(f"dispatch_ahead={ahead}: step {out['steps'][str(ahead)] * 1e3:.1f} ms", flush=True)
    return out


def wake_cost(repeat: int) -> dict:
    """A jitted program of about a millisecond: its device time back to back, its
    dispatch, and dispatch plus wait; ``wake_s`` what the wait adds beyond the device."""
    import jax
    import jax.numpy as jnp

    # About 1 ms on a v5e (8 products of 17 GFLOP); a few on a CPU.
    n = 256 if jax.devices()[0].platform == "cpu" else 2048
    x = jnp.ones((n, n), jnp.bfloat16)

    @jax.jit
    def work(x):
        for _ in range(8):
            x = jnp.tanh(x @ x) * 0.5
        return x

    jax.block_until_ready(work(x))
    chains = []
    for _ in range(repeat):
        y = x
        start = time.perf_counter()
        for _ in range(20):
            y = work(y)
        jax.block_until_ready(y)
        chains.append((time.perf_counter() - start) / 20)
    device = statistics.median(chains)
    dispatches, rounds = [], []
    for _ in range(20 * repeat):
        start = time.perf_counter()
        y = work(x)
        returned = time.perf_counter()
        jax.block_until_ready(y)
        dispatches.append(returned - start)
        rounds.append(time.perf_counter() - start)
    dispatch, whole = statistics.median(dispatches), statistics.median(rounds)
    return {
        "program_device_s": device,
        "program_dispatch_s": dispatch,
        "program_round_trip_s": whole,
        "wake_s": max(0.0, whole - device - dispatch),
    }


def main() -> None:
    import accelerator
    import jax

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="auto", choices=["auto", *accelerator.SIZES])
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ahead", default="none,2,4", help="dispatch_ahead values (none: None)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = jax.devices()[0]
    name = args.size if args.size != "auto" else ("tiny" if device.platform == "cpu" else "gpt")
    sizes = accelerator.SIZES[name]
    aheads = [None if a == "none" else int(a) for a in args.ahead.split(",")]
    record = {
        "platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__,
        "date": f"{datetime.date.today()}", "size": name, "repeat": args.repeat,
    }  # fmt: skip
    record.update(wake_cost(args.repeat))
    print(json.dumps(record), flush=True)
    record.update(pipeline_costs(sizes, args.stages, args.microbatches, args.repeat, aheads))
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
