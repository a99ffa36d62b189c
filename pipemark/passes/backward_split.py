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

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.marks import weight_name
from pipemark.passes.framework import check_result, paused_collector
from pipemark.primitive import pipeline_p
from pipemark.roles import BACKWARD, WEIGHT, StageRole
from pipemark.staged import Stage, StagedJaxpr, ValueRef, new_ref, stage_debug_info

__all__ = ["split_backward"]

_NO_EFFECTS: frozenset = frozenset()


class _Halves(NamedTuple):
    """How one backward stage splits: the equations of each half (in program order),
    which of the stage's outputs each half returns, and what B exports to W."""

    b_eqns: list[Any]
    w_eqns: list[Any]
    b_outputs: list[int]  # stage output positions B returns (then the exports)
    w_outputs: list[int]  # stage output positions W returns
    exports: list[Var]  # values B defines that W reads
    w_name: str
    b_reads: set[Var]  # what B's equations read and B returns (the stage inputs it needs)
    w_reads: set[Var]  # what W's equations read and W returns


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
    # Per stage, the outputs that root W: program results no other stage reads.
    unread: dict[int, set[int]] = {}
    for r in staged.outputs:
        if r.kind == "stage":
            unread.setdefault(r.stage, set()).add(r.index)
    for s in stages:
        for r in s.inputs:
            if r.kind == "stage" and r.stage in unread:
                unread[r.stage].discard(r.index)
    w_roots = {c: sorted(os) for c, os in unread.items() if os}
    new_stages: list[Stage] = []
    # Per old stage, where its outputs went: None (same stage, same place), its new
    # index (moved down by the W stages before it), or per output a new reference.
    where: list[int | list[ValueRef] | None] = []
    for c, stage in enumerate(stages):
        halves = None
        if c in w_roots and stage.role.kind == BACKWARD:
            halves = _halves(stage, w_roots[c])
        if len(new_stages) == c:  # nothing split before it: it reads what it read
            inputs = stage.inputs
        else:
            inputs = tuple([_remap(ref, where) for ref in stage.inputs])
        if halves is None:
            moved = len(new_stages) != c
            where.append(len(new_stages) if moved else None)
            if moved or inputs is not stage.inputs:
                stage = Stage(stage.name, stage.closed_jaxpr, inputs, stage.eqn_indices, stage.role)
            new_stages.append(stage)
            continue
        where.append(_append_halves(new_stages, stage, inputs, halves))
    outputs = [_remap(ref, where) for ref in staged.outputs]
    names = [s.name for s in new_stages]
    if len(set(names)) != len(names):
        clash = next(n for n in names if names.count(n) > 1)  # the error path only
        raise StageGraphError(
            f"split_backward names a W stage {clash!r} (after its backward stage), but "
            "the program already has a stage of that name; rename that stage."
        )
    # Valid by construction: unique names (checked above), and every reference to a
    # program input or to an earlier stage's output.
    result = StagedJaxpr._trusted(new_stages, staged.invars, outputs, staged.debug_info)
    return result.with_signature(staged.signature).with_balance(staged.balance)


def _remap(ref: ValueRef, where: list[int | list[ValueRef] | None]) -> ValueRef:
    if ref.kind != "stage":
        return ref
    went = where[ref.stage]
    if went is None:
        return ref
    if type(went) is int:
        return new_ref("stage", ref.index, went)
    return went[ref.index]


def _halves(stage: Stage, roots: list[int]) -> _Halves | None:
    """How a backward stage splits, given the outputs that root W (``roots``), or
    ``None`` when one half would be empty.

    One sweep from the last equation to the first, so every reader of an equation's
    results is placed before the equation itself: the roots of W are the parameter
    gradients (program results no other stage reads), every other output roots B. An
    equation goes to W when W needs one of its results and B none; everything else
    stays in B: what B needs, effects, and dead code, so that nothing is dropped and B
    never reads what W computes. A marker is split by its operand/result pairs."""
    jaxpr = stage.jaxpr
    eqns, outvars = jaxpr.eqns, jaxpr.outvars
    w_roots = [o for o in roots if type(outvars[o]) is not Literal]
    if not w_roots:
        return None
    w_need = {outvars[o] for o in w_roots}
    rooted = set(w_roots)
    b_need = {v for o, v in enumerate(outvars) if o not in rooted and type(v) is not Literal}
    w_name = weight_name(stage.role.owner)
    b_rev: list[Any] = []
    w_rev: list[Any] = []
    w_defined: set[Var] = set()
    markers_in_b = 0
    for eqn in reversed(eqns):
        if eqn.primitive is pipeline_p:
            mine = [k for k, v in enumerate(eqn.outvars) if v in w_need and v not in b_need]
            if mine:
                w_rev.append(_pairs(eqn, mine, {**eqn.params, "name": w_name}))
                w_defined.update(eqn.outvars[k] for k in mine)
                _need(w_need, [eqn.invars[k] for k in mine])
            rest = [k for k in range(len(eqn.outvars)) if k not in mine] if mine else None
            if rest is None or rest:
                markers_in_b += 1
                b_rev.append(eqn if rest is None else _pairs(eqn, rest, eqn.params))
                _need(b_need, eqn.invars if rest is None else [eqn.invars[k] for k in rest])
            continue
        outs = eqn.outvars
        if not eqn.effects and not w_need.isdisjoint(outs) and b_need.isdisjoint(outs):
            w_rev.append(eqn)
            w_defined.update(outs)
            needed = w_need
        else:
            b_rev.append(eqn)
            needed = b_need
        try:  # _need, inline: this loop runs once per equation of every backward stage
            needed.update(eqn.invars)
        except TypeError:  # a Literal among them
            needed.update(a for a in eqn.invars if type(a) is not Literal)
    w_outputs = [o for o in w_roots if outvars[o] in w_defined]
    if not w_outputs or len(b_rev) == markers_in_b:
        return None  # W would be empty, or B holds nothing but markers (the stage is all W)
    b_eqns, w_eqns = b_rev[::-1], w_rev[::-1]
    b_defined = {v for e in b_eqns for v in e.outvars}
    exports: dict[Var, None] = {}  # what W reads from B, in the order W first reads it
    for e in w_eqns:
        for a in e.invars:
            if type(a) is not Literal and a in b_defined:
                exports[a] = None
    chosen = set(w_outputs)
    b_outputs = [o for o in range(len(outvars)) if o not in chosen]
    w_reads = w_need
    if len(w_outputs) < len(w_roots):  # roots B returns after all: W may not read them
        w_reads = {a for e in w_eqns for a in e.invars if type(a) is not Literal}
    return _Halves(b_eqns, w_eqns, b_outputs, w_outputs, list(exports), w_name, b_need, w_reads)


def _need(needed: set, invars: Sequence[Any]) -> None:
    try:
        needed.update(invars)
    except TypeError:  # a Literal among them (unhashable, and never a result)
        needed.update(a for a in invars if type(a) is not Literal)


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
) -> list[ValueRef]:
    """Append B and W for a backward stage; per output of the stage, where it went."""
    jaxpr, consts = stage.jaxpr, stage.closed_jaxpr.consts
    b, w = len(new_stages), len(new_stages) + 1
    b_out = [jaxpr.outvars[o] for o in halves.b_outputs] + halves.exports
    invars = jaxpr.invars
    b_reads, w_reads = halves.b_reads, halves.w_reads
    b_keep = [i for i, v in enumerate(invars) if v in b_reads]
    w_keep = [i for i, v in enumerate(invars) if v in w_reads]
    names = list(map(str, inputs))  # each input's debug name, made once for both halves
    b_inputs = tuple([inputs[i] for i in b_keep])
    b_jaxpr = _sub_jaxpr(
        jaxpr, stage.name, halves.b_eqns, b_out, [invars[i] for i in b_keep],
        b_inputs, [names[i] for i in b_keep],
    )  # fmt: skip
    new_stages.append(Stage(stage.name, ClosedJaxpr(b_jaxpr, consts), b_inputs, (), stage.role))
    # W reads the stage inputs it needs, then B's exports.
    first = len(halves.b_outputs)
    exported = [new_ref("stage", first + k, b) for k in range(len(halves.exports))]
    w_inputs = tuple([inputs[i] for i in w_keep] + exported)
    w_invars = [invars[i] for i in w_keep] + halves.exports
    w_name = halves.w_name
    w_out = [jaxpr.outvars[o] for o in halves.w_outputs]
    w_names = [names[i] for i in w_keep] + [str(ref) for ref in exported]
    w_jaxpr = _sub_jaxpr(jaxpr, w_name, halves.w_eqns, w_out, w_invars, w_inputs, w_names)
    w_role = StageRole(WEIGHT, stage.role.owner)
    new_stages.append(Stage(w_name, ClosedJaxpr(w_jaxpr, consts), w_inputs, (), w_role))
    went: list[Any] = [None] * len(jaxpr.outvars)
    for k, o in enumerate(halves.b_outputs):
        went[o] = new_ref("stage", k, b)
    for k, o in enumerate(halves.w_outputs):
        went[o] = new_ref("stage", k, w)
    return went


def _sub_jaxpr(
    jaxpr: Jaxpr,
    name: str,
    eqns: list[Any],
    outvars: list[Any],
    invars: list[Var],
    inputs: Sequence[ValueRef],
    names: Sequence[str],
) -> Jaxpr:
    """A stage jaxpr of ``eqns`` from ``invars`` to ``outvars``, with the original's
    constants and the effects of its equations."""
    effects = [e.effects for e in eqns if e.effects]
    # Most stages have no effect: one shared empty set, not a new one per stage.
    effects = frozenset().union(*effects) if effects else _NO_EFFECTS
    info = stage_debug_info(name, inputs, len(outvars), names)
    return Jaxpr(jaxpr.constvars, invars, outvars, eqns, effects, info)
