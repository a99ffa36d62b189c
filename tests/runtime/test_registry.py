"""Tests for pipemark.runtime.schedules.registry: the one table of schedule names, each built for
a pm.runtime.ScheduleProblem.

A schedule registered here runs as a pipeline with no other change: each case below
registers one, runs ``pm.pipeline_value_and_grad(..., schedule=name)`` on the host CPU
devices of the root conftest.py and compares with ``jax.value_and_grad`` of the loss.
The memory-aware schedule of docs/architecture.md ("Adding a schedule") is run from
the page itself.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from tests._trees import assert_trees_close


def _lifo(problem):
    """GPipe with the backwards newest microbatch first: each device runs every
    forward, then the backwards in reverse."""
    micro = problem.num_microbatches
    orders = [
        [pm.Action(j, m, pm.runtime.FORWARD) for m in range(micro)]
        + [pm.Action(j, m, pm.runtime.BACKWARD) for m in reversed(range(micro))]
        for j in range(problem.num_stages)
    ]
    return pm.runtime.schedule_from_orders(
        orders,
        stage_devices=tuple(range(problem.num_stages)),
        num_microbatches=micro,
        stage_graph=problem.stage_graph,
        name="lifo",
    )


def _pairs(problem):
    """Interleaved 1F1B under another name: several stages on each device."""
    return pm.runtime.interleaved_schedule(
        problem.num_stages,
        problem.num_microbatches,
        num_devices=problem.num_devices,
        stage_graph=problem.stage_graph,
    )


def _split(problem):
    """ZB-H1 under another name: the backward split into B and W."""
    return pm.runtime.zero_bubble_schedule(
        problem.num_stages, problem.num_microbatches, stage_graph=problem.stage_graph
    )


def _docs_schedule():
    """The builder of docs/architecture.md's "Adding a schedule", run as the page shows
    it (which registers it as "memory-capped"), then unregistered."""
    section = DOCS.read_text(encoding="utf-8").split("## Adding a schedule", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, f"{DOCS} (Adding a schedule)", "exec"), namespace)
    pm.runtime.unregister_schedule("memory-capped")
    return namespace["memory_capped"]


DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
MEMORY_CAPPED = _docs_schedule()


def _one_in_flight_on_the_largest(problem):
    """The docs' memory-aware schedule with room for one microbatch of the stage with
    the most residuals."""
    limit = max(problem.activation_bytes)
    return MEMORY_CAPPED(dataclasses.replace(problem, memory_limit=limit))


def _in_flight(schedule):
    """Per stage, the most microbatches in flight at once (forward run, backward not);
    each stage on a device of its own."""
    now = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for _, _, action in schedule.actions():
        now[action.stage] += {pm.runtime.FORWARD: 1, pm.runtime.BACKWARD: -1}[action.kind]
        peak[action.stage] = max(peak[action.stage], now[action.stage])
    return peak


@pytest.fixture
def registered(request):
    """Registers the case's schedule and forgets it after the test."""
    name, build, options = request.param
    entry = pm.runtime.register_schedule(name, build, **options)
    yield entry
    pm.runtime.unregister_schedule(name)


CASES = [
    ("lifo", _lifo, {}),
    ("pairs", _pairs, {"one_stage_per_device": False}),
    ("split", _split, {"splits_backward": True}),
    ("memory-capped", _one_in_flight_on_the_largest, {}),
]


@pytest.mark.parametrize("registered", CASES, indirect=True, ids=[c[0] for c in CASES])
def test_a_registered_schedule_runs_a_pipeline_equal_to_value_and_grad(registered):
    ex = examples.mlp(num_layers=4, width=8, batch=8)
    devices = jax.devices()[:2] if not registered.one_stage_per_device else None
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_microbatches=4, schedule=registered.name, devices=devices
    )
    got = pipe(*ex.args)
    want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert assert_trees_close(got, want, rtol=1e-5, atol=1e-6) > 1
    plan = pipe.plan(*ex.args)
    assert plan.num_stages == 4
    assert plan.schedule.splits_backward == registered.splits_backward
    # The registry, not the schedule's name, says whether the backward is split.
    assert any(w is not None for w in plan.weight_stages) == registered.splits_backward
    expected_devices = 2 if not registered.one_stage_per_device else 4
    assert plan.schedule.num_devices == expected_devices
    assert registered.name in pm.runtime.SCHEDULES
    assert (registered.name in pm.runtime.ZERO_BUBBLE_VARIANTS) == registered.splits_backward
    # The plan keeps what the builder was given: the pipeline's stage graph, every
    # device, the split, and each stage's residuals (at least its input activation,
    # 2 rows x 8 float32 per microbatch; the two middle layers alike).
    problem = plan.problem
    assert problem.stage_graph == plan.schedule.stage_graph
    assert problem.num_devices == len(devices or jax.devices())
    assert problem.splits_backward == registered.splits_backward
    sizes = problem.activation_bytes
    assert len(sizes) == 4 and min(sizes) >= 2 * 8 * 4 and sizes[1] == sizes[2], sizes
    if registered.name == "memory-capped":  # the residuals reached the builder
        peaks = _in_flight(plan.schedule)
        assert all(n * size <= max(sizes) for n, size in zip(peaks, sizes)), (peaks, sizes)
        assert peaks != _in_flight(pm.make_schedule("1f1b", 4, 4)), peaks


@pytest.mark.parametrize("graph", [None, [(0, 1), (1, 2), (2, 3), (0, 2)]], ids=["chain", "skip"])
def test_the_docs_memory_aware_schedule_keeps_its_residuals_under_the_limit(graph):
    sizes = (300, 100, 200, 100)
    unlimited = pm.runtime.ScheduleProblem(4, 8, stage_graph=graph, activation_bytes=sizes)
    # Without a limit it is 1F1B (stage j holds up to 4 - j microbatches on a chain).
    one_f_one_b = pm.make_schedule("1f1b", 4, 8, stage_graph=graph)
    assert MEMORY_CAPPED(unlimited).ticks == one_f_one_b.ticks
    for limit in (300, 500, 900, 1200, 10_000):
        schedule = MEMORY_CAPPED(dataclasses.replace(unlimited, memory_limit=limit))
        peaks = _in_flight(schedule)
        assert all(n * size <= limit for n, size in zip(peaks, sizes)), (limit, peaks)
        # Stage 0 holds as many as fit, up to 1F1B's 4.
        assert peaks[0] == min(limit // sizes[0], 4), (limit, peaks)
    with pytest.raises(PipemarkError, match=r"Stage 0 holds 300 bytes .* memory_limit=250"):
        MEMORY_CAPPED(dataclasses.replace(unlimited, memory_limit=250))


def test_the_built_in_schedules_and_their_entries():
    assert pm.runtime.SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
    assert pm.runtime.ZERO_BUBBLE_VARIANTS == ("zb-h1", "zb-v", "dualpipev")
    entries = {name: pm.runtime.schedule_entry(name) for name in pm.runtime.SCHEDULES}
    assert {n for n, e in entries.items() if not e.one_stage_per_device} == {
        "interleaved",
        "zb-v",
        "dualpipev",
    }
    assert {n for n, e in entries.items() if e.splits_backward} == {"zb-h1", "zb-v", "dualpipev"}
    with pytest.raises(AttributeError):  # entries are immutable
        entries["gpipe"].splits_backward = True  # type: ignore[misc]


def test_a_name_registers_once_and_unregisters():
    pm.runtime.register_schedule("lifo", _lifo)
    try:
        assert "lifo" in pm.runtime.SCHEDULES
        assert pm.make_schedule("lifo", 2, 3).name == "lifo"
        with pytest.raises(PipemarkError, match="registered already"):
            pm.runtime.register_schedule("lifo", _lifo)
    finally:
        pm.runtime.unregister_schedule("lifo")
    assert "lifo" not in pm.runtime.SCHEDULES
    with pytest.raises(PipemarkError, match=r"Unknown schedule 'lifo'; choose one of 'gpipe'"):
        pm.runtime.PipelineOptions(num_microbatches=2, schedule="lifo")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pm.runtime.register_schedule("", _lifo), "non-empty str"),
        (lambda: pm.runtime.register_schedule("gpipe", _lifo), "registered already"),
        (lambda: pm.runtime.register_schedule("x", "gpipe"), "build must be callable"),
        (lambda: pm.runtime.unregister_schedule("nope"), "Unknown schedule 'nope'"),
    ],
)
def test_registry_errors(call, message):
    with pytest.raises(PipemarkError, match=message):
        call()


def test_a_builder_of_the_old_form_still_registers_with_a_warning():
    given = {}

    def old(num_stages, num_microbatches, *, stage_graph, num_devices):
        given.update(stage_graph=stage_graph, num_devices=num_devices)
        return pm.runtime.gpipe_schedule(num_stages, num_microbatches, stage_graph=stage_graph)

    with pytest.warns(DeprecationWarning, match=r"write build\(problem\) -> Schedule"):
        pm.runtime.register_schedule("old", old)
    try:
        assert (
            pm.make_schedule("old", 3, 2, num_devices=4).ticks
            == pm.runtime.gpipe_schedule(3, 2).ticks
        )
        # As the planner called it: one device per stage.
        assert given == {"stage_graph": {0: (), 1: (0,), 2: (1,)}, "num_devices": 3}
    finally:
        pm.runtime.unregister_schedule("old")


def test_the_entry_checks_the_devices_a_schedule_needs():
    few = pm.runtime.ScheduleProblem(4, 2, num_devices=2)
    with pytest.raises(
        PipemarkError,
        match=r"4 stages but only 2 device\(s\); each stage needs its own device.*"
        r"schedule='interleaved' or 'zb-v'",
    ):
        pm.runtime.schedule_entry("1f1b").schedule(few)
    # A schedule that places its stages itself must keep to the devices available.
    with pytest.raises(PipemarkError, match="uses 4 devices but only 2 are available"):
        pm.runtime.build_schedule(pm.runtime.gpipe_schedule(4, 2), few)
    pm.runtime.register_schedule("wide", _lifo, one_stage_per_device=False)
    pm.runtime.register_schedule("nothing", lambda problem: None)
    try:
        with pytest.raises(PipemarkError, match="uses 4 devices but only 2 are available"):
            pm.runtime.build_schedule("wide", few)
        with pytest.raises(PipemarkError, match=r"returned NoneType, not a pm\.Schedule"):
            pm.make_schedule("nothing", 2, 2)
    finally:
        pm.runtime.unregister_schedule("wide")
        pm.runtime.unregister_schedule("nothing")


def test_the_problem_times_reach_the_zero_bubble_builders():
    # ZB-H1 orders its actions by simulating them with the problem's times: with a slow
    # last stage the order differs from the one for unit times.
    slow_last = pm.runtime.ScheduleProblem(4, 8, splits_backward=True).with_costs(
        {"forward": (1.0, 1.0, 1.0, 4.0)}
    )
    tuned = pm.runtime.build_schedule("zb-h1", slow_last)
    assert tuned.ticks == pm.runtime.zero_bubble_schedule(4, 8, costs=slow_last.costs).ticks
    assert tuned.ticks != pm.make_schedule("zb-h1", 4, 8).ticks
