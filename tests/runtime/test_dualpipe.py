"""Tests of pipemark.runtime.schedules.dualpipe: DualPipeV equals torch's ScheduleDualPipeV cell
for cell, idles DeepSeek's (PP/2 - 1)(F&B + B - 3W) on paper, and runs as
schedule="dualpipev" with the loss and gradients of jax.value_and_grad."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime import ScheduleProblem, build_schedule, dualpipev_schedule
from pipemark.runtime.schedules.csv_cells import read_rows
from tests._trees import assert_trees_close

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    ("name", "stages", "micro"), [("dualpipev", 4, 8), ("dualpipev_8stages", 8, 16)]
)
def test_equals_the_schedule_torch_writes(name, stages, micro):
    torch = pm.runtime.schedule_from_csv(FIXTURES / f"{name}.csv", name="dualpipev")
    ours = dualpipev_schedule(stages, micro)
    assert ours == torch  # the same ticks, overlapped pairs and stage placement

    # Cell for cell, but for the idle cells pipemark writes where a device waits.
    def busy(text):
        return [[cell for cell in row if cell] for row in read_rows(text)]

    assert busy(ours.to_csv()) == busy((FIXTURES / f"{name}.csv").read_text())


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("weight", [0.25, 1.0, 1.5])
def test_simulated_bubble_is_deepseeks_formula(devices, weight):
    # F equal to the backward's first half (the costs zero-bubble schedules are drawn
    # for) and W no longer than F; B = whole backward; F&B = F + B, the pair run as one
    # unit.
    forward = first_half = 1.5
    costs = {"forward": forward, "backward": first_half, "weight": weight}
    whole = first_half + weight
    for micro in (2 * devices, 3 * devices + 1):
        sim = pm.simulate_schedule(dualpipev_schedule(2 * devices, micro), costs)
        formula = (devices - 1) * ((forward + whole) + whole - 3 * weight)
        assert sim.bubble == pytest.approx(formula)
        # Every device is busy 2M (F + B): its two stages' work, nothing more.
        assert sim.busy == pytest.approx([2 * micro * (forward + whole)] * devices)


def test_unequal_forward_and_first_half():
    costs = {"forward": 2.0, "backward": 1.0, "weight": 0.5}
    sim = pm.simulate_schedule(dualpipev_schedule(8, 16), costs)
    assert sim.bubble == pytest.approx(3 * (2 * 2.0 + 1.0 - 0.5))  # (D - 1)(2F + I - W)


def test_sizes_and_devices_it_refuses():
    with pytest.raises(pm.PipemarkError, match="num_stages must be even"):
        dualpipev_schedule(3, 6)
    with pytest.raises(pm.PipemarkError, match="at least as many microbatches as stages"):
        dualpipev_schedule(4, 3)
    with pytest.raises(pm.PipemarkError, match="4 stages need 2 devices, but 1 are available"):
        build_schedule("dualpipev", ScheduleProblem(4, 4, splits_backward=True, num_devices=1))


def test_waves_keep_the_overlapped_pairs():
    problem = ScheduleProblem(4, 8, splits_backward=True, microbatches_in_flight=4)
    waves = build_schedule("dualpipev", problem)
    assert waves.name == "dualpipev, waves of 4" and waves.num_microbatches == 8
    assert len(waves.overlapped) == 2 * len(dualpipev_schedule(4, 4).overlapped)
    assert max(waves.in_flight()) <= max(dualpipev_schedule(4, 4).in_flight())


def test_registered_and_runs_equal_to_value_and_grad():
    ex = examples.mlp(num_layers=4, width=8, batch=8)
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    step = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=4, num_microbatches=4, schedule="dualpipev"
    )
    assert_trees_close(step(*ex.args), want, rtol=2e-5, atol=1e-6)
    plan = step.plan(*ex.args)
    assert plan.schedule.name == "dualpipev" and plan.schedule.num_devices == 2
    # The overlapped pairs run as one program each (a forward and another
    # microbatch's backward).
    pairs = [
        s for _, s in plan.steps.serial if s.fused and len({p.microbatch for p in s.parts}) > 1
    ]
    assert len(pairs) == len(plan.schedule.overlapped) > 0
    # Measured costs simulate it.
    costs = step.action_costs(*ex.args, repeat=1)
    assert pm.simulate_schedule(plan.schedule, costs).makespan > 0
