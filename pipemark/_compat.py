"""The one place pipemark reaches into ``jax._src``, and its shims across JAX versions.

Each use says which JAX versions it was checked on. Everything else in pipemark uses
public JAX (``jax``, ``jax.extend``, ``jax.interpreters``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax as _jax
import numpy as np

# JAX 0.10.2 and 0.11.x: a config state that is part of the jit cache key and of the
# trace context. The marker lowering reads it, so `jit(f)` compiled under one lowering
# mode is never reused under another. There is no public way to define such a state.
from jax._src import config as _jax_config
from jax.extend.core import ClosedJaxpr as _ClosedJaxpr
from jax.extend.core import Jaxpr as _Jaxpr
from jax.sharding import SingleDeviceSharding as _SingleDeviceSharding

from pipemark.caches import register_cache

LOWERING_MODES = ("barrier", "identity", "custom_call")


def define_lowering_state():
    """A context-manager/setter object holding the marker lowering mode.

    Its default can be set with the ``PIPEMARK_LOWERING`` environment variable.
    """
    return _jax_config.enum_state(
        "pipemark_lowering",
        list(LOWERING_MODES),
        "barrier",
        help="How pipeline_marker equations lower: barrier, identity or custom_call.",
        include_in_jit_key=True,
        include_in_trace_context=True,
    )


# JAX 0.10.2 and 0.11.x: `eqn.source_info.name_stack` is a NameStack whose `.stack` holds
# `Scope` entries (from jax.named_scope / jax.named_call) and `Transform` entries (jvp,
# transpose, vmap, ...). There is no public accessor and its str() form mixes both, so
# the entries are told apart by class name (no jax._src import needed here).
def name_stack_scopes(source_info) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scope names and the transform names of an equation's name stack, outermost
    first: ``(("block1", "attn"), ("transpose", "jvp"))``."""
    stack = getattr(getattr(source_info, "name_stack", None), "stack", ()) or ()
    scopes: list[str] = []
    transforms: list[str] = []
    for entry in stack:
        kind = type(entry).__name__
        name = getattr(entry, "name", None)
        if not isinstance(name, str):
            continue
        if kind == "Transform":
            transforms.append(name)
        elif kind == "Scope":
            scopes.append(name)
    return tuple(scopes), tuple(transforms)


# JAX 0.10.2 and 0.11.x: `jaxpr.debug_info.arg_names` holds one key path per input as
# `jax.tree_util.keystr` writes it (``params['blocks'][0]['w']``), or None where unknown.
# It is debugging data (absent on a hand-built jaxpr), so anything read from it is a hint.
def input_paths(jaxpr) -> tuple[str | None, ...]:
    """The key path of each of ``jaxpr``'s inputs as traced (``"params['h'][0]"``), or
    None for each where the program does not record it."""
    names = getattr(getattr(jaxpr, "debug_info", None), "arg_names", None)
    if names is None or len(names) != len(jaxpr.invars):
        return (None,) * len(jaxpr.invars)
    return tuple(name if isinstance(name, str) else None for name in names)


# JAX 0.10.2: ClosedJaxpr and Jaxpr are two classes and `ClosedJaxpr.jaxpr` is the open
# Jaxpr. JAX 0.11.0 and later merged them: `ClosedJaxpr` is an alias of `Jaxpr`, every
# Jaxpr carries its (possibly empty) consts, `cj.jaxpr` is `cj` itself and `type(cj)`
# is named "Jaxpr". `ClosedJaxpr(jaxpr, consts)` and `jaxpr.replace(...)` still work, but
# an open Jaxpr can no longer be told from a closed one.
CLOSED_JAXPR_IS_JAXPR: bool = _ClosedJaxpr is _Jaxpr


def jaxpr_type_name(value: object) -> str:
    """The type name to show in an error message: ``"ClosedJaxpr"`` for a closed jaxpr on
    every JAX version (JAX 0.11 calls it ``Jaxpr``), else the type's own name."""
    if isinstance(value, _ClosedJaxpr):
        return "ClosedJaxpr"
    return type(value).__name__


# Call-like primitives whose body is the `call_jaxpr` param and runs once, beyond
# custom_jvp_call/custom_vjp_call. JAX 0.10.2 and 0.11.0 stage calls as "closed_call";
# after 0.11.0 (jax main, July 2026) closed_call_p is an alias of eval_jaxpr_p, named
# "eval_jaxpr" (param still `call_jaxpr`). "core_call" is the pre-0.4 name.
CLOSED_CALL_NAMES: tuple[str, ...] = ("closed_call", "core_call", "eval_jaxpr")


# JAX 0.10.2 (measured) and 0.11.1 (read in its source: the same four-argument call in
# jax/_src/array.py and dispatch.py, and Sharding._internal_device_list): jaxlib's
# `batched_copy_array_to_devices_with_sharding(arrays, device_lists, shardings,
# copy_semantics)` copies committed arrays to other devices in one C++ call. It is what
# `jax.device_put` ends in for a jax.Array, and what NVIDIA JaxPP uses for stage-to-stage
# transfers, but `jax.device_put` first runs a primitive bind and per-array Python checks:
# on CPU, 45-65 µs to move one small array from device 0 to device 1 (100-120 µs with
# two threads taking turns on the GIL), against 8-23 µs for the direct call. The
# pipeline runtime hands values between devices on its critical path, once per tick.
try:
    from jax._src.lib import xla_client as _xla_client

    _batched_copy = _xla_client.batched_copy_array_to_devices_with_sharding
    _REUSE_INPUT = _xla_client.ArrayCopySemantics.REUSE_INPUT
    from jax._src.array import ArrayImpl as _ArrayImpl
except (ImportError, AttributeError):  # another jaxlib: fall back to jax.device_put
    _batched_copy = None
    _REUSE_INPUT = None
    _ArrayImpl = None
_fast_copy_failed = False


@functools.lru_cache(maxsize=64)
def _device_target(device: Any) -> tuple[Any, Any]:
    sharding = _SingleDeviceSharding(device)
    return sharding, sharding._internal_device_list


register_cache(_device_target.cache_clear)


def copy_to_device(arrays: list[Any], device: Any) -> list[Any]:
    """``jax.device_put(arrays, device)``, with one C++ call for the entries that are
    single-device ``jax.Array`` values when jaxlib offers it; anything else (NumPy
    arrays, scalars, sharded arrays) goes through ``jax.device_put``. If the direct call
    is missing or refuses its arguments, everything goes through ``jax.device_put`` from
    then on, so a jaxlib that changed the call only loses speed."""
    global _fast_copy_failed
    if not arrays:
        return []
    if _batched_copy is None or _fast_copy_failed:
        return _jax.device_put(list(arrays), device)
    fast: list[int] = []
    slow: list[int] = []
    for i, a in enumerate(arrays):
        # A deleted array goes the slow way, where JAX raises "Array has been deleted";
        # the direct call would read freed memory (a segfault).
        single = type(a) is _ArrayImpl and not a.is_deleted() and a.sharding.num_devices == 1
        (fast if single else slow).append(i)
    if not fast:
        return _jax.device_put(list(arrays), device)
    count = len(fast)
    try:
        sharding, device_list = _device_target(device)
        copied = _batched_copy(
            [arrays[i] for i in fast],
            [device_list] * count,
            [sharding] * count,
            [_REUSE_INPUT] * count,
        )
    except (TypeError, AttributeError, ValueError):
        _fast_copy_failed = True
        return _jax.device_put(list(arrays), device)
    if not slow:
        return list(copied)
    result: list[Any] = [None] * len(arrays)
    for i, value in zip(fast, copied):
        result[i] = value
    for i, value in zip(slow, _jax.device_put([arrays[i] for i in slow], device)):
        result[i] = value
    return result


# JAX 0.10.2 (measured) and 0.11.1 (read in its source: the same constructor call at the
# end of jax/_src/array.py's make_array_from_single_device_arrays):
# `jax.make_array_from_single_device_arrays` builds an aval and checks the shards, then
# calls `ArrayImpl(aval, sharding, shards, committed=True)`. In a two-process CPU run it
# takes 7 µs per call (about 20 µs with the caches cold after a collective); with the
# aval built once and the checks skipped, 2 µs. The multi-process transport builds one
# global array per value it sends, on its critical path.
def global_array_maker(shape: tuple, dtype: Any, sharding: Any) -> Callable[[list[Any]], Any]:
    """A function of a list of per-device shards that returns the global array of
    ``shape`` and ``dtype`` laid out by ``sharding``, as
    ``jax.make_array_from_single_device_arrays(shape, sharding, shards)`` does, but
    without checking the shards each call: for callers whose shards fit by construction
    (on the sharding's devices of this process, of the shard shape and ``dtype``). The
    public function where the fast constructor is missing."""
    public = functools.partial(_jax.make_array_from_single_device_arrays, shape, sharding)
    if _ArrayImpl is None:
        return public
    try:
        from jax._src import core as _core

        aval = _core.update_aval_with_sharding(
            _core.ShapedArray(shape, np.dtype(dtype), weak_type=False), sharding
        )
    except (ImportError, AttributeError, TypeError):  # another JAX: the public function
        return public

    def make(shards: list[Any]) -> Any:
        return _ArrayImpl(aval, sharding, shards, committed=True, _skip_checks=True)

    return make


def shard_map(f: Any, *, mesh: Any, in_specs: Any, out_specs: Any) -> Any:
    """``jax.shard_map`` (public since JAX 0.7; ``jax.experimental.shard_map`` before)."""
    try:
        from jax import shard_map as _shard_map
    except ImportError:  # pragma: no cover - older JAX
        from jax.experimental.shard_map import shard_map as _shard_map
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def coordination_client() -> Any:
    """The ``jax.distributed`` coordination client, a key-value store every process of
    the job reaches (``key_value_set``, ``blocking_key_value_get``), or ``None``
    outside ``jax.distributed``. JAX 0.10-0.12: ``jax._src.distributed.global_state``
    holds it; JAX has no public name for it."""
    try:
        from jax._src.distributed import global_state
    except ImportError:  # a JAX that moved it: the agreement check is skipped
        return None
    return getattr(global_state, "client", None)
