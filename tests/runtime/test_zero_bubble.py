"""The runtime runs zero-bubble schedules (ZB-H1, ZB-V) and 1F1B on 4 host CPU devices:
loss and gradients equal jax.value_and_grad's, W is split from B where it should be,
and the measured action costs make a schedule that runs."""

from __future__ import annotations

import functools

import jax
import pytest

import pipemark as pm
from pipemark import examples
from tests._trees import assert_trees_close, assert_trees_equal

SCHEDULES = ["1f1b", "zb-h1", "zb-v"]


@functools.cache
def _model(name: str) -> examples.Example:
    if name == "mlp":
        return examples.mlp(num_layers=4, width=8, batch=8)
    return examples.language_model(
        num_layers=4, vocab=32, d_model=16, num_heads=2, seq=8, batch=8, markers="boundary"
    )


@functools.cache
def _reference(name: str):
    ex = _model(name)
    return jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)


def _pipeline(loss_fn, schedule):
    return pm.pipeline_value_and_grad(loss_fn, num_stages=4, num_microbatches=4, schedule=schedule)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_pipeline_equals_value_and_grad_and_measures_its_actions(model, schedule):
    ex = _model(model)
    step = _pipeline(ex.loss_fn, schedule)
    got = step(*ex.args)
    assert_trees_close(got, _reference(model), rtol=2e-5, atol=1e-6)
    plan = step.plan(*ex.args)
    assert plan.schedule.name == schedule
    assert plan.schedule.num_devices == {"zb-v": 2}.get(schedule, 4)
    weights = [s.name for s in plan.staged.stages if s.name.endswith("_weight")]
    # A zero-bubble plan splits W from B in every stage but the first (the first layer's
    # backward is all W, kept whole); 1F1B splits none.
    assert len(weights) == (0 if schedule == "1f1b" else 3), weights
    # Measured costs, one per stage and kind: W apart only where the backward is split,
    # and none for the first layer.
    costs = step.action_costs(*ex.args, repeat=1)
    assert {kind: len(v) for kind, v in costs.items()} == dict.fromkeys(costs, 4), costs
    assert all(c > 0 for c in costs["forward"] + costs["backward"]), costs
    assert costs["weight"][0] == 0, costs
    assert all(w > 0 for w in costs["weight"][1:]) == (schedule != "1f1b"), costs
    assert pm.simulate_schedule(plan.schedule, costs).makespan > 0
    # Measuring leaves the pipeline as it was: the same call gives the same bits.
    assert_trees_equal(step(*ex.args), got)


@pytest.mark.parametrize("model", ["mlp", "lm"])
def test_a_schedule_built_on_measured_costs_runs_where_its_order_meets_the_graph(model):
    ex = _model(model)
    step = _pipeline(ex.loss_fn, "zb-h1")
    costs = step.action_costs(*ex.args, repeat=1)
    graph = step.plan(*ex.args).schedule.stage_graph
    # One built for a stage graph with an edge more (a skip from stage 0 to 2) orders
    # every edge of the pipeline's: it fits, with the pipeline's graph.
    wider = pm.runtime.zero_bubble_schedule(
        4, 4, costs=costs, stage_graph=[(0, 1), (1, 2), (2, 3), (0, 2)]
    )
    assert wider.stage_graph != graph
    assert pm.make_schedule(wider, 4, 4, stage_graph=graph).stage_graph == graph
    # One built for stages 1 and 2 that both read stage 0 alone runs their forwards side
    # by side, but the pipeline's stage 2 reads stage 1: refused, naming the edge.
    other = pm.runtime.zero_bubble_schedule(
        4, 4, costs=costs, stage_graph=[(0, 1), (0, 2), (1, 3), (2, 3)]
    )
    with pytest.raises(pm.errors.StageGraphError, match=r"before F0s1 .*the edge 1->2"):
        _pipeline(ex.loss_fn, other)(*ex.args)
    tuned = pm.runtime.zero_bubble_schedule(4, 4, costs=costs, stage_graph=graph)
    assert_trees_close(_pipeline(ex.loss_fn, tuned)(*ex.args), _reference(model), rtol=2e-5)
