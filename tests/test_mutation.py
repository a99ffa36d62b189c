"""call_watching_arguments: a traced function that changes its arguments in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import pipemark as pm
from pipemark.mutation import call_watching_arguments


def _trace(fn, *args):
    return jax.make_jaxpr(lambda *a: call_watching_arguments(fn, a))(*args)


def test_an_update_assigned_into_an_argument_and_dropped_is_refused():
    def step(state, x):
        state["w"] = state["w"] - 0.1 * x
        state["extra"] = x  # a new key changes the structure
        return jnp.sum(x)

    def step_in_place(state, x):
        state["w"] = state["w"] - 0.1 * x
        return jnp.sum(x)

    with pytest.raises(pm.errors.StateMutationError, match="the structure of the arguments"):
        _trace(step, {"w": jnp.ones(2)}, jnp.ones(2))
    with pytest.raises(
        pm.errors.StateMutationError, match=r"args\[0\]\['w'\]\. .*return a new dict"
    ):
        _trace(step_in_place, {"w": jnp.ones(2)}, jnp.ones(2))
    # pm.split traces through the same check; the user's dict is left as it was.
    w = jnp.ones(2)
    state = {"w": w}
    with pytest.raises(pm.errors.StateMutationError):
        pm.split(step_in_place, state, jnp.ones(2))
    assert state == {"w": w} and state["w"] is w


def test_an_update_written_in_place_and_returned_is_accepted():
    def step(state, x):
        state["w"] = state["w"] - 0.1 * x
        return state, jnp.sum(x)

    cj = _trace(step, {"w": jnp.ones(2)}, jnp.ones(2))
    got = jaxpr_as_fun(cj)(jnp.ones(2), jnp.ones(2))
    np.testing.assert_allclose(got[0], jax.jit(step)({"w": jnp.ones(2)}, jnp.ones(2))[0]["w"])


def test_an_nnx_dropout_counter_advanced_in_a_loss_is_not_refused():
    # jax.jit drops the RNG count alike; refusing it would refuse every loss with dropout.
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 3, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    graphdef, params, rest = nnx.split(Model(nnx.Rngs(0)), nnx.Param, ...)

    def loss(params, rest, x):
        return jnp.mean(nnx.merge(graphdef, params, rest)(x) ** 2)

    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    staged = pm.split(loss, params, rest, x, num_stages=2)
    np.testing.assert_allclose(
        staged(params, rest, x)[0], jax.jit(loss)(params, rest, x), rtol=1e-5
    )
