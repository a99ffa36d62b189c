"""Inline call-like equations, so that markers inside ``jax.jit`` (and friends) can cut.

A program traced from ``jax.jit(loss)`` is one ``jit`` equation whose body holds the
whole model; a model that jits its layers, checkpoints them or wraps them in a
``custom_jvp`` puts markers inside such bodies. Stages are cut at the top level of a
program, so :func:`inline_calls` first brings those bodies up, following a rule per
primitive (:data:`CALL_RULES`, looked up by primitive name):

======================================  ================================================
primitive                               rule
======================================  ================================================
``jit`` (``pjit``), ``closed_call``,    ``"inline"``: always replaced by its body, whose
``core_call``, ``call``                 equations keep the call's name in their name
                                        stack (``loss/...``); calls inside the body that
                                        come up are inlined too
``checkpoint`` (``remat2``, ``remat``)  ``"split"``: when the body holds a stage marker,
                                        each run of equations between two markers
                                        becomes a checkpoint of its own with the same
                                        ``policy`` and ``prevent_cse``, so every stage
                                        rematerialises its own part; else left alone
``custom_jvp_call``, ``custom_vjp_call``  ``"inline_marked"``: replaced by the primal
                                        body when it holds a stage marker (a staged
                                        program evaluates it; the custom derivative rule
                                        was applied already if the program is a
                                        gradient); else left alone
======================================  ================================================

``scan``, ``cond``, ``while`` and ``shard_map`` bodies are never inlined: a marker
inside them is still refused by the slicer.

Under ``jax.grad``, a checkpoint over several stages becomes a forward part at the top
level and a ``differentiated`` checkpoint in the backward pass whose body recomputes
the forward (with copies of the forward markers) before the mirrored backward stages.
The copies of markers of stages that already ran are dropped, so the recomputation
joins the first backward stage that reads it and each backward stage gets its own
checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    new_jaxpr_eqn,
)

from pipemark._compat import CLOSED_CALL_NAMES
from pipemark.marks import OPENERS, STAGE_MARK_TYPES
from pipemark.passes._markers import first_stage_marker
from pipemark.passes.framework import jaxpr_pass
from pipemark.primitive import is_marker
from pipemark.walk import BODY_PARAMS, open_jaxpr

__all__ = ["CALL_RULES", "CallRule", "inline_calls"]


@dataclass(frozen=True)
class CallRule:
    """How :func:`inline_calls` treats one call-like primitive (its body is where
    :data:`pipemark.walk.BODY_PARAMS` says).

    Attributes
    ----------
    action:
        ``"inline"`` (always), ``"inline_marked"`` (when the body holds a stage marker)
        or ``"split"`` (a checkpoint: one checkpoint per stage when the body holds a
        stage marker).
    scope:
        The parameter naming the call (``jit``'s ``name``), pushed on the name stack of
        the inlined equations; ``None`` for none.
    """

    action: str
    scope: str | None = None


#: The rule per primitive name (every call-like primitive of :mod:`pipemark.walk`);
#: primitives not listed are never inlined.
CALL_RULES: dict[str, CallRule] = {
    "jit": CallRule("inline", "name"),
    "pjit": CallRule("inline", "name"),
    **{name: CallRule("inline") for name in CLOSED_CALL_NAMES},
    "core_call": CallRule("inline", "name"),
    "call": CallRule("inline", "name"),
    "remat2": CallRule("split"),  # jax.checkpoint
    "checkpoint": CallRule("split"),
    "remat": CallRule("split"),
    "custom_jvp_call": CallRule("inline_marked"),
    "custom_vjp_call": CallRule("inline_marked"),
    "custom_vjp_call_jaxpr": CallRule("inline_marked"),
}


def _rule(eqn: JaxprEqn) -> CallRule | None:
    return CALL_RULES.get(eqn.primitive.name)


def _body(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]]:
    """The body's open jaxpr and its consts (JAX 0.10 open Jaxprs have none; in JAX
    0.11 every jaxpr is closed and ``.jaxpr`` is itself)."""
    value = eqn.params[BODY_PARAMS[eqn.primitive.name][0]]
    if callable(value) and not isinstance(value, (Jaxpr, ClosedJaxpr)):
        value = value()  # a thunk, as older custom_vjp_call_jaxpr params held
    return open_jaxpr(value), tuple(getattr(value, "consts", ()))


def _wants_inlining(eqn: JaxprEqn, memo: dict[int, JaxprEqn | None]) -> bool:
    rule = _rule(eqn)
    if rule is None:
        return False
    return rule.action == "inline" or first_stage_marker(_body(eqn)[0], memo) is not None


@jaxpr_pass
def inline_calls(cj: ClosedJaxpr) -> ClosedJaxpr:
    """Bring the bodies of call-like equations up to the top level, as
    :data:`CALL_RULES` says, so that markers inside them can cut stages.

    Pure: returns a new program (the input itself when there is nothing to inline)
    that computes the same results with the same equations.

    Before / after (``jax.jit`` of a boundary-marked function)::

        { lambda ; a. let b = jit[name=f jaxpr={ lambda ; c. let
              d = sin c ; pipeline_marker[boundary] ; e = cos d in (e,) }] a in (b,) }
        { lambda ; a. let d = sin a ; pipeline_marker[boundary] ; e = cos d in (e,) }

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = jnp.sin(x)
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> cj = jax.make_jaxpr(jax.jit(f))(1.0)
    >>> [e.primitive.name for e in cj.eqns]
    ['jit']
    >>> [e.primitive.name for e in inline_calls(cj).eqns]
    ['sin', 'pipeline_marker', 'cos']
    >>> def g(x):
    ...     return jax.jit(f)(x) * 2.0
    >>> inlined = inline_calls(jax.make_jaxpr(g)(1.0))
    >>> [(e.primitive.name, str(e.source_info.name_stack)) for e in inlined.eqns][:2]
    [('sin', 'f'), ('pipeline_marker', 'f')]

    A program that is one call (``jax.jit(f)`` traced) gets no scope: it would name
    every equation alike.
    """
    memo: dict[int, JaxprEqn | None] = {}
    if not any(_wants_inlining(eqn, memo) for eqn in cj.jaxpr.eqns):
        return cj
    body = _whole_program_body(cj)
    if body is not None:
        # jax.jit(f) traced: the program is its call's body, reused without a copy.
        return inline_calls(body)
    return _Inliner(memo).run(cj)


def _whole_program_body(cj: ClosedJaxpr) -> ClosedJaxpr | None:
    """The body of ``cj`` when ``cj`` is one always-inlined call that reads the
    program's inputs in order and gives its results (``jax.jit(f)`` traced), as a
    program with ``cj``'s debug info; else ``None``. No name is pushed: it would scope
    every equation alike."""
    jaxpr = cj.jaxpr
    if len(jaxpr.eqns) != 1:
        return None
    eqn = jaxpr.eqns[0]
    rule = _rule(eqn)
    if rule is None or rule.action != "inline":
        return None
    if list(eqn.invars) != list(jaxpr.invars) or list(eqn.outvars) != list(jaxpr.outvars):
        return None
    body, consts = _body(eqn)
    if len(set(body.invars)) != len(body.invars) or set(body.invars) & set(body.constvars):
        return None
    return ClosedJaxpr(body.replace(debug_info=jaxpr.debug_info), list(consts))


def _is_copy(eqn: JaxprEqn, opened: frozenset[str]) -> bool:
    """Whether a marker inside a differentiated checkpoint copies a forward one: a
    boundary (the backward pass has none of its own) or a marker of an opened stage."""
    if not is_marker(eqn, STAGE_MARK_TYPES):
        return False
    return eqn.params["mark_type"] == "boundary" or eqn.params.get("name") in opened


def _fresh(var: Var) -> Var:
    return type(var)(var.aval)  # a DropVar stays a DropVar


def _read(env: dict[Var, Any], atom: Any) -> Any:
    """What ``atom`` of one scope stands for in the new program (one look-up, never a
    chain: a variable of one scope may also be a variable of another, e.g. a body
    inlined twice)."""
    if isinstance(atom, Literal):
        return atom
    return env.get(atom, atom)


class _Inliner:
    """One walk over a program. Each scope (the program, each inlined body) has its own
    ``env``, mapping its variables to the atoms that stand for them in the new program:
    a body inlined twice (a function jitted once, called twice) reads and defines its
    variables in its own scope each time, so no copy sees another's values."""

    def __init__(self, memo: dict[int, JaxprEqn | None]) -> None:
        self.memo = memo
        self.eqns: list[JaxprEqn] = []
        self.constvars: list[Var] = []
        self.consts: list[Any] = []
        self.defined: set[Var] = set()  # every variable the new program defines
        self.opened: set[str] = set()  # names of the stages whose start marker is out
        self.regions: list[tuple[int, int, JaxprEqn]] = []  # checkpoints to split
        self.splitting = 0  # depth of checkpoint bodies being split

    def run(self, cj: ClosedJaxpr) -> ClosedJaxpr:
        jaxpr = cj.jaxpr
        self.constvars, self.consts = list(jaxpr.constvars), list(cj.consts)
        self.defined.update(jaxpr.constvars)
        self.defined.update(jaxpr.invars)
        env: dict[Var, Any] = {}
        for eqn in jaxpr.eqns:
            self.emit(eqn, env)
        outvars = [_read(env, v) for v in jaxpr.outvars]
        eqns = _split_regions(self.eqns, self.regions, outvars)
        effects = set().union(*(eqn.effects for eqn in eqns)) if eqns else set()
        new = jaxpr.replace(constvars=self.constvars, outvars=outvars, eqns=eqns, effects=effects)
        return ClosedJaxpr(new, self.consts)

    def emit(
        self,
        eqn: JaxprEqn,
        env: dict[Var, Any],
        source_info: Any = None,
        ran: frozenset[str] | None = None,
    ) -> None:
        """Append ``eqn`` of the scope ``env`` (its inputs renamed; ``source_info``
        replaced when given), or inline it when its rule says so. ``ran``: inside a
        differentiated checkpoint, the stages opened before it."""
        invars = eqn.invars
        if env and any(v in env for v in invars if not isinstance(v, Literal)):
            invars = [_read(env, v) for v in invars]
        if ran is not None and _is_copy(eqn, ran):
            # A recomputation's copy of a marker of a stage that already ran.
            env.update(zip(eqn.outvars, invars))
            return
        if _rule(eqn) is not None and _wants_inlining(eqn, self.memo):
            results = self.inline(eqn, invars, source_info or eqn.source_info, ran)
            env.update(zip(eqn.outvars, results))
            return
        outvars = self.define(eqn.outvars, env)
        if invars is not eqn.invars or source_info is not None or outvars is not eqn.outvars:
            # One copy of the equation, whatever changes.
            eqn = eqn.replace(
                invars=invars,
                outvars=outvars,
                source_info=eqn.source_info if source_info is None else source_info,
            )
        if is_marker(eqn, OPENERS):
            self.opened.add(eqn.params.get("name"))
        self.eqns.append(eqn)

    def define(self, outvars: list[Var], env: dict[Var, Any]) -> list[Var]:
        """``outvars`` as the new program defines them: a variable it defines already
        (a second copy of a body) is replaced by a fresh one, in this scope only."""
        defined = self.defined
        if not any(v in defined for v in outvars):
            defined.update(outvars)
            return outvars
        renamed = []
        for v in outvars:
            if v in defined:
                env[v] = v = _fresh(v)
            defined.add(v)
            renamed.append(v)
        return renamed

    def inline(
        self, eqn: JaxprEqn, invars: list[Any], source_info: Any, ran: frozenset[str] | None
    ) -> list[Any]:
        """Emit the body of ``eqn`` in a scope of its own, reading ``invars``; returns
        the atoms that stand for the body's results."""
        rule = _rule(eqn)
        body, consts = _body(eqn)
        stack = source_info.name_stack
        if rule.scope is not None and isinstance(eqn.params.get(rule.scope), str):
            stack = stack.extend(eqn.params[rule.scope])
        env: dict[Var, Any] = dict(zip(body.invars, invars))
        for var, value in zip(body.constvars, consts):
            env[var] = new = Var(var.aval)
            self.defined.add(new)
            self.constvars.append(new)
            self.consts.append(value)
        split = rule.action == "split" and not self.splitting
        if rule.action == "split" and eqn.params.get("differentiated"):
            ran = frozenset(self.opened)
        stacks: dict[int, Any] = {}  # name stacks are shared by runs of equations
        scoped = bool(getattr(stack, "stack", True))  # an empty prefix changes nothing
        first = len(self.eqns)
        self.splitting += rule.action == "split"
        for inner in body.eqns:
            new_info = None
            if scoped:
                info = inner.source_info
                inner_stack = info.name_stack
                key = id(inner_stack)
                if key not in stacks:
                    stacks[key] = (inner_stack, stack + inner_stack)
                new_info = info.replace(name_stack=stacks[key][1])
            self.emit(inner, env, new_info, ran)
        self.splitting -= rule.action == "split"
        if split:
            self.regions.append((first, len(self.eqns), eqn))
        return [_read(env, v) for v in body.outvars]


def _split_regions(
    eqns: list[JaxprEqn], regions: list[tuple[int, int, JaxprEqn]], outvars: list[Any]
) -> list[JaxprEqn]:
    """Replace each inlined checkpoint body ``eqns[first:end]`` by one checkpoint per
    run of equations between its stage markers (the markers stay at the top level)."""
    if not regions:
        return eqns
    last_use: dict[Var, int] = {}
    for index, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = index
    for v in outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(eqns)
    out: list[JaxprEqn] = []
    done = 0
    for first, end, template in regions:
        out.extend(eqns[done:first])
        run_start = first
        for index in range(first, end + 1):
            if index == end or is_marker(eqns[index], STAGE_MARK_TYPES):
                if index > run_start:
                    out.append(_checkpoint(eqns[run_start:index], index, last_use, template))
                if index < end:
                    out.append(eqns[index])
                run_start = index + 1
        done = end
    out.extend(eqns[done:])
    return out


def _checkpoint(
    run: list[JaxprEqn], end: int, last_use: dict[Var, int], template: JaxprEqn
) -> JaxprEqn:
    """One checkpoint equation (``template``'s primitive and params) over ``run``, whose
    last equation is just before index ``end``: it reads what the run reads from
    outside and returns what is read after it."""
    defined: set[Var] = set()
    reads: dict[Var, None] = {}  # ordered
    outs: list[Var] = []
    for eqn in run:
        for v in eqn.invars:
            if not isinstance(v, Literal) and v not in defined:
                reads[v] = None
        for v in eqn.outvars:
            defined.add(v)
            if last_use.get(v, -1) >= end:
                outs.append(v)
    inner_in = {v: Var(v.aval) for v in reads}
    body_eqns = [
        eqn.replace(
            invars=[inner_in.get(v, v) if not isinstance(v, Literal) else v for v in eqn.invars]
        )
        for eqn in run
    ]
    effects = set().union(*(eqn.effects for eqn in run))
    info = DebugInfo(
        "checkpoint",
        "pipemark: a stage's part of a checkpoint",
        tuple(f"input[{i}]" for i in range(len(inner_in))),
        tuple(f"result[{i}]" for i in range(len(outs))),
    )
    body = Jaxpr([], list(inner_in.values()), outs, body_eqns, effects, info)
    params = dict(template.params, jaxpr=body)
    # The run's results keep their variables at the top level (the body defines them in
    # its own scope too, as a sliced stage shares its program's variables).
    return new_jaxpr_eqn(
        list(reads), outs, template.primitive, params, effects, template.source_info, template.ctx
    )
