"""A pipeline's and a training step's export (pipemark/runtime/execution/plan_export.py): the
programs a call runs, in its order, equal to the call within ulps (each exported module is
another program to XLA: tests/_exact.py); against JAX's own step within rounding; the schedule, slots and stages in the manifest; what is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from tests._devices import devices
from tests._trees import assert_trees_close, assert_trees_within_ulps


def test_a_pipeline_export_computes_its_call(tmp_path):
    ex = examples.mlp(num_layers=2, batch=4)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, devices=devices(2)
    )
    exported = pipe.export(tmp_path, ex.params, ex.batch)
    loaded = pm.load_staged(tmp_path)
    flat = jax.tree_util.tree_leaves((ex.params, ex.batch))
    # The same computations in the same order as the call; each exported module wraps
    # its program in its calling convention, another program to XLA (tests/_exact.py).
    assert_trees_within_ulps(loaded(*flat), jax.tree_util.tree_leaves(pipe(ex.params, ex.batch)))
    manifest = exported.manifest
    plan = pipe.plan(ex.params, ex.batch)
    assert manifest["kind"] == "pipeline"
    assert [s["id"] for s in manifest["slots"]] == [d.id for d in plan.devices]
    assert manifest["pipeline"]["num_microbatches"] == 2
    schedule = manifest["schedule"]
    assert schedule["name"] == "1f1b" and schedule["stage_devices"] == [0, 1]
    # torch's grammar, read back as the schedule the plan runs.
    assert schedule["csv"] == plan.schedule.to_csv()
    assert pm.runtime.schedule_from_csv(schedule["csv"]).to_csv() == schedule["csv"]
    # The last stage's forward and backward run as one program, as the runtime fuses them.
    assert "layer1+layer1_backward" in exported.programs
    stage_steps = [s for s in manifest["steps"] if s["slot"] is not None and s["reads"]]
    assert len(stage_steps) == plan.steps.num_programs
    assert {s["name"]: s["slot"] for s in manifest["stages"]} == {
        "layer0": 0,
        "layer1": 1,
        "layer1_backward": 1,
        "layer0_backward": 0,
    }


def test_a_training_step_export_computes_the_step(tmp_path):
    ex = examples.mlp(num_layers=2, batch=4)
    step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    state = init_state(ex.params)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=devices(2))
    exported = pipelined.export(tmp_path, ex.params, state, ex.batch)
    got = pm.load_staged(tmp_path)(ex.params, state, ex.batch)
    want = jax.tree_util.tree_leaves(pipelined(ex.params, state, ex.batch))
    assert_trees_within_ulps(got, want)  # exported modules: see the test above
    assert_trees_close(got, jax.tree_util.tree_leaves(jax.jit(step)(ex.params, state, ex.batch)))
    assert exported.kind == "train_step"
    assert [n for n in exported.programs if n.startswith("update/")] == ["update/0", "update/1"]
    assert exported.input_names[-1] == "args[2][1]" and exported.output_names[-1] == "result[2]"


def test_sum_over_count_is_refused():
    ex = examples.mlp(num_layers=1, batch=4)

    def summed(params, batch):
        return ex.loss_fn(params, batch) * 4, np.float32(4)

    pipe = pm.pipeline_value_and_grad(
        summed, num_stages=1, num_microbatches=2, loss_reduction="sum_over_count"
    )
    with pytest.raises(pm.PipemarkError, match="sum_over_count"):
        pipe.export("never-written", ex.params, ex.batch)
