"""pipemark._ffi: the generic typed-FFI handler, registered here under test-only target
names with handlers of the tests' own (the real targets are tested in
test_custom_call.py)."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipemark import _ffi

_requests: list[_ffi.CopyRequest] = []


def _record_and_copy(api, frame, request: _ffi.CopyRequest) -> None:
    del api, frame
    _requests.append(request)
    for src, dst, size in zip(request.srcs, request.dsts, request.sizes):
        ctypes.memmove(dst, src, size)


def _raise(api, frame, request) -> None:
    raise RuntimeError("boom")


_TARGETS = {
    "pipemark_test_ffi_copy": _record_and_copy,
    "pipemark_test_ffi_raise": _raise,
}
# XLA keeps raw pointers to the handlers, and registering a name twice kills the
# process: register once per process, keep the handlers alive.
_handlers: dict[str, object] = {}


def _register() -> None:
    for name, execute in _TARGETS.items():
        if name not in _handlers:
            handler = _handlers[name] = _ffi.make_handler(execute, traits=0)
            jax.ffi.register_ffi_target(
                name, jax.ffi.pycapsule(handler), platform="cpu", api_version=1
            )


def _call(target: str, arrays, results=None, **attrs):
    _register()
    avals = (
        results if results is not None else [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    )
    return jax.ffi.ffi_call(target, avals, has_side_effect=True)(*arrays, **attrs)


def _sizes(*arrays) -> np.ndarray:
    return np.array([a.size * a.dtype.itemsize for a in arrays], np.int64)


def test_a_handler_gets_the_operands_results_and_byte_sizes():
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.arange(4, dtype=jnp.int8)
    _requests.clear()
    out = jax.block_until_ready(_call("pipemark_test_ffi_copy", [x, y], byte_sizes=_sizes(x, y)))
    np.testing.assert_array_equal(out[0], x)
    np.testing.assert_array_equal(out[1], y)
    (request,) = _requests
    assert request.sizes == (24, 4)
    assert all(request.srcs) and all(request.dsts)
    assert set(request.srcs).isdisjoint(request.dsts)  # no aliasing asked for


def test_any_exception_in_a_handler_comes_back_as_an_error():
    x = jnp.ones(3)
    with pytest.raises(Exception, match=r"pipemark: RuntimeError\('boom'\)"):
        jax.block_until_ready(_call("pipemark_test_ffi_raise", [x], byte_sizes=_sizes(x)))
    # The process is alive and the target still works.
    out = _call("pipemark_test_ffi_copy", [x], byte_sizes=_sizes(x))
    np.testing.assert_array_equal(out[0], x)


def test_a_result_count_unlike_the_operand_count_is_refused():
    x = jnp.ones(3)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2
    with pytest.raises(Exception, match="needs one result per operand; got 1 operands and 2"):
        jax.block_until_ready(
            _call("pipemark_test_ffi_copy", [x], results=results, byte_sizes=_sizes(x))
        )


def test_a_non_integer_array_attribute_is_refused():
    x = jnp.ones(3)
    with pytest.raises(Exception, match="attribute 'byte_sizes' must be an int64 array"):
        jax.block_until_ready(
            _call("pipemark_test_ffi_copy", [x], byte_sizes=np.array([12.0], np.float32))
        )
