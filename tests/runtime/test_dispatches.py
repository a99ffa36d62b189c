"""The programs the planner counts (pipemark.runtime.planning.dispatches) against the programs
the runtime's plan dispatches for the same layout: the planner has no stage programs,
only the schedule and which stages are alike, and must come to the same steps."""

from __future__ import annotations

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime.planning.dispatches import programs, stage_classes
from pipemark.runtime.planning.planner import predict_layout
from pipemark.runtime.planning.workload import Layout, MeasuredPipeline
from pipemark.runtime.schedules.problem import ScheduleProblem
from pipemark.runtime.schedules.registry import build_schedule, schedule_entry


def _without_weights(programs_of_a_device):
    """Each program's actions but the weight steps: the runtime runs a whole backward
    (a first stage's, DualPipeV's) as one step named by its backward."""
    return sorted(tuple(a for a in unit if a.kind != "weight") for unit in programs_of_a_device)


@pytest.mark.parametrize(
    ("schedule", "stages", "microbatches", "devices", "fuse"),
    [
        ("interleaved", 16, 8, 1, 2),  # a TPU run's layout: 164 programs
        ("interleaved", 8, 8, 2, 3),
        ("1f1b", 4, 8, 4, 2),
        ("zb-h1", 4, 8, 4, 2),
        ("dualpipev", 8, 8, 4, 2),
        ("gpipe", 4, 4, 4, 2),
        ("zb-v", 8, 8, 4, 3),
        ("interleaved", 4, 8, 1, 4),  # a stage's forward and backward on one device
    ],
)
def test_the_planners_programs_are_the_runtimes(schedule, stages, microbatches, devices, fuse):
    ex = examples.gpt(num_layers=stages, batch=microbatches)  # a block a stage
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=stages, num_microbatches=microbatches, schedule=schedule,
        devices=jax.devices()[:devices], fuse_actions=fuse,
    )  # fmt: skip
    plan = pipe.plan(*ex.args)
    runtime = [[tuple(p.action for p in s.parts or (s,)) for s in c] for c in plan.steps.columns]
    problem = ScheduleProblem(
        stages, microbatches, num_devices=devices,
        splits_backward=schedule_entry(schedule).splits_backward,
    )  # fmt: skip
    built = build_schedule(schedule, problem)
    counted = programs(built, stage_classes([1.0] * stages), fuse_actions=fuse)
    per_device: list[list[tuple]] = [[] for _ in range(devices)]
    for first, unit in counted.items():
        per_device[built.stage_devices[first.stage]].append(unit)
    assert [len(c) for c in per_device] == [len(c) for c in runtime]
    assert [_without_weights(c) for c in per_device] == [_without_weights(c) for c in runtime]


def test_runs_are_fused_only_where_their_program_is_shared_and_not_across_hosts():
    built = build_schedule("interleaved", ScheduleProblem(16, 8, num_devices=1))
    alike = stage_classes([1.0] * 16)
    assert len(programs(built, alike, fuse_actions=1)) == 248  # 256 actions, 8 F + B
    assert len(programs(built, alike)) == 164
    assert len(programs(built, alike, fuse_min_uses=1)) == 129  # every run of 2
    assert len(programs(built, alike, distributed=True)) == 248
    # Stages unlike each other share no program: no run is dispatched 16 times a call.
    unlike = stage_classes(list(range(16)))
    assert len(programs(built, unlike)) == 248


def test_the_planner_dispatches_the_runtimes_programs():
    # 16 stages on one device with a host slower than the chip: fused runs of 2 cut the
    # host's 248 dispatches to 164, and the step with them.
    measured = MeasuredPipeline(
        {"forward": 1e-4, "backward": 2e-4}, Layout(microbatches=8), global_batch=8
    )
    layout = Layout(schedule="interleaved", stages_per_device=16, microbatches=8)
    cluster = pm.planner.tpu_v5e(1)
    steps = {
        k: predict_layout(
            measured, layout, cluster, global_batch=8, update=False, fuse_actions=k
        ).step_seconds
        for k in (1, 2)
    }
    host = cluster.dispatch_cost(2)
    assert steps[1] == pytest.approx(248 * host, rel=0.02)
    assert steps[2] == pytest.approx(164 * host, rel=0.02)
    with pytest.raises(pm.PipemarkError, match="fuse_actions must be a positive int"):
        predict_layout(measured, layout, cluster, global_batch=8, fuse_actions=0)
    with pytest.raises(pm.PipemarkError, match="fuse_min_uses"):
        predict_layout(measured, layout, cluster, global_batch=8, fuse_min_uses=0)


def test_a_bound_counts_programs_so_fused_runs_hold_more_activations():
    # dispatch_ahead counts programs, as the runtime's bound and memory model do: 4
    # programs ahead of fused runs of 2 hold more forwards' activations than 4 actions.
    measured = MeasuredPipeline(
        {"forward": 1e-4, "backward": 2e-4}, Layout(microbatches=8), global_batch=8,
        activation_bytes=1000.0,
    )  # fmt: skip
    layout = Layout(schedule="interleaved", stages_per_device=16, microbatches=8)
    held = {
        (ahead, fuse): predict_layout(
            measured, layout, pm.planner.tpu_v5e(1), global_batch=8, update=False,
            fuse_actions=fuse, dispatch_ahead=ahead,
        ).memory["activations"]
        for ahead in (2, 4, None)
        for fuse in (1, 2)
    }  # fmt: skip
    assert held[2, 1] < held[2, 2] and held[4, 1] < held[4, 2]
    assert held[None, 1] == held[None, 2]  # unbounded: every later program either way
