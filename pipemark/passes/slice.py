"""Cut a marked program into stages: :func:`slice_stages`."""

from __future__ import annotations

import bisect
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from pipemark.errors import (
    MarkerError,
    PipemarkError,
    StageGraphError,
    describe_eqn,
)
from pipemark.passes._markers import (
    StageSpan,
    find_stage_spans,
    stage_index_of_equations,
    stage_spans_routed,
)
from pipemark.passes.framework import jaxpr_pass
from pipemark.staged import (
    Stage,
    StagedJaxpr,
    ValueRef,
    new_ref,
    new_stage,
    stage_debug_info,
)

__all__ = ["slice_stages"]

_UNMARKED_MODES = ("assign", "error")


def _assign_unmarked(jaxpr: Jaxpr, stage_of: list[int | None], spans) -> list[int]:
    """Give every unmarked equation a stage (the rule is in :func:`slice_stages`)."""
    eqns = jaxpr.eqns
    defined_by_stage: dict[Var, int] = {}
    deferred: list[int] = []
    assigned = list(stage_of)
    for index, eqn in enumerate(eqns):
        stage = assigned[index]
        if stage is None:
            operand_stages = [
                defined_by_stage[a]
                for a in eqn.invars
                if not isinstance(a, Literal) and a in defined_by_stage
            ]
            if operand_stages:
                stage = max(operand_stages)
                assigned[index] = stage
            else:
                deferred.append(index)
                continue
        for v in eqn.outvars:
            defined_by_stage[v] = stage
    if deferred:
        # Equations that read only program inputs, constants, literals and each other
        # go to the earliest stage reading their results. Walking backwards, every
        # reader of such an equation already has its stage.
        first_use: dict[Var, int] = {}
        starts = [span.first for span in spans]
        pending = set(deferred)
        for index in range(len(eqns) - 1, -1, -1):
            eqn = eqns[index]
            if index in pending:
                uses = [first_use[v] for v in eqn.outvars if v in first_use]
                if uses:
                    assigned[index] = min(uses)
                else:
                    # Nothing in a stage reads it: the first stage after it, else the last.
                    assigned[index] = min(bisect.bisect_right(starts, index), len(spans) - 1)
            stage = assigned[index]
            for a in eqn.invars:
                if isinstance(a, Var) and not isinstance(a, Literal):
                    previous = first_use.get(a)
                    if previous is None or stage < previous:
                        first_use[a] = stage
    return assigned  # type: ignore[return-value]


@jaxpr_pass
def slice_stages(cj: ClosedJaxpr, unmarked: str = "assign") -> StagedJaxpr:
    """Cut a program at its start/end markers into a :class:`~pipemark.StagedJaxpr`.

    One stage per start/end pair (a ``jvp_start``/``jvp_end`` pair of the same name
    belongs to the same stage), in program order. Each stage is a ``ClosedJaxpr`` whose
    inputs are the program inputs and earlier-stage values it reads, and whose outputs
    are the values that later stages or the program's result read. A constant lives in
    every stage that reads it. A value may skip stages (stage 0 feeding stage 3).
    ``make_jaxpr(jax.value_and_grad(f))`` of a marked ``f`` gives forward stages
    followed by mirrored ``<name>_backward`` stages.

    Parameters
    ----------
    cj:
        A program with start/end markers (see :func:`insert_markers`,
        :func:`layers_from_boundaries`).
    unmarked:
        What to do with equations outside every start/end pair (such as a loss after
        the last ``end`` marker, or the seed of the backward pass):

        ``"assign"`` (default)
            An equation that reads a value computed in some stage joins the *latest*
            such stage. An equation that reads only program inputs, constants, literals
            and other such equations joins the *earliest* stage that reads its result;
            if no stage does, the first stage after it, or the last stage. Stages
            therefore still run in order, and an unmarked equation between two stages
            stays with the computation it continues.
        ``"error"``
            Refuse the program with a :class:`MarkerError` naming the first such
            equation.

    Returns
    -------
    StagedJaxpr
        Calling it runs the stages in order and returns the original's flat results;
        :meth:`~pipemark.StagedJaxpr.as_closed_jaxpr` stitches them back.

    Raises
    ------
    MarkerError
        For malformed markers (see :func:`pipemark.passes._markers.find_stage_spans`),
        a program without start/end markers, boundary markers (call
        :func:`layers_from_boundaries` first) or, with ``unmarked="error"``, an equation
        outside every stage.

    Examples
    --------
    Before::

        { lambda ; a:f32[]. let
            b:f32[] = pipeline_marker[mark_type=start name=s0] a
            c:f32[] = sin b
            d:f32[] = pipeline_marker[mark_type=end name=s0] c
            e:f32[] = pipeline_marker[mark_type=start name=s1] d
            f:f32[] = cos e
            g:f32[] = pipeline_marker[mark_type=end name=s1] f
          in (g,) }

    After: stage ``s0`` is ``{ lambda ; a. let b = start a; c = sin b; d = end c in
    (d,) }`` and stage ``s1`` takes ``d`` and returns ``g``.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = pm.passes.insert_markers(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0),
    ...                               [1], names=["s0", "s1"])
    >>> staged = slice_stages(cj)
    >>> print(staged.stages[1].closed_jaxpr)  # doctest: +NORMALIZE_WHITESPACE
    { lambda ; a:f32[]. let
        b:f32[] = pipeline_marker[mark_type=start name=s1] a
        c:f32[] = cos b
        d:f32[] = pipeline_marker[mark_type=end name=s1] c
      in (d,) }
    >>> staged.stages[1].inputs
    (ValueRef(kind='stage', index=0, stage=0, value=None),)
    """
    return _slice_stages(cj, unmarked)


def _slice_stages(cj: ClosedJaxpr, unmarked: str = "assign") -> StagedJaxpr:
    if unmarked not in _UNMARKED_MODES:
        raise PipemarkError(
            f"unmarked must be one of {', '.join(map(repr, _UNMARKED_MODES))}, got {unmarked!r}."
        )
    jaxpr = cj.jaxpr
    spans = find_stage_spans(jaxpr)
    if not spans:
        raise MarkerError(
            "slice_stages: the program has no start/end markers, so there is nothing to cut. "
            "Mark the model's layers with pm.mark(..., mark_type='start'/'end') or "
            "pm.mark_pipeline_boundary(), or insert markers with "
            "pm.passes.insert_markers(cj, cuts) or pm.passes.insert_markers_by_scope(cj)."
        )
    input_position = {v: i for i, v in enumerate(jaxpr.invars)}
    const_value = dict(zip(jaxpr.constvars, cj.consts))
    found = None
    if stage_spans_routed(jaxpr):
        found = _routed_flow(jaxpr, spans, input_position, const_value)
    if found is None:
        found = _flow(jaxpr, spans, unmarked, input_position, const_value)
    members, reads, exported, candidates = found

    eqns = jaxpr.eqns
    output_ref: dict[Var, ValueRef] = {}
    output_name: dict[Var, str] = {}
    input_names: dict[int, str] = {}
    stages: list[Stage] = []
    stage_output = ValueRef.stage_output
    for k, indices in enumerate(members):
        if type(indices) is range:
            stage_eqns = eqns[indices.start : indices.stop]
        else:
            stage_eqns = [eqns[i] for i in indices]
        outvars: list[Var] = []
        effects: set[Any] = set()
        if candidates is None:
            for eqn in stage_eqns:
                for v in eqn.outvars:
                    if v in exported:
                        output_ref[v] = stage_output(k, len(outvars))
                        output_name[v] = f"stage{k}[{len(outvars)}]"
                        outvars.append(v)
                if eqn.effects:
                    effects.update(eqn.effects)
        else:
            for v in candidates[k]:
                if v in exported:
                    position = len(outvars)
                    output_ref[v] = new_ref("stage", position, k)
                    output_name[v] = f"stage{k}[{position}]"
                    outvars.append(v)
            for eqn in stage_eqns:
                if eqn.effects:
                    effects.update(eqn.effects)
        invars: list[Var] = []
        refs: list[ValueRef] = []
        arg_names: list[str] = []
        constvars: list[Var] = []
        for a, producer in reads[k].items():
            if producer is not None:
                invars.append(a)
                refs.append(output_ref[a])
                arg_names.append(output_name[a])
            elif a in input_position:
                invars.append(a)
                position = input_position[a]
                refs.append(ValueRef.input(position))
                arg_name = input_names.get(position)
                if arg_name is None:
                    arg_name = input_names[position] = f"input[{position}]"
                arg_names.append(arg_name)
            else:
                constvars.append(a)
        name = spans[k].name
        stage_jaxpr = Jaxpr(
            constvars,
            invars,
            outvars,
            stage_eqns,
            effects,
            stage_debug_info(name, refs, len(outvars), arg_names),
        )
        closed = ClosedJaxpr(stage_jaxpr, [const_value[c] for c in constvars])
        stages.append(new_stage(name, closed, tuple(refs), tuple(indices)))

    outputs = []
    for a in jaxpr.outvars:
        if isinstance(a, Literal) or not isinstance(a, Var):
            outputs.append(ValueRef.const(a))
        elif a in output_ref:
            outputs.append(output_ref[a])
        elif a in input_position:
            outputs.append(ValueRef.input(input_position[a]))
        else:
            outputs.append(ValueRef.const(const_value[a]))
    # The references are valid by construction: stage names are unique (the marker
    # validation refuses duplicates) and every stage reads program inputs and earlier
    # stages only (the sweep refuses anything else).
    return StagedJaxpr._trusted(stages, jaxpr.invars, outputs, jaxpr.debug_info)


_Flow = tuple[
    list[Any],  # the equation indices of each stage: a list, or a range
    list[dict[Var, int | None]],  # per stage, what it reads from outside: the stage
    # defining it, or None for a program input or constant; in order of first read
    set[Var],  # the values read outside the stage that defines them
    list[list[Var]] | None,  # per stage, the only values that may be in the set above
]


def _routed_flow(
    jaxpr: Jaxpr,
    spans: tuple[StageSpan, ...],
    input_position: dict[Var, int],
    const_value: dict[Var, Any],
) -> _Flow | None:
    """What :func:`_flow` finds, read off the markers alone, for a program recorded as
    routed (see :func:`~pipemark.passes._markers.remember_stage_spans`) whose stages
    cover all its equations, each opened by one start marker and closed by one end
    marker: a stage reads from outside exactly its start marker's operands, and only its
    end marker's results leave it. ``None`` when the program is not of that shape."""
    eqns = jaxpr.eqns
    expected_first = 0
    for span in spans:
        if (
            span.first != expected_first
            or span.openers != (span.first,)
            or span.closers != (span.last,)
        ):
            return None
        expected_first = span.last + 1
    if expected_first != len(eqns):
        return None
    made_by: dict[Var, int] = {}  # end-marker result -> its stage
    exported: set[Var] = set()
    reads: list[dict[Var, int | None]] = []
    leaving: list[list[Var]] = []
    for k, span in enumerate(spans):
        stage_reads: dict[Var, int | None] = {}
        for a in eqns[span.first].invars:
            if type(a) is Literal:
                continue
            producer = made_by.get(a)
            if producer is not None:
                exported.add(a)
            elif a not in input_position and a not in const_value:
                return None
            stage_reads[a] = producer
        reads.append(stage_reads)
        results = eqns[span.last].outvars
        leaving.append(results)
        for v in results:
            made_by[v] = k
    for a in jaxpr.outvars:
        if type(a) is not Literal and a in made_by:
            exported.add(a)
    members = [range(span.first, span.last + 1) for span in spans]
    return members, reads, exported, leaving


def _flow(
    jaxpr: Jaxpr,
    spans: tuple[StageSpan, ...],
    unmarked: str,
    input_position: dict[Var, int],
    const_value: dict[Var, Any],
) -> _Flow:
    """The equations of each stage, what each reads from outside and which values
    leave their stage, by one sweep over the equations."""
    eqns = jaxpr.eqns
    stage_of = stage_index_of_equations(spans, len(eqns))
    if unmarked == "error":
        stray = [i for i, s in enumerate(stage_of) if s is None]
        if stray:
            first = stray[0]
            raise MarkerError(
                f"{describe_eqn(eqns[first], first)} lies outside every start/end pair "
                f"({len(stray)} such equation{'s' if len(stray) > 1 else ''} in all). Move "
                "it between a stage's markers, or slice with unmarked='assign' to let it "
                "join a stage by its operands."
            )
        assigned = stage_of
    elif None in stage_of:
        assigned = _assign_unmarked(jaxpr, stage_of, spans)
    else:
        assigned = stage_of  # type: ignore[assignment]

    num_stages = len(spans)
    # One sweep in program order (a value is defined before it is read): the equations
    # of each stage, the stage defining each value, the values that leave their stage,
    # and what each stage reads from outside, in the order it first reads them (None:
    # a program input or constant).
    members: list[list[int]] = [[] for _ in range(num_stages)]
    defined_in: dict[Var, int] = {}
    defined_get = defined_in.get
    exported: set[Var] = set()
    reads: list[dict[Var, int | None]] = [{} for _ in range(num_stages)]
    current = -1
    stage_reads: dict[Var, int | None] = {}
    stage_members: list[int] = []
    for index, eqn in enumerate(eqns):
        stage = assigned[index]
        if stage != current:
            current = stage
            stage_reads = reads[stage]
            stage_members = members[stage]
        stage_members.append(index)
        for a in eqn.invars:
            if type(a) is Literal:
                continue
            producer = defined_get(a)
            if producer == stage or a in stage_reads:
                continue
            if producer is not None:
                if producer > stage:
                    raise StageGraphError(
                        f"{describe_eqn(eqn, index)} in stage {spans[stage].name!r} reads a "
                        f"value computed later, in stage {spans[producer].name!r}; move "
                        "the markers so that every stage reads only earlier stages."
                    )
                exported.add(a)
            elif a not in input_position and a not in const_value:
                raise StageGraphError(
                    f"{describe_eqn(eqn)} reads {a}, which no equation, input or "
                    "constant of the program defines; the program is malformed "
                    "(check it with jax.extend.core.check_jaxpr)."
                )
            stage_reads[a] = producer
        for v in eqn.outvars:
            defined_in[v] = stage
    for a in jaxpr.outvars:
        if type(a) is not Literal and a in defined_in:
            exported.add(a)
    return members, reads, exported, None
