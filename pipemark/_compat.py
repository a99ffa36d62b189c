"""The one place pipemark reaches into ``jax._src``, and its shims across JAX versions.

Each use says which JAX versions it was checked on. Everything else in pipemark uses
public JAX (``jax``, ``jax.extend``, ``jax.interpreters``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax as _jax
import numpy as np

# JAX 0.10.2 and 0.11.x: a config state that is part of the jit cache key and of the
# trace context. The marker lowering reads it, so `jit(f)` compiled under one lowering
# mode is never reused under another. There is no public way to define such a state.
from jax._src import config as _jax_config
from jax.extend.core import ClosedJaxpr as _ClosedJaxpr
from jax.extend.core import Jaxpr as _Jaxpr
from jax.interpreters import mlir as _mlir
from jax.interpreters import partial_eval as _pe

from pipemark.caches import register_cache

LOWERING_MODES = ("barrier", "identity", "custom_call")

#: What a device running out of memory raises from a program's call: XLA's
#: ``RESOURCE_EXHAUSTED`` is a ``JaxRuntimeError`` where the program runs out, and a
#: ``ValueError`` where its result buffers cannot be allocated at dispatch (a TPU v5e on
#: JAX 0.10.2: "RESOURCE_EXHAUSTED: ... RuntimeBufferAllocationFailure"). Callers check
#: the message for ``RESOURCE_EXHAUSTED`` and raise anything else again.
DEVICE_ERRORS: tuple[type[Exception], ...] = (_jax.errors.JaxRuntimeError, ValueError)


def is_single_device_sharding(sharding: Any) -> bool:
    """Whether ``sharding`` places an array on one device whole (a
    ``SingleDeviceSharding``). JAX 0.12 deprecates the class's public name for
    ``jax.sharding.is_single_device_sharding``, which JAX 0.10.2 does not have.

    >>> import jax
    >>> is_single_device_sharding(jax.sharding.make_single_device_sharding(jax.devices()[0]))
    True
    """
    test = getattr(_jax.sharding, "is_single_device_sharding", None)
    if test is not None:
        return bool(test(sharding))
    return isinstance(sharding, _jax.sharding.SingleDeviceSharding)  # JAX 0.10.2


# ======================================================================================
# What differs between JAX versions: the one table.
#
# Every JAX internal pipemark relies on, with each form it is known to take and the
# releases that form was measured on (jax 0.10.2 on Python 3.11; 0.11.2 and 0.12.0.1 on
# Python 3.12). The functions below this table are the only readers of these forms;
# passes ask them (``scan_operand_counts``, ``run_dce_rule``...) and never read a
# version-dependent parameter by name. ``jax_form(row)`` is the form this JAX has, found
# by looking at JAX itself; tests/test_compat.py traces each primitive on the installed
# JAX and fails naming the row whose form is not one listed here.
# ======================================================================================
VERSION_TABLE: dict[str, dict[str, str]] = {
    "scan operand groups": {
        "num_consts/num_carry": "0.10.2: scan params num_consts and num_carry (ints); "
        "its operands are consts, carry, xs and its results carry, ys",
        "ft_in/ft_out": "0.11.2, 0.12.0.1: scan params ft_in, a flat tree of the groups "
        "(consts, carry, xs), and ft_out, of (carry, ys); no num_consts/num_carry",
    },
    "DCE rule signature": {
        "rule(used_outs, eqn)": "0.10.2, 0.11.2: pe.dce_rules[p](used_outputs, eqn) "
        "returns (used_inputs, new_eqn or None)",
        "rule(used_outs, live_ins, eqn)": "0.12.0.1: a list of live-input flags (Ref "
        "inputs still read later) comes second; pe.dce_jaxpr gained live_inputs=",
    },
    "closed jaxpr class": {
        "ClosedJaxpr": "0.10.2: ClosedJaxpr is a class of its own holding an open Jaxpr",
        "Jaxpr": "0.11.2, 0.12.0.1: ClosedJaxpr is an alias of Jaxpr",
    },
    "closed call primitive": {
        "closed_call": "0.10.2: jax.extend.core.primitives.closed_call_p",
        "eval_jaxpr": "0.11.2, 0.12.0.1: closed_call_p is eval_jaxpr_p (param call_jaxpr)",
    },
    # What JAX stages for a gradient, which fixes the equations (and costs) of a traced
    # training step: tests whose expected tables count equations pick theirs by it.
    "tanh derivative": {
        "sub/mul": "0.10.2: jvp of tanh stages sub(1, y) and mul (1 - y*y as two equations)",
        "one_minus_square": "0.11.2, 0.12.0.1: one primitive one_minus_square(y)",
    },
    # Unchanged from 0.10.2 to 0.12.0.1, listed so that a JAX which renames one fails
    # the guard test (tests/test_compat.py) instead of a pass deep in a split.
    "body params": {
        "unchanged": "0.10.2, 0.11.2, 0.12.0.1: the names in BODY_PARAMS and PARAMS_READ",
    },
    "lowering registration": {
        "mlir.register_lowering": "0.10.2, 0.11.2, 0.12.0.1: "
        "jax.interpreters.mlir.register_lowering(primitive, rule, platform=None)",
    },
    "FFI": {
        "jax.ffi": "0.10.2, 0.11.2, 0.12.0.1: jax.ffi.register_ffi_target, pycapsule, "
        "build_ffi_lowering_function, ffi_call",
    },
    # The TPU identity kernel of custom-call markers (pipemark.pallas_identity).
    "Pallas TPU kernel": {
        "SideEffectType": "0.10.2 (measured), 0.11.1 and 0.12.0.1 (read in their source): "
        "pl.pallas_call(kernel, out_shape, in_specs, out_specs, scratch_shapes, "
        "input_output_aliases, interpret, name, compiler_params, metadata); "
        "pltpu.CompilerParams(has_side_effects=pltpu.SideEffectType.SIDE_EFFECTING), a "
        "kernel XLA never removes or deduplicates; pl.ANY refs, pltpu.make_async_copy, "
        "pltpu.SemaphoreType.DMA; the TPU lowering writes name as the tpu_custom_call's "
        "kernel_name and metadata as its kernel_metadata frontend attribute, and asks the "
        "device kind (jax.sharding.AbstractDevice) for a rank-1 block",
    },
    # Every equation records the abstract mesh it was traced under (jax.sharding.set_mesh)
    # and evaluating it enters that mesh again: pipemark.runtime.devices.sharding rebuilds it on
    # a stage's sub-mesh through eqn_context_with_mesh.
    "equation context": {
        "JaxprEqnContext._create": "0.10.2, 0.12.0.1: eqn.ctx is an interned "
        "JaxprEqnContext whose _create takes its slots (cur_abstract_mesh among them; "
        "0.12 adds cur_layout_mode and no_collectives) by name, xla_metadata as items",
        "JaxprEqnContext configs": "0.12.1: _create(xla_metadata items, configs), the "
        "configs named by jax._src.config.jaxpr_eqn_ctx_names(), the mesh as "
        "abstract_mesh_context_manager",
    },
    # A stage program of the one microbatch of a call (pipemark.runtime.devices.compilation)
    # can make its accumulators itself instead of adding to zeros it is given.
    "one microbatch's accumulators": {
        "zeros first": "0.10.2 (measured): a program whose arguments arrive in layouts "
        "XLA chose (Layout.AUTO) gives the outputs it makes layouts of its own, whatever "
        "out_shardings asks, and a later program mixing such an array with "
        "default-layout ones (an optimizer update) computed wrong values; donated zeros "
        "fix an accumulator's layout (a program whose arguments are all in the default "
        "layout, a one-stage pipeline's, makes them right)",
        "made in the program": "0.12.1 (measured): the same pipelines equal "
        "jax.value_and_grad with the accumulators made in the program",
    },
    # pipemark registers no partial-eval rule: jax.checkpoint and linearize derive one
    # for the marker from its jvp and transpose rules (DESIGN.md).
    "partial-eval rule": {"none registered": "0.10.2, 0.11.2, 0.12.0.1"},
    # A primitive whose lowering binds custom_partitioning (the benchmarks' native
    # sleep) must say so for jit to lower it with the devices it compiles for.
    "devices during lowering": {
        "prim_requires_devices_during_lowering": "0.10.2, 0.12.1 (measured): "
        "jax._src.dispatch.prim_requires_devices_during_lowering, a set of primitives",
    },
}

#: Where each known higher-order primitive keeps its bodies (a ``cond``'s ``branches``
#: is a tuple of them). Unchanged from JAX 0.10.2 to 0.12.0.1 ("body params" row).
BODY_PARAMS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),  # JAX < 0.7 named jit "pjit"
    "call": ("call_jaxpr",),
    "remat2": ("jaxpr",),  # jax.checkpoint
    "checkpoint": ("jaxpr",),
    "remat": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),  # older JAX
    "scan": ("jaxpr",),
    "cond": ("branches",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "shard_map": ("jaxpr",),
}

#: The other params pipemark reads by name, per primitive, on every supported JAX:
#: scan's trip count and direction (pipemark.passes.scan, pipemark.cost), jit's name
#: (pushed on the name stack when inlined) and remat's ``differentiated`` flag
#: (pipemark.passes.inline). scan's operand groups differ by version: ask
#: :func:`scan_operand_counts`.
PARAMS_READ: dict[str, tuple[str, ...]] = {
    "scan": ("length", "reverse"),
    "jit": ("name",),
    "remat2": ("differentiated",),
}


class JaxVersionError(RuntimeError):
    """A JAX internal is in a form pipemark._compat does not know (a JAX newer than the
    tested range): the message names the row of VERSION_TABLE."""


def jax_form(row: str) -> str:
    """The form row ``row`` of :data:`VERSION_TABLE` takes on the installed JAX.

    >>> jax_form("DCE rule signature") in VERSION_TABLE["DCE rule signature"]
    True
    """
    if row == "scan operand groups":
        params = traced_params("scan")
        return "num_consts/num_carry" if "num_consts" in params else "ft_in/ft_out"
    if row == "DCE rule signature":
        return (
            "rule(used_outs, live_ins, eqn)" if DCE_RULE_TAKES_LIVE_INS else "rule(used_outs, eqn)"
        )
    if row == "tanh derivative":
        traced = _jax.make_jaxpr(_jax.grad(_jax.numpy.tanh))(np.float32(1.0))
        names = {eqn.primitive.name for eqn in traced.jaxpr.eqns}
        return "one_minus_square" if "one_minus_square" in names else "sub/mul"
    if row == "closed jaxpr class":
        return "Jaxpr" if CLOSED_JAXPR_IS_JAXPR else "ClosedJaxpr"
    if row == "Pallas TPU kernel":
        return "SideEffectType" if pallas_side_effecting() is not True else "bool only"
    if row == "equation context":
        ctx = _jax.make_jaxpr(_jax.numpy.sin)(np.float32(1.0)).eqns[0].ctx
        configs = _context_config_names(ctx) is not None
        return "JaxprEqnContext configs" if configs else "JaxprEqnContext._create"
    if row == "closed call primitive":
        from jax.extend.core.primitives import closed_call_p

        return closed_call_p.name
    if row == "one microbatch's accumulators":
        return "made in the program" if ACCUMULATORS_MADE_IN_PROGRAM else "zeros first"
    if row not in VERSION_TABLE:
        raise KeyError(f"{row!r} is no row of VERSION_TABLE: {sorted(VERSION_TABLE)}")
    (form,) = VERSION_TABLE[row]
    return form


@functools.cache
def traced_params(primitive: str) -> dict[str, Any]:
    """The params JAX gives an equation of ``primitive`` (one of :data:`BODY_PARAMS`'
    keys that this JAX stages: ``scan``, ``cond``, ``while``, ``jit``, ``remat2``,
    ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``), traced once per process.

    >>> sorted(traced_params("remat2"))
    ['differentiated', 'jaxpr', 'policy', 'prevent_cse']
    """
    from jax import lax

    programs: dict[str, Callable[[Any], Any]] = {
        "scan": lambda x: lax.scan(lambda c, _: (c * 2, c), x, None, length=2)[0],
        "cond": lambda x: lax.cond(x > 0, lambda y: y * 2, lambda y: y, x),
        "while": lambda x: lax.while_loop(lambda c: c < 10, lambda c: c + 1, x),
        "jit": _jax.jit(lambda x: x * 2),
        "remat2": _jax.checkpoint(lambda x: x * 2),
        "custom_jvp_call": _custom_jvp_example(),
        "custom_vjp_call": _custom_vjp_example(),
        "shard_map": lambda x: shard_map(
            lambda y: y * 2,
            mesh=_jax.make_mesh((1,), ("pipemark_probe",), devices=_jax.devices()[:1]),
            in_specs=_jax.P(),
            out_specs=_jax.P(),
        )(x),
    }
    if primitive not in programs:
        raise KeyError(f"no example program stages {primitive!r}: {sorted(programs)}")
    traced = _jax.make_jaxpr(programs[primitive])(np.float32(1.0))
    for eqn in traced.jaxpr.eqns:
        if eqn.primitive.name == primitive:
            return dict(eqn.params)
    staged = [eqn.primitive.name for eqn in traced.jaxpr.eqns]
    raise JaxVersionError(f"this JAX stages {staged} for a {primitive!r} example, no {primitive!r}")


register_cache(traced_params.cache_clear)


def _custom_jvp_example() -> Callable[[Any], Any]:
    @_jax.custom_jvp
    def double(x):
        return x * 2

    double.defjvp(lambda primals, tangents: (double(primals[0]), tangents[0] * 2))
    return double


def _custom_vjp_example() -> Callable[[Any], Any]:
    @_jax.custom_vjp
    def double(x):
        return x * 2

    double.defvjp(lambda x: (x * 2, None), lambda _, g: (g * 2,))
    return double


# ----------------------------------------------------------------- scan operand groups


def scan_operand_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation's params: its operands are
    ``consts, carry, xs`` and its results ``carry, ys`` on every JAX.

    >>> import jax
    >>> from jax import lax
    >>> cj = jax.make_jaxpr(lambda c, xs: lax.scan(lambda c, x: (c + x, c), c, xs))(
    ...     0.0, jax.numpy.ones(3))
    >>> scan_operand_counts(cj.eqns[0].params)
    (0, 1)
    """
    if "num_consts" in params and "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    raise JaxVersionError(
        "scan operand groups: this JAX's scan has neither num_consts/num_carry nor "
        f"ft_in (params: {sorted(params)}); add its form to pipemark._compat.VERSION_TABLE."
    )


# --------------------------------------------------------------------------- DCE rules

# The DCE rule signature row: JAX 0.12 added `live_inputs=` to pe.dce_jaxpr together
# with the live_ins argument of every rule.
DCE_RULE_TAKES_LIVE_INS: bool = "live_inputs" in inspect.signature(_pe.dce_jaxpr).parameters

DceRule = Callable[[Sequence[bool], Any], tuple[list[bool], Any]]


def register_dce_rule(primitive: Any, rule: DceRule) -> None:
    """Register ``rule(used_outputs, eqn) -> (used_inputs, eqn or None)`` as
    ``primitive``'s DCE rule in the calling convention of the installed JAX.

    >>> from jax.extend.core import Primitive
    >>> example = Primitive("pipemark_dce_example")
    >>> register_dce_rule(example, lambda used, eqn: (list(used), eqn if any(used) else None))
    >>> dce_rule(example) is not None
    True
    """
    if DCE_RULE_TAKES_LIVE_INS:

        def rule_with_live_ins(used_outputs, live_ins, eqn):
            del live_ins  # a marker holds no Ref: every operand is a plain value
            return rule(used_outputs, eqn)

        _pe.dce_rules[primitive] = rule_with_live_ins
    else:
        _pe.dce_rules[primitive] = rule


def dce_rule(primitive: Any) -> DceRule | None:
    """``primitive``'s registered DCE rule (JAX's or pipemark's) as a function of
    ``(used_outputs, eqn)``, whatever the JAX's calling convention; ``None`` when it
    has none. Every input is taken as live (pipemark's programs hold no Ref values).

    >>> from jax.extend.core import Primitive
    >>> dce_rule(Primitive("pipemark_without_dce_rule")) is None
    True
    """
    rule = _pe.dce_rules.get(primitive)
    if rule is None or not DCE_RULE_TAKES_LIVE_INS:
        return rule
    return functools.partial(_with_all_live, rule)


def _with_all_live(rule: Any, used_outputs: Sequence[bool], eqn: Any) -> tuple[list[bool], Any]:
    return rule(used_outputs, [True] * len(eqn.invars), eqn)


def register_lowering(
    primitive: Any, rule: Callable[..., Any], platform: str | None = None
) -> None:
    """``mlir.register_lowering(primitive, rule, platform)``: on every platform, or for
    ``platform`` only (the "lowering registration" row of :data:`VERSION_TABLE`);
    pipemark.primitive registers the marker's lowering with it."""
    _mlir.register_lowering(primitive, rule, platform=platform)


def pallas_side_effecting() -> Any:
    """The ``has_side_effects`` value of ``pltpu.CompilerParams`` that makes XLA keep a
    Pallas TPU kernel whose results are unused and never merge two calls of it:
    ``pltpu.SideEffectType.SIDE_EFFECTING`` (the "Pallas TPU kernel" row of
    :data:`VERSION_TABLE`); ``True``, the older spelling, where the enum is missing.

    >>> pallas_side_effecting().name
    'SIDE_EFFECTING'
    """
    from jax.experimental.pallas import tpu as pltpu

    kinds = getattr(pltpu, "SideEffectType", None)
    return True if kinds is None else kinds.SIDE_EFFECTING


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

#: Whether a one-microbatch stage program may make its accumulators itself whatever
#: layouts its arguments arrive in (the VERSION_TABLE row "one microbatch's
#: accumulators"): measured right on JAX 0.12.1 and wrong on 0.10.2; versions between
#: are treated as 0.10 is.
ACCUMULATORS_MADE_IN_PROGRAM: bool = tuple(
    int(part) for part in _jax.__version__.split(".")[:2]
) >= (0, 12)


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
    sharding = _jax.sharding.make_single_device_sharding(device)
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


def lower_with_devices(primitive: Any) -> None:
    """Have ``jax.jit`` lower ``primitive`` knowing the devices it compiles for, as it
    does for ``jax.experimental.custom_partitioning`` (whose lowering needs them): for
    a primitive whose lowering rule binds one. JAX has no public way to say so; the
    "devices during lowering" row of :data:`VERSION_TABLE`.

    >>> from jax.extend.core import Primitive
    >>> lower_with_devices(Primitive("needs_devices"))
    """
    try:
        from jax._src.dispatch import prim_requires_devices_during_lowering
    except ImportError as error:  # pragma: no cover - a JAX that moved it
        raise JaxVersionError(
            "devices during lowering: jax._src.dispatch has no "
            "prim_requires_devices_during_lowering; update pipemark._compat.VERSION_TABLE "
            "and lower_with_devices."
        ) from error
    prim_requires_devices_during_lowering.add(primitive)


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


def coordination_process() -> int | None:
    """This process's index in the ``jax.distributed`` job (what ``jax.process_index()``
    says), read without starting JAX's backends (an error raised before any device was
    used is published with it), or ``None`` outside ``jax.distributed``. JAX 0.10-0.12:
    ``jax._src.distributed.global_state.process_id``, set by ``initialize``."""
    if coordination_client() is None:
        return None
    from jax._src.distributed import global_state

    return getattr(global_state, "process_id", None)


# The "equation context" row. JAX 0.10.2 and 0.12.0.1 (measured): `eqn.ctx` is a
# `jax._src.core.JaxprEqnContext`, interned, built by the static `_create` from its
# slots in slot order (0.12 adds cur_layout_mode and no_collectives), less `configs`
# (filled later) and `__weakref__`; the mesh is its `cur_abstract_mesh` slot. JAX
# 0.12.1 (measured): the slots are only `xla_metadata` and `configs`, the values of the
# configs `jax._src.config.jaxpr_eqn_ctx_names()` names, the mesh among them as
# "abstract_mesh_context_manager"; `_create(xla_metadata, configs)`. Both store
# `xla_metadata` as a dict but take it as sorted items (the interner hashes the
# arguments). There is no public constructor.
_MESH_CONFIG = "abstract_mesh_context_manager"


def _context_config_names(ctx: Any) -> tuple[str, ...] | None:
    """The names of ``ctx.configs`` where the context holds its mesh among them (JAX
    >= 0.12.1), else ``None``."""
    if hasattr(type(ctx), "cur_abstract_mesh") or "cur_abstract_mesh" in type(ctx).__slots__:
        return None
    from jax._src import config

    names = tuple(config.jaxpr_eqn_ctx_names())
    if _MESH_CONFIG not in names or len(names) != len(ctx.configs):
        raise JaxVersionError(
            "equation context: this JAX's JaxprEqnContext holds neither a "
            f"cur_abstract_mesh nor an {_MESH_CONFIG!r} config; update "
            "pipemark._compat.eqn_context_mesh and eqn_context_with_mesh."
        )
    return names


def _metadata_items(ctx: Any) -> Any:
    metadata = ctx.xla_metadata
    return None if metadata is None else tuple(sorted(metadata.items()))


def eqn_context_mesh(ctx: Any) -> Any:
    """The abstract mesh an equation was traced under (``jax.sharding.set_mesh``), from
    its ``eqn.ctx``; an empty mesh outside one.

    >>> import jax, jax.numpy as jnp
    >>> eqn_context_mesh(jax.make_jaxpr(jnp.sin)(1.0).eqns[0].ctx).empty
    True
    """
    names = _context_config_names(ctx)
    if names is None:
        return ctx.cur_abstract_mesh
    return ctx.configs[names.index(_MESH_CONFIG)]


def eqn_context_with_mesh(ctx: Any, mesh: Any) -> Any:
    """``ctx`` (an equation's ``eqn.ctx``) with its abstract mesh set to ``mesh``.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(jnp.sin)(1.0).eqns[0]
    >>> mesh = jax.sharding.AbstractMesh((2,), ("data",))
    >>> eqn_context_mesh(eqn_context_with_mesh(eqn.ctx, mesh)) == mesh
    True
    """
    names = _context_config_names(ctx)
    if names is None:
        values = []
        for name in type(ctx).__slots__:
            if name == "configs" or name.startswith("__"):
                continue
            if name == "cur_abstract_mesh":
                values.append(mesh)
            elif name == "xla_metadata":
                values.append(_metadata_items(ctx))
            else:
                values.append(getattr(ctx, name))
    else:
        configs = list(ctx.configs)
        configs[names.index(_MESH_CONFIG)] = mesh
        values = [_metadata_items(ctx), tuple(configs)]
    try:
        new = type(ctx)._create(*values)
    except (AttributeError, TypeError) as error:
        raise JaxVersionError(
            f"equation context: this JAX's JaxprEqnContext ({error}) is in no form "
            "pipemark._compat.VERSION_TABLE knows; update eqn_context_with_mesh."
        ) from error
    if eqn_context_mesh(new) != mesh:
        raise JaxVersionError(
            "equation context: JaxprEqnContext._create takes its slots in another order; "
            "update pipemark._compat.eqn_context_with_mesh."
        )
    return new


# JAX 0.10.2 and 0.12.0.1 (read in jax/_src/literals.py, the same in both): a literal's
# value may be a `TypedNdArray`, an np.ndarray subclass carrying its own aval, which
# JAX 0.12 types under the mesh the literal was traced under (measured: 0.12.0.1 under
# jax.sharding.set_mesh; vmap broadcasts an unbatched literal under that mesh). Its
# constructor is `TypedNdArray(val, aval)`.
def literal_value_with_aval(value: Any, aval: Any) -> Any:
    """A literal's ``value`` typed as ``aval`` where the value carries its own type
    (JAX's ``TypedNdArray``); any other value unchanged.

    >>> import jax, numpy as np
    >>> literal_value_with_aval(2.0, jax.typeof(np.float32(2.0)))
    2.0
    """
    if not hasattr(value, "_aval") or not isinstance(value, np.ndarray):
        return value
    return type(value)(np.asarray(value), aval)


# JAX 0.10.2 and 0.12.1 (measured): a context manager for a config option
# (`jax.default_matmul_precision("highest")`, `jax.debug_nans(True)`, pipemark's own
# lowering mode) sets a value for the calling thread alone (`State.swap_local`), and a
# new thread starts with none. The jit cache key holds such values, so a stage program
# dispatched from a pipeline's worker thread compiled and ran without the caller's
# settings. There is no public way to read which options a thread set.
def thread_settings() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The JAX config values the calling thread set for itself (inside their context
    managers), as a function whose context manager sets them on another thread too.

    >>> import threading, jax
    >>> with jax.default_matmul_precision("highest"):
    ...     settings = thread_settings()
    >>> seen = []
    >>> def work():
    ...     with settings():
    ...         seen.append(jax.config.jax_default_matmul_precision)
    >>> thread = threading.Thread(target=work); thread.start(); thread.join()
    >>> seen
    ['highest']
    """
    try:
        unset = _jax_config.config_ext.unset
        own = [(s, s.get_local()) for s in _jax_config.config_states.values()]
    except AttributeError:  # another JAX: the settings stay the thread's own
        return contextlib.nullcontext
    own = [(state, value) for state, value in own if value is not unset]

    @contextlib.contextmanager
    def applied() -> Any:
        before = []
        try:
            for state, value in own:
                before.append((state, state.swap_local(value)))
                if state._update_thread_local_hook:
                    state._update_thread_local_hook(value)
            yield
        finally:
            for state, value in reversed(before):
                state.set_local(value)
                if state._update_thread_local_hook:
                    state._update_thread_local_hook(None if value is unset else value)

    return applied
