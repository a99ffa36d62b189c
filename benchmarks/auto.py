"""Benchmark of automatic layer slicing (pipemark.passes.auto_layers).

Prints two markdown tables:

1. Time to auto-slice programs of 1k to 100k equations into 8 layers, next to the time
   ``jax.make_jaxpr`` takes to trace them (a fresh function each time, so its cache
   never hides the tracing). Target: at most 0.2 s at 10k equations.
2. Balance (largest stage FLOPs / mean stage FLOPs) of a 48-block transformer cut into 4
   and 8 stages by ``auto_layers`` (by default, preferring cuts between blocks; and with
   ``block_cuts="off"``, cutting anywhere), by equal equation counts and by equal block
   counts; then the same model behind a heavy input projection (uneven layers). Target:
   at most 1.03 for ``auto_layers`` cutting anywhere; cuts between blocks may cost up to
   ``BLOCK_TOLERANCE`` (15 %) over the best cut anywhere.

Run with ``.venv/bin/python benchmarks/auto.py`` (``--quick`` stops at 10k equations).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time

import jax
import numpy as np

import pipemark as pm
from pipemark import examples
from pipemark.passes.auto import balanced_cuts, equation_costs


def _best_time(fn, repeat):
    # Like timeit: the garbage collector is off while timing, so a collection of the
    # previous program's millions of objects is not charged to this one.
    best = float("inf")
    result = None
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
    return best, result


def timing_table(sizes, layers=8):
    rows = [
        "| program | equations | make_jaxpr (s) | auto_layers (s) | auto / make_jaxpr |",
        "|---|---:|---:|---:|---:|",
    ]
    for grad in (False, True):
        for size in sizes:
            ex = examples.sized("transformer", size, grad=grad, markers=None)
            repeat = 3 if size <= 10_000 else 1
            trace_time, cj = _best_time(lambda ex=ex, grad=grad: ex.trace(grad), repeat)
            auto_time, _ = _best_time(lambda cj=cj: pm.passes.auto_layers(cj, layers), repeat)
            kind = "value_and_grad" if grad else "forward"
            rows.append(
                f"| transformer {kind} | {len(cj.eqns):,} | {trace_time:.3f} | "
                f"{auto_time:.3f} | {auto_time / trace_time:.2f} |"
            )
    return "\n".join(rows)


def _balance(costs, cuts):
    bounds = [0, *cuts, len(costs)]
    stage = np.array([costs[a:b].sum() for a, b in itertools.pairwise(bounds)])
    return stage.max() / stage.mean()


def _block_starts(num_layers, **sizes):
    """Equation index where each block begins in the unmarked program."""
    marked = examples.transformer(num_layers, markers="startend", **sizes).trace()
    starts = [
        i
        for i, e in enumerate(marked.eqns)
        if e.primitive is pm.pipeline_p and e.params["mark_type"] == "start"
    ]
    return [index - 2 * block for block, index in enumerate(starts)]


def _marked_cuts(marked):
    starts = [
        i
        for i, e in enumerate(marked.eqns)
        if e.primitive is pm.pipeline_p and e.params["mark_type"] == "start"
    ]
    return [index - 2 * k for k, index in enumerate(starts)][1:]


def _with_projection(ex, width):
    """The model behind a heavy input projection up to ``width`` and back: one costly
    stretch of equations at the start, as an embedding or a stem would be."""
    d_model = ex.batch[0].shape[-1]
    up = np.full((d_model, width), 1.0 / d_model, np.float32)
    down = np.full((width, d_model), 1.0 / width, np.float32)

    def loss_fn(params, batch):
        x, y = batch
        return ex.loss_fn(params, ((x @ up) @ down, y))

    return loss_fn


def balance_table(num_layers=48):
    sizes = dict(d_model=64, num_heads=4, seq=32, batch=2)
    ex = examples.transformer(num_layers, markers=None, **sizes)
    blocks = _block_starts(num_layers, **sizes)
    plain = jax.make_jaxpr(ex.loss_fn)(*ex.args)
    projected = jax.make_jaxpr(_with_projection(ex, 2048))(*ex.args)
    rows = [
        "| model | stages | auto_layers | auto_layers, cuts anywhere | equal equation counts "
        "| equal block counts | auto_layers time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, cj, offset in (
        (f"{num_layers} blocks", plain, 0),
        (f"{num_layers} blocks + heavy input projection", projected, 2),
    ):
        costs = equation_costs(cj)
        for stages in (4, 8):
            start = time.perf_counter()
            marked = pm.passes.auto_layers(cj, stages)
            elapsed = time.perf_counter() - start
            auto = _balance(costs, _marked_cuts(marked))
            anywhere = _balance(
                costs, _marked_cuts(pm.passes.auto_layers(cj, stages, block_cuts="off"))
            )
            equal_eqns = _balance(costs, balanced_cuts(np.ones(len(costs), np.int64), stages))
            per_stage = num_layers // stages
            by_blocks = [blocks[per_stage * k] + offset for k in range(1, stages)]
            equal_blocks = _balance(costs, by_blocks)
            rows.append(
                f"| {label} | {stages} | {auto:.4f} | {anywhere:.4f} | {equal_eqns:.4f} "
                f"| {equal_blocks:.4f} "
                f"| {elapsed:.3f} |"
            )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop at 10k equations")
    args = parser.parse_args()
    sizes = [1_000, 3_000, 10_000] if args.quick else [1_000, 3_000, 10_000, 30_000, 100_000]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}\n")
    print("Auto-slicing time, 8 layers\n")
    print(timing_table(sizes))
    print("\nBalance of a 48-block transformer (largest stage FLOPs / mean)\n")
    print(balance_table())


if __name__ == "__main__":
    main()
