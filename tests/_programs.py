"""Random programs for the differential tests (#24 item 3), built from the idioms real
models use: ``jax.jit`` helpers called 1-3 times with equal and different shapes,
nested jit, every ``jax.nn`` activation, custom_jvp / custom_vjp, ``jax.checkpoint``
with each policy, scans (nested, reverse, with stacked outputs), cond, while, tied
weights, several outputs, pytree inputs and outputs, and boundary markers.

A program is a :class:`Recipe` (a hypothesis-drawn list of :class:`Step`) turned into a
fresh Python function ``fn(params, x)`` by :func:`build`. Every step reads activations
of shape ``(BATCH, WIDTH)`` and parameters, and computes row by row (no value mixes two
rows of ``x``), so a loss that is a mean over rows splits into microbatches exactly, as
the runtime needs. Every helper that a body or a jit wraps is made once, here, at import
time: JAX caches traces and compilations on the function object, so examples after the
first few compile nothing new and the tests stay fast.

The reference is always JAX's own evaluation of ``fn`` (eager, and ``jax.value_and_grad``
for gradients); :func:`describe` prints a recipe as the Python it runs, for reports.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import pipemark as pm

BATCH = 4  # rows of x; split into 1, 2 or 4 microbatches by the runtime tests
WIDTH = 3  # != BATCH, so a helper called on x and on a weight sees different shapes
NUM_WEIGHTS = 3
STACK = 3  # layers of the scanned weight stack
DEEP = (2, 2)  # outer x inner layers of the nested scan

RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------ activations


def _glu(a):
    return jax.nn.glu(jnp.concatenate([a, a * 0.5 + 0.1], axis=-1))


def _attention(a):
    # (rows, time=WIDTH, heads=1, head_dim=1): attention within each row only.
    q = a.reshape(BATCH, WIDTH, 1, 1)
    return jax.nn.dot_product_attention(q, q * 0.5, q).reshape(a.shape)


#: Every differentiable ``jax.nn`` activation of JAX 0.10, as a function of one
#: (BATCH, WIDTH) array returning that shape. Reductions keep their axis.
ACTIVATIONS = {
    "celu": jax.nn.celu,
    "elu": jax.nn.elu,
    "gelu": jax.nn.gelu,
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "glu": _glu,
    "hard_sigmoid": jax.nn.hard_sigmoid,
    "hard_silu": jax.nn.hard_silu,
    "hard_swish": jax.nn.hard_swish,
    "hard_tanh": jax.nn.hard_tanh,
    "identity": jax.nn.identity,
    "leaky_relu": jax.nn.leaky_relu,
    "log1mexp": lambda a: jax.nn.log1mexp(jax.nn.softplus(a) + 0.5),
    "log_sigmoid": jax.nn.log_sigmoid,
    "log_softmax": jax.nn.log_softmax,
    "logmeanexp": lambda a: a - jax.nn.logmeanexp(a, axis=-1, keepdims=True),
    "logsumexp": lambda a: a - jax.nn.logsumexp(a, axis=-1, keepdims=True),
    "mish": jax.nn.mish,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "selu": jax.nn.selu,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "soft_sign": jax.nn.soft_sign,
    "softmax": jax.nn.softmax,
    "softplus": jax.nn.softplus,
    "sparse_plus": jax.nn.sparse_plus,
    "sparse_sigmoid": jax.nn.sparse_sigmoid,
    "squareplus": jax.nn.squareplus,
    "standardize": jax.nn.standardize,
    "swish": jax.nn.swish,
    "tanh": jax.nn.tanh,
    "dot_product_attention": _attention,
}


# ------------------------------------------------------------------ jitted helpers


@jax.jit
def _gate(a):
    return a * jnp.tanh(a) + 0.1 * a


@jax.jit
def _nested(a):
    # nested jit, the inner helper called twice with equal shapes
    return _gate(a) - 0.5 * _gate(a * 0.5) + jax.nn.silu(a)


@jax.jit
def _nested2(a):
    return _nested(a) * 0.5 + jax.nn.softplus(_gate(a))


@jax.jit
def _affine(a, w):
    return jnp.sin(a @ w) + a @ w * 0.5


#: Elementwise jitted helpers (any shape in, same shape out).
HELPERS = {
    "gate": _gate,
    "nested": _nested,
    "nested2": _nested2,
    "silu": jax.nn.silu,
    "softplus": jax.nn.softplus,
    "elu": jax.nn.elu,
    "log_sigmoid": jax.nn.log_sigmoid,
    "leaky_relu": jax.nn.leaky_relu,
}


@jax.jit
def _marked_helper(a):
    # a jitted layer that ends with a boundary: every call cuts the program
    b = jnp.sin(a) * 0.8
    pm.mark_pipeline_boundary()
    return jnp.cos(b) + a * 0.1


# ------------------------------------------------------------------ custom rules


@jax.custom_jvp
def _soft_clip(a):
    return jnp.tanh(a) * 2.0


@_soft_clip.defjvp
def _soft_clip_jvp(primals, tangents):
    (a,), (t,) = primals, tangents
    # a deliberately different (but fixed) derivative: 1.5 x the true one
    return _soft_clip(a), 1.5 * 2.0 * (1.0 - jnp.tanh(a) ** 2) * t


@jax.custom_vjp
def _scaled_softplus(a, w):
    return jax.nn.softplus(a @ w)


def _scaled_softplus_fwd(a, w):
    return _scaled_softplus(a, w), (a, w)


def _scaled_softplus_bwd(res, g):
    a, w = res
    g = g * jax.nn.sigmoid(a @ w) * 0.5  # half the true cotangent
    return g @ w.T, a.T @ g


_scaled_softplus.defvjp(_scaled_softplus_fwd, _scaled_softplus_bwd)


# ------------------------------------------------------------------ checkpoint


def _block(a, w):
    h = jnp.tanh(a @ w)
    h = checkpoint_name(h, "hidden")
    return jax.nn.gelu(h @ w.T) + a


_POLICIES = jax.checkpoint_policies
POLICIES = {
    "none": None,
    "nothing_saveable": _POLICIES.nothing_saveable,
    "everything_saveable": _POLICIES.everything_saveable,
    "dots_saveable": _POLICIES.dots_saveable,
    "checkpoint_dots": _POLICIES.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": _POLICIES.dots_with_no_batch_dims_saveable,
    "save_only_these_names": _POLICIES.save_only_these_names("hidden"),
    "save_anything_except_these_names": _POLICIES.save_anything_except_these_names("hidden"),
    "save_any_names_but_these": _POLICIES.save_any_names_but_these("hidden"),
}
CHECKPOINTED = {name: jax.checkpoint(_block, policy=policy) for name, policy in POLICIES.items()}


# ------------------------------------------------------------------ control flow


def _layer(h, w):
    h = jax.nn.silu(h @ w) * 0.7 + h * 0.3
    return h, jnp.tanh(h)


def _outer_layer(h, ws):
    h, ys = lax.scan(_layer, h, ws)
    return h, ys.sum(0)


def _branch_a(a, w):
    return jnp.tanh(a @ w)


def _branch_b(a, w):
    return jax.nn.softplus(a) - _gate(a @ w.T)


def _while_body(carry):
    i, h = carry
    return i + 1, jnp.sin(h) * 0.9 + 0.1


# ------------------------------------------------------------------ recipes


@dataclass(frozen=True)
class Step:
    """One operation: ``kind`` (a key of :data:`OPS`) and its drawn arguments."""

    kind: str
    reads: tuple[int, ...]  # activation indices read
    arg: str = ""  # activation / helper / policy name
    weight: int = 0  # which weight of params["w"]
    times: int = 1  # calls of the helper
    flag: bool = False  # reverse scan / different shapes / ...


@dataclass(frozen=True)
class Recipe:
    """A program: its steps, which activations it returns, and where boundaries go."""

    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    boundaries: tuple[int, ...] = ()  # a boundary marker after these steps

    @property
    def kinds(self) -> set[str]:
        return {s.kind for s in self.steps}

    @property
    def differentiable(self) -> bool:
        return "while" not in self.kinds  # JAX cannot reverse-differentiate while

    @property
    def marked(self) -> bool:
        return bool(self.boundaries) or "marked_jit" in self.kinds


def _w(params, step):
    return params["w"][step.weight]


def _op_act(params, vals, s):
    return ACTIVATIONS[s.arg](vals[s.reads[0]])


def _op_dense(params, vals, s):
    return vals[s.reads[0]] @ _w(params, s) + params["b"]


def _op_tied(params, vals, s):
    w = _w(params, s)  # the same weight read twice (tied embedding style)
    return jnp.tanh(vals[s.reads[0]] @ w) @ w.T


def _op_add(params, vals, s):
    return vals[s.reads[0]] + vals[s.reads[1]] * 0.5


def _op_mul(params, vals, s):
    return vals[s.reads[0]] * jnp.tanh(vals[s.reads[1]])


def _op_jit(params, vals, s):
    helper = HELPERS[s.arg]
    out = helper(vals[s.reads[0]])
    for k in range(1, s.times):  # the same helper again, on other activations
        out = out + helper(vals[s.reads[k % len(s.reads)]] * (0.5 + k))
    if s.flag:  # and on a weight: another shape
        out = out @ helper(_w(params, s))
    return out


def _op_affine(params, vals, s):
    out = _affine(vals[s.reads[0]], _w(params, s))
    if s.flag:  # the same helper on (WIDTH, WIDTH) operands
        out = out @ _affine(_w(params, s), params["w"][(s.weight + 1) % NUM_WEIGHTS])
    return out


def _op_custom_jvp(params, vals, s):
    return _soft_clip(vals[s.reads[0]])


def _op_custom_vjp(params, vals, s):
    return _scaled_softplus(vals[s.reads[0]], _w(params, s))


def _op_checkpoint(params, vals, s):
    return CHECKPOINTED[s.arg](vals[s.reads[0]], _w(params, s))


def _op_scan(params, vals, s):
    h, ys = lax.scan(_layer, vals[s.reads[0]], params["stack"], reverse=s.flag)
    return h + ys.mean(0)


def _op_nested_scan(params, vals, s):
    h, ys = lax.scan(_outer_layer, vals[s.reads[0]], params["deep"], reverse=s.flag)
    return h - ys.mean(0)


def _op_cond(params, vals, s):
    w = _w(params, s)
    return lax.cond(jnp.sum(w) > 0, _branch_a, _branch_b, vals[s.reads[0]], w)


def _op_while(params, vals, s):
    _, h = lax.while_loop(lambda c: c[0] < 3, _while_body, (0, vals[s.reads[0]]))
    return h


def _op_marked_jit(params, vals, s):
    return _marked_helper(vals[s.reads[0]])


OPS = {
    "act": (1, _op_act, "{out} = jax.nn.{arg}({a})"),
    "dense": (1, _op_dense, "{out} = {a} @ w[{weight}] + b"),
    "tied": (1, _op_tied, "{out} = tanh({a} @ w[{weight}]) @ w[{weight}].T"),
    "add": (2, _op_add, "{out} = {a} + {b} * 0.5"),
    "mul": (2, _op_mul, "{out} = {a} * tanh({b})"),
    "jit": (3, _op_jit, "{out} = jit helper {arg} x{times} on {reads} (on w[{weight}]: {flag})"),
    "affine": (1, _op_affine, "{out} = jit _affine({a}, w[{weight}]) (twice: {flag})"),
    "custom_jvp": (1, _op_custom_jvp, "{out} = custom_jvp _soft_clip({a})"),
    "custom_vjp": (1, _op_custom_vjp, "{out} = custom_vjp _scaled_softplus({a}, w[{weight}])"),
    "checkpoint": (1, _op_checkpoint, "{out} = checkpoint(_block, policy={arg})({a}, w[{weight}])"),
    "scan": (1, _op_scan, "{out} = scan(_layer, {a}, stack, reverse={flag})"),
    "nested_scan": (1, _op_nested_scan, "{out} = scan(scan(_layer), {a}, deep, reverse={flag})"),
    "cond": (1, _op_cond, "{out} = cond(sum(w[{weight}]) > 0, _branch_a, _branch_b, {a})"),
    "while": (1, _op_while, "{out} = while_loop(3 trips of sin, {a})"),
    "marked_jit": (1, _op_marked_jit, "{out} = jit _marked_helper({a})  # holds a boundary"),
}
_ARG_CHOICES = {
    "act": sorted(ACTIVATIONS),
    "jit": sorted(HELPERS),
    "checkpoint": sorted(CHECKPOINTED),
}
SCANS = frozenset({"scan", "nested_scan"})
CONTROL_FLOW = frozenset({"checkpoint", "scan", "nested_scan", "cond", "while"})


def build(recipe: Recipe):
    """A fresh ``fn(params, x)`` running ``recipe``; returns a pytree of activations:
    ``{"out": last, "aux": (others...)}`` or just the last one."""

    def fn(params, x):
        vals = [x]
        for i, step in enumerate(recipe.steps):
            vals.append(OPS[step.kind][1](params, vals, step))
            if i in recipe.boundaries:
                pm.mark_pipeline_boundary()
        last = vals[-1]
        if not recipe.outputs:
            return last
        return {"out": last, "aux": tuple(vals[i] for i in recipe.outputs)}

    return fn


def loss_of(recipe: Recipe):
    """A scalar loss over every output of ``build(recipe)``: a mean over rows, so the
    runtime's microbatch mean equals it."""
    fn = build(recipe)

    def loss(params, x):
        leaves = jax.tree_util.tree_leaves(fn(params, x))
        return sum(jnp.mean(leaf * (1.0 + 0.25 * k)) for k, leaf in enumerate(leaves))

    return loss


def describe(recipe: Recipe) -> str:
    """The recipe as the Python-like lines it runs (for failure reports)."""
    lines = ["def fn(params, x):  # v0 = x; w = params['w'], b = params['b']"]
    for i, s in enumerate(recipe.steps):
        names = [f"v{r}" for r in s.reads]
        text = OPS[s.kind][2].format(
            out=f"v{i + 1}",
            a=names[0],
            b=names[-1],
            reads=", ".join(names),
            arg=s.arg,
            weight=s.weight,
            times=s.times,
            flag=s.flag,
        )
        lines.append("    " + text)
        if i in recipe.boundaries:
            lines.append("    pm.mark_pipeline_boundary()")
    last = f"v{len(recipe.steps)}"
    outs = ", ".join(f"v{i}" for i in recipe.outputs)
    lines.append(
        f"    return {{'out': {last}, 'aux': ({outs},)}}" if outs else f"    return {last}"
    )
    return "\n".join(lines)


@st.composite
def steps(draw, index: int, kinds: list[str]) -> Step:
    kind = draw(st.sampled_from(kinds))
    arity = OPS[kind][0]
    reads = tuple(draw(st.integers(0, index)) for _ in range(arity))
    choices = _ARG_CHOICES.get(kind)
    return Step(
        kind=kind,
        reads=reads,
        arg=draw(st.sampled_from(choices)) if choices else "",
        weight=draw(st.integers(0, NUM_WEIGHTS - 1)),
        times=draw(st.integers(1, 3)) if kind == "jit" else 1,
        flag=draw(st.booleans()),
    )


@st.composite
def recipes(
    draw,
    *,
    markers: bool = False,
    differentiable: bool = False,
    needs: frozenset[str] = frozenset(),
    max_steps: int = 6,
    straight: bool = False,
) -> Recipe:
    """Random recipes. ``markers``: boundary markers (and a jitted helper holding one)
    may appear; ``differentiable``: no while loop; ``needs``: at least one step of one
    of these kinds; ``straight``: no control flow (:data:`CONTROL_FLOW`), whose bodies
    JAX compiles afresh for every program (cheap examples, for large counts)."""
    kinds = [k for k in OPS if k != "marked_jit" or markers]
    if straight:
        kinds = [k for k in kinds if k not in CONTROL_FLOW]
    if differentiable and "while" in kinds:
        kinds.remove("while")
    count = draw(st.integers(2 if markers else 1, max_steps))
    drawn = [draw(steps(i, kinds)) for i in range(count)]
    if needs and not needs & {s.kind for s in drawn}:
        where = draw(st.integers(0, count - 1))
        drawn[where] = draw(steps(where, sorted(needs)))
    outputs = tuple(draw(st.lists(st.integers(0, count - 1), max_size=2, unique=True)))
    boundaries: tuple[int, ...] = ()
    if markers:
        # at least one cut: a boundary, or a call of the jitted helper that holds one
        least = 0 if "marked_jit" in {s.kind for s in drawn} else 1
        cuts = st.sets(st.integers(0, count - 2), min_size=least, max_size=3)
        boundaries = tuple(sorted(draw(cuts)))
    return Recipe(tuple(drawn), outputs, boundaries)


def inputs(seed: int) -> tuple[dict, jax.Array]:
    """``(params, x)`` for a seed: params a pytree (a list of weights, a bias, a layer
    stack and a nested stack), x a (BATCH, WIDTH) batch."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32) * scale)

    scale = 1.0 / np.sqrt(WIDTH)
    params = {
        "w": [normal(WIDTH, WIDTH, scale=scale) for _ in range(NUM_WEIGHTS)],
        "b": normal(WIDTH, scale=0.1),
        "stack": normal(STACK, WIDTH, WIDTH, scale=scale),
        "deep": normal(*DEEP, WIDTH, WIDTH, scale=scale),
    }
    return params, normal(BATCH, WIDTH)


def assert_close(got, want, what: str, recipe: Recipe) -> None:
    """``got`` (a flat list) equals the leaves of ``want`` within float32 rounding."""
    want = jax.tree_util.tree_leaves(want)
    got = list(got)
    assert len(got) == len(want), f"{what}: {len(got)} results, JAX gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{what}: result {k} has shape {g.shape}, JAX {w.shape}"
        diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        bound = ATOL + RTOL * np.abs(w.astype(np.float64))
        if not np.all(diff <= bound):
            worst = int(np.argmax(diff - bound))
            raise AssertionError(
                f"{what}: result {k} differs from JAX by up to {float(diff.max()):.3g} "
                f"(largest |JAX value| {float(np.abs(w).max()):.3g}; at flat index {worst}: "
                f"{float(g.flat[worst])!r} vs {float(w.flat[worst])!r})\n{describe(recipe)}"
            )
