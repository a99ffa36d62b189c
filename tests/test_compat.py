"""Tests for pipemark._compat: its table of what differs between JAX versions, each
difference where pipemark relies on it, the guard that fails on a JAX whose internals
are in a form the table does not know, and copy_to_device, the runtime's cross-device
hand-off.

Copies between two devices use the host CPU devices the root conftest.py asks JAX for.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun
from jax.sharding import make_single_device_sharding

import pipemark as pm
from pipemark import _compat

# ============================================================ the version table


def _scan_program(c, k, xs, ys):
    """A scan with 2 consts (c, k), 2 carries and 2 xs of distinct shapes."""

    def body(carry, x):
        a, b = carry
        xa, xb = x
        return (a * c[0] + xa, b + k * xb.sum()), a.sum() + xb[0]

    return jax.lax.scan(body, (jnp.zeros(3), jnp.zeros(())), (xs, ys))


SCAN_ARGS = (jnp.ones(1), jnp.float32(2.0), jnp.ones((4, 3)), jnp.ones((4, 5)))


def test_scan_operand_counts_name_the_consts_carry_and_xs_of_jax_s_scan():
    (eqn,) = [
        e for e in jax.make_jaxpr(_scan_program)(*SCAN_ARGS).eqns if e.primitive.name == "scan"
    ]
    num_consts, num_carry = _compat.scan_operand_counts(eqn.params)
    assert (num_consts, num_carry) == (2, 2)
    shapes = [v.aval.shape for v in eqn.invars]
    # consts (c, k), carry (a, b), xs (stacked along the 4 iterations).
    assert shapes[:num_consts] == [(1,), ()]
    assert shapes[num_consts : num_consts + num_carry] == [(3,), ()]
    assert shapes[num_consts + num_carry :] == [(4, 3), (4, 5)]
    assert [v.aval.shape for v in eqn.outvars[:num_carry]] == [(3,), ()]


def test_scan_operand_counts_refuse_params_of_an_unknown_form():
    with pytest.raises(_compat.JaxVersionError, match=r"scan operand groups.*VERSION_TABLE"):
        _compat.scan_operand_counts({"jaxpr": None, "length": 2, "groups": (1, 1, 1)})


@pytest.mark.parametrize("num_chunks", [2, 4])
def test_split_scan_equals_jax_on_this_jax_s_scan_params(num_chunks):
    # split_scan rebuilds the scan per chunk from the counts _compat reads: the carries and
    # stacked results equal JAX's evaluation of the unsplit function.
    cj = jax.make_jaxpr(_scan_program)(*SCAN_ARGS)
    split = pm.passes.split_scan(cj, num_chunks)
    assert sum(e.primitive.name == "scan" for e in split.eqns) == num_chunks
    got = jaxpr_as_fun(split)(*SCAN_ARGS)
    want = jax.tree.leaves(jax.jit(_scan_program)(*SCAN_ARGS))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def _marker_program(x, y):
    x, y = pm.mark((x, y), name="s", mark_type="start")
    return pm.mark((jnp.sin(x), jnp.cos(y)), name="s", mark_type="end")[0]


def test_jax_s_own_dce_runs_the_marker_rule_in_its_calling_convention():
    from jax.interpreters import partial_eval as pe

    cj = jax.make_jaxpr(_marker_program)(1.0, 2.0)
    jaxpr, used_inputs = pe.dce_jaxpr(cj.jaxpr, [True])
    markers = [e for e in jaxpr.eqns if e.primitive is pm.pipeline_p]
    # Both markers stay (structural) with only the x operand; cos(y) is gone.
    assert [len(e.invars) for e in markers] == [1, 1]
    assert [e.primitive.name for e in jaxpr.eqns] == ["pipeline_marker", "sin", "pipeline_marker"]
    assert used_inputs == [True, False]


def test_dce_rule_calls_jax_s_rules_as_used_outputs_then_eqn():
    # JAX's own rule for scan, whatever its signature on this JAX.
    cj = jax.make_jaxpr(_scan_program)(*SCAN_ARGS)
    (eqn,) = [e for e in cj.eqns if e.primitive.name == "scan"]
    rule = _compat.dce_rule(eqn.primitive)
    assert rule is not None
    used_inputs, new_eqn = rule([True, False, False], eqn)  # the first carry only
    assert len(used_inputs) == len(eqn.invars)
    assert new_eqn is not None and len(new_eqn.outvars) < len(eqn.outvars)


def test_pipemark_dce_equals_jax_on_a_marked_scan():
    def f(c, k, xs, ys):
        out = _scan_program(c, k, xs, ys)
        return pm.mark(out[0][0], name="s", mark_type="boundary")

    cj = jax.make_jaxpr(f)(*SCAN_ARGS)
    pruned = pm.passes.dce(cj)

    np.testing.assert_allclose(
        np.asarray(jaxpr_as_fun(pruned)(*SCAN_ARGS)[0]),
        np.asarray(jax.jit(f)(*SCAN_ARGS)),
        rtol=1e-6,
    )
    (scan,) = [e for e in pruned.eqns if e.primitive.name == "scan"]
    assert len(scan.outvars) < len(next(e for e in cj.eqns if e.primitive.name == "scan").outvars)


@pytest.mark.parametrize("mode", ["barrier", "identity", "custom_call"])
def test_jit_of_a_marked_program_equals_the_unmarked_one(mode):
    # jit runs JAX's DCE (the rule's calling convention) and the registered lowering.
    with pm.lowering(mode):
        got = jax.jit(jax.value_and_grad(_marker_program))(1.0, 2.0)
    want = jax.value_and_grad(lambda x, y: jnp.sin(x))(1.0, 2.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# ======================================================= the guard for the next JAX
# These fail on a JAX whose internals are not in a form _compat knows, naming the row of
# _compat.VERSION_TABLE (or the params) that changed: the place to update.


@pytest.mark.parametrize("row", sorted(_compat.VERSION_TABLE))
def test_guard_every_row_is_in_a_known_form(row):
    form = _compat.jax_form(row)
    assert form in _compat.VERSION_TABLE[row], (
        f"JAX {jax.__version__}: {row!r} is {form!r}, not one of the forms "
        f"pipemark._compat.VERSION_TABLE knows ({sorted(_compat.VERSION_TABLE[row])})"
    )


def test_guard_scan_params_hold_one_known_form_of_operand_groups():
    params = _compat.traced_params("scan")
    old = {"num_consts", "num_carry"} <= set(params)
    new = "ft_in" in params and "ft_out" in params
    assert old != new, (
        f"JAX {jax.__version__} changed scan's operand groups: params {sorted(params)}; "
        "update 'scan operand groups' in pipemark._compat.VERSION_TABLE and scan_operand_counts"
    )
    if new:
        # The flat trees group the operands as (consts, carry, xs), the results (carry, ys).
        assert len(params["ft_in"].unpack()) == 3, params["ft_in"]
        assert len(params["ft_out"].unpack()) == 2, params["ft_out"]


@pytest.mark.parametrize(
    "primitive",
    sorted(
        set(_compat.PARAMS_READ)
        | {
            "scan",
            "cond",
            "while",
            "jit",
            "remat2",
            "custom_jvp_call",
            "custom_vjp_call",
            "shard_map",
        }
    ),
)
def test_guard_the_params_pipemark_reads_exist(primitive):
    params = _compat.traced_params(primitive)
    wanted = (*_compat.BODY_PARAMS.get(primitive, ()), *_compat.PARAMS_READ.get(primitive, ()))
    missing = [name for name in wanted if name not in params]
    assert not missing, (
        f"JAX {jax.__version__} renamed or dropped {primitive}'s params {missing} (it has "
        f"{sorted(params)}); update BODY_PARAMS / PARAMS_READ and 'body params' in "
        "pipemark._compat.VERSION_TABLE"
    )


def test_guard_the_dce_rule_signature_is_the_one_compat_expects():
    from jax.interpreters import partial_eval as pe

    # JAX's own rule for closed calls takes the arguments every rule is called with.
    names = list(inspect.signature(pe.dce_jaxpr_closed_call_rule).parameters)
    expected = 3 if _compat.DCE_RULE_TAKES_LIVE_INS else 2
    assert len(names) == expected and names[-1] == "eqn", (
        f"JAX {jax.__version__}'s DCE rules take {names}; pipemark._compat expects "
        f"{_compat.jax_form('DCE rule signature')}: update 'DCE rule signature' in "
        "VERSION_TABLE and register_dce_rule / dce_rule"
    )


def test_guard_lowering_and_ffi_entry_points_exist():
    from jax.interpreters import mlir

    params = list(inspect.signature(mlir.register_lowering).parameters)
    assert params[:3] == ["prim", "rule", "platform"], (
        f"JAX {jax.__version__}: mlir.register_lowering takes {params}; update "
        "'lowering registration' in pipemark._compat.VERSION_TABLE"
    )
    wanted = ("register_ffi_target", "pycapsule", "build_ffi_lowering_function", "ffi_call")
    missing = [name for name in wanted if not hasattr(jax.ffi, name)]
    assert not missing, f"JAX {jax.__version__}: jax.ffi lacks {missing}; update 'FFI'"


def test_guard_the_pallas_tpu_entry_points_exist():
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    wanted = {
        "pl.pallas_call": (pl.pallas_call, {"name", "metadata", "input_output_aliases"}),
        "pltpu.CompilerParams": (pltpu.CompilerParams, {"has_side_effects"}),
        "jax.sharding.AbstractMesh": (jax.sharding.AbstractMesh, {"abstract_device"}),
    }
    missing = {
        what: sorted(params - set(inspect.signature(fn).parameters))
        for what, (fn, params) in wanted.items()
    }
    names = ("make_async_copy", "SemaphoreType")
    missing["pltpu"] = [name for name in names if not hasattr(pltpu, name)]
    missing["pl"] = [] if hasattr(pl, "ANY") else ["ANY"]
    assert not any(missing.values()), (
        f"JAX {jax.__version__}: Pallas TPU lacks {missing}; update 'Pallas TPU kernel' "
        "in pipemark._compat.VERSION_TABLE and pipemark.pallas_identity"
    )


def _tested_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    setup = (Path(__file__).parents[1] / "setup.py").read_text(encoding="utf-8")
    low, high = re.search(r'"jax>=([\d.]+),<([\d.]+)"', setup).groups()
    return tuple(map(int, low.split("."))), tuple(map(int, high.split(".")))


def test_guard_the_installed_jax_is_in_the_tested_range():
    low, high = _tested_range()
    version = tuple(jax.__version_info__[:3])
    assert low <= version < high, (
        f"JAX {jax.__version__} is outside the range setup.py declares tested "
        f"({low} to below {high}): run the suite on it (CONTRIBUTING.md, 'Moving to "
        "another JAX'), record its forms in pipemark._compat.VERSION_TABLE, then move the bound"
    )


# ================================================================== copy_to_device


def _check_copies(copies, sources, device):
    assert len(copies) == len(sources)
    for copy, source in zip(copies, sources):
        assert isinstance(copy, jax.Array)
        assert copy.devices() == {device}
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(source))


def test_copies_jax_and_numpy_values_in_order():
    device = jax.devices()[0]
    sources = [jnp.arange(6.0).reshape(2, 3), np.float32(0.25), jnp.ones(3, jnp.int32), 1.5]
    _check_copies(_compat.copy_to_device(sources, device), sources, device)


def test_uses_the_direct_call_for_jax_arrays_only(monkeypatch):
    if _compat._batched_copy is None:
        pytest.skip("this jaxlib has no batched_copy_array_to_devices_with_sharding")
    calls = []
    direct = _compat._batched_copy

    def spy(arrays, *rest):
        calls.append(len(arrays))
        return direct(arrays, *rest)

    monkeypatch.setattr(_compat, "_batched_copy", spy)
    monkeypatch.setattr(_compat, "_fast_copy_failed", False)
    device = jax.devices()[0]
    sources = [jnp.ones(2), np.zeros(2), jnp.arange(3)]
    _check_copies(_compat.copy_to_device(sources, device), sources, device)
    assert calls == [2]  # the NumPy array went through jax.device_put
    _compat.copy_to_device([np.ones(2)], device)
    assert calls == [2]  # nothing for the direct call: not called


def test_falls_back_to_device_put_when_the_direct_call_refuses(monkeypatch):
    def refuses(*args):
        raise TypeError("incompatible function arguments")

    monkeypatch.setattr(_compat, "_batched_copy", refuses)
    monkeypatch.setattr(_compat, "_fast_copy_failed", False)
    device = jax.devices()[0]
    sources = [jnp.ones(2), np.zeros(3)]
    _check_copies(_compat.copy_to_device(sources, device), sources, device)
    assert _compat._fast_copy_failed  # and later calls skip it
    _check_copies(_compat.copy_to_device(sources, device), sources, device)


def test_falls_back_without_the_direct_call(monkeypatch):
    monkeypatch.setattr(_compat, "_batched_copy", None)
    device = jax.devices()[0]
    sources = [jnp.ones(2), np.zeros(3)]
    _check_copies(_compat.copy_to_device(sources, device), sources, device)


def test_copies_between_two_devices_including_a_value_still_being_computed():
    d0, d1 = jax.devices()[:2]
    a = jax.device_put(jnp.arange(12.0).reshape(3, 4), d0)
    # A value still being computed: a program big enough for XLA to run it
    # asynchronously (the copy is enqueued behind it).
    f = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x, out_shardings=make_single_device_sharding(d0))
    b = f(jnp.ones((256, 256)))
    copies = _compat.copy_to_device([a, b, np.float32(2.0)], d1)
    assert [c.devices() for c in copies] == [{d1}] * 3, copies
    assert all(c.committed for c in copies)
    np.testing.assert_array_equal(np.asarray(copies[0]), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(copies[1]), np.asarray(b))
    assert float(copies[2]) == 2.0
    # A program on d1 accepts the copies (committed to d1).
    g = jax.jit(lambda x, y: x.sum() + y.sum())
    assert g(copies[0], copies[1]).devices() == {d1}
    # The sources are untouched and stay where they were.
    assert a.devices() == {d0} and b.devices() == {d0}


@pytest.mark.parametrize("fast", [True, False])
def test_global_array_maker_equals_the_public_constructor(monkeypatch, fast):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if not fast:  # a JAX without the fast constructor: the public function
        monkeypatch.setattr(_compat, "_ArrayImpl", None)
    device = jax.devices()[0]
    sharding = NamedSharding(Mesh(np.array([device]), ("pair",)), P("pair"))
    block = jax.device_put(jnp.arange(6.0, dtype=jnp.float32).reshape(3, 2), device)
    make = _compat.global_array_maker((3, 2), np.float32, sharding)
    got = make([block])
    want = jax.make_array_from_single_device_arrays((3, 2), sharding, [block])
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.sharding == want.sharding and got.committed
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A program takes it like the public function's array.
    assert float(jax.jit(lambda x: x.sum())(got)) == 15.0


DELETED = """\
import jax, jax.numpy as jnp
from pipemark._compat import copy_to_device
x = jnp.ones(4) + 1
y = jnp.zeros(4) + 1
x.delete()
try:
    copy_to_device([y, x], jax.devices()[0])
except RuntimeError as error:
    print("RuntimeError:", error)
"""


def test_copying_a_deleted_array_raises_as_jax_does_not_segfaults():
    # In a subprocess: before the fix the direct copy read freed memory (exit 139).
    done = subprocess.run(
        [sys.executable, "-c", DELETED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "RuntimeError: Array has been deleted" in done.stdout
