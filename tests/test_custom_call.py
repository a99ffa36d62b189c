"""The ``custom_call`` lowering and the CPU ``pipeline_marker``/``identity`` targets."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import custom_call as cc
from pipemark.lowering import get_lowering
from tests._trees import assert_trees_within_ulps

REPO = Path(__file__).resolve().parent.parent


def _layer(x, w, name):
    x, w = pm.mark((x, w), name=name, mark_type="start")
    (y,) = pm.mark((jnp.tanh(x @ w),), name=name, mark_type="end")
    return y


def _model(x, w1, w2):
    y = _layer(x, w1, "layer0")
    pm.mark_pipeline_boundary()
    return jnp.sum(_layer(y, w2, "layer1") ** 2)


def _inputs():
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    return (
        jax.random.normal(k1, (4, 3)),
        jax.random.normal(k2, (3, 5)),
        jax.random.normal(k3, (5, 2)),
    )


def _run(fn, *args, mode):
    with pm.lowering(mode):
        return jax.tree_util.tree_map(np.asarray, fn(*args))


# ------------------------------------------------------------------------------ HLO


def test_lowered_hlo_carries_target_name_marker_params_sizes_and_aliasing():
    x, w1, _ = _inputs()
    with pm.lowering("custom_call"):
        text = jax.jit(lambda x, w: _layer(x, w, "layer0")).lower(x, w1).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @pipeline_marker" in line]
    assert len(calls) == 2
    start, end = calls
    assert 'mark_type = "start"' in start and 'name = "layer0"' in start
    assert 'mark_type = "end"' in end and 'name = "layer0"' in end
    assert "byte_sizes = dense<[48, 60]>" in start  # f32[4,3] and f32[3,5]
    assert "byte_sizes = dense<80>" in end  # f32[4,5]
    assert all("has_side_effect = true" in c for c in calls)
    assert "operand_index = 0" in start and "operand_index = 1" in start
    assert "optimization_barrier" not in text


def test_compiled_hlo_keeps_the_custom_calls_with_aliasing():
    x, w1, w2 = _inputs()
    with pm.lowering("custom_call"):
        text = jax.jit(_model).lower(x, w1, w2).compile().as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="pipeline_marker"' in line]
    # start and end of two layers, plus the zero-operand boundary marker
    assert len(calls) == 5
    assert all("custom_call_has_side_effect=true" in c for c in calls)
    assert all("API_VERSION_TYPED_FFI" in c for c in calls)
    assert sum("output_to_operand_aliasing" in c for c in calls) == 4
    assert any('name = "layer1"' in c and 'mark_type = "end"' in c for c in calls)
    assert any('mark_type = "boundary"' in c for c in calls)


def test_zero_operand_marker_lowers_to_a_call_without_operands():
    def f(x):
        pm.mark_pipeline_boundary()
        return x + 1.0

    with pm.lowering("custom_call"):
        text = jax.jit(f).lower(1.0).as_text()
        assert float(jax.jit(f)(1.0)) == 2.0
    assert re.search(r"custom_call @pipeline_marker\(\) .*mark_type = \"boundary\"", text)
    assert "byte_sizes = dense<> : tensor<0xi64>" in text


def test_hook_markers_keep_the_barrier_lowering():
    f = jax.jit(lambda x: pm.mark(x, name="tap", mark_type="hook") * 2.0)
    with pm.lowering("custom_call"):
        text = f.lower(jnp.ones(3)).as_text()
    assert "optimization_barrier" in text
    assert "pipeline_marker" not in text


def test_prng_keys_pass_around_the_call():
    def f(key, x):
        key, x = pm.mark((key, x), name="s", mark_type="start")
        return jax.random.normal(key, x.shape) + x

    key = jax.random.key(1)
    x = jnp.arange(3.0)
    with pm.lowering("custom_call"):
        text = jax.jit(f).lower(key, x).as_text()
    assert "byte_sizes = dense<12>" in text  # only the float operand goes through
    # Compiled against eager: two programs (tests/_exact.py).
    assert_trees_within_ulps(_run(jax.jit(f), key, x, mode="custom_call"), f(key, x))


def test_sub_byte_values_pass_around_the_call():
    x = jnp.arange(6, dtype=jnp.int4)
    y = jnp.arange(3.0)
    f = jax.jit(lambda x, y: pm.mark((x, y), name="s", mark_type="end"))
    with pm.lowering("custom_call"):
        text = f.lower(x, y).as_text()
        out = f(x, y)
    assert "byte_sizes = dense<12>" in text  # int4 may be packed: it skips the call
    np.testing.assert_array_equal(out[0], x)


def test_identity_target_refuses_sub_byte_buffers():
    with pytest.raises(Exception, match="pipemark: cannot copy buffers of XLA data type"):
        jax.block_until_ready(cc.identity(jnp.arange(4, dtype=jnp.int4), alias=False))


# ------------------------------------------------------- equivalence under transforms


def _scan_model(x, w1, w2):
    def body(carry, w):
        return _layer(carry, w, "shared"), None

    square = jnp.stack([w1 @ w1.T, w1 @ w1.T * 0.5])
    out, _ = jax.lax.scan(body, x @ w1 @ w1.T, square)
    return jnp.sum(out @ w1 @ w2)


def _cond_model(x, w1, w2):
    return jax.lax.cond(
        jnp.sum(x) > 0,
        lambda x: _model(x, w1, w2),
        lambda x: _model(-x, w1, w2),
        x,
    )


TRANSFORMS = {
    "jit": lambda: jax.jit(_model),
    "grad": lambda: jax.jit(jax.grad(_model, argnums=(0, 1, 2))),
    "vmap": lambda: jax.jit(jax.vmap(_model, in_axes=(0, None, None))),
    "scan": lambda: jax.jit(jax.grad(_scan_model, argnums=1)),
    "cond": lambda: jax.jit(jax.value_and_grad(_cond_model, argnums=1)),
    "checkpoint": lambda: jax.jit(jax.grad(jax.checkpoint(_model), argnums=1)),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_results_equal_identity_mode(transform):
    x, w1, w2 = _inputs()
    if transform == "vmap":
        x = jnp.stack([x, 2 * x, -x])
    expected = _run(TRANSFORMS[transform](), x, w1, w2, mode="identity")
    cc.reset_cpu_copy_stats()
    got = _run(TRANSFORMS[transform](), x, w1, w2, mode="custom_call")
    assert cc.cpu_copy_stats().calls > 0  # the targets really ran
    # Two programs: XLA fuses nothing across a custom call, so each rounds its own way.
    # A scan's gradient through chains of matrix products differed by 19 float32 ulps
    # (2.3e-6 relative) at XLA_OPT=0 (no FMA contraction); within 1e-5 at any level.
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expected
    )


def test_jaxpr_is_the_same_in_every_mode():
    # The mode only changes lowering, never the traced program.
    x, w1, w2 = _inputs()
    texts = set()
    for mode in ("identity", "custom_call"):
        with pm.lowering(mode):
            texts.add(str(jax.make_jaxpr(jax.grad(_model))(x, w1, w2)))
    assert len(texts) == 1


# -------------------------------------------------------------------------- copies


def _copy_ops(compiled_text):
    """Buffer copies in the entry computation (a fusion named *_copy_* is compute)."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    return len(re.findall(r"= \S+ copy\(", entry))


def test_donated_buffers_are_never_copied():
    def step(x, w):
        x, w = pm.mark((x, w), name="s", mark_type="start")
        return pm.mark((x * 2.0, w), name="s", mark_type="end")

    x, w = jnp.arange(1000.0), jnp.ones((17, 3), jnp.float16)
    donated = jax.jit(step, donate_argnums=(0, 1))
    with pm.lowering("custom_call"):
        assert _copy_ops(donated.lower(x, w).compile().as_text()) == 0
        cc.reset_cpu_copy_stats()
        out_x, out_w = donated(jnp.arange(1000.0), jnp.ones((17, 3), jnp.float16))
        jax.block_until_ready((out_x, out_w))
    stats = cc.cpu_copy_stats()
    assert stats.calls == 2
    assert (stats.copies, stats.bytes_copied) == (0, 0)
    np.testing.assert_array_equal(out_x, np.arange(1000.0) * 2)
    np.testing.assert_array_equal(out_w, np.ones((17, 3)))


def test_without_donation_inputs_are_copied_and_left_intact():
    def step(x):
        (x,) = pm.mark((x,), name="s", mark_type="start")
        return x + 1.0

    x = jnp.arange(5.0)
    with pm.lowering("custom_call"):
        compiled = jax.jit(step).lower(x).compile().as_text()
        out = jax.jit(step)(x)
    assert _copy_ops(compiled) == 1  # XLA copies the parameter before the aliased call
    np.testing.assert_array_equal(out, np.arange(5.0) + 1)
    np.testing.assert_array_equal(x, np.arange(5.0))


@pytest.mark.parametrize(
    "shapes_dtypes",
    [
        [((7,), np.uint8)],
        [((0,), np.float32), ((3, 5), np.float64), ((13,), np.int8)],
        [((2, 3, 4), jnp.bfloat16), ((1,), np.bool_), ((), np.int32), ((9,), np.complex64)],
    ],
)
def test_identity_target_copies_every_size_correctly(shapes_dtypes):
    rng = np.random.default_rng(0)
    arrays = [
        jnp.asarray((rng.standard_normal(shape) * 50).astype(dtype))
        for shape, dtype in shapes_dtypes
    ]
    cc.reset_cpu_copy_stats()
    outs = jax.jit(lambda *a: cc.identity(*a, alias=False))(*arrays)
    stats = cc.cpu_copy_stats()
    nonempty = [a for a in arrays if a.size]
    assert stats.copies == len(nonempty)
    assert stats.bytes_copied == sum(a.nbytes for a in nonempty)
    for a, b in zip(arrays, outs):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_identity_target_with_aliasing_copies_nothing_itself():
    cc.reset_cpu_copy_stats()
    (out,) = jax.jit(cc.identity, donate_argnums=0)(jnp.arange(6))
    np.testing.assert_array_equal(out, np.arange(6))
    assert cc.cpu_copy_stats().copies == 0


# --------------------------------------------------------------------- FFI errors


def _raw_call(target, arrays, **attrs):
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    return jax.ffi.ffi_call(target, avals, has_side_effect=True)(*arrays, **attrs)


def test_wrong_byte_sizes_come_back_as_an_error_not_a_crash():
    cc.register_targets("cpu")
    x = jnp.arange(4.0)
    with pytest.raises(Exception, match=r"pipemark: byte_sizes\[0\] is 8 but operand 0 holds 16"):
        jax.block_until_ready(_raw_call("identity", [x], byte_sizes=np.array([8], np.int64)))


def test_missing_byte_sizes_come_back_as_an_error():
    cc.register_targets("cpu")
    with pytest.raises(Exception, match="pipemark: missing int64 array attribute 'byte_sizes'"):
        jax.block_until_ready(_raw_call("pipeline_marker", [jnp.ones(2)], name="a"))


def test_plan_copies_rejects_bad_tables():
    with pytest.raises(pm.PipemarkError, match="overlapping ranges"):
        cc.plan_copies([0], [8], [16])
    with pytest.raises(pm.PipemarkError, match="negative size"):
        cc.plan_copies([0], [64], [-1])
    with pytest.raises(pm.PipemarkError, match="one of each per buffer"):
        cc.plan_copies([0, 1], [64], [1])


# --------------------------------------------------- registration and availability


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_registering_and_selecting_twice_is_harmless():
    done = _python(
        "import jax, jax.numpy as jnp, pipemark as pm\n"
        "from pipemark import custom_call as cc\n"
        "cc.register_targets('cpu'); cc.register_targets('cpu'); cc.register_targets('CPU')\n"
        "pm.set_lowering('custom_call'); pm.set_lowering('custom_call')\n"
        "with pm.lowering('custom_call'):\n"
        "    y = jax.jit(lambda x: pm.mark(x, name='a', mark_type='start') * 2)(jnp.ones(3))\n"
        "cc.register_targets('cpu'); pm.set_lowering('custom_call')\n"
        "print(float(y.sum()), sorted(cc.registered_platforms()))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6.0 ['cpu']"


def test_import_pipemark_does_not_import_cupy_or_pallas():
    done = _python(
        "import sys, jax, pipemark as pm\n"
        "with pm.lowering('custom_call'):\n"
        "    jax.jit(lambda x: pm.mark(x, name='a', mark_type='end'))(1.0)\n"
        "print('cupy' in sys.modules, 'jax.experimental.pallas' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"


def test_gpu_without_cupy_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(pm.PipemarkError, match=r"pip install 'pipemark\[gpu\]'"):
        pm.set_lowering("custom_call")
    with (
        pytest.raises(pm.PipemarkError, match="CuPy, which is not installed"),
        pm.lowering("custom_call"),
    ):
        pass
    assert "cuda" not in cc.registered_platforms()
    assert get_lowering() == "barrier"


def test_unsupported_platform_is_refused():
    with pytest.raises(pm.PipemarkError, match="'cpu', 'cuda' and 'tpu', not 'rocm'"):
        cc.register_targets("rocm")
    for bad in (None, 3, ["cpu"]):
        with pytest.raises(pm.PipemarkError, match="platform must be 'cpu', 'cuda' or 'tpu'"):
            cc.register_targets(bad)


def test_cuda_sources_are_found_in_the_checkout():
    assert cc.kernel_dir() == REPO / "kernels"
    assert cc.KERNEL_NAME in cc.kernel_sources()[cc.KERNEL_FILE]


def test_installed_package_ships_the_cuda_sources(tmp_path):
    # build_py lays out exactly the files a wheel of pipemark contains; importing from
    # there (not from the editable checkout) finds the sources inside the package.
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(site)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert (site / "pipemark" / "kernels" / cc.KERNEL_FILE).is_file()
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", "import pipemark.custom_call as c; print(c.kernel_dir())"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(site / "pipemark" / "kernels")


# -------------------------------------------------------------------------- GPU


def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_devices(), reason="needs an NVIDIA GPU")
def test_cuda_targets_match_identity_mode():
    pytest.importorskip("cupy")
    x, w1, w2 = (jax.device_put(a, _cuda_devices()[0]) for a in _inputs())
    f = jax.jit(jax.grad(_model, argnums=(1, 2)))
    expected = _run(f, x, w1, w2, mode="identity")
    got = _run(f, x, w1, w2, mode="custom_call")
    jax.tree_util.tree_map(np.testing.assert_allclose, got, expected)
    outs = jax.jit(lambda *a: cc.identity(*a, alias=False))(x, w1[:, :1], jnp.zeros(0))
    np.testing.assert_array_equal(outs[1], w1[:, :1])
