"""Tests of pipemark.runtime.devices.steps: which forward steps fuse_steps folds into the
backward step that follows them, where the fused step goes, and a whole backward of a
split stage run as its B and W in one program."""

from __future__ import annotations

import collections

import jax
import pytest

import pipemark as pm
from pipemark.runtime import BACKWARD, FORWARD, WEIGHT, Action
from tests._devices import computing_on
from tests._trees import assert_trees_close
from tests.runtime._fusion import mlp_pipeline, unfused_steps


def _plan(
    num_stages: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    devices: int = 0,
    recompute_residuals: bool = True,
):
    pipe, ex = mlp_pipeline(
        num_stages, num_microbatches, schedule, devices, recompute_residuals=recompute_residuals
    )
    return pipe.plan(*ex.args)


def _fused(plan) -> set[tuple[int, ...]]:
    """The stages of each fused program the plan compiled."""
    return {combined.stages for combined in plan.fused}


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_one_stage_fuses_every_forward_with_its_backward(num_microbatches):
    plan = _plan(1, num_microbatches)
    forward, backward = plan.forward_stages[0], plan.backward_stages[0]
    (column,) = plan.steps.columns
    assert [(s.index, s.fused.stages, s.microbatch) for s in column] == [
        (backward, (forward, backward), m) for m in range(num_microbatches)
    ]
    assert _fused(plan) == {(forward, backward)}
    assert plan.steps.num_actions == 2 * num_microbatches
    assert plan.steps.num_programs == num_microbatches
    # The fused step reads the forward's inputs first, then the backward's own (none of
    # them the forward's outputs: those stay inside the program).
    unfused = unfused_steps(plan).columns[0]
    assert column[0].inputs[: len(unfused[0].inputs)] == unfused[0].inputs
    extra = column[0].inputs[len(unfused[0].inputs) :]
    assert all(key[1] != forward for source, key in extra if source == 2)
    assert {source for source, _ in extra} <= {0, 1}  # parameters and batch


def test_the_last_stage_of_1f1b_is_fused_and_the_first_is_not():
    plan = _plan(2, 4)
    first, last = plan.steps.columns
    assert all(s.fused is None for s in first)  # its forward feeds stage 1
    both = (plan.forward_stages[1], plan.backward_stages[1])
    assert [(s.index, s.fused.stages) for s in last] == [(plan.backward_stages[1], both)] * 4
    assert _fused(plan) == {both}
    assert plan.steps.num_programs == 12 and plan.steps.num_actions == 16
    # The fused step takes its backward's place in the global order; the rest keeps its own.
    want = [
        (w, s.index, s.microbatch)
        for w, s in unfused_steps(plan).serial
        if s.index != plan.forward_stages[1]
    ]
    assert [(w, s.index, s.microbatch) for w, s in plan.steps.serial] == want


@pytest.mark.parametrize(
    ("num_stages", "num_microbatches", "schedule", "devices"),
    [(2, 4, "zb-h1", 2), (4, 4, "zb-v", 2)],
)
def test_no_fusion_where_another_stage_reads_the_forward(
    num_stages, num_microbatches, schedule, devices
):
    # Under a zero-bubble schedule the weight-gradient stage reads the forward's
    # activations too, when the forward hands over every residual: the forward's
    # outputs must leave its program.
    plan = _plan(num_stages, num_microbatches, schedule, devices, recompute_residuals=False)
    assert not plan.fused
    assert all(s.fused is None for column in plan.steps.columns for s in column)
    assert plan.steps.num_programs == plan.steps.num_actions


@pytest.mark.parametrize(
    ("num_stages", "num_microbatches", "schedule", "devices"),
    [(2, 4, "zb-h1", 2), (4, 4, "zb-v", 2)],
)
def test_zero_bubble_last_stage_fuses_when_its_weight_stage_reads_the_stage_input(
    num_stages, num_microbatches, schedule, devices
):
    # With the residuals recomputed (the default), the weight-gradient stage reads the
    # activation the forward received, where it lies, not one the forward returns: on
    # the last stage only the backward reads the forward's outputs, and the two fuse.
    plan = _plan(num_stages, num_microbatches, schedule, devices)
    last = plan.forward_stages[-1]
    weight = plan.weight_stages[-1]
    assert all(
        ref.stage != last for ref in plan.staged.stages[weight].inputs if ref.kind == "stage"
    )
    assert _fused(plan) == {(last, plan.backward_stages[-1])}
    assert plan.steps.num_programs == plan.steps.num_actions - num_microbatches


def test_a_zero_bubble_stage_without_a_weight_program_is_fused():
    # One stage: its backward has no input cotangent to compute, so split_backward
    # leaves it whole, and nothing but it reads the forward.
    plan = _plan(1, 4, "zb-h1")
    assert plan.weight_stages == (None,)
    assert _fused(plan) == {(plan.forward_stages[0], plan.backward_stages[0])}
    assert plan.steps.num_programs == 4


@pytest.mark.parametrize("num_stages", [1, 2])
def test_a_forward_not_followed_by_its_backward_is_not_fused(num_stages):
    # GPipe runs every forward before any backward, microbatch 0 first: with several
    # microbatches no forward is followed by its own backward; with one, the last
    # stage's is.
    plan = _plan(num_stages, 4, "gpipe")
    assert not plan.fused and plan.steps.num_programs == plan.steps.num_actions == 8 * num_stages
    plan = _plan(num_stages, 1, "gpipe")
    both = (plan.forward_stages[-1], plan.backward_stages[-1])
    assert _fused(plan) == {both}
    assert [s.fused.stages for s in plan.steps.columns[-1]] == [both]


def test_a_whole_backward_of_a_split_stage_is_its_b_and_w_in_one_program():
    # Stage 2 runs microbatch 0's backward whole and microbatch 1's split; stage 1 splits
    # both; stage 0 has no W program (its backward is all weight gradient).
    def split(j, m):
        return [Action(j, m, BACKWARD), Action(j, m, WEIGHT)]

    orders = [
        [
            Action(0, 0, FORWARD),
            Action(0, 1, FORWARD),
            Action(0, 0, BACKWARD),
            Action(0, 1, BACKWARD),
        ],
        [Action(1, 0, FORWARD), Action(1, 1, FORWARD), *split(1, 0), *split(1, 1)],
        [Action(2, 0, FORWARD), Action(2, 1, FORWARD), Action(2, 0, BACKWARD), *split(2, 1)],
    ]
    schedule = pm.runtime.schedule_from_orders(orders, stage_devices=(0, 1, 2), num_microbatches=2)
    assert schedule.whole_backwards == {(0, 0), (0, 1), (2, 0)}
    pipe, ex = mlp_pipeline(3, 2, schedule, num_layers=3)
    with computing_on(jax.tree_util.tree_leaves(ex.args)[0].devices()):  # the pipeline's
        want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert_trees_close(pipe(*ex.args), want, rtol=2e-5, atol=1e-6)
    plan = pipe.plan(*ex.args)
    assert plan.weight_stages[0] is None and None not in plan.weight_stages[1:]
    both = (plan.backward_stages[2], plan.weight_stages[2])
    # Compiled as one program for stage 2 alone; stage 1's halves stay apart.
    assert _fused(plan) == {both}
    (whole,) = [s for s in plan.steps.columns[2] if s.fused is not None]
    assert whole.microbatch == 0 and whole.fused.stages == both
    assert whole.sends and all(key[1] == both[0] for _, key, _ in whole.sends)  # to stage 1
    assert plan.steps.num_programs == plan.steps.num_actions == 4 * 3 + 3


# ------------------------------------------------- runs of actions as one program


def _parts(column) -> list:
    """Each step of ``column`` as the unfused steps it runs, in program order."""
    return [part for step in column for part in step.parts or (step,)]


def _label(step) -> tuple:
    return (step.index, step.microbatch, step.action)


@pytest.mark.parametrize(
    ("schedule", "num_stages", "devices"),
    [("interleaved", 4, 1), ("interleaved", 4, 2), ("zb-v", 4, 2), ("dualpipev", 4, 2)],
)
@pytest.mark.parametrize("fuse_actions", [2, 4])
def test_runs_of_actions_are_fused_where_no_other_device_waits(
    schedule, num_stages, devices, fuse_actions
):
    pipe, ex = mlp_pipeline(
        num_stages, 4, schedule, devices, batch=8, fuse_actions=fuse_actions, fuse_min_uses=1
    )
    plan = pipe.plan(*ex.args)
    alone, _ = mlp_pipeline(num_stages, 4, schedule, devices, batch=8, fuse_actions=1)
    before = alone.plan(*ex.args).steps
    steps = plan.steps
    assert steps.num_actions == before.num_actions
    for w, (column, old) in enumerate(zip(steps.columns, before.columns)):
        # The same actions in the same order, runs of at most fuse_actions of them.
        assert [_label(p) for p in _parts(column)] == [_label(p) for p in _parts(old)]
        items = iter(old)  # the steps before runs were fused, some fused already
        for step in column:
            parts = step.parts or (step,)
            run = [next(items)]
            while len(_parts(run)) < len(parts):
                run.append(next(items))
            assert len(parts) <= fuse_actions or len(run) == 1
            assert len({p.index for p in parts}) == len(parts)  # each stage once
            # No other device waits for a step of a run before its last: each step
            # after the first reads from its own device only, and each before the last
            # sends to it only.
            for item in run[1:]:
                assert all(plan.units[k[1]].worker == w for src, k in item.inputs if src == 2)
            for item in run[:-1]:
                assert all(r == w for _, _, targets in item.sends for r, _ in targets)
    if devices == 1:
        assert steps.num_programs <= before.num_programs / fuse_actions * 1.5
    assert steps.num_programs <= before.num_programs
    with computing_on(jax.tree_util.tree_leaves(ex.args)[0].devices()):
        want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert_trees_close(pipe(*ex.args), want, rtol=2e-5, atol=1e-6)


def _runs_fused(plan, alone) -> dict[tuple, tuple]:
    """The runs ``plan`` fused that ``alone`` (the same plan with ``fuse_actions=1``)
    did not: each run's actions -> what its program is compiled from."""
    before = {tuple(map(_label, s.parts or (s,))) for _, s in alone.steps.serial}
    return {
        tuple(map(_label, s.parts)): (
            tuple(plan.units[i].run for i in s.fused.stages), s.fused.reads, s.fused.passed
        )
        for _, s in plan.steps.serial
        if s.parts and tuple(map(_label, s.parts)) not in before
    }  # fmt: skip


def test_by_default_only_runs_whose_program_serves_many_dispatches_are_fused():
    """By default (``fuse_actions=2``, ``fuse_min_uses=None``) a run is fused where its
    program runs at least twice per microbatch a call (stages of identical layers share
    it), so that each program compiled for a run replaces many dispatches."""
    args = (8, 2, "interleaved", 1)
    options = {"batch": 4, "num_layers": 8}
    every, ex = mlp_pipeline(*args, **options, fuse_actions=2, fuse_min_uses=1)
    default, _ = mlp_pipeline(*args, **options)
    alone = mlp_pipeline(*args, **options, fuse_actions=1)[0].plan(*ex.args)
    all_runs = _runs_fused(every.plan(*ex.args), alone)
    uses = collections.Counter(all_runs.values())
    plan = default.plan(*ex.args)
    fused = _runs_fused(plan, alone)
    assert set(fused) == {run for run, program in all_runs.items() if uses[program] >= 4}
    assert fused and set(fused) != set(all_runs)  # some runs fused, some not
    assert plan.fuse_min_uses is None and plan.fuse_actions == 2
    with computing_on(jax.tree_util.tree_leaves(ex.args)[0].devices()):
        want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert_trees_close(default(*ex.args), want, rtol=2e-5, atol=1e-6)
    for bad in (0, 1.5, True):
        with pytest.raises(pm.PipemarkError, match=r"fuse_min_uses \(or None\) must be a positive"):
            mlp_pipeline(*args, **options, fuse_min_uses=bad)


def test_fuse_actions_of_one_fuses_no_runs_and_bad_values_are_refused():
    args = (8, 2, "interleaved", 1)
    one, ex = mlp_pipeline(*args, batch=4, num_layers=8, fuse_actions=1)
    every, _ = mlp_pipeline(*args, batch=4, num_layers=8, fuse_actions=1, fuse_min_uses=1)
    default, _ = mlp_pipeline(*args, batch=4, num_layers=8)
    steps = one.plan(*ex.args).steps
    assert steps == every.plan(*ex.args).steps  # whatever fuse_min_uses says
    assert steps.num_programs > default.plan(*ex.args).steps.num_programs
    for bad in (0, -2, 1.5, True, None):
        with pytest.raises(pm.PipemarkError, match="fuse_actions must be a positive int"):
            mlp_pipeline(4, 4, "interleaved", 1, fuse_actions=bad)
