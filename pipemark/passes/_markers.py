"""Find and validate the stage structure that markers give a jaxpr.

A *stage* is the run of equations from the marker that opens it to the marker that
closes it, both included. ``start`` and ``jvp_start`` open a stage, ``end`` and
``jvp_end`` close it; markers are matched by name. Under :func:`jax.jvp` a primal marker
and its tangent marker share a name, so ``start a``, ``jvp_start a`` … ``end a``,
``jvp_end a`` is one stage ``a`` that closes when every opener has its closer.

This module is private to :mod:`pipemark.passes`; other passes import
:func:`find_stage_spans` and :func:`stage_index_of_equations` from here. Their
signatures are stable.

Two shapes that JAX makes are accepted on purpose:

* A mirrored ``<name>_backward`` stage left open at the end of the program, when stage
  ``<name>`` exists. ``grad`` makes no backward ``end`` marker when the first stage's
  inputs are not differentiated (their cotangent is a symbolic zero), so the last
  backward stage runs to the end of the program. Its span has ``closers == ()``.
* A ``jvp_end`` right after the stage of the same name closed, with
  no other stage opened in between: the tangent marker of a ``start`` whose tangents
  were all symbolic zeros is missing, so the tangent ``jvp_end`` follows the primal
  ``end``. The stage is extended to that marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from pipemark.errors import MarkerError, describe_eqn
from pipemark.marks import CLOSERS, MARK_TYPES, OPENERS, STAGE_MARK_TYPES, forward_name
from pipemark.passes.memo import ProgramMemo
from pipemark.primitive import is_marker, pipeline_p
from pipemark.walk import CALL_PRIMITIVES, bodies, find_eqn

__all__ = [
    "first_stage_marker",
    "StageSpan",
    "check_no_markers_in_bodies",
    "find_stage_spans",
    "stage_index_of_equations",
]


@dataclass(frozen=True)
class StageSpan:
    """One stage of a marked program: equations ``first`` to ``last``, both included.

    Attributes
    ----------
    name:
        The stage name (the markers' ``name`` parameter).
    first, last:
        Equation indices of the first opening marker and the last closing marker (or of
        the program's last equation when the stage is closed implicitly).
    openers, closers:
        Indices of the ``start``/``jvp_start`` and ``end``/``jvp_end`` markers of this
        stage, in program order. ``closers`` is empty for a mirrored backward stage that
        JAX left open at the end of the program.
    """

    name: str
    first: int
    last: int
    openers: tuple[int, ...]
    closers: tuple[int, ...]

    @property
    def implicit_end(self) -> bool:
        """Whether the stage runs to the end of the program without an end marker."""
        return not self.closers


def _as_jaxpr(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def _marker_params(eqn: JaxprEqn, index: int) -> tuple[str, str]:
    """The (name, mark_type) of a marker equation, validated."""
    mark_type = eqn.params.get("mark_type")
    name = eqn.params.get("name")
    if mark_type not in MARK_TYPES:
        raise MarkerError(
            f"{describe_eqn(eqn, index)}: unknown mark type {mark_type!r}. A pipeline "
            f"marker's mark_type must be one of {', '.join(MARK_TYPES)}; rebuild the "
            "marker with pm.mark or pm.mark_pipeline_jaxpreqn."
        )
    if not isinstance(name, str):
        raise MarkerError(
            f"{describe_eqn(eqn, index)}: marker name {name!r} is not a str; give every "
            "marker a string name."
        )
    return name, mark_type


def first_stage_marker(jaxpr: Jaxpr, seen: dict[int, JaxprEqn | None]) -> JaxprEqn | None:
    """The first stage-delimiting marker anywhere inside ``jaxpr`` (recursively);
    ``seen`` memoises the bodies searched."""
    return find_eqn(jaxpr, _is_stage_marker, seen)


def _is_stage_marker(eqn: JaxprEqn) -> bool:
    return is_marker(eqn, STAGE_MARK_TYPES)


# The stage spans of programs validated before: find_stage_spans validates a program
# once even when a pipeline of passes reads it several times.
_SPANS = ProgramMemo()


def check_no_markers_in_bodies(jaxpr: Jaxpr | ClosedJaxpr) -> None:
    """Raise :class:`MarkerError` if a stage marker sits inside a sub-jaxpr.

    Passes cut only the top level of a program; a ``start``/``end``/``jvp_*``/
    ``boundary`` marker inside a ``scan``, ``cond``, ``while``, ``pjit`` or ``remat``
    body cannot be cut there. Linear in the total number of equations (each distinct
    body is scanned once; :func:`find_stage_spans` remembers the programs it validated).
    """
    jaxpr = _as_jaxpr(jaxpr)
    seen: dict[int, JaxprEqn | None] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        for param, body in bodies(eqn):
            inner = first_stage_marker(body, seen)
            if inner is None:
                continue
            raise MarkerError(
                f"{describe_eqn(eqn, index)} holds {_article(inner.params['mark_type'])} "
                f"{inner.params['mark_type']} marker "
                f"{inner.params.get('name')!r} inside its {param!r} body; stages are cut "
                f"only at the top level of a program. {_body_advice(eqn)}"
            )


@dataclass
class _Open:
    name: str
    first: int
    openers: list[int]
    closers: list[int]
    pending: set[str]  # closing mark types still expected


def find_stage_spans(
    jaxpr: Jaxpr | ClosedJaxpr, *, allow_boundaries: bool = False
) -> tuple[StageSpan, ...]:
    """Find the stages of a marked program and check that its markers are well formed.

    Parameters
    ----------
    jaxpr:
        A ``Jaxpr`` or ``ClosedJaxpr``; only its top level is cut.
    allow_boundaries:
        When ``False`` (the default), zero-operand ``boundary`` markers are refused with
        a message that points to :func:`pipemark.passes.layers_from_boundaries`; when
        ``True`` they are ignored.

    Returns
    -------
    tuple of StageSpan
        One span per stage, in program order. Spans never overlap. Equations outside
        every span are *unmarked*.

    Raises
    ------
    MarkerError
        For an end without a start, a start without an end, mismatched names, a start
        inside another stage, two stages with the same name, an unknown mark type, a
        stage marker inside a sub-jaxpr body, or (unless allowed) a boundary marker.
        Every message names the equation index, primitive and source line.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = pm.mark(x, name="a", mark_type="start")
    ...     x = pm.mark(jnp.sin(x), name="a", mark_type="end")
    ...     return jnp.cos(x)
    >>> find_stage_spans(jax.make_jaxpr(f)(1.0))
    (StageSpan(name='a', first=0, last=2, openers=(0,), closers=(2,)),)
    """
    jaxpr = _as_jaxpr(jaxpr)
    if not allow_boundaries:
        known = _SPANS.get(jaxpr)
        if known is not None:
            return known
    check_no_markers_in_bodies(jaxpr)
    finder = _SpanFinder(jaxpr.eqns)
    markers: list[int] = []
    for index, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is not pipeline_p:
            continue
        markers.append(index)
        name, mark_type = _marker_params(eqn, index)
        if mark_type == "boundary":
            if allow_boundaries:
                continue
            raise MarkerError(
                f"{describe_eqn(eqn, index)}: this program marks layers with boundary "
                "markers, which do not delimit stages by themselves. Call "
                "pm.passes.layers_from_boundaries(cj) first to wrap each layer in "
                "start/end markers (pm.split does this for you)."
            )
        if mark_type in OPENERS:
            finder.opener(index, name, mark_type)
        elif mark_type in CLOSERS:
            finder.closer(index, name, mark_type)
        # hook and grad markers are ordinary equations for stage structure.
    result = finder.finish()
    if not allow_boundaries:
        _SPANS.put(jaxpr, result, markers=markers)
    return result


class _SpanFinder:
    """The stages of a program, marker by marker (see :func:`find_stage_spans`)."""

    def __init__(self, eqns: list[JaxprEqn]) -> None:
        self.eqns = eqns
        self.spans: list[StageSpan] = []
        self.where_named: dict[str, int] = {}  # stage name -> opening eqn index
        self.current: _Open | None = None
        # The span closed last, while no other stage has opened since: a tangent marker
        # of the same name may still extend it (see the module docstring).
        self.just_closed: _Open | None = None

    def close(self, stage: _Open, last: int) -> None:
        span = StageSpan(stage.name, stage.first, last, tuple(stage.openers), tuple(stage.closers))
        self.spans.append(span)

    def where(self, index: int) -> str:
        return describe_eqn(self.eqns[index], index)

    def opener(self, index: int, name: str, mark_type: str) -> None:
        current = self.current
        if current is not None:
            if current.name == name and OPENERS[mark_type] not in current.pending:
                # The tangent opener of a stage whose primal start is open.
                current.openers.append(index)
                current.pending.add(OPENERS[mark_type])
                return
            advice = ""
            if forward_name(name) or forward_name(current.name):
                advice = (
                    " In a gradient program this happens when a stage reads values "
                    "that bypass its start marker, so the backward markers "
                    "interleave: pass every value the stage reads through its start "
                    "marker (pm.mark((x, w, ...), ...)), or mark layers with boundary "
                    "markers and use pm.passes.layers_from_boundaries."
                )
            raise MarkerError(
                f"{self.where(index)} opens stage {name!r} inside stage "
                f"{current.name!r}, opened at {self.where(current.first)}; stages cannot "
                f"nest. Close {current.name!r} with an end marker first.{advice}"
            )
        if name in self.where_named:
            raise MarkerError(
                f"{self.where(index)} opens a second stage named {name!r}; the "
                f"first one opened at {self.where(self.where_named[name])}. Stage names "
                "must be unique: rename one of them (jax.checkpoint over a marked "
                "function duplicates its markers; checkpoint inside each stage "
                "instead)."
            )
        self.where_named[name] = index
        self.current = _Open(name, index, [index], [], {OPENERS[mark_type]})
        self.just_closed = None

    def closer(self, index: int, name: str, mark_type: str) -> None:
        current = self.current
        if current is None:
            self.late_tangent_closer(index, name, mark_type)
            return
        if current.name != name:
            raise MarkerError(
                f"{self.where(index)} closes stage {name!r}, but the open stage "
                f"is {current.name!r}, opened at {self.where(current.first)}. Give the "
                "start and end markers of a stage the same name."
            )
        if mark_type not in current.pending:
            raise MarkerError(
                f"{self.where(index)} closes stage {name!r}, but stage {name!r} "
                f"has no open {CLOSERS[mark_type]} marker (opened at "
                f"{self.where(current.first)}). Pair start with end and jvp_start with "
                "jvp_end."
            )
        current.pending.discard(mark_type)
        current.closers.append(index)
        if not current.pending:
            self.close(current, index)
            self.just_closed, self.current = current, None

    def late_tangent_closer(self, index: int, name: str, mark_type: str) -> None:
        """A closer with no stage open: the ``jvp_end`` of the stage just closed (its
        tangent opener was never made), which extends it; else an error."""
        last = self.just_closed
        if (
            last is not None
            and last.name == name
            and mark_type == "jvp_end"
            and "jvp_end" not in {self.eqns[i].params["mark_type"] for i in last.closers}
        ):
            last.closers.append(index)
            self.spans[-1] = StageSpan(
                name, last.first, index, tuple(last.openers), tuple(last.closers)
            )
            return
        raise MarkerError(
            f"{self.where(index)} closes stage {name!r}, but no stage is "
            f"open there. Add a start marker named {name!r} before it, or remove "
            "this end marker."
        )

    def finish(self) -> tuple[StageSpan, ...]:
        current = self.current
        if current is not None:
            forward = forward_name(current.name)
            mirrored = (
                forward is not None
                and forward in self.where_named
                and not current.closers
                and all(self.eqns[i].params["mark_type"] == "start" for i in current.openers)
            )
            if not mirrored:
                raise MarkerError(
                    f"{self.where(current.first)} opens stage {current.name!r}, which is "
                    f"never closed. Add an end marker named {current.name!r} after the "
                    "stage's last equation."
                )
            self.close(current, len(self.eqns) - 1)
        return tuple(self.spans)


def stage_index_of_equations(spans: tuple[StageSpan, ...], num_eqns: int) -> list[int | None]:
    """For each equation index, the index of the span holding it, or ``None`` when the
    equation is outside every span (unmarked).

    >>> spans = (StageSpan("a", 1, 2, (1,), (2,)),)
    >>> stage_index_of_equations(spans, 4)
    [None, 0, 0, None]
    """
    stage: list[int | None] = [None] * num_eqns
    for k, span in enumerate(spans):
        stage[span.first : span.last + 1] = [k] * (span.last + 1 - span.first)
    return stage


def _body_advice(eqn: JaxprEqn) -> str:
    if eqn.primitive.name in CALL_PRIMITIVES:
        return (
            f"Inline the {eqn.primitive.name} first with pm.passes.inline_calls(cj) "
            "(pm.split, pm.show and the runtime do this for you)."
        )
    if eqn.primitive.name == "scan":
        return (
            "Hoist the marker out of the scan, or slice the body jaxpr itself; a scan whose "
            "body is one layer marked with a start/end pair is cut into stages by "
            "pm.passes.layers_from_scans(cj) (pm.split does this for you)."
        )
    return f"Hoist the marker out of the {eqn.primitive.name}, or slice the body jaxpr itself."


def _article(word: str) -> str:
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"
