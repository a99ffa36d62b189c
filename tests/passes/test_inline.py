"""inline_calls: jitted programs, checkpoints and custom derivatives with markers inside
become sliceable, keep their numbers, and nothing else changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import check_jaxpr, jaxpr_as_fun

import pipemark as pm
from pipemark import examples
from pipemark.passes import inline_calls
from pipemark.passes.inline import CALL_RULES
from pipemark.walk import CALL_PRIMITIVES
from tests._trees import assert_trees_within_ulps


def _prims(cj):
    return [e.primitive.name for e in cj.jaxpr.eqns]


def _boundary_loss(params, x):
    for w, b in params:
        x = jnp.tanh(x @ w + b)
        pm.mark_pipeline_boundary()
    return jnp.sum(x**2)


def _params(n=3, width=4):
    rng = np.random.default_rng(0)
    return [
        (jnp.asarray(rng.normal(size=(width, width)), jnp.float32) * 0.5, jnp.full(width, 0.1))
        for _ in range(n)
    ], jnp.asarray(rng.normal(size=(2, width)), jnp.float32)


def _snapshot(cj):
    return str(cj), [id(e) for e in cj.jaxpr.eqns]


def test_rule_table_names_each_call_like_primitive():
    assert CALL_RULES["jit"].action == "inline" and CALL_RULES["jit"].scope == "name"
    assert CALL_RULES["closed_call"].action == "inline"
    assert CALL_RULES["remat2"].action == "split"
    assert CALL_RULES["custom_jvp_call"].action == "inline_marked"
    # One rule for every call-like primitive the walker knows, and no other.
    assert set(CALL_RULES) == CALL_PRIMITIVES
    assert CALL_RULES["custom_vjp_call"].action == "inline_marked"
    for name in ("scan", "cond", "while", "shard_map"):
        assert name not in CALL_RULES


def test_nothing_to_inline_returns_the_input_itself():
    ex = examples.mlp(2)
    cj = jax.make_jaxpr(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert inline_calls(cj) is cj
    # a checkpoint or custom_jvp without markers inside stays as it is
    cj = jax.make_jaxpr(lambda x: jax.checkpoint(jnp.sin)(jax.nn.relu(x)))(1.0)
    assert inline_calls(cj) is cj


@pytest.mark.parametrize(
    "wrap",
    [
        jax.jit,
        lambda f: jax.jit(jax.value_and_grad(f)),
        lambda f: jax.value_and_grad(jax.jit(f)),
        lambda f: jax.jit(jax.jit(f)),
    ],
    ids=["jit", "jit_of_grad", "grad_of_jit", "nested"],
)
def test_jitted_programs_split_and_verify(wrap):
    params, x = _params()
    fn = wrap(_boundary_loss)
    cj = jax.make_jaxpr(fn)(params, x)
    before = _snapshot(cj)
    inlined = inline_calls(cj)
    assert _snapshot(cj) == before  # pure
    check_jaxpr(inlined.jaxpr)
    assert "jit" not in _prims(inlined)
    staged = pm.split(fn, params, x)
    names = [s.name for s in staged.stages]
    assert names[:4] == ["layer0", "layer1", "layer2", "layer3"]
    staged.verify(fn, params, x)


def test_inlined_equations_keep_the_jit_name_in_their_scope():
    params, x = _params()

    def named_loss(params, x):
        return _boundary_loss(params, x)

    def outer(params, x):
        return jax.jit(named_loss)(params, x) * 2.0

    cj = inline_calls(jax.make_jaxpr(outer)(params, x))
    scopes = [str(e.source_info.name_stack) for e in cj.jaxpr.eqns]
    assert set(scopes[:-1]) == {"named_loss"} and scopes[-1] == ""


def test_a_whole_program_call_is_inlined_without_copies():
    params, x = _params()
    cj = jax.make_jaxpr(jax.jit(_boundary_loss))(params, x)
    (call,) = cj.jaxpr.eqns
    body = call.params["jaxpr"].jaxpr
    inlined = inline_calls(cj)
    assert {str(e.source_info.name_stack) for e in inlined.jaxpr.eqns} == {""}
    # The body is the program: its equations and variables are reused, not copied.
    assert inlined.jaxpr.eqns == body.eqns
    assert all(a is b for a, b in zip(inlined.jaxpr.eqns, body.eqns))
    assert inlined.jaxpr.invars == body.invars
    assert inlined.jaxpr.debug_info.arg_names == cj.jaxpr.debug_info.arg_names
    leaves = jax.tree_util.tree_leaves((params, x))
    # The call ran as one compiled program; inlined, its equations run one by one: two
    # programs, whose reductions may round apart (issue #38: 1 ulp on some CPUs).
    assert_trees_within_ulps(jaxpr_as_fun(inlined)(*leaves), jaxpr_as_fun(cj)(*leaves))


def test_equinox_filter_jit_splits():
    eqx = pytest.importorskip("equinox")
    params, x = _params()
    fn = eqx.filter_jit(_boundary_loss)
    staged = pm.split(fn, params, x)
    assert len(staged.stages) == 4
    staged.verify(fn, params, x)


def test_jitted_layers_inside_an_unmarked_model_balance_automatically():
    params, x = _params(4)
    layer = jax.jit(lambda x, w, b: jnp.tanh(x @ w + b))

    def loss(params, x):
        for w, b in params:
            x = layer(x, w, b)  # the same jaxpr inlined four times
        return jnp.sum(x**2)

    fn = jax.jit(jax.value_and_grad(loss))
    staged = pm.split(fn, params, x, num_stages=2)
    assert [s.name for s in staged.stages] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward"
    ]  # fmt: skip
    assert {p for s in staged.stages for p in _prims(s.closed_jaxpr)}.isdisjoint({"jit"})
    staged.verify(fn, params, x)


def test_flax_linen_jitted_train_step_with_optax():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(4):
                x = nn.relu(nn.Dense(16, name=f"hidden_{i}")(x))
            return nn.Dense(1)(x)

    model = Model()
    x = jnp.ones((8, 16))
    params = model.init(jax.random.PRNGKey(0), x)
    opt = optax.adam(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        grads = pm.mark_gradient(grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    staged = pm.split(step, params, state, x, num_stages=2)
    assert [s.name for s in staged.stages] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward", "apply_grad"
    ]  # fmt: skip
    staged.verify(step, params, state, x)


def _marked(x):
    for i in range(3):
        x = pm.mark(x, name=f"l{i}", mark_type="start")
        x = jnp.sin(x) * 2
        x = pm.mark(x, name=f"l{i}", mark_type="end")
    return x


def _checkpoints(stage):
    return [e for e in stage.jaxpr.eqns if CALL_RULES.get(e.primitive.name, None) is not None]


def test_checkpoint_over_stages_becomes_one_checkpoint_per_stage():
    fn = jax.checkpoint(_marked, policy=jax.checkpoint_policies.nothing_saveable)
    cj = jax.make_jaxpr(fn)(1.0)
    inlined = inline_calls(cj)
    check_jaxpr(inlined.jaxpr)
    staged = pm.split(fn, 1.0)
    assert [s.name for s in staged.stages] == ["l0", "l1", "l2"]
    for stage in staged.stages:
        (remat,) = _checkpoints(stage)
        assert remat.primitive is cj.jaxpr.eqns[0].primitive
        assert remat.params["policy"] is cj.jaxpr.eqns[0].params["policy"]
        assert [e.primitive.name for e in remat.params["jaxpr"].eqns] == ["sin", "mul"]
    staged.verify(fn, 1.0)
    # A compiled call against its equations one by one: two programs (tests/_exact.py).
    assert_trees_within_ulps(jaxpr_as_fun(inlined)(0.3), jaxpr_as_fun(cj)(0.3))


def test_gradient_of_a_checkpoint_over_stages():
    fn = jax.value_and_grad(jax.checkpoint(_marked))
    staged = pm.split(fn, 1.0)
    assert [s.name for s in staged.stages] == [
        "l0", "l1", "l2", "l2_backward", "l1_backward", "l0_backward"
    ]  # fmt: skip
    # Each backward stage rematerialises inside a checkpoint of its own; the copies of
    # the forward markers in the recomputation are gone.
    for stage in staged.stages[3:]:
        assert _checkpoints(stage), stage.name
    staged.verify(fn, 1.0)
    jitted = jax.jit(lambda x: staged(x))(1.0)
    np.testing.assert_allclose(jitted, fn(1.0), rtol=1e-6)


def test_custom_jvp_with_markers_inside_is_inlined():
    @jax.custom_jvp
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        x = pm.mark(jnp.sin(x), name="a", mark_type="end")
        x = pm.mark(x, name="b", mark_type="start")
        return pm.mark(jnp.cos(x), name="b", mark_type="end")

    f.defjvp(lambda primals, tangents: (f(primals[0]), tangents[0]))
    cj = jax.make_jaxpr(f)(1.0)
    assert _prims(cj) == ["custom_jvp_call"]
    assert "custom_jvp_call" not in _prims(inline_calls(cj))
    staged = pm.split(f, 1.0)
    assert [s.name for s in staged.stages] == ["a", "b"]
    staged.verify(f, 1.0)


def test_markers_inside_a_scan_are_still_refused():
    def loss(x):
        def body(c, _):
            pm.mark_pipeline_boundary()
            return jnp.sin(c), None

        return jax.lax.scan(body, x, None, length=3)[0]

    with pytest.raises(pm.errors.MarkerError, match="scan"):
        pm.split(jax.jit(loss), 1.0)


def test_refuses_a_non_closed_jaxpr():
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(pm.PipemarkError, match="inline_calls takes"):
        inline_calls(cj.jaxpr if cj.jaxpr is not cj else object())


def test_runtime_takes_a_jitted_loss():
    ex = examples.mlp(num_layers=4, width=4, batch=4)
    loss = jax.jit(ex.loss_fn)
    pipeline = pm.pipeline_value_and_grad(
        loss, num_stages=2, num_microbatches=2, schedule="interleaved", devices=jax.devices()[:1]
    )
    value, grads = pipeline(*ex.args)
    want, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- one body inlined more than once
# The reference is always JAX's own evaluation (jax.jit of the function), never a
# program a pipemark pass touched.


def _close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)


@jax.jit
def _sin(x):
    return jnp.sin(x)


def _twice(x):
    a = _sin(x)
    b = _sin(a * 2.0)  # reads the first call's result; its body is the same object
    return a + b


def test_a_function_jitted_once_and_called_twice_keeps_each_calls_values():
    x = jnp.float32(1.0)
    cj = jax.make_jaxpr(_twice)(x)
    assert _prims(cj).count("jit") == 2
    inlined = inline_calls(cj)
    assert "jit" not in _prims(inlined)
    _close(jaxpr_as_fun(inlined)(x), [jax.jit(_twice)(x)])
    staged = pm.split(_twice, x, num_stages=2)
    _close(staged(x), [jax.jit(_twice)(x)])
    staged.verify(_twice, x)


def test_every_equation_of_the_inlined_program_defines_new_variables():
    x = jnp.float32(1.0)
    inlined = inline_calls(jax.make_jaxpr(_twice)(x))
    defined = [v for e in inlined.jaxpr.eqns for v in e.outvars]
    assert len(set(defined)) == len(defined)


def _silu_mlp_loss(params, x):
    for w in params:
        x = jax.nn.silu(x @ w)  # jax.nn.silu is a jitted function: one body, many calls
    return jnp.mean(x**2)


def test_silu_mlp_gradients_equal_jax_value_and_grad():
    rng = np.random.default_rng(1)
    params = [jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(3)]
    x = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    vag = jax.value_and_grad(_silu_mlp_loss)
    want = jax.jit(vag)(params, x)
    inlined = inline_calls(jax.make_jaxpr(vag)(params, x))
    got = jaxpr_as_fun(inlined)(*params, x)
    _close(got, jax.tree_util.tree_leaves(want))
    staged = pm.split(vag, params, x, num_stages=3)
    _close(staged(params, x), jax.tree_util.tree_leaves(want))
    staged.verify(vag, params, x)


@jax.jit
def _inner(x):
    return jnp.tanh(x) * 2.0


@jax.jit
def _outer(x):
    return _inner(x) + _inner(x[::-1] + 1.0)  # nested, called twice inside


def _nested(x, y):
    a = _outer(x)
    b = _outer(a * 0.5)  # same shapes: the same body again
    c = _outer(y)  # another shape: another body
    return a * b, c + _inner(c)


def test_nested_jitted_helpers_called_with_equal_and_different_shapes():
    x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
    y = jnp.linspace(0.0, 2.0, 3, dtype=jnp.float32)
    want = jax.jit(_nested)(x, y)
    inlined = inline_calls(jax.make_jaxpr(_nested)(x, y))
    check_jaxpr(inlined.jaxpr)
    _close(jaxpr_as_fun(inlined)(x, y), want)
    staged = pm.split(_nested, x, y, num_stages=2)
    _close(staged(x, y), want)


def test_a_body_whose_variables_the_program_also_defines():
    # A program may define the same Var objects as a body it calls (a jaxpr built from
    # a traced body by hand): the inlined copy must get variables of its own.
    cj = jax.make_jaxpr(jax.jit(lambda x: jnp.sin(x) * 3.0))(jnp.float32(0.5))
    call = cj.jaxpr.eqns[0]
    body = call.params["jaxpr"].jaxpr
    result = jax.extend.core.Var(body.outvars[0].aval)
    again = call.replace(invars=list(body.outvars), outvars=[result])
    program = body.replace(eqns=[*body.eqns, again], outvars=[result])
    check_jaxpr(program)
    inlined = inline_calls(jax.extend.core.ClosedJaxpr(program, []))
    check_jaxpr(inlined.jaxpr)
    x = jnp.float32(0.5)
    _close(jaxpr_as_fun(inlined)(x), [jnp.sin(jnp.sin(x) * 3.0) * 3.0])
