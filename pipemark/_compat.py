"""The one place pipemark reaches into ``jax._src``, and its shims across JAX versions.

Each use says which JAX versions it was checked on. Everything else in pipemark uses
public JAX (``jax``, ``jax.extend``, ``jax.interpreters``).
"""

from __future__ import annotations

# JAX 0.10.2 and 0.11.x: a config state that is part of the jit cache key and of the
# trace context. The marker lowering reads it, so `jit(f)` compiled under one lowering
# mode is never reused under another. There is no public way to define such a state.
from jax._src import config as _jax_config
from jax.extend.core import ClosedJaxpr as _ClosedJaxpr
from jax.extend.core import Jaxpr as _Jaxpr

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
