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

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Literal, Var, new_jaxpr_eqn, no_effects
from jax.extend.core import primitives as _primitives

from pipemark._compat import scan_operand_counts
from pipemark.caches import register_cache
from pipemark.cost import eqn_costs
from pipemark.errors import MarkerError, PipemarkError, describe_eqn
from pipemark.marks import PAIRED_MARK_TYPES, backward_name, forward_name
from pipemark.passes.framework import jaxpr_pass
from pipemark.primitive import is_marker, mark_pipeline_jaxpreqn

__all__ = [
    "SCAN_COST_FRACTION",
    "chunk_ranges",
    "layers_from_scans",
    "scans_to_split",
    "scans_with_layer_markers",
    "split_scan",
]

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


def scans_to_split(
    cj: ClosedJaxpr, min_cost_fraction: float, costs: Sequence[float] | None = None
) -> list[int]:
    """Indices of the top-level scans of at least two iterations whose cost (``costs``
    per equation, by default FLOPs plus transcendentals) is at least
    ``min_cost_fraction`` of the program's."""
    eqns = cj.jaxpr.eqns
    if not any(eqn.primitive is _primitives.scan_p for eqn in eqns):
        return []
    if costs is None:
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


@jaxpr_pass
def split_scan(
    cj: ClosedJaxpr,
    num_chunks: int,
    *,
    min_cost_fraction: float = SCAN_COST_FRACTION,
    scans: Sequence[int] | None = None,
) -> ClosedJaxpr:
    """Cut every heavy top-level ``scan`` into ``num_chunks`` scans over contiguous
    index ranges (:func:`chunk_ranges`); see the module docstring.

    Pure: returns a new program computing the same results with the same equations
    (the input itself when no scan qualifies); to float rounding, since XLA compiles
    each chunk's loop for its own length and may unroll or fuse it differently. A scan qualifies when it has at least two
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
    _check_args(num_chunks, min_cost_fraction)
    if scans is None:
        scans = scans_to_split(cj, min_cost_fraction) if num_chunks > 1 else []
    targets = {i for i in scans if _splittable(cj.jaxpr.eqns, i)} if num_chunks > 1 else set()
    if not targets:
        return cj
    return _rewrite(
        cj, {i: (cj.jaxpr.eqns[i], chunk_ranges(cj.jaxpr.eqns[i].params["length"], num_chunks), None)
             for i in targets}
    )  # fmt: skip


def _rewrite(cj: ClosedJaxpr, plans: dict[int, tuple[JaxprEqn, list, list | None]]) -> ClosedJaxpr:
    """Replace each planned top-level scan (``index -> (scan equation to split, ranges,
    stage names per range or None)``) by its chunks, each wrapped in zero-operand
    start/end markers of its stage name when names are given."""
    jaxpr = cj.jaxpr
    env: dict[Var, Any] = {}
    pieces: dict[Var, _Pieces] = {}
    eqns: list[JaxprEqn] = []
    made: set[int] = set()  # ids of the concatenations this pass made

    def atom(v: Any) -> Any:
        return v if isinstance(v, Literal) else env.get(v, v)

    for index, eqn in enumerate(jaxpr.eqns):
        invars = [atom(v) for v in eqn.invars]
        if index not in plans:
            changed = any(a is not b for a, b in zip(invars, eqn.invars))
            eqns.append(eqn.replace(invars=invars) if changed else eqn)
            continue
        scan, ranges, names = plans[index]
        chunks, tail, results, parts = _build_chunks(scan, invars, ranges, pieces)
        for k, chunk in chunks:
            if names is None:
                eqns.extend(chunk)
            else:
                start = mark_pipeline_jaxpreqn([], [], names[k], "start")
                end = mark_pipeline_jaxpreqn([], [], names[k], "end")
                eqns.extend([start, *chunk, end])
        made.update(id(e) for e in tail)
        eqns.extend(tail)
        env.update(zip(eqn.outvars, results))
        num_carry = scan_operand_counts(eqn.params)[1]
        for out, by_range in zip(eqn.outvars[num_carry:], parts):
            # Keyed by the variable later equations read (their inputs are renamed).
            pieces[env[out]] = [(a, b, v) for (a, b), v in zip(ranges, by_range)]
    outvars = [atom(v) for v in jaxpr.outvars]
    eqns = _drop_unread(eqns, made, outvars)
    effects = set().union(*(e.effects for e in eqns)) if eqns else set()
    new = jaxpr.replace(outvars=outvars, eqns=eqns, effects=effects)
    return ClosedJaxpr(new, cj.consts)


def _splittable(eqns: Sequence[JaxprEqn], index: Any) -> bool:
    if not isinstance(index, (int, np.integer)) or not 0 <= index < len(eqns):
        raise PipemarkError(f"scans holds {index!r}, which is not an equation index.")
    eqn = eqns[index]
    if eqn.primitive is not _primitives.scan_p:
        raise PipemarkError(f"scans names {describe_eqn(eqn, int(index))}, which is no scan.")
    return eqn.params["length"] >= 2 and not eqn.effects


def _aligned(var: Any, ranges: list[tuple[int, int]], pieces: dict[Var, _Pieces]) -> bool:
    found = pieces.get(var) if not isinstance(var, Literal) else None
    return found is not None and [(a, b) for a, b, _ in found] == ranges


@functools.cache
def _template(kind: str) -> tuple[Any, dict[str, Any]]:
    """The primitive and params JAX gives a traced slice or concatenate along axis 0
    (params differ between JAX versions; traced once per process)."""
    x = np.zeros((2, 1), np.float32)
    if kind == "slice":
        cj = jax.make_jaxpr(lambda x: lax.slice_in_dim(x, 0, 1))(x)
    else:
        cj = jax.make_jaxpr(lambda a, b: lax.concatenate([a, b], 0))(x, x)
    (eqn,) = cj.jaxpr.eqns
    return eqn.primitive, dict(eqn.params)


register_cache(_template.cache_clear)


@functools.lru_cache(maxsize=4096)
def _chunk_aval(aval: Any, length: int) -> Any:
    # Avals hash by value; the chunks of one scan share a few lengths.
    return aval.update(shape=(length, *aval.shape[1:]))


register_cache(_chunk_aval.cache_clear)


def _stacked_var(var: Any, length: int) -> Var:
    return Var(_chunk_aval(var.aval, length))


def _slice(x: Var, start: int, stop: int, where: JaxprEqn) -> JaxprEqn:
    primitive, params = _template("slice")
    shape = x.aval.shape
    params = dict(
        params,
        start_indices=(start,) + (0,) * (len(shape) - 1),
        limit_indices=(stop, *shape[1:]),
        strides=(1,) * len(shape) if params.get("strides") is not None else None,
    )
    out = _stacked_var(x, stop - start)
    return new_jaxpr_eqn([x], [out], primitive, params, no_effects, where.source_info, where.ctx)


def _build_chunks(eqn, invars, ranges, pieces):
    """The chunked scan: per chunk in execution order its range index and equations
    (its slices right before it, so they land in its stage), the concatenations of the
    stacked results, the atoms standing for the scan's results, and per stacked result
    its piece per range."""
    params = eqn.params
    num_consts, num_carry = scan_operand_counts(params)
    first_xs = num_consts + num_carry
    consts, carry = invars[:num_consts], invars[num_consts:first_xs]
    ys_out = eqn.outvars[num_carry:]
    chunks: list[tuple[int, list[JaxprEqn]]] = []
    tail: list[JaxprEqn] = []
    parts: list[list[Any]] = [[None] * len(ranges) for _ in ys_out]
    xs = [(x, _aligned(x, ranges, pieces)) for x in invars[first_xs:]]
    for a, b in ranges[::-1] if params["reverse"] else ranges:
        k = ranges.index((a, b))
        new: list[JaxprEqn] = []
        chunks.append((k, new))
        chunk_xs = []
        for x, aligned in xs:
            if aligned:
                chunk_xs.append(pieces[x][k][2])
            else:
                new.append(_slice(x, a, b, eqn))
                chunk_xs.append(new[-1].outvars[0])
        carry_out = [Var(v.aval) for v in eqn.outvars[:num_carry]]
        ys = [_stacked_var(v, b - a) for v in ys_out]
        new.append(
            new_jaxpr_eqn(
                [*consts, *carry, *chunk_xs],
                [*carry_out, *ys],
                eqn.primitive,
                dict(params, length=b - a),
                eqn.effects,
                eqn.source_info,
                eqn.ctx,
            )
        )
        carry = carry_out
        for j, y in enumerate(ys):
            parts[j][k] = y
    results = list(carry)
    concatenate, concat_params = _template("concatenate")
    for var, by_range in zip(ys_out, parts):
        if len(by_range) == 1:
            results.append(by_range[0])
            continue
        out = Var(var.aval)
        tail.append(
            new_jaxpr_eqn(
                list(by_range), [out], concatenate, dict(concat_params, dimension=0),
                no_effects, eqn.source_info, eqn.ctx,
            )
        )  # fmt: skip
        results.append(out)
    return chunks, tail, results, parts


def _drop_unread(eqns: list[JaxprEqn], made: set[int], outvars: list[Any]) -> list[JaxprEqn]:
    """Leave out the concatenations this pass made whose result nothing reads (every
    reader took the pieces)."""
    if not made:
        return eqns
    read = {v for e in eqns for v in e.invars if not isinstance(v, Literal)}
    read.update(v for v in outvars if not isinstance(v, Literal))
    return [e for e in eqns if id(e) not in made or e.outvars[0] in read]


def _body_markers(eqn: JaxprEqn) -> list[JaxprEqn]:
    if eqn.primitive is not _primitives.scan_p:
        return []
    body = eqn.params["jaxpr"].jaxpr
    return [e for e in body.eqns if is_marker(e, PAIRED_MARK_TYPES)]


def scans_with_layer_markers(cj: ClosedJaxpr) -> list[int]:
    """Indices of the top-level scans whose body holds start/end markers: a scan over
    layers marked ``each iteration is a layer``."""
    return [i for i, eqn in enumerate(cj.jaxpr.eqns) if _body_markers(eqn)]


def _unmarked_scan(eqn: JaxprEqn, index: int) -> tuple[JaxprEqn, str]:
    """The scan with the markers of its body removed (each passes its operands
    through), and their stage name."""
    markers = _body_markers(eqn)
    marker_ids = {id(m) for m in markers}
    names = {m.params.get("name") for m in markers}
    if len(names) != 1:
        raise MarkerError(
            f"{describe_eqn(eqn, index)} holds markers of several stages "
            f"{sorted(map(str, names))} in its body; mark each iteration as one layer: "
            "one start/end pair, one name."
        )
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    sub: dict[Var, Any] = {}
    kept = []
    for inner in body.eqns:
        invars = [v if isinstance(v, Literal) else sub.get(v, v) for v in inner.invars]
        if id(inner) in marker_ids:
            sub.update(zip(inner.outvars, invars))
            continue
        changed = any(a is not b for a, b in zip(invars, inner.invars))
        kept.append(inner.replace(invars=invars) if changed else inner)
    outvars = [v if isinstance(v, Literal) else sub.get(v, v) for v in body.outvars]
    effects = set().union(*(e.effects for e in kept)) if kept else set()
    new_body = ClosedJaxpr(body.replace(eqns=kept, outvars=outvars, effects=effects), closed.consts)
    return eqn.replace(params=dict(eqn.params, jaxpr=new_body)), names.pop()


@jaxpr_pass
def layers_from_scans(cj: ClosedJaxpr, num_stages: int | None = None) -> ClosedJaxpr:
    """Cut every top-level scan whose body is marked as one layer (start/end markers
    named ``N`` inside the body) into stages ``N0``, ``N1``, …: one per iteration, or
    ``num_stages`` chunks of contiguous iterations. A gradient program's backward scan
    (markers ``N_backward``) becomes the mirrored stages ``N{k}_backward``.

    The markers leave the body; each chunk (its slices and its scan) is wrapped in
    start/end markers that carry no values (the slicer finds what a stage reads).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> from jax import lax
    >>> def f(ws, x):
    ...     def layer(h, w):
    ...         h, w = pm.mark((h, w), name="block", mark_type="start")
    ...         return pm.mark(jnp.tanh(h @ w), name="block", mark_type="end"), None
    ...     return lax.scan(layer, x, ws)[0]
    >>> cj = jax.make_jaxpr(f)(jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
    >>> [s.name for s in pm.passes.slice_stages(layers_from_scans(cj)).stages]
    ['block0', 'block1', 'block2']
    """
    if num_stages is not None:
        _check_args(num_stages, 0.0)
    plans = {}
    for index in scans_with_layer_markers(cj):
        scan, name = _unmarked_scan(cj.jaxpr.eqns[index], index)
        length = scan.params["length"]
        ranges = chunk_ranges(length, length if num_stages is None else num_stages)
        base = forward_name(name)
        names = (
            [f"{name}{k}" for k in range(len(ranges))]
            if base is None
            else [backward_name(f"{base}{k}") for k in range(len(ranges))]
        )
        plans[index] = (scan, ranges, names)
    return _rewrite(cj, plans) if plans else cj
