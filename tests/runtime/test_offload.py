"""Tests of pipemark.runtime.training.offload: ``pipeline_train_step(...,
offload="optimizer")`` keeps the optimizer state in host memory between steps and
equals ``jax.jit`` of the same optax step; ``step.memory`` counts that state in host
memory, not on the device; what cannot be offloaded is refused, naming what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark.errors import HostMemoryError
from pipemark.runtime.training.offload import host_memory_kind
from tests._devices import computing_on
from tests._devices import devices as pick_devices

optax = pytest.importorskip("optax")

WIDTH = 16


def _loss(params, batch):
    """An MLP whose layers are the stages (a boundary after each but the last)."""
    x, y = batch
    for k, (w, b) in enumerate(params):
        x = jnp.tanh(x @ w + b)
        if k < len(params) - 1:
            pm.mark_pipeline_boundary()
    return jnp.mean((x - y) ** 2)


def _setup(num_layers=2):
    rng = np.random.default_rng(0)
    params = [
        (
            jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / WIDTH**0.5, jnp.float32),
            jnp.asarray(rng.normal(size=WIDTH) * 0.1, jnp.float32),
        )
        for _ in range(num_layers)
    ]
    x = jnp.asarray(rng.normal(size=(8, WIDTH)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, WIDTH)), jnp.float32)
    return params, (x, y)


def _step(optimizer):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        grads = pm.mark_gradient(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(tree)}


@pytest.mark.parametrize("donate", [False, True])
def test_optimizer_state_waits_in_host_memory_and_equals_jit(donate):
    devices = pick_devices(2)
    with computing_on(devices):
        params, batch = _setup()
        optimizer = optax.adamw(1e-2, eps=1e-4)
        step = _step(optimizer)
        state = optimizer.init(params)
        pipelined = pm.pipeline_train_step(
            step,
            num_stages=2,
            num_microbatches=2,
            devices=devices,
            donate=donate,
            offload="optimizer",
        )
        ref = jax.jit(step)
        # The reference's own copies: a donating step deletes the arrays passed in.
        want_params, want_state = jax.tree_util.tree_map(jnp.copy, (params, state))
        for _ in range(3):
            passed = state
            params, state, loss = pipelined(params, state, batch)
            want_params, want_state, want_loss = ref(want_params, want_state, batch)
            # Between steps the moments lie in host memory, the parameters on their
            # devices; so does Adam's step count, which both stages' parts read.
            moments = [x for x in jax.tree_util.tree_leaves(state) if x.ndim]
            assert _kinds(moments) == {"pinned_host"} and len(moments) == 8
            assert _kinds(params) == {"device"}
            if donate:  # the host arrays passed in are gone, as jit's donation would
                assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(passed) if x.ndim)
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        got = jax.tree_util.tree_leaves((params, state))
        want = jax.tree_util.tree_leaves((want_params, want_state))
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_memory_counts_the_offloaded_state_in_host_memory():
    devices = pick_devices(2)
    with computing_on(devices):
        params, batch = _setup()
        optimizer = optax.adam(1e-2)
        step = _step(optimizer)
        state = optimizer.init(params)
        options = dict(num_stages=2, num_microbatches=2, devices=devices)
        plain = pm.pipeline_train_step(step, **options).memory(params, state, batch)
        offloaded = pm.pipeline_train_step(step, **options, offload="optimizer")
        memory = offloaded.memory(params, state, batch)
    layer = (WIDTH * WIDTH + WIDTH) * 4  # one stage's parameters, float32
    for on, off in zip(plain.slots, memory.slots):
        # Both moments (2 layer) are the slot's in host memory, old and new at once.
        assert (off.host, on.host) == (4 * layer, 0)
        assert off.predicted_peak <= on.predicted_peak
    # The state was made on the first device: there it no longer counts, neither while
    # the pipeline runs (both stages' moments) nor in slot 0's update (slot 1's).
    on, off = plain.slots[0], memory.slots[0]
    assert off.arguments == on.arguments - 4 * layer
    assert off.update == on.update - 2 * layer
    assert "host" in str(memory) and "host" not in str(plain)


def test_no_host_memory_kind_is_refused():
    class Memory:
        kind = "device"

    class Device:
        def addressable_memories(self):
            return [Memory()]

    with pytest.raises(HostMemoryError, match="offload=None"):
        host_memory_kind([Device()])
    assert host_memory_kind(jax.devices()[:1]) in ("pinned_host", "unpinned_host")


def test_refused_offloads_name_what_to_do():
    with pytest.raises(HostMemoryError, match=r'"params\+optimizer"'):
        pm.pipeline_train_step(_step(optax.sgd(0.1)), num_microbatches=2, offload="all")
    devices = pick_devices(1)
    with computing_on(devices):
        params, batch = _setup()
        optimizer = optax.adam(1e-2)
        state = optimizer.init(params)

        def loss_first(params, opt_state, batch):  # returns the loss first
            new_params, new_state, loss = _step(optimizer)(params, opt_state, batch)
            return loss, new_params, new_state

        pipelined = pm.pipeline_train_step(
            loss_first, num_stages=1, num_microbatches=2, devices=devices, offload="optimizer"
        )
        with pytest.raises(HostMemoryError, match="new state first"):
            pipelined(params, state, batch)


def test_one_device_updates_one_stage_at_a_time():
    # Four stages on one device: with offload each stage's part of the update brings
    # in its own state alone, so the update holds less on the device than the whole.
    devices = pick_devices(1)
    with computing_on(devices):
        params, batch = _setup(num_layers=4)
        optimizer = optax.adamw(1e-2, eps=1e-4)
        step = _step(optimizer)
        state = optimizer.init(params)
        options = dict(num_stages=4, num_microbatches=2, schedule="interleaved", devices=devices)
        plain = pm.pipeline_train_step(step, **options).memory(params, state, batch)
        pipelined = pm.pipeline_train_step(step, **options, offload="optimizer")
        memory = pipelined.memory(params, state, batch)
        want = jax.jit(step)(params, state, batch)
        got = pipelined(params, state, batch)
    # Each stage's moments and its step count's copy wait in host memory.
    assert _kinds(got[1]) == {"pinned_host"}
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    layer = (WIDTH * WIDTH + WIDTH) * 4
    # Three other stages' moments (old and new) are no longer on the device at once.
    assert memory.slots[0].update <= plain.slots[0].update - 3 * 2 * layer


def test_parameters_wait_in_host_memory_too():
    # offload="params+optimizer": the parameters lie in host memory between steps as
    # well, each slot bringing its own in for the call (a program reads them there).
    devices = pick_devices(2)
    with computing_on(devices):
        params, batch = _setup()
        optimizer = optax.adamw(1e-2, eps=1e-4)
        step = _step(optimizer)
        state = optimizer.init(params)
        pipelined = pm.pipeline_train_step(
            step,
            num_stages=2,
            num_microbatches=2,
            devices=devices,
            offload="params+optimizer",
        )
        ref = jax.jit(step)
        want_params, want_state = params, state
        for _ in range(2):
            params, state, loss = pipelined(params, state, batch)
            want_params, want_state, want_loss = ref(want_params, want_state, batch)
            assert _kinds(params) == {"pinned_host"}
            assert _kinds([x for x in jax.tree_util.tree_leaves(state) if x.ndim]) == {
                "pinned_host"
            }
        memory = pipelined.memory(params, state, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    got = jax.tree_util.tree_leaves((params, state))
    for a, b in zip(got, jax.tree_util.tree_leaves((want_params, want_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    layer = (WIDTH * WIDTH + WIDTH) * 4
    # A slot's parameters and both moments, old and new, in host memory.
    assert [s.host for s in memory.slots] == [6 * layer, 6 * layer]
