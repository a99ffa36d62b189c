"""The stage dataflow of a marked program, in one sweep: :func:`stage_flow`.

For each stage: its equations, what it reads from outside (program inputs, constants,
earlier stages' values) and which of its values leave it. :func:`slice_stages` builds
the stage programs from it and :func:`mark_missing_vars` asks it whether any value
crosses a stage boundary without going through the markers (:attr:`StageFlow.routed`).

A program whose every stage is exactly one start marker, its equations and one end
marker, whose equations read only what their stage defines, and whose start markers
read only program inputs, constants and earlier end markers' results (what the
insert passes build) is *routed*: its flow is read off the markers, after one check
of each equation's operands.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> cj = pm.passes.insert_markers(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0), [1])
>>> flow = stage_flow(cj.jaxpr)
>>> flow.routed, [list(m) for m in flow.members]
(True, [[0, 1, 2], [3, 4, 5]])
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

from jax.extend.core import Jaxpr, Literal, Var

from pipemark.errors import MarkerError, PipemarkError, StageGraphError, describe_eqn
from pipemark.passes._markers import StageSpan, find_stage_spans, stage_index_of_equations
from pipemark.passes.memo import ProgramMemo

__all__ = [
    "StageFlow",
    "UNMARKED_MODES",
    "routed_flow",
    "stage_flow",
]

#: What :func:`stage_flow` does with equations outside every stage.
UNMARKED_MODES = ("assign", "error")

# stage_flow's answers, per program and unmarked mode.
_FLOWS = ProgramMemo()


class StageFlow(NamedTuple):
    """The dataflow between the stages of a marked program.

    Attributes
    ----------
    spans:
        The stages' spans (:func:`~pipemark.passes._markers.find_stage_spans`).
    members:
        The equation indices of each stage (a ``range`` when contiguous).
    reads:
        Per stage, what it reads from outside, in order of first read: the stage
        defining it, or ``None`` for a program input or constant.
    exported:
        The values read outside the stage that defines them (or returned).
    leaving:
        Per stage, the only values that may be in ``exported`` (its end marker's
        results), for a routed program; ``None`` otherwise.
    """

    spans: tuple[StageSpan, ...]
    members: list[Any]
    reads: list[dict[Var, int | None]]
    exported: set[Var]
    leaving: list[list[Var]] | None

    @property
    def routed(self) -> bool:
        """Whether every value crossing a stage boundary goes through the markers."""
        return self.leaving is not None


def stage_flow(jaxpr: Jaxpr, unmarked: str = "assign") -> StageFlow:
    """The stage dataflow of ``jaxpr`` (see the module docstring). ``unmarked``:
    ``"assign"`` gives an equation outside every stage the stage of its operands (see
    :func:`pipemark.passes.slice_stages`), ``"error"`` refuses it.

    The answer is remembered per program (keyed on its contents: an edit in place is
    analysed again), so the passes that ask about the same program share one sweep."""
    if unmarked not in UNMARKED_MODES:
        raise PipemarkError(
            f"unmarked must be one of {', '.join(map(repr, UNMARKED_MODES))}, got {unmarked!r}."
        )
    flow = _FLOWS.get(jaxpr, unmarked)
    if flow is not None:
        return flow
    flow = routed_flow(jaxpr)
    if flow is None:
        spans = find_stage_spans(jaxpr)
        if not spans:
            flow = StageFlow(spans, [], [], set(), [])
        else:
            flow = StageFlow(spans, *_flow(jaxpr, spans, unmarked, _inputs_and_constants(jaxpr)))
        _FLOWS.put(jaxpr, flow, unmarked)
    return flow


def routed_flow(jaxpr: Jaxpr) -> StageFlow | None:
    """:func:`stage_flow`'s answer when ``jaxpr`` is routed (see the module
    docstring), else ``None``: the fast path, one look at each equation's operands
    instead of the general sweep. A program without stages is not routed."""
    flow = _FLOWS.get(jaxpr, "assign")
    if flow is not None:
        return flow if flow.routed else None
    spans = find_stage_spans(jaxpr)
    if not spans:
        return None
    found = _routed_flow(jaxpr, spans, _inputs_and_constants(jaxpr))
    if found is None:
        return None
    flow = StageFlow(spans, *found)
    for unmarked in UNMARKED_MODES:  # a routed program has no unmarked equation
        _FLOWS.put(jaxpr, flow, unmarked)
    return flow


def _inputs_and_constants(jaxpr: Jaxpr) -> set[Var]:
    return set(jaxpr.invars) | set(jaxpr.constvars)


def _routed_flow(jaxpr: Jaxpr, spans: tuple[StageSpan, ...], known: set[Var]) -> tuple | None:
    """What :func:`_flow` finds, read off the markers, for a routed program (see the
    module docstring): a stage reads from outside exactly its start marker's operands,
    and only its end marker's results leave it. ``None`` when the program is not
    routed."""
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
            elif a not in known:
                return None
            stage_reads[a] = producer
        reads.append(stage_reads)
        if not _reads_only_its_own(eqns, span):
            return None
        results = eqns[span.last].outvars
        leaving.append(results)
        for v in results:
            made_by[v] = k
    for a in jaxpr.outvars:
        if type(a) is Literal:
            continue
        if a in made_by:
            exported.add(a)
        elif a not in known:
            return None  # a result defined inside a stage, not by its end marker
    members = [range(span.first, span.last + 1) for span in spans]
    return members, reads, exported, leaving


def _reads_only_its_own(eqns: list, span: StageSpan) -> bool:
    """Whether every equation of the stage after its start marker reads only values
    the stage defines (literals aside)."""
    local = set(eqns[span.first].outvars)
    add = local.update
    for eqn in eqns[span.first + 1 : span.last + 1]:
        for a in eqn.invars:
            if type(a) is not Literal and a not in local:
                return False
        add(eqn.outvars)
    return True


def _flow(jaxpr: Jaxpr, spans: tuple[StageSpan, ...], unmarked: str, known: set[Var]) -> tuple:
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
            elif a not in known:
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
