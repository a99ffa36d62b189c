"""Tests for pipemark.runtime.registry: the one table of schedule names.

A schedule registered here runs as a pipeline with no other change: each case below
registers one, runs ``pm.pipeline_value_and_grad(..., schedule=name)`` on the host CPU
devices of the root conftest.py and compares with ``jax.value_and_grad`` of the loss.
"""

from __future__ import annotations

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from tests._trees import assert_trees_close


def _lifo(num_stages, num_microbatches, *, stage_graph, num_devices):
    """GPipe with the backwards newest microbatch first: each device runs every
    forward, then the backwards in reverse."""
    orders = [
        [pm.Action(j, m, pm.runtime.FORWARD) for m in range(num_microbatches)]
        + [pm.Action(j, m, pm.runtime.BACKWARD) for m in reversed(range(num_microbatches))]
        for j in range(num_stages)
    ]
    return pm.schedule_from_orders(
        orders,
        stage_devices=tuple(range(num_stages)),
        num_microbatches=num_microbatches,
        stage_graph=stage_graph,
        name="lifo",
    )


def _pairs(num_stages, num_microbatches, *, stage_graph, num_devices):
    """Interleaved 1F1B under another name: several stages on each device."""
    return pm.interleaved_schedule(
        num_stages, num_microbatches, num_devices=num_devices, stage_graph=stage_graph
    )


def _split(num_stages, num_microbatches, *, stage_graph, num_devices):
    """ZB-H1 under another name: the backward split into B and W."""
    return pm.zero_bubble_schedule(num_stages, num_microbatches, stage_graph=stage_graph)


@pytest.fixture
def registered(request):
    """Registers the case's schedule and forgets it after the test."""
    name, build, options = request.param
    entry = pm.register_schedule(name, build, **options)
    yield entry
    pm.runtime.unregister_schedule(name)


CASES = [
    ("lifo", _lifo, {}),
    ("pairs", _pairs, {"one_stage_per_device": False}),
    ("split", _split, {"splits_backward": True}),
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


def test_the_built_in_schedules_and_their_entries():
    assert pm.runtime.SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
    assert pm.runtime.ZERO_BUBBLE_VARIANTS == ("zb-h1", "zb-v")
    entries = {name: pm.runtime.schedule_entry(name) for name in pm.runtime.SCHEDULES}
    assert {n for n, e in entries.items() if not e.one_stage_per_device} == {
        "interleaved",
        "zb-v",
    }
    assert {n for n, e in entries.items() if e.splits_backward} == {"zb-h1", "zb-v"}
    with pytest.raises(AttributeError):  # entries are immutable
        entries["gpipe"].splits_backward = True  # type: ignore[misc]


def test_a_name_registers_once_and_unregisters():
    pm.register_schedule("lifo", _lifo)
    try:
        assert "lifo" in pm.runtime.SCHEDULES
        assert pm.make_schedule("lifo", 2, 3).name == "lifo"
        with pytest.raises(PipemarkError, match="registered already"):
            pm.register_schedule("lifo", _lifo)
    finally:
        pm.runtime.unregister_schedule("lifo")
    assert "lifo" not in pm.runtime.SCHEDULES
    with pytest.raises(PipemarkError, match=r"Unknown schedule 'lifo'; choose one of 'gpipe'"):
        pm.runtime.PipelineOptions(num_microbatches=2, schedule="lifo")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pm.register_schedule("", _lifo), "non-empty str"),
        (lambda: pm.register_schedule("gpipe", _lifo), "registered already"),
        (lambda: pm.register_schedule("x", "gpipe"), "build must be callable"),
        (lambda: pm.runtime.unregister_schedule("nope"), "Unknown schedule 'nope'"),
    ],
)
def test_registry_errors(call, message):
    with pytest.raises(PipemarkError, match=message):
        call()
