"""Tests of pipemark.passes.residuals: each backward stage recomputes the cheap
residuals of its forward from the fewest bytes handed over, and the staged program
still computes what ``jax.value_and_grad`` of the user's function computes."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.cost import nbytes
from pipemark.passes.residuals import recompute_residuals
from pipemark.passes.stages import pair_stages
from tests._programs import BATCH, assert_close, inputs, loss_of, recipes


def _handed_over(staged):
    """Per forward stage, the bytes of its outputs its backward stage reads."""
    forward, backward, _ = pair_stages(staged)
    sizes = []
    for f, b in zip(forward, backward):
        if b is None:
            continue
        outs = staged.stages[f].out_avals
        read = {r.index for r in staged.stages[b].inputs if r.kind == "stage" and r.stage == f}
        sizes.append(sum(nbytes(outs[o]) for o in read))
    return sizes


def _check(staged, lean):
    for stage in lean.stages:
        check_jaxpr(stage.jaxpr)
    check_jaxpr(lean.as_closed_jaxpr().jaxpr)
    assert [s.name for s in lean.stages] == [s.name for s in staged.stages]
    assert [s.role for s in lean.stages] == [s.role for s in staged.stages]
    assert all(a <= b for a, b in zip(_handed_over(lean), _handed_over(staged)))


def _gpt(dtype=jnp.bfloat16):
    return examples.gpt(3, 16, 2, seq=8, batch=2, vocab=32, d_ff=32, compute_dtype=dtype)


@pytest.mark.slow
def test_a_mixed_precision_gpt_hands_over_far_fewer_bytes_and_computes_the_same():
    ex = _gpt()
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args)
    lean = recompute_residuals(staged)
    _check(staged, lean)
    before, after = _handed_over(staged), _handed_over(lean)
    # Every block stage: the bfloat16 weight copies, the causal mask, the GELU's
    # intermediates and the probabilities' second precision are recomputed.
    for b, a in zip(before[1:-1], after[1:-1]):
        assert a < 0.6 * b, (before, after)
    report = lean.verify(fn, *ex.args)
    assert report.passed, report


def test_the_backward_recomputes_casts_of_parameters_from_the_parameters():
    def loss(w, x):
        h = jnp.tanh(x @ w.astype(jnp.bfloat16))
        pm.mark_pipeline_boundary()
        return jnp.sum(h.astype(jnp.float32) ** 2)

    args = jnp.eye(8) * 0.5, jnp.ones((4, 8), jnp.bfloat16)
    fn = jax.value_and_grad(loss, argnums=(0, 1))  # the input's cotangent reads the copy
    staged = pm.split(fn, *args)
    lean = recompute_residuals(staged)
    _check(staged, lean)
    backward = lean.stages[pair_stages(lean)[1][0]]
    # The parameter itself (a program input, which costs nothing to hand over), not its
    # bfloat16 copy; and the convert equation at the backward's start.
    assert pm.staged.ValueRef.input(0) in backward.inputs
    assert backward.jaxpr.eqns[0].primitive.name == "convert_element_type"
    assert lean.verify(fn, *args).passed


def test_what_cannot_be_recomputed_cheaply_is_handed_over():
    # A matmul's result and a reduction are never recomputed: nothing changes.
    def loss(w, x):
        h = x @ w
        s = jnp.sum(h, axis=1, keepdims=True)
        pm.mark_pipeline_boundary()
        return jnp.sum((h * s) @ w)

    args = jnp.eye(8), jnp.ones((4, 8))
    staged = pm.split(jax.value_and_grad(loss), *args)
    lean = recompute_residuals(staged, recomputable=frozenset())
    assert _handed_over(lean) == _handed_over(staged)
    assert lean.verify(jax.value_and_grad(loss), *args).passed


def _handed_over_shapes(staged):
    """The shapes of every forward output its backward stage reads."""
    forward, backward, _ = pair_stages(staged)
    shapes = []
    for f, b in zip(forward, backward):
        if b is not None:
            outs = staged.stages[f].out_avals
            read = {r.index for r in staged.stages[b].inputs if r.kind == "stage" and r.stage == f}
            shapes += [outs[o].shape for o in sorted(read)]
    return shapes


@pytest.mark.parametrize("attention", ["dot_product", "einsum"])
def test_attention_scores_are_recomputed_from_queries_and_keys(attention):
    # jax.nn.dot_product_attention keeps its float32 probabilities (sequence x sequence
    # per head) for the backward; handing them over cost a Llama on a TPU v5e a quarter
    # of its step. Their matrix product (8 x its operands' bytes here) is recomputed.
    seq = 64
    ex = examples.llama(2, 32, 2, seq=seq, batch=2, vocab=32, attention=attention)
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args)
    kept = recompute_residuals(staged, expanding_products=False)
    lean = recompute_residuals(staged)
    _check(staged, lean)
    assert any(shape[-2:] == (seq, seq) for shape in _handed_over_shapes(kept))
    assert not any(shape[-2:] == (seq, seq) for shape in _handed_over_shapes(lean))
    assert sum(_handed_over(lean)) < 0.7 * sum(_handed_over(kept))
    report = lean.verify(fn, *ex.args)
    assert report.passed, report


@pytest.mark.slow
def test_the_input_is_not_changed_and_other_stages_follow_the_new_outputs():
    ex = _gpt(jnp.float32)
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args)
    before = [(s.closed_jaxpr, s.inputs) for s in staged.stages]
    lean = recompute_residuals(staged)
    assert [(s.closed_jaxpr, s.inputs) for s in staged.stages] == before
    assert staged.verify(fn, *ex.args).passed
    # The forward stages still hand the next forward stage the same activation, now at
    # new positions among fewer outputs.
    forward = pair_stages(lean)[0]
    for f, g in itertools.pairwise(forward):
        reads = [r for r in lean.stages[g].inputs if r.kind == "stage" and r.stage == f]
        assert reads and all(r.index < len(lean.stages[f].jaxpr.outvars) for r in reads)
    np.testing.assert_allclose(lean(*ex.args)[0], jax.jit(fn)(*ex.args)[0], rtol=1e-6)


def test_recompute_residuals_refuses_what_is_not_a_staged_program():
    with pytest.raises(pm.PipemarkError, match="takes a StagedJaxpr"):
        recompute_residuals(jax.make_jaxpr(jnp.sin)(1.0))


@settings(max_examples=6, deadline=None)
@given(recipe=recipes(markers=True, differentiable=True), seed=st.integers(0, 3))
def test_random_programs_compute_what_jax_computes(recipe, seed):
    # Programs of real idioms (jitted helpers, activations, custom_jvp/vjp, remat,
    # scan, cond), cut at their markers; the reference is JAX's own value_and_grad.
    loss = loss_of(recipe)
    params, x = inputs(seed)
    fn = jax.value_and_grad(loss)
    staged = pm.split(fn, params, x)
    lean = recompute_residuals(staged)
    _check(staged, lean)
    assert_close(lean(params, x), fn(params, x), "recompute_residuals", recipe)
    assert x.shape[0] == BATCH


def test_a_constant_the_forward_holds_is_handed_over_for_the_recomputation():
    # A table the model closes over (rotary embeddings, say) is a constant of the
    # forward stage: cheaper to hand over than the residuals made from it.
    table = np.linspace(0.5, 1.5, 8).astype(np.float32)

    def loss(w, x):
        h = jnp.tanh(x @ w) * jnp.broadcast_to(table, x.shape)
        pm.mark_pipeline_boundary()
        return jnp.sum(h**2)

    args = jnp.eye(8) * 0.5, jnp.ones((16, 8))
    fn = jax.value_and_grad(loss)
    staged = pm.split(fn, *args)
    lean = recompute_residuals(staged)
    _check(staged, lean)
    assert sum(_handed_over(lean)) < sum(_handed_over(staged))
    assert lean.verify(fn, *args).passed


def test_a_rematerialised_forward_hands_over_only_what_it_received():
    ex = _gpt(jnp.float32)
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args)
    forward, backward, _ = pair_stages(staged)
    names = {staged.stages[f].name for f in forward[1:-1]}  # the block stages
    lean = recompute_residuals(staged, rematerialize=names)
    _check(staged, lean)
    for f, b in zip(forward[1:-1], backward[1:-1]):
        reads = [r for r in lean.stages[b].inputs if r.kind == "stage" and r.stage == f]
        assert reads == []  # its inputs, read where they lie: nothing the forward made
    assert lean.verify(fn, *ex.args).passed
