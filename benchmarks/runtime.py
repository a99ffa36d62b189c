"""Benchmark of the pipeline runtime (pipemark.pipeline_value_and_grad) on host CPU devices.

Prints five markdown tables:

1. **Bubble fraction with equal stages of fixed duration**, which isolates the runtime
   from the number of cores: every stage is tiny, and its forward and its backward each
   wait ``t`` (wrapped in ``jax.custom_vjp``), either in C (``--stage native``: a custom
   call compiled at run time with the system C compiler, see ``_native_sleep.py``; the
   default when a compiler is found) or in Python (``--stage callback``: a
   ``jax.pure_callback``, ``pipemark.examples.sleeping``, which costs 100–220 µs of JAX's
   callback path per call). ``--stage native callback`` measures both in one run, and
   several ``--sleep-ms`` values give a table each. One stage's work per microbatch,
   ``t_f + t_b``, is measured on its own (a one-stage pipeline, ``M`` microbatches on one
   device, divided by ``M``); the pipeline of ``S`` stages takes ``TS``; the measured bubble is
   ``1 - M (t_f + t_b) / TS``, against the ideal ``(S - 1) / (M + S - 1)``. Target: within
   10% of the ideal (measured <= 1.1 x ideal). Also printed: the runtime's overhead per
   tick, ``(TS - (M + S - 1)(t_f + t_b)) / ticks``, and the overhead per tick that the
   target allows; and after each table, per stage kind and ``S``, the smallest ``t`` for
   which the measured overhead per tick would keep measured / ideal <= 1.1, and per stage
   kind how many rows are within the target and which is the worst.
2. **Bubble fraction with real compute** (tanh layers), measured the same way. Host CPU
   devices overlap only when each has a core of its own; with fewer cores than stages the
   measured bubble says so (the stages take turns on the cores).
3. **Host overhead**: with tiny stages, the host time to fetch inputs and dispatch, per
   action, and the wall time per tick.
4. **Zero-bubble schedules** (``--tables zero-bubble``): ZB-H1, ZB-V and DualPipeV
   (where ``M`` is at least its ``2D`` stages) against 1F1B
   with stages whose forward, input-cotangent (B) and weight-gradient (W) parts each
   wait ``t`` (the largest ``--sleep-ms``), the measured bubble beside the one
   ``pm.simulate_schedule`` predicts from each action's measured cost
   (``Pipeline.action_costs``; target: within 10 %, for ``t`` ≥ 20 ms).
5. **Stages in separate processes** (``--tables processes``; ``benchmarks/distributed.py``
   has the details and runs 2 and 4 processes): per-step overhead against the same
   stages in one process, bytes moved against the stage graph's boundary bytes, and a
   transfer per MiB against a raw ``ppermute``.

The script sets ``--xla_force_host_platform_device_count`` (at least 4) and makes XLA run
each device's computation on one thread.

Run with ``.venv/bin/python benchmarks/runtime.py`` (``--stages 4 --width 512
--sleep-ms 5``; ``--quick`` for a short run; ``--tables equal`` for the first table only,
e.g. ``--tables equal --stage native callback --sleep-ms 5 20``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


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


def _native_sleep():
    # The module sits next to this script, which may also be imported from elsewhere.
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import _native_sleep

    return _native_sleep


def _stage_builder(kind: str):
    """``(num_stages, seconds) -> Example`` for an equal-stage kind, and its description."""
    if kind == "native":
        return _native_sleep().sleeping, "sleep in a C custom call (no Python, GIL released)"
    from pipemark import examples

    return examples.sleeping, "sleep in a jax.pure_callback"


def _dispatch_mode(build, seconds: float = 0.02) -> str:
    """Whether XLA runs a one-stage program of this kind asynchronously: the time its
    dispatch took against its whole run (forward and backward, ``2 * seconds``)."""
    dispatched, total = _native_sleep().dispatch_seconds(build(1, seconds))
    mode = "asynchronous" if dispatched < total / 2 else "inline, on the dispatching thread"
    return f"dispatch took {1e3 * dispatched:.2f} ms of {1e3 * total:.1f} ms: {mode}"


def sleep_table(
    stage_counts: list[int],
    micro: list[int],
    sleep_ms: float,
    repeat: int,
    kinds: tuple[str, ...],
) -> str:
    import jax
    import jax.numpy as jnp

    import pipemark as pm

    seconds = sleep_ms / 1e3
    described = "; ".join(f"{kind}: {_stage_builder(kind)[1]}" for kind in kinds)
    lines = [
        f"Equal stages: forward and backward each wait t = {sleep_ms:g} ms ({described}); "
        f"{os.cpu_count()} CPU cores, median of {repeat}",
        "",
        "| stage | schedule | S | M | t_f+t_b ms | TS (pipeline) ms | ideal TS ms | "
        "measured bubble | ideal (S−1)/(M+S−1) | measured / ideal | overhead µs/tick | "
        "budget µs/tick |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for kind in kinds:
        build = _stage_builder(kind)[0]
        # XLA's CPU client runs programs under ~1000 flops inline; say which this is.
        notes.append(f"- {kind} stage program: {_dispatch_mode(build)}")
        one_fn, one_params, _ = build(1, seconds)
        ratios: list[tuple[float, str]] = []  # measured / ideal of each row of this kind
        for stages in stage_counts:
            devices = jax.devices()[:stages]
            loss_fn, params, _ = build(stages, seconds)
            # Per M, the stage time t needed for measured <= 1.1 x ideal (worst schedule).
            needed: dict[int, tuple[float, str]] = {}
            for m in micro:
                # Each builder's example sets the feature width (its batch's last axis).
                batch = jnp.ones((2 * m, one_params[0].shape[-1]), jnp.float32)
                one = pm.pipeline_value_and_grad(one_fn, num_microbatches=m, devices=devices[:1])
                work = (
                    _median_time(lambda one=one, batch=batch, p=one_params: one(p, batch), repeat)
                    / m
                )
                for schedule in ("gpipe", "1f1b"):
                    pipe = pm.pipeline_value_and_grad(
                        loss_fn, num_microbatches=m, devices=devices, schedule=schedule
                    )
                    ts = _median_time(
                        lambda pipe=pipe, batch=batch, params=params: pipe(params, batch), repeat
                    )
                    measured = max(0.0, 1.0 - m * work / ts)
                    ideal = pm.runtime.ideal_bubble_fraction(stages, m)
                    ratio = measured / ideal
                    ideal_ts = (m + stages - 1) * work
                    # Per tick (one forward or one backward): what the pipeline adds to the
                    # ideal, and what it may add for measured <= 1.1 x ideal.
                    ticks = pipe.plan(params, batch).schedule.num_ticks
                    overhead = (ts - ideal_ts) / ticks
                    budget = (m * work / (1.0 - 1.1 * ideal) - ideal_ts) / ticks
                    t_min = _needed_stage_time(work, seconds, overhead, budget)
                    if m not in needed or t_min > needed[m][0]:
                        needed[m] = (t_min, schedule)
                    ratios.append((ratio, f"{schedule}, S = {stages}, M = {m}"))
                    lines.append(
                        f"| {kind} | {schedule} | {stages} | {m} | {1e3 * work:.2f} | "
                        f"{1e3 * ts:.1f} | {1e3 * ideal_ts:.1f} | {measured:.3f} | "
                        f"{ideal:.3f} | {ratio:.2f} | {1e6 * overhead:.0f} | "
                        f"{1e6 * budget:.0f} |"
                    )
            per_m = ", ".join(f"M = {m}: {1e3 * t:.1f} ms ({s})" for m, (t, s) in needed.items())
            notes.append(
                f"- {kind}, S = {stages}: at the measured overhead per tick, measured / ideal "
                f"≤ 1.10 needs t ≥ {1e3 * max(t for t, _ in needed.values()):.1f} ms for every "
                f"M here ({per_m})"
            )
        within = sum(ratio <= 1.1 for ratio, _ in ratios)
        worst_ratio, worst_row = max(ratios)
        notes.append(
            f"- {kind}, t = {sleep_ms:g} ms: {within} of {len(ratios)} rows within the target "
            f"(measured / ideal ≤ 1.10); worst {worst_ratio:.2f} ({worst_row})"
        )
    return "\n".join([*lines, "", *notes])


def zero_bubble_table(devices: int, micro: list[int], sleep_ms: float, repeat: int) -> str:
    """ZB-H1, ZB-V and DualPipeV against 1F1B on stages whose F, B and W each wait
    ``sleep_ms``: the measured bubble beside the simulated one
    (``pm.simulate_schedule``). DualPipeV runs each overlapped forward and backward as
    one program, which the simulation runs as one unit of their two costs.

    The simulation takes each action's measured cost (``Pipeline.action_costs``: each
    action run alone and waited for), and the measured bubble is ``1 - work / (devices ×
    step)`` with ``work`` the sum of those costs. With the nominal costs (F = B = W = t)
    the simulation misses two things a measurement sees: each action takes ``t`` plus
    its dispatch and the sleep's oversleep (1–2 % of ``t`` at 20 ms), and the first
    stage's backward is all W (the input's cotangent is not needed and is never
    computed), so its device has ``t`` less work per microbatch. Both columns are shown.
    """
    import jax
    import jax.numpy as jnp

    import pipemark as pm

    native = _native_sleep()
    t = sleep_ms / 1e3
    nominal = {"forward": t, "backward": t, "weight": t}
    lines = [
        f"Zero-bubble schedules: F, B and W each wait t = {sleep_ms:g} ms (native sleep), "
        f"{devices} devices, median of {repeat}; costs measured per action "
        "(Pipeline.action_costs), medians over stages",
        "",
        "| schedule | stages | M | F / B / W ms | step ms | simulated ms | step / simulated "
        "| measured bubble | simulated bubble | measured / simulated | simulated at F = B = W = t |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in micro:
        schedules = [("1f1b", devices), ("zb-h1", devices), ("zb-v", 2 * devices)]
        # DualPipeV needs at least as many microbatches as stages.
        schedules += [("dualpipev", 2 * devices)] if m >= 2 * devices else []
        for schedule, stages in schedules:
            loss_fn, params, _ = native.sleeping_split(stages, t)
            batch = jnp.ones((2 * m, params[0].shape[-1]), jnp.float32)
            pipe = pm.pipeline_value_and_grad(
                loss_fn, num_microbatches=m, devices=jax.devices()[:devices], schedule=schedule
            )
            ts = _median_time(lambda p=pipe, b=batch, w=params: p(w, b), repeat)
            costs = pipe.action_costs(params, batch, repeat=repeat)
            schedule_ = pipe.plan(params, batch).schedule
            sim = pm.simulate_schedule(schedule_, costs)
            work = m * sum(map(sum, costs.values()))
            measured = max(0.0, 1.0 - work / (devices * ts))
            typical = " / ".join(
                f"{1e3 * sorted(costs[k])[len(costs[k]) // 2]:.2f}"
                for k in ("forward", "backward", "weight")
            )
            lines.append(
                f"| {schedule} | {stages} | {m} | {typical} | {1e3 * ts:.1f} | "
                f"{1e3 * sim.makespan:.1f} | {ts / sim.makespan:.3f} | {measured:.3f} | "
                f"{sim.bubble_fraction:.3f} | {measured / sim.bubble_fraction:.2f} | "
                f"{pm.simulate_schedule(schedule_, nominal).bubble_fraction:.3f} |"
            )
    return "\n".join(lines)


def _needed_stage_time(work: float, seconds: float, overhead: float, budget: float) -> float:
    """The smallest ``t`` for which a per-tick ``overhead`` stays within the budget.

    The budget per tick grows in proportion to ``t_f + t_b`` (it is ``(t_f + t_b)`` times
    a factor of ``S`` and ``M``), which is ``2 t`` plus the stage's fixed cost
    ``work - 2 seconds`` (dispatch, the tiny layer, the sleep's oversleep). Assumes the
    overhead per tick does not grow with ``t``.
    """
    if overhead <= 0:
        return 0.0
    needed_work = work * overhead / budget
    return max(0.0, (needed_work - (work - 2 * seconds)) / 2)


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
            ideal = pm.runtime.ideal_bubble_fraction(stages, m)
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


STAGE_KINDS = ("native", "callback")
TABLES = ("equal", "compute", "overhead", "zero-bubble", "processes")


def _stage_kinds(requested: list[str] | None) -> tuple[str, ...]:
    native = _native_sleep()
    if requested is None:
        if native.available():
            return ("native",)
        print(
            "note: no working C compiler (tried $CC, cc, gcc): equal stages wait in a "
            "jax.pure_callback, which measures JAX's callback path more than the runtime\n"
        )
        return ("callback",)
    if "native" in requested and not native.available():
        native.sleeping(1, 0.0)  # raises NativeSleepUnavailable with the reason
    return tuple(dict.fromkeys(requested))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--sleep-ms",
        type=float,
        nargs="+",
        default=[5.0],
        help="equal-stage duration t in ms (forward and backward each); several give a table each",
    )
    parser.add_argument(
        "--stage",
        choices=STAGE_KINDS,
        nargs="+",
        default=None,
        help="how an equal stage waits: native (C custom call; the default when a C compiler "
        "is found) or callback (jax.pure_callback); give both to measure them side by side",
    )
    parser.add_argument(
        "--tables",
        choices=TABLES,
        nargs="+",
        default=list(TABLES),
        help="which tables to print (default: all)",
    )
    args = parser.parse_args(argv)
    from _host_devices import use_host_devices

    use_host_devices(max(4, args.stages))
    micro = [4, 8] if args.quick else [4, 8, 16, 32]
    repeat = 3 if args.quick else args.repeat
    if "equal" in args.tables:
        kinds = _stage_kinds(args.stage)
        for ms in args.sleep_ms:
            print(sleep_table([2, 4], micro, ms, repeat, kinds))
            print()
    if "compute" in args.tables:
        print(bubble_table(args.stages, micro, args.width, args.rows, repeat))
        print()
    if "overhead" in args.tables:
        print(overhead_table(args.stages, micro, repeat))
    if "zero-bubble" in args.tables:
        print()
        print(zero_bubble_table(4, [4, 8] if args.quick else [8, 16], max(args.sleep_ms), repeat))
    if "processes" in args.tables:
        # Stages in separate processes (jax.distributed): its own script, since each
        # process must start JAX its own way (benchmarks/distributed.py).
        sys.stdout.flush()
        import distributed

        print()
        distributed.main(["--processes", "2", *(["--quick"] if args.quick else [])])
    sys.stdout.flush()


if __name__ == "__main__":
    main()
