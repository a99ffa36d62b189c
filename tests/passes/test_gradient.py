"""split_at_gradient: the two parts compose to the original training step, each part
holds what it should, and every malformed program is refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, check_jaxpr, jaxpr_as_fun

import pipemark as pm
from pipemark import examples
from pipemark._compat import CLOSED_JAXPR_IS_JAXPR
from pipemark.errors import MarkerError, PipemarkError
from pipemark.passes import dce, mark_missing_vars, split_at_gradient
from pipemark.passes._markers import find_stage_spans
from pipemark.primitive import is_marker
from tests._exact import assert_equations_from
from tests._trees import assert_trees_equal


def _step_program(example, optimizer):
    step, init_state = examples.train_step(example.loss_fn, optimizer=optimizer)
    args = (example.params, init_state(example.params), example.batch)
    return jax.make_jaxpr(step)(*args), jax.tree.leaves(args)


MODELS = {
    "mlp": lambda: examples.mlp(3),
    "resnet": lambda: examples.resnet(5, skip=3),
    "transformer_block": lambda: examples.transformer(1),
}


def _run(cj, args):
    return [np.asarray(v) for v in jaxpr_as_fun(cj)(*args)]


def _compose(compute_grad, apply_grad, args):
    return _run(apply_grad, [*args, *_run(compute_grad, args)])


def _assert_same(programs, cj, got, want):
    """``programs`` compute with ``cj``'s own equations (split, markers added, dead
    code dropped), so their results are ``cj``'s bit for bit (tests/_exact.py)."""
    assert_equations_from(programs, cj)
    assert_trees_equal(got, want)


def _snapshot(cj):
    return (
        str(cj),
        [id(e) for e in cj.jaxpr.eqns],
        [(tuple(e.invars), tuple(e.outvars)) for e in cj.jaxpr.eqns],
        tuple(cj.jaxpr.outvars),
    )


def _mark_types(cj):
    return [e.params["mark_type"] for e in cj.jaxpr.eqns if e.primitive is pm.pipeline_p]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_parts_compose_to_the_training_step(model, optimizer):
    cj, args = _step_program(MODELS[model](), optimizer)
    before = _snapshot(cj)
    compute_grad, apply_grad = split_at_gradient(cj)
    assert _snapshot(cj) == before
    for part in (compute_grad, apply_grad):
        assert isinstance(part, ClosedJaxpr)
        check_jaxpr(part.jaxpr)
    _assert_same(
        (compute_grad, apply_grad), cj, _compose(compute_grad, apply_grad, args), _run(cj, args)
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_compute_grad_holds_the_pipeline_and_apply_grad_the_update(model):
    ex = MODELS[model]()
    cj, args = _step_program(ex, "sgd")
    compute_grad, apply_grad = split_at_gradient(cj)
    (marker,) = [e for e in cj.jaxpr.eqns if is_marker(e, "grad")]
    num_grads = len(marker.invars)
    assert num_grads == len(jax.tree.leaves(ex.params))

    # compute_grad: every stage marker, forward and mirrored backward; no grad marker.
    stage_names = [s.name for s in find_stage_spans(compute_grad)]
    forward = [s.name for s in find_stage_spans(cj)]
    assert stage_names == forward
    assert any(name.endswith("_backward") for name in stage_names)
    assert "grad" not in _mark_types(compute_grad)
    # Its outputs: the gradients, then the residuals (here, the loss).
    grads = _run(compute_grad, args)[:num_grads]
    reference = jax.tree.leaves(jax.grad(ex.loss_fn)(*ex.args))
    for g, r in zip(grads, reference):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    num_residuals = len(compute_grad.jaxpr.outvars) - num_grads
    assert num_residuals == 1  # the loss, returned by the step

    # apply_grad: program inputs, gradients, residuals; SGD is only elementwise work.
    assert len(apply_grad.jaxpr.invars) == len(cj.jaxpr.invars) + num_grads + num_residuals
    assert apply_grad.jaxpr.invars[: len(cj.jaxpr.invars)] == cj.jaxpr.invars
    assert apply_grad.jaxpr.invars[len(cj.jaxpr.invars) :][:num_grads] == marker.outvars
    assert not _mark_types(apply_grad)
    assert {e.primitive.name for e in apply_grad.jaxpr.eqns} <= {"mul", "sub"}


def test_parts_work_with_the_other_passes():
    cj, args = _step_program(examples.mlp(2), "adam")
    compute_grad, apply_grad = split_at_gradient(cj)
    routed = dce(mark_missing_vars(compute_grad))
    check_jaxpr(routed.jaxpr)
    _assert_same((routed, apply_grad), cj, _compose(routed, apply_grad, args), _run(cj, args))


def test_hand_shaped_step_with_bypass_literal_and_constants():
    const_before = np.float32(3.0) * np.ones(2, np.float32)
    const_after = np.linspace(0, 1, 2, dtype=np.float32)

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(x * jnp.sin(w) * const_before))(w)
        (marked, one) = pm.mark_gradient((g, 1.0))
        # The update also reads the unmarked gradient and a value from before the cut.
        return w - 0.1 * marked * one + 0.01 * g * const_after, loss, jnp.cos(w) * x

    args = [np.ones(2, np.float32), np.full(2, 0.5, np.float32)]
    cj = jax.make_jaxpr(step)(*args)
    compute_grad, apply_grad = split_at_gradient(cj)
    check_jaxpr(compute_grad.jaxpr)
    check_jaxpr(apply_grad.jaxpr)
    _assert_same(
        (compute_grad, apply_grad), cj, _compose(compute_grad, apply_grad, args), _run(cj, args)
    )
    # Each constant lives in the part that reads it.
    assert [np.asarray(c).tolist() for c in compute_grad.consts] == [const_before.tolist()]
    assert [np.asarray(c).tolist() for c in apply_grad.consts] == [const_after.tolist()]


def test_unread_gradient_still_gets_an_input():
    def step(w):
        g = jax.grad(lambda w: jnp.sin(w))(w)
        a, _ = pm.mark_gradient((g, 2.0 * g))
        return w - a

    cj = jax.make_jaxpr(step)(1.0)
    compute_grad, apply_grad = split_at_gradient(cj)
    check_jaxpr(apply_grad.jaxpr)
    assert len(apply_grad.jaxpr.invars) == 1 + 2
    _assert_same(
        (compute_grad, apply_grad),
        cj,
        _compose(compute_grad, apply_grad, [np.float32(1.0)]),
        _run(cj, [1.0]),
    )


def test_backward_stage_left_open_by_jax_is_not_a_straddle():
    # The first stage's input is data, so grad makes no end marker for its mirrored
    # backward stage; the gradients are marked after it.
    def step(w, x):
        def loss(w):
            xs = pm.mark(x, name="a", mark_type="start")
            return pm.mark(jnp.sum(jnp.sin(xs * w)), name="a", mark_type="end")

        return w - 0.5 * pm.mark_gradient(jax.grad(loss)(w))

    args = [np.float32(0.3), np.ones(3, np.float32)]
    cj = jax.make_jaxpr(step)(*args)
    assert any(s.implicit_end for s in find_stage_spans(cj))
    compute_grad, apply_grad = split_at_gradient(cj)
    _assert_same(
        (compute_grad, apply_grad), cj, _compose(compute_grad, apply_grad, args), _run(cj, args)
    )


# ------------------------------------------------------------------------------ errors


def test_no_grad_marker():
    cj = examples.mlp(2).trace(grad=True)
    with pytest.raises(MarkerError, match=r"no grad marker.*pm\.mark_gradient\(grads\)"):
        split_at_gradient(cj)


def test_two_grad_markers_are_named():
    def step(w):
        g = pm.mark_gradient(jax.grad(jnp.sin)(w))
        h = pm.mark_gradient(jax.grad(jnp.cos)(w))
        return w - g - h

    cj = jax.make_jaxpr(step)(1.0)
    first, second = (i for i, e in enumerate(cj.jaxpr.eqns) if is_marker(e, "grad"))
    with pytest.raises(
        MarkerError,
        match=rf"equation {second} \(pipeline_marker grad 'grad'.*is a second grad marker; "
        rf"the first is equation {first} .*single pm\.mark_gradient",
    ):
        split_at_gradient(cj)


def test_grad_marker_inside_a_jit_body():
    @jax.jit
    def inner(w):
        return pm.mark_gradient(jax.grad(jnp.sin)(w))

    cj = jax.make_jaxpr(lambda w: w - inner(w))(1.0)
    with pytest.raises(MarkerError, match=r"equation 0 \(\w+.*holds the grad marker inside"):
        split_at_gradient(cj)


def test_grad_marker_inside_a_stage():
    def step(w):
        w = pm.mark(w, name="a", mark_type="start")
        g = pm.mark_gradient(jnp.cos(w))
        return pm.mark(w - g, name="a", mark_type="end")

    cj = jax.make_jaxpr(step)(1.0)
    with pytest.raises(
        MarkerError,
        match=r"equation 2 \(pipeline_marker grad 'grad'.*lies inside stage 'a', which opens at "
        r"equation 0 .*after the stage's end marker",
    ):
        split_at_gradient(cj)


def test_malformed_stage_markers():
    def step(w):
        g = pm.mark_gradient(jnp.cos(w))
        return pm.mark(w - g, name="a", mark_type="end")

    with pytest.raises(MarkerError, match=r"closes stage 'a', but no stage is open"):
        split_at_gradient(jax.make_jaxpr(step)(1.0))


@pytest.mark.skipif(CLOSED_JAXPR_IS_JAXPR, reason="JAX >= 0.11: ClosedJaxpr is Jaxpr")
def test_refuses_a_non_closed_jaxpr():
    cj = jax.make_jaxpr(lambda w: pm.mark_gradient(w))(1.0)
    with pytest.raises(PipemarkError, match=r"takes a jax\.extend\.core\.ClosedJaxpr, got Jaxpr"):
        split_at_gradient(cj.jaxpr)


# ---------------------------------------------------------------- the apply stage


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mark_apply_stage_gives_the_update_a_stage(model, optimizer):
    cj, args = _step_program(MODELS[model](), optimizer)
    before = _snapshot(cj)
    marked = pm.passes.mark_apply_stage(cj)
    assert _snapshot(cj) == before  # pure
    check_jaxpr(marked.jaxpr)
    staged = pm.passes.slice_stages(marked)
    assert staged.stages[-1].name == "apply_grad"
    grad_at = pm.passes.apply_start(cj.jaxpr)
    assert [id(e) for e in staged["apply_grad"].jaxpr.eqns[1:-1]] == [
        id(e) for e in cj.jaxpr.eqns[grad_at:]
    ]
    _assert_same(staged, cj, _run(staged.as_closed_jaxpr(), args), _run(cj, args))
    # Idempotent: the update is in a stage now.
    assert pm.passes.mark_apply_stage(marked) is marked


def test_mark_apply_stage_leaves_programs_without_an_update_alone():
    ex = examples.mlp(2)
    cj = jax.make_jaxpr(jax.value_and_grad(ex.loss_fn))(ex.params, ex.batch)
    assert pm.passes.mark_apply_stage(cj) is cj
    assert pm.passes.apply_start(cj.jaxpr) is None

    def step(w):  # the grad marker is the last equation: nothing to apply
        return pm.mark_gradient(jax.grad(lambda w: jnp.sum(w**2))(w))

    cj = jax.make_jaxpr(step)(jnp.ones(3))
    assert pm.passes.mark_apply_stage(cj) is cj


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_auto_layers_keeps_the_update_out_of_the_backward_stages(optimizer):
    cj, args = _step_program(examples.mlp(4, markers=None), optimizer)
    staged = pm.passes.slice_stages(pm.passes.auto_layers(cj, 2))
    assert [s.name for s in staged.stages] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward", "apply_grad"
    ]  # fmt: skip
    grad_at = pm.passes.apply_start(cj.jaxpr) - 1
    update = {id(e) for e in cj.jaxpr.eqns[grad_at + 1 :]}
    for stage in staged.stages[:-1]:
        assert not update & {id(e) for e in stage.jaxpr.eqns}, stage.name
    _assert_same(staged, cj, _run(staged.as_closed_jaxpr(), args), _run(cj, args))


def test_boundary_marked_step_gets_an_apply_stage():
    ex = examples.mlp(3, markers="boundary")
    step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    args = (ex.params, init_state(ex.params), ex.batch)
    staged = pm.split(step, *args)
    names = [s.name for s in staged.stages]
    assert names[-1] == "apply_grad" and names[-2] == "layer0_backward"
    assert "sqrt" in {e.primitive.name for e in staged["apply_grad"].jaxpr.eqns}
    staged.verify(step, *args)
