"""Marker validation: sub-jaxpr bodies, the per-jaxpr caches, and the nested-stage
message of a gradient program."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.errors import MarkerError
from pipemark.passes import _markers
from pipemark.passes._markers import (
    check_no_markers_in_bodies,
    find_stage_spans,
)


def _copy(cj: ClosedJaxpr) -> ClosedJaxpr:
    """The same program in a new Jaxpr object (and a new equation list): not in any
    cache, neither pipemark's nor make_jaxpr's."""
    j = cj.jaxpr
    return ClosedJaxpr(
        Jaxpr(j.constvars, j.invars, j.outvars, list(j.eqns), j.effects, j.debug_info),
        cj.consts,
    )


def _two_stages() -> ClosedJaxpr:
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        x = pm.mark(jnp.sin(x), name="a", mark_type="end")
        x = pm.mark(x, name="b", mark_type="start")
        return pm.mark(jnp.cos(x), name="b", mark_type="end")

    return _copy(jax.make_jaxpr(f)(1.0))


def _start(x):
    return pm.mark(x, name="a", mark_type="start")


# ------------------------------------------------------------- markers inside bodies

BODIES = {
    "scan": (lambda x: lax.scan(lambda c, _: (_start(c) * 2, None), x, None, length=2)[0],
             "scan", "jaxpr"),
    "cond": (lambda x: lax.cond(x > 0, lambda y: y, lambda y: _start(y), x), "cond", "branches"),
    "while": (lambda x: lax.while_loop(lambda y: y < 3, lambda y: _start(y) + 1, x),
              "while", "body_jaxpr"),
    "jit": (lambda x: jax.jit(lambda y: jnp.sin(_start(y)))(x), "jit", "jaxpr"),
    "scan in jit": (
        lambda x: jax.jit(
            lambda y: lax.scan(lambda c, _: (_start(c) * 2, None), y, None, length=2)[0]
        )(x),
        "jit",
        "jaxpr",
    ),
    "remat": (lambda x: jax.checkpoint(lambda y: jnp.sin(_start(y)))(x), "remat", "jaxpr"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BODIES))
def test_marker_in_a_body_is_found(case):
    fn, primitive, param = BODIES[case]

    def f(x):
        # Equations with plain parameters only come first: the fast path skips them.
        y = jnp.sin(x).astype(jnp.float32) * 2.0
        return fn(y)

    cj = _copy(jax.make_jaxpr(f)(1.0))
    index = next(i for i, e in enumerate(cj.eqns) if e.primitive.name.startswith(primitive))
    advice = (
        rf"Inline the {primitive}\w* first with pm\.passes\.inline_calls"
        if primitive in ("jit", "remat", "checkpoint")
        else rf"Hoist the marker out of the {primitive}\w*, or slice the body jaxpr itself"
    )
    pattern = (
        rf"equation {index} \({primitive}\w*, .*\) holds a start marker 'a' inside its "
        rf"'{param}' body; stages are cut only at the top level of a program\. {advice}"
    )
    for check in (check_no_markers_in_bodies, find_stage_spans, pm.passes.slice_stages):
        with pytest.raises(MarkerError, match=pattern):
            check(cj)
    # A failed check is not remembered.
    with pytest.raises(MarkerError, match=pattern):
        check_no_markers_in_bodies(cj)


def test_bodies_without_stage_markers_pass():
    def f(x):
        x = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
        x = lax.cond(x > 0, jnp.sin, jnp.cos, x)
        # A hook marker inside a body does not delimit stages.
        return jax.jit(lambda y: pm.mark(y, name="h", mark_type="hook"))(x)

    cj = _copy(jax.make_jaxpr(f)(1.0))
    check_no_markers_in_bodies(cj)
    assert find_stage_spans(cj) == ()


def test_a_marker_in_a_scan_body_is_found():

    def f(x):
        def body(carry, _):
            carry = pm.mark(carry, name="inner", mark_type="start")
            return pm.mark(jnp.sin(carry), name="inner", mark_type="end"), None

        return lax.scan(body, x, None, length=2)[0]

    cj = jax.make_jaxpr(f)(1.0)
    with pytest.raises(MarkerError, match="inside its 'jaxpr' body"):
        check_no_markers_in_bodies(_copy(cj))


# ------------------------------------------------------------------------- the caches


def test_spans_are_cached_per_jaxpr(monkeypatch):
    cj = _two_stages()
    spans = find_stage_spans(cj)
    assert [s.name for s in spans] == ["a", "b"]
    assert find_stage_spans(cj) is spans
    assert find_stage_spans(cj.jaxpr) is spans

    def fail(jaxpr):
        raise AssertionError("validated again")

    monkeypatch.setattr(_markers, "check_no_markers_in_bodies", fail)
    assert find_stage_spans(cj) is spans
    # The same program in another Jaxpr object is validated afresh.
    with pytest.raises(AssertionError, match="validated again"):
        find_stage_spans(_copy(cj))


def test_boundary_programs_are_not_cached_as_valid():
    cj = _copy(examples.mlp(num_layers=2, markers="boundary").trace())
    assert find_stage_spans(cj, allow_boundaries=True) == ()
    with pytest.raises(MarkerError, match="layers_from_boundaries"):
        find_stage_spans(cj)
    assert find_stage_spans(cj, allow_boundaries=True) == ()


def test_replacing_an_equation_in_place_is_validated_again():
    """Jaxpr.eqns is a plain list: a user can replace an equation without changing its
    length. The cached spans must not hide the new structure."""
    cj = _two_stages()
    eqns = cj.jaxpr.eqns
    assert isinstance(eqns, list)
    assert len(find_stage_spans(cj)) == 2
    start_b = next(
        i for i, e in enumerate(eqns) if e.primitive is pm.pipeline_p and e.params["name"] == "b"
    )
    original = eqns[start_b]
    eqns[start_b] = original.replace(params={**original.params, "name": "c"})
    with pytest.raises(MarkerError, match=r"closes stage 'b', but the open stage is 'c'"):
        find_stage_spans(cj)
    eqns[start_b] = original
    assert [s.name for s in find_stage_spans(cj)] == ["a", "b"]


def test_appending_an_equation_is_validated_again():
    cj = _two_stages()
    spans = find_stage_spans(cj)
    eqns = cj.jaxpr.eqns
    eqns.append(eqns[0].replace(params={"name": "z", "mark_type": "start"}))
    with pytest.raises(MarkerError, match="opens stage 'z', which is never closed"):
        find_stage_spans(cj)
    eqns.pop()
    assert find_stage_spans(cj) == spans


def test_a_body_marker_put_in_place_is_found():
    cj = _two_stages()
    check_no_markers_in_bodies(cj)
    scan = jax.make_jaxpr(BODIES["scan"][0])(1.0).eqns[0]
    sin = next(i for i, e in enumerate(cj.eqns) if e.primitive.name == "sin")
    cj.jaxpr.eqns[sin] = scan
    with pytest.raises(MarkerError, match=rf"equation {sin} \(scan, .*'jaxpr' body"):
        check_no_markers_in_bodies(cj)


def test_editing_the_results_in_place_is_validated_again():
    # A result appended in place after slicing validated the program (and found it
    # routed: every result leaving through an end marker) must be seen.
    cj = pm.passes.insert_markers(_copy(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)), [1])
    sin = next(e for e in cj.eqns if e.primitive.name == "sin")
    pm.passes.slice_stages(cj)
    cj.jaxpr.outvars.append(sin.outvars[0])
    staged = pm.passes.slice_stages(cj)
    assert len(staged.outputs) == 2
    np.testing.assert_allclose(staged(0.5)[1], np.sin(0.5), rtol=1e-6)


def test_editing_a_marker_params_in_place_is_validated_again():
    cj = _two_stages()
    find_stage_spans(cj)
    cj.jaxpr.eqns[0].params["mark_type"] = "bogus"
    with pytest.raises(MarkerError, match="unknown mark type 'bogus'"):
        find_stage_spans(cj)
    cj.jaxpr.eqns[0].params["mark_type"] = "start"
    cj.jaxpr.eqns[0].params["name"] = "other"
    with pytest.raises(MarkerError, match="closes stage 'a', but the open stage is 'other'"):
        find_stage_spans(cj)


def test_clear_caches_forgets_validated_programs():
    cj = _two_stages()
    find_stage_spans(cj)
    assert _cache_holds(cj.jaxpr)
    clear_caches()
    assert not _cache_holds(cj.jaxpr)


def _cache_holds(jaxpr: Jaxpr) -> bool:
    return jaxpr in _markers._SPANS


def test_the_caches_do_not_keep_a_jaxpr_alive():
    cj = _two_stages()
    find_stage_spans(cj)
    marked = pm.passes.insert_markers(
        _copy(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)), [1]
    )
    find_stage_spans(marked)
    assert _cache_holds(cj.jaxpr) and _cache_holds(marked.jaxpr)
    refs = [weakref.ref(cj.jaxpr), weakref.ref(marked.jaxpr)]
    del cj, marked
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_validating_many_programs_does_not_grow_the_caches():
    gc.collect()
    before = len(_markers._SPANS)
    for _ in range(20):
        cj = _two_stages()
        find_stage_spans(cj)
        pm.passes.slice_stages(cj)
    del cj
    gc.collect()
    assert len(_markers._SPANS) == before


def _stage_texts(staged):
    return [(s.name, str(s.closed_jaxpr), s.inputs, s.num_eqns) for s in staged.stages]


PROGRAMS = {
    "insert_markers": lambda: pm.passes.insert_markers(
        examples.mlp(num_layers=3, markers=None).trace(), [3, 9]
    ),
    "insert_markers grad": lambda: pm.passes.insert_markers(
        examples.resnet(num_blocks=3, markers=None).trace(grad=True), [4, 11, 30]
    ),
    "layers_from_boundaries": lambda: pm.passes.layers_from_boundaries(
        examples.transformer(num_layers=2, d_model=8, num_heads=2, seq=4, markers="boundary")
        .trace(grad=True)
    ),
    "auto_layers": lambda: pm.passes.auto_layers(
        examples.mlp(num_layers=4, markers=None).trace(grad=True), 3
    ),
    "mark_missing_vars": lambda: pm.passes.mark_missing_vars(
        examples.mlp(num_layers=3, markers="startend").trace(grad=True)
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PROGRAMS))
def test_remembered_spans_equal_a_fresh_validation(case):
    marked = PROGRAMS[case]()
    remembered = find_stage_spans(marked)
    fresh = _copy(marked)
    assert not _cache_holds(fresh.jaxpr)
    assert find_stage_spans(fresh) == remembered
    assert _stage_texts(pm.passes.slice_stages(marked)) == _stage_texts(
        pm.passes.slice_stages(fresh)
    )


# --------------------------------------------------- nested stages in a gradient program


def test_nested_backward_stages_explain_the_bypassing_read():
    def f(x):
        a = pm.mark(x, name="s0", mark_type="start")
        b = pm.mark(jnp.sin(a), name="s0", mark_type="end")
        _ = pm.mark(b, name="s1", mark_type="start")
        # s1 reads b directly, not the result of its start marker.
        return pm.mark(jnp.sin(b), name="s1", mark_type="end")

    cj = jax.make_jaxpr(jax.value_and_grad(f))(1.0)
    starts = [
        i
        for i, e in enumerate(cj.eqns)
        if e.primitive is pm.pipeline_p and e.params["mark_type"] == "start"
    ]
    pattern = (
        rf"equation {starts[-1]} \(pipeline_marker start 's0_backward', .*\) opens stage "
        rf"'s0_backward' inside stage 's1_backward', opened at equation {starts[-2]} .*; "
        r"stages cannot nest\. Close 's1_backward' with an end marker first\. In a gradient "
        r"program this happens when a stage reads values that bypass its start marker, so "
        r"the backward markers interleave: pass every value the stage reads through its "
        r"start marker \(pm\.mark\(\(x, w, \.\.\.\), \.\.\.\)\), or mark layers with "
        r"boundary markers and use pm\.passes\.layers_from_boundaries\.$"
    )
    for check in (find_stage_spans, pm.passes.slice_stages, pm.passes.mark_missing_vars):
        with pytest.raises(MarkerError, match=pattern):
            check(cj)


def test_nested_forward_stages_get_no_gradient_advice():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        x = pm.mark(x, name="b", mark_type="start")
        return pm.mark(pm.mark(x, name="b", mark_type="end"), name="a", mark_type="end")

    with pytest.raises(MarkerError, match=r"first\.$") as info:
        find_stage_spans(jax.make_jaxpr(f)(1.0))
    assert "opens stage 'b' inside stage 'a'" in str(info.value)
    assert "bypass" not in str(info.value)
