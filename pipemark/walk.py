"""Sub-jaxprs: the one walker over the bodies of higher-order primitives.

Passes, the cost model and the views that look inside ``jit``, ``scan``, ``cond``,
``while``, ``checkpoint``, ``custom_jvp``/``custom_vjp`` or ``shard_map`` equations ask
this module for the bodies. :data:`BODY_PARAMS` names where each known primitive keeps
its bodies; any other primitive's parameters are searched for jaxprs (so a primitive
JAX adds later is still walked), skipping quickly the many primitives that never hold
one. :data:`CALL_PRIMITIVES` are the call-like ones, which run their body once.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> def f(x):
...     return lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)[0]
>>> cj = jax.make_jaxpr(jax.jit(f))(1.0)
>>> [(param, len(body.eqns)) for param, body in bodies(cj.eqns[0])]
[('jaxpr', 1)]
>>> [e.primitive.name for e in iter_eqns(cj.jaxpr)]
['jit', 'scan', 'sin']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn
from jax.extend.core import primitives as _primitives

from pipemark._compat import BODY_PARAMS as _COMPAT_BODY_PARAMS
from pipemark._compat import CLOSED_CALL_NAMES

__all__ = [
    "BODY_PARAMS",
    "CALL_PRIMITIVES",
    "bodies",
    "find_eqn",
    "iter_eqns",
    "map_bodies",
    "open_jaxpr",
]

#: Call-like primitives (their names across JAX versions): each runs its body once,
#: with the equation's operands as the body's inputs.
CALL_PRIMITIVES: frozenset[str] = frozenset(
    (
        "jit",
        "pjit",  # JAX < 0.7 named jit "pjit"
        *CLOSED_CALL_NAMES,
        "call",
        "remat2",  # jax.checkpoint
        "checkpoint",
        "remat",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",  # older JAX
    )
)

#: The parameters holding the bodies of each known higher-order primitive (a ``cond``'s
#: ``branches`` is a tuple of them): pipemark._compat's table, with the closed-call names.
BODY_PARAMS: dict[str, tuple[str, ...]] = {
    **_COMPAT_BODY_PARAMS,
    **{name: ("call_jaxpr",) for name in CLOSED_CALL_NAMES},
}


def open_jaxpr(value: Any) -> Jaxpr | None:
    """The open jaxpr of a body parameter's value (a ``Jaxpr``, a ``ClosedJaxpr`` or a
    thunk returning one, as older ``custom_vjp_call_jaxpr`` held); ``None`` for any
    other value."""
    if callable(value) and not isinstance(value, (Jaxpr, ClosedJaxpr)):
        try:
            value = value()
        except TypeError:
            return None
    if isinstance(value, ClosedJaxpr):
        return value.jaxpr
    return value if isinstance(value, Jaxpr) else None


def bodies(eqn: JaxprEqn) -> list[tuple[str, Jaxpr]]:
    """``(parameter, open jaxpr)`` for each body of ``eqn``, in parameter order; empty
    for a first-order primitive."""
    params = eqn.params
    known = BODY_PARAMS.get(eqn.primitive.name)
    if known is not None:
        names = [name for name in known if name in params]
    elif eqn.primitive in _NO_BODY or not params or not _may_hold_body(params):
        return []
    else:
        names = list(params)
    found = []
    for name in names:
        value = params[name]
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (Jaxpr, ClosedJaxpr)) or (known is not None and callable(item)):
                body = open_jaxpr(item)
                if body is not None:
                    found.append((name, body))
    return found


def iter_eqns(jaxpr: Jaxpr | ClosedJaxpr, seen: set[int] | None = None) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr`` and, after each, of its bodies, recursively; a body
    shared by several equations is walked once (``seen`` holds the ids walked)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    seen = set() if seen is None else seen
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    for eqn in jaxpr.eqns:
        yield eqn
        for _, body in bodies(eqn):
            yield from iter_eqns(body, seen)


def find_eqn(
    jaxpr: Jaxpr | ClosedJaxpr,
    predicate: Callable[[JaxprEqn], bool],
    memo: dict[int, JaxprEqn | None] | None = None,
) -> JaxprEqn | None:
    """The first equation (in :func:`iter_eqns` order) satisfying ``predicate``, or
    ``None``. ``memo`` (body id -> answer) lets repeated questions with the same
    predicate skip bodies already searched."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    memo = {} if memo is None else memo
    key = id(jaxpr)
    if key in memo:
        return memo[key]
    memo[key] = None  # guards against a body that (indirectly) contains itself
    found = None
    for eqn in jaxpr.eqns:
        if predicate(eqn):
            found = eqn
        else:
            found = next(
                (hit for _, body in bodies(eqn) if (hit := find_eqn(body, predicate, memo))),
                None,
            )
        if found is not None:
            break
    memo[key] = found
    return found


def map_bodies(eqn: JaxprEqn, fn: Callable[[Jaxpr], Jaxpr]) -> JaxprEqn:
    """``eqn`` with each body replaced by ``fn`` of it (a ``ClosedJaxpr`` body stays
    closed, with its consts); ``eqn`` itself when ``fn`` changes no body.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(jax.jit(jnp.sin))(1.0)
    >>> map_bodies(cj.eqns[0], lambda body: body) is cj.eqns[0]
    True
    """
    found = bodies(eqn)
    if not found:
        return eqn
    new_params = {}
    for name in dict.fromkeys(param for param, _ in found):
        value = eqn.params[name]
        items = value if isinstance(value, (tuple, list)) else (value,)
        mapped = [_map_body(item, fn) for item in items]
        if any(a is not b for a, b in zip(mapped, items)):
            new_params[name] = (
                type(value)(mapped) if isinstance(value, (tuple, list)) else mapped[0]
            )
    return eqn.replace(params={**eqn.params, **new_params}) if new_params else eqn


def _map_body(item: Any, fn: Callable[[Jaxpr], Jaxpr]) -> Any:
    if isinstance(item, ClosedJaxpr):
        new = fn(item.jaxpr)
        return item if new is item.jaxpr else ClosedJaxpr(new, item.consts)
    if isinstance(item, Jaxpr):
        return fn(item)
    return item  # a thunk: left as it is


# Parameter types that never hold a jaxpr: most equations' parameters are these.
_PLAIN_TYPES = frozenset((int, float, bool, str, type(None), np.dtype))
# JAX's elementwise, shape, reduction and contraction primitives: their parameters are
# shapes, axes, dtypes, shardings and dimension numbers, never a jaxpr, so the body
# walker skips them without looking at their parameters (most equations of a model are
# these). Primitives with a jaxpr parameter (scan, cond, while, pjit, custom_jvp_call,
# remat, scatter's update_jaxpr, reduce's computation, sort's comparator...) are not
# listed; anything not listed goes through _may_hold_body.
_NO_BODY = frozenset(
    p
    for p in (
        getattr(_primitives, f"{name}_p", None)
        for name in [
            "abs",
            "acos",
            "acosh",
            "add",
            "and",
            "asin",
            "asinh",
            "atan",
            "atan2",
            "atanh",
            "bitcast_convert_type",
            "broadcast_in_dim",
            "cbrt",
            "ceil",
            "clamp",
            "concatenate",
            "conj",
            "convert_element_type",
            "copy",
            "cos",
            "cosh",
            "cumlogsumexp",
            "cummax",
            "cummin",
            "cumprod",
            "cumsum",
            "div",
            "dot_general",
            "dynamic_slice",
            "dynamic_update_slice",
            "eq",
            "erf",
            "erf_inv",
            "erfc",
            "exp",
            "exp2",
            "expm1",
            "floor",
            "ge",
            "gt",
            "imag",
            "integer_pow",
            "iota",
            "is_finite",
            "le",
            "lgamma",
            "log",
            "log1p",
            "logistic",
            "lt",
            "max",
            "min",
            "mul",
            "ne",
            "neg",
            "nextafter",
            "not",
            "or",
            "pad",
            "pow",
            "real",
            "reduce_and",
            "reduce_max",
            "reduce_min",
            "reduce_or",
            "reduce_precision",
            "reduce_prod",
            "reduce_sum",
            "reduce_xor",
            "rem",
            "reshape",
            "rev",
            "round",
            "rsqrt",
            "select_n",
            "shift_left",
            "shift_right_arithmetic",
            "shift_right_logical",
            "sign",
            "sin",
            "sinh",
            "slice",
            "sqrt",
            "square",
            "squeeze",
            "sub",
            "tan",
            "tanh",
            "transpose",
            "xor",
            "argmax",
            "argmin",
        ]
    )
    if p is not None
)


def _may_hold_body(params: dict) -> bool:
    """Whether some parameter value is (or is a tuple or list holding) a jaxpr. A fast
    over-approximation: only values of other types than plain scalars, strings, dtypes
    and tuples of those are looked at."""
    plain = _PLAIN_TYPES
    for value in params.values():
        kind = type(value)
        if kind in plain:
            continue
        if kind is tuple or kind is list:
            for item in value:
                if type(item) not in plain and type(item) is not tuple:
                    return True
            continue
        if issubclass(kind, np.dtype):
            continue
        return True
    return False
