"""Tests of benchmarks/_native_sleep.py: a C custom call that copies its operand and
sleeps, the equal stage of benchmarks/runtime.py.

The two-device pipeline runs on the host CPU devices the root conftest.py asks JAX for.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_REPO = Path(__file__).resolve().parents[2]
# benchmarks/ is not a package: runtime.py imports its neighbour as ``_native_sleep``,
# and so do the tests.
if str(_REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(_REPO / "benchmarks"))

import _native_sleep as ns  # noqa: E402

from tests._trees import assert_trees_close  # noqa: E402

if not ns.available():
    pytest.skip("no working C compiler for the native sleep", allow_module_level=True)


def _elapsed(fn, *args) -> float:
    jax.block_until_ready(fn(*args))  # compile first
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(-5, 5, dtype=np.int32),
        np.array([True, False, True]),
        np.float64(2.5),
        np.zeros((0, 4), np.float32),
        np.arange(24, dtype=np.int8).reshape(2, 3, 4),
    ],
    ids=["f32", "i32", "bool", "scalar", "empty", "i8-3d"],
)
def test_returns_its_operand_unchanged(value):
    x = jnp.asarray(value)
    out = jax.jit(lambda x: ns.native_sleep(x, 0.0))(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(ns.native_sleep(x, 0.0)), np.asarray(x))


def test_lowers_to_a_side_effecting_api_version_3_custom_call():
    x = jnp.ones((2, 4), jnp.float32)
    text = jax.jit(lambda x: ns.native_sleep(x, 0.0015)).lower(x).as_text()
    assert "stablehlo.custom_call @pipemark_bench_native_sleep" in text
    assert 'backend_config = "32 1500"' in text  # 32 bytes, 1500 µs
    assert "api_version = 3" in text and "has_side_effect = true" in text
    assert "callback" not in text


def test_a_call_takes_at_least_the_requested_time():
    x = jnp.ones(4)
    assert _elapsed(jax.jit(lambda x: ns.native_sleep(x, 0.02)), x) >= 0.02


def test_grad_is_the_identity_and_the_backward_waits_too():
    w = jnp.arange(1.0, 5.0)
    x = jnp.ones(4)
    np.testing.assert_array_equal(
        np.asarray(jax.grad(lambda x: jnp.sum(ns.native_sleep(x, 1e-3) * w))(x)), np.asarray(w)
    )

    def loss(x):
        # The forward's result feeds the backward, so neither sleep is dead code (like a
        # pure_callback, the primitive is pure: JAX drops it when its result is unused).
        y = ns.native_sleep(x, 0.01)
        return jnp.sum(y * y)

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x)), 2 * np.asarray(x))
    assert _elapsed(jax.jit(jax.grad(loss)), x) >= 0.02  # forward and backward, 10 ms each
    assert _elapsed(jax.jit(loss), x) >= 0.01


def test_vmap_sleeps_once_for_the_batch():
    x = jnp.arange(6.0).reshape(3, 2)
    f = jax.jit(jax.vmap(lambda row: ns.native_sleep(row, 0.01)))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    assert "native_sleep" in str(jax.make_jaxpr(jax.vmap(lambda r: ns.native_sleep(r, 0.0)))(x))


def test_on_a_sharded_operand_each_device_sleeps_once_on_its_shard():
    # XLA's partitioner refuses a side-effecting custom call without a sharding; the
    # sleep is partitioned as an elementwise call (custom_partitioning), each device
    # copying its own shard's bytes.
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), sharding)
    f = jax.jit(lambda x: ns.native_sleep(x * 2, 0.05), out_shardings=sharding)
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.asarray(x))
    compiled = f.lower(x).compile().as_text()
    assert compiled.count("pipemark_bench_native_sleep") == 1
    assert 'backend_config="64 50000"' in compiled  # 2 x 8 float32 a device, 50 ms
    # The two devices sleep at once: one duration, not two.
    assert 0.05 <= _elapsed(f, x) < 0.09


@pytest.mark.parametrize("seconds", [-1e-3, float("nan")])
def test_a_negative_duration_is_rejected(seconds):
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        ns.native_sleep(jnp.ones(2), seconds)


def test_sleeping_example_matches_value_and_grad_on_one_device():
    ex = ns.sleeping(num_stages=3, seconds=0.0)
    loss, grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert float(loss) > 0 and len(grads) == 3
    marks = str(jax.make_jaxpr(ex.loss_fn)(*ex.args))
    assert all(f"name=stage{i}" in marks for i in range(3))
    with pytest.raises(ValueError, match="num_stages, batch and width must be >= 1"):
        ns.sleeping(num_stages=0)
    with pytest.raises(ValueError, match="num_stages, batch and width must be >= 1"):
        ns.sleeping(width=0)


def test_action_costs_wait_for_each_action():
    # The stage runs asynchronously (its dispatch returns at once), so a cost that did
    # not wait for the action would be microseconds, not the sleep's 20 ms.
    import pipemark as pm

    seconds = 0.02
    ex = ns.sleeping_split(num_stages=1, seconds=seconds)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_microbatches=2, devices=jax.devices()[:1], schedule="zb-h1"
    )
    costs = pipe.action_costs(*ex.args, repeat=2)
    assert seconds <= costs["forward"][0] < 5 * seconds
    # The only stage's backward is all W: the batch's cotangent is never computed.
    assert costs["backward"][0] < seconds <= costs["weight"][0] < 5 * seconds
    loss, grads = pipe(*ex.args)
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert np.allclose(loss, want_loss) and np.allclose(grads[0], want_grads[0])
    with pytest.raises(pm.PipemarkError, match="repeat must be a positive int"):
        pipe.action_costs(*ex.args, repeat=0)


def _dispatch_and_total_seconds(width: int, seconds: float) -> tuple[float, float]:
    return ns.dispatch_seconds(ns.sleeping(num_stages=1, seconds=seconds, batch=2, width=width))


def test_the_default_width_makes_xla_run_the_stage_asynchronously():
    # XLA's CPU client runs programs under 1000 estimated flops inline (the dispatch
    # returns when they are done) and larger ones asynchronously; a stage standing for
    # milliseconds of work must be in the second class (see sleeping's docstring).
    dispatched, total = _dispatch_and_total_seconds(width=32, seconds=0.05)
    assert total >= 0.1  # forward and backward each waited
    assert dispatched < 0.05, (dispatched, total)
    dispatched, total = _dispatch_and_total_seconds(width=4, seconds=0.05)
    assert dispatched >= 0.1, (dispatched, total)  # inline: the waits happened in the call


def test_without_a_compiler_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(ns, "_library", None)
    monkeypatch.setattr(ns, "compiler", lambda: None)
    assert not ns.available()
    with pytest.raises(ns.NativeSleepUnavailable, match=r"no C compiler found.*--stage callback"):
        ns.sleeping(2, 0.0)


def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    failing = tmp_path / "badcc"
    failing.write_text("#!/bin/sh\necho 'badcc: broken on purpose' >&2\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setattr(ns, "_library", None)
    monkeypatch.setattr(ns, "compiler", lambda: str(failing))
    with pytest.raises(ns.NativeSleepUnavailable, match=r"(?s)exit 3.*broken on purpose"):
        ns.native_sleep(jnp.ones(2), 0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stage_pipeline_matches_value_and_grad_on_two_devices(schedule):
    import pipemark as pm

    ex = ns.sleeping(num_stages=2, seconds=0.002)
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4, schedule=schedule)
    assert pipe.plan(*ex.args).schedule.num_devices == 2
    jax.block_until_ready(pipe(*ex.args))
    start = time.perf_counter()
    got = jax.block_until_ready(pipe(*ex.args))
    seconds = time.perf_counter() - start
    assert_trees_close(got, want, rtol=0, atol=1e-6)
    # Forward and backward of 2 stages x 4 microbatches, 2 ms each, on two devices that
    # overlap: at least the ideal (M + S - 1) ticks of 2 ms each.
    assert seconds >= 5 * 2 * 0.002


_SECOND_IMPORT = """
import sys
import jax.numpy as jnp
sys.path[:0] = [{benchmarks!r}, {repo!r}]
import _native_sleep as ns
from benchmarks import _native_sleep as again
assert again is not ns
print(ns.native_sleep(jnp.arange(2.0), 0.0).tolist(), again.native_sleep(jnp.arange(3.0), 0.0).tolist())
"""


def test_a_second_import_registers_nothing_twice():
    # Imported under a second name, the module registers nothing twice (that would kill
    # the process, so it runs in its own) and still works.
    code = _SECOND_IMPORT.format(benchmarks=str(_REPO / "benchmarks"), repo=str(_REPO))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0.0, 1.0] [0.0, 1.0, 2.0]"
