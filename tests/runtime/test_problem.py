"""Tests for pipemark.runtime.schedules.problem: what a schedule builder is given, checked once."""

from __future__ import annotations

import dataclasses

import pytest

import pipemark as pm
from pipemark.errors import PipemarkError, StageGraphError


def test_defaults_and_normal_forms():
    problem = pm.runtime.ScheduleProblem(3, 4, stage_graph=[(0, 2), (1, 2)], slots=("a", "b"))
    assert problem.stage_graph == {0: (), 1: (), 2: (0, 1)}
    assert problem.predecessors == ((), (), (0, 1))
    assert problem.successors == ((2,), (2,), ())
    assert problem.num_devices == 2  # from the slots
    assert problem.costs == dict.fromkeys(("forward", "backward", "weight"), (1.0,) * 3)
    assert problem.activation_bytes is None and problem.memory_limit is None
    # A normal form survives dataclasses.replace, which checks the fields again.
    assert dataclasses.replace(problem, memory_limit=10).stage_graph == problem.stage_graph


def test_times_per_stage_and_the_cost_of_an_action():
    problem = pm.runtime.ScheduleProblem(2, 1, backward_time=(2.0, 3.0), weight_time=1.0)
    backward = pm.Action(1, 0, "backward")
    assert problem.cost(backward) == 4.0  # not split: B + W
    assert dataclasses.replace(problem, splits_backward=True).cost(backward) == 3.0
    measured = problem.with_costs({"forward": (0.5, 0.25)})
    assert measured.forward_time == (0.5, 0.25) and measured.backward_time == (2.0, 3.0)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: pm.runtime.ScheduleProblem(0, 2),
            PipemarkError,
            "num_stages must be a positive int",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2, stage_graph=[(1, 0), (0, 1)]),
            StageGraphError,
            "cycle",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2, forward_time=(1.0,)),
            PipemarkError,
            "forward_time has 1 entries but the schedule has 2 stages",
        ),
        (lambda: pm.runtime.ScheduleProblem(2, 2, weight_time=-1), PipemarkError, "non-negative"),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2, num_devices=3, slots=("a", "b")),
            PipemarkError,
            "num_devices=3 but 2 slots",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2, activation_bytes=(1, 2, 3)),
            PipemarkError,
            "activation_bytes has 3 entries",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2, memory_limit=0),
            PipemarkError,
            "memory_limit must be",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2).with_costs({"forwards": 1.0}),
            PipemarkError,
            r"costs\['forwards'\]",
        ),
        (
            lambda: pm.runtime.ScheduleProblem(2, 2).with_costs([1.0, 2.0]),
            PipemarkError,
            "with_costs takes a table",
        ),
    ],
)
def test_bad_problems_are_named(make, error, message):
    with pytest.raises(error, match=message):
        make()
