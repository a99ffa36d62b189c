"""slice_stages: one stage per start/end pair; stitching gives the original back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark._compat import CLOSED_JAXPR_IS_JAXPR
from pipemark.passes._markers import find_stage_spans
from tests._exact import assert_same_equations_same_bits

P = pm.passes
X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)


def _m(x, name, mark_type):
    return pm.mark(x, name=name, mark_type=mark_type)


def stage_of_primitive(staged, name):
    return [s.name for s in staged.stages for e in s.jaxpr.eqns if e.primitive.name == name]


def check_staged(cj, staged):
    for stage in staged.stages:
        check_jaxpr(stage.closed_jaxpr.jaxpr)
    stitched = staged.as_closed_jaxpr()
    check_jaxpr(stitched.jaxpr)
    return stitched


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
@pytest.mark.parametrize("grad", [False, True])
def test_model_zoo_slices_and_stitches_back(kind, grad):
    ex = getattr(examples, kind)()
    cj = ex.trace(grad)
    before = str(cj)
    eqns_before = list(cj.eqns)
    staged = P.slice_stages(cj, unmarked="assign")
    assert str(cj) == before and all(a is b for a, b in zip(cj.eqns, eqns_before))
    names = [s.name for s in staged.stages]
    forward = [s.name for s in find_stage_spans(ex.trace())]
    if grad:
        assert names == forward + [f"{n}_backward" for n in reversed(forward)]
    else:
        assert names == forward
    stitched = check_staged(cj, staged)
    # Every equation once, the original objects, in the original order.
    assert len(stitched.eqns) == len(cj.eqns)
    assert all(a is b for a, b in zip(stitched.eqns, cj.eqns))
    staged.verify(cj, *ex.args)
    fn = jax.value_and_grad(ex.loss_fn) if grad else ex.loss_fn
    staged.verify(fn, *ex.args)
    assert sum(s.num_eqns for s in staged.stages) == len(cj.eqns)


def test_resnet_skip_connections_cross_stages():
    ex = examples.resnet(num_blocks=6, skip=3)
    staged = P.slice_stages(ex.trace(grad=True))
    graph = staged.graph
    assert graph.has_edge("block0", "block3")
    assert graph.has_edge("block2", "block5")
    # Backward: the skip's cotangent leaves block3_backward and is added to block1's
    # cotangent in block1_backward, the stage that reads both.
    assert graph.has_edge("block3_backward", "block1_backward")
    block3 = staged["block3"]
    assert {staged.stages[r.stage].name for r in block3.inputs if r.kind == "stage"} == {
        "block0",
        "block2",
    }


def test_resnet_with_unrouted_skips():
    ex = examples.resnet(num_blocks=5, skip=2, route_skips=False)
    cj = ex.trace()
    staged = P.slice_stages(cj)
    assert staged.graph.has_edge("block0", "block2")
    staged.verify(cj, *ex.args)


def test_constants_live_in_the_stages_that_use_them():
    big = np.arange(6, dtype=np.float32)
    other = np.ones(6, dtype=np.float32) * 3

    def f(x):
        x = _m(x, "a", "start")
        x = _m(jnp.sin(x) + big, "a", "end")
        x = _m(x, "b", "start")
        x = _m(jnp.cos(x) * other, "b", "end")
        x = _m(x, "c", "start")
        return _m(x - big, "c", "end")

    cj = jax.make_jaxpr(f)(X)
    assert len(cj.jaxpr.constvars) == 2
    staged = P.slice_stages(cj)
    check_staged(cj, staged)
    consts = [[np.asarray(c).tolist() for c in s.closed_jaxpr.consts] for s in staged.stages]
    assert consts == [[big.tolist()], [other.tolist()], [big.tolist()]]
    # Constants are not stage inputs.
    assert [len(s.inputs) for s in staged.stages] == [1, 1, 1]
    stitched = staged.as_closed_jaxpr()
    assert len(stitched.jaxpr.constvars) == 2
    staged.verify(f, X)


def test_stage_inputs_and_outputs_are_exactly_what_crosses():
    def f(x, y):
        x, y = _m((x, y), "a", "start")
        u, v = jnp.sin(x), jnp.cos(y)
        u, v = _m((u, v), "a", "end")
        (u,) = _m((u,), "b", "start")
        w = jnp.tanh(u)
        (w,) = _m((w,), "b", "end")
        return w, v

    staged = P.slice_stages(jax.make_jaxpr(f)(X, X))
    a, b = staged.stages
    assert [str(r) for r in a.inputs] == ["input[0]", "input[1]"]
    assert len(a.out_avals) == 2  # u to stage b, v to the result
    assert [str(r) for r in b.inputs] == ["stage0[0]"]
    assert [str(r) for r in staged.outputs] == ["stage1[0]", "stage0[1]"]
    assert a.eqn_indices == (0, 1, 2, 3) and b.eqn_indices == (4, 5, 6)


def test_unmarked_assign_rule():
    def f(x, y):
        early = jnp.exp(y)  # reads inputs only, first read in stage b
        x = _m(x, "a", "start")
        x = _m(jnp.sin(x), "a", "end")
        after_a = x * 2.0  # continues stage a
        unused = jnp.tan(y)  # read by no stage: the next stage (b)
        x = _m(after_a, "b", "start")
        x = _m(jnp.cos(x) + early, "b", "end")
        loss = jnp.sum(x)  # after the last end: joins stage b
        tail = jnp.abs(y)  # inputs only, no reader, after every stage: the last stage
        return loss, unused, tail

    cj = jax.make_jaxpr(f)(X, X)
    staged = P.slice_stages(cj)
    assert stage_of_primitive(staged, "exp") == ["b"]
    assert stage_of_primitive(staged, "mul") == ["a"]
    assert stage_of_primitive(staged, "tan") == ["b"]
    assert stage_of_primitive(staged, "reduce_sum") == ["b"]
    assert stage_of_primitive(staged, "abs") == ["b"]
    check_staged(cj, staged)
    staged.verify(f, X, X)


def test_unmarked_assign_joins_the_latest_operand_stage():
    def f(x):
        x = _m(x, "a", "start")
        a = _m(jnp.sin(x), "a", "end")
        x = _m(a, "b", "start")
        b = _m(jnp.cos(x), "b", "end")
        both = a + b  # after b: reads a and b -> stage b
        only_a = a * 3.0  # after b: reads only a -> stage a
        x = _m((both, only_a), "c", "start")
        return _m(x[0] - x[1], "c", "end")

    staged = P.slice_stages(jax.make_jaxpr(f)(X))
    assert stage_of_primitive(staged, "add") == ["b"]
    assert stage_of_primitive(staged, "mul") == ["a"]
    staged.verify(f, X)


def test_unmarked_error_accepts_a_fully_marked_program():
    ex = examples.mlp()
    staged = P.slice_stages(ex.trace(), unmarked="error")
    assert len(staged.stages) == 4


def test_value_and_grad_loss_and_seed_join_the_last_forward_stage():
    def f(ws, x):
        for i, w in enumerate(ws):
            (x, w) = _m((x, w), f"l{i}", "start")
            (x,) = _m((jnp.tanh(x @ w),), f"l{i}", "end")
        return jnp.sum(x**2)  # loss after the last end marker

    ws = [jnp.eye(3) * 0.5, jnp.eye(3) * 0.25]
    x = jnp.ones((2, 3))
    cj = jax.make_jaxpr(jax.value_and_grad(f))(ws, x)
    staged = P.slice_stages(cj)
    assert [s.name for s in staged.stages] == ["l0", "l1", "l1_backward", "l0_backward"]
    assert stage_of_primitive(staged, "reduce_sum")[0] == "l1"
    with pytest.raises(pm.errors.MarkerError, match="lies outside every start/end pair"):
        P.slice_stages(cj, unmarked="error")
    staged.verify(jax.value_and_grad(f), ws, x)


def test_grad_without_input_cotangent_leaves_last_backward_stage_open():
    # Only x goes through the start marker and x is not differentiated: JAX makes no
    # end marker for l0_backward; the stage runs to the end of the program.
    def f(ws, x):
        for i, w in enumerate(ws):
            (x,) = _m((x,), f"l{i}", "start")
            (x,) = _m((jnp.tanh(x @ w),), f"l{i}", "end")
        return jnp.sum(x)

    ws = [jnp.eye(3) * 0.5, jnp.eye(3) * 0.25]
    x = jnp.ones((2, 3))
    cj = jax.make_jaxpr(jax.value_and_grad(f))(ws, x)
    spans = find_stage_spans(cj)
    assert spans[-1].name == "l0_backward" and spans[-1].implicit_end
    assert spans[-1].last == len(cj.eqns) - 1
    staged = P.slice_stages(cj)
    check_staged(cj, staged)
    staged.verify(cj, ws, x)


def test_jvp_markers_pair_with_their_primal_stage():
    def f(x):
        for i in range(3):
            x = _m(x, f"l{i}", "start")
            x = _m(jnp.sin(x) * 1.5, f"l{i}", "end")
        return x

    def g(x, t):
        return jax.jvp(f, (x,), (t,))

    cj = jax.make_jaxpr(g)(X, X)
    mark_types = {e.params["mark_type"] for e in cj.eqns if e.primitive is pm.pipeline_p}
    assert mark_types == {"start", "end", "jvp_start", "jvp_end"}
    staged = P.slice_stages(cj, unmarked="error")
    assert [s.name for s in staged.stages] == ["l0", "l1", "l2"]
    check_staged(cj, staged)
    staged.verify(g, X, X)


def test_jvp_end_after_primal_end_extends_the_stage():
    # A start whose tangent is a symbolic zero makes no jvp_start; its jvp_end follows
    # the primal end.
    def f(x, c):
        c = _m(c, "a", "start")
        return _m(jnp.sin(c) * x, "a", "end")

    cj = jax.make_jaxpr(lambda x, t: jax.jvp(lambda x: f(x, X), (x,), (t,)))(X, X)
    types = [e.params["mark_type"] for e in cj.eqns if e.primitive is pm.pipeline_p]
    assert types == ["start", "end", "jvp_end"]
    staged = P.slice_stages(cj, unmarked="error")
    assert [s.name for s in staged.stages] == ["a"]
    staged.verify(cj, X, X)


def test_hook_and_grad_markers_are_ordinary_equations():
    def f(x):
        x = _m(x, "a", "start")
        x = _m(jnp.sin(x), "hook", "hook")
        x = pm.mark_gradient(x)
        return _m(x, "a", "end")

    staged = P.slice_stages(jax.make_jaxpr(f)(X))
    assert len(staged.stages) == 1 and staged.stages[0].num_eqns == 5


def test_program_outputs_from_inputs_constants_and_literals():
    const = np.arange(6, dtype=np.float32)

    def f(x, y):
        x = _m(x, "a", "start")
        x = _m(jnp.sin(x), "a", "end")
        return x, y, 3.0, const

    cj = jax.make_jaxpr(f)(X, X)
    staged = P.slice_stages(cj)
    assert [r.kind for r in staged.outputs] == ["stage", "input", "const", "const"]
    assert_same_equations_same_bits(staged, cj, X, X)
    assert_same_equations_same_bits(check_staged(cj, staged), cj, X, X)


def test_dead_equations_stay_in_their_stage():
    def f(x):
        x = _m(x, "a", "start")
        jnp.cos(x)  # dead
        return _m(jnp.sin(x), "a", "end")

    cj = jax.make_jaxpr(f)(X)
    staged = P.slice_stages(cj)
    assert staged.stages[0].num_eqns == len(cj.eqns)


def test_slice_is_idempotent_through_stitching():
    ex = examples.transformer(num_layers=2)
    cj = ex.trace(grad=True)
    once = P.slice_stages(cj)
    twice = P.slice_stages(once.as_closed_jaxpr())
    assert [s.name for s in once.stages] == [s.name for s in twice.stages]
    for a, b in zip(once.stages, twice.stages):
        assert all(x is y for x, y in zip(a.jaxpr.eqns, b.jaxpr.eqns))
        assert [str(r) for r in a.inputs] == [str(r) for r in b.inputs]


def test_slice_rejects_bad_arguments():
    cj = examples.mlp().trace()
    with pytest.raises(pm.PipemarkError, match="unmarked must be one of 'assign', 'error'"):
        P.slice_stages(cj, unmarked="ignore")
    if not CLOSED_JAXPR_IS_JAXPR:  # JAX >= 0.11: ClosedJaxpr is Jaxpr
        with pytest.raises(pm.PipemarkError, match=r"takes a jax\.extend\.core\.ClosedJaxpr"):
            P.slice_stages(cj.jaxpr)
