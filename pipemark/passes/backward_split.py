"""Split each backward stage into the gradients the pipeline waits for and those it
does not: :func:`split_backward`, the program transformation zero-bubble schedules need.

A backward stage ``<name>_backward`` computes two kinds of result: the cotangents of its
input activations, which the previous backward stage reads (on the pipeline's critical
path), and the gradients of its parameters, which only the program's result reads (they
can wait). :func:`split_backward` cuts it in two: **B** (``<name>_backward``) holds every
equation the activation cotangents need and nothing else; **W** (``<name>_weight``)
holds the equations only the parameter gradients need, reading from B the intermediate
values it shares with them (exported as extra B outputs). No equation is copied, so no
``dot_general`` is computed twice, and B then W computes exactly what the backward stage
did, bit for bit. A backward stage whose parameter gradients need no equation of their
own (or that has no parameters) gets no W.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from pipemark.errors import PipemarkError
from pipemark.marks import forward_name, weight_name
from pipemark.passes.framework import check_result, paused_collector
from pipemark.primitive import pipeline_p
from pipemark.staged import Stage, StagedJaxpr, ValueRef, new_ref, stage_debug_info

__all__ = ["split_backward"]


class _Halves(NamedTuple):
    """How one backward stage splits: the equations of each half (in program order),
    which of the stage's outputs each half returns, and what B exports to W."""

    b_eqns: list[Any]
    w_eqns: list[Any]
    b_outputs: list[int]  # stage output positions B returns (then the exports)
    w_outputs: list[int]  # stage output positions W returns
    exports: list[Var]  # values B defines that W reads


def split_backward(staged: StagedJaxpr) -> StagedJaxpr:
    """Split every backward stage of ``staged`` into B (activation cotangents) and W
    (parameter gradients); see the module docstring. Other stages are kept as they are.

    Before (one backward stage: the cotangent of ``x`` and the gradient of ``w``)::

        layer1_backward: { lambda ; x:f32[4,8] w:f32[8,8] g:f32[4,8]. let
            gx:f32[4,8] = dot_general[...] g w
            gw:f32[8,8] = dot_general[...] x g
          in (gx, gw) }

    After: B returns ``gx`` (read by ``layer0_backward``); W returns ``gw``::

        layer1_backward: { lambda ; w:f32[8,8] g:f32[4,8]. let
            gx:f32[4,8] = dot_general[...] g w  in (gx,) }
        layer1_weight:   { lambda ; x:f32[4,8] g:f32[4,8]. let
            gw:f32[8,8] = dot_general[...] x g  in (gw,) }

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, width=4, batch=2)
    >>> staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    >>> [s.name for s in split_backward(staged).stages]
    ['layer0', 'layer1', 'layer1_backward', 'layer1_weight', 'layer0_backward']
    """
    if not all(hasattr(staged, a) for a in ("stages", "outputs", "invars")):
        raise PipemarkError(
            f"split_backward takes a StagedJaxpr, got {type(staged).__name__}; make one "
            "with pm.split(jax.value_and_grad(loss), *args)."
        )
    with paused_collector():
        result = _split(staged)
    if jax.config.jax_enable_checks:
        check_result(result)
    return result


def _split(staged: StagedJaxpr) -> StagedJaxpr:
    stages = staged.stages
    read_by_stages = {(r.stage, r.index) for s in stages for r in s.inputs if r.kind == "stage"}
    results = {(r.stage, r.index) for r in staged.outputs if r.kind == "stage"}
    new_stages: list[Stage] = []
    # (old stage, old output) -> (new stage, new output)
    moved: dict[tuple[int, int], tuple[int, int]] = {}
    for c, stage in enumerate(stages):
        halves = None
        if forward_name(stage.name) is not None:
            halves = _halves(stage, c, read_by_stages, results)
        inputs = tuple(_remap(ref, moved) for ref in stage.inputs)
        if halves is None:
            b = len(new_stages)
            new_stages.append(Stage(stage.name, stage.closed_jaxpr, inputs, stage.eqn_indices))
            moved.update({(c, o): (b, o) for o in range(len(stage.jaxpr.outvars))})
            continue
        _append_halves(new_stages, stage, inputs, halves, c, moved)
    outputs = [_remap(ref, moved) for ref in staged.outputs]
    return StagedJaxpr(new_stages, staged.invars, outputs, staged.debug_info, staged.signature)


def _remap(ref: ValueRef, moved: dict[tuple[int, int], tuple[int, int]]) -> ValueRef:
    if ref.kind != "stage":
        return ref
    stage, index = moved[(ref.stage, ref.index)]
    return new_ref("stage", index, stage)


def _halves(stage: Stage, c: int, read_by_stages: set, results: set) -> _Halves | None:
    """How backward stage ``c`` splits, or ``None`` when one half would be empty."""
    jaxpr = stage.jaxpr
    eqns, outvars = jaxpr.eqns, jaxpr.outvars
    producer = {v: (i, k) for i, e in enumerate(eqns) for k, v in enumerate(e.outvars)}
    # The outputs another stage reads (activation cotangents) root B; effects stay in B.
    b_roots = [outvars[o] for o in range(len(outvars)) if (c, o) in read_by_stages]
    effects = [i for i, e in enumerate(eqns) if e.effects and e.primitive is not pipeline_p]
    b_whole, b_parts = _needs(eqns, b_roots, producer, effects)
    w_outputs = [
        o
        for o in range(len(outvars))
        if (c, o) in results
        and (c, o) not in read_by_stages
        and type(outvars[o]) is not Literal
        and outvars[o] in producer
        and not _in(b_whole, b_parts, *producer[outvars[o]])
    ]
    if not w_outputs:
        return None
    w_all_whole, w_all_parts = _needs(eqns, [outvars[o] for o in w_outputs], producer)
    while True:
        w_whole = w_all_whole - b_whole
        w_parts = {i: ks - b_parts.get(i, set()) for i, ks in w_all_parts.items()}
        b_eqns, w_eqns = _partition(eqns, w_whole, w_parts, weight_name(stage.name))
        # What stays in B (dead code among it) must not read what W computes: such a
        # value moves to B, with what it needs, until B reads only its own.
        defined_in_w = {v for e in w_eqns for v in e.outvars}
        wanted = [
            a for e in b_eqns for a in e.invars if type(a) is not Literal and a in defined_in_w
        ]
        if not wanted:
            break
        more_whole, more_parts = _needs(eqns, wanted, producer)
        b_whole |= more_whole
        for i, ks in more_parts.items():
            b_parts.setdefault(i, set()).update(ks)
    w_outputs = [o for o in w_outputs if not _in(b_whole, b_parts, *producer[outvars[o]])]
    if not w_outputs or not any(e.primitive is not pipeline_p for e in b_eqns):
        return None  # W would be empty, or B holds nothing but markers (the stage is all W)
    defined_in_b = {v for e in b_eqns for v in e.outvars}
    exports: dict[Var, None] = {}
    for e in w_eqns:
        for a in e.invars:
            if type(a) is not Literal and a in defined_in_b:
                exports[a] = None
    b_outputs = [o for o in range(len(outvars)) if o not in w_outputs]
    return _Halves(b_eqns, w_eqns, b_outputs, w_outputs, list(exports))


def _in(whole: set[int], parts: dict[int, set[int]], i: int, k: int) -> bool:
    return i in whole or k in parts.get(i, ())


def _needs(
    eqns: Sequence[Any],
    roots: Sequence[Any],
    producer: dict[Var, tuple[int, int]],
    seeds: Sequence[int] = (),
) -> tuple[set[int], dict[int, set[int]]]:
    """What the values ``roots`` (and the equations ``seeds``) depend on: whole
    equations, and for each marker the result positions (a marker is an identity per
    operand/result pair, so its result ``k`` needs only its operand ``k``)."""
    whole: set[int] = set(seeds)
    parts: dict[int, set[int]] = {}
    seen: set[Var] = set()
    stack = [*roots, *(a for i in seeds for a in eqns[i].invars)]
    while stack:
        v = stack.pop()
        if type(v) is Literal or v in seen or v not in producer:
            continue
        seen.add(v)
        i, k = producer[v]
        eqn = eqns[i]
        if eqn.primitive is pipeline_p:
            parts.setdefault(i, set()).add(k)
            stack.append(eqn.invars[k])
        elif i not in whole:
            whole.add(i)
            stack.extend(eqn.invars)
    return whole, parts


def _partition(
    eqns: Sequence[Any], w_whole: set[int], w_parts: dict[int, set[int]], w_name: str
) -> tuple[list[Any], list[Any]]:
    """The equations of B and of W, in program order. A marker is split by its
    operand/result pairs (W's pairs in a marker named ``w_name``); an equation neither
    half needs (dead code) stays in B, so nothing is dropped."""
    b_eqns: list[Any] = []
    w_eqns: list[Any] = []
    for i, eqn in enumerate(eqns):
        if eqn.primitive is not pipeline_p:
            (w_eqns if i in w_whole else b_eqns).append(eqn)
            continue
        mine = sorted(w_parts.get(i, ()))
        if mine:
            w_eqns.append(_pairs(eqn, mine, {**eqn.params, "name": w_name}))
        rest = [k for k in range(len(eqn.outvars)) if k not in set(mine)]
        if rest or not eqn.outvars:
            b_eqns.append(eqn if not mine else _pairs(eqn, rest, eqn.params))
    return b_eqns, w_eqns


def _pairs(eqn: Any, positions: list[int], params: dict) -> Any:
    return eqn.replace(
        invars=[eqn.invars[k] for k in positions],
        outvars=[eqn.outvars[k] for k in positions],
        params=params,
    )


def _append_halves(
    new_stages: list[Stage],
    stage: Stage,
    inputs: tuple[ValueRef, ...],
    halves: _Halves,
    c: int,
    moved: dict[tuple[int, int], tuple[int, int]],
) -> None:
    """Append B and W for backward stage ``c`` and record where its outputs went."""
    jaxpr, consts = stage.jaxpr, stage.closed_jaxpr.consts
    b, w = len(new_stages), len(new_stages) + 1
    b_out = [jaxpr.outvars[o] for o in halves.b_outputs] + halves.exports
    b_reads = _reads(halves.b_eqns, b_out)
    b_pairs = [(ref, v) for ref, v in zip(inputs, jaxpr.invars) if v in b_reads]
    b_inputs = tuple(ref for ref, _ in b_pairs)
    b_jaxpr = _sub_jaxpr(jaxpr, stage.name, halves.b_eqns, b_out, [v for _, v in b_pairs], b_inputs)
    new_stages.append(Stage(stage.name, ClosedJaxpr(b_jaxpr, consts), b_inputs))
    # W reads the stage inputs it needs, then B's exports.
    exported_at = {v: len(halves.b_outputs) + k for k, v in enumerate(halves.exports)}
    w_reads = _reads(halves.w_eqns, [jaxpr.outvars[o] for o in halves.w_outputs])
    stage_inputs = [(ref, v) for ref, v in zip(inputs, jaxpr.invars) if v in w_reads]
    w_invars = [v for _, v in stage_inputs] + halves.exports
    w_inputs = tuple(ref for ref, _ in stage_inputs) + tuple(
        new_ref("stage", exported_at[v], b) for v in halves.exports
    )
    w_name = weight_name(stage.name)
    w_out = [jaxpr.outvars[o] for o in halves.w_outputs]
    w_jaxpr = _sub_jaxpr(jaxpr, w_name, halves.w_eqns, w_out, w_invars, w_inputs)
    new_stages.append(Stage(w_name, ClosedJaxpr(w_jaxpr, consts), w_inputs))
    moved.update({(c, o): (b, k) for k, o in enumerate(halves.b_outputs)})
    moved.update({(c, o): (w, k) for k, o in enumerate(halves.w_outputs)})


def _reads(eqns: Sequence[Any], outvars: Sequence[Any]) -> set[Var]:
    reads = {a for e in eqns for a in e.invars if type(a) is not Literal}
    reads.update(v for v in outvars if type(v) is not Literal)
    return reads


def _sub_jaxpr(
    jaxpr: Jaxpr,
    name: str,
    eqns: list[Any],
    outvars: list[Any],
    invars: list[Var],
    inputs: Sequence[ValueRef],
) -> Jaxpr:
    """A stage jaxpr of ``eqns`` from ``invars`` to ``outvars``, with the original's
    constants and the effects of its equations."""
    effects: set[Any] = set()
    for e in eqns:
        effects.update(e.effects)
    info = stage_debug_info(name, inputs, len(outvars))
    return Jaxpr(jaxpr.constvars, invars, outvars, eqns, effects, info)
