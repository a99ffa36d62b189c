"""Tests of pipemark.runtime.execution.perfetto and the traces of a call (Pipeline.trace,
PipelinedStep.trace): the JSON is loaded back and its events checked against the
plan's steps, and the actions' names in a jax.profiler trace are recorded."""

from __future__ import annotations

import contextlib
import itertools
import json

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime.devices.steps import STAGE, step_name
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests.runtime._fusion import mlp_pipeline


def _pipeline(schedule="1f1b"):
    return mlp_pipeline(2, 4, schedule)  # on 2 devices, the MLP's arrays made there


def _expected(plan):
    """(the steps' names per worker, the values read across workers) of a plan."""
    names = [s.name for s in plan.staged.stages]
    per_worker: dict[int, list[str]] = {}
    producer = {}
    for worker, step in plan.steps.serial:
        per_worker.setdefault(worker, []).append(step_name(step, names))
        producer.update((key, worker) for _, key, _ in step.sends)
    crossing = sum(
        1
        for worker, step in plan.steps.serial
        for source, key in step.inputs
        if source == STAGE and producer[key] != worker
    )
    return per_worker, crossing


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_traced_call_has_a_slice_per_action_and_an_arrow_per_transfer(tmp_path, schedule):
    pipe, ex = _pipeline(schedule)
    path = tmp_path / "step.json"
    returned = pipe.trace(*ex.args, path=path)
    trace = json.loads(path.read_text(encoding="utf-8"))
    assert trace == returned and trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    plan = pipe.plan(*ex.args)
    per_worker, crossing = _expected(plan)
    slices = [e for e in events if e["ph"] == "X"]
    for worker, names in per_worker.items():
        mine = sorted((e for e in slices if e["tid"] == worker), key=lambda e: e["ts"])
        assert sorted(e["name"] for e in mine) == sorted(names)
        # One device slot runs one action at a time: its slices never overlap.
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in itertools.pairwise(mine))
        assert all(e["dur"] > 0 and e["ts"] >= 0 for e in mine)
    assert len(slices) == len(plan.steps.serial)
    if schedule == "zb-h1":
        assert any(
            e["name"].endswith(")" + e["name"][-4:]) or "(weight)" in e["name"] for e in slices
        )
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(tracks) == [0, 1] and all(name.startswith("slot ") for name in tracks.values())
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(ends) == crossing > 0 and starts.keys() == ends.keys()
    for flow, end in ends.items():  # from one slot to the other, forward in time
        assert starts[flow]["tid"] != end["tid"] and starts[flow]["ts"] <= end["ts"]


def test_the_traced_call_computes_what_jax_does():
    pipe, ex = _pipeline()
    pipe.trace(*ex.args)
    with computing_on(pipe.plan(*ex.args).devices):
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    got = pipe(*ex.args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jax.numpy.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_actions_are_named_in_a_profiler_trace(monkeypatch):
    pipe, ex = _pipeline()
    jax.block_until_ready(pipe(*ex.args))  # compiled
    seen = []

    @contextlib.contextmanager
    def annotation(name, **kwargs):
        seen.append(name)
        yield

    monkeypatch.setattr(jax.profiler, "TraceAnnotation", annotation)
    jax.block_until_ready(pipe(*ex.args))
    per_worker, _ = _expected(pipe.plan(*ex.args))
    assert sorted(seen) == sorted(n for names in per_worker.values() for n in names)
    assert "stage0 mb3" in seen and "stage1+stage1_backward mb0" in seen


def test_a_training_step_traces_its_gradient_part(tmp_path):
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=2, width=4, batch=4)
    step, _ = examples.train_step(ex.loss_fn, optimizer="sgd")
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
    trace = pipelined.trace(ex.params, (), ex.batch, path=tmp_path / "t.json")
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert names == {"layer0 mb0", "layer0 mb1", "layer0_backward mb0", "layer0_backward mb1",
                     "layer1+layer1_backward mb0", "layer1+layer1_backward mb1"}  # fmt: skip
    assert json.loads((tmp_path / "t.json").read_text(encoding="utf-8")) == trace
