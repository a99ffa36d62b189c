"""Benchmark of the pipeline runtime (pipemark.pipeline_value_and_grad) on host CPU devices.

Prints two markdown tables:

1. **Bubble fraction** per schedule, measured against the ideal ``(S - 1) / (M + S - 1)``
   of ``S`` equal stages and ``M`` microbatches. One stage's work for one microbatch is
   measured on its own (a one-stage pipeline of the same layers, ``M`` microbatches on one
   device: ``T1``); the pipeline takes ``TS``; the measured bubble is the fraction of
   ``TS`` that is not work, ``1 - T1 / TS``. Target: within 10% of the ideal.
2. **Host overhead per tick**: with tiny stages, the host time to walk the schedule and
   dispatch every action, divided by the number of ticks and of actions.

Each host device needs a core of its own for stages to overlap: the script sets
``--xla_force_host_platform_device_count`` to the number of stages and makes XLA run each
device's computation on one thread. With fewer cores than stages the measured bubble
says so (the stages take turns on the cores).

Run with ``.venv/bin/python benchmarks/runtime.py`` (``--stages 4 --width 512``; ``--quick``
for a short run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _set_flags(num_devices: int) -> None:
    # Must run before JAX starts its backend: one host device per stage, each computing
    # on a single thread so that devices, not intra-op threads, use the cores.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={num_devices} "
        "--xla_cpu_multi_thread_eigen=false"
    ).strip()


def _model(num_stages: int, layers_per_stage: int, width: int, rows: int, seed: int = 0):
    """``num_stages`` stages of ``layers_per_stage`` tanh layers of equal size; the loss
    (a mean) is tiny next to a layer, so the stages are equal."""
    import jax.numpy as jnp
    import numpy as np

    import pipemark as pm

    rng = np.random.default_rng(seed)
    params = [
        [
            jnp.asarray(rng.normal(0, width**-0.5, (width, width)).astype(np.float32))
            for _ in range(layers_per_stage)
        ]
        for _ in range(num_stages)
    ]

    def loss_fn(params, batch):
        x = batch
        for i, stage in enumerate(params):
            x, stage = pm.mark((x, stage), name=f"stage{i}", mark_type="start")
            for w in stage:
                x = jnp.tanh(x @ w)
            if i == len(params) - 1:
                x = jnp.mean(x * x)
            x = pm.mark(x, name=f"stage{i}", mark_type="end")
        return x

    def batch(num_microbatches: int):
        return jnp.asarray(rng.normal(0, 1, (rows * num_microbatches, width)).astype(np.float32))

    return loss_fn, params, batch


def _median_time(fn, repeat: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def bubble_table(stages: int, micro: list[int], width: int, rows: int, repeat: int) -> str:
    import jax

    import pipemark as pm

    devices = jax.devices()[:stages]
    loss_fn, params, make_batch = _model(stages, 2, width, rows)
    one_fn, one_params, _ = _model(1, 2, width, rows)
    lines = [
        f"S = {stages} stages (2 tanh layers of {width}×{width} each), {rows} rows per "
        f"microbatch, {os.cpu_count()} CPU cores, median of {repeat}",
        "",
        "| schedule | M | T1 (one stage) ms | TS (pipeline) ms | measured bubble | "
        "ideal (S−1)/(M+S−1) | measured / ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in micro:
        batch = make_batch(m)
        one = pm.pipeline_value_and_grad(
            one_fn, num_microbatches=m, devices=devices[:1], schedule="1f1b"
        )
        t1 = _median_time(lambda one=one, batch=batch: one(one_params, batch), repeat)
        for schedule in ("gpipe", "1f1b"):
            pipe = pm.pipeline_value_and_grad(
                loss_fn, num_microbatches=m, devices=devices, schedule=schedule
            )
            ts = _median_time(lambda pipe=pipe, batch=batch: pipe(params, batch), repeat)
            measured = max(0.0, 1.0 - t1 / ts)
            ideal = pm.ideal_bubble_fraction(stages, m)
            lines.append(
                f"| {schedule} | {m} | {1e3 * t1:.2f} | {1e3 * ts:.2f} | {measured:.3f} | "
                f"{ideal:.3f} | {measured / ideal:.2f} |"
            )
    return "\n".join(lines)


def overhead_table(stages: int, micro: list[int], repeat: int) -> str:
    import jax

    import pipemark as pm

    devices = jax.devices()[:stages]
    loss_fn, params, make_batch = _model(stages, 1, 8, 2)
    lines = [
        f"Tiny stages (one 8×8 layer, 2 rows), S = {stages}; host time to dispatch one call",
        "",
        "| schedule | M | ticks | actions | dispatch ms | µs per tick | µs per action | "
        "wall ms (with compute) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in micro:
        batch = make_batch(m)
        for schedule in ("gpipe", "1f1b"):
            pipe = pm.pipeline_value_and_grad(
                loss_fn, num_microbatches=m, devices=devices, schedule=schedule
            )
            jax.block_until_ready(pipe(params, batch))
            dispatch = []
            for _ in range(repeat):
                out, timings = pipe.timed_call(params, batch)
                jax.block_until_ready(out)
                dispatch.append(timings["dispatch_s"])
            dispatch.sort()
            d = dispatch[len(dispatch) // 2]
            wall = _median_time(lambda pipe=pipe, batch=batch: pipe(params, batch), repeat)
            ticks, actions = timings["num_ticks"], timings["num_actions"]
            lines.append(
                f"| {schedule} | {m} | {ticks} | {actions} | {1e3 * d:.2f} | "
                f"{1e6 * d / ticks:.0f} | {1e6 * d / actions:.0f} | {1e3 * wall:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    _set_flags(args.stages)
    micro = [4, 8] if args.quick else [4, 8, 16, 32]
    repeat = 3 if args.quick else args.repeat
    print(bubble_table(args.stages, micro, args.width, args.rows, repeat))
    print()
    print(overhead_table(args.stages, micro, repeat))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
