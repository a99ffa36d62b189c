"""The TPU custom-call marker: the Pallas identity kernel (pipemark.pallas_identity).

On CPU the kernel runs with Pallas's interpreter (``interpret=True``), and the TPU
lowering is checked in the StableHLO that ``jax.export`` makes for platform ``"tpu"``.
The tests marked ``tpu`` run the compiled kernel and need a TPU.
"""

from __future__ import annotations

import functools
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import custom_call as cc
from pipemark import examples
from pipemark import pallas_identity as pi
from pipemark.caches import clear_caches
from pipemark.primitive import is_marker

ON_TPU = jax.default_backend() == "tpu"
needs_tpu = pytest.mark.skipif(not ON_TPU, reason="needs a TPU")


def _arrays():
    """Small arrays of the shapes and dtypes a marker meets: odd shapes, a scalar,
    bf16, int8, int32 and bool."""
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((5, 7)), jnp.float32),
        jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.bfloat16),
        jnp.arange(9, dtype=jnp.int32),
        jnp.float32(2.5),
        jnp.asarray(rng.integers(-100, 100, (33, 128)), jnp.int8),
        jnp.asarray([True, False, True]),
    )


def _assert_returned(arrays, outs):
    """``outs`` are ``arrays``: one each, same shapes, dtypes and values."""
    assert len(outs) == len(arrays)
    for a, b in zip(arrays, outs):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------ the kernel, interpreted on CPU


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copying"])
def test_kernel_returns_its_operands_under_jit(alias):
    arrays = _arrays()
    outs = jax.jit(lambda *a: pi.identity(*a, alias=alias, interpret=True))(*arrays)
    _assert_returned(arrays, outs)


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copying"])
def test_kernel_under_grad_and_vmap(alias):
    x = jnp.arange(12.0).reshape(3, 4)
    w = jnp.arange(4, dtype=jnp.bfloat16)

    def f(x, w):
        y, v = pi.identity(x, w, alias=alias, interpret=True)
        return jnp.sum(y**2) + jnp.sum(v.astype(jnp.float32))

    grads = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(grads[0], 2 * x)
    np.testing.assert_array_equal(grads[1], np.ones(4))
    batched = jax.jit(jax.vmap(lambda r: pi.identity(r, alias=alias, interpret=True)[0] * 2))(x)
    np.testing.assert_array_equal(batched, 2 * x)


def test_large_arrays_are_copied_by_several_concurrent_dmas(monkeypatch):
    monkeypatch.setattr(pi, "MIN_DMA_BYTES", 1024)  # so that 100 KiB is "large"
    x = jnp.arange(100 * 256, dtype=jnp.float32).reshape(100, 256)
    assert pi.dma_slices(x.shape, 4) == ((0, 32), (32, 64), (64, 100))
    copy = functools.partial(pi.identity, alias=False, block_bytes=None)  # DMAs only
    (y,) = jax.jit(lambda x: copy(x, interpret=True))(x)
    np.testing.assert_array_equal(y, x)
    text = jax.jit(lambda x: copy(x)).trace(x).lower(lowering_platforms=("tpu",))
    assert text.as_text().count("@tpu_custom_call") == 1


def test_copy_blocks_stream_whole_tiles_and_leave_the_rest_to_dmas():
    shapes = [(1000, 512), (64, 3, 128), (4096,), (300, 128), (8, 2**20), (0, 128), (4, 4)]
    itemsizes = [4, 2, 4, 1, 4, 4, 8]
    steps, rows = pi.copy_blocks(shapes, itemsizes, block_bytes=64 * 1024)
    # 1-D, a 32 MiB block of 8 whole rows, empty, 64-bit: by DMA
    assert rows[2:] == (None, 32, None, None, None)
    assert rows[0] % 8 == 0 and rows[3] % 32 == 0  # float32 / int8 sublane tiles
    assert steps == max(-(-s[0] // r) for s, r in zip(shapes, rows) if r)
    blocked = [(s, i, r) for s, i, r in zip(shapes, itemsizes, rows) if r]
    total = sum(np.prod(s) * i for s, i, _ in blocked)
    assert steps >= total / (64 * 1024) - 1  # the budget a step moves
    for shape, _, r in blocked:  # every row is in a block, within the steps
        assert -(-shape[0] // r) <= steps
    assert pi.copy_blocks([(5, 7)], [4]) == (1, (5,))  # one block: the whole array


def test_blocked_and_dma_copies_in_one_call_return_every_array():
    arrays = (*_arrays(), jnp.arange(100 * 256, dtype=jnp.float32).reshape(100, 256))
    # 16 KiB a step: the 100-row array in 7 blocks of 16 rows (the last ragged), the
    # int8 one in 2 blocks, the small ones once, the 1-D ones by DMAs over the steps.
    shaped = [pi._to_kernel(a) for a in arrays]  # what the kernel sees: scalar as (1, 1)
    steps, rows = pi.copy_blocks(
        [a.shape for a in shaped], [a.dtype.itemsize for a in shaped], 16384
    )
    assert steps == 7 and rows[-1] == 16 and rows[4] == 32 and rows[2] is None is rows[5]
    outs = jax.jit(lambda *a: pi.identity(*a, alias=False, block_bytes=16384, interpret=True))(
        *arrays
    )
    _assert_returned(arrays, outs)
    lowered = jax.jit(lambda x: pi.identity(x, alias=False)).trace(arrays[-1])
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("@tpu_custom_call") == 1


def test_bad_block_sizes_are_refused():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(pm.PipemarkError, match="block_bytes must be a positive int"):
            pi.identity(jnp.ones((8, 8)), alias=False, block_bytes=bad, interpret=True)


def test_bad_dma_counts_are_refused():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(pm.PipemarkError, match="dmas must be a positive int"):
            pi.identity(jnp.ones(3), alias=False, dmas=bad, interpret=True)


def test_dma_slices_cover_the_array_in_aligned_pieces():
    mib = 2**20
    assert pi.dma_slices((2**28,), 4) == (None,)  # 1 GiB, but 1-D: one DMA
    assert pi.dma_slices((1024, 1024), 4) == (None,)  # 4 MiB: one DMA
    for shape, itemsize, dmas in [
        ((8192, 8192), 4, 4),
        ((1000, 33, 1024), 2, 8),
        ((8200, 4096), 1, 3),
    ]:
        slices = pi.dma_slices(shape, itemsize, dmas)
        assert 2 <= len(slices) <= dmas
        assert slices[0][0] == 0 and slices[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
        row_bytes = np.prod(shape[1:]) * itemsize
        assert all((stop - start) * row_bytes >= 16 * mib for start, stop in slices)
        if len(shape) == 2:
            assert all(start % 32 == 0 for start, _ in slices)


# --------------------------------------------------- markers lowered for TPU, on CPU


def _model(x, w, b, key):
    x, w, b, key = pm.mark((x, w, b, key), name="layer0", mark_type="start")
    pm.mark_pipeline_boundary()
    y = pm.mark(jnp.tanh(x @ w + b), name="tap", mark_type="hook")
    (y,) = pm.mark((y,), name="layer0", mark_type="end")
    return jnp.sum(y**2) + jnp.sum(jax.random.uniform(key, (2,)))


def _model_args():
    return (
        jnp.ones((8, 128)),
        jnp.full((128, 256), 0.01),
        jnp.zeros(256),
        jax.random.key(0),
    )


def _kernels(text):
    """(kernel name, metadata, operand count) of each tpu_custom_call in StableHLO text."""
    found = []
    for line in text.splitlines():
        if "@tpu_custom_call" not in line:
            continue
        kernel = re.search(r'kernel_name = "([^"]*)"', line).group(1)
        raw = re.search(r'kernel_metadata = "((?:[^"\\]|\\.)*)"', line).group(1)
        metadata = json.loads(raw.replace("\\0A", "").replace("\\22", '"'))
        operands = re.search(r"@tpu_custom_call\(([^)]*)\)", line).group(1)
        assert "has_side_effect = true" in line
        found.append((kernel, metadata, len([o for o in operands.split(",") if o.strip()])))
    return found


def _markers(fn, *args):
    cj = jax.make_jaxpr(fn)(*args)
    return [eqn.params for eqn in cj.eqns if is_marker(eqn)]


def test_every_marker_but_hooks_lowers_to_a_named_tpu_kernel():
    step = jax.value_and_grad(_model, argnums=(0, 1, 2))
    args = _model_args()  # outside the context: there, newer JAX runs no eager op
    with pm.lowering("custom_call"), pi.lowering_for_tpu():
        text = jax.export.export(jax.jit(step), platforms=["tpu"])(*args).mlir_module()
    kernels = _kernels(text)
    want = [p for p in _markers(step, *args) if p["mark_type"] != "hook"]
    assert len(want) == 5  # start, boundary and end forward; end and start backward
    assert sorted((k, tuple(sorted(m.items()))) for k, m, _ in kernels) == sorted(
        (
            pi.kernel_name(p["name"], p["mark_type"]),
            (("mark_type", p["mark_type"]), ("name", p["name"])),
        )
        for p in want
    )
    operands = {k: n for k, _, n in kernels}
    assert operands["pipeline_marker.start.layer0"] == 3  # the PRNG key passes around
    assert operands["pipeline_marker.boundary.boundary"] == 0
    assert "pipeline_marker.hook" not in text and "optimization_barrier" in text
    assert "@pipeline_marker" not in text  # no CPU/CUDA target in a TPU program


def test_tpu_kernels_alias_and_keep_scalars_and_bools_as_kernel_types():
    def f(s, flags, empty, x4):
        return pm.mark((s, flags, empty, x4), name="s", mark_type="end")

    args = (
        jnp.float32(1.0),
        jnp.ones((8, 128), bool),
        jnp.zeros((0, 3)),
        jnp.arange(6, dtype=jnp.int4),
    )
    with pm.lowering("custom_call"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    (call,) = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    # the scalar as (1, 1), the bools as uint8; the empty and int4 arrays pass around
    assert "(tensor<1x1xf32>, tensor<8x128xui8>) -> (tensor<1x1xf32>, tensor<8x128xui8>)" in call
    # the bools aliased; the scalar copied (aliased, a TPU v5e returned other bytes)
    assert call.count("output_operand_alias<") == 1 and "operand_index = 1" in call


def test_vmapped_markers_lower_with_their_batched_shapes():
    f = jax.vmap(lambda x: pm.mark(x * 2, name="b", mark_type="start"))
    with pm.lowering("custom_call"):
        text = jax.jit(f).trace(jnp.ones((4, 8, 128))).lower(lowering_platforms=("tpu",)).as_text()
    (call,) = [line for line in text.splitlines() if "@tpu_custom_call" in line]
    assert "(tensor<4x8x128xf32>) -> tensor<4x8x128xf32>" in call


def test_lowering_for_cpu_and_tpu_at_once_gives_each_its_kernel():
    args = _model_args()
    with pm.lowering("custom_call"), pi.lowering_for_tpu():
        lowered = jax.jit(_model).trace(*args).lower(lowering_platforms=("cpu", "tpu"))
    text = lowered.as_text()
    assert text.count("@tpu_custom_call") == 3 and text.count("@pipeline_marker") == 3


def test_markers_in_scan_cond_and_checkpoint_lower_for_tpu():
    def body(carry, w):
        (carry,) = pm.mark((jnp.tanh(carry @ w),), name="shared", mark_type="end")
        return carry, None

    def f(x, ws):
        x = jax.lax.scan(body, x, ws)[0]
        x = jax.lax.cond(jnp.sum(x) > 0, lambda x: pm.mark(x, name="c", mark_type="start"),
                         lambda x: -x, x)  # fmt: skip
        return jnp.sum(jax.checkpoint(lambda x: pm.mark(x * 2, name="k", mark_type="end"))(x))

    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    args = (jnp.ones((8, 128)), jnp.full((3, 128, 128), 0.01))
    with pm.lowering("custom_call"):
        text = step.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    names = {kernel for kernel, _, _ in _kernels(text)}
    assert {f"pipeline_marker.{k}" for k in ("end.shared", "start.c", "end.k")} <= names
    assert any(name.endswith("_backward") for name in names)


@pytest.mark.skipif(ON_TPU, reason="a TPU host knows its TPU's kind")
def test_rank_one_operands_need_a_tpu_kind_off_a_tpu():
    f = jax.jit(lambda b: pm.mark(b, name="bias", mark_type="start"))
    with pm.lowering("custom_call"), pytest.raises(pm.PipemarkError, match="lowering_for_tpu"):
        jax.export.export(f, platforms=["tpu"])(jnp.zeros(256))


def test_a_program_sharded_over_several_devices_is_refused():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.P("x"))
    f = jax.jit(lambda x: pm.mark(x, name="s", mark_type="start") * 2, in_shardings=sharding)
    with pm.lowering("custom_call"), pytest.raises(pm.PipemarkError, match="shard_map"):
        f.trace(jnp.ones((8, 128))).lower(lowering_platforms=("tpu",))


def test_tpu_targets_register_and_count_nothing():
    cc.check_available("tpu")
    cc.register_targets("TPU")  # once per process: the second call does nothing
    assert "tpu" in cc.registered_platforms()
    assert cc.copy_stats("tpu") == cc.CopyStats()


# ------------------------------- markers through the interpreted kernel, end to end


@pytest.fixture
def pallas_on_cpu(monkeypatch):
    if ON_TPU:
        pytest.skip("on a TPU the tests marked tpu run the compiled kernel instead")
    """Markers under pm.lowering("custom_call") lower on CPU to the Pallas kernel run by
    Pallas's interpreter: the TPU lowering, end to end, on CPU. pipemark's caches of
    compiled stage programs are emptied before and after, so that no program lowered
    with the other kernel is reused either way; the test must use fresh functions,
    which JAX's jit cache cannot answer. The CPU target must make no call."""
    rule = functools.partial(pi.lower_marker, interpret=True)
    monkeypatch.setitem(cc.PLATFORM_LOWERINGS, "cpu", rule)
    clear_caches()
    cc.reset_cpu_copy_stats()
    yield
    clear_caches()
    assert cc.cpu_copy_stats().calls == 0


def test_marked_programs_through_the_kernel_equal_identity_lowering(pallas_on_cpu):
    args = _model_args()
    # Fresh functions: jit caches what it lowered with the FFI target elsewhere.
    programs = {
        "grad": lambda: jax.jit(jax.grad(lambda *a: _model(*a), argnums=(0, 1, 2))),
        "vmap": lambda: jax.jit(
            jax.vmap(lambda x, *a: _model(x, *a), in_axes=(0, None, None, None))
        ),
    }
    for name, make in programs.items():
        call_args = (jnp.stack([args[0], -args[0]]), *args[1:]) if name == "vmap" else args
        with pm.lowering("custom_call"):
            program = make()
            assert "@pipeline_marker" not in program.lower(*call_args).as_text()
            got = program(*call_args)
        with pm.lowering("identity"):
            want = make()(*call_args)
        jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-6), got, want)


@pytest.mark.slow  # 2-5 s: the runtime plans and compiles four stage programs
def test_pipeline_through_the_kernel_equals_value_and_grad(pallas_on_cpu):
    ex = examples.mlp(num_layers=2, width=8, batch=4)
    loss_fn = lambda params, batch: ex.loss_fn(params, batch)  # noqa: E731 (fresh)
    with pm.lowering("custom_call"):
        pipeline = pm.pipeline_value_and_grad(
            loss_fn, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]
        )
        got = pipeline(*ex.args)
    want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    jax.tree_util.tree_map(
        functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got, want
    )


# ------------------------------------------------------------------ on a real TPU


def _tpu_failures(run, arrays) -> dict:
    """``run(array)`` for each of ``arrays`` (it must return the array): the arrays it
    failed on, with what went wrong, so that one run on a TPU names them all."""
    failures = {}
    for a in arrays:
        key = f"{a.dtype}{list(a.shape)}"
        try:
            out = run(a)
            if not np.array_equal(np.asarray(out), np.asarray(a)):
                failures[key] = "wrong values"
        except Exception as error:  # every failure is reported
            failures[key] = f"{type(error).__name__}: {str(error)[:300]}"
    return failures


def _tpu_arrays():
    big = jnp.arange(64 * 2**18, dtype=jnp.float32).reshape(2048, -1)  # 64 MiB: 4 DMAs
    return (*_arrays(), jnp.arange(300.0), jnp.ones((8, 128), bool), big)


@pytest.mark.tpu
@needs_tpu
def test_tpu_markers_equal_identity_lowering():
    args = _model_args()
    step = jax.value_and_grad(_model, argnums=(0, 1, 2))
    with pm.lowering("custom_call"):
        compiled = jax.jit(step).lower(*args).compile().as_text()
        got = jax.jit(step)(*args)
    assert compiled.count('custom_call_target="tpu_custom_call"') == 5
    assert compiled.count("pipeline_marker.boundary.boundary") >= 1
    with pm.lowering("identity"):
        want = jax.jit(step)(*args)
    jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-5), got, want)

    def through_marker(a):
        with pm.lowering("custom_call"):
            return jax.jit(lambda a: pm.mark(a, name="one", mark_type="end"))(a)

    assert not _tpu_failures(through_marker, _tpu_arrays())


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copying"])
def test_tpu_identity_kernel_returns_every_array(alias):
    def through_kernel(a):
        return jax.jit(lambda a: cc.identity(a, alias=alias)[0])(a)

    assert not _tpu_failures(through_kernel, _tpu_arrays())


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("block_bytes", [4096, pi.DEFAULT_BLOCK_BYTES, None])
def test_tpu_copies_every_array_of_one_call(block_bytes):
    # Blocked (ragged blocks, small arrays copied once) and DMA copies in one kernel.
    arrays = (*_tpu_arrays(), jnp.arange(100 * 256, dtype=jnp.float32).reshape(100, 256))
    copy = functools.partial(pi.identity, alias=False, block_bytes=block_bytes)
    outs = jax.jit(lambda *a: copy(*a))(*arrays)
    _assert_returned(arrays, outs)


@pytest.mark.tpu
@needs_tpu
def test_tpu_pipeline_with_kernel_markers_equals_value_and_grad():
    ex = examples.transformer(num_layers=2, d_model=128, num_heads=2, seq=8, batch=4)
    with jax.default_matmul_precision("highest"):  # TPU float32 matmuls: bf16 passes
        with pm.lowering("custom_call"):
            pipeline = pm.pipeline_value_and_grad(  # two stages on the one chip
                ex.loss_fn,
                num_stages=2,
                num_microbatches=2,
                schedule="interleaved",
                devices=jax.devices()[:1],
            )
            got = pipeline(*ex.args)
        want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    jax.tree_util.tree_map(
        functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-5), got, want
    )
