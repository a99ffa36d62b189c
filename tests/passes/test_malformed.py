"""Malformed programs: each raises its named error, with a message that names the
equation (index, primitive, source line) and says what to do."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark.passes._markers import find_stage_spans


def _m(x, name, mark_type):
    return pm.mark(x, name=name, mark_type=mark_type)


def _trace(fn):
    return jax.make_jaxpr(fn)(jnp.ones(3))


def _retype(cj, index, **params):
    """``cj`` with the params of equation ``index`` changed (a hand-built malformation)."""
    eqns = list(cj.jaxpr.eqns)
    eqns[index] = eqns[index].replace(params={**eqns[index].params, **params})
    return jax.extend.core.ClosedJaxpr(cj.jaxpr.replace(eqns=eqns), cj.consts)


def end_without_start(x):
    return _m(jnp.sin(x), "a", "end")


def start_without_end(x):
    return jnp.sin(_m(x, "a", "start"))


def mismatched_names(x):
    return _m(jnp.sin(_m(x, "a", "start")), "b", "end")


def nested_start(x):
    x = _m(x, "a", "start")
    x = _m(jnp.sin(x), "b", "start")
    return _m(_m(x, "b", "end"), "a", "end")


def same_stage_opened_twice(x):
    x = _m(_m(x, "a", "start"), "a", "start")
    return _m(x, "a", "end")


def duplicate_stage_names(x):
    x = _m(jnp.sin(_m(x, "a", "start")), "a", "end")
    return _m(jnp.cos(_m(x, "a", "start")), "a", "end")


def second_end(x):
    x = _m(jnp.sin(_m(x, "a", "start")), "a", "end")
    return _m(x, "b", "end")


def jvp_end_closes_start(x):
    return _m(jnp.sin(_m(x, "a", "start")), "a", "jvp_end")


def end_closes_jvp_start(x):
    return _m(jnp.sin(_m(x, "a", "jvp_start")), "a", "end")


def late_jvp_end(x):
    x = _m(jnp.sin(_m(x, "a", "start")), "a", "end")
    x = _m(jnp.cos(_m(x, "b", "start")), "b", "end")
    return _m(x, "a", "jvp_end")


def backward_without_forward(x):
    return jnp.sin(_m(x, "a_backward", "start"))


def stage_marker(fn):
    def wrapped(x):
        x = _m(x, "outer", "start")
        return _m(fn(x), "outer", "end")

    return wrapped


def marked_body(x):
    return _m(jnp.sin(_m(x, "inner", "start")), "inner", "end")


def in_scan(x):
    def body(carry, _):
        return marked_body(carry), None

    return jax.lax.scan(body, x, None, length=2)[0]


def in_cond(x):
    return jax.lax.cond(x[0] > 0, marked_body, jnp.cos, x)


def in_while(x):
    return jax.lax.while_loop(lambda c: c[0] < 10.0, lambda c: marked_body(c) + 1.0, x)


def in_jit(x):
    return jax.jit(marked_body)(x)


def in_checkpoint(x):
    return jax.checkpoint(marked_body)(x)


def boundary_in_scan(x):
    def body(carry, _):
        pm.mark_pipeline_boundary()
        return jnp.sin(carry), None

    return jax.lax.scan(body, x, None, length=2)[0]


def stray_before(x):
    x = jnp.sin(x)
    return _m(jnp.cos(_m(x, "a", "start")), "a", "end")


def stray_after(x):
    return jnp.cos(_m(jnp.sin(_m(x, "a", "start")), "a", "end"))


def boundaries(x):
    x = jnp.sin(x)
    pm.mark_pipeline_boundary()
    return jnp.cos(x)


def plain(x):
    return jnp.cos(jnp.sin(x))


def well_formed(x):
    return _m(jnp.sin(_m(x, "a", "start")), "a", "end")


slice_ = pm.passes.slice_stages


def slice_error(cj):
    return slice_(cj, unmarked="error")


# (id, program, pass, error, message pattern, index of the named equation or None)
CASES = [
    ("end without start", end_without_start, slice_, pm.errors.MarkerError,
     r"closes stage 'a', but no stage is open.*Add a start marker", 1),
    ("start without end", start_without_end, slice_, pm.errors.MarkerError,
     r"opens stage 'a', which is never closed.*Add an end marker", 0),
    ("mismatched names", mismatched_names, slice_, pm.errors.MarkerError,
     r"closes stage 'b', but the open stage is 'a'.*same name", 2),
    ("nested start", nested_start, slice_, pm.errors.MarkerError,
     r"opens stage 'b' inside stage 'a'.*cannot nest", 2),
    ("stage opened twice", same_stage_opened_twice, slice_, pm.errors.MarkerError,
     r"opens stage 'a' inside stage 'a'", 1),
    ("duplicate stage names", duplicate_stage_names, slice_, pm.errors.MarkerError,
     r"opens a second stage named 'a'.*must be unique", 3),
    ("second end", second_end, slice_, pm.errors.MarkerError,
     r"closes stage 'b', but no stage is open", 3),
    ("jvp_end closes start", jvp_end_closes_start, slice_, pm.errors.MarkerError,
     r"has no open jvp_start marker.*Pair start with end", 2),
    ("end closes jvp_start", end_closes_jvp_start, slice_, pm.errors.MarkerError,
     r"has no open start marker", 2),
    ("late jvp_end", late_jvp_end, slice_, pm.errors.MarkerError,
     r"closes stage 'a', but no stage is open", 6),
    ("backward without forward", backward_without_forward, slice_, pm.errors.MarkerError,
     r"opens stage 'a_backward', which is never closed", 0),
    ("marker in scan", stage_marker(in_scan), slice_, pm.errors.MarkerError,
     r"holds a start marker 'inner' inside its 'jaxpr' body.*Hoist the marker out of the "
     r"scan, or slice the body", 1),
    ("marker in cond", stage_marker(in_cond), slice_, pm.errors.MarkerError,
     r"inside its 'branches' body.*Hoist the marker out of the cond", None),
    ("marker in while", stage_marker(in_while), slice_, pm.errors.MarkerError,
     r"inside its 'body_jaxpr' body.*out of the while", 1),
    ("marker in jit", stage_marker(in_jit), slice_, pm.errors.MarkerError,
     r"holds a start marker 'inner'.*Inline the jit first with "
     r"pm.passes.inline_calls\(cj\)", 1),
    ("marker in checkpoint", stage_marker(in_checkpoint), slice_, pm.errors.MarkerError,
     r"Inline the \w+ first with pm.passes.inline_calls", 1),
    ("boundary in scan", boundary_in_scan, pm.passes.layers_from_boundaries, pm.errors.MarkerError,
     r"holds a boundary marker.*inside its 'jaxpr' body", 0),
    ("stray equation before", stray_before, slice_error, pm.errors.MarkerError,
     r"equation 0 \(sin.*lies outside every start/end pair \(1 such equation in all\).*"
     r"unmarked='assign'", 0),
    ("stray equation after", stray_after, slice_error, pm.errors.MarkerError,
     r"lies outside every start/end pair", 3),
    ("boundary markers", boundaries, slice_, pm.errors.MarkerError,
     r"boundary markers.*layers_from_boundaries", 1),
    ("no markers", plain, slice_, pm.errors.MarkerError,
     r"no start/end markers.*insert_markers", None),
    ("insert into marked", well_formed, lambda cj: pm.passes.insert_markers(cj, [1]),
     pm.errors.MarkerError, r"already has one.*remove_markers", 0),
    ("boundaries and start/end", well_formed, pm.passes.layers_from_boundaries,
     pm.errors.MarkerError, r"already has one", 0),
    ("insert by scope, no scopes", well_formed, pm.passes.insert_markers_by_scope,
     pm.PipemarkError, r"no equation has a name scope", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("program", "run", "error", "pattern", "index"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_malformed_program_raises(program, run, error, pattern, index):
    cj = _trace(program)
    before = str(cj)
    with pytest.raises(error) as info:
        run(cj)
    message = str(info.value)
    assert re.search(pattern, message, re.DOTALL), message
    if index is not None:
        assert f"equation {index} (" in message
        # Traced equations name the user's source line.
        assert "test_malformed.py" in message, message
    assert str(cj) == before


@pytest.mark.parametrize(
    ("params", "pattern"),
    [
        ({"mark_type": "middle"}, r"unknown mark type 'middle'"),
        ({"name": 3}, r"marker name 3 is not a str"),
    ],
    ids=["unknown mark type", "name not a str"],
)
def test_hand_built_marker_params_are_refused(params, pattern):
    cj = _retype(_trace(well_formed), 0, **params)
    with pytest.raises(pm.errors.MarkerError, match=pattern) as info:
        pm.passes.slice_stages(cj)
    assert "equation 0 (pipeline_marker" in str(info.value)


def test_marker_errors_are_value_errors():
    with pytest.raises(ValueError):
        find_stage_spans(_trace(end_without_start))


# The passes the cases are run through, and the (case, pass) pairs where the program is
# well formed for that pass (each for a reason): every other pair must be refused with a
# PipemarkError, never accepted and never a builtin error.
PASSES = {
    "slice_stages": pm.passes.slice_stages,
    "slice_stages(unmarked='error')": slice_error,
    "layers_from_boundaries": pm.passes.layers_from_boundaries,
    "insert_markers_by_scope": pm.passes.insert_markers_by_scope,
    "insert_markers([0])": lambda cj: pm.passes.insert_markers(cj, [0]),
}
ACCEPTED = {
    # slice_stages assigns stray equations to a neighbouring stage by default
    ("stray equation before", "slice_stages"),
    ("stray equation after", "slice_stages"),
    # boundary markers are what layers_from_boundaries turns into layers
    ("boundary markers", "layers_from_boundaries"),
    # an unmarked program: no boundaries is one layer; a cut at 0 is one stage
    ("no markers", "layers_from_boundaries"),
    ("no markers", "insert_markers([0])"),
    # well-formed start/end programs, malformed only for the pass of their case
    *((case, name) for case in ("insert into marked", "boundaries and start/end",
      "insert by scope, no scopes") for name in ("slice_stages", "slice_stages(unmarked='error')")),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_every_pass_refuses_or_accepts_each_malformed_program_as_listed(case):
    cj = _trace(case[1])
    before = str(cj)
    for name, run in PASSES.items():
        if (case[0], name) in ACCEPTED:
            result = run(cj)
            program = result.as_closed_jaxpr() if hasattr(result, "as_closed_jaxpr") else result
            jax.extend.core.check_jaxpr(program.jaxpr)
        else:
            with pytest.raises(pm.PipemarkError):
                run(cj)
        assert str(cj) == before, name
