"""Tests of pipemark.runtime.memory.budget (memory_budget=): the plan the runtime picks keeps
every device within the budget, by the memory estimate, and computes what
``jax.value_and_grad`` of the user's loss computes; an impossible budget is refused."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime import pipeline as pipeline_module
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests.runtime._compiles import compilations
from tests.runtime._steps import mlp_train_step


def _pipeline(memory_budget=None, num_layers=4, width=32):
    # GPipe holds every microbatch's residuals on the first stage: the budget bites.
    # Unmarked, cut automatically: the budget has no marked layers to move.
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=num_layers, width=width, batch=256, markers=None)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_stages=2,
        num_microbatches=8,
        schedule="gpipe",
        devices=used,
        memory_budget=memory_budget,
    )
    return pipe, ex


def pipe_error(pipe, ex):
    """The error ``pipe`` raises on ``ex``'s arguments."""
    with pytest.raises(pm.PipemarkError) as caught:
        pipe(*ex.args)
    return caught.value


def _peaks(pipe, ex):
    return [s.predicted_peak for s in pipe.memory(*ex.args).slots]


def _assert_equals_jax(pipe, ex):
    with computing_on(pipe.plan(*ex.args).devices):
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    got = pipe(*ex.args)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_a_budget_the_plan_fits_changes_nothing():
    pipe, ex = _pipeline()
    peaks = _peaks(pipe, ex)
    within, _ = _pipeline(memory_budget=max(peaks))
    assert _peaks(within, ex) == peaks
    plain, fitted = pipe.plan(*ex.args).staged, within.plan(*ex.args).staged
    assert [s.num_eqns for s in fitted.stages] == [s.num_eqns for s in plain.stages]


def test_a_slot_over_the_budget_runs_fewer_microbatches_in_flight():
    pipe, ex = _pipeline()
    peaks = _peaks(pipe, ex)
    # GPipe: every stage holds all 8 microbatches' residuals.
    assert pipe.plan(*ex.args).schedule.in_flight() == (8, 8)
    budget = max(peaks) - 1
    within, _ = _pipeline(memory_budget=budget)
    assert all(p <= budget for p in _peaks(within, ex))
    # Waves cost a fill and a drain each; rematerialising a stage costs its forward
    # for every microbatch: the budget takes the cheaper, fewer microbatches at once.
    plan = within.plan(*ex.args)
    assert max(plan.schedule.in_flight()) < 8
    assert "waves of" in plan.schedule.name
    assert [s.num_eqns for s in plan.staged.stages] == [
        s.num_eqns for s in pipe.plan(*ex.args).staged.stages
    ]
    _assert_equals_jax(within, ex)


def test_a_slot_over_the_budget_with_one_microbatch_in_flight_rematerialises():
    # Four layers a stage: their residuals outweigh the temporaries that recomputing
    # them adds to the backward (with one layer a stage the two are even: no gain).
    pipe, ex = _pipeline(num_layers=8, width=64)
    one_at_a_time = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=8, schedule="gpipe",
        devices=pipe.options.devices, microbatches_in_flight=1,
    )  # fmt: skip
    assert one_at_a_time.plan(*ex.args).schedule.in_flight() == (1, 1)
    budget = max(_peaks(one_at_a_time, ex)) - 1
    within, _ = _pipeline(memory_budget=budget, num_layers=8, width=64)
    slots = within.memory(*ex.args).slots
    assert all(s.predicted_peak <= budget for s in slots)
    # The over slot's backward recomputes its forward: it reads the stage's inputs,
    # nothing its forward computed.
    plan = within.plan(*ex.args)
    assert plan.rematerialized
    for forward, backward in zip(plan.forward_stages, plan.backward_stages):
        if plan.staged.stages[forward].name in plan.rematerialized:
            inputs = plan.staged.stages[backward].inputs
            assert not any(r.kind == "stage" and r.stage == forward for r in inputs)
    _assert_equals_jax(within, ex)


def test_on_one_device_fewer_microbatches_in_flight_come_first(monkeypatch):
    # Every action runs on the one device: waves add no idle time, so the budget
    # takes them before it recomputes anything, and does not even plan the
    # rematerialised pipeline, which is expected to take longer.
    used = pick_devices(1)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=32, batch=256)
    kw = dict(num_stages=2, num_microbatches=8, schedule="interleaved", devices=used)
    plain = pm.pipeline_value_and_grad(ex.loss_fn, **kw)
    held = max(plain.plan(*ex.args).schedule.in_flight())
    peak = max(_peaks(plain, ex))
    planned = []
    build_plan = pipeline_module.build_plan

    def counting(loss, params, batch, options, remat):
        planned.append((options.microbatches_in_flight, remat))
        return build_plan(loss, params, batch, options, remat)

    monkeypatch.setattr(pipeline_module, "build_plan", counting)
    within = pm.pipeline_value_and_grad(ex.loss_fn, memory_budget=peak - 1, **kw)
    plan = within.plan(*ex.args)
    assert planned == [(None, frozenset()), (1, frozenset())]
    assert max(plan.schedule.in_flight()) < held
    assert plan.schedule.num_ticks == plain.plan(*ex.args).schedule.num_ticks
    assert max(_peaks(within, ex)) <= peak - 1
    assert [s.num_eqns for s in plan.staged.stages] == [
        s.num_eqns for s in plain.plan(*ex.args).staged.stages
    ]
    _assert_equals_jax(within, ex)


def test_a_budget_no_plan_fits_says_which_device_and_by_how_much():
    pipe, ex = _pipeline(memory_budget=10_000)
    # The parameters and gradients alone are over: refused before any stage program
    # is compiled (nor run), whichever change the budget tried.
    over = r"Slot \d .* over memory_budget=10000"
    with compilations() as compiled, pytest.raises(pm.MemoryBudgetError, match=over):
        pipe(*ex.args)
    assert "jit(run)" not in compiled, compiled
    message = str(pipe_error(pipe, ex))
    assert re.search(r"needs at least [\d.]+ KiB, [\d.]+ KiB over", message), message
    assert "not compiled: the rest is over already" in message
    assert "dispatch_ahead" not in message  # bounded: the bound is not what to change
    unbounded = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=8, schedule="gpipe",
        devices=pick_devices(2), memory_budget=10_000, dispatch_ahead=None,
    )  # fmt: skip
    assert "a dispatch bound (dispatch_ahead=2" in str(pipe_error(unbounded, ex))
    with pytest.raises(pm.PipemarkError, match="memory_budget"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, memory_budget=-1)


def test_a_training_step_within_a_budget_updates_as_jax_does():
    used, ex, step, state = mlp_train_step("sgd", num_layers=4, width=64, batch=32)
    kw = dict(num_stages=2, num_microbatches=8, schedule="gpipe", devices=used)
    plain = pm.pipeline_train_step(step, **kw)
    budget = max(s.predicted_peak for s in plain.memory(ex.params, state, ex.batch).slots)
    fitted = pm.pipeline_train_step(step, memory_budget=budget, **kw)
    with computing_on(used):
        want = step(ex.params, state, ex.batch)
    got = fitted(ex.params, state, ex.batch)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_a_training_step_whose_update_is_over_the_budget_is_refused():
    used, ex, step, state = mlp_train_step("adam", num_layers=4, width=64, batch=8)
    kw = dict(num_stages=2, num_microbatches=2, devices=used)
    slots = pm.pipeline_train_step(step, **kw).memory(ex.params, state, ex.batch).slots
    # Adam's update reads the parameters, gradients and both moments and writes three
    # of them: far more than the pipeline before it holds.
    budget = max(s.update for s in slots) - 1
    pipeline_part = [s.parameters + s.batch + s.accumulators + s.in_flight for s in slots]
    assert max(pipeline_part) < budget
    fitted = pm.pipeline_train_step(step, memory_budget=budget, **kw)
    with pytest.raises(pm.MemoryBudgetError, match=r"The training step's update needs .* on slot"):
        fitted(ex.params, state, ex.batch)


def _two_big_layers(params, x):
    # Four marked layers: the first two hold 64 x 64 weights, the last two vectors.
    w0, w1, v2, v3 = params
    for layer in (
        lambda h: jnp.tanh(h @ w0),
        lambda h: jnp.tanh(h @ w1),
        lambda h: jnp.tanh(h * v2),
        lambda h: jnp.tanh(h * v3),
    ):
        pm.mark_pipeline_boundary()
        x = layer(x)
    return jnp.mean(x**2)


def test_a_slot_over_the_budget_by_its_parameters_gives_a_layer_to_its_neighbour():
    used = pick_devices(2)
    with computing_on(used):
        keys = jax.random.split(jax.random.PRNGKey(0), 5)
        params = [
            jax.random.normal(keys[0], (64, 64)) / 8,
            jax.random.normal(keys[1], (64, 64)) / 8,
            jax.random.normal(keys[2], (64,)),
            jax.random.normal(keys[3], (64,)),
        ]
        x = jax.random.normal(keys[4], (8, 64))
        want = jax.value_and_grad(_two_big_layers)(params, x)
    # On the host, as a checkpoint loader gives them: arrays the caller keeps on the
    # first device stay there whichever slot reads them (the estimate's `arguments`),
    # and no move of a layer would take them off.
    params = [np.asarray(p) for p in params]
    kw = dict(num_stages=2, num_microbatches=4, devices=used)
    plain = pm.pipeline_value_and_grad(_two_big_layers, **kw)
    layers = plain.plan(params, x).stage_layers
    assert layers[0] >= 2  # both weights on the first slot
    peaks = [s.predicted_peak for s in plain.memory(params, x).slots]
    # Fewer microbatches in flight or recomputing the residuals cannot take the two
    # weights (and their gradients) off the first slot: moving a layer can.
    budget = peaks[0] - 2 * 64 * 64 * 4
    fitted = pm.pipeline_value_and_grad(_two_big_layers, memory_budget=budget, **kw)
    plan = fitted.plan(params, x)
    assert plan.stage_layers == (1, 3)
    assert all(s.predicted_peak <= budget for s in fitted.memory(params, x).slots)
    for g, w in zip(jax.tree_util.tree_leaves(fitted(params, x)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_stage_layers_shares_the_marked_layers_as_asked():
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=16)
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    kw = dict(num_stages=2, num_microbatches=4, devices=used)
    for layers in [(1, 3), (3, 1), (2, 2)]:
        pipe = pm.pipeline_value_and_grad(ex.loss_fn, stage_layers=layers, **kw)
        plan = pipe.plan(*ex.args)
        assert plan.stage_layers == layers
        # Each stage's slot holds the parameters of its layers: one weight and bias
        # per layer of the MLP.
        assert [len(leaves) for leaves in plan.steps.params] == [2 * n for n in layers]
        got = pipe(*ex.args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(pm.PipemarkError, match=r"stage_layers=\(1, 2\) does not share"):
        pm.pipeline_value_and_grad(ex.loss_fn, stage_layers=(1, 2), **kw)(*ex.args)
    with pytest.raises(pm.PipemarkError, match="gives 3 stages but num_stages=2"):
        pm.pipeline_value_and_grad(ex.loss_fn, stage_layers=(1, 1, 2), **kw)(*ex.args)
    with pytest.raises(pm.PipemarkError, match="each of stage_layers must be a positive"):
        pm.pipeline_value_and_grad(ex.loss_fn, stage_layers=(0, 4), **kw)
    with pytest.raises(pm.PipemarkError, match="is not cut at top-level layer markers"):
        unmarked = examples.mlp(num_layers=4, width=16, batch=16, markers=None)
        pm.pipeline_value_and_grad(unmarked.loss_fn, stage_layers=(2, 2), **kw)(*unmarked.args)
