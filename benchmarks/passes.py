"""How long the pass pipeline takes compared with tracing the program.

For MLPs and transformers of about 2k to 200k equations (``value_and_grad`` of a model
whose layers are separated by boundary markers), time

    layers_from_boundaries → slice_stages → mark_missing_vars → dce

and divide by the time ``jax.make_jaxpr`` takes to trace the same program (a fresh
function each time: ``make_jaxpr`` caches on the function object). Print a markdown
table with the ratio and the microseconds per equation of each pass, and the time of a
bare def-use sweep over the same program (a dict store per result, a lookup per read
variable: the least any pass over the equations does) to show how much of the growth
with the program's size is the memory hierarchy's rather than the passes'.

The insert pass is :func:`~pipemark.passes.layers_from_boundaries`: it is what
``pm.split`` runs on a boundary-marked model, and on a gradient program it also cuts the
backward part into mirrored ``<name>_backward`` stages (the most expensive insert). This
is the main table. ``--markers startend`` times hand-marked models (``pm.mark``
start/end pairs) instead, without an insert pass; there ``mark_missing_vars`` has real
work, since the backward stages JAX makes read forward values past their markers.

Timing: the best of ``--repeat`` rounds; each round traces a fresh function and runs
the passes on that program (passes remember, per program, what they validated). Before
each timed call the heap that exists is frozen (``gc.freeze``), for tracing and passes
alike: otherwise a full collection over a heap holding a 200k-equation jaxpr lands in
whichever call happens to trigger it. The collector runs once per round, before
tracing, not before each timed call (a full collection leaves the CPU caches cold). The
last column repeats the ratio with the collector left as it is.

Targets: ratio <= 0.05 at 2k equations; microseconds per equation flat
within 2x from 2k to 200k.

The last lines time the front end ``pm.split`` runs before these passes,
``inline_calls`` then ``split_scan``, on the largest program of each kind: as traced
(nothing to inline, no scan: the passes only look) and traced under one ``jax.jit``
(the whole program is one jit equation to inline). Target: at most 10 % of
the pipeline's time.

The very last lines time ``split_backward`` (the B/W split of zero-bubble schedules)
on the staged gradient program of 10k equations, against ``make_jaxpr`` of that
program: with a stage per layer (the boundary-marked model), and cut into 8 and 64
stages by ``auto_layers``. Target: at most 0.05.

    python benchmarks/passes.py                      # 2k, 20k, 200k
    python benchmarks/passes.py --sizes 2000 20000 --repeat 5
    python benchmarks/passes.py --markers startend   # hand-marked models, no insert
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Literal

from pipemark import examples
from pipemark.passes import (
    dce,
    inline_calls,
    layers_from_boundaries,
    mark_missing_vars,
    slice_stages,
    split_scan,
)

PASSES: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("insert", layers_from_boundaries),
    ("slice", slice_stages),
    ("mark_missing_vars", mark_missing_vars),
    ("dce", dce),
)


def _timed(fn: Callable[[], Any], collector: bool) -> tuple[float, Any]:
    """Seconds ``fn()`` takes. Without ``collector``, the heap that exists before the
    call is frozen (``gc.freeze``): the collector still runs, but only over objects the
    call makes, so a full collection over an unrelated big heap (the input jaxpr,
    earlier results) does not land in whichever call happens to trigger it. With it, the
    collector runs as it would in a program."""
    if not collector:
        gc.freeze()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.unfreeze()


def _bare_sweep(cj: Any) -> None:
    """The least any def-use pass does: one sweep in program order that records each
    equation's results in a dict and looks up each variable it reads. Timed on the same
    program as the passes, it shows how much of the growth of µs/eqn with the program's
    size comes from memory (caches) rather than from the passes' algorithms."""
    defined: dict[Any, int] = {}
    get = defined.get
    for index, eqn in enumerate(cj.jaxpr.eqns):
        for v in eqn.invars:
            if type(v) is not Literal:
                get(v)
        for v in eqn.outvars:
            defined[v] = index


def _pipeline(cj: Any, collector: bool, insert: bool = True) -> dict[str, float]:
    """Seconds per pass. slice_stages reads the inserted program; the rewrite passes
    continue from it, each from the previous one's result. Without ``insert`` the
    program already has start/end markers and the insert pass is skipped."""
    times: dict[str, float] = {}
    inserted = current = cj
    for name, fn in PASSES:
        if name == "insert" and not insert:
            continue
        source = inserted if name == "slice" else current
        seconds, result = _timed(lambda fn=fn, source=source: fn(source), collector)
        times[name] = seconds
        if name == "insert":
            inserted = current = result
        elif name != "slice":
            current = result
    return times


def _fresh_trace(example: Any) -> tuple[float, Any]:
    """The example's gradient program traced afresh, and the seconds it took (the
    collector runs before, never inside, a timed call: see :func:`measure`)."""
    gc.collect()
    return _timed(lambda: example.trace(grad=True), collector=False)


def measure(kind: str, num_eqns: int, repeat: int, markers: str = "boundary") -> dict[str, Any]:
    insert = markers == "boundary"
    example = examples.sized(kind, num_eqns, markers=markers)
    # Each round traces a fresh function and runs the passes on that program: passes
    # remember what they validated on a program (by identity), so running them twice
    # on one program would time the second run without its checks. The collector runs
    # once per round, before tracing, never just before a timed call: a full collection
    # walks the whole heap and leaves the CPU caches cold for whatever runs next.
    trace_times, pass_times = [], []
    for _ in range(repeat):
        seconds, cj = _fresh_trace(example)
        trace_times.append(seconds)
        pass_times.append(_pipeline(cj, collector=False, insert=insert))
    best = {name: min(t[name] for t in pass_times) for name in pass_times[0]}
    sweep = min(_timed(lambda: _bare_sweep(cj), collector=False)[0] for _ in range(repeat))
    gc.collect()
    trace_with_collector, cj = _timed(lambda: example.trace(grad=True), collector=True)
    with_collector = _pipeline(cj, collector=True, insert=insert)
    count = len(cj.jaxpr.eqns)
    total = sum(best.values())
    return {
        "kind": kind,
        "eqns": count,
        "layers": len(example.params),
        "trace": min(trace_times),
        "passes": best,
        "total": total,
        "ratio": total / min(trace_times),
        "ratio_gc": sum(with_collector.values()) / trace_with_collector,
        "us_per_eqn": total / count * 1e6,
        "sweep_us_per_eqn": sweep / count * 1e6,
    }


def front_end(kind: str, num_eqns: int, repeat: int, pipeline_seconds: float) -> str:
    """One line: what inline_calls + split_scan add to the pipeline, as traced and for
    the program traced under one jax.jit."""
    example = examples.sized(kind, num_eqns, markers="boundary")

    def front(cj: Any) -> Any:
        return split_scan(inline_calls(cj), 8)

    plain, jitted = [], []
    for _ in range(repeat):
        gc.collect()
        cj = example.trace(grad=True)
        plain.append(_timed(lambda cj=cj: front(cj), collector=False)[0])
        gc.collect()
        wrapped = jax.jit(jax.value_and_grad(example.loss_fn))
        cj = jax.make_jaxpr(wrapped)(*example.args)
        jitted.append(_timed(lambda cj=cj: front(cj), collector=False)[0])
    a, b = min(plain), min(jitted)
    return (
        f"- {kind}, {num_eqns:,} equations: inline_calls + split_scan take {a * 1e3:.2f} ms "
        f"as traced ({100 * a / pipeline_seconds:.1f} % of the pipeline) and "
        f"{b * 1e3:.1f} ms with the program in one jit ({100 * b / pipeline_seconds:.1f} %); "
        "target <= 10 %."
    )


def backward_split_line(
    kind: str, num_eqns: int, repeat: int, num_stages: int | None = None
) -> str:
    """One line: ``split_backward`` (the B/W split zero-bubble schedules run) on the
    staged gradient program, against ``make_jaxpr`` of that program. With
    ``num_stages`` the model is traced without markers and cut into that many stages
    by ``auto_layers``; without, every layer is a stage (its boundary markers)."""
    from pipemark import split_jaxpr
    from pipemark.passes import split_backward

    markers = "boundary" if num_stages is None else None
    example = examples.sized(kind, num_eqns, markers=markers)
    traces, splits = [], []
    for _ in range(repeat):
        seconds, cj = _fresh_trace(example)
        traces.append(seconds)
        staged = split_jaxpr(cj, num_stages=num_stages)
        gc.collect()
        seconds, split = _timed(lambda staged=staged: split_backward(staged), collector=False)
        splits.append(seconds)
    a, b = min(splits), min(traces)
    how = "a stage per layer" if num_stages is None else f"auto_layers into {num_stages}"
    return (
        f"- {kind}, {len(cj.jaxpr.eqns):,} equations, {how}: {len(staged.stages)} → "
        f"{len(split.stages)} stages; split_backward {a * 1e3:.1f} ms, make_jaxpr "
        f"{b * 1e3:.0f} ms, ratio {a / b:.3f} (target <= 0.05)."
    )


def table(rows: list[dict[str, Any]]) -> str:
    names = [name for name, _ in PASSES]
    head = (
        "| model | equations | make_jaxpr (s) | "
        + " | ".join(f"{n} (µs/eqn)" for n in names)
        + " | passes (µs/eqn) | ratio | ratio, GC on | bare sweep (µs/eqn) | passes / sweep |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        per_pass = " | ".join(
            f"{r['passes'][n] / r['eqns'] * 1e6:.2f}" if n in r["passes"] else "—" for n in names
        )
        lines.append(
            f"| {r['kind']} | {r['eqns']:,} | {r['trace']:.2f} | {per_pass} | "
            f"{r['us_per_eqn']:.2f} | {r['ratio']:.3f} | {r['ratio_gc']:.3f} | "
            f"{r['sweep_us_per_eqn']:.3f} | {r['us_per_eqn'] / r['sweep_us_per_eqn']:.1f} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> str:
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["eqns"])
        smallest = mine[0]
        spread = max(r["us_per_eqn"] for r in mine) / min(r["us_per_eqn"] for r in mine)
        sweep_spread = mine[-1]["sweep_us_per_eqn"] / mine[0]["sweep_us_per_eqn"]
        ratio_ok = "meets" if smallest["ratio"] <= 0.05 else "misses"
        flat_ok = "meets" if spread <= 2 else "misses"
        lines.append(
            f"- {kind}: ratio {smallest['ratio']:.3f} at {smallest['eqns']:,} equations "
            f"({ratio_ok} <= 0.05); µs/eqn varies {spread:.2f}x from "
            f"{mine[0]['eqns']:,} to {mine[-1]['eqns']:,} equations ({flat_ok} <= 2x); "
            f"the bare def-use sweep's by {sweep_spread:.2f}x over the same range."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["mlp", "transformer"])
    parser.add_argument(
        "--markers",
        choices=["boundary", "startend"],
        default="boundary",
        help="boundary: time insert (layers_from_boundaries) too; startend: the model "
        "is marked by hand, time slice and the rewrite passes only",
    )
    parser.add_argument("--sizes", nargs="+", type=int, default=[2_000, 20_000, 200_000])
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed rounds per size, the same for every size: the growth from the smallest "
        "to the largest compares like with like",
    )
    args = parser.parse_args(argv)
    # The first call of each pass pays for lazy imports and caches; keep it out of the
    # table.
    for kind in args.kinds:
        warm = examples.sized(kind, 500, markers=args.markers).trace(grad=True)
        _pipeline(warm, False, insert=args.markers == "boundary")
    rows = []
    for kind in args.kinds:
        for size in args.sizes:
            row = measure(kind, size, args.repeat, args.markers)
            rows.append(row)
            print(
                f"{kind} {row['eqns']:,} equations: ratio {row['ratio']:.3f}, "
                f"{row['us_per_eqn']:.2f} µs/eqn",
                flush=True,
            )
    print()
    print(table(rows))
    print()
    print(verdict(rows))
    for kind in args.kinds:
        largest = max((r for r in rows if r["kind"] == kind), key=lambda r: r["eqns"])
        print(front_end(kind, max(args.sizes), args.repeat, largest["total"]), flush=True)
    # The B/W split at 10k equations (its target's size), or at the largest size asked
    # for when that is smaller (a quick run).
    size = min(10_000, max(args.sizes))
    repeat = max(args.repeat, 5) if size == 10_000 else args.repeat
    for kind in args.kinds:
        for num_stages in (None, 8, 64):
            print(backward_split_line(kind, size, repeat, num_stages), flush=True)


if __name__ == "__main__":
    main()
