"""pipemark.runtime.training.layouts: which values of a training step's update take a
parameter's spec (tied to it elementwise, at one shape) and which do not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark.passes.inline import inline_calls
from pipemark.runtime.training.layouts import step_layouts, update_layouts

ROWS = P("data", None)


def _layouts(fn, *args, known):
    return update_layouts(jax.make_jaxpr(fn)(*args).jaxpr, known)


def test_a_square_matrix_transposed_or_multiplied_is_not_tied():
    w = jnp.ones((4, 4))
    inputs, outputs = _layouts(lambda w, v: (w.T + v, w @ v, v * 2), w, w, known={0: ROWS})
    assert inputs == [ROWS, None] and outputs == [None, None, None]


def test_two_parameters_of_different_specs_tie_nothing_together():
    w = jnp.ones((4, 4))
    inputs, outputs = _layouts(
        lambda a, b, m: (a + m, b + m), w, w, w, known={0: ROWS, 1: P(None, "model")}
    )
    assert inputs == [ROWS, P(None, "model"), None] and outputs == [None, None]


def test_adamw_moments_and_gradients_take_their_parameters_spec():
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params = {"w": jnp.ones((4, 2)), "b": jnp.ones((2,))}

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"])))(params)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    args = (params, tx.init(params), jnp.ones((3, 4)))
    # As pipeline_train_step traces a step: its calls inlined (optax jits some).
    compute, apply = pm.passes.split_at_gradient(inline_calls(jax.make_jaxpr(step)(*args)))
    leaves = jax.tree_util.tree_leaves(args[:2])
    specs = [ROWS if leaf.shape == (4, 2) else P() for leaf in leaves[:2]] + [P()] * 5
    layouts = step_layouts(compute, apply, specs, num_args=len(leaves) + 1)
    # (b, w), then adamw's count, mu (b, w), nu (b, w): w's moments sharded like w.
    assert layouts.state == [P(), ROWS, P(), P(), ROWS, P(), ROWS]
    assert layouts.results == [P(), ROWS]  # the gradients of b and w
