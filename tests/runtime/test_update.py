"""Tests of pipemark.runtime.update: a training step's update runs per device slot,
where each stage's parameters live, and equals the step ``jax.jit`` runs; an update that
couples the stages (global-norm clipping) stays one program on the first slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from tests._devices import computing_on
from tests._devices import devices as pick_devices


def _close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _slot_of(x):
    (device,) = x.devices()
    return device


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_slot_updates_its_own_stages_parameters(optimizer):
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=16)
        step, init = examples.train_step(ex.loss_fn, optimizer=optimizer)
        state = init(ex.params)
        want = jax.jit(step)(ex.params, state, ex.batch)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    new_params, new_state, loss = pipelined(ex.params, state, ex.batch)
    _close((new_params, new_state, loss), want)
    # Each new parameter (and its optimizer state) where its stage ran: the plan's
    # own placement of the parameter, not the first slot.
    plan = pipelined.plan(ex.params, state, ex.batch)
    readers = {leaf: w for w, leaves in enumerate(plan.steps.params) for leaf in leaves}
    slots = plan.placement.slots
    for leaf, value in enumerate(jax.tree_util.tree_leaves(new_params)):
        assert _slot_of(value) in slots[readers[leaf]].devices
    assert {_slot_of(v) for v in jax.tree_util.tree_leaves(new_params)} == set(used)
    # A second step from the returned state, which lies on the stages' slots already.
    with computing_on(used):
        want = jax.jit(step)(*want[:2], ex.batch)
    _close(pipelined(new_params, new_state, ex.batch), want)


def test_the_update_per_slot_is_counted_on_each_slot():
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=64, batch=16)
        step, init = examples.train_step(ex.loss_fn, optimizer="adam")
        state = init(ex.params)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    slots = pipelined.memory(ex.params, state, ex.batch).slots
    assert all(s.update for s in slots)  # both slots run a part of the update
    # Adam's part on a slot reads its parameters, gradients and two moments: at least
    # four times the parameters that slot holds.
    assert all(s.update >= 4 * s.parameters for s in slots)


def test_an_update_that_couples_the_stages_stays_on_the_first_slot():
    optax = pytest.importorskip("optax")
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=16)
    optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(ex.loss_fn)(params, batch)
        loss, grads = pm.mark_gradient((loss, grads))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with computing_on(used):
        state = optimizer.init(ex.params)
        want = jax.jit(step)(ex.params, state, ex.batch)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    got = pipelined(ex.params, state, ex.batch)
    _close(got, want)
    plan = pipelined.plan(ex.params, state, ex.batch)
    first = plan.placement.slots[plan.update_worker].devices
    assert all(_slot_of(v) in first for v in jax.tree_util.tree_leaves(got[0]))
    assert jnp.isfinite(got[2])
