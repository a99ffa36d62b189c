"""The pipeline_marker primitive: identity under every transformation, and the markers
each transformation leaves in the program."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var, check_jaxpr, jaxpr_as_fun
from jax.interpreters import partial_eval as pe
from jax.test_util import check_grads

import pipemark as pm
from pipemark.marks import MARK_TYPES
from pipemark.primitive import is_marker
from tests._trees import assert_trees_within_ulps

LAYERS = 3


def _params(seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * LAYERS)
    return [
        (
            jax.random.normal(keys[2 * i], (4, 4)) / 2,
            jax.random.normal(keys[2 * i + 1], (4,)) / 10,
        )
        for i in range(LAYERS)
    ]


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
PARAMS = _params()


def mlp(params, x, *, marked: bool = True):
    """A small MLP; with ``marked`` every layer sits between a start and an end marker."""
    for i, (w, b) in enumerate(params):
        if marked:
            x, w, b = pm.mark((x, w, b), name=f"layer{i}", mark_type="start")
        x = jnp.tanh(x @ w + b)
        if marked:
            x = pm.mark(x, name=f"layer{i}", mark_type="end")
    return x


def loss(params, x, *, marked: bool = True):
    return jnp.sum(mlp(params, x, marked=marked) ** 2)


marked_loss = functools.partial(loss, marked=True)
plain_loss = functools.partial(loss, marked=False)


def markers(closed: ClosedJaxpr | Jaxpr, recursive: bool = False):
    """(mark_type, name, number of operands) of every marker equation, in order."""
    jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is pm.pipeline_p:
            found.append((eqn.params["mark_type"], eqn.params["name"], len(eqn.invars)))
        elif recursive:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found.extend(markers(sub, recursive=True))
    return found


def assert_tree_close(a, b, rtol=1e-6, atol=1e-6):
    jax.tree_util.tree_map(
        lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol, atol), a, b
    )


# ------------------------------------------------- equal to the unmarked function


def test_eager_equals_unmarked():
    # Eager: the same operations run one by one on both sides, the markers in between
    # computing nothing, so the same bits (tests/_exact.py).
    np.testing.assert_array_equal(mlp(PARAMS, X), mlp(PARAMS, X, marked=False))


@pytest.mark.parametrize("mode", ["barrier", "identity"])
def test_jit_equals_unmarked(mode):
    with pm.lowering(mode):
        got = jax.jit(marked_loss)(PARAMS, X)
    np.testing.assert_allclose(got, plain_loss(PARAMS, X), rtol=1e-6)


def test_grad_equals_unmarked():
    assert_tree_close(jax.grad(marked_loss)(PARAMS, X), jax.grad(plain_loss)(PARAMS, X))
    assert_tree_close(
        jax.grad(marked_loss, argnums=(0, 1))(PARAMS, X),
        jax.grad(plain_loss, argnums=(0, 1))(PARAMS, X),
    )


def test_jitted_grad_equals_unmarked():
    assert_tree_close(jax.jit(jax.grad(marked_loss))(PARAMS, X), jax.grad(plain_loss)(PARAMS, X))


def test_vjp_equals_unmarked():
    out, pullback = jax.vjp(mlp, PARAMS, X)
    ref_out, ref_pullback = jax.vjp(functools.partial(mlp, marked=False), PARAMS, X)
    assert_tree_close(out, ref_out)
    ct = jnp.arange(8.0).reshape(2, 4)
    assert_tree_close(pullback(ct), ref_pullback(ct))


def test_jvp_equals_unmarked():
    tangents = (jax.tree_util.tree_map(jnp.ones_like, PARAMS), jnp.ones_like(X))
    got = jax.jvp(mlp, (PARAMS, X), tangents)
    want = jax.jvp(functools.partial(mlp, marked=False), (PARAMS, X), tangents)
    assert_tree_close(got, want)


def test_linearize_equals_unmarked():
    out, f_lin = jax.linearize(lambda x: mlp(PARAMS, x), X)
    ref_out, ref_lin = jax.linearize(lambda x: mlp(PARAMS, x, marked=False), X)
    assert_tree_close(out, ref_out)
    assert_tree_close(f_lin(jnp.ones_like(X)), ref_lin(jnp.ones_like(X)))


def test_hessian_equals_unmarked():
    got = jax.hessian(lambda x: marked_loss(PARAMS, x))(X)
    want = jax.hessian(lambda x: plain_loss(PARAMS, x))(X)
    assert got.shape == (2, 4, 2, 4)
    assert_tree_close(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_equals_unmarked_and_keeps_markers():
    xs = jnp.stack([X, 2 * X, -X])
    got = jax.vmap(mlp, in_axes=(None, 0))(PARAMS, xs)
    assert_tree_close(got, jax.vmap(functools.partial(mlp, marked=False), (None, 0))(PARAMS, xs))
    jaxpr = jax.make_jaxpr(jax.vmap(mlp, in_axes=(None, 0)))(PARAMS, xs)
    assert markers(jaxpr) == markers(jax.make_jaxpr(mlp)(PARAMS, X))
    starts = [e for e in jaxpr.eqns if is_marker(e, "start")]
    assert starts[0].outvars[0].aval.shape == (3, 2, 4)  # the batch dimension is kept


def test_vmap_over_marker_with_mixed_batch_dims():
    def f(x, y):
        x, y = pm.mark((x, y), name="s", mark_type="start")
        return x * y

    got = jax.vmap(f, in_axes=(1, None))(jnp.ones((3, 5)), jnp.arange(3.0))
    np.testing.assert_array_equal(got, jnp.broadcast_to(jnp.arange(3.0), (5, 3)))


def test_vmap_of_grad_equals_unmarked():
    xs = jnp.stack([X, 2 * X])
    got = jax.vmap(jax.grad(marked_loss), in_axes=(None, 0))(PARAMS, xs)
    want = jax.vmap(jax.grad(plain_loss), in_axes=(None, 0))(PARAMS, xs)
    assert_tree_close(got, want)


def test_check_grads_second_order():
    # Finite differences need float32 matmuls: an accelerator's default precision (a
    # TPU's bf16 passes) is coarser than their step.
    with jax.default_matmul_precision("highest"):
        check_grads(marked_loss, (PARAMS, X), order=2, modes=["fwd", "rev"], atol=1e-2, rtol=1e-2)


# -------------------------------------------------------- inside control flow


def test_marker_in_scan_body():
    w = PARAMS[0][0]

    def step(carry, _, marked):
        if marked:
            carry = pm.mark(carry, name="step", mark_type="start")
        carry = jnp.tanh(carry @ w)
        if marked:
            carry = pm.mark(carry, name="step", mark_type="end")
        return carry, jnp.sum(carry)

    def f(x, marked=True):
        carry, ys = lax.scan(functools.partial(step, marked=marked), x, None, length=4)
        return jnp.sum(carry) + jnp.sum(ys)

    np.testing.assert_allclose(f(X), f(X, False), rtol=1e-6)
    assert_tree_close(jax.grad(f)(X), jax.grad(functools.partial(f, marked=False))(X))
    jaxpr = jax.make_jaxpr(jax.grad(f))(X)
    found = markers(jaxpr, recursive=True)
    assert ("start", "step", 1) in found
    assert ("start", "step_backward", 1) in found


def test_marker_in_cond_branch():
    def f(x, pred, marked=True):
        def yes(x):
            if marked:
                x = pm.mark(x, name="branch", mark_type="start")
            return jnp.sin(x) * 2

        return jnp.sum(lax.cond(pred, yes, jnp.cos, x))

    for pred in (True, False):
        np.testing.assert_allclose(f(X, pred), f(X, pred, False), rtol=1e-6)
        assert_tree_close(
            jax.grad(f)(X, pred), jax.grad(functools.partial(f, marked=False))(X, pred)
        )
        assert_tree_close(
            jax.jit(jax.grad(f))(X, pred), jax.grad(functools.partial(f, marked=False))(X, pred)
        )


def test_marker_in_while_body():
    def f(x, marked=True):
        def body(state):
            i, x = state
            if marked:
                x = pm.mark(x, name="body", mark_type="hook")
            return i + 1, x * 0.5 + 1.0

        return lax.while_loop(lambda s: s[0] < 5, body, (0, x))[1]

    # The loop compiles as one program, with the marker's barrier in its body or
    # without; jit compiles the whole function: three programs (tests/_exact.py).
    assert_trees_within_ulps(f(X), f(X, False))
    assert_trees_within_ulps(jax.jit(f)(X), f(X, False))
    assert ("hook", "body", 1) in markers(jax.make_jaxpr(f)(X), recursive=True)


def test_checkpoint_duplicates_forward_markers():
    f = jax.checkpoint(marked_loss)
    assert_tree_close(jax.grad(f)(PARAMS, X), jax.grad(plain_loss)(PARAMS, X))
    found = markers(jax.make_jaxpr(jax.grad(f))(PARAMS, X), recursive=True)
    # The forward starts are recomputed for the backward pass: seen twice.
    assert sum(1 for m in found if m[:2] == ("start", "layer0")) == 2
    assert ("end", "layer0_backward", 2) in found


def test_custom_vjp_function():
    @jax.custom_vjp
    def scaled(x):
        return 3.0 * x

    scaled.defvjp(lambda x: (3.0 * x, None), lambda _, g: (3.0 * g,))

    def f(x, marked=True):
        if marked:
            x = pm.mark(x, name="a", mark_type="start")
        y = scaled(jnp.sin(x))
        if marked:
            y = pm.mark(y, name="a", mark_type="end")
        return jnp.sum(y)

    np.testing.assert_allclose(jax.grad(f)(X), jax.grad(functools.partial(f, marked=False))(X))
    np.testing.assert_allclose(
        jax.jit(jax.grad(f))(X), jax.grad(functools.partial(f, marked=False))(X), rtol=1e-6
    )


def test_nested_jit():
    inner = jax.jit(lambda p, x: mlp(p, x))
    outer = jax.jit(lambda p, x: jnp.sum(inner(p, x) ** 2))
    np.testing.assert_allclose(outer(PARAMS, X), plain_loss(PARAMS, X), rtol=1e-6)
    assert_tree_close(jax.grad(outer)(PARAMS, X), jax.grad(plain_loss)(PARAMS, X))
    found = markers(jax.make_jaxpr(outer)(PARAMS, X), recursive=True)
    assert [m[:2] for m in found if m[0] == "start"] == [("start", f"layer{i}") for i in range(3)]


# --------------------------------------------- the markers transformations leave


def test_grad_mirrors_markers_in_reverse_order():
    found = markers(jax.make_jaxpr(jax.grad(marked_loss))(PARAMS, X))
    forward = [(t, n) for t, n, _ in found if not n.endswith("_backward")]
    backward = [(t, n) for t, n, _ in found if n.endswith("_backward")]
    assert forward == [(t, f"layer{i}") for i in range(LAYERS) for t in ("start", "end")]
    assert backward == [
        (t, f"layer{i}_backward") for i in reversed(range(LAYERS)) for t in ("start", "end")
    ]
    # The backward end of a layer carries the cotangents of the layer's inputs that have
    # one: the activation (except for layer 0, whose input is not differentiated) and
    # the layer's parameters.
    ends = {n: k for t, n, k in found if t == "end" and n.endswith("_backward")}
    assert ends == {"layer2_backward": 3, "layer1_backward": 3, "layer0_backward": 2}


def test_jvp_makes_tangent_markers():
    tangents = (jax.tree_util.tree_map(jnp.ones_like, PARAMS), jnp.ones_like(X))
    found = markers(jax.make_jaxpr(lambda p, x, t: jax.jvp(mlp, (p, x), t))(PARAMS, X, tangents))
    assert ("jvp_start", "layer0", 3) in found
    assert ("jvp_end", "layer2", 1) in found
    assert not any(n.endswith("_backward") for _, n, _ in found)


def test_zero_tangents_get_no_tangent_marker():
    # Only x is differentiated: the weights' tangents are symbolic zeros and skip the
    # tangent marker, which carries the activation's tangent alone.
    found = markers(jax.make_jaxpr(lambda x: jax.jvp(lambda x: mlp(PARAMS, x), (x,), (x,)))(X))
    assert ("jvp_start", "layer1", 1) in found


def test_second_order_markers():
    found = markers(jax.make_jaxpr(jax.hessian(lambda x: marked_loss(PARAMS, x)))(X))
    names = {n for _, n, _ in found}
    assert {"layer0", "layer0_backward"} <= names
    assert {t for t, _, _ in found} >= {"start", "end"}


def test_boundary_markers_survive_grad_and_jit():
    def f(x):
        for i in range(3):
            pm.mark_pipeline_boundary()
            x = jnp.sin(x) * (i + 1)
        return jnp.sum(x)

    assert markers(jax.make_jaxpr(f)(X)) == [("boundary", "boundary", 0)] * 3
    # grad: the forward part keeps every boundary; the backward part has none (a
    # boundary with no operands has no tangent and nothing to transpose).
    assert markers(jax.make_jaxpr(jax.grad(f))(X)) == [("boundary", "boundary", 0)] * 3
    inner = jax.make_jaxpr(jax.jit(f))(X).eqns[0].params["jaxpr"]
    assert markers(inner) == [("boundary", "boundary", 0)] * 3
    # jit's dead-code elimination keeps them.
    dced, _ = pe.dce_jaxpr(inner.jaxpr, [True])
    assert markers(dced) == [("boundary", "boundary", 0)] * 3
    np.testing.assert_allclose(jax.jit(f)(X), f(X), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(X), jax.grad(f)(X), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(f)(jnp.stack([X, X])), jnp.stack([f(X), f(X)]))


def test_value_carrying_boundary_is_mirrored():
    def f(x):
        x = pm.mark(jnp.sin(x), name="cut", mark_type="boundary")
        return jnp.sum(jnp.cos(x))

    found = markers(jax.make_jaxpr(jax.grad(f))(X))
    assert found == [("boundary", "cut", 1), ("boundary", "cut_backward", 1)]
    np.testing.assert_allclose(jax.grad(f)(X), -jnp.sin(jnp.sin(X)) * jnp.cos(X), rtol=1e-6)


def test_grad_marker_passes_tangents_unmarked():
    def step(params, x):
        grads = pm.mark_gradient(jax.grad(plain_loss)(params, x))
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)

    found = markers(jax.make_jaxpr(step)(PARAMS, X))
    assert found == [("grad", "grad", 2 * LAYERS)]

    # Differentiating through the gradient marker works and adds no other marker.
    def meta(params):
        return plain_loss(step(params, X), X)

    want = jax.grad(
        lambda p: plain_loss(
            jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, p, jax.grad(plain_loss)(p, X)), X
        )
    )(PARAMS)
    assert_tree_close(jax.grad(meta)(PARAMS), want, rtol=1e-5, atol=1e-5)
    assert {t for t, _, _ in markers(jax.make_jaxpr(jax.grad(meta))(PARAMS))} == {"grad"}


def test_linear_transpose_of_each_mark_type():
    for mark_type, want in [
        ("start", ("end", "m_backward")),
        ("end", ("start", "m_backward")),
        ("jvp_start", ("end", "m_backward")),
        ("jvp_end", ("start", "m_backward")),
        ("boundary", ("boundary", "m_backward")),
        ("hook", ("hook", "m")),
        ("grad", None),
    ]:

        def f(x, mark_type=mark_type):
            return 2.0 * pm.mark(x, name="m", mark_type=mark_type)

        transpose = jax.linear_transpose(f, X)
        (ct,) = transpose(jnp.ones_like(X))
        np.testing.assert_array_equal(ct, 2.0 * jnp.ones_like(X))
        found = markers(jax.make_jaxpr(transpose)(jnp.ones_like(X)))
        assert found == ([] if want is None else [(*want, 1)]), mark_type


def test_transpose_with_zero_cotangents_keeps_stage_delimited():
    # The second result is unused, so its cotangent is a symbolic zero: it skips the
    # transposed marker, which still exists to close the backward stage.
    def f(x, y):
        a, _ = pm.mark((x, y), name="s", mark_type="end")
        return jnp.sum(a)

    found = markers(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(X, X))
    assert ("start", "s_backward", 1) in found

    # When every cotangent is a symbolic zero, the rule still emits a marker with no
    # operands, so the backward stage keeps both its start and its end.
    from jax.interpreters import ad

    rule = ad.primitive_transposes[pm.pipeline_p]

    def transpose_all_zero(x):
        zero = ad.Zero(jax.typeof(x))
        undefined = ad.UndefinedPrimal(jax.typeof(x))
        return rule([zero], undefined, name="s", mark_type="end")

    found = markers(jax.make_jaxpr(transpose_all_zero)(X))
    assert found == [("start", "s_backward", 0)]


# --------------------------------------------------------------- dead code


def test_dce_prunes_dead_pairs_and_keeps_stage_markers():
    def f(x, y):
        x, y = pm.mark((x, y), name="s", mark_type="start")
        h = pm.mark(x * 2, name="h", mark_type="hook")
        del h
        z = pm.mark(x + 1, name="s", mark_type="end")
        del z
        return x

    closed = jax.make_jaxpr(f)(X, X)
    dced, used_inputs = pe.dce_jaxpr(closed.jaxpr, [True])
    assert used_inputs == [True, False]
    assert markers(dced) == [("start", "s", 1), ("end", "s", 0)]
    check_jaxpr(dced)


def test_dce_keeps_every_structural_mark_type():
    for mark_type in ("start", "end", "jvp_start", "jvp_end", "boundary", "grad"):
        closed = jax.make_jaxpr(lambda x, t=mark_type: (pm.mark(x, name="m", mark_type=t), x)[1])(X)
        dced, _ = pe.dce_jaxpr(closed.jaxpr, [True])
        assert markers(dced) == [(mark_type, "m", 0)]
    closed = jax.make_jaxpr(lambda x: (pm.mark(x, name="m", mark_type="hook"), x)[1])(X)
    assert markers(pe.dce_jaxpr(closed.jaxpr, [True])[0]) == []


# ---------------------------------------------------------- public helpers


def test_mark_keeps_pytree_structure():
    tree = {"a": X, "b": [jnp.ones(3), (jnp.zeros(()),)], "c": None}
    out = pm.mark(tree, name="t", mark_type="hook")
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert_tree_close(out, tree)
    assert pm.mark(3.0, name="scalar", mark_type="start") == 3.0
    assert pm.mark((), name="empty", mark_type="boundary") == ()


def test_mark_gradient_returns_tree():
    grads = jax.grad(plain_loss)(PARAMS, X)
    assert_tree_close(pm.mark_gradient(grads), grads)


def _debug_info():
    return jax.extend.core.DebugInfo("test", "hand-built", ("x",), ("y",))


def test_mark_pipeline_jaxpreqn_builds_checkable_equation():
    aval = jax.typeof(X)
    a, b = Var(aval), Var(aval)
    eqn = pm.mark_pipeline_jaxpreqn([a], [b], "stage0", "start")
    assert eqn.params == {"name": "stage0", "mark_type": "start"}
    jaxpr = Jaxpr([], [a], [b], [eqn], debug_info=_debug_info())
    check_jaxpr(jaxpr)
    np.testing.assert_array_equal(jaxpr_as_fun(ClosedJaxpr(jaxpr, []))(X)[0], X)


def test_mark_hook_jaxpreqn():
    aval = jax.typeof(X)
    a, b = Var(aval), Var(aval)
    eqn = pm.mark_hook_jaxpreqn([a], [b])
    assert eqn.params == {"name": "hook", "mark_type": "hook"}
    check_jaxpr(Jaxpr([], [a], [b], [eqn], debug_info=_debug_info()))


def test_flatten_shape_byte_sizes():
    sizes = pm.flatten_shape_byte_sizes(
        (
            jax.ShapeDtypeStruct((2, 3), jnp.float32),
            [np.zeros(5, np.int8), (jnp.zeros((4,), jnp.bfloat16),)],
            jax.typeof(jnp.zeros((), jnp.float64 if jax.config.x64_enabled else jnp.int32)),
        )
    )
    assert sizes.dtype == np.int64
    assert sizes.tolist() == [24, 5, 8, 4 if not jax.config.x64_enabled else 8]
    assert pm.flatten_shape_byte_sizes([]).tolist() == []
    assert pm.flatten_shape_byte_sizes(Var(jax.typeof(X))).tolist() == [32]


def test_is_marker():
    closed = jax.make_jaxpr(mlp)(PARAMS, X)
    assert is_marker(closed.eqns[0]) and is_marker(closed.eqns[0], "start")
    assert not is_marker(closed.eqns[0], "end")
    assert not is_marker(closed.eqns[1])


def test_mark_types():
    assert MARK_TYPES == ("start", "end", "jvp_start", "jvp_end", "boundary", "grad", "hook")
    assert pm.pipeline_p.name == "pipeline_marker"
    assert pm.pipeline_p.multiple_results
