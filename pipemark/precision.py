"""The narrowest floating-point type each result of a program is computed through.

A model that keeps float32 parameters but casts them to bfloat16 before each matmul
returns float32 results that carry bfloat16 rounding; so does a float32 matmul on a TPU,
which runs in bfloat16 passes unless asked for more. :func:`result_compute_types`
finds, for each result of a jaxpr, the narrowest floating type among the values it
depends on, walking the program forward (equivalently: back from each result through
every equation it depends on), into the bodies of ``jit``, ``checkpoint``,
``custom_jvp``/``custom_vjp``, ``scan``, ``while`` and ``cond`` equations through
:mod:`pipemark.walk`. :meth:`pipemark.StagedJaxpr.verify` takes its default tolerance
from it, so a bfloat16-compute model is judged at bfloat16 rounding, and a result that
never meets a narrower value keeps its own type's tolerance.

Narrower means fewer significand bits: float64 (52) > float32 (23) > float16 and
TensorFloat-32 (10) > bfloat16 (7) > the float8 types (2-3). A float32 ``dot_general``
or convolution counts at the precision the backend computes it in (:func:`matmul_type`):
on TPU, ``DEFAULT`` precision is one bfloat16 pass; on a GPU, TensorFloat-32.

>>> import jax, jax.numpy as jnp
>>> def f(w, x):
...     y = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
...     return jnp.sum(y), jnp.sum(x * 2)
>>> cj = jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((2, 2)))
>>> [t.dtype for t in result_compute_types(cj, platform="cpu")]
['bfloat16', 'float32']
>>> result_compute_types(cj, platform="cpu")[0].reason.startswith("bfloat16: made by equation 0 (")
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from pipemark._compat import scan_operand_counts
from pipemark.errors import describe_eqn
from pipemark.walk import CALL_PRIMITIVES, bodies, iter_eqns

__all__ = [
    "ComputeType",
    "MATMUL_PRIMITIVES",
    "matmul_type",
    "result_compute_types",
    "platform_of",
    "reference_compute_types",
]

#: Primitives whose float32 operands the backend may round to a narrower type, as
#: ``jax.default_matmul_precision`` and the equation's ``precision`` say.
MATMUL_PRIMITIVES: frozenset[str] = frozenset(
    ("dot_general", "conv_general_dilated", "ragged_dot_general")
)

# Significand bits of the pseudo-type a matmul algorithm computes in (the real dtypes
# read theirs from finfo). TensorFloat-32 keeps float16's 10 bits.
_PSEUDO_BITS = {"tensorfloat32": 10}


@dataclass(frozen=True)
class ComputeType:
    """The narrowest floating type on a result's path, and where it comes from.

    ``dtype`` is a dtype name (``"bfloat16"``) or ``"tensorfloat32"``; ``bits`` its
    significand bits (fewer is narrower); :attr:`reason` says why, in words. The other
    fields locate the cause: ``kind`` is ``"input"``, ``"const"``, ``"eqn"`` (a value
    an equation made), ``"matmul"`` (a float32 matmul computed narrower) or ``"own"``
    (the result's own type: nothing narrower on its path); ``index``/``eqn`` the
    equation, ``path`` the equations whose bodies hold it, innermost first.
    """

    dtype: str
    bits: int
    kind: str
    detail: str = ""
    eqn: JaxprEqn | None = None
    index: int | None = None
    path: tuple[tuple[int, JaxprEqn], ...] = ()

    @property
    def reason(self) -> str:
        """Why, in words: ``"bfloat16: made by equation 12 (convert_element_type,
        model.py:17:12 (mm))"``. Formatted on demand: the walk stays cheap."""
        if self.kind == "own":
            text = "the result's own type; nothing narrower on its path"
        elif self.kind in ("input", "const"):
            text = self.detail
        elif self.kind == "matmul":
            text = f"{describe_eqn(self.eqn, self.index)} with float32 operands, {self.detail}"
        else:
            text = f"made by {describe_eqn(self.eqn, self.index)}"
        inside = "".join(f" inside {describe_eqn(e, i)}" for i, e in self.path)
        return f"{self.dtype}: {text}{inside}"


@functools.cache
def _bits(dtype: np.dtype) -> int | None:
    """Significand bits of a floating (or complex) dtype; None for any other."""
    if dtype.kind not in "fcV" or not jnp.issubdtype(dtype, jnp.inexact):
        return None
    return int(jnp.finfo(dtype).nmant)


def _type_name(dtype: np.dtype) -> str:
    # A complex value rounds like its parts: it is judged as that type.
    return {"complex64": "float32", "complex128": "float64"}.get(dtype.name, dtype.name)


def _numpy_dtype(aval: Any) -> np.dtype | None:
    """An aval's dtype as numpy's; None for none (a token) or an extended dtype (a
    PRNG key), which no floating type rounds."""
    try:
        return np.dtype(aval.dtype)
    except (AttributeError, TypeError):
        return None


def _value_type(aval: Any, kind: str, **where: Any) -> ComputeType | None:
    dtype = _numpy_dtype(aval)
    bits = None if dtype is None else _bits(dtype)
    return None if bits is None else ComputeType(_type_name(dtype), bits, kind, **where)


def _narrower(a: ComputeType | None, b: ComputeType | None) -> ComputeType | None:
    """The narrower of two (the first on a tie, so the earliest cause is named)."""
    if a is None:
        return b
    if b is None or a.bits <= b.bits:
        return a
    return b


def _narrowest(types: Iterable[ComputeType | None]) -> ComputeType | None:
    found = None
    for t in types:
        found = _narrower(found, t)
    return found


def platform_of(inputs: Sequence[Any]) -> str:
    """The platform a reference runs on: that of the first input array placed on a
    device, else ``jax.default_backend()``.

    >>> import jax.numpy as jnp
    >>> platform_of([1.0, jnp.ones(2)]) == jax.default_backend()
    True
    """
    for value in inputs:
        if isinstance(value, jax.Array):
            try:
                return next(iter(value.devices())).platform
            except Exception:  # a tracer or a deleted array: the default backend answers
                break
    return jax.default_backend()


def _config_precision() -> Any:
    """``jax_default_matmul_precision`` as a ``lax.Precision`` or dot algorithm preset;
    None when unset (or a value this JAX does not know)."""
    value = getattr(jax.config, "jax_default_matmul_precision", None)
    if not isinstance(value, str):
        return value
    try:
        return lax.Precision(value)  # "bfloat16", "tensorfloat32", "highest", ...
    except ValueError:
        presets = getattr(lax, "DotAlgorithmPreset", None)
        return getattr(presets, value.upper(), None)


# What each precision level computes float32 operands in, per platform: on TPU DEFAULT
# is one bfloat16 pass and HIGH three (bfloat16_3x: about TensorFloat-32's accuracy or
# better); NVIDIA GPUs from Ampere on use TensorFloat-32 for both (older ones float32,
# which this cautious table does not tell apart). HIGHEST is float32 everywhere, and a
# CPU always computes float32.
_LEVELS: dict[str, dict[str, tuple[str, str]]] = {
    "tpu": {
        "DEFAULT": ("bfloat16", "one bfloat16 pass"),
        "HIGH": ("tensorfloat32", "three bfloat16 passes"),
    },
    "gpu": {"DEFAULT": ("tensorfloat32", "TensorFloat-32"), "HIGH": ("tensorfloat32", "TF32")},
}
_LEVELS["cuda"] = _LEVELS["rocm"] = _LEVELS["gpu"]
_LEVEL_ORDER = {"DEFAULT": 0, "HIGH": 1, "HIGHEST": 2}

# A dot algorithm preset (LHS_RHS_ACCUM[_Xn]) names its operand type; n passes of it
# recover more bits (bfloat16 x3 about TensorFloat-32, x6 or more float32).
_PRESET_TYPES: dict[str, tuple[str, dict[str, str | None]]] = {
    "BF16": ("bfloat16", {"X3": "tensorfloat32", "X6": None, "X9": None}),
    "TF32": ("tensorfloat32", {"X3": None}),
    "F16": ("float16", {}),
    "ANY": ("float8_e4m3fn", {}),  # float8 operands
}


def matmul_type(eqn: JaxprEqn, platform: str) -> tuple[str, str] | None:
    """``(type, how)`` when ``eqn``, a matmul or convolution with float32 operands,
    computes in a narrower type on ``platform`` (its ``precision``, else
    ``jax_default_matmul_precision``, decides); else None.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((2, 2))).eqns[0]
    >>> matmul_type(eqn, "tpu"), matmul_type(eqn, "cpu")
    (('bfloat16', 'DEFAULT precision on TPU: one bfloat16 pass'), None)
    """
    if eqn.primitive.name not in MATMUL_PRIMITIVES or not any(
        getattr(_numpy_dtype(v.aval), "name", "") in ("float32", "complex64") for v in eqn.invars
    ):
        return None  # narrower operands count as values; float64 is left as it is
    precision, source = eqn.params.get("precision"), "precision"
    if precision is None:
        precision, source = _config_precision(), "jax_default_matmul_precision"
    if isinstance(precision, (tuple, list)):
        # One level per operand: the lower is the cautious reading.
        levels = [p for p in precision if p is not None] or [None]
        precision = min(levels, key=lambda p: _LEVEL_ORDER.get(getattr(p, "name", ""), 0))
    name = "DEFAULT" if precision is None else getattr(precision, "name", str(precision))
    if name in _LEVEL_ORDER:  # a Precision level, or the DEFAULT algorithm preset
        narrow, how = _LEVELS.get(platform, {}).get(name, (None, ""))
        return (
            None if narrow is None else (narrow, f"{name} precision on {platform.upper()}: {how}")
        )
    head, _, rest = name.partition("_")
    narrow, passes = _PRESET_TYPES.get(head, (None, {}))
    narrow = passes.get(rest.rsplit("_", 1)[-1], narrow)
    return None if narrow is None else (narrow, f"{source} {name}")


def _pseudo_type(name: str) -> tuple[str, int]:
    if name in _PSEUDO_BITS:
        return name, _PSEUDO_BITS[name]
    return name, _bits(np.dtype(getattr(jnp, name)))


# ------------------------------------------------------------------------- the walk

Types = list  # one ComputeType | None per value
Path = tuple  # ((index, eqn), ...) of the enclosing equations, innermost first


def result_compute_types(
    program: ClosedJaxpr | Jaxpr, *, platform: str | None = None
) -> tuple[ComputeType | None, ...]:
    """For each result of ``program``, the narrowest floating type among the values it
    depends on (None for a result that depends on no floating value), computed on
    ``platform`` (default: ``jax.default_backend()``), which decides the type of a
    float32 matmul. ``program`` is the reference's own trace (``jax.make_jaxpr(fn)``),
    never a rewritten one: the answer is about the computation the user wrote.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda w, x: (x @ w, x + 1))(jnp.ones((2, 2)), jnp.ones((2, 2)))
    >>> [t.dtype for t in result_compute_types(cj, platform="tpu")]
    ['bfloat16', 'float32']
    >>> result_compute_types(cj, platform="tpu")[1].reason
    "float32: the result's own type; nothing narrower on its path"
    """
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    names = getattr(jaxpr.debug_info, "arg_names", None) or ()
    inputs = []
    for k, var in enumerate(jaxpr.invars):
        name = names[k] if k < len(names) and names[k] else ""
        detail = f"program input {k}" + (f" ({name})" if name else "")
        inputs.append(_value_type(var.aval, "input", detail=detail))
    found = _propagate(jaxpr, inputs, platform or jax.default_backend(), ())
    results = []
    for var, narrowest in zip(jaxpr.outvars, found):
        own = _value_type(var.aval, "own")
        # The result's own type when nothing on its path is narrower (named as such).
        results.append(narrowest if own is None or narrowest.bits < own.bits else own)
    return tuple(results)


def _propagate(jaxpr: Jaxpr, inputs: Types, platform: str, path: Path) -> Types:
    """The narrowest type each of ``jaxpr``'s outputs depends on, given its inputs'."""
    env: dict[Any, ComputeType | None] = dict(zip(jaxpr.invars, inputs))
    for var in jaxpr.constvars:
        env[var] = _value_type(var.aval, "const", detail="a constant of the program")
    for index, eqn in enumerate(jaxpr.eqns):
        ins = [None if isinstance(v, Literal) else env.get(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        if rule is None:
            rule = (
                _first_order
                if eqn.primitive.name in MATMUL_PRIMITIVES or not bodies(eqn)
                else _opaque
            )
        outs = rule(eqn, index, ins, platform, path)
        for var, found in zip(eqn.outvars, outs):
            env[var] = found
    return [
        _value_type(v.aval, "const", detail="a literal") if isinstance(v, Literal) else env.get(v)
        for v in jaxpr.outvars
    ]


def _made_by(eqn: JaxprEqn, index: int | None, inherited: ComputeType | None, path: Path) -> Types:
    """Each output's type: what it inherits, or its own type when that is narrower."""
    outs = []
    for var in eqn.outvars:
        dtype = _numpy_dtype(var.aval)
        bits = None if dtype is None else _bits(dtype)
        if bits is not None and (inherited is None or bits < inherited.bits):
            name = _type_name(dtype)
            outs.append(ComputeType(name, bits, "eqn", eqn=eqn, index=index, path=path))
        else:
            outs.append(inherited)
    return outs


def _first_order(eqn: JaxprEqn, index: int | None, ins: Types, platform: str, path: Path) -> Types:
    inherited = _narrowest(ins)
    matmul = matmul_type(eqn, platform)
    if matmul is not None:
        name, bits = _pseudo_type(matmul[0])
        computed = ComputeType(name, bits, "matmul", matmul[1], eqn, index, path)
        inherited = _narrower(inherited, computed)
    return _made_by(eqn, index, inherited, path)


def _opaque(eqn: JaxprEqn, index: int, ins: Types, platform: str, path: Path) -> Types:
    """A primitive with bodies whose operands this module cannot map to them: every
    result depends on every operand and on every value inside (the cautious answer)."""
    inner = ((index, eqn), *path)
    found = _narrowest(ins)
    for _, body in bodies(eqn):
        for inner_eqn in iter_eqns(body):
            found = _narrowest([found, *_first_order(inner_eqn, None, [], platform, inner)])
    return _made_by(eqn, index, found, path)


def _call(eqn: JaxprEqn, index: int, ins: Types, platform: str, path: Path) -> Types:
    """A call-like primitive: its body runs once on the operands."""
    found = bodies(eqn)
    if len(found) != 1 or len(found[0][1].invars) != len(ins):
        return _opaque(eqn, index, ins, platform, path)
    outs = _propagate(found[0][1], ins, platform, ((index, eqn), *path))
    return outs if len(outs) == len(eqn.outvars) else _opaque(eqn, index, ins, platform, path)


def _loop(body: Jaxpr, fixed: Types, carry: Types, rest: Types, platform: str, path: Path):
    """Run ``body(*fixed, *carry, *rest)`` (outputs: carry, then others) until the carry's
    types stop narrowing: each round narrows at least one, so it ends."""
    while True:
        outs = _propagate(body, [*fixed, *carry, *rest], platform, path)
        merged = [_narrower(c, o) for c, o in zip(carry, outs)]
        if [getattr(t, "bits", None) for t in merged] == [getattr(t, "bits", None) for t in carry]:
            return merged, outs[len(carry) :]
        carry = merged


def _scan(eqn: JaxprEqn, index: int, ins: Types, platform: str, path: Path) -> Types:
    body = bodies(eqn)[0][1]
    num_consts, num_carry = scan_operand_counts(eqn.params)
    consts, carry = ins[:num_consts], ins[num_consts : num_consts + num_carry]
    inner = ((index, eqn), *path)
    carry, ys = _loop(body, consts, carry, ins[num_consts + num_carry :], platform, inner)
    return [*carry, *ys]


def _while(eqn: JaxprEqn, index: int, ins: Types, platform: str, path: Path) -> Types:
    found = dict(bodies(eqn))
    cond, body = found.get("cond_jaxpr"), found.get("body_jaxpr")
    if cond is None or body is None:
        return _opaque(eqn, index, ins, platform, path)
    # Operands: the condition's constants, the body's constants, the carry.
    num_carry = len(body.outvars)
    num_cond = len(cond.invars) - num_carry
    num_body = len(body.invars) - num_carry
    cond_consts = ins[:num_cond]
    body_consts = ins[num_cond : num_cond + num_body]
    inner = ((index, eqn), *path)
    carry, _ = _loop(body, body_consts, ins[num_cond + num_body :], [], platform, inner)
    # The condition decides how many rounds run: every result depends on it.
    (predicate,) = _propagate(cond, [*cond_consts, *carry], platform, inner)
    return [_narrower(c, predicate) for c in carry]


def _cond(eqn: JaxprEqn, index: int, ins: Types, platform: str, path: Path) -> Types:
    inner = ((index, eqn), *path)
    branches = [_propagate(body, ins[1:], platform, inner) for _, body in bodies(eqn)]
    # The branch index chooses the result: every result depends on it.
    return [_narrowest([ins[0], *outs]) for outs in zip(*branches)]


#: How each higher-order primitive maps its operands to its bodies; any other
#: primitive with bodies is walked cautiously (every result depends on everything).
_RULES: dict[str, Callable[..., Types]] = {
    **{name: _call for name in CALL_PRIMITIVES},
    "shard_map": _call,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def reference_compute_types(
    reference: Callable[..., Any] | ClosedJaxpr, inputs: Sequence[Any]
) -> tuple[ComputeType | None, ...]:
    """:func:`result_compute_types` of ``reference(*inputs)`` as JAX traces it (a
    ``ClosedJaxpr`` is taken as it is), on the platform of the inputs
    (:func:`platform_of`).

    >>> import jax.numpy as jnp
    >>> [t.dtype for t in reference_compute_types(lambda x: [x.astype(jnp.float16) * 2], [jnp.ones(2)])]
    ['float16']
    """
    program = (
        reference if isinstance(reference, ClosedJaxpr) else jax.make_jaxpr(reference)(*inputs)
    )
    return result_compute_types(program, platform=platform_of(inputs))
