"""Tests of pipemark.runtime.memory (Pipeline.memory): the bytes each slot holds,
counted from the user's arrays and from the schedule's order, not from the estimate's
own walk."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pipemark as pm
from pipemark import examples
from pipemark.cost import nbytes
from pipemark.runtime.memory import estimate_memory
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests.runtime._fusion import mlp_pipeline
from tests.runtime._steps import mlp_train_step


def _mlp_pipeline(schedule, num_stages, num_microbatches, width=32):
    # A layer per stage, microbatches of 4 rows however many there are.
    return mlp_pipeline(
        num_stages,
        num_microbatches,
        schedule,
        batch=4 * num_microbatches,
        num_layers=num_stages,
        width=width,
    )


def _tree_bytes(tree):
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tree))


def test_parameters_batch_and_accumulators_add_up_to_the_users_arrays():
    pipe, ex = _mlp_pipeline("1f1b", 4, 4)
    params, batch = ex.args
    slots = pipe.memory(params, batch).slots
    assert len(slots) == 4
    # Each layer's parameters on its own stage's slot; the inputs and the targets on
    # the first and the last; the loss and every gradient accumulated once.
    assert [s.parameters for s in slots] == [_tree_bytes(layer) for layer in params]
    assert sum(s.batch for s in slots) == _tree_bytes(batch)
    assert slots[1].batch == slots[2].batch == 0
    assert sum(s.accumulators for s in slots) == _tree_bytes(params) + 4  # + the loss
    for s in slots:
        assert s.temporaries is not None and s.temporaries >= 0
        assert s.predicted_peak == (
            s.parameters + s.batch + s.accumulators + s.in_flight + s.temporaries
        )


def _residual_bytes(plan):
    """Bytes the first stage's forward leaves for its own slot, per microbatch: its
    outputs that its backward reads."""
    staged = plan.staged
    forward, backward = plan.forward_stages[0], plan.backward_stages[0]
    read = {
        ref.index
        for ref in staged.stages[backward].inputs
        if ref.kind == "stage" and ref.stage == forward
    }
    return sum(nbytes(staged.stages[forward].out_avals[o]) for o in read)


def test_the_schedule_sets_how_many_microbatches_are_in_flight():
    # GPipe runs every forward before any backward: the first stage holds the residuals
    # of all M microbatches, M times what one leaves. 1F1B starts backwards after S
    # forwards: what it holds does not grow with M.
    held = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            pipe, ex = _mlp_pipeline(schedule, 2, m)
            plan = pipe.plan(*ex.args)
            held[schedule, m] = estimate_memory(plan).slots[0].in_flight
            residual = _residual_bytes(plan)
    assert residual > 0
    assert held["gpipe", 8] - held["gpipe", 4] == 4 * residual
    assert held["1f1b", 8] == held["1f1b", 4] < held["gpipe", 4]


def test_one_stage_holds_nothing_in_flight_and_its_program_temporaries():
    pipe, ex = _mlp_pipeline("1f1b", 1, 1, width=64)
    (slot,) = pipe.memory(*ex.args).slots
    assert slot.in_flight == 0
    (program,) = pipe.compiled_programs(*ex.args).values()
    assert slot.temporaries == program.memory_analysis().temp_size_in_bytes
    assert "predicted_peak" in str(pipe.memory(*ex.args)) and "KiB" in str(pipe.memory(*ex.args))


def test_a_training_step_counts_each_slots_part_of_its_update():
    used, ex, step, state = mlp_train_step("adam", num_layers=2, width=16, batch=8)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
    estimate = pipelined.memory(ex.params, state, ex.batch)
    first, last = estimate.slots
    params = _tree_bytes(ex.params)
    assert first.parameters + last.parameters == params
    # The update, each slot its own stage's part (pipemark.runtime.update): parameters,
    # Adam's two moments and the gradients in, new parameters and moments out (no
    # donation), whatever its temporaries.
    assert _tree_bytes(state) >= 2 * params
    assert first.update >= 4 * first.parameters and last.update >= 4 * last.parameters
    assert first.update + last.update >= 4 * params + _tree_bytes(state)
    assert first.predicted_peak >= first.update
    assert "update" in str(estimate)
    assert all(s.measured_peak is None or s.measured_peak > 0 for s in estimate.slots)


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
def test_every_schedule_has_an_estimate_per_slot(schedule):
    pipe, ex = _mlp_pipeline(schedule, 4 if schedule == "interleaved" else 2, 4)
    plan = pipe.plan(*ex.args)
    estimate = pipe.memory(*ex.args)
    assert len(estimate.slots) == len(plan.placement.slots)
    assert all(s.in_flight > 0 for s in estimate.slots)


def test_stages_on_sub_meshes_are_estimated_without_their_temporaries():
    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs 8 host CPU devices")
    mesh = Mesh(np.array(cpus[:8]).reshape(4, 2), ("stage", "data"))
    ex = examples.mlp(num_layers=4, width=16, batch=16)
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4, mesh=mesh)
    slots = pipe.memory(*ex.args).slots
    # A slot's values whole (each device of its data axis holds the parameters);
    # its programs are not lowered here, so no temporaries.
    assert [s.devices.count("cpu") for s in slots] == [2] * 4
    assert sum(s.parameters for s in slots) == _tree_bytes(ex.params)
    assert all(s.temporaries is None and s.in_flight > 0 for s in slots)


def test_each_action_dispatched_ahead_holds_its_results_too():
    # One slot, interleaved: the results of the next `dispatch_ahead` actions are
    # allocated when they are dispatched, before the device runs them.
    with computing_on(pick_devices(1)):
        ex = examples.mlp(num_layers=4, width=32, batch=16)
    in_flight = {}
    for ahead in (1, 3):
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn,
            num_stages=4,
            num_microbatches=4,
            schedule="interleaved",
            devices=pick_devices(1),
            dispatch_ahead=ahead,
        )
        plan = pipe.plan(*ex.args)
        (slot,) = estimate_memory(plan).slots
        in_flight[ahead] = slot.in_flight
        # Whatever the bound, the same results (donated accumulators included).
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
        got = pipe(*ex.args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    largest = max(sum(nbytes(v.aval) for v in s.jaxpr.outvars) for s in plan.staged.stages)
    assert in_flight[1] < in_flight[3] <= in_flight[1] + 2 * largest


def test_dispatch_ahead_must_be_a_positive_count_or_none():
    ex = examples.mlp(num_layers=2, batch=4)
    with pytest.raises(pm.PipemarkError, match="dispatch_ahead"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, dispatch_ahead=0)
    with pytest.raises(pm.PipemarkError, match="recompute_residuals"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, recompute_residuals="yes")
