"""How much work a jaxpr or one equation does: FLOPs, memory traffic, parameter bytes.

:func:`estimate_cost` walks a program once and adds up a :class:`Cost` per equation.
The count per primitive lives in one table, :data:`cost_rules`, keyed by primitive name,
with a default for primitives it does not list (the same shape as JAX's ``dce_rules``):

* ``dot_general`` and ``conv_general_dilated`` are exact: two FLOPs per multiply-add,
  and a convolution counts only the kernel taps that land inside the (unpadded,
  undilated) input, as XLA's own cost analysis does.
* Elementwise arithmetic and comparisons are one FLOP per output element;
  transcendental functions (``exp``, ``tanh``, ``rsqrt`` …) are counted in
  ``transcendentals`` instead, again as XLA does. Reductions cost one FLOP per input
  element that is folded in; data movement (``broadcast_in_dim``, ``reshape``,
  ``transpose``, ``gather``, ``slice`` …) costs no FLOPs, only bytes.
* Equations with bodies are costed from their bodies: ``jit``, ``checkpoint``,
  ``custom_jvp_call``/``custom_vjp_call`` once; ``scan`` ``length`` times; ``cond`` as
  its most expensive branch; ``while`` as *one* iteration of its condition and body,
  flagged ``approximate`` because the trip count is not known before running it.

Memory traffic is the unfused upper bound: every equation reads its operands and writes
its results. XLA fuses elementwise chains and moves far fewer bytes; use ``cost="xla"``
for its number.

>>> import jax, jax.numpy as jnp
>>> cj = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((8, 16)), jnp.ones((16, 4)))
>>> c = estimate_cost(cj)
>>> c.flops, c.transcendentals, c.param_bytes
(1024, 32, 768)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from pipemark.errors import PipemarkError, describe_eqn
from pipemark.walk import CALL_PRIMITIVES, bodies

__all__ = [
    "COST_MODELS",
    "Cost",
    "cost_rules",
    "estimate_cost",
    "eqn_costs",
    "flatten_shape_byte_sizes",
    "nbytes",
]

COST_MODELS: tuple[str, ...] = ("analytic", "xla")


@dataclasses.dataclass(frozen=True)
class Cost:
    """The work of a program or an equation.

    Attributes
    ----------
    flops:
        Floating-point (and integer) arithmetic operations; a multiply-add is two.
    transcendentals:
        Calls of transcendental functions (``exp``, ``log``, ``tanh``, ``rsqrt`` …),
        which XLA counts apart from ``flops``.
    bytes_read, bytes_written:
        Bytes the equations read and write, with no fusion (an upper bound).
    param_bytes:
        Bytes of the program's inputs (arguments and constants) that some equation
        consumes. Zero for a single equation.
    approximate:
        True when some part could not be counted exactly (a ``while`` loop costed as
        one iteration, a primitive with no rule); ``notes`` says which.
    notes:
        Human-readable reasons for ``approximate``, without duplicates.
    """

    flops: int = 0
    transcendentals: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    param_bytes: int = 0
    approximate: bool = False
    notes: tuple[str, ...] = ()

    @property
    def bytes_accessed(self) -> int:
        """``bytes_read + bytes_written``."""
        return self.bytes_read + self.bytes_written

    @property
    def total_flops(self) -> int:
        """``flops + transcendentals``: the number the automatic slicer balances."""
        return self.flops + self.transcendentals

    def __add__(self, other: Cost) -> Cost:
        if not isinstance(other, Cost):
            return NotImplemented
        return Cost(
            self.flops + other.flops,
            self.transcendentals + other.transcendentals,
            self.bytes_read + other.bytes_read,
            self.bytes_written + other.bytes_written,
            self.param_bytes + other.param_bytes,
            self.approximate or other.approximate,
            _merge_notes(self.notes, other.notes),
        )

    def scaled(self, times: int) -> Cost:
        """The cost of running this ``times`` times (``param_bytes`` unchanged)."""
        return dataclasses.replace(
            self,
            flops=self.flops * times,
            transcendentals=self.transcendentals * times,
            bytes_read=self.bytes_read * times,
            bytes_written=self.bytes_written * times,
        )


def _merge_notes(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    if not b:
        return a
    return tuple(dict.fromkeys(a + b))


def _sum_costs(costs: Iterable[Cost]) -> Cost:
    flops = transcendentals = read = written = params = 0
    approximate = False
    notes: dict[str, None] = {}
    for c in costs:
        flops += c.flops
        transcendentals += c.transcendentals
        read += c.bytes_read
        written += c.bytes_written
        params += c.param_bytes
        approximate = approximate or c.approximate
        for note in c.notes:
            notes[note] = None
    return Cost(flops, transcendentals, read, written, params, approximate, tuple(notes))


# ----------------------------------------------------------------------------- sizes


# Programs repeat a handful of avals many times; avals are hashable and immutable, so
# their sizes are computed once. The cache is bounded so that it cannot grow forever.
_AVAL_SIZES: dict[Any, tuple[int, int]] = {}


def _sizes(aval: Any) -> tuple[int, int]:
    """(elements, bytes) of one value; (0, 0) without an array layout (tokens, refs)."""
    try:
        return _AVAL_SIZES[aval]
    except KeyError:
        pass
    except TypeError:  # an unhashable aval
        return _compute_sizes(aval)
    sizes = _compute_sizes(aval)
    if len(_AVAL_SIZES) < 65536:
        _AVAL_SIZES[aval] = sizes
    return sizes


def _compute_sizes(aval: Any) -> tuple[int, int]:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None:
        return 0, 0
    elements = math.prod(shape)
    if dtype is None:
        return elements, 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        itemsize = getattr(dtype, "itemsize", 0) or 0
    return elements, int(itemsize) * elements


def _size(aval: Any) -> int:
    return _sizes(aval)[0]


def nbytes(aval: Any) -> int:
    """Bytes of one value; 0 for values without an array layout (tokens, refs)."""
    return _sizes(aval)[1]


def _in_avals(eqn: JaxprEqn) -> list[Any]:
    return [v.aval for v in eqn.invars]


def _out_avals(eqn: JaxprEqn) -> list[Any]:
    return [v.aval for v in eqn.outvars]


def _flat(eqn: JaxprEqn, flops: int = 0, transcendentals: int = 0) -> Cost:
    read = written = 0
    for v in eqn.invars:
        read += _sizes(v.aval)[1]
    for v in eqn.outvars:
        written += _sizes(v.aval)[1]
    return Cost(flops, transcendentals, read, written)


# ------------------------------------------------------------------------ cost rules

CostRule = Callable[[JaxprEqn], Cost]

#: Per-primitive cost rules, keyed by primitive name. A rule maps an equation to its
#: :class:`Cost`; primitives not listed get :func:`_default_rule`.
cost_rules: dict[str, CostRule] = {}


def _out_elements(eqn: JaxprEqn) -> int:
    total = 0
    for v in eqn.outvars:
        total += _sizes(v.aval)[0]
    return total


def _elementwise(eqn: JaxprEqn) -> Cost:
    return _flat(eqn, flops=_out_elements(eqn))


def _transcendental(eqn: JaxprEqn) -> Cost:
    return _flat(eqn, transcendentals=_out_elements(eqn))


def _data_movement(eqn: JaxprEqn) -> Cost:
    return _flat(eqn)


def _free(eqn: JaxprEqn) -> Cost:
    # Markers and sharding annotations are identities that move no data.
    del eqn
    return Cost()


def _reduction(eqn: JaxprEqn) -> Cost:
    # Folding n elements into m results takes n - m binary operations.
    folded = sum(_size(a) for a in _in_avals(eqn)) - _out_elements(eqn)
    return _flat(eqn, flops=max(folded, 0))


def _one_minus_square(eqn: JaxprEqn) -> Cost:
    # 1 - x * x: a multiply and a subtraction per element.
    return _flat(eqn, flops=2 * _out_elements(eqn))


def _integer_pow(eqn: JaxprEqn) -> Cost:
    # Square-and-multiply: bit_length - 1 squarings and popcount - 1 multiplications,
    # plus one division for a negative exponent.
    y = int(eqn.params["y"])
    magnitude = abs(y)
    multiplies = 0
    if magnitude > 1:
        multiplies = magnitude.bit_length() - 1 + bin(magnitude).count("1") - 1
    if y < 0:
        multiplies += 1
    return _flat(eqn, flops=multiplies * _out_elements(eqn))


def _dot_general(eqn: JaxprEqn) -> Cost:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contracted = math.prod(lhs_shape[d] for d in lhs_contract)
    return _flat(eqn, flops=2 * _out_elements(eqn) * contracted)


def _conv_valid_taps(
    in_size: int,
    kernel: int,
    out_size: int,
    stride: int,
    padding: tuple[int, int],
    lhs_dilation: int,
    rhs_dilation: int,
) -> int:
    """Pairs (output position, kernel tap) of one spatial dimension whose input
    position is a real element: inside the input and not a hole of lhs dilation."""
    dilated_in = (in_size - 1) * lhs_dilation + 1 if in_size else 0
    taps = 0
    for k in range(kernel):
        offset = k * rhs_dilation - padding[0]
        for o in range(out_size):
            pos = o * stride + offset
            if 0 <= pos < dilated_in and pos % lhs_dilation == 0:
                taps += 1
    return taps


def _conv_general_dilated(eqn: JaxprEqn) -> Cost:
    params = eqn.params
    lhs_spec, rhs_spec, out_spec = params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    rhs_shape = eqn.invars[1].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    spatial = len(lhs_spec) - 2
    strides = params["window_strides"] or (1,) * spatial
    lhs_dilation = params["lhs_dilation"] or (1,) * spatial
    rhs_dilation = params["rhs_dilation"] or (1,) * spatial
    taps = 1
    for i in range(spatial):
        taps *= _conv_valid_taps(
            lhs_shape[lhs_spec[2 + i]],
            rhs_shape[rhs_spec[2 + i]],
            out_shape[out_spec[2 + i]],
            strides[i],
            tuple(params["padding"][i]),
            lhs_dilation[i],
            rhs_dilation[i],
        )
    # Each output (batch, feature) pair sums over the kernel's input features.
    macs = out_shape[out_spec[0]] * out_shape[out_spec[1]] * rhs_shape[rhs_spec[1]] * taps
    return _flat(eqn, flops=2 * macs)


def _sort(eqn: JaxprEqn) -> Cost:
    shape = eqn.invars[0].aval.shape
    n = shape[eqn.params["dimension"]] if shape else 1
    comparisons = math.prod(shape) * max(math.ceil(math.log2(n)), 1) if n > 1 else 0
    return _flat(eqn, flops=comparisons * int(eqn.params.get("num_keys", 1)))


def _scatter_combine(eqn: JaxprEqn) -> Cost:
    # One combining operation per update element.
    return _flat(eqn, flops=_size(eqn.invars[2].aval))


def _reduce_window(eqn: JaxprEqn) -> Cost:
    window = math.prod(eqn.params.get("window_dimensions", (1,)))
    return _flat(eqn, flops=_out_elements(eqn) * max(window - 1, 0))


def _cumulative(eqn: JaxprEqn) -> Cost:
    return _flat(eqn, flops=_out_elements(eqn))


def _cumlogsumexp(eqn: JaxprEqn) -> Cost:
    n = _out_elements(eqn)
    return _flat(eqn, flops=2 * n, transcendentals=2 * n)


def _as_closed(jaxpr: Any) -> ClosedJaxpr:
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


# The cost of each body, for the length of one public call (estimate_cost, eqn_costs):
# a scan split into chunks, or a function jitted once and called many times, shares
# one body among many equations, which is then costed once. Scoped to the call, so
# a program edited between calls is costed afresh.
_BODY_MEMO: contextvars.ContextVar[dict[int, tuple[Any, Cost]] | None] = contextvars.ContextVar(
    "pipemark_body_costs", default=None
)


@contextlib.contextmanager
def _body_memo() -> Iterator[None]:
    if _BODY_MEMO.get() is not None:  # an outer call's memo serves
        yield
        return
    token = _BODY_MEMO.set({})
    try:
        yield
    finally:
        _BODY_MEMO.reset(token)


def _body_cost(jaxpr: Any) -> Cost:
    body = _as_closed(jaxpr).jaxpr
    memo = _BODY_MEMO.get()
    if memo is None:
        return _jaxpr_cost(body, with_params=False)
    entry = memo.get(id(body))
    if entry is None or entry[0] is not body:  # the body is kept alive by the entry
        entry = memo[id(body)] = (body, _jaxpr_cost(body, with_params=False))
    return entry[1]


def _call(eqn: JaxprEqn) -> Cost:
    return _sum_costs(_body_cost(body) for _, body in bodies(eqn))


def _scan(eqn: JaxprEqn) -> Cost:
    return _call(eqn).scaled(int(eqn.params["length"]))


def _cond(eqn: JaxprEqn) -> Cost:
    branches = [_body_cost(body) for _, body in bodies(eqn)]
    # Only one branch runs: charge the most expensive one (by FLOPs, then bytes).
    worst = max(branches, key=lambda c: (c.total_flops, c.bytes_accessed))
    index_bytes = nbytes(eqn.invars[0].aval)
    return worst + Cost(bytes_read=index_bytes)


def _while(eqn: JaxprEqn) -> Cost:
    return _call(eqn) + Cost(
        approximate=True,
        notes=("while loop costed as one iteration (its trip count is not known)",),
    )


def _default_rule(eqn: JaxprEqn) -> Cost:
    """Primitives without a rule: the sum of their bodies when they have any (a call
    of some kind), otherwise one FLOP per output element. Either way flagged."""
    name = eqn.primitive.name
    found = bodies(eqn)
    note = f"no cost rule for {name!r}; "
    if found:
        base = _sum_costs(_body_cost(body) for _, body in found)
        note += "charged the sum of its bodies"
    else:
        base = _elementwise(eqn)
        note += "charged one FLOP per output element"
    return base + Cost(approximate=True, notes=(note,))


def _register(rule: CostRule, names: Iterable[str]) -> None:
    for name in names:
        cost_rules[name] = rule


_register(
    _elementwise,
    [
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "max",
        "min",
        "neg",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round",
        "nextafter",
        "is_finite",
        "select_n",
        "clamp",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and",
        "or",
        "xor",
        "not",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "population_count",
        "clz",
        "add_any",
        "square",
        "conj",
        "real",
        "imag",
        "complex",
        "copysign",
    ],
)
_register(
    _transcendental,
    [
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "atan2",
        "sqrt",
        "rsqrt",
        "cbrt",
        "pow",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "random_gamma_grad",
        "bessel_i0e",
        "bessel_i1e",
        "regularized_incomplete_beta",
        "polygamma",
        "zeta",
    ],
)
_register(
    _data_movement,
    [
        "broadcast_in_dim",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "bitcast_convert_type",
        "reduce_precision",
        "concatenate",
        "pad",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "rev",
        "iota",
        "copy",
        "copy_p",
        "device_put",
        "split",
        "stop_gradient",
        "select_and_gather_add",
        "full_like",
        "random_bits",
        "random_seed",
        "random_wrap",
        "random_unwrap",
        "threefry2x32",
    ],
)
_register(_free, ["pipeline_marker", "sharding_constraint", "optimization_barrier"])
_register(
    _reduction,
    [
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
    ],
)
_register(_cumulative, ["cumsum", "cumprod", "cummax", "cummin"])
_register(_reduce_window, ["reduce_window_sum", "reduce_window_max", "reduce_window_min"])
_register(_scatter_combine, ["scatter-add", "scatter_add", "scatter-mul", "scatter_mul"])
_register(_scatter_combine, ["scatter-min", "scatter_min", "scatter-max", "scatter_max"])
cost_rules["cumlogsumexp"] = _cumlogsumexp
cost_rules["integer_pow"] = _integer_pow
# JAX 0.11 and later stage tanh's derivative as one primitive (0.10: sub and mul); see
# the "tanh derivative" row of pipemark._compat.VERSION_TABLE.
cost_rules["one_minus_square"] = _one_minus_square
cost_rules["dot_general"] = _dot_general
cost_rules["conv_general_dilated"] = _conv_general_dilated
cost_rules["sort"] = _sort
cost_rules["scan"] = _scan
cost_rules["cond"] = _cond
cost_rules["while"] = _while
# Call-like primitives run their body once (pipemark.walk names them across JAX
# versions); so does shard_map, on each device's shard.
_register(_call, [*sorted(CALL_PRIMITIVES), "shard_map"])


# ------------------------------------------------------------------------ public API


def _eqn_cost(eqn: JaxprEqn) -> Cost:
    return cost_rules.get(eqn.primitive.name, _default_rule)(eqn)


def _jaxpr_cost(jaxpr: Jaxpr, *, with_params: bool) -> Cost:
    total = _sum_costs(_eqn_cost(e) for e in jaxpr.eqns)
    if not with_params:
        return total
    consumed: set[Var] = set()
    for eqn in jaxpr.eqns:
        consumed.update(v for v in eqn.invars if isinstance(v, Var))
    params = sum(nbytes(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars) if v in consumed)
    return dataclasses.replace(total, param_bytes=params)


def eqn_costs(jaxpr: ClosedJaxpr | Jaxpr) -> list[Cost]:
    """The analytic :class:`Cost` of each top-level equation, in order."""
    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    with _body_memo():
        return [_eqn_cost(e) for e in inner.eqns]


def estimate_cost(program: ClosedJaxpr | Jaxpr | JaxprEqn, cost: str = "analytic") -> Cost:
    """Estimate the work of a closed jaxpr, an open jaxpr, or one equation.

    Parameters
    ----------
    program:
        A ``ClosedJaxpr`` (e.g. from ``jax.make_jaxpr``), a ``Jaxpr``, or one
        ``JaxprEqn``.
    cost:
        ``"analytic"`` (default) counts with :data:`cost_rules`. ``"xla"`` lowers and
        compiles the program for the default backend and reads XLA's cost analysis
        (after fusion, so its byte counts are much lower); it takes a compilation.

    Returns
    -------
    Cost
        ``param_bytes`` counts the program's arguments and constants that some
        equation reads; it is zero for a single equation.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 5)))
    >>> estimate_cost(cj).flops  # 2 * 2 * 5 * 3
    60
    >>> estimate_cost(cj.jaxpr.eqns[0]).bytes_written
    40
    """
    if cost not in COST_MODELS:
        raise PipemarkError(
            f"Unknown cost model {cost!r}; estimate_cost takes one of "
            f"{', '.join(map(repr, COST_MODELS))}."
        )
    if isinstance(program, JaxprEqn):
        if cost == "xla":
            return _xla_eqn_cost(program)
        with _body_memo():
            return _eqn_cost(program)
    if isinstance(program, (ClosedJaxpr, Jaxpr)):
        closed = _as_closed(program)
        with _body_memo():
            analytic = _jaxpr_cost(closed.jaxpr, with_params=True)
        if cost == "analytic":
            return analytic
        return dataclasses.replace(_xla_cost(closed), param_bytes=analytic.param_bytes)
    raise PipemarkError(
        f"estimate_cost takes a ClosedJaxpr, a Jaxpr or a JaxprEqn, got "
        f"{type(program).__name__}. Trace a function first: jax.make_jaxpr(fn)(*args)."
    )


# ------------------------------------------------------------------------------ XLA


def _xla_cost(closed: ClosedJaxpr, what: str = "the program") -> Cost:
    from jax.extend.core import jaxpr_as_fun

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    try:
        compiled = jax.jit(jaxpr_as_fun(closed)).lower(*avals).compile()
        analysis = compiled.cost_analysis()
    except Exception as err:  # XLA's errors are not ours to classify
        raise PipemarkError(
            f"XLA could not compile {what} for its cost analysis ({err}). "
            "Use cost='analytic' instead."
        ) from err
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per device
        analysis = analysis[0] if analysis else None
    if not analysis:
        raise PipemarkError(
            f"XLA's backend ({jax.default_backend()}) gave no cost analysis for {what}. "
            "Use cost='analytic' instead."
        )
    accessed = int(analysis.get("bytes accessed", 0))
    written = int(sum(v for k, v in analysis.items() if k.startswith("bytes accessedout")))
    return Cost(
        flops=int(analysis.get("flops", 0)),
        transcendentals=int(analysis.get("transcendentals", 0)),
        bytes_read=max(accessed - written, 0),
        bytes_written=written,
    )


def _xla_eqn_cost(eqn: JaxprEqn) -> Cost:
    # Wrap the equation in a program of its own: its Var operands become arguments,
    # its results (dropped ones included) become outputs.
    from jax.extend.core import DebugInfo

    invars = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, Literal)))
    outvars = [Var(v.aval) for v in eqn.outvars]
    debug = DebugInfo(
        "pipemark cost",
        eqn.primitive.name,
        tuple(f"operand[{i}]" for i in range(len(invars))),
        tuple(f"result[{i}]" for i in range(len(outvars))),
    )
    inner = Jaxpr([], invars, outvars, [eqn.replace(outvars=outvars)], eqn.effects, debug)
    return _xla_cost(ClosedJaxpr(inner, ()), describe_eqn(eqn))


def flatten_shape_byte_sizes(x: Any) -> np.ndarray:
    """The byte size of each leaf of ``x``, in order, as an int64 array (an array of
    Python ints when a size does not fit in int64).

    Leaves may be abstract values (``jax.core.ShapedArray``), ``jax.ShapeDtypeStruct``,
    arrays, or jaxpr variables; tuples and lists nest.

    >>> import jax, numpy as np
    >>> flatten_shape_byte_sizes((jax.ShapeDtypeStruct((2, 3), np.float32),
    ...                           [np.zeros(5, np.int8)]))
    array([24,  5])
    """
    sizes: list[int] = []

    def visit(node: Any) -> None:
        if isinstance(node, (tuple, list)):
            for child in node:
                visit(child)
        else:
            sizes.append(_leaf_byte_size(node))

    visit(x)
    if max(sizes, default=0) > _INT64_MAX:
        return np.array(sizes, dtype=object)  # exact Python ints: no int64 wraps around
    return np.array(sizes, dtype=np.int64)


_INT64_MAX = int(np.iinfo(np.int64).max)


def _leaf_byte_size(leaf: Any) -> int:
    aval = getattr(leaf, "aval", leaf)  # a jaxpr Var or Literal carries its aval
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        raise PipemarkError(
            f"flatten_shape_byte_sizes: {leaf!r} of type {type(leaf).__name__} has no "
            "shape and dtype; pass avals, jax.ShapeDtypeStructs, arrays, or nested "
            "tuples/lists of them."
        )
    # math.prod on Python ints: exact for any shape (np.prod in int64 would wrap).
    return int(np.dtype(dtype).itemsize) * math.prod(int(d) for d in shape)
