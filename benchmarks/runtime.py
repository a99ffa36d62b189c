"""Benchmark of the pipeline runtime (pipemark.pipeline_value_and_grad) on host CPU devices.

Prints three markdown tables:

1. **Bubble fraction with equal stages of fixed duration**, which isolates the runtime
   from the number of cores: every stage is tiny, and its forward and its backward each
   sleep ``t`` in a ``jax.pure_callback`` (wrapped in ``jax.custom_vjp``, since a callback
   has no derivative). One stage's work per microbatch, ``t_f + t_b``, is measured on its
   own (a one-stage pipeline, ``M`` microbatches on one device, divided by ``M``); the
   pipeline of ``S`` stages takes ``TS``; the measured bubble is
   ``1 - M (t_f + t_b) / TS``, against the ideal ``(S - 1) / (M + S - 1)``. Target: within
   10% of the ideal.
2. **Bubble fraction with real compute** (tanh layers), measured the same way. Host CPU
   devices overlap only when each has a core of its own; with fewer cores than stages the
   measured bubble says so (the stages take turns on the cores).
3. **Host overhead**: with tiny stages, the host time to fetch inputs and dispatch, per
   action, and the wall time per tick.

The script sets ``--xla_force_host_platform_device_count`` (at least 4) and makes XLA run
each device's computation on one thread.

Run with ``.venv/bin/python benchmarks/runtime.py`` (``--stages 4 --width 512
--sleep-ms 5``; ``--quick`` for a short run).
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


def sleep_table(stage_counts: list[int], micro: list[int], sleep_ms: float, repeat: int) -> str:
    import jax
    import jax.numpy as jnp

    import pipemark as pm
    from pipemark import examples

    seconds = sleep_ms / 1e3
    lines = [
        f"Equal stages: forward and backward each sleep {sleep_ms:g} ms in a host callback; "
        f"{os.cpu_count()} CPU cores, median of {repeat}",
        "",
        "| schedule | S | M | t_f+t_b ms | TS (pipeline) ms | ideal TS ms | measured bubble | "
        "ideal (S−1)/(M+S−1) | measured / ideal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    one_fn, one_params, _ = examples.sleeping(1, seconds)
    for stages in stage_counts:
        devices = jax.devices()[:stages]
        loss_fn, params, _ = examples.sleeping(stages, seconds)
        for m in micro:
            batch = jnp.ones((2 * m, 4), jnp.float32)
            one = pm.pipeline_value_and_grad(one_fn, num_microbatches=m, devices=devices[:1])
            work = _median_time(lambda one=one, batch=batch: one(one_params, batch), repeat) / m
            for schedule in ("gpipe", "1f1b"):
                pipe = pm.pipeline_value_and_grad(
                    loss_fn, num_microbatches=m, devices=devices, schedule=schedule
                )
                ts = _median_time(
                    lambda pipe=pipe, batch=batch, params=params: pipe(params, batch), repeat
                )
                measured = max(0.0, 1.0 - m * work / ts)
                ideal = pm.ideal_bubble_fraction(stages, m)
                lines.append(
                    f"| {schedule} | {stages} | {m} | {1e3 * work:.2f} | {1e3 * ts:.1f} | "
                    f"{1e3 * (m + stages - 1) * work:.1f} | {measured:.3f} | {ideal:.3f} | "
                    f"{measured / ideal:.2f} |"
                )
    return "\n".join(lines)


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
        f"Tiny stages (one 8×8 layer, 2 rows), S = {stages}; host time to fetch and dispatch, "
        "summed over the device workers, and wall time of one call",
        "",
        "| schedule | M | ticks | actions | host µs per action | wall ms | wall µs per tick |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in micro:
        batch = make_batch(m)
        for schedule in ("gpipe", "1f1b"):
            pipe = pm.pipeline_value_and_grad(
                loss_fn, num_microbatches=m, devices=devices, schedule=schedule
            )
            jax.block_until_ready(pipe(params, batch))
            host = []
            for _ in range(repeat):
                out, timings = pipe.timed_call(params, batch)
                jax.block_until_ready(out)
                host.append(timings["host_s"])
            host.sort()
            h = host[len(host) // 2]
            wall = _median_time(lambda pipe=pipe, batch=batch: pipe(params, batch), repeat)
            ticks, actions = timings["num_ticks"], timings["num_actions"]
            lines.append(
                f"| {schedule} | {m} | {ticks} | {actions} | {1e6 * h / actions:.0f} | "
                f"{1e3 * wall:.2f} | {1e6 * wall / ticks:.0f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--sleep-ms", type=float, default=5.0, help="equal-stage duration")
    args = parser.parse_args(argv)
    _set_flags(max(4, args.stages))
    micro = [4, 8] if args.quick else [4, 8, 16, 32]
    repeat = 3 if args.quick else args.repeat
    print(sleep_table([2, 4], micro, args.sleep_ms, repeat))
    print()
    print(bubble_table(args.stages, micro, args.width, args.rows, repeat))
    print()
    print(overhead_table(args.stages, micro, repeat))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
