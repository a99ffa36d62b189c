"""pm.split on models as users write them: keyword and static arguments, non-array
leaves (equinox), flax linen and nnx, optax training steps with a gradient marker."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.signature import SignatureError
from tests._trees import assert_trees_within_ulps

optax = pytest.importorskip("optax")


def _names(staged):
    return [s.name for s in staged.stages]


# ------------------------------------------------------------------ signatures


def _scaled(x, w, *, scale, mode="tanh"):
    x = getattr(jnp, mode)(x @ w) * scale
    pm.mark_pipeline_boundary()
    return jnp.sum(jnp.sin(x @ w))


def test_keyword_arguments_are_traced_and_called_by_name():
    x, w = jnp.ones((2, 4)), jnp.eye(4) * 0.5
    staged = pm.split(_scaled, x, w, scale=2.0)
    assert _names(staged) == ["layer0", "layer1"]
    assert staged.input_names == ("x", "w", "scale")
    staged.verify(_scaled, x, w, scale=2.0)
    (out,) = staged(x, w, scale=3.0)
    assert out == _scaled(x, w, scale=3.0)


def test_static_argnames_and_argnums_hold_arguments_static():
    x, w = jnp.ones((2, 4)), jnp.eye(4) * 0.5
    staged = pm.split(_scaled, x, w, scale=2.0, mode="sin", static_argnames="mode")
    assert len(staged.invars) == 3
    assert "sin" in {e.primitive.name for s in staged.stages for e in s.jaxpr.eqns}
    staged.verify(_scaled, x, w, scale=2.0, mode="sin")
    with pytest.raises(SignatureError, match="static 'mode' was 'sin'"):
        staged(x, w, scale=2.0, mode="cos")

    def by_position(x, w, depth):
        for _ in range(depth):
            x = jnp.tanh(x @ w)
            pm.mark_pipeline_boundary()
        return jnp.sum(x)

    staged = pm.split(by_position, x, w, 3, static_argnums=2)
    assert _names(staged) == ["layer0", "layer1", "layer2", "layer3"]
    staged.verify(by_position, x, w, 3)


def test_split_keyword_of_the_same_name_goes_through_partial():
    def f(x, num_stages):
        x = jnp.sin(x)
        pm.mark_pipeline_boundary()
        return x * num_stages

    staged = pm.split(functools.partial(f, num_stages=3.0), jnp.ones(2))
    assert _names(staged) == ["layer0", "layer1"]
    # sin of a vector and of a scalar are two programs (tests/_exact.py).
    assert_trees_within_ulps(staged(jnp.ones(2))[0], jnp.full(2, 3.0) * jnp.sin(1.0))


def test_a_call_with_another_structure_names_both():
    ex = examples.mlp(num_layers=2)
    params = {"layers": ex.params}
    fn = lambda p, batch: ex.loss_fn(p["layers"], batch)  # noqa: E731
    staged = pm.split(fn, params, ex.batch)
    renamed = {"blocks": ex.params}
    with pytest.raises(SignatureError) as info:
        staged(renamed, ex.batch)
    assert "traced with: ({'layers':" in str(info.value)
    assert "called with: ({'blocks':" in str(info.value)
    # the flat inputs stay accepted
    flat = jax.tree_util.tree_leaves((params, ex.batch))
    np.testing.assert_array_equal(staged(*flat)[0], staged(params, ex.batch)[0])


def test_input_names_are_pytree_paths():
    ex = examples.mlp(num_layers=2)
    staged = pm.split(ex.loss_fn, ex.params, ex.batch)
    assert len(staged.input_names) == len(staged.invars)
    assert staged.input_names[0].startswith(f"{ex.loss_fn.__code__.co_varnames[0]}[0]")


# ------------------------------------------------------------------ equinox


def _eqx_model():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, 3, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
    y = jnp.zeros((6, 2))
    return eqx, model, x, y


def _eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def test_equinox_module_with_function_leaves_splits_and_verifies():
    eqx, model, x, y = _eqx_model()
    vag = eqx.filter_value_and_grad(_eqx_loss)
    staged = pm.split(vag, model, x, y, num_stages=2)
    assert _names(staged) == ["layer0", "layer1", "layer1_backward", "layer0_backward"]
    staged.verify(vag, model, x, y)
    assert staged.input_names[0] == "model.layers[0].weight"
    loss, grads = vag(model, x, y)
    got = staged(model, x, y)
    # Eager value_and_grad and the staged program's equations evaluated one by one are
    # two programs: the loss's mean rounds its last bit differently on JAX 0.12, and
    # the gradients' sums may too (tests/_exact.py).
    want = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
    assert_trees_within_ulps(got, [loss, *want])
    pm.show(staged)  # the HTML view takes it too


def test_equinox_changed_activation_is_refused():
    eqx, model, x, y = _eqx_model()
    staged = pm.split(_eqx_loss, model, x, y, num_stages=2)
    other = eqx.tree_at(lambda m: m.activation, model, jax.nn.gelu)
    with pytest.raises(SignatureError, match="activation is a static"):
        staged(other, x, y)


def test_differentiating_non_array_leaves_gets_a_hint():
    _, model, x, y = _eqx_model()
    with pytest.raises(pm.PipemarkError, match="filter_value_and_grad"):
        pm.split(jax.value_and_grad(_eqx_loss), model, x, y)


def test_equinox_optax_step_puts_the_update_in_its_own_stage():
    eqx, model, x, y = _eqx_model()
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, y)
        grads = pm.mark_gradient(grads)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    staged = pm.split(step, model, state, x, y, num_stages=2)
    assert _names(staged) == [
        "layer0", "layer1", "layer1_backward", "layer0_backward", "apply_grad"
    ]  # fmt: skip
    apply = staged["apply_grad"]
    backward = staged["layer0_backward"]
    assert not any(e.primitive is pm.pipeline_p and e.params["mark_type"] == "grad"
                   for e in apply.jaxpr.eqns)  # fmt: skip
    assert "sqrt" in {e.primitive.name for e in apply.jaxpr.eqns}  # adam's update
    assert "sqrt" not in {e.primitive.name for e in backward.jaxpr.eqns}
    staged.verify(step, model, state, x, y)


# ------------------------------------------------------------------ flax


def test_flax_linen_jit_free_train_step_with_hand_markers():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.Dense(8)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = Block(name=f"Block_{i}")(x)
                if i < 2:
                    pm.mark_pipeline_boundary()
            return nn.Dense(1)(x)

    model = Model()
    x = jnp.ones((4, 8))
    params = model.init(jax.random.PRNGKey(0), x)
    opt = optax.sgd(0.1)
    state = opt.init(params)

    def step(params, state, x):
        def loss(p):
            return jnp.mean(model.apply(p, x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        grads = pm.mark_gradient(grads)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    staged = pm.split(step, params, state, x)
    assert _names(staged) == [
        "layer0", "layer1", "layer2",
        "layer2_backward", "layer1_backward", "layer0_backward", "apply_grad",
    ]  # fmt: skip
    assert "params['params']['Block_0']['Dense_0']['kernel']" in staged.input_names
    staged.verify(step, params, state, x)


def test_flax_nnx_model_splits_with_keyword_arguments():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])

        def __call__(self, x, *, scale):
            for layer in self.layers:
                x = jax.nn.relu(layer(x)) * scale
            return x

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, x, *, scale):
        return jnp.mean(nnx.merge(graphdef, state)(x, scale=scale) ** 2)

    x = jnp.ones((4, 8))
    vag = jax.value_and_grad(loss)
    staged = pm.split(vag, state, x, scale=0.5, num_stages=2)
    assert _names(staged) == ["layer0", "layer1", "layer1_backward", "layer0_backward"]
    staged.verify(vag, state, x, scale=0.5)
