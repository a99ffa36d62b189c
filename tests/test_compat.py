"""Tests for pipemark._compat.copy_to_device, the runtime's cross-device hand-off.

Copies between two devices run in a subprocess with 2 host CPU devices, because XLA
reads ``--xla_force_host_platform_device_count`` only when JAX starts; this process has
one device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipemark import _compat


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


_TWO_DEVICES = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import SingleDeviceSharding
    from pipemark._compat import copy_to_device

    d0, d1 = jax.devices()
    a = jax.device_put(jnp.arange(12.0).reshape(3, 4), d0)
    # A value still being computed: a program big enough for XLA to run it
    # asynchronously (the copy is enqueued behind it).
    f = jax.jit(lambda x: jnp.tanh(x @ x.T) @ x, out_shardings=SingleDeviceSharding(d0))
    b = f(jnp.ones((256, 256)))
    copies = copy_to_device([a, b, np.float32(2.0)], d1)
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
    print("ok")
    """
)


def test_copies_between_two_devices_including_a_value_still_being_computed():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICES],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


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
