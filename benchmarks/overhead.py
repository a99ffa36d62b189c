"""The pipeline runtime's own cost, next to plain ``jax.jit``, on a 4-layer tanh MLP.

    python benchmarks/overhead.py               # width 512, batch 1024, 40 rounds
    python benchmarks/overhead.py --quick       # tiny and short (the test runs this)

The model is ``pipemark.examples.mlp`` (4 marked layers, a mean-squared-error loss). In
one run, on 2 host CPU devices (``--xla_force_host_platform_device_count=2``; XLA keeps
its default threads, so one program may use every core), it times:

* ``jax.jit(jax.value_and_grad(loss))``, the reference;
* ``pipeline_value_and_grad`` with 1 stage and 1 microbatch (the runtime's cost with no
  pipeline to run), and the same plan walked with its forward and backward as separate
  programs (``unfused``: what the runtime ran before it fused them);
* for information, 1 stage × 4 microbatches and 2 stages × 4 microbatches (1F1B).

Each round calls every row once, in turn (the order rotates from round to round), and
waits for the results; the table shows the median over ``--repeat`` rounds. Columns:
the median call in ms, and its ratio to ``jax.jit`` (the median over rounds of each
round's ratio: on a shared machine the load drifts between rounds); the schedule's actions per call and
the programs dispatched (a fused forward and backward is one program); the host time
per action that ``Pipeline.timed_call`` reports (``host_s / num_actions``: placing the
inputs, dispatching and handing values over, summed over the device workers, waits
excluded), and the same in CPU time of the walking threads (``host_cpu_s``; on a
machine whose cores also run the CPU devices' programs, wall time includes the host
thread being preempted by them). For ``jax.jit`` the host columns show how long its call
took to return (its own dispatch), in wall and CPU time.

Targets (1 stage × 1 microbatch): at most 1.05 × ``jax.jit``, and at most 100 µs of host
time per action. A verdict line says whether they are met.

Then a profile of the 1 stage × 1 microbatch call: the CPU time (of the calling thread,
``time.thread_time``) of each part of a call, median over ``--repeat`` calls each made
right after the previous one's results were waited for (as in a training loop), next to
the CPU time of the ``jax.jit`` call. The parts are the runtime's internals, timed by
wrapping them: binding the arguments (``Pipeline._bind``: the parameters' static
leaves), the plan's key (shapes and dtypes), the call's set-up (flattening, splitting
into microbatches), placing the inputs, dispatching the program(s), the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time


def _set_flags(num_devices: int) -> None:
    # Must run before JAX starts its backend.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()
    )


def _unfused(pipe, params, batch):
    """A call of ``pipe``'s plan with every action its own program (no fusion)."""
    from pipemark.runtime.execution.run import run_plan

    plan = pipe.plan(params, batch)
    plan = dataclasses.replace(plan, steps=plan.unfused_steps, fused={})

    def call(timings):
        return run_plan(plan, params, batch, timings)

    return call


def _rows(width: int, batch_size: int):
    """``(label, call)`` per row; ``call(timings)`` returns the results and fills
    ``timings`` (a dict) with the host times when it can."""
    import jax

    import pipemark as pm
    from pipemark import examples

    loss_fn, params, batch = examples.mlp(num_layers=4, width=width, batch=batch_size)
    reference = jax.jit(jax.value_and_grad(loss_fn))

    def jitted(timings):
        start, cpu = time.perf_counter(), time.thread_time()
        out = reference(params, batch)
        timings["dispatch_s"] = time.perf_counter() - start
        timings["dispatch_cpu_s"] = time.thread_time() - cpu
        return out

    rows = [("`jax.jit(jax.value_and_grad(loss))`", jitted)]
    for stages, micro in ((1, 1), (1, 4), (2, 4)):
        pipe = pm.pipeline_value_and_grad(
            loss_fn,
            num_stages=stages,
            num_microbatches=micro,
            devices=jax.devices()[:stages],
        )

        def piped(timings, pipe=pipe):
            out, got = pipe.timed_call(params, batch)
            timings.update(got)
            return out

        rows.append(
            (
                f"pipeline, {stages} stage{'s' * (stages > 1)} × {micro} microbatch"
                f"{'es' * (micro > 1)}",
                piped,
            )
        )
        if (stages, micro) == (1, 1):
            rows.append(
                ("pipeline, 1 stage × 1 microbatch, unfused", _unfused(pipe, params, batch))
            )
    return rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def measure(width: int, batch_size: int, repeat: int) -> list[dict]:
    """Per row: its label, median seconds, and the median host timings."""
    import jax

    rows = _rows(width, batch_size)
    for _, call in rows:  # compile and warm up
        jax.block_until_ready(call({}))
    seconds: list[list[float]] = [[] for _ in rows]
    timings: list[list[dict]] = [[] for _ in rows]
    for round_ in range(repeat):
        for offset in range(len(rows)):
            i = (round_ + offset) % len(rows)
            got: dict = {}
            start = time.perf_counter()
            jax.block_until_ready(rows[i][1](got))
            seconds[i].append(time.perf_counter() - start)
            timings[i].append(got)
    results = []
    for (label, _), times, got in zip(rows, seconds, timings):
        # Each round's ratio to the jax.jit call of the same round: the load of a shared
        # machine drifts between rounds more than within one.
        ratios = [t / r for t, r in zip(times, seconds[0])]
        row = {"label": label, "seconds": _median(times), "ratio": _median(ratios)}
        if "host_s" in got[0]:
            row["actions"] = got[0]["num_actions"]
            row["programs"] = got[0]["num_programs"]
            row["host_s"] = _median([g["host_s"] for g in got])
            row["host_cpu_s"] = _median([g["host_cpu_s"] for g in got])
        else:
            row["dispatch_s"] = _median([g["dispatch_s"] for g in got])
            row["dispatch_cpu_s"] = _median([g["dispatch_cpu_s"] for g in got])
        results.append(row)
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| run | median ms | / jax.jit | actions | programs | host µs per action | "
        "host CPU µs per action |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results:
        ratio = row["ratio"]
        if "host_s" in row:
            actions = row["actions"]
            counts = f"{actions} | {row['programs']}"
            host = f"{1e6 * row['host_s'] / actions:.0f} | {1e6 * row['host_cpu_s'] / actions:.0f}"
        else:
            counts = "— | 1"
            host = (
                f"{1e6 * row['dispatch_s']:.0f} (its call) | "
                f"{1e6 * row['dispatch_cpu_s']:.0f} (its call)"
            )
        lines.append(
            f"| {row['label']} | {1e3 * row['seconds']:.2f} | {ratio:.3f} | {counts} | {host} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict]) -> str:
    one = next(r for r in results if r["label"] == "pipeline, 1 stage × 1 microbatch")
    ratio = one["ratio"]
    host = 1e6 * one["host_s"] / one["actions"]
    return (
        f"- 1 stage × 1 microbatch: {ratio:.3f} × jax.jit (target ≤ 1.05: "
        f"{'met' if ratio <= 1.05 else 'not met'}); host {host:.0f} µs per action "
        f"(target ≤ 100: {'met' if host <= 100 else 'not met'})"
    )


#: The parts of a call that ``profile`` times: (label, owner, method name).
PARTS = (
    ("binding the arguments", "pipeline", "Pipeline._bind"),
    ("the plan's key (shapes, dtypes)", "pipeline", "Pipeline._key"),
    ("the call's set-up (flatten, split)", "execution", "_Call.__init__"),
    ("placing the inputs", "execution", "_Call.place"),
    ("dispatching the program(s)", "execution", "_Call.dispatch"),
    ("collecting the results", "execution", "_Call.results"),
    ("the whole call", "pipeline", "Pipeline.__call__"),
)


def profile(width: int, batch_size: int, repeat: int) -> str:
    """The CPU time of each part of a 1 stage × 1 microbatch call (see the docstring)."""
    import jax

    import pipemark as pm
    from pipemark import examples
    from pipemark.runtime import pipeline
    from pipemark.runtime.execution import run as execution

    loss_fn, params, batch = examples.mlp(num_layers=4, width=width, batch=batch_size)
    reference = jax.jit(jax.value_and_grad(loss_fn))
    pipe = pm.pipeline_value_and_grad(
        loss_fn, num_stages=1, num_microbatches=1, devices=jax.devices()[:1]
    )
    jax.block_until_ready((pipe(params, batch), reference(params, batch)))
    seconds: dict[str, list[float]] = {label: [] for label, *_ in PARTS}
    modules = {"pipeline": pipeline, "execution": execution}
    originals = []
    for label, module, name in PARTS:
        owner = getattr(modules[module], name.split(".")[0])
        method = getattr(owner, name.split(".")[1])

        def timed(*args, method=method, label=label, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[label].append(time.thread_time() - start)

        originals.append((owner, name.split(".")[1], method))
        setattr(owner, name.split(".")[1], timed)
    jitted = []
    try:
        for _ in range(repeat):
            jax.block_until_ready(pipe(params, batch))
            start = time.thread_time()
            out = reference(params, batch)
            jitted.append(time.thread_time() - start)
            jax.block_until_ready(out)
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)
    lines = [
        "| part of a call (1 stage × 1 microbatch) | CPU µs per call |",
        "|---|---|",
    ]
    for label, times in seconds.items():
        per_call = len(times) // repeat
        lines.append(f"| {label} | {1e6 * per_call * _median(times):.0f} |")
    lines.append(f"| `jax.jit(jax.value_and_grad(loss))`, its call | {1e6 * _median(jitted):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="tiny and short")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.batch, args.repeat = 16, 32, 3
    _set_flags(2)
    results = measure(args.width, args.batch, args.repeat)
    print(
        f"4-layer MLP, width {args.width}, batch {args.batch}; {os.cpu_count()} CPU cores, "
        f"2 host devices; median of {args.repeat} interleaved rounds"
    )
    print()
    print(table(results))
    print()
    print(verdict(results))
    print()
    print(profile(args.width, args.batch, args.repeat))


if __name__ == "__main__":
    main()
