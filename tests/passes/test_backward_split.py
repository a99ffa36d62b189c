"""pm.passes.split_backward: each backward stage becomes B (activation cotangents) and W
(parameter gradients), bit for bit the same program, no equation computed twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.marks import forward_name, weight_name
from pipemark.primitive import is_marker
from pipemark.roles import BACKWARD, FORWARD, WEIGHT, StageRole
from pipemark.staged import Stage


def _leaves(values):
    return jax.tree_util.tree_leaves(values)


def _count(staged, primitive: str) -> int:
    return sum(e.primitive.name == primitive for s in staged.stages for e in s.jaxpr.eqns)


def _check_split(staged, split, args) -> None:
    """Bit-exact results, no equation copied or lost, W deferrable. Bit for bit
    because the split holds the very equations of the staged program (checked below),
    each evaluated by itself on both sides (tests/_exact.py)."""
    for want, got in zip(_leaves(staged(*args)), _leaves(split(*args)), strict=True):
        assert want.dtype == got.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # Every non-marker equation of the program is in exactly one stage: nothing is
    # computed twice (dot_general among them) and nothing is dropped.
    def computing(program):
        return [id(e) for s in program.stages for e in s.jaxpr.eqns if not is_marker(e)]

    assert sorted(computing(split)) == sorted(computing(staged))
    assert _count(split, "dot_general") == _count(staged, "dot_general")
    # No stage reads what a W stage computes: W can wait until the end.
    names = [s.name for s in split.stages]
    weights = {k for k, n in enumerate(names) if n.endswith("_weight")}
    assert not any(r.kind == "stage" and r.stage in weights for s in split.stages for r in s.inputs)
    for stage in split.stages:
        check_jaxpr(stage.jaxpr)


def test_mlp_backward_stages_split_into_b_and_w():
    ex = examples.mlp(num_layers=3, width=8, batch=4)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    split = pm.passes.split_backward(staged)
    assert [s.name for s in split.stages] == [
        "layer0", "layer1", "layer2",
        "layer2_backward", "layer2_weight",
        "layer1_backward", "layer1_weight",
        "layer0_backward",  # nothing reads its input cotangent: it is all W already
    ]  # fmt: skip
    _check_split(staged, split, ex.args)
    # B computes the cotangent (one dot_general), W the weight gradient (the other).
    b, w = split["layer1_backward"], split["layer1_weight"]
    assert _count_stage(b, "dot_general") == 1 and _count_stage(w, "dot_general") == 1
    assert weight_name("layer1") == "layer1_weight"
    # The halves carry their roles: B and W both belong to their forward stage.
    assert b.role == StageRole(BACKWARD, "layer1") and w.role == StageRole(WEIGHT, "layer1")
    assert [s.role.kind for s in split.stages[:3]] == [FORWARD] * 3
    # W's results are only program results (the gradients).
    w_index = [s.name for s in split.stages].index("layer1_weight")
    results = [r for r in split.outputs if r.kind == "stage" and r.stage == w_index]
    assert len(results) == len(w.jaxpr.outvars) == 2  # kernel and bias gradients


def _count_stage(stage, primitive: str) -> int:
    return sum(e.primitive.name == primitive for e in stage.jaxpr.eqns)


def test_the_demo_transformer_splits_bit_for_bit():
    lm = examples.language_model(
        num_layers=4, vocab=32, d_model=16, num_heads=2, seq=8, batch=4, markers="boundary"
    )
    staged = pm.split(jax.value_and_grad(lm.loss_fn), *lm.args)
    split = pm.passes.split_backward(staged)
    names = [s.name for s in split.stages]
    assert [n for n in names if n.endswith("_weight")] == [
        "layer3_weight",
        "layer2_weight",
        "layer1_weight",
    ]
    _check_split(staged, split, lm.args)
    # The forward stages are kept as they were.
    for name in ("layer0", "layer3"):
        assert split[name].closed_jaxpr is staged[name].closed_jaxpr


def test_a_stage_without_parameters_gets_no_w():
    def loss(params, x):
        for i, w in enumerate(params):
            x, w = pm.mark((x, w), name=f"layer{i}", mark_type="start")
            x = pm.mark(jnp.tanh(x @ w), name=f"layer{i}", mark_type="end")
            # A layer with no parameters of its own.
            x = pm.mark(x, name=f"act{i}", mark_type="start")
            x = pm.mark(jnp.sin(x) * 2.0, name=f"act{i}", mark_type="end")
        return jnp.sum(x**2)

    params = [jnp.eye(4) * 0.5, jnp.eye(4) * 0.25]
    args = (params, jnp.ones((2, 4)))
    staged = pm.split(jax.value_and_grad(loss), *args)
    split = pm.passes.split_backward(staged)
    names = [s.name for s in split.stages]
    assert "act0_weight" not in names and "act1_weight" not in names
    assert "layer1_weight" in names
    assert split["act1_backward"].closed_jaxpr is staged["act1_backward"].closed_jaxpr
    _check_split(staged, split, args)


def test_a_forward_program_is_unchanged():
    ex = examples.mlp(num_layers=2, width=4, batch=2)
    staged = pm.split(ex.loss_fn, *ex.args)
    split = pm.passes.split_backward(staged)
    assert [s.closed_jaxpr for s in split.stages] == [s.closed_jaxpr for s in staged.stages]
    assert not any(forward_name(s.name) for s in split.stages)
    assert {s.role.kind for s in split.stages} == {FORWARD}


def test_split_backward_refuses_what_is_not_a_staged_program():
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(pm.PipemarkError, match="split_backward takes a StagedJaxpr"):
        pm.passes.split_backward(cj)


def test_a_w_name_already_taken_is_refused():
    ex = examples.mlp(num_layers=2, width=4, batch=2)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    first = staged.stages[0]
    taken = weight_name(staged.stages[2].role.owner)  # what layer1_backward's W would be
    stages = [Stage(taken, first.closed_jaxpr, first.inputs), *staged.stages[1:]]
    renamed = pm.StagedJaxpr(stages, staged.invars, staged.outputs)
    with pytest.raises(pm.errors.StageGraphError, match=f"names a W stage '{taken}'.*rename"):
        pm.passes.split_backward(renamed)


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 4),
    width=st.integers(2, 6),
    batch=st.integers(1, 3),
    stages=st.sampled_from([None, 2, 3]),
)
def test_random_mlps_split_bit_for_bit(layers, width, batch, stages):
    # Hand-marked layers, or cut automatically into a number of stages.
    markers = "startend" if stages is None else None
    ex = examples.mlp(num_layers=layers, width=width, batch=batch, markers=markers)
    num_stages = None if stages is None else min(stages, layers)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args, num_stages=num_stages)
    split = pm.passes.split_backward(staged)
    _check_split(staged, split, ex.args)


@jax.custom_vjp
def _watched_layer(x, w):
    return jnp.tanh(x @ w)


def _watched_fwd(x, w):
    y = jnp.tanh(x @ w)
    return y, (x, w, y)


def _watched_bwd(residuals, g):
    x, w, y = residuals
    g = g * (1 - y**2)
    dx = g @ w.T
    jax.debug.callback(lambda value: None, dx)  # an effect reading the input cotangent
    return dx, x.T @ g


_watched_layer.defvjp(_watched_fwd, _watched_bwd)


def test_an_effect_stays_in_b_with_what_it_reads():
    # In the first layer nothing reads the input cotangent but the effect: it and the
    # cotangent stay in B, and W (the weight gradient) must not take the start marker's
    # result they share from under it.
    def loss(params, x):
        for i, w in enumerate(params):
            x, w = pm.mark((x, w), name=f"layer{i}", mark_type="start")
            x = pm.mark(_watched_layer(x, w), name=f"layer{i}", mark_type="end")
        return jnp.sum(x**2)

    args = ([jnp.eye(4) * 0.5, jnp.eye(4) * 0.25], jnp.ones((2, 4)))
    staged = pm.split(jax.value_and_grad(loss), *args)
    split = pm.passes.split_backward(staged)
    assert "layer0_weight" in [s.name for s in split.stages]
    b = split["layer0_backward"]
    assert any(e.effects for e in b.jaxpr.eqns)
    _check_split(staged, split, args)
