"""The runtime takes losses as users write them: loss(params, *batch), params with
non-array leaves (equinox), and masked or weighted means (loss_reduction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark.errors import PipemarkError
from pipemark.runtime.arguments import batch_arg_names, partition_params
from tests._devices import devices


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _pipeline(loss, **options):
    options = {"num_stages": 2, "num_microbatches": 2, "schedule": "interleaved", **options}
    return pm.pipeline_value_and_grad(loss, devices=devices(1), **options)


def _mlp_params(widths=(8, 16, 16, 4), seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(widths))
    return [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, widths[:-1], widths[1:])
    ]


def _forward(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return x


def test_several_batch_arguments():
    def loss(params, x, y):
        return jnp.mean((_forward(params, x) - y) ** 2)

    params = _mlp_params()
    x, y = jax.random.normal(jax.random.PRNGKey(1), (8, 8)), jnp.ones((8, 4))
    got = _pipeline(loss)(params, x, y)
    _assert_close(got, jax.value_and_grad(loss)(params, x, y))


def test_batch_argument_errors_name_the_argument():
    def loss(params, x, y):
        return jnp.mean((_forward(params, x) - y) ** 2)

    params, x = _mlp_params(), jnp.ones((8, 8))
    with pytest.raises(
        PipemarkError, match=r"batch argument 0 \(x\) has 8 rows, batch argument 1 \(y\) has 6"
    ):
        _pipeline(loss)(params, x, jnp.ones((6, 4)))
    with pytest.raises(PipemarkError, match=r"batch argument 1 \(y\) holds a scalar"):
        _pipeline(loss)(params, x, jnp.float32(1.0))
    with pytest.raises(
        PipemarkError, match=r"batch argument 0 \(x\) has 6 rows, which do not split into 4"
    ):
        _pipeline(loss, num_microbatches=4)(params, jnp.ones((6, 8)), jnp.ones((6, 4)))
    assert batch_arg_names(lambda p, *b: 0, 2) == ["batch argument 0", "batch argument 1"]


def test_equinox_module_with_function_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(8, 4, 16, 3, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 8))
    y = jnp.ones((8, 4))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    value, grads = _pipeline(loss)(model, x, y)
    want_value, want_grads = eqx.filter_value_and_grad(loss)(model, x, y)
    _assert_close(value, want_value)
    # Gradients have the module's structure, None at the function leaves.
    _assert_close(grads, want_grads)
    assert grads.activation is None


def _dropout_loss(params, batch):
    x, keys = batch  # a typed key per row
    h = jnp.tanh(x @ params[0])
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, h.shape[1:]))(keys)
    h = jnp.where(keep, h / 0.9, 0.0)
    pm.mark_pipeline_boundary()
    return jnp.mean((h @ params[1]) ** 2)


def test_typed_keys_in_the_batch_split_with_the_rows():
    params = [jnp.full((3, 4), 0.1), jnp.linspace(-1, 1, 12).reshape(4, 3)]
    batch = (jnp.ones((8, 3)), jax.random.split(jax.random.key(0), 8))
    value, grads = _pipeline(_dropout_loss, num_microbatches=4)(params, batch)
    want = jax.value_and_grad(_dropout_loss)(params, batch)
    _assert_close((value, grads), want)
    optax = pytest.importorskip("optax")
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_dropout_loss)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = (params, tx.init(params))
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=devices(2))
    _assert_close(pipelined(*state, batch), jax.jit(step)(*state, batch))


def test_a_key_split_before_the_grad_marker_is_refused_by_name():
    optax = pytest.importorskip("optax")
    tx = optax.sgd(0.1)

    def step(params, opt_state, rng, x):
        rng, sub = jax.random.split(rng)  # before the marker: a value for the update
        keys = jax.random.split(sub, x.shape[0])
        loss, grads = jax.value_and_grad(_dropout_loss)(params, (x, keys))
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rng, loss

    params = [jnp.full((3, 4), 0.1), jnp.full((4, 3), 0.1)]
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=devices(2))
    with pytest.raises(PipemarkError, match=r"is a key<fry> \(a random key.*Split the key after"):
        pipelined(params, tx.init(params), jax.random.key(1), jnp.ones((8, 3)))


def test_partition_keeps_arrays_and_statics_apart():
    part = partition_params({"w": jnp.ones(2), "act": jnp.tanh, "n": 3})
    assert part.dynamic == {"w": part.dynamic["w"], "act": None, "n": None}
    full = part.combine(part.dynamic)
    assert full["act"] is jnp.tanh and full["n"] == 3
    other = partition_params({"w": jnp.ones(2), "act": jnp.sin, "n": 3})
    assert other.key != part.key


def _masked_lm():
    vocab, width, seq = 11, 16, 6
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "embed": jax.random.normal(keys[0], (vocab, width)) * 0.3,
        "hidden": _mlp_params((width, width, width), seed=1),
        "out": jax.random.normal(keys[1], (width, vocab)) * 0.3,
    }
    tokens = jax.random.randint(keys[2], (8, seq), 0, vocab)
    # The last two sequences are all padding: with 4 microbatches one is empty.
    mask = jnp.concatenate([jnp.ones((6, seq)), jnp.zeros((2, seq))]).at[0, 3:].set(0)

    def token_losses(params, tokens):
        h = _forward(params["hidden"], params["embed"][tokens[:, :-1]])
        logits = h @ params["out"]
        picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    return params, tokens, mask, token_losses


@pytest.mark.slow
def test_masked_mean_with_sum_over_count_equals_the_unsplit_mean():
    params, tokens, mask, token_losses = _masked_lm()

    def mean_loss(params, tokens, mask):
        m = mask[:, 1:]
        return jnp.sum(token_losses(params, tokens) * m) / jnp.sum(m)

    def sum_and_count(params, tokens, mask):
        m = mask[:, 1:]
        return jnp.sum(token_losses(params, tokens) * m), jnp.sum(m)

    pipeline = _pipeline(sum_and_count, num_microbatches=4, loss_reduction="sum_over_count")
    value, grads = pipeline(params, tokens, mask)
    assert np.isfinite(value)
    _assert_close((value, grads), jax.value_and_grad(mean_loss)(params, tokens, mask))


def test_a_masked_mean_with_the_mean_reduction_is_refused():
    params, tokens, mask, token_losses = _masked_lm()

    def mean_loss(params, tokens, mask):
        m = mask[:, 1:]
        return jnp.sum(token_losses(params, tokens) * m) / jnp.sum(m)

    with pytest.raises(
        PipemarkError,
        match=r"divides by a count computed from the batch at equation \d+ \(div.*sum_over_count",
    ):
        _pipeline(mean_loss, num_microbatches=4)(params, tokens, mask)


def test_sum_over_count_needs_a_pair():
    params = _mlp_params()

    def loss(params, x):
        return jnp.mean(_forward(params, x) ** 2)

    with pytest.raises(PipemarkError, match=r"needs loss_fn to return \(sum, count\)"):
        _pipeline(loss, loss_reduction="sum_over_count")(params, jnp.ones((4, 8)))


def test_flax_linen_loss_with_inputs_and_targets():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.tanh(nn.Dense(16)(x))
            return nn.Dense(2)(x)

    model = Model()
    x, y = jnp.ones((8, 8)), jnp.zeros((8, 2))
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    _assert_close(_pipeline(loss)(params, x, y), jax.value_and_grad(loss)(params, x, y))


def test_scanned_model_splits_in_the_runtime():
    from pipemark import examples

    ex = examples.scanned_transformer(num_layers=4, batch=4)
    value, grads = _pipeline(ex.loss_fn, num_stages=2)(*ex.args)
    _assert_close((value, grads), jax.value_and_grad(ex.loss_fn)(*ex.args), rtol=1e-4, atol=1e-5)
    plan = _pipeline(ex.loss_fn, num_stages=2).plan(*ex.args)
    lengths = [
        [e.params["length"] for e in s.jaxpr.eqns if e.primitive.name == "scan"]
        for s in plan.staged.stages
    ]
    assert lengths == [[2], [2], [2], [2]]
