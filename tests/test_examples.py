"""Tests for pipemark.examples: the model zoo used by tests, benchmarks and docs."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from pipemark.primitive import is_marker
from tests._trees import assert_trees_within_ulps


def _markers(cj):
    return [
        (e.params["mark_type"], e.params["name"], len(e.invars))
        for e in cj.jaxpr.eqns
        if e.primitive is pm.pipeline_p
    ]


def _builders():
    return {
        "mlp": lambda markers: examples.mlp(num_layers=4, markers=markers),
        "resnet": lambda markers: examples.resnet(num_blocks=5, skip=3, markers=markers),
        "resnet_bypass": lambda markers: examples.resnet(
            num_blocks=5, skip=3, markers=markers, route_skips=False
        ),
        "transformer": lambda markers: examples.transformer(num_layers=2, markers=markers),
    }


@pytest.mark.parametrize("kind", sorted(_builders()))
@pytest.mark.parametrize("markers", ["startend", "boundary"])
def test_markers_do_not_change_loss_or_gradients(kind, markers):
    build = _builders()[kind]
    marked, plain = build(markers), build(None)
    # Eager, with and without markers: the same operations one by one (the models are
    # Python loops, no marker inside a jit or a loop), so the same bits.
    assert np.array_equal(marked.loss_fn(*marked.args), plain.loss_fn(*plain.args))
    value_marked, grads_marked = jax.value_and_grad(marked.loss_fn)(*marked.args)
    value_plain, grads_plain = jax.value_and_grad(plain.loss_fn)(*plain.args)
    assert np.array_equal(value_marked, value_plain)
    for a, b in zip(jax.tree.leaves(grads_marked), jax.tree.leaves(grads_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(_builders()))
def test_unmarked_programs_have_no_markers(kind):
    ex = _builders()[kind](None)
    for grad in (False, True):
        assert pm.pipeline_p not in {e.primitive for e in ex.trace(grad).jaxpr.eqns}


@pytest.mark.parametrize("kind", sorted(_builders()))
def test_startend_pairs_and_mirrored_backward_markers(kind):
    ex = _builders()[kind]("startend")
    num_layers = len(ex.params)
    prefix = "layer" if kind == "mlp" else "block"
    forward = _markers(ex.trace())
    expected = []
    for i in range(num_layers):
        expected += [("start", f"{prefix}{i}"), ("end", f"{prefix}{i}")]
    assert [(t, n) for t, n, _ in forward] == expected

    backward = _markers(ex.trace(grad=True))
    assert backward[: len(forward)] == forward
    mirrored = [(t, n) for t, n, _ in backward[len(forward) :]]
    assert mirrored == [
        (t, f"{prefix}{i}_backward") for i in reversed(range(num_layers)) for t in ("start", "end")
    ]
    # Every parameter of a layer went through its start marker, so the mirrored end
    # marker carries one cotangent per parameter (plus the activation's, except for
    # the first layer, whose input is data and gets no cotangent).
    ends = {n: k for t, n, k in backward if t == "end" and n.endswith("_backward")}
    for i, layer_params in enumerate(ex.params):
        num_params = len(jax.tree.leaves(layer_params))
        starts = {n: k for t, n, k in forward if t == "start"}
        carried = starts[f"{prefix}{i}"]
        expected_cotangents = carried if i > 0 else carried - 1
        assert ends[f"{prefix}{i}_backward"] == expected_cotangents
        assert carried >= num_params + 1


def test_boundary_markers_sit_between_layers():
    ex = examples.mlp(num_layers=4, markers="boundary")
    cj = ex.trace()
    kinds = [t for t, _, _ in _markers(cj)]
    assert kinds == ["boundary"] * 3
    assert all(k == 0 for _, _, k in _markers(cj))


def test_resnet_skip_goes_through_the_start_marker_only_when_routed():
    def stage_reads(route_skips):
        cj = examples.resnet(num_blocks=4, skip=3, route_skips=route_skips).trace()
        eqns = cj.jaxpr.eqns
        block0_end = next(e for e in eqns if is_marker(e, "end") and e.params["name"] == "block0")
        skipped = block0_end.outvars[0]
        readers = [
            (e.primitive.name, e.params.get("mark_type"), e.params.get("name"))
            for e in eqns
            if any(v is skipped for v in e.invars)
        ]
        return readers

    routed = stage_reads(True)
    assert ("pipeline_marker", "start", "block3") in routed
    bypass = stage_reads(False)
    assert ("pipeline_marker", "start", "block3") not in bypass
    assert ("add", None, None) in bypass  # block 3 adds block 0's output directly


def test_same_seed_same_params_other_seed_other_params():
    a = examples.transformer(num_layers=1, seed=3)
    b = examples.transformer(num_layers=1, seed=3)
    c = examples.transformer(num_layers=1, seed=4)
    for x, y in zip(jax.tree.leaves(a.args), jax.tree.leaves(b.args)):
        assert np.array_equal(x, y)
    assert not np.array_equal(a.params[0]["wq"], c.params[0]["wq"])


def test_example_unpacks_and_trace_is_fresh():
    loss_fn, params, batch = ex = examples.mlp(num_layers=2)
    assert ex.args == (params, batch)
    assert str(ex.trace()) == str(jax.make_jaxpr(loss_fn)(params, batch))
    assert ex.trace() is not ex.trace()


def test_models_are_flat_python_loops():
    # No nested call hides equations: the equation count must scale with layers.
    for ex in (examples.mlp(3), examples.transformer(2), examples.resnet(4)):
        prims = Counter(e.primitive.name for e in ex.trace(grad=True).jaxpr.eqns)
        assert not {"pjit", "jit", "scan", "custom_jvp_call", "closed_call"} & set(prims)


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
@pytest.mark.parametrize("target", [600, 3000])
def test_sized_hits_the_equation_count(kind, target):
    ex = examples.sized(kind, target)
    count = len(ex.trace(grad=True).jaxpr.eqns)
    per_layer = len(examples.sized(kind, target * 2).trace(grad=True).jaxpr.eqns) - count
    per_layer /= max(1, len(examples.sized(kind, target * 2).params) - len(ex.params))
    assert abs(count - target) <= per_layer


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_train_step_marks_gradients_once(optimizer):
    ex = examples.mlp(num_layers=3)
    step, init_state = examples.train_step(ex.loss_fn, optimizer=optimizer)
    state = init_state(ex.params)
    cj = jax.make_jaxpr(step)(ex.params, state, ex.batch)
    grads = [e for e in cj.jaxpr.eqns if is_marker(e, "grad")]
    assert len(grads) == 1
    assert len(grads[0].invars) == len(jax.tree.leaves(ex.params))
    new_params, _, loss = step(ex.params, state, ex.batch)
    assert float(ex.loss_fn(new_params, ex.batch)) < float(loss)


def test_sgd_step_is_plain_sgd():
    ex = examples.mlp(num_layers=2)
    step, init_state = examples.train_step(ex.loss_fn, learning_rate=0.5)
    new_params, state, _ = step(ex.params, init_state(ex.params), ex.batch)
    grads = jax.grad(ex.loss_fn)(*ex.args)
    assert state == ()
    for p, g, q in zip(*(jax.tree.leaves(t) for t in (ex.params, grads, new_params))):
        np.testing.assert_allclose(q, p - 0.5 * g, rtol=1e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: examples.mlp(markers="pairs"), "Unknown markers style 'pairs'"),
        (lambda: examples.mlp(num_layers=0), "num_layers must be a positive int"),
        (lambda: examples.resnet(skip=0), "skip must be a positive int"),
        (lambda: examples.transformer(d_model=10, num_heads=4), "multiple of num_heads"),
        (lambda: examples.gpt(d_model=10, num_heads=4), "multiple of num_heads"),
        (lambda: examples.gpt(d_ff=0), "d_ff must be a positive int"),
        (lambda: examples.sized("cnn", 100), "Unknown model kind 'cnn'"),
        (lambda: examples.sized("mlp", -1), "num_eqns must be a positive int"),
        (lambda: examples.train_step(lambda p, b: 0.0, optimizer="lamb"), "'lamb'"),
    ],
)
def test_bad_arguments_raise_pipemark_errors(call, message):
    with pytest.raises(PipemarkError, match=message):
        call()


def _gpt(num_layers=2, **options):
    return examples.gpt(num_layers, d_model=16, num_heads=2, seq=8, batch=2, vocab=32, **options)


def test_gpt_keeps_float32_parameters_and_multiplies_in_bfloat16():
    ex = _gpt(num_layers=1)
    dots = [e for e in ex.trace(grad=True).jaxpr.eqns if e.primitive.name == "dot_general"]
    # Forward: 4 projections, 2 attention matmuls, 2 of the MLP, the output projection;
    # the backward has two for each (both operands need a cotangent).
    assert len(dots) == 3 * 9
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    loss, grads = jax.eval_shape(jax.value_and_grad(ex.loss_fn), *ex.args)
    assert loss.dtype == jnp.float32
    float32 = {np.dtype(np.float32)}
    assert {x.dtype for x in jax.tree.leaves((ex.params, grads))} == float32
    # The same model in float32 (JAX's own evaluation, no casts): close, not equal.
    exact = _gpt(num_layers=1, compute_dtype=jnp.float32)
    casts = [e for e in exact.trace().jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert all(e.params["new_dtype"] != jnp.bfloat16 for e in casts)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(exact.loss_fn)(*exact.args)
    got = jax.jit(ex.loss_fn)(*ex.args)
    assert got != want
    np.testing.assert_allclose(got, want, rtol=2e-2)


def test_gpt_markers_sit_between_blocks_and_do_not_change_the_loss():
    # The layout is language_model's (one loss function for both), whose gradients with
    # markers tests/test_language_model.py compares: here the forward, compiled once each.
    marked, plain = _gpt(markers="boundary"), _gpt(markers=None)
    assert [t for t, _, _ in _markers(marked.trace())] == ["boundary"]
    assert [t for t, _, _ in _markers(_gpt(markers="startend").trace())] == ["start", "end"] * 2
    assert not _markers(plain.trace())
    # Compiled with and without the markers' barriers: two programs, whose float32
    # loss may round apart (tests/_exact.py); bfloat16 matmuls feed it, but the same
    # ones on both sides, so only the last reductions may differ.
    assert_trees_within_ulps(
        jax.jit(marked.loss_fn)(*marked.args), jax.jit(plain.loss_fn)(*plain.args)
    )


def test_gpt_attention_is_causal():
    block = _gpt(num_layers=1).params["blocks"][0]
    attend = jax.jit(lambda h: examples._gpt_attention(h, block, 2, jnp.bfloat16))
    h = jax.random.normal(jax.random.key(1), (2, 8, 16), jnp.bfloat16)
    later = h.at[:, 5:].add(1.0)  # change the tokens after position 4
    out, changed = attend(h), attend(later)
    assert np.array_equal(out[:, :5], changed[:, :5])
    assert not np.array_equal(out[:, 5:], changed[:, 5:])
