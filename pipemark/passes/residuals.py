"""Hand each backward stage the fewest residual bytes: :func:`recompute_residuals`.

A forward stage returns the residuals its backward stage reads: every value of the
forward that ``jax.vjp`` keeps. Many of them are cheap functions of others: the
``bfloat16`` copy of a ``float32`` weight, a causal mask made from ``iota``, the
``tanh`` and the squares inside a GELU, a softmax's probabilities in two precisions.
Inside one ``jax.jit`` program XLA fuses such values into their readers and stores the
few they come from; between two stage programs every residual is written to memory by
the forward, held while the microbatch is in flight, and read back by the backward. On a
TPU v5e the forward stage of four GPT blocks (one 1024-token row) returned 961 MB.

:func:`recompute_residuals` chooses, per forward stage, the set of values to hand over
with the fewest bytes from which the backward can recompute every residual by cheap
equations (elementwise arithmetic, casts, comparisons, ``select_n``, broadcasts,
reshapes, transposes, ``iota``; never a reduction or an equation with effects; a
``dot_general`` only when its result is at least :data:`EXPANSION` times the bytes of
its operands, as attention scores are): a minimum cut, as PyTorch's AOTAutograd
partitioner cuts between its forward and backward graphs. A program input (a parameter, the batch) costs nothing to hand
over: the backward reads it where it lies. The backward stage then starts with copies
of the cheap equations, on variables of its own, and the forward drops the cheap
equations nothing reads any more. The staged program computes the same values
(recomputation repeats the same operations on the same operands).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import jax
import networkx as nx
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from pipemark.cost import nbytes
from pipemark.errors import PipemarkError
from pipemark.passes.framework import check_result, paused_collector
from pipemark.passes.rewrite import dce
from pipemark.passes.stages import pair_stages
from pipemark.primitive import pipeline_p
from pipemark.staged import (
    Stage,
    StagedJaxpr,
    ValueRef,
    new_ref,
    stage_debug_info,
    substitute_operands,
)
from pipemark.walk import bodies, iter_eqns

__all__ = ["EXPANSION", "RECOMPUTABLE", "recompute_residuals"]

#: Primitives a backward stage may recompute: elementwise, shape and index operations
#: that read each operand element about once (no contraction, no reduction).
_ARITHMETIC = {"abs", "add", "clamp", "div", "integer_pow", "max", "min", "mul", "neg", "pow"}
_FUNCTIONS = {"cos", "erf", "exp", "exp2", "expm1", "log", "log1p", "logistic", "rsqrt"}
_MORE_FUNCTIONS = {"sign", "sin", "sqrt", "square", "sub", "tan", "tanh", "log2", "cosh", "sinh"}
# JAX 0.12 differentiates tanh through one_minus_square (1 - x**2).
_ROUNDING = {"ceil", "floor", "round", "one_minus_square"}
_LOGIC = {"and", "eq", "ge", "gt", "is_finite", "le", "lt", "ne", "not", "or", "select_n", "xor"}
_CASTS = {"convert_element_type", "copy", "copy_p", "reduce_precision"}
_SHAPES = {"broadcast_in_dim", "concatenate", "expand_dims", "iota", "pad", "reshape", "rev"}
_MORE_SHAPES = {"slice", "squeeze", "transpose"}
# Calls (a function with a custom derivative, a jitted helper) are recomputable when
# their bodies are: of these primitives, and reductions.
_CALLS = {"custom_jvp_call", "jit", "pjit", "closed_call"}
_CALL_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum"}
RECOMPUTABLE: frozenset[str] = frozenset().union(
    _ARITHMETIC,
    _FUNCTIONS,
    _MORE_FUNCTIONS,
    _ROUNDING,
    _LOGIC,
    _CASTS,
    _SHAPES,
    _MORE_SHAPES,
    {"custom_jvp_call"},
)

#: A matrix product whose result holds at least this many times the bytes of its
#: operands is recomputed by the backward rather than handed over (``expanding_products``).
EXPANSION = 4

_SOURCE, _SINK = "source", "sink"


def recompute_residuals(
    staged: StagedJaxpr,
    recomputable: frozenset[str] = RECOMPUTABLE,
    rematerialize: Collection[str] = (),
    expanding_products: bool = True,
) -> StagedJaxpr:
    """``staged`` with each backward stage reading the fewest residual bytes from its
    forward stage, recomputing the rest by equations of ``recomputable`` primitives
    and, with ``expanding_products``, by the matrix products whose result holds at
    least :data:`EXPANSION` times the bytes of their operands (see the module
    docstring). The forward stages named in ``rematerialize`` have
    every equation without effects recomputable, matrix products included: their
    backward recomputes the forward from what costs least to hand over (its inputs,
    usually), as ``jax.checkpoint`` of the whole stage would. Stages without a
    backward, and pairs where nothing is gained, are kept as they are.

    Before: the forward hands over ``c``, the ``bfloat16`` copy of its parameter, and
    ``e`` (``tanh`` of a product)::

        layer0:          { lambda ; w:f32[8] x:f32[8]. let
            c:bf16[8] = convert_element_type[new_dtype=bfloat16] w
            d:f32[8] = mul x w
            e:f32[8] = tanh d ...
          in (..., c, e) }
        layer0_backward: { lambda ; c:bf16[8] e:f32[8] g:f32[8]. let ... }

    After: it hands over ``d``; the backward reads the parameter ``w`` itself and
    recomputes ``c`` and ``e``::

        layer0:          { lambda ; w:f32[8] x:f32[8]. let ... in (..., d) }
        layer0_backward: { lambda ; g:f32[8] w:f32[8] d:f32[8]. let
            c':bf16[8] = convert_element_type[new_dtype=bfloat16] w
            e':f32[8] = tanh d ...

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def loss(w, x):
    ...     h = jnp.tanh(x * w.astype(jnp.bfloat16))
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.sum(jnp.sin(h.astype(jnp.float32)) ** 2)
    >>> args = jnp.ones(8), jnp.ones(8, jnp.bfloat16)
    >>> staged = pm.split(jax.value_and_grad(loss), *args)
    >>> lean = recompute_residuals(staged)
    >>> staged.stages[0].bytes_out, lean.stages[0].bytes_out  # layer0 hands over less
    (48, 16)
    >>> lean.verify(jax.value_and_grad(loss), *args).passed
    True
    """
    if not all(hasattr(staged, a) for a in ("stages", "outputs", "invars")):
        raise PipemarkError(
            f"recompute_residuals takes a StagedJaxpr, got {type(staged).__name__}; make "
            "one with pm.split(jax.value_and_grad(loss), *args)."
        )
    with paused_collector():
        result = staged
        forward, backward, _ = pair_stages(staged)
        cheap = functools.partial(_cheap, recomputable=recomputable, expand=expanding_products)
        for f, b in zip(forward, backward):
            if b is not None:
                everything = staged.stages[f].name in rematerialize
                result = _recompute_pair(result, f, b, _pure if everything else cheap)
    if jax.config.jax_enable_checks:
        check_result(result)
    return result


def _recompute_pair(
    staged: StagedJaxpr, f: int, b: int, cheap: Callable[[JaxprEqn], bool]
) -> StagedJaxpr:
    """``staged`` with backward stage ``b`` recomputing what it can of forward stage
    ``f``'s residuals, or ``staged`` itself where the cut saves nothing."""
    forward, backward = staged.stages[f], staged.stages[b]
    outvars = forward.jaxpr.outvars
    resolve = _Aliases(forward.jaxpr)
    residuals = {
        resolve(outvars[ref.index])
        for ref in backward.inputs
        if ref.kind == "stage" and ref.stage == f and type(outvars[ref.index]) is not Literal
    }
    cut = _cut(forward, residuals, cheap, resolve) if residuals else None
    if cut is None:
        return staged
    saved, recompute = cut
    kept = _kept_outputs(staged, f, b, set(saved), resolve)
    new_forward, index, at = _lean_forward(forward, kept, saved, resolve)
    stages = [_remap_stage(s, f, index) if k != b else s for k, s in enumerate(staged.stages)]
    stages[f] = new_forward
    stages[b] = _recomputing_backward(backward, forward, f, (index, at), recompute, resolve)
    outputs = [_remap(ref, f, index) for ref in staged.outputs]
    result = StagedJaxpr._trusted(stages, staged.invars, outputs, staged.debug_info)
    return result.with_signature(staged.signature).with_balance(staged.balance)


class _Aliases:
    """What a value of a stage is once its markers are seen through: a marker's result
    is its operand (markers are identities; the runtime compiles without them)."""

    def __init__(self, jaxpr: Jaxpr) -> None:
        self.operand = {
            out: arg
            for e in jaxpr.eqns
            if e.primitive is pipeline_p
            for arg, out in zip(e.invars, e.outvars)
            if type(arg) is not Literal
        }

    def __call__(self, v: Var) -> Var:
        while v in self.operand:
            v = self.operand[v]
        return v


def _cut(
    stage: Stage, residuals: set[Var], cheap: Callable[[JaxprEqn], bool], resolve: _Aliases
) -> tuple[list[Var], list[JaxprEqn]] | None:
    """The values to hand over (in program order) and the equations that recompute the
    residuals from them, by a minimum cut over the cheap equations that lead to the
    residuals; ``None`` when handing over the residuals themselves is as cheap.

    Each value ``v`` is an edge ``(v, 0) -> (v, 1)`` whose capacity is the cost of
    handing it over: twice its bytes (written, then read), plus one for a value that is
    not a residual (ties keep what the forward returns), and nothing for a program
    input. A value no cheap equation makes hangs from the source; each cheap
    equation's operands lead into its results; the residuals lead to the sink."""
    jaxpr = stage.jaxpr
    producer = {v: e for e in jaxpr.eqns if cheap(e) for v in e.outvars}
    free = {v for v, ref in zip(jaxpr.invars, stage.inputs) if ref.kind == "input"}
    graph = nx.DiGraph()
    seen: set[Var] = set()
    stack = list(residuals)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        cost = 0 if v in free else 2 * nbytes(v.aval) + (v not in residuals)
        graph.add_edge((v, 0), (v, 1), capacity=cost)
        if v not in producer:
            graph.add_edge(_SOURCE, (v, 0))  # no capacity: unbounded
            continue
        for u in producer[v].invars:
            if type(u) is not Literal:
                graph.add_edge((resolve(u), 1), (v, 0))
                stack.append(resolve(u))
    for r in residuals:
        graph.add_edge((r, 1), _SINK)
    value, (near, _) = nx.minimum_cut(graph, _SOURCE, _SINK)
    if value >= sum(2 * nbytes(r.aval) for r in residuals if r not in free):
        return None
    saved = {v for v in seen if (v, 0) in near and (v, 1) not in near}
    recompute = _recomputation(jaxpr, residuals, saved, producer, resolve)
    # A program input's edge costs nothing, so the cut may pass one nobody reads.
    read = {resolve(u) for e in recompute for u in e.invars if type(u) is not Literal}
    order = {v: k for k, v in enumerate((*jaxpr.constvars, *jaxpr.invars))}
    for eqn in jaxpr.eqns:
        order.update((v, len(order)) for v in eqn.outvars if v not in order)
    return sorted(saved & (read | residuals), key=order.get), recompute


def _pure(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` has no effects and is no marker (markers are seen through)."""
    return not eqn.effects and eqn.primitive is not pipeline_p


def _cheap(eqn: JaxprEqn, recomputable: frozenset[str], expand: bool) -> bool:
    """Whether the backward may recompute ``eqn``: a pure equation of a
    ``recomputable`` primitive (a call: with a cheap body) or, with ``expand``, an
    expanding matrix product."""
    if not _pure(eqn):
        return False
    if eqn.primitive.name in _CALLS:
        return eqn.primitive.name in recomputable and _cheap_body(eqn, recomputable)
    return eqn.primitive.name in recomputable or (expand and _expanding(eqn))


def _cheap_body(eqn: JaxprEqn, recomputable: frozenset[str]) -> bool:
    """Whether every equation in ``eqn``'s bodies, nested calls' included, is pure and
    of a ``recomputable`` primitive or a reduction: ``jax.nn.softmax`` (a function with
    a custom derivative, left as a call by JAX 0.12: its max and sum read each element
    once, as the elementwise equations around them do)."""
    allowed = recomputable | _CALLS | _CALL_REDUCTIONS
    return all(
        not e.effects and e.primitive.name in allowed
        for _, body in bodies(eqn)
        for e in iter_eqns(body)
    )


def _expanding(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``dot_general`` whose result holds at least
    :data:`EXPANSION` times its operands' bytes: attention scores (sequence x sequence
    per head) from queries and keys over a head dimension of 64. Recomputing one reads
    its operands and does 2 x (contraction) multiply-adds per result element, about
    500 for that dimension against the 8 bytes per float32 element a hand-over writes
    and reads: on an accelerator (a TPU v5e does 240 per byte of memory bandwidth) the
    product is cheaper to redo than to store, as flash attention's backward does."""
    if eqn.primitive.name != "dot_general":
        return False
    operands = sum(nbytes(v.aval) for v in eqn.invars)
    return nbytes(eqn.outvars[0].aval) >= EXPANSION * max(operands, 1)


def _recomputation(
    jaxpr: Jaxpr,
    residuals: set[Var],
    saved: set[Var],
    producer: dict[Var, JaxprEqn],
    resolve: _Aliases,
) -> list[JaxprEqn]:
    """The forward's equations, in program order, that recompute ``residuals`` from
    ``saved``."""
    needed: set[Var] = set()
    stack = [r for r in residuals if r not in saved]
    while stack:
        v = stack.pop()
        if v in needed:
            continue
        needed.add(v)
        for u in producer[v].invars:
            if type(u) is not Literal and resolve(u) not in saved:
                stack.append(resolve(u))
    return [e for e in jaxpr.eqns if not needed.isdisjoint(e.outvars)]


def _kept_outputs(
    staged: StagedJaxpr, f: int, b: int, saved: set[Var], resolve: _Aliases
) -> list[int]:
    """The forward's output positions it still returns: those another stage or the
    program's result reads, and the residuals handed over as they are."""
    forward = staged.stages[f]
    outvars, invars = forward.jaxpr.outvars, set(forward.jaxpr.invars)
    readers = [ref for k, s in enumerate(staged.stages) if k != b for ref in s.inputs]
    readers += staged.outputs
    kept = {ref.index for ref in readers if ref.kind == "stage" and ref.stage == f}
    for ref in staged.stages[b].inputs:
        if ref.kind == "stage" and ref.stage == f:
            value = outvars[ref.index]
            if type(value) is Literal or (resolve(value) in saved - invars):
                kept.add(ref.index)
    return sorted(kept)


def _lean_forward(
    forward: Stage, kept: list[int], saved: list[Var], resolve: _Aliases
) -> tuple[Stage, dict[int, int], dict[Var, int]]:
    """The forward returning its ``kept`` outputs and then the ``saved`` values it
    computes and does not return yet, without what nothing reads any more (:func:`dce`);
    with where each kept output went and where each saved value is returned."""
    jaxpr = forward.jaxpr
    outvars = [jaxpr.outvars[o] for o in kept]
    index = {o: k for k, o in enumerate(kept)}
    invars = set(jaxpr.invars)
    at: dict[Var, int] = {}
    for k, v in enumerate(outvars):
        if type(v) is not Literal:
            at.setdefault(resolve(v), k)
    for v in saved:
        if v not in invars and v not in at:
            at[v] = len(outvars)
            outvars.append(v)
    info = stage_debug_info(forward.name, forward.inputs, len(outvars))
    new = Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, jaxpr.eqns, jaxpr.effects, info)
    closed = dce(ClosedJaxpr(new, forward.closed_jaxpr.consts))
    return Stage(forward.name, closed, forward.inputs, (), forward.role), index, at


def _remap(ref: ValueRef, f: int, index: dict[int, int]) -> ValueRef:
    if ref.kind == "stage" and ref.stage == f:
        return new_ref("stage", index[ref.index], f)
    return ref


def _remap_stage(stage: Stage, f: int, index: dict[int, int]) -> Stage:
    if not any(ref.kind == "stage" and ref.stage == f for ref in stage.inputs):
        return stage
    inputs = tuple(_remap(ref, f, index) for ref in stage.inputs)
    return Stage(stage.name, stage.closed_jaxpr, inputs, stage.eqn_indices, stage.role)


def _recomputing_backward(
    backward: Stage,
    forward: Stage,
    f: int,
    where: tuple[dict[int, int], dict[Var, int]],
    recompute: list[JaxprEqn],
    resolve: _Aliases,
) -> Stage:
    """The backward reading the handed-over values (from the forward's outputs, or
    where the forward reads them) and starting with copies of the ``recompute``
    equations, on variables of its own, in place of the residuals they make. ``where``:
    the new position of each kept forward output, and where each value is returned."""
    jaxpr = backward.jaxpr
    index, at = where
    f_out = forward.jaxpr.outvars
    where_read = dict(zip(forward.jaxpr.invars, forward.inputs))
    made = {v for e in recompute for v in e.outvars}
    invars: list[Var] = []
    inputs: list[ValueRef] = []
    dropped: dict[Var, Var] = {}  # backward input -> the residual recomputed for it
    for var, ref in zip(jaxpr.invars, backward.inputs):
        if ref.kind == "stage" and ref.stage == f:
            value = f_out[ref.index]
            if type(value) is Literal:
                ref = new_ref("stage", index[ref.index], f)
            elif resolve(value) in made:
                dropped[var] = resolve(value)
                continue
            else:  # handed over as it is: returned by the forward, or read where it is
                value = resolve(value)
                ref = new_ref("stage", at[value], f) if value in at else where_read[value]
        invars.append(var)
        inputs.append(ref)
    read = [resolve(u) for e in recompute for u in e.invars if type(u) is not Literal]
    env = _handed_over(invars, inputs, [v for v in read if v not in made], f, at, where_read)
    eqns = []
    for eqn in recompute:
        outs = [Var(v.aval) if type(v) is Var else v for v in eqn.outvars]
        args = [u if type(u) is Literal else env[resolve(u)] for u in eqn.invars]
        env.update(zip(eqn.outvars, outs))
        eqns.append(eqn.replace(invars=args, outvars=outs))
    sub = {var: env[value] for var, value in dropped.items()}
    eqns += substitute_operands(jaxpr.eqns, sub)
    outvars = [v if type(v) is Literal else sub.get(v, v) for v in jaxpr.outvars]
    info = stage_debug_info(backward.name, inputs, len(outvars))
    new = Jaxpr(jaxpr.constvars, invars, outvars, eqns, jaxpr.effects, info)
    closed = ClosedJaxpr(new, backward.closed_jaxpr.consts)
    return Stage(backward.name, closed, tuple(inputs), (), backward.role)


def _handed_over(
    invars: list[Var],
    inputs: list[ValueRef],
    values: list[Var],
    f: int,
    at: dict[Var, int],
    where_read: dict[Var, ValueRef],
) -> dict[Var, Var]:
    """Per handed-over value the recomputation reads, the backward's variable for it:
    an input the backward already has (the same reference), else a new input appended
    to ``invars`` and ``inputs``."""
    have = dict(zip(inputs, invars))
    env: dict[Var, Var] = {}
    for value in dict.fromkeys(values):
        ref = new_ref("stage", at[value], f) if value in at else where_read[value]
        if ref not in have:
            have[ref] = value
            invars.append(value)
            inputs.append(ref)
        env[value] = have[ref]
    return env
