"""StagedJaxpr: run, stitch, verify, summary, graph."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.staged import Stage, StagedJaxpr, ValueRef
from tests._exact import assert_same_equations_same_bits

P = pm.passes
X = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)


def two_stages():
    cj = jax.make_jaxpr(lambda x, y: (jnp.cos(jnp.sin(x) * y), x))(X, X)
    return cj, P.slice_stages(P.insert_markers(cj, [2], names=["front", "back"]))


def test_call_accepts_pytrees_and_flat_arguments():
    ex = examples.mlp(num_layers=2)
    staged = pm.split(ex.loss_fn, *ex.args)
    flat = jax.tree_util.tree_leaves(ex.args)
    a = staged(*ex.args)
    b = staged(*flat)
    assert len(a) == 1
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    assert_same_equations_same_bits(staged, ex.trace(), *flat)


def test_call_under_jit_matches_closely():
    ex = examples.transformer(num_layers=1)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    got = jax.jit(lambda *a: staged(*a))(*ex.args)
    want = jax.tree_util.tree_leaves(jax.value_and_grad(ex.loss_fn)(*ex.args))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_call_rejects_wrong_arguments():
    _, staged = two_stages()
    with pytest.raises(pm.PipemarkError, match=r"takes 2 inputs \(after flattening\), got 1"):
        staged(X)
    with pytest.raises(pm.PipemarkError, match=r"Input 1 has shape \(3,\).*float32\[4\]"):
        staged(X, jnp.ones(3))


def test_verify_against_jaxpr_and_callable():
    cj, staged = two_stages()
    report = staged.verify(cj, X, X)
    assert report.passed and report.references == ("jit", "eager")
    assert len(report.checks) == 4  # two results, each against both evaluations
    report = staged.verify(lambda x, y: (jnp.cos(jnp.sin(x) * y), x), X, X, against="jit")
    assert report.references == ("jit",) and not report.exact
    assert report.comparison == "within rtol 1e-05"
    assert str(report).startswith("passed: 2 comparisons against jit, within rtol 1e-05 (atol")


def test_verify_names_the_first_differing_result():
    _, staged = two_stages()
    with pytest.raises(pm.PipemarkError, match=r"Result 0 \(output 0 of stage 'back'\) differs"):
        staged.verify(lambda x, y: (jnp.cos(jnp.sin(x) * y) + 1e-3, x), X, X)
    with pytest.raises(pm.PipemarkError, match=r"Result 1 \(program input 0\) differs"):
        staged.verify(lambda x, y: (jnp.cos(jnp.sin(x) * y), x + 1), X, X)
    with pytest.raises(pm.PipemarkError, match=r"returns 2 results, the reference \(jit\) 1"):
        staged.verify(lambda x, y: x, X, X)
    with pytest.raises(
        pm.PipemarkError, match=r"is float32\[4\], the reference's \(jit\) is int32"
    ):
        staged.verify(lambda x, y: (jnp.zeros(4, jnp.int32), x), X, X)
    with pytest.raises(pm.PipemarkError, match="reference must be a ClosedJaxpr or a callable"):
        staged.verify(3, X, X)


def test_verify_with_tolerance():
    _, staged = two_stages()
    near = lambda x, y: (jnp.cos(jnp.sin(x) * y) + 1e-7, x)  # noqa: E731
    # By default float32 results agree within rtol 1e-5 (atol: rtol x largest magnitude).
    assert staged.verify(near, X, X).largest_difference > 0
    with pytest.raises(pm.VerificationError, match=r"\(bit for bit\)") as caught:
        staged.verify(near, X, X, rtol=0, atol=0)
    assert not caught.value.report.passed and caught.value.report.exact
    assert "np.float" not in str(caught.value)  # plain numbers
    staged.verify(near, X, X, rtol=0, atol=1e-5)
    far = lambda x, y: (jnp.cos(jnp.sin(x) * y) * (1 + 1e-4), x)  # noqa: E731
    with pytest.raises(pm.PipemarkError, match=r"largest difference [0-9.e-]+, 4 of 4 elements"):
        staged.verify(far, X, X)


def test_verify_compares_integers_exactly_and_nans_in_place():
    def f(x):
        return jnp.argsort(x), jnp.where(x > 0, jnp.nan, x)

    staged = pm.split(f, X, num_stages=1)
    report = staged.verify(f, X)
    assert [c.rtol for c in report.checks[:2]] == [0.0, 1e-5]
    with pytest.raises(pm.PipemarkError, match=r"Result 0 .*differs"):
        staged.verify(lambda x: (jnp.argsort(x) + 1, f(x)[1]), X)


def skip(x):
    a = jnp.sin(x)
    return jnp.cos(a) + a


def test_summary_table():
    cj = jax.make_jaxpr(skip)(jnp.ones(4))
    staged = P.slice_stages(P.insert_markers(cj, [1, 2]))
    # The table itself is tested in tests/views/test_views.py.
    assert staged.summary(style="plain") == pm.views.summary(staged, style="plain")
    assert staged.summary(style="plain").splitlines()[2].split()[:2] == ["0", "stage0"]
    # print(staged) shows the same table (drawn by rich when it is installed).
    assert str(staged) == staged.summary()
    assert staged._repr_html_().startswith('<div class="pipemark-view">')
    assert repr(staged) == "StagedJaxpr(3 stages: stage0, stage1, stage2)"


def test_graph_has_bytes_per_edge():
    cj = jax.make_jaxpr(skip)(jnp.ones(4))
    staged = P.slice_stages(P.insert_markers(cj, [1, 2]))
    graph = staged.graph
    assert sorted(graph.nodes) == ["stage0", "stage1", "stage2"]
    assert graph.nodes["stage1"] == {"kind": "stage", "index": 1, "num_eqns": 3}
    edges = {
        edge: (data["bytes"], data["num_values"], data["skip"])
        for edge, data in graph.edges.items()
    }
    assert edges == {
        ("stage0", "stage1"): (16, 1, False),
        ("stage0", "stage2"): (16, 1, True),  # the skip connection is its own edge
        ("stage1", "stage2"): (16, 1, False),
    }
    # An edge names the stage outputs that cross it, readably.
    data = graph.edges["stage0", "stage2"]
    (ref,) = data["refs"]
    assert ref in staged.stages[2].inputs and ref.kind == "stage" and ref.stage == 0
    assert data["types"] == ("f32[4]",)
    assert repr(data["refs"]) == f"(ValueRef.stage_output(0, {ref.index}),)"
    assert "Var(" not in repr(dict(graph.edges.items()))


def test_stage_properties():
    _, staged = two_stages()
    front = staged["front"]
    assert staged[0] is front and len(staged) == 2
    assert front.num_eqns == 4 and front.bytes_in == 32 and front.bytes_out == 16
    assert [str(a) for a in front.in_avals] == ["float32[4]", "float32[4]"]
    with pytest.raises(pm.PipemarkError, match="No stage named 'zz'"):
        staged["zz"]
    with pytest.raises(pm.PipemarkError, match="No stage 5: this program has 2 stages"):
        staged[5]


def test_constructor_checks_references():
    _, staged = two_stages()
    front, back = staged.stages
    bad_back = Stage(back.name, back.closed_jaxpr, (ValueRef.stage_output(1, 0),))
    with pytest.raises(
        pm.errors.StageGraphError, match="reads stage 1, which does not run before it"
    ):
        StagedJaxpr([front, bad_back], staged.invars, staged.outputs)
    with pytest.raises(pm.errors.StageGraphError, match="reads output 5 of stage 'front'"):
        StagedJaxpr(
            [front, Stage("b", back.closed_jaxpr, (ValueRef.stage_output(0, 5),))],
            staged.invars,
            staged.outputs,
        )
    with pytest.raises(pm.errors.StageGraphError, match="has 1 inputs but 0 input references"):
        StagedJaxpr([front, Stage("b", back.closed_jaxpr, ())], staged.invars, staged.outputs)
    with pytest.raises(pm.errors.StageGraphError, match="Two stages are named 'front'"):
        StagedJaxpr([front, front], staged.invars, staged.outputs)
    with pytest.raises(pm.errors.StageGraphError, match="reads program input 7"):
        StagedJaxpr(staged.stages, staged.invars, [ValueRef.input(7)])


def test_as_closed_jaxpr_keeps_debug_info_and_effects():
    cj, staged = two_stages()
    stitched = staged.as_closed_jaxpr()
    assert stitched.jaxpr.debug_info.arg_names == cj.jaxpr.debug_info.arg_names
    assert stitched.jaxpr.effects == set()
    # Stage programs name their inputs after where they come from.
    assert staged["back"].jaxpr.debug_info.arg_names == ("stage0[0]",)


def test_verify_evaluates_the_reference_without_any_pipemark_pass(monkeypatch):
    # The oracle must not share code with what it checks: after the split, every pass
    # module's entry that could rewrite the reference fails if called.
    import pipemark.passes as passes
    import pipemark.staging as staging

    @jax.jit
    def helper(x):
        return jnp.sin(x)

    def f(x):
        return helper(helper(x) * 2.0)

    staged = pm.split(f, X, num_stages=2)

    def forbidden(*args, **kwargs):
        raise AssertionError("verify ran a pipemark pass on the reference")

    for module in (passes, staging):
        for name in ("inline_calls", "split_jaxpr"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr("pipemark.passes.inline.inline_calls", forbidden)
    report = staged.verify(f, X)
    assert report.passed and report.references == ("jit", "eager")


def test_a_literal_result_has_the_traced_dtype():
    # A program result that is a literal (a Python float in the jaxpr) comes back as
    # jax.jit gives it (float32), not as numpy would make it (float64).
    def f(x):
        return jnp.sin(x), 2.0

    staged = pm.split(f, X, num_stages=1)
    _, literal = staged(X)
    assert np.asarray(literal).dtype == np.asarray(jax.jit(f)(X)[1]).dtype == np.float32
