"""Cut a scan over layers into contiguous chunks, so that stages can cut between them.

The standard way to write a deep model runs ``lax.scan`` over stacked layer parameters
(flax ``nn.scan``, ``nnx.scan``, equinox ``filter_vmap`` + ``scan``). To the passes that
is one equation: all layers would land in one stage. :func:`split_scan` rewrites each
heavy top-level scan of trip count ``L`` into ``num_chunks`` scans over contiguous index
ranges (lengths differing by at most one: 7 into 4 gives 2, 2, 2, 1), each over its
slice of the stacked inputs, with the carry threaded from one to the next::

    c, ys = scan[length=8] c0 ws
    →  w0 = slice ws 0:4 ; c1, y0 = scan[length=4] c0 w0
       w1 = slice ws 4:8 ; c, y1 = scan[length=4] c1 w1 ; ys = concatenate y0 y1

A reverse scan runs its chunks last range first. The chunks of a gradient program's
backward scan (``reverse=True``, reading the forward scan's stacked residuals) read the
forward chunks' pieces directly instead of slicing their concatenation, so backward
chunk ``k`` depends on forward chunk ``k`` alone and the stages mirror. Concatenations
nothing reads any more are dropped.

:func:`pipemark.passes.auto_layers` (and so ``pm.split(..., num_stages=S)``) calls it
first, so a scanned model splits into balanced stages with no extra call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var
from jax.extend.core import primitives as _primitives

from pipemark.cost import eqn_costs
from pipemark.errors import PipemarkError, check_closed_jaxpr, describe_eqn

__all__ = ["SCAN_COST_FRACTION", "chunk_ranges", "scans_to_split", "split_scan"]

#: The share of a program's cost a scan must have for :func:`split_scan` (and so
#: :func:`pipemark.passes.auto_layers`) to cut it by default.
SCAN_COST_FRACTION = 0.05

# Each piece of a split scan's stacked result: (start, stop, variable).
_Pieces = list[tuple[int, int, Any]]


def chunk_ranges(length: int, num_chunks: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges covering ``range(length)``, ``num_chunks`` of
    them (fewer when ``length`` is smaller), whose lengths differ by at most one, the
    longer ones first.

    >>> chunk_ranges(7, 4)
    [(0, 2), (2, 4), (4, 6), (6, 7)]
    >>> chunk_ranges(8, 4)
    [(0, 2), (2, 4), (4, 6), (6, 8)]
    """
    count = max(1, min(num_chunks, length))
    base, extra = divmod(length, count)
    ranges, start = [], 0
    for k in range(count):
        stop = start + base + (k < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


def _check_args(num_chunks: Any, min_cost_fraction: Any) -> None:
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, (int, np.integer)):
        raise PipemarkError(f"num_chunks must be a positive int, got {num_chunks!r}.")
    if num_chunks < 1:
        raise PipemarkError(f"num_chunks must be a positive int, got {num_chunks!r}.")
    if not isinstance(min_cost_fraction, (int, float)) or not 0 <= min_cost_fraction <= 1:
        raise PipemarkError(
            f"min_cost_fraction must be a number in [0, 1], got {min_cost_fraction!r}."
        )


def scans_to_split(cj: ClosedJaxpr, min_cost_fraction: float) -> list[int]:
    """Indices of the top-level scans of at least two iterations whose cost (FLOPs plus
    transcendentals) is at least ``min_cost_fraction`` of the program's."""
    eqns = cj.jaxpr.eqns
    if not any(eqn.primitive is _primitives.scan_p for eqn in eqns):
        return []
    costs = [c.total_flops for c in eqn_costs(cj)]
    total = sum(costs)
    return [
        i
        for i, eqn in enumerate(eqns)
        if eqn.primitive is _primitives.scan_p
        and eqn.params["length"] >= 2
        and costs[i] > 0
        and costs[i] >= min_cost_fraction * total
    ]


def split_scan(
    cj: ClosedJaxpr,
    num_chunks: int,
    *,
    min_cost_fraction: float = SCAN_COST_FRACTION,
    scans: Sequence[int] | None = None,
) -> ClosedJaxpr:
    """Cut every heavy top-level ``scan`` into ``num_chunks`` scans over contiguous
    index ranges (:func:`chunk_ranges`); see the module docstring.

    Pure: returns a new program computing the same results bit for bit (the input
    itself when no scan qualifies). A scan qualifies when it has at least two
    iterations, no effects, and costs at least ``min_cost_fraction`` of the program;
    ``scans`` (indices of top-level scan equations) chooses them instead.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> def f(ws, x):
    ...     return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    >>> cj = jax.make_jaxpr(f)(jnp.ones((7, 4, 4)), jnp.ones((2, 4)))
    >>> split = split_scan(cj, 4)
    >>> [e.params["length"] for e in split.eqns if e.primitive.name == "scan"]
    [2, 2, 2, 1]
    """
    check_closed_jaxpr(cj, "split_scan")
    _check_args(num_chunks, min_cost_fraction)
    if scans is None:
        scans = scans_to_split(cj, min_cost_fraction) if num_chunks > 1 else []
    targets = {i for i in scans if _splittable(cj.jaxpr.eqns, i)} if num_chunks > 1 else set()
    if not targets:
        return cj
    jaxpr = cj.jaxpr
    env: dict[Var, Any] = {}
    pieces: dict[Var, _Pieces] = {}
    eqns: list[JaxprEqn] = []
    made: set[int] = set()  # ids of the concatenations this pass made
    constvars, consts = list(jaxpr.constvars), list(cj.consts)

    def atom(v: Any) -> Any:
        return v if isinstance(v, Literal) else env.get(v, v)

    for index, eqn in enumerate(jaxpr.eqns):
        invars = [atom(v) for v in eqn.invars]
        if index not in targets:
            changed = any(a is not b for a, b in zip(invars, eqn.invars))
            eqns.append(eqn.replace(invars=invars) if changed else eqn)
            continue
        ranges = chunk_ranges(eqn.params["length"], num_chunks)
        traced, results, parts = _trace_chunks(eqn, invars, ranges, pieces)
        body = traced.jaxpr
        sub = dict(
            zip(body.invars, [*_operands(invars), *_piece_inputs(eqn, invars, ranges, pieces)])
        )
        constvars.extend(body.constvars)
        consts.extend(traced.consts)
        for new in body.eqns:
            new = new.replace(
                invars=[v if isinstance(v, Literal) else sub.get(v, v) for v in new.invars],
                source_info=eqn.source_info,
            )
            if new.primitive is _primitives.concatenate_p:
                made.add(id(new))
            eqns.append(new)
        for out, value in zip(eqn.outvars, results):
            env[out] = value if isinstance(value, Literal) else sub.get(value, value)
        for out, by_range in zip(eqn.outvars[eqn.params["num_carry"] :], parts):
            # Keyed by the variable later equations read (their inputs are renamed).
            pieces[env[out]] = [(a, b, sub.get(v, v)) for (a, b), v in zip(ranges, by_range)]
    outvars = [atom(v) for v in jaxpr.outvars]
    eqns = _drop_unread(eqns, made, outvars)
    effects = set().union(*(e.effects for e in eqns)) if eqns else set()
    new = jaxpr.replace(constvars=constvars, outvars=outvars, eqns=eqns, effects=effects)
    return ClosedJaxpr(new, consts)


def _splittable(eqns: Sequence[JaxprEqn], index: Any) -> bool:
    if not isinstance(index, (int, np.integer)) or not 0 <= index < len(eqns):
        raise PipemarkError(f"scans holds {index!r}, which is not an equation index.")
    eqn = eqns[index]
    if eqn.primitive is not _primitives.scan_p:
        raise PipemarkError(f"scans names {describe_eqn(eqn, int(index))}, which is no scan.")
    return eqn.params["length"] >= 2 and not eqn.effects


def _operands(invars: Sequence[Any]) -> list[Any]:
    return [v for v in invars if not isinstance(v, Literal)]


def _aligned(var: Any, ranges: list[tuple[int, int]], pieces: dict[Var, _Pieces]) -> bool:
    found = pieces.get(var) if not isinstance(var, Literal) else None
    return found is not None and [(a, b) for a, b, _ in found] == ranges


def _piece_inputs(eqn, invars, ranges, pieces) -> list[Any]:
    """The pieces the chunks read instead of slicing, in the order they are traced."""
    first_xs = eqn.params["num_consts"] + eqn.params["num_carry"]
    return [v for x in invars[first_xs:] if _aligned(x, ranges, pieces) for _, _, v in pieces[x]]


def _struct(v: Any) -> jax.ShapeDtypeStruct:
    aval = v.aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _trace_chunks(eqn, invars, ranges, pieces):
    """Trace the chunked scan: returns the traced program, the atoms standing for the
    scan's results (in the traced program's variables) and, per stacked result, its
    piece per range."""
    params = eqn.params
    num_consts, num_carry = params["num_consts"], params["num_carry"]
    operands = _operands(invars)
    piece_inputs = _piece_inputs(eqn, invars, ranges, pieces)
    order = ranges[::-1] if params["reverse"] else ranges
    num_ys = len(eqn.outvars) - num_carry

    def chunked(*flat):
        given, piece_values = iter(flat[: len(operands)]), iter(flat[len(operands) :])
        values = [v.val if isinstance(v, Literal) else next(given) for v in invars]
        consts, carry = values[:num_consts], values[num_consts : num_consts + num_carry]
        xs = []  # per stacked input: its pieces, or the whole stack to slice
        for var, value in zip(invars[num_consts + num_carry :], values[num_consts + num_carry :]):
            aligned = _aligned(var, ranges, pieces)
            xs.append([next(piece_values) for _ in ranges] if aligned else value)
        parts: list[list[Any]] = [[None] * len(ranges) for _ in range(num_ys)]
        for a, b in order:
            k = ranges.index((a, b))
            # Each chunk slices its inputs right before it runs, so the slices land in
            # the chunk's stage.
            chunk_xs = [x[k] if isinstance(x, list) else lax.slice_in_dim(x, a, b) for x in xs]
            out = _primitives.scan_p.bind(*consts, *carry, *chunk_xs, **dict(params, length=b - a))
            carry = out[:num_carry]
            for j, y in enumerate(out[num_carry:]):
                parts[j][k] = y
        ys = [p[0] if len(p) == 1 else lax.concatenate(p, 0) for p in parts]
        return [*carry, *ys, *(y for p in parts for y in p)]

    traced = jax.make_jaxpr(chunked)(*map(_struct, [*operands, *piece_inputs]))
    outs = traced.jaxpr.outvars
    results = outs[: num_carry + num_ys]
    flat_parts = outs[num_carry + num_ys :]
    parts = [flat_parts[j * len(ranges) : (j + 1) * len(ranges)] for j in range(num_ys)]
    return traced, results, parts


def _drop_unread(eqns: list[JaxprEqn], made: set[int], outvars: list[Any]) -> list[JaxprEqn]:
    """Leave out the concatenations this pass made whose result nothing reads (every
    reader took the pieces)."""
    if not made:
        return eqns
    read = {v for e in eqns for v in e.invars if not isinstance(v, Literal)}
    read.update(v for v in outvars if not isinstance(v, Literal))
    return [e for e in eqns if id(e) not in made or e.outvars[0] in read]
