"""The demo behind ``pipemark demo``: a small MLP with boundary markers, its jaxpr, and
a table showing that every transformation of the marked function equals the unmarked
one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

import pipemark as pm

WIDTH = 16
LAYERS = 3


def _init(seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), LAYERS)
    return [(jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.zeros(WIDTH)) for k in keys]


def _loss(params, x, *, marked: bool):
    for w, b in params:
        if marked:
            pm.mark_pipeline_boundary()
        x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)


def _checks(params, x) -> list[tuple[str, Callable[[Callable], object]]]:
    xs = jnp.stack([x, 2 * x])
    return [
        ("eager", lambda f: f(params, x)),
        ("jit", lambda f: jax.jit(f)(params, x)),
        ("grad", lambda f: jax.grad(f)(params, x)),
        ("jit(grad)", lambda f: jax.jit(jax.grad(f))(params, x)),
        ("vmap", lambda f: jax.vmap(f, in_axes=(None, 0))(params, xs)),
        ("vmap(grad)", lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0))(params, xs)),
        ("hessian", lambda f: jax.hessian(lambda x: f(params, x))(x)),
    ]


def _max_difference(a, b) -> float:
    diffs = jax.tree_util.tree_map(
        lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)), initial=0.0)), a, b
    )
    return max(jax.tree_util.tree_leaves(diffs), default=0.0)


def run(out: TextIO) -> bool:
    """Print the demo to ``out``; return whether every check matched."""
    params = _init()
    x = jnp.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)

    def marked(p, x):
        return _loss(p, x, marked=True)

    def plain(p, x):
        return _loss(p, x, marked=False)

    print(f"A {LAYERS}-layer MLP with a boundary marker before each layer:\n", file=out)
    print(jax.make_jaxpr(marked)(params, x), file=out)

    rows = []
    for name, apply in _checks(params, x):
        start = time.perf_counter()
        difference = _max_difference(apply(marked), apply(plain))
        seconds = time.perf_counter() - start
        rows.append((name, difference, difference <= 1e-5, seconds))

    print("\nEach transformation of the marked function vs. the unmarked one:\n", file=out)
    print(f"{'transform':<12} {'max |difference|':>17}  {'equal':<5} {'seconds':>8}", file=out)
    for name, difference, ok, seconds in rows:
        print(
            f"{name:<12} {difference:>17.2e}  {'yes' if ok else 'NO':<5} {seconds:>8.2f}", file=out
        )
    boundaries = sum(
        pm.is_marker(e, "boundary") for e in jax.make_jaxpr(jax.grad(marked))(params, x).eqns
    )
    print(f"\nboundary markers kept in make_jaxpr(grad(f)): {boundaries} of {LAYERS}", file=out)
    return all(ok for _, _, ok, _ in rows) and boundaries == LAYERS
