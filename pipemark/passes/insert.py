"""Passes that put start/end markers into an unmarked (or boundary-marked) program.

All three passes share one builder: the equations are split into consecutive segments,
and each segment is wrapped in a ``start``/``end`` marker pair. Every value a segment
reads from outside (a program input, a constant, a value from an earlier segment)
enters through its start marker; every value it defines that a later segment or the
program's result reads leaves through its end marker. Literals stay inline. A value
defined in segment 0 and read in segment 3 leaves segment 0 through its end marker and
enters segment 3 through its start marker; segments 1 and 2 never see it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from jax.extend.core import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    new_jaxpr_eqn,
    no_effects,
)

from pipemark._compat import name_stack_scopes
from pipemark._text import plural
from pipemark.errors import MarkerError, PipemarkError, describe_eqn
from pipemark.marks import APPLY_STAGE, STAGE_MARK_TYPES, backward_name, forward_name
from pipemark.passes._backward import forward_end, mirror_cuts
from pipemark.passes._markers import check_no_markers_in_bodies
from pipemark.passes.framework import jaxpr_pass
from pipemark.passes.gradient import apply_start
from pipemark.primitive import pipeline_p

__all__ = ["insert_markers", "insert_markers_by_scope", "layers_from_boundaries"]


def _marker_indices(jaxpr: Jaxpr, pass_name: str, allowed: frozenset[str]) -> list[int]:
    """Indices of the program's marker equations; refuses stage markers (other than the
    mark types in ``allowed``), since the pass inserts them."""
    eqns = jaxpr.eqns
    markers = [index for index, eqn in enumerate(eqns) if eqn.primitive is pipeline_p]
    for index in markers:
        eqn = eqns[index]
        mark_type = eqn.params.get("mark_type")
        if mark_type in STAGE_MARK_TYPES and mark_type not in allowed:
            raise MarkerError(
                f"{describe_eqn(eqn, index)}: {pass_name} inserts stage markers into a "
                "program that has none, but this program already has one. Remove them "
                "first with pm.passes.remove_markers(cj), or slice the program as it is "
                "with pm.passes.slice_stages(cj)."
            )
    return markers


def _wrap_segments(
    cj: ClosedJaxpr,
    runs: Sequence[tuple[int | None, int, int]],
    names: Sequence[str],
) -> ClosedJaxpr:
    """Wrap each segment of equations in a start/end marker pair.

    ``runs`` covers the equations in program order with ``(segment, start, stop)``:
    equations ``start .. stop-1`` belong to ``segment`` (non-decreasing from run to
    run; a segment may have several runs), or are dropped when ``segment`` is ``None``.
    A dropped equation must be an identity (a marker); its results are replaced by its
    operands.

    A value read from outside a segment comes from the segment that defines it, with
    one exception: a mirrored segment ``<name>_backward`` takes a value that also
    entered segment ``<name>`` from there. In a pipeline the two run on one device, so
    the backward stage reuses what its forward stage received (for instance the layer
    input it needs for the weight gradient) instead of fetching it again.

    An end marker passes on the values its segment received and re-exports first, then
    the values its segment defines, in the order other segments first read them (the
    program's results last).
    """
    jaxpr = cj.jaxpr
    flow = _SegmentFlow(jaxpr, runs, names)
    writer = _SegmentWriter(jaxpr.eqns, flow, names)
    for segment in range(len(names)):
        if flow.runs_of[segment]:
            writer.segment(segment)
    outvars = []
    for atom in jaxpr.outvars:
        atom = flow.resolve(atom)
        outvars.append(writer.outside_copy.get(atom, atom) if type(atom) is not Literal else atom)
    new_jaxpr = Jaxpr(
        jaxpr.constvars, jaxpr.invars, outvars, writer.new_eqns, jaxpr.effects, jaxpr.debug_info
    )
    return ClosedJaxpr(new_jaxpr, cj.consts)


def _mirrors(names: Sequence[str]) -> dict[int, int]:
    """Segment -> the earlier segment it mirrors (``<name>_backward`` -> ``<name>``)."""
    segment_named = {name: k for k, name in enumerate(names)}
    mirror_of: dict[int, int] = {}
    for k, name in enumerate(names):
        mirrored = forward_name(name)
        forward = k if mirrored is None else segment_named.get(mirrored, k)
        if forward < k:
            mirror_of[k] = forward
    return mirror_of


class _SegmentFlow:
    """One sweep in program order (segments never go back, and a value is defined
    before it is read) finds the segment defining each value, what enters each segment
    from where (``None`` for the defining segment's end marker, or no marker for
    program inputs and constants; else the segment whose entered copy it is), what
    leaves each segment, and the equations that read a value from outside their
    segment: only those are rebuilt, to read the start marker's results; every other
    equation is reused as it is."""

    def __init__(
        self, jaxpr: Jaxpr, runs: Sequence[tuple[int | None, int, int]], names: Sequence[str]
    ) -> None:
        self.alias: dict[Var, object] = {}  # results of dropped markers: their operands
        self.defined_in: dict[Var, int] = {}
        self.runs_of: list[list[tuple[int, int]]] = [[] for _ in names]
        self.renamed: list[list[int]] = [[] for _ in names]
        self.entering_from: list[dict[Var, int | None]] = [{} for _ in names]
        self.exported: dict[Var, None] = {}  # defined values leaving their segment
        self.exported_from: list[list[Var]] = [[] for _ in names]
        self.reexported: list[dict[Var, None]] = [{} for _ in names]  # entered copies leaving
        self.sweep(jaxpr.eqns, runs, _mirrors(names))
        for atom in jaxpr.outvars:
            atom = self.resolve(atom)
            if type(atom) is not Literal and atom not in self.exported:
                home = self.defined_in.get(atom)
                if home is not None:
                    self.exported[atom] = None
                    self.exported_from[home].append(atom)

    def resolve(self, atom: Any) -> Any:
        if type(atom) is Literal:
            return atom
        return self.alias.get(atom, atom)

    def sweep(self, eqns: list, runs: Sequence, mirror_of: dict[int, int]) -> None:
        alias, defined_in, exported = self.alias, self.defined_in, self.exported
        defined_get = defined_in.get
        current = -1
        entering: dict[Var, int | None] = {}
        mirror_entering: dict[Var, int | None] | None = None
        mirror = None
        segment_renamed: list[int] = []
        for segment, start, stop in runs:
            run = eqns[start:stop]
            if segment is None:
                for eqn in run:
                    for inner, outer in zip(eqn.invars, eqn.outvars):
                        alias[outer] = inner if type(inner) is Literal else alias.get(inner, inner)
                continue
            if segment != current:
                current = segment
                entering = self.entering_from[segment]
                segment_renamed = self.renamed[segment]
                mirror = mirror_of.get(segment)
                mirror_entering = None if mirror is None else self.entering_from[mirror]
            self.runs_of[segment].append((start, stop))
            for index, eqn in enumerate(run, start):
                outside = False
                for atom in eqn.invars:
                    if type(atom) is Literal:
                        continue
                    if alias:
                        resolved = alias.get(atom, atom)
                        if resolved is not atom:
                            outside = True  # reads through a dropped marker: rebuilt
                            atom = resolved
                            if type(atom) is Literal:
                                continue
                    home = defined_get(atom)
                    if home == segment:
                        continue
                    outside = True
                    if atom in entering:
                        continue
                    if mirror_entering is not None and atom in mirror_entering:
                        entering[atom] = mirror
                        self.reexported[mirror][atom] = None  # type: ignore[index]
                    else:
                        entering[atom] = None
                        if home is not None and atom not in exported:
                            exported[atom] = None
                            self.exported_from[home].append(atom)
                if outside:
                    segment_renamed.append(index)
                for v in eqn.outvars:
                    defined_in[v] = segment


class _SegmentWriter:
    """Writes the segments, each between its start and end marker, in order."""

    def __init__(self, eqns: list, flow: _SegmentFlow, names: Sequence[str]) -> None:
        self.eqns, self.flow, self.names = eqns, flow, names
        self.outside_copy: dict[Var, Var] = {}  # value -> the end result later segments read
        self.passed_on: list[dict[Var, Var]] = [{} for _ in names]  # entered copy -> end result
        self.new_eqns: list[JaxprEqn] = []
        # Every marker is this one with its operands, results, parameters and source
        # replaced (built directly, as eqn.replace would): cheaper than building each
        # from scratch, and the same equation.
        marker = new_jaxpr_eqn([], [], pipeline_p, {}, no_effects)
        self.marker_effects, self.marker_ctx = marker.effects, marker.ctx

    def marker(self, operands: list, results: list, name: str, mark_type: str, at: int):
        return JaxprEqn(
            operands,
            results,
            pipeline_p,
            {"name": name, "mark_type": mark_type},
            self.marker_effects,
            self.eqns[at].source_info,
            self.marker_ctx,
        )

    def segment(self, segment: int) -> None:
        flow, new_eqns = self.flow, self.new_eqns
        segment_runs = flow.runs_of[segment]
        first, last = segment_runs[0][0], segment_runs[-1][1] - 1
        name = self.names[segment]
        entering = flow.entering_from[segment]
        # What the segment's equations read instead: the start marker's results, or
        # (through dropped markers) the operands.
        remap: dict[Var, object] = {v: Var(v.aval) for v in entering}
        sources = [
            self.outside_copy.get(v, v) if source is None else self.passed_on[source][v]
            for v, source in entering.items()
        ]
        new_eqns.append(self.marker(sources, list(remap.values()), name, "start", first))
        leaving: list[Var] = [remap[v] for v in flow.reexported[segment]]  # type: ignore[misc]
        if flow.alias:
            for outer, inner in flow.alias.items():
                if type(inner) is not Literal:
                    inner = remap.get(inner, inner)  # type: ignore[arg-type]
                remap.setdefault(outer, inner)
        self.copy_runs(segment_runs, flow.renamed[segment], remap)
        leaving += flow.exported_from[segment]
        results = [Var(v.aval) for v in leaving]
        new_eqns.append(self.marker(leaving, results, name, "end", last))
        count = len(flow.reexported[segment])
        self.passed_on[segment] = dict(zip(flow.reexported[segment], results[:count]))
        self.outside_copy.update(zip(leaving[count:], results[count:]))

    def copy_runs(self, segment_runs: list, renamed: list[int], remap: dict) -> None:
        """The segment's equations, those in ``renamed`` reading through ``remap``."""
        eqns, new_eqns = self.eqns, self.new_eqns
        # Equation ``index`` of a run lands at ``index + shift`` of the new list.
        shifts: list[tuple[int, int]] = []
        for start, stop in segment_runs:
            shifts.append((stop, len(new_eqns) - start))
            new_eqns.extend(eqns[start:stop])
        for index in renamed:
            shift = shifts[0][1]
            if len(shifts) > 1:
                shift = next(s for stop, s in shifts if index < stop)
            eqn = eqns[index]
            # eqn.replace(invars=...), without its extra call.
            new_eqns[index + shift] = JaxprEqn(
                [a if type(a) is Literal else remap.get(a, a) for a in eqn.invars],  # type: ignore[misc]
                eqn.outvars,
                eqn.primitive,
                eqn.params,
                eqn.effects,
                eqn.source_info,
                eqn.ctx,
            )


def _check_names(names: Sequence[str] | None, count: int, default: str) -> list[str]:
    if names is None:
        return [f"{default}{i}" for i in range(count)]
    if isinstance(names, str):
        raise PipemarkError(f"names must be a sequence of str, one per stage, got {names!r}.")
    names = list(names)
    if len(names) != count:
        raise PipemarkError(
            f"names has {len(names)} entries but the cuts make {count} stages; give one "
            "name per stage."
        )
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or not name:
            raise PipemarkError(f"Stage name {name!r} is not a non-empty str.")
        if name in seen:
            raise PipemarkError(f"Stage name {name!r} appears twice; stage names are unique.")
        seen.add(name)
    return names


@jaxpr_pass
def insert_markers(
    cj: ClosedJaxpr, cuts: Sequence[int], names: Sequence[str] | None = None
) -> ClosedJaxpr:
    """Wrap consecutive runs of equations in start/end markers: a stage begins at each
    equation index in ``cuts``.

    The first stage always begins at equation 0 (a cut at 0 is allowed and changes
    nothing), so ``cuts=[k]`` makes two stages: equations ``0..k-1`` and ``k..``.
    Every value a stage reads from outside enters through its start marker and every
    value a later stage or the result reads leaves through its end marker.

    Parameters
    ----------
    cj:
        A program without start/end or boundary markers.
    cuts:
        Sorted, unique equation indices in ``range(len(cj.eqns))``.
    names:
        One name per stage; default ``stage0``, ``stage1``, ….

    Raises
    ------
    PipemarkError
        For unsorted, duplicate or out-of-range cuts, or a wrong number of names.
    MarkerError
        If the program already has stage markers.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)
    >>> print(cj)
    { lambda ; a:f32[]. let b:f32[] = sin a; c:f32[] = cos b in (c,) }
    >>> print(insert_markers(cj, [1], names=["s0", "s1"]))  # doctest: +NORMALIZE_WHITESPACE
    { lambda ; a:f32[]. let
        b:f32[] = pipeline_marker[mark_type=start name=s0] a
        c:f32[] = sin b
        d:f32[] = pipeline_marker[mark_type=end name=s0] c
        e:f32[] = pipeline_marker[mark_type=start name=s1] d
        f:f32[] = cos e
        g:f32[] = pipeline_marker[mark_type=end name=s1] f
      in (g,) }
    """
    num_eqns = len(cj.jaxpr.eqns)
    if num_eqns == 0:
        raise PipemarkError("insert_markers: the program has no equations to put in stages.")
    try:
        raw_cuts = list(cuts)
        cut_list = [int(c) for c in raw_cuts]
        if any(isinstance(c, bool) or int(c) != c for c in raw_cuts):
            raise TypeError
    except (TypeError, ValueError):
        raise PipemarkError(f"cuts must be a sequence of equation indices, got {cuts!r}.") from None
    for previous, cut in itertools.pairwise(cut_list):
        if cut == previous:
            raise PipemarkError(f"cuts has equation index {cut} twice; give each cut once.")
        if cut < previous:
            raise PipemarkError(f"cuts must be sorted: {cut} comes after {previous}.")
    for cut in cut_list:
        if not 0 <= cut < num_eqns:
            raise PipemarkError(
                f"Cut {cut} is out of range: the program has {plural(num_eqns, 'equation')}, so a "
                f"stage can begin at an index from 0 to {num_eqns - 1}."
            )
    _marker_indices(cj.jaxpr, "insert_markers", frozenset())
    check_no_markers_in_bodies(cj.jaxpr)
    starts = sorted({0, *cut_list})
    names = _check_names(names, len(starts), "stage")
    runs = [
        (k, begin, stop) for k, (begin, stop) in enumerate(zip(starts, [*starts[1:], num_eqns]))
    ]
    return _wrap_segments(cj, runs, names)


@jaxpr_pass
def layers_from_boundaries(cj: ClosedJaxpr) -> ClosedJaxpr:
    """Turn zero-operand boundary markers into start/end markers around each layer.

    The equations between two boundary markers (and before the first, and after the
    last) form a layer named ``layer0``, ``layer1``, …; empty layers are skipped and
    the boundary markers are removed. Values crossing a layer boundary flow through the
    markers; program inputs and constants read by several layers enter each of them
    through its start marker; literals stay inline. A program without boundary markers
    becomes a single layer.

    Raises :class:`MarkerError` if the program also has start/end markers or a boundary
    marker inside a sub-jaxpr.

    A gradient program (``make_jaxpr(jax.value_and_grad(f))`` of a boundary-marked
    ``f``) has boundaries in its forward part only: a marker without operands has no
    tangent, so ``jax.grad`` leaves none in the backward pass. Its backward part is cut
    into mirrored layers ``layerN_backward … layer0_backward`` (last forward layer
    first), each holding the backward equations that read the forward values of its
    layer, as :func:`pipemark.passes.auto_layers` does.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = jnp.sin(x)
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> print(jax.make_jaxpr(f)(1.0))  # doctest: +NORMALIZE_WHITESPACE
    { lambda ; a:f32[]. let
        b:f32[] = sin a
        pipeline_marker[mark_type=boundary name=boundary]
        c:f32[] = cos b
      in (c,) }
    >>> print(layers_from_boundaries(jax.make_jaxpr(f)(1.0)))
    ... # doctest: +NORMALIZE_WHITESPACE
    { lambda ; a:f32[]. let
        b:f32[] = pipeline_marker[mark_type=start name=layer0] a
        c:f32[] = sin b
        d:f32[] = pipeline_marker[mark_type=end name=layer0] c
        e:f32[] = pipeline_marker[mark_type=start name=layer1] d
        f:f32[] = cos e
        g:f32[] = pipeline_marker[mark_type=end name=layer1] f
      in (g,) }
    """
    return _layers_from_boundaries(cj)


def _layers_from_boundaries(cj: ClosedJaxpr) -> ClosedJaxpr:
    markers = _marker_indices(cj.jaxpr, "layers_from_boundaries", frozenset(("boundary",)))
    check_no_markers_in_bodies(cj.jaxpr)
    eqns = cj.jaxpr.eqns
    backward_from = forward_end(cj.jaxpr)
    forward_count = len(eqns) if backward_from is None else backward_from
    boundaries = [i for i in markers if eqns[i].params.get("mark_type") == "boundary"]
    if boundaries and boundaries[-1] >= forward_count:
        forward_count = len(eqns)  # boundaries in the backward part: cut it as marked
    runs: list[tuple[int | None, int, int]] = []
    layer_starts: list[int] = []
    begin = 0
    for stop in [*boundaries, forward_count]:
        if stop > begin:
            runs.append((len(layer_starts), begin, stop))
            layer_starts.append(begin)
        if stop < forward_count:
            runs.append((None, stop, stop + 1))
        begin = stop + 1
    layers = len(layer_starts)
    names = [f"layer{i}" for i in range(layers)]
    # A training step's optimizer update (after its grad marker) is a stage of its own.
    apply_at = apply_start(cj.jaxpr)
    stop = len(eqns) if apply_at is None or apply_at <= forward_count else apply_at
    backward_count = stop - forward_count
    if backward_count >= layers > 1:
        # jax.grad leaves no boundary in the backward pass (a marker without operands
        # has no tangent), so cut it in mirror of the forward layers, as auto_layers does.
        mirrored = mirror_cuts(cj.jaxpr, forward_count, layer_starts[1:], layers, stop=stop)
        begins = [forward_count, *mirrored, stop]
        runs.extend((layers + stage, begins[stage], begins[stage + 1]) for stage in range(layers))
        names += [backward_name(f"layer{i}") for i in reversed(range(layers))]
    elif backward_count:
        # No backward pass, or one too short to mirror: it joins the last layer.
        runs.append((max(layers - 1, 0), forward_count, stop))
        if not names:
            names = ["layer0"]
    if stop < len(eqns):
        runs.append((len(names), stop, len(eqns)))
        names.append(APPLY_STAGE)
    # Every boundary is dropped; any other marker (a hook, ...) stays.
    return _wrap_segments(cj, runs, names)


@jaxpr_pass
def insert_markers_by_scope(cj: ClosedJaxpr, depth: int = 1) -> ClosedJaxpr:
    """Insert markers where the ``jax.named_scope`` / ``jax.named_call`` name changes.

    Each equation's key is its first ``depth`` scope names; a new stage begins wherever
    the key changes. The stage is named after the scopes (``"block1"``, or
    ``"block1/attn"`` for ``depth=2``), with ``_backward`` appended for equations that
    ``grad`` made by transposition, so ``value_and_grad`` of a scoped model splits into
    forward stages and mirrored backward stages. Equations with no scope at all (a
    loss, the seed of the backward pass) join the stage before them, or the first stage
    when they come first. A scope that comes back after another one gets a numbered
    name (``block1_2``).

    Blocks created in a loop need distinct scope names (``f"block{i}"``): consecutive
    equations with the same key are one stage.

    Raises
    ------
    PipemarkError
        If ``depth`` is not a positive int or no equation has a name scope.
    MarkerError
        If the program already has stage markers.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     with jax.named_scope("embed"):
    ...         x = jnp.sin(x)
    ...     with jax.named_scope("head"):
    ...         return jnp.cos(x)
    >>> marked = insert_markers_by_scope(jax.make_jaxpr(f)(1.0))
    >>> [e.params["name"] for e in marked.eqns if e.primitive is pm.pipeline_p]
    ['embed', 'embed', 'head', 'head']
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise PipemarkError(f"depth must be a positive int, got {depth!r}.")
    eqns = cj.jaxpr.eqns
    keys: list[tuple[tuple[str, ...], bool] | None] = []
    for eqn in eqns:
        scopes, transforms = name_stack_scopes(eqn.source_info)
        keys.append((scopes[:depth], "transpose" in transforms) if scopes else None)
    first_key = next((k for k in keys if k is not None), None)
    if first_key is None:
        raise PipemarkError(
            "insert_markers_by_scope: no equation has a name scope. Wrap the model's "
            "blocks in jax.named_scope(...) or jax.named_call, or cut by index with "
            "pm.passes.insert_markers(cj, cuts)."
        )
    cuts: list[int] = []
    names: list[str] = []
    uses: dict[str, int] = {}
    current = None
    for index, key in enumerate(keys):
        if key is None:
            if current is not None:
                continue
            key = first_key  # unscoped equations before the first scope join it
        if key == current:
            continue
        current = key
        scopes, transposed = key
        base = backward_name("/".join(scopes)) if transposed else "/".join(scopes)
        uses[base] = uses.get(base, 0) + 1
        cuts.append(index)
        names.append(base if uses[base] == 1 else f"{base}_{uses[base]}")
    # A numbered name may still collide with a scope literally called e.g. "block1_2".
    taken: set[str] = set()
    for i, name in enumerate(names):
        while name in taken:
            name += "_"
        taken.add(name)
        names[i] = name
    return insert_markers(cj, cuts, names)
