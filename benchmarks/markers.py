"""Marker overhead on CPU: jitted training-step time with markers ÷ without.

For each MLP size, one training step (grad + SGD update, parameters donated) is compiled
with a start/end marker pair around every layer, under each lowering mode, and timed
against the same step without markers. The custom-call rows also report the copies made
around the markers: copies the CPU target made itself plus buffer copies XLA inserted in
the entry computation, with and without donating the parameters.

Targets: barrier ≤ 1.01×; custom call with donation makes 0 copies. Timing on a shared
machine is noisy (identity-mode steps, whose compiled code equals the unmarked step's,
scatter by several percent), so the last column compares the compiled code itself: on
CPU, XLA removes optimisation barriers before it optimises, and a barrier-lowered step
compiles to the very same instructions as the unmarked step.

    python benchmarks/markers.py            # the table in docs/custom-call.md
    python benchmarks/markers.py --quick    # smaller, for a smoke test
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp

import pipemark as pm
from pipemark import custom_call

MODES = ("identity", "barrier", "custom_call")


def init_params(width: int, depth: int, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), depth)
    return [(jax.random.normal(k, (width, width)) / width**0.5, jnp.zeros((width,))) for k in keys]


def make_step(marked: bool):
    # A fresh function per call: jit caches on the function object.
    def loss(params, x):
        for i, (w, b) in enumerate(params):
            if marked:
                x, w, b = pm.mark((x, w, b), name=f"layer{i}", mark_type="start")
            x = jnp.tanh(x @ w + b)
            if marked:
                (x,) = pm.mark((x,), name=f"layer{i}", mark_type="end")
        return jnp.mean(x**2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)

    return step


def time_steps(steps: dict, params, x, repeats: int, calls: int = 10) -> dict:
    """Fastest seconds per step of each donated, jitted step in ``steps`` (name → (mode,
    step)). Each round times ``calls`` consecutive steps of each kind, in an order that
    rotates from round to round, so neither load from other processes nor the cost of
    switching lowering modes between kinds favours one of them."""
    state = {}
    for name, (mode, step) in steps.items():
        with pm.lowering(mode):
            current = jax.tree_util.tree_map(jnp.copy, params)
            for _ in range(3):  # compile and warm up
                current = step(current, x)
            state[name] = jax.block_until_ready(current)
    names = list(steps)
    best = dict.fromkeys(steps, float("inf"))
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            mode, step = steps[name]
            with pm.lowering(mode):
                current = step(state[name], x)  # the first call after a switch: untimed
                jax.block_until_ready(current)
                start = time.perf_counter()
                for _ in range(calls):
                    current = step(current, x)
                state[name] = jax.block_until_ready(current)
                best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def optimized_instructions(marked: bool, mode: str, params, x) -> list[str]:
    """The instructions of the compiled (optimised) HLO of one step, without names,
    metadata or the stack-frame table: two steps with equal lists run the same code."""
    with pm.lowering(mode):
        text = jax.jit(make_step(marked), donate_argnums=0).lower(params, x).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%v", text)
    return [
        line.strip()
        for line in text.splitlines()
        if "=" in line and not re.match(r"\s*\d+ \{", line)
    ]


def entry_copies(compiled_text: str) -> int:
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    return len(re.findall(r"= \S+ copy\(", entry))


def count_copies(params, x, donate: bool) -> str:
    """'target + XLA' copies of one custom-call marked step."""
    step = jax.jit(make_step(True), donate_argnums=(0,) if donate else ())
    with pm.lowering("custom_call"):
        xla = entry_copies(step.lower(params, x).compile().as_text())
        params = jax.tree_util.tree_map(jnp.copy, params)
        custom_call.reset_cpu_copy_stats()
        jax.block_until_ready(step(params, x))
    return f"{custom_call.cpu_copy_stats().copies} + {xla}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="two small sizes, few repeats")
    args = parser.parse_args()
    if args.quick:
        args.widths, args.repeats = [32, 128], 5

    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, depth {args.depth}, "
        f"batch {args.batch}, fastest of {args.repeats} rounds of 10 steps per kind"
    )
    print()
    print(
        "| width | unmarked step | identity | barrier | custom_call "
        "| copies donated (target + XLA) | copies not donated "
        "| compiled code = unmarked (identity, barrier) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for width in args.widths:
        params = init_params(width, args.depth)
        x = jax.random.normal(jax.random.PRNGKey(1), (args.batch, width))
        steps = {"unmarked": ("identity", jax.jit(make_step(False), donate_argnums=0))}
        for mode in MODES:
            steps[mode] = (mode, jax.jit(make_step(True), donate_argnums=0))
        best = time_steps(steps, params, x, args.repeats)
        base = best["unmarked"]
        ratios = [best[mode] / base for mode in MODES]
        donated = count_copies(params, x, donate=True)
        kept = count_copies(params, x, donate=False)
        cells = " | ".join(f"{r:.3f}×" for r in ratios)
        unmarked = optimized_instructions(False, "identity", params, x)
        same = ", ".join(
            "yes" if optimized_instructions(True, mode, params, x) == unmarked else "no"
            for mode in ("identity", "barrier")
        )
        print(f"| {width} | {base * 1e6:.0f} µs | {cells} | {donated} | {kept} | {same} |")


if __name__ == "__main__":
    main()
