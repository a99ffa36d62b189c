"""Tests of the threaded dispatch of pipemark.runtime.execution (one worker thread per
device), on the host CPU devices the root conftest.py asks JAX for."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime.execution.run import run_plan
from tests._trees import assert_trees_close, assert_trees_equal


def _pipemark_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("pipemark"))


def _call_in_a_thread(fn, *args, seconds: float = 60) -> str | None:
    """Call ``fn(*args)`` on a daemon thread and return the error it raised as
    ``'Type: message'`` (None if it returned); fails if it is still running after
    ``seconds``."""
    outcome = {}

    def call():
        try:
            jax.block_until_ready(fn(*args))
        except BaseException as error:
            outcome["error"] = f"{type(error).__name__}: {error}"

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=seconds)
    assert not caller.is_alive(), f"the call still runs after {seconds} s: it hangs"
    return outcome.get("error")


@pytest.mark.parametrize(
    ("example", "options", "devices"),
    [
        pytest.param(
            lambda: examples.mlp(num_layers=4, width=8, batch=16),
            dict(num_microbatches=8),
            4,
            id="mlp-S4-M8-1f1b",
        ),
        pytest.param(
            lambda: examples.mlp(num_layers=4, width=8, batch=16),
            dict(num_microbatches=8, schedule="gpipe"),
            4,
            id="mlp-S4-M8-gpipe",
        ),
        pytest.param(
            lambda: examples.transformer(num_layers=4, d_model=8, num_heads=2, seq=4, batch=4),
            dict(num_microbatches=4, num_stages=2),
            2,
            id="transformer-S2-M4-1f1b",
        ),
        pytest.param(
            lambda: examples.resnet(num_blocks=4, width=8, batch=8, skip=2),
            dict(num_microbatches=4),
            4,
            id="resnet_skip-S4-M4-1f1b",
        ),
        pytest.param(
            lambda: examples.mlp(num_layers=4, width=8, batch=8),
            dict(num_microbatches=4, schedule="interleaved", devices=2),
            2,
            id="mlp-S4-M4-interleaved",
        ),
    ],
)
def test_threaded_results_are_bit_identical_to_one_thread(example, options, devices):
    ex = example()
    if "devices" in options:
        options = dict(options, devices=jax.devices()[: options["devices"]])
    plan = pm.pipeline_value_and_grad(ex.loss_fn, **options).plan(*ex.args)
    assert plan.schedule.num_devices == devices
    threaded = run_plan(plan, *ex.args, None)
    serial = run_plan(plan, *ex.args, None, parallel=False)
    # The same programs in the same order on each device: the same bits.
    assert assert_trees_equal(threaded, serial) > 2


@pytest.fixture(scope="module")
def mlp_pipeline():
    """A 4-stage MLP pipeline, its plan, its example and JAX's loss and gradients."""
    ex = examples.mlp(num_layers=4, width=8, batch=8)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4)
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    return pipeline, pipeline.plan(*ex.args), ex, want


def test_worker_threads_run_under_the_callers_jax_settings(mlp_pipeline):
    """A JAX setting the caller made for its own thread (a config option's context
    manager: part of what JAX compiles a program for) holds on every device's thread:
    each stage program is dispatched, and compiled, under it."""
    _, plan, ex, want = mlp_pipeline
    assert len(plan.devices) > 1  # worker threads besides the caller's
    seen = {}

    def recorded(unit):
        def run(accs, inputs, scale):
            seen[threading.current_thread().name] = jax.config.jax_default_matmul_precision
            return unit.run(accs, inputs, scale)

        return dataclasses.replace(unit, run=run)

    recording = dataclasses.replace(
        plan,
        units={index: recorded(unit) for index, unit in plan.units.items()},
        fused={key: recorded(unit) for key, unit in plan.fused.items()},  # the last stage's
    )
    with jax.default_matmul_precision("highest"):
        got = run_plan(recording, *ex.args, None)
    assert len(seen) == len(plan.devices) and set(seen.values()) == {"highest"}, seen
    assert_trees_close(got, want)
    assert jax.config.jax_default_matmul_precision is None  # the caller's own, restored


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_worker_error_reaches_the_caller_without_hanging(mlp_pipeline, stage, which):
    # Stage 0 runs on the caller's thread, stage 2 on a worker's; the stage raises on
    # its third call.
    pipeline, plan, ex, want = mlp_pipeline
    index = (plan.forward_stages if which == "forward" else plan.backward_stages)[stage]
    unit = plan.units[index]
    calls = []

    def failing(accs, inputs, scale):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"stage {stage} failed on purpose")
        return unit.run(accs, inputs, scale)

    # A plan is immutable: the failing stage goes into a copy of it.
    failing_plan = dataclasses.replace(
        plan, units={**plan.units, index: dataclasses.replace(unit, run=failing)}
    )
    error = _call_in_a_thread(run_plan, failing_plan, *ex.args, None)
    assert error == f"RuntimeError: stage {stage} failed on purpose"
    assert _pipemark_threads() == []  # every worker stopped
    assert_trees_close(pipeline(*ex.args), want)  # and the pipeline works again


def _loss_with_a_failing_callback(stage: int, calls: list):
    """A 3-stage loss whose stage ``stage`` calls back into Python; the callback raises
    on its third call."""

    def failing(x):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"stage {stage} callback failed on purpose")
        return np.asarray(x)

    def loss_fn(params, batch):
        x = batch
        for i, w in enumerate(params):
            x, w = pm.mark((x, w), name=f"stage{i}", mark_type="start")
            x = jnp.tanh(x @ w)
            if i == stage:  # a callback has no derivative: keep tangents away from it
                checked = jax.pure_callback(
                    failing, jax.ShapeDtypeStruct(x.shape, x.dtype), jax.lax.stop_gradient(x)
                )
                x = x + 0.0 * checked
            if i == len(params) - 1:
                x = jnp.mean(x * x)
            x = pm.mark(x, name=f"stage{i}", mark_type="end")
        return x

    return loss_fn


@pytest.mark.parametrize("stage", [0, 1])
def test_an_error_inside_a_running_program_reaches_the_caller(stage):
    # Results are published before they are computed, so the error can surface in a
    # reader or only when the caller waits for the accumulators; either way it reaches
    # the caller, nothing hangs, every worker stops, and the pipeline works afterwards.
    calls = []
    loss_fn = _loss_with_a_failing_callback(stage, calls)
    params = [jnp.eye(4) * 0.5 for _ in range(3)]
    batch = jnp.ones((8, 4))
    pipeline = pm.pipeline_value_and_grad(loss_fn, num_microbatches=4)
    error = _call_in_a_thread(pipeline, params, batch)
    assert error is not None and f"stage {stage} callback failed on purpose" in error, error
    assert _pipemark_threads() == []
    calls.extend([1] * 10)  # past the failing call
    want = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    assert_trees_close(pipeline(params, batch), want)


@pytest.mark.parametrize("parallel", [True, False], ids=["threaded", "serial"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_values_are_freed_after_their_last_reader(schedule, parallel):
    ex = examples.mlp(num_layers=4, width=8, batch=16)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=8, schedule=schedule)
    timings = {}
    jax.block_until_ready(run_plan(pipeline.plan(*ex.args), *ex.args, timings, parallel=parallel))
    assert timings["values_left"] == 0


def test_1f1b_holds_fewer_values_at_once_than_gpipe():
    # Serially, GPipe holds every forward's outputs for all 8 microbatches before the
    # first backward; 1F1B frees them as it goes.
    ex = examples.mlp(num_layers=4, width=8, batch=16)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=8, schedule=schedule)
        timings = {}
        jax.block_until_ready(run_plan(pipeline.plan(*ex.args), *ex.args, timings, parallel=False))
        peaks[schedule] = timings["peak_values"]
    assert peaks["1f1b"] < peaks["gpipe"], peaks
    assert peaks["gpipe"] >= 8, peaks


def test_devices_overlap():
    # Four stages that sleep 20 ms per action: threaded, the pipeline takes near the
    # ideal (M + S - 1) 2t = 280 ms (measured about 296 ms); walked from one thread, XLA
    # runs much of it one device after another (about 410 ms; serial 640 ms).
    # The bounds leave room for a loaded CI machine (the other test worker runs at the
    # same time): what they prove is overlap, which one device after another cannot
    # give. The benchmark (benchmarks/runtime.py) measures how close to ideal it gets.
    stages, micro, seconds = 4, 4, 0.02
    loss_fn, params, _ = examples.sleeping(stages, seconds)
    batch = jnp.ones((2 * micro, 4))
    plan = pm.pipeline_value_and_grad(loss_fn, num_microbatches=micro, schedule="gpipe").plan(
        params, batch
    )
    times = {}
    for parallel in (True, False):
        jax.block_until_ready(run_plan(plan, params, batch, None, parallel=parallel))
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(run_plan(plan, params, batch, None, parallel=parallel))
            runs.append(time.perf_counter() - start)
        times[parallel] = min(runs)
    ideal = (micro + stages - 1) * 2 * seconds
    serial = micro * stages * 2 * seconds
    assert times[True] >= 0.95 * ideal, times
    assert times[True] < 0.75 * serial, times
    assert times[True] < times[False], times
