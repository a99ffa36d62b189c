"""Splitting a scan over layers: balance and time.

A 48-block transformer written as ``lax.scan`` over stacked block parameters
(``pipemark.examples.scanned_transformer``), ``value_and_grad`` of its loss, is split by
``pm.split(..., num_stages=S)``: the forward and backward scans are cut into S chunks
(``pm.passes.split_scan``) and balanced by ``auto_layers``. For S = 4 and 8, and for a
trip count that does not divide (47 blocks), print

- balance: the largest stage's FLOPs over the mean, forward stages and backward stages
  apart (target: at most 1.05 when the trip count divides);
- time: the passes after tracing (inline_calls, split_scan, auto_layers, slice_stages)
  over ``jax.make_jaxpr``'s time to trace the program (a fresh function each time;
  target: at most 0.1).

    python benchmarks/scan.py              # 48 and 47 blocks, d_model 64
    python benchmarks/scan.py --quick      # 8 and 7 blocks, d_model 16
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

import pipemark as pm
from pipemark import examples
from pipemark.cost import estimate_cost


def _best(fn, repeat):
    best, result = float("inf"), None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def _passes(cj, num_stages):
    # What pm.split runs after tracing; auto_layers splits the scans (split_scan).
    cj = pm.passes.inline_calls(cj)
    return pm.passes.slice_stages(pm.passes.auto_layers(cj, num_stages))


def _balance(flops):
    flops = np.asarray(flops, dtype=float)
    return flops.max() / flops.mean()


def row(num_layers, num_stages, d_model, repeat):
    ex = examples.scanned_transformer(num_layers, d_model=d_model, num_heads=4, seq=16)
    trace, cj = _best(lambda: ex.trace(grad=True), repeat)
    split, staged = _best(lambda: _passes(cj, num_stages), repeat)
    flops = [estimate_cost(s.closed_jaxpr).total_flops for s in staged.stages]
    forward, backward = flops[:num_stages], flops[num_stages : 2 * num_stages]
    lengths = [
        e.params["length"] for s in staged.stages[:num_stages] for e in s.jaxpr.eqns
        if e.primitive.name == "scan"
    ]  # fmt: skip
    return (
        (
            f"| {num_layers} | {num_stages} | {'-'.join(map(str, lengths))} | "
            f"{_balance(forward):.3f} | {_balance(backward):.3f} | {trace * 1e3:.1f} | "
            f"{split * 1e3:.1f} | {split / trace:.3f} |"
        ),
        num_layers % num_stages == 0,
        _balance(forward),
        _balance(backward),
        split / trace,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 7 blocks, d_model 16")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    layers, d_model = ((8, 7), 16) if args.quick else ((48, 47), 64)
    _passes(examples.scanned_transformer(4).trace(grad=True), 2)  # warm the caches
    print(
        "| blocks | stages | blocks per forward stage | forward balance | backward balance "
        "| make_jaxpr (ms) | split (ms) | split / make_jaxpr |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for num_layers in layers:
        for num_stages in (4, 8):
            line, divides, fwd, bwd, ratio = row(num_layers, num_stages, d_model, args.repeat)
            print(line, flush=True)
            results.append((divides, fwd, bwd, ratio))
    worst = max(max(f, b) for d, f, b, _ in results if d)
    slowest = max(r for *_, r in results)
    print()
    print(
        f"- balance when the trip count divides: worst {worst:.3f} "
        f"({'meets' if worst <= 1.05 else 'misses'} <= 1.05); split / make_jaxpr: worst "
        f"{slowest:.3f} ({'meets' if slowest <= 0.1 else 'misses'} <= 0.1)."
    )


if __name__ == "__main__":
    main()
