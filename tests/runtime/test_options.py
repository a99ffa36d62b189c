"""PipelineOptions: what a pipeline is asked to do, checked before anything is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from tests._devices import computing_on, devices


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], r"devices is empty; give at least one jax device"),
        (["cpu:0", "cpu:1"], r"devices\[0\] is 'cpu:0', not a jax.Device \(a device's name"),
        ("cpu", r"devices is 'cpu'; give a list of jax devices"),
        (jax.devices()[0], r"devices is .*; give a list of jax devices"),
        ([jax.devices()[0], 3], r"devices\[1\] is 3, not a jax.Device;"),
    ],
)
def test_bad_devices_are_named_before_tracing(bad, message):
    ex = examples.mlp(2)
    with pytest.raises(pm.PipemarkError, match=message):
        pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=1, devices=bad)


def test_devices_may_be_any_iterable_of_devices():
    ex = examples.mlp(2)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=1, num_microbatches=1, devices=iter(devices(1))
    )
    loss, _ = pipe(*ex.args)
    want, _ = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))


def test_block_cuts_is_checked_before_tracing():
    with pytest.raises(pm.PipemarkError, match="Unknown block_cuts 'blocks'"):
        pm.pipeline_value_and_grad(lambda p, x: x, num_microbatches=1, block_cuts="blocks")
    with pytest.raises(pm.PipemarkError, match="Unknown block_cuts"):
        pm.pipeline_train_step(lambda p, x: x, num_microbatches=1, block_cuts=None)


@pytest.mark.parametrize("value", [None, 0, "no"])
def test_gather_results_must_be_a_bool(value):
    with pytest.raises(pm.PipemarkError, match="gather_results must be True"):
        pm.pipeline_value_and_grad(lambda p, x: x, num_microbatches=1, gather_results=value)


@pytest.mark.parametrize("value", ["twice", True, "ONCE"])
def test_fsdp_gather_is_checked_before_tracing(value):
    with pytest.raises(pm.PipemarkError, match=r"fsdp_gather is .*; use 'once'"):
        pm.pipeline_value_and_grad(lambda p, x: x, num_microbatches=1, fsdp_gather=value)
    with pytest.raises(pm.PipemarkError, match=r"fsdp_gather is .*; use 'once'"):
        pm.pipeline_train_step(lambda p, x: x, num_microbatches=1, fsdp_gather=value)


@pytest.mark.parametrize("value", ["overlapped", None, "END_OF_CALL"])
def test_reduce_gradients_is_checked_before_tracing(value):
    message = r"reduce_gradients is .*; use 'after_stage' .* or 'end_of_call'"
    with pytest.raises(pm.PipemarkError, match=message):
        pm.pipeline_value_and_grad(lambda p, x: x, num_microbatches=1, reduce_gradients=value)
    with pytest.raises(pm.PipemarkError, match=message):
        pm.pipeline_train_step(lambda p, x: x, num_microbatches=1, reduce_gradients=value)


def test_gather_results_changes_nothing_in_one_process():
    # Every stage is this process's: its results are held here whatever the option.
    ex = examples.mlp(4)
    used = devices(2)
    got = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, gather_results=False, devices=used
    )(*ex.args)
    with computing_on(used):
        want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.is_fully_addressable
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _two_blocks_then_a_head(params, x):
    # Two blocks, each two matmuls, then a head as heavy as a block: balanced best by a
    # cut inside the second block, between blocks only at 4 | 2 matmuls.
    for block in params["blocks"]:
        x = jnp.tanh(jnp.tanh(x @ block["w1"]) @ block["w2"])
    return jnp.sum(jnp.tanh(x @ params["head_in"]) @ params["head_out"])


@pytest.mark.parametrize("block_cuts, aligned", [("prefer", False), ("require", True)])
def test_the_runtime_cuts_by_block_cuts(block_cuts, aligned):
    rng = np.random.default_rng(0)
    w = lambda: jnp.asarray(rng.normal(size=(8, 8)) * 0.3, jnp.float32)  # noqa: E731
    params = {"blocks": [{"w1": w(), "w2": w()} for _ in range(2)], "head_in": w(), "head_out": w()}
    x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
    # Interleaved over one device: two stages need no second device.
    pipe = pm.pipeline_value_and_grad(
        _two_blocks_then_a_head,
        num_stages=2,
        num_microbatches=2,
        schedule="interleaved",
        devices=devices(1),
        loss_reduction="sum",
        block_cuts=block_cuts,
    )
    assert pipe.plan(params, x).staged.balance.block_aligned is aligned
    loss, grads = pipe(params, x)
    want_loss, want_grads = jax.jit(jax.value_and_grad(_two_blocks_then_a_head))(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule, wave", [("gpipe", 3), ("1f1b", 2), ("interleaved", 2)])
def test_microbatches_in_flight_computes_what_jax_computes(schedule, wave):
    used = devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=24)
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=4 if schedule == "interleaved" else 2, num_microbatches=6,
        schedule=schedule, devices=used, microbatches_in_flight=wave,
    )  # fmt: skip
    held = pipe.plan(*ex.args).schedule.in_flight()
    assert max(held) <= wave
    got = pipe(*ex.args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(pm.PipemarkError, match="microbatches_in_flight"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, microbatches_in_flight=0)
