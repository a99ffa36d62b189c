"""Rewrite the markers of a program: remove them, route bypassing values through them,
and eliminate dead code around them.

Each pass takes a ``ClosedJaxpr`` and returns a new one that passes
``jax.extend.core.check_jaxpr``; the input is never modified. Equations a pass does not
change are shared between input and output (they are immutable), which keeps every pass
linear in the size of the program with a small constant.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from pipemark._compat import dce_rule
from pipemark.passes._markers import StageSpan, find_stage_spans
from pipemark.passes.flow import routed_flow
from pipemark.passes.framework import jaxpr_pass
from pipemark.primitive import is_marker, pipeline_p
from pipemark.walk import find_eqn, map_bodies

__all__ = ["remove_markers", "mark_missing_vars", "dce"]


# ------------------------------------------------------------------------ remove_markers


def _contains_marker(jaxpr: Jaxpr, memo: dict[int, JaxprEqn | None]) -> bool:
    return find_eqn(jaxpr, is_marker, memo) is not None


def _without_markers(jaxpr: Jaxpr, memo: dict[int, JaxprEqn | None]) -> Jaxpr:
    return _remove_markers(jaxpr, memo) if _contains_marker(jaxpr, memo) else jaxpr


def _remove_markers(jaxpr: Jaxpr, memo: dict[int, JaxprEqn | None]) -> Jaxpr:
    # A marker is the identity, so its results are replaced by its operands everywhere
    # they are read; a sub-jaxpr keeps its signature and only loses its own markers.
    env: dict[Var, Any] = {}
    new_eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is pipeline_p:
            for operand, result in zip(eqn.invars, eqn.outvars):
                env[result] = env.get(operand, operand) if isinstance(operand, Var) else operand
            continue
        new_invars = [env.get(v, v) if isinstance(v, Var) else v for v in eqn.invars]
        changed = any(a is not b for a, b in zip(new_invars, eqn.invars))
        mapped = map_bodies(eqn, lambda body: _without_markers(body, memo))
        if changed:
            mapped = mapped.replace(invars=new_invars)
        new_eqns.append(mapped)
    outvars = [env.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    return jaxpr.replace(eqns=new_eqns, outvars=outvars)


@jaxpr_pass
def remove_markers(cj: ClosedJaxpr) -> ClosedJaxpr:
    """Drop every pipeline marker, in the program and in its sub-jaxprs.

    A marker is the identity, so every read of a marker's result reads the marker's
    operand instead. The program computes exactly what it computed before. Idempotent.

    Parameters
    ----------
    cj:
        A closed jaxpr, e.g. from ``jax.make_jaxpr``.

    Returns
    -------
    ClosedJaxpr
        The program without ``pipeline_marker`` equations; same inputs, outputs and
        constants.

    Raises
    ------
    PipemarkError
        When ``cj`` is not a ``ClosedJaxpr``.

    Examples
    --------
    Before::

        { lambda ; a:f32[]. let
            b:f32[] = pipeline_marker[mark_type=start name=s] a
            c:f32[] = sin b
            d:f32[] = pipeline_marker[mark_type=end name=s] c
          in (d,) }

    After::

        { lambda ; a:f32[]. let b:f32[] = sin a in (b,) }

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = pm.mark(x, name="s", mark_type="start")
    ...     return pm.mark(jnp.sin(x), name="s", mark_type="end")
    >>> cj = jax.make_jaxpr(f)(1.0)
    >>> [e.primitive.name for e in remove_markers(cj).eqns]
    ['sin']
    """
    return ClosedJaxpr(_remove_markers(cj.jaxpr, {}), cj.consts)


# --------------------------------------------------------------------- mark_missing_vars


@jaxpr_pass
def mark_missing_vars(cj: ClosedJaxpr) -> ClosedJaxpr:
    """Route every value that crosses a stage boundary through the stage's markers.

    After this pass, an equation of a stage reads only values defined in the same stage
    (by its start marker or its own equations); everything else enters through the
    stage's start marker, and every value a stage defines and something later reads
    leaves through the stage's end marker. Concretely, for a value ``v`` read by an
    equation of stage ``j`` and not defined in stage ``j``:

    * if ``v`` is defined inside an earlier stage ``i`` and not an output of its end
      marker, ``v`` is added to stage ``i``'s end marker (a new operand/result pair);
    * that result (or ``v`` itself when it is a program input, a constant, an output of
      an end marker, or the result of an equation outside every stage) is added to stage
      ``j``'s start marker, and stage ``j`` reads the new result.

    Values that stage ``i`` defines inside and that the program returns, or that an
    equation outside every stage reads, also leave through stage ``i``'s end marker.
    This covers skip connections (stage 0 feeding stage 3) and the forward values
    (weights, activations) that a mirrored ``_backward`` stage reuses. Each value is
    added at most once per marker, and a value a marker already carries is reused.
    A mirrored backward stage that JAX left without an end marker (it runs to the end
    of the program) gets no end marker. Idempotent.

    Parameters
    ----------
    cj:
        A closed jaxpr with start/end markers (call
        :func:`pipemark.passes.layers_from_boundaries` first for boundary markers).

    Returns
    -------
    ClosedJaxpr
        The same computation with the crossing values routed through the markers.

    Raises
    ------
    MarkerError
        When the markers are malformed (see :func:`pipemark.passes.slice_stages`).
    PipemarkError
        When ``cj`` is not a ``ClosedJaxpr``.

    Examples
    --------
    Before (stage ``b`` reads the program input ``a`` and stage ``a``'s start result
    ``b``, bypassing its start marker)::

        { lambda ; a:f32[]. let
            b:f32[] = pipeline_marker[mark_type=start name=a] a
            c:f32[] = sin b
            d:f32[] = pipeline_marker[mark_type=end name=a] c
            e:f32[] = pipeline_marker[mark_type=start name=b] d
            f:f32[] = mul e a
            g:f32[] = add f b
            h:f32[] = pipeline_marker[mark_type=end name=b] g
          in (h,) }

    After::

        { lambda ; a:f32[]. let
            b:f32[] = pipeline_marker[mark_type=start name=a] a
            c:f32[] = sin b
            d:f32[] e:f32[] = pipeline_marker[mark_type=end name=a] c b
            f:f32[] g:f32[] h:f32[] = pipeline_marker[mark_type=start name=b] d a e
            i:f32[] = mul f g
            j:f32[] = add i h
            k:f32[] = pipeline_marker[mark_type=end name=b] j
          in (k,) }

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     y = pm.mark(x, name="a", mark_type="start")
    ...     d = pm.mark(jnp.sin(y), name="a", mark_type="end")
    ...     e = pm.mark(d, name="b", mark_type="start")
    ...     return pm.mark(e * x + y, name="b", mark_type="end")
    >>> cj = mark_missing_vars(jax.make_jaxpr(f)(1.0))
    >>> [len(e.invars) for e in cj.eqns if e.primitive is pm.pipeline_p]
    [1, 2, 3, 1]
    """
    return _mark_missing_vars(cj)


def _mark_missing_vars(cj: ClosedJaxpr) -> ClosedJaxpr:
    jaxpr = cj.jaxpr
    eqns = jaxpr.eqns
    spans = find_stage_spans(jaxpr)
    if not spans:
        return ClosedJaxpr(jaxpr.replace(eqns=list(eqns)), cj.consts)
    if routed_flow(jaxpr) is not None:
        # Every crossing value goes through the markers already (what the insert
        # passes build): the sweep below would change nothing.
        return ClosedJaxpr(jaxpr.replace(eqns=list(eqns), outvars=list(jaxpr.outvars)), cj.consts)

    router = _Router(eqns, spans)
    router.route_outside()
    router.route_stages()
    outvars = [router.published(v) for v in jaxpr.outvars]
    return ClosedJaxpr(jaxpr.replace(eqns=router.finish(), outvars=outvars), cj.consts)


class _Router:
    """Routes every value that crosses a stage boundary around the markers through
    them (see :func:`mark_missing_vars`), adding operand/result pairs to the markers."""

    def __init__(self, eqns: list[JaxprEqn], spans: tuple[StageSpan, ...]) -> None:
        self.eqns, self.spans = eqns, spans
        # For every value defined in a stage, one int: twice the stage index, plus one
        # when the value is already published (a result of one of the stage's end
        # markers). One dict lookup per operand then answers both questions.
        home: dict[Var, int] = {}
        self.home = home
        self.opener_of: list[int] = []
        self.closer_of: list[int | None] = []
        for k, span in enumerate(spans):
            self.opener_of.append(span.openers[0])
            # The last closer comes after every equation of the stage, so any value of
            # the stage can be added there.
            self.closer_of.append(span.closers[-1] if span.closers else None)
            inner = 2 * k
            for eqn in eqns[span.first : span.last + 1]:
                for v in eqn.outvars:
                    home[v] = inner
            for i in span.closers:
                for v in eqns[i].outvars:
                    home[v] = inner + 1
        # The operand/result pairs added to each stage's start and end markers, and
        # maps from a value to the marker result that carries it. They start from the
        # pairs the markers already have, so an existing pair is reused, not duplicated.
        self.added_in: dict[int, tuple[list[Any], list[Var]]] = {}
        self.added_out: dict[int, tuple[list[Any], list[Var]]] = {}
        self.carried_in: list[dict[Var, Var] | None] = [None] * len(spans)
        self.carried_out: list[dict[Var, Var] | None] = [None] * len(spans)
        self.new_eqns = list(eqns)

    def carry(self, carried_by: list, added: dict, k: int, marker: int, v: Any) -> Var:
        """The result of stage ``k``'s marker ``eqns[marker]`` that carries ``v``; a new
        operand/result pair when the marker has none for it yet."""
        carried = carried_by[k]
        if carried is None:
            carried = carried_by[k] = {}
            eqn = self.eqns[marker]
            for operand, result in zip(eqn.invars, eqn.outvars):
                if type(operand) is not Literal and operand not in carried:
                    carried[operand] = result
        result = carried.get(v)
        if result is None:
            result = carried[v] = Var(v.aval)
            operands, results = added.setdefault(k, ([], []))
            operands.append(v)
            results.append(result)
        return result

    def published(self, v: Any) -> Any:
        """``v``, or the end-marker result that carries it out of its stage."""
        if type(v) is Literal:
            return v
        code = self.home.get(v, 1)
        if code & 1:  # not defined in a stage, or already published
            return v
        k = code >> 1
        closer = self.closer_of[k]
        if closer is None:  # a backward stage left open by JAX: nothing can follow it
            return v
        return self.carry(self.carried_out, self.added_out, k, closer, v)

    def entering(self, j: int, v: Any) -> Any:
        """The start-marker result of stage ``j`` that carries ``v`` into it."""
        if type(v) is Literal or self.home.get(v, -2) >> 1 == j:
            return v
        return self.carry(self.carried_in, self.added_in, j, self.opener_of[j], self.published(v))

    def from_another_stage(self, j: int, v: Any) -> Any:
        """For a marker through which values enter stage ``j``: ``v``, published when
        it is another stage's inner value."""
        if type(v) is Literal or self.home.get(v, -2) >> 1 == j:
            return v
        return self.published(v)

    def rewrite(self, i: int, route) -> None:
        eqn = self.eqns[i]
        new_invars = [route(v) for v in eqn.invars]
        if any(a is not b for a, b in zip(new_invars, eqn.invars)):
            self.new_eqns[i] = eqn.replace(invars=new_invars)

    def route_outside(self) -> None:
        """Equations outside every stage: reads of a stage's inner values go through
        that stage's end marker. (A value no stage defines has no entry: code 1.)"""
        eqns, home_get = self.eqns, self.home.get
        start = 0
        bounds = [*((span.first, span.last + 1) for span in self.spans), (len(eqns), 0)]
        for stop, resume in bounds:
            for i in range(start, stop):
                for v in eqns[i].invars:
                    if type(v) is not Literal and not home_get(v, 1) & 1:
                        self.rewrite(i, self.published)
                        break
            start = resume

    def route_stages(self) -> None:
        """Equations of each stage: what they read from elsewhere enters through the
        stage's start marker (which itself reads other stages' published values)."""
        eqns, home_get = self.eqns, self.home.get
        for j, span in enumerate(self.spans):
            openers = span.openers
            for i in range(span.first, span.last + 1):
                for v in eqns[i].invars:
                    if type(v) is not Literal and home_get(v, -2) >> 1 != j:
                        if i in openers:
                            self.rewrite(i, lambda v, j=j: self.from_another_stage(j, v))
                        else:
                            self.rewrite(i, lambda v, j=j: self.entering(j, v))
                        break

    def finish(self) -> list[JaxprEqn]:
        """The equations, with the pairs added to the markers."""
        new_eqns = self.new_eqns
        markers = [(self.opener_of, self.added_in), (self.closer_of, self.added_out)]
        for marker_of, added in markers:
            for k, (operands, results) in added.items():
                index = marker_of[k]
                eqn = new_eqns[index]
                new_eqns[index] = eqn.replace(
                    invars=[*eqn.invars, *operands], outvars=[*eqn.outvars, *results]
                )
        return new_eqns


# ---------------------------------------------------------------------------------- dce


@jaxpr_pass
def dce(cj: ClosedJaxpr) -> ClosedJaxpr:
    """Marker-aware dead-code elimination.

    Equations whose results nobody reads are dropped, except effectful ones. A marker
    loses the operand/result pairs whose results nobody reads, but a marker that
    delimits a stage (``start``, ``end``, ``jvp_start``, ``jvp_end``, ``boundary``,
    ``grad``) stays even when no pair is left, so the stage structure survives; an unread
    ``hook`` marker goes. The program keeps all its inputs; constants nobody reads are
    dropped. Idempotent.

    It follows ``jax.interpreters.partial_eval.dce_jaxpr`` (one backward sweep) and
    uses JAX's DCE rules, the marker's from :mod:`pipemark.primitive` among them; the
    bodies of ``scan``, ``cond``, ``pjit``… are cleaned by JAX's rules for those
    primitives. An equation of a primitive without a rule stays when it has any effect.

    Parameters
    ----------
    cj:
        A closed jaxpr.

    Returns
    -------
    ClosedJaxpr
        The program without dead code; same inputs and outputs.

    Raises
    ------
    PipemarkError
        When ``cj`` is not a ``ClosedJaxpr``.

    Examples
    --------
    Before (``w`` goes through the start marker but its only reader is dead)::

        { lambda ; a:f32[] b:f32[]. let
            c:f32[] d:f32[] = pipeline_marker[mark_type=start name=a] a b
            _:f32[] = cos d
            e:f32[] = sin c
            f:f32[] = pipeline_marker[mark_type=end name=a] e
          in (f,) }

    After::

        { lambda ; a:f32[] b:f32[]. let
            c:f32[] = pipeline_marker[mark_type=start name=a] a
            d:f32[] = sin c
            e:f32[] = pipeline_marker[mark_type=end name=a] d
          in (e,) }

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x, w):
    ...     x, w = pm.mark((x, w), name="a", mark_type="start")
    ...     _ = jnp.cos(w)
    ...     return pm.mark(jnp.sin(x), name="a", mark_type="end")
    >>> cj = dce(jax.make_jaxpr(f)(1.0, 2.0))
    >>> [(e.primitive.name, len(e.invars)) for e in cj.eqns]
    [('pipeline_marker', 1), ('sin', 1), ('pipeline_marker', 1)]
    """
    return _dce(cj)


def _dce(cj: ClosedJaxpr) -> ClosedJaxpr:
    jaxpr = cj.jaxpr
    # One backward sweep, like jax.interpreters.partial_eval.dce_jaxpr, but with a fast
    # path for the common case of a primitive without a DCE rule of its own: such an
    # equation stays when a result is read or it has effects. Primitives with rules
    # (pipeline markers, pjit, scan, cond, while, custom_jvp…) use them.
    rule_of = dce_rule
    read: set[Var] = {v for v in jaxpr.outvars if type(v) is not Literal}
    mark_read = read.add
    kept: list[JaxprEqn] = []
    keep = kept.append
    for eqn in reversed(jaxpr.eqns):
        primitive = eqn.primitive
        if primitive is pipeline_p and eqn.outvars:
            # A marker whose results are all read keeps every operand (what its DCE
            # rule returns, without building the lists): most markers, between stages.
            for v in eqn.outvars:
                if v not in read:
                    break
            else:
                keep(eqn)
                for v in eqn.invars:
                    if type(v) is not Literal:
                        mark_read(v)
                continue
        rule = rule_of(primitive)
        if rule is None:
            for v in eqn.outvars:
                if v in read:
                    break
            else:
                if not eqn.effects:
                    continue
            keep(eqn)
            for v in eqn.invars:
                if type(v) is not Literal:
                    mark_read(v)
            continue
        used_inputs, new_eqn = rule([v in read for v in eqn.outvars], eqn)
        if new_eqn is None:
            continue
        keep(new_eqn)
        for v, used in zip(eqn.invars, used_inputs):
            if used and type(v) is not Literal:
                read.add(v)
    kept.reverse()
    constants = [(v, c) for v, c in zip(jaxpr.constvars, cj.consts) if v in read]
    # Removing equations never adds effects, so the program's effects still cover every
    # equation's.
    new_jaxpr = jaxpr.replace(constvars=[v for v, _ in constants], eqns=kept)
    return ClosedJaxpr(new_jaxpr, [c for _, c in constants])
