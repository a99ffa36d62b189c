"""The backward part of a gradient program, and how to cut it in mirror of the forward.

``jax.grad`` makes the backward pass by transposing the forward one, and JAX records
that in each equation's name stack. :func:`forward_end` finds where the backward pass
begins; :func:`mirror_cuts` cuts it into stages that mirror given forward layers (the
last forward layer's mirror first), keeping each backward equation next to the forward
values it reads. :func:`pipemark.passes.auto_layers` and
:func:`pipemark.passes.layers_from_boundaries` both use it, so a program cut either way
gets the ``<name>_backward`` stages that ``jax.grad`` gives a hand-marked function.
"""

from __future__ import annotations

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from pipemark._compat import name_stack_scopes
from pipemark.cost import _nbytes

__all__ = ["crossing_bytes", "forward_end", "mirror_cuts"]


def crossing_bytes(
    program: ClosedJaxpr | Jaxpr, start: int = 0, stop: int | None = None
) -> np.ndarray:
    """Bytes that a cut before each equation of ``eqns[start:stop]`` would move.

    Entry ``i`` (for ``0 <= i <= stop - start``) is the total size of the values made
    by equations ``start .. start+i-1`` and read by equations ``start+i .. stop-1``.
    Program inputs and constants are not counted (every stage can read them), nor are
    reads after ``stop``. Linear in the number of equations.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)) + x)(jnp.ones(8))
    >>> crossing_bytes(cj)
    array([ 0, 32, 32,  0])
    """
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    eqns = jaxpr.eqns
    stop = len(eqns) if stop is None else stop
    count = stop - start
    defined: dict[Var, int] = {}
    last_use: dict[Var, int] = {}
    for i in range(count):
        eqn = eqns[start + i]
        for v in eqn.invars:
            if isinstance(v, Var) and v in defined:
                last_use[v] = i
        for v in eqn.outvars:
            defined[v] = i
    delta = np.zeros(count + 2, dtype=np.int64)
    for v, use in last_use.items():
        size = _nbytes(v.aval)
        delta[defined[v] + 1] += size
        delta[use + 1] -= size
    return np.cumsum(delta)[: count + 1]


def mirror_cuts(jaxpr: Jaxpr, forward_end: int, forward_cuts: list[int], layers: int) -> list[int]:
    """Cut the backward part ``eqns[forward_end:]`` into ``layers`` stages, mirroring
    forward layers ``layers-1 .. 0``; returns absolute equation indices where backward
    stages 2, 3, … begin."""
    eqns = jaxpr.eqns
    bounds = [0, *forward_cuts, forward_end]
    # Which forward layers hold each value: the layer that makes it and every layer
    # that reads it. Program inputs belong to the layers that read them.
    holders: dict[Var, set[int]] = {}
    for layer in range(layers):
        for index in range(bounds[layer], bounds[layer + 1]):
            eqn = eqns[index]
            for v in eqn.invars:
                if isinstance(v, Var):
                    holders.setdefault(v, set()).add(layer)
            for v in eqn.outvars:
                holders.setdefault(v, set()).add(layer)
    count = len(eqns) - forward_end
    # misplaced[b, t]: bytes backward equation b must fetch from other forward layers
    # if it runs in the mirror of forward layer t.
    misplaced = np.zeros((count, layers))
    for b in range(count):
        seen: set[Var] = set()
        for v in eqns[forward_end + b].invars:
            if not isinstance(v, Var) or v in seen or v not in holders:
                continue
            seen.add(v)
            size = _nbytes(v.aval)
            misplaced[b] += size
            for layer in holders[v]:
                misplaced[b, layer] -= size
    cut_bytes = crossing_bytes(jaxpr, forward_end).astype(np.float64)
    index = np.arange(count + 1)
    inf = np.inf
    # Stage s of the backward mirrors forward layer layers-1-s.
    totals = np.concatenate(([0.0], np.cumsum(misplaced[:, layers - 1])))
    best = np.where(index >= 1, totals, inf)
    choices = []
    for s in range(1, layers):
        totals = np.concatenate(([0.0], np.cumsum(misplaced[:, layers - 1 - s])))
        candidate = best + cut_bytes - totals
        candidate[:s] = inf
        candidate[count] = inf
        running = np.minimum.accumulate(candidate)
        # The latest position that attains the running minimum (ties: later cuts).
        argmin = np.maximum.accumulate(np.where(candidate == running, index, 0))
        new_best = np.full(count + 1, inf)
        new_best[1:] = totals[1:] + running[:-1]
        new_best[: s + 1] = inf
        best = new_best
        choices.append(np.concatenate(([-1], argmin[:-1])))
    cuts = []
    end = count
    for choice in reversed(choices):
        end = int(choice[end])
        cuts.append(end)
    return [forward_end + c for c in cuts[::-1]]


def forward_end(jaxpr: Jaxpr) -> int | None:
    """Index of the first equation JAX made by transposition (the backward pass)."""
    for index, eqn in enumerate(jaxpr.eqns):
        _, transforms = name_stack_scopes(eqn.source_info)
        if "transpose" in transforms:
            return index
    return None
