"""remove_markers, mark_missing_vars and dce: validity, purity, idempotence, numerical
equality with the input program, and the structure each pass promises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Jaxpr,
    Literal,
    Var,
    check_jaxpr,
    jaxpr_as_fun,
)

import pipemark as pm
from pipemark import examples
from pipemark._compat import CLOSED_JAXPR_IS_JAXPR
from pipemark.errors import MarkerError, PipemarkError
from pipemark.passes import dce, mark_missing_vars, remove_markers, slice_stages
from pipemark.passes._markers import find_stage_spans
from pipemark.primitive import is_marker
from tests._exact import assert_same_equations_same_bits
from tests._trees import assert_trees_within_ulps

PASSES = {
    "remove_markers": remove_markers,
    "mark_missing_vars": mark_missing_vars,
    "dce": dce,
    "mark_missing_vars+dce": lambda cj: dce(mark_missing_vars(cj)),
}

# ------------------------------------------------------------------------ programs


def _eqn_template(fn, *args):
    """The single equation ``fn`` traces to, with its full params (see JAX-NOTES)."""
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return eqn


def _hand_built():
    """Two stages built equation by equation: stage s1 reads the program input ``w`` and
    stage s0's inner value ``c`` directly; an end marker carries a literal; a hook
    marker nobody reads; a DropVar result; a stage-inner value returned directly."""
    f32 = jax.typeof(jnp.zeros(3, jnp.float32))
    sin = _eqn_template(jnp.sin, jnp.zeros(3))
    mul = _eqn_template(jnp.multiply, jnp.zeros(3), jnp.zeros(3))
    add = _eqn_template(jnp.add, jnp.zeros(3), jnp.zeros(3))
    x, w, a, b, c, d, e, f, g, h, i, j, k = (Var(f32) for _ in range(13))
    one = Literal(np.ones(3, np.float32), f32)
    eqns = [
        pm.mark_pipeline_jaxpreqn([x, w], [a, b], "s0", "start"),
        sin.replace(invars=[a], outvars=[c]),
        mul.replace(invars=[c, b], outvars=[d]),
        pm.mark_hook_jaxpreqn([d], [DropVar(f32)]),
        pm.mark_pipeline_jaxpreqn([d], [e], "s0", "end"),
        pm.mark_pipeline_jaxpreqn([e], [f], "s1", "start"),
        mul.replace(invars=[f, w], outvars=[g]),
        add.replace(invars=[g, c], outvars=[h]),
        pm.mark_pipeline_jaxpreqn([h, one], [i, j], "s1", "end"),
        add.replace(invars=[i, j], outvars=[k]),
    ]
    info = DebugInfo("hand_built", "hand_built", ("x", "w"), ("k", "c", "j"))
    jaxpr = Jaxpr([], [x, w], [k, c, j], eqns, debug_info=info)
    check_jaxpr(jaxpr)
    args = [np.linspace(0, 1, 3, dtype=np.float32), np.full(3, 2.0, np.float32)]
    return ClosedJaxpr(jaxpr, []), args


def _traced(example, grad):
    cj = example.trace(grad)
    return cj, jax.tree.leaves(example.args)


def _with_const():
    const = np.arange(3, dtype=np.float32)

    def f(x):
        x = pm.mark(x, name="s0", mark_type="start")
        y = pm.mark(jnp.sin(x) + jnp.asarray(const), name="s0", mark_type="end")
        y = pm.mark(y, name="s1", mark_type="start")
        return pm.mark(y * jnp.asarray(const) * x, name="s1", mark_type="end")

    x = np.ones(3, np.float32)
    cj = jax.make_jaxpr(f)(x)
    return cj, [x]


PROGRAMS = {
    "hand_built": _hand_built,
    "with_const": _with_const,
    "mlp": lambda: _traced(examples.mlp(3), False),
    "mlp_grad": lambda: _traced(examples.mlp(3), True),
    "resnet": lambda: _traced(examples.resnet(5, route_skips=False), False),
    "resnet_grad": lambda: _traced(examples.resnet(5, route_skips=False), True),
    "resnet_routed_grad": lambda: _traced(examples.resnet(5), True),
    "transformer_block": lambda: _traced(examples.transformer(1), False),
    "transformer_grad": lambda: _traced(examples.transformer(2), True),
}


# ------------------------------------------------------------------------- helpers


def _snapshot(cj):
    """Everything a pass could mutate in place."""
    return (
        str(cj),
        [id(e) for e in cj.jaxpr.eqns],
        [(tuple(e.invars), tuple(e.outvars), dict(e.params)) for e in cj.jaxpr.eqns],
        tuple(cj.jaxpr.invars),
        tuple(cj.jaxpr.outvars),
        tuple(cj.jaxpr.constvars),
        [id(c) for c in cj.consts],
    )


def _run(cj, args):
    return [np.asarray(v) for v in jaxpr_as_fun(cj)(*args)]


def _assert_same_outputs(out, cj, args):
    """``out`` computes with ``cj``'s own equations (the passes here add, move or drop
    markers and dead code), so it gives the same bits (tests/_exact.py)."""
    assert_same_equations_same_bits(out, cj, *args)


def _markers(cj):
    return [
        (e.params["mark_type"], e.params["name"], len(e.invars))
        for e in cj.jaxpr.eqns
        if e.primitive is pm.pipeline_p
    ]


def _is_var(atom):
    return not isinstance(atom, Literal)


def _crossing_reads(cj):
    """Reads that break 'a stage reads other stages' values only through its start
    marker, and values that leave a stage without going through its end marker.
    Returns a list of (equation index, operand) pairs; empty when the program is closed.
    """
    eqns = cj.jaxpr.eqns
    spans = find_stage_spans(cj)
    stage_of = {}
    inner = {}  # value -> stage, for values defined in a stage but not by its end marker
    for k, span in enumerate(spans):
        for i in range(span.first, span.last + 1):
            stage_of[i] = k
            for v in eqns[i].outvars:
                if i not in span.closers:
                    inner[v] = k
    defined_in = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.outvars:
            defined_in[v] = stage_of.get(i)
    bad = []
    for i, eqn in enumerate(eqns):
        k = stage_of.get(i)
        is_opener = k is not None and i in spans[k].openers
        for v in filter(_is_var, eqn.invars):
            if k is not None and not is_opener:
                if defined_in.get(v) != k:
                    bad.append((i, v))
            elif v in inner and inner[v] != k and spans[inner[v]].closers:
                bad.append((i, v))
    for v in filter(_is_var, cj.jaxpr.outvars):
        if v in inner and spans[inner[v]].closers:
            bad.append((len(eqns), v))
    return bad


# ------------------------------------------------------------- every pass, every program


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_is_valid_pure_and_exact(program, pass_name):
    cj, args = PROGRAMS[program]()
    before = _snapshot(cj)
    out = PASSES[pass_name](cj)
    assert isinstance(out, ClosedJaxpr)
    check_jaxpr(out.jaxpr)
    assert _snapshot(cj) == before
    assert out.jaxpr.invars == cj.jaxpr.invars
    _assert_same_outputs(out, cj, args)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_is_idempotent(program, pass_name):
    cj, _ = PROGRAMS[program]()
    once = PASSES[pass_name](cj)
    twice = PASSES[pass_name](once)
    assert str(twice) == str(once)


@pytest.mark.skipif(CLOSED_JAXPR_IS_JAXPR, reason="JAX >= 0.11: ClosedJaxpr is Jaxpr")
@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_refuses_a_non_closed_jaxpr(pass_name):
    cj, _ = _hand_built()
    with pytest.raises(PipemarkError, match=r"takes a jax\.extend\.core\.ClosedJaxpr, got Jaxpr"):
        PASSES[pass_name](cj.jaxpr)


# --------------------------------------------------------------------- remove_markers


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_remove_markers_keeps_other_equations_in_order(program):
    cj, _ = PROGRAMS[program]()
    out = remove_markers(cj)
    assert pm.pipeline_p not in {e.primitive for e in out.jaxpr.eqns}
    expected = [e for e in cj.jaxpr.eqns if e.primitive is not pm.pipeline_p]
    assert [e.primitive for e in out.jaxpr.eqns] == [e.primitive for e in expected]
    assert [e.params for e in out.jaxpr.eqns] == [e.params for e in expected]


def test_remove_markers_substitutes_literals_and_chains():
    cj, _ = _hand_built()
    out = remove_markers(cj)
    # The literal the s1 end marker carried is now the program's second... third output.
    assert isinstance(out.jaxpr.outvars[2], Literal)
    # c = sin(x): the start marker between x and sin is gone, so sin reads x itself.
    assert out.jaxpr.eqns[0].invars[0] is cj.jaxpr.invars[0]


def test_remove_markers_cleans_sub_jaxprs():
    def body(carry, x):
        carry = pm.mark(carry, name="inner", mark_type="start")
        carry = pm.mark(carry * x, name="inner", mark_type="end")
        return carry, carry

    @jax.jit
    def jitted(x):
        x = pm.mark(x, name="j", mark_type="start")
        return pm.mark(jnp.cos(x), name="j", mark_type="end")

    def f(c, xs):
        c, ys = jax.lax.scan(body, c, xs)
        return jitted(c), ys

    args = [np.float32(1.5), np.linspace(0.5, 1.0, 4, dtype=np.float32)]
    cj = jax.make_jaxpr(f)(*args)
    out = remove_markers(cj)
    check_jaxpr(out.jaxpr)
    # The jitted helper's body lost its markers: it compiles to another program (no
    # barrier), which may round apart.
    assert_trees_within_ulps(_run(out, args), _run(cj, args))
    assert "pipeline_marker" in str(cj)
    assert "pipeline_marker" not in str(out)


def test_remove_markers_without_markers_changes_nothing():
    cj = examples.mlp(2, markers=None).trace(grad=True)
    out = remove_markers(cj)
    assert str(out) == str(cj)
    assert all(a is b for a, b in zip(out.jaxpr.eqns, cj.jaxpr.eqns))


# ------------------------------------------------------------------ mark_missing_vars


@pytest.mark.parametrize(
    "program",
    ["hand_built", "with_const", "mlp", "mlp_grad", "resnet", "resnet_grad", "transformer_grad"],
)
def test_mark_missing_vars_closes_every_stage(program):
    cj, _ = PROGRAMS[program]()
    assert _crossing_reads(cj), "the program should have values that bypass markers"
    out = mark_missing_vars(cj)
    assert _crossing_reads(out) == []
    # Only markers change, and only by growing.
    assert [e.primitive for e in out.jaxpr.eqns] == [e.primitive for e in cj.jaxpr.eqns]
    for (t0, n0, k0), (t1, n1, k1) in zip(_markers(cj), _markers(out)):
        assert (t0, n0) == (t1, n1) and k1 >= k0


def test_mark_missing_vars_routes_the_skip_connection():
    cj = examples.resnet(5, skip=3, route_skips=False).trace()
    out = mark_missing_vars(cj)
    eqns = out.jaxpr.eqns
    by_name = {(e.params["mark_type"], e.params["name"]): e for e in eqns if is_marker(e)}
    skipped = by_name[("end", "block0")].outvars[0]
    start3 = by_name[("start", "block3")]
    before3 = next(
        e for e in cj.jaxpr.eqns if is_marker(e, "start") and e.params["name"] == "block3"
    )
    assert len(start3.invars) == len(before3.invars) + 1
    assert any(v is skipped for v in start3.invars)
    # The skip jumps straight from stage 0 to stage 3: the markers of stages 1 and 2
    # carry nothing new.
    old = {(t, n): k for t, n, k in _markers(cj)}
    for name in ("block1", "block2"):
        for kind in ("start", "end"):
            assert len(by_name[(kind, name)].invars) == old[(kind, name)]


def test_mark_missing_vars_routes_forward_weights_into_the_backward_stage():
    ex = examples.mlp(2)
    cj = ex.trace(grad=True)
    out = mark_missing_vars(cj)
    eqns = out.jaxpr.eqns
    by_name = {(e.params["mark_type"], e.params["name"]): e for e in eqns if is_marker(e)}
    start1 = by_name[("start", "layer1")]
    # (x, w, b) went through the start marker; the backward stage needs w for the
    # cotangent of x.
    weight_inside = start1.outvars[1]
    end1 = by_name[("end", "layer1")]
    assert any(v is weight_inside for v in end1.invars)
    carried = end1.outvars[next(i for i, v in enumerate(end1.invars) if v is weight_inside)]
    start_back = by_name[("start", "layer1_backward")]
    assert any(v is carried for v in start_back.invars)
    # The backward stage's dot_general now reads the weight from its own start marker.
    first, last = eqns.index(start_back), eqns.index(by_name[("end", "layer1_backward")])
    inside = set(start_back.outvars)
    for e in eqns[first + 1 : last]:
        inside.update(e.outvars)
    for e in eqns[first + 1 : last + 1]:
        assert all(v in inside for v in e.invars if _is_var(v))


def test_mark_missing_vars_reuses_pairs_a_marker_already_has():
    def f(x):
        y = pm.mark(x, name="a", mark_type="start")
        d = pm.mark(jnp.sin(y), name="a", mark_type="end")
        e = pm.mark(d, name="b", mark_type="start")
        # jnp.sin(y) is read again directly: it is already carried by both markers.
        return pm.mark(e * jnp.sin(y), name="b", mark_type="end")

    cj = jax.make_jaxpr(f)(1.0)
    out = mark_missing_vars(cj)
    assert [k for _, _, k in _markers(out)] == [1, 2, 2, 1]


def test_mark_missing_vars_leaves_unmarked_programs_alone():
    cj = examples.mlp(2, markers=None).trace(grad=True)
    out = mark_missing_vars(cj)
    assert str(out) == str(cj)


def test_mark_missing_vars_refuses_boundary_markers():
    cj = examples.mlp(3, markers="boundary").trace()
    with pytest.raises(MarkerError, match=r"layers_from_boundaries"):
        mark_missing_vars(cj)


def test_mark_missing_vars_refuses_unpaired_markers():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        return pm.mark(jnp.sin(x), name="b", mark_type="end")

    with pytest.raises(MarkerError, match=r"equation 2 \(pipeline_marker end 'b'.*closes stage"):
        mark_missing_vars(jax.make_jaxpr(f)(1.0))


# -------------------------------------------------------------------------------- dce


def test_dce_drops_dead_pairs_but_keeps_stage_markers():
    def f(x, w):
        x, w = pm.mark((x, w), name="a", mark_type="start")
        _ = jnp.cos(w)
        y = pm.mark(jnp.sin(x), name="a", mark_type="end")
        # Stage b computes nothing anybody reads.
        z = pm.mark(y, name="b", mark_type="start")
        pm.mark(jnp.exp(z), name="b", mark_type="end")
        return y

    cj = jax.make_jaxpr(f)(1.0, 2.0)
    out = dce(cj)
    assert _markers(out) == [("start", "a", 1), ("end", "a", 1), ("start", "b", 0), ("end", "b", 0)]
    assert {e.primitive.name for e in out.jaxpr.eqns} == {"pipeline_marker", "sin"}
    assert [s.name for s in find_stage_spans(out)] == ["a", "b"]
    assert out.jaxpr.invars == cj.jaxpr.invars


def test_dce_drops_unread_hooks_and_keeps_grad_and_boundary_markers():
    def f(x):
        pm.mark_pipeline_boundary()
        pm.mark(jnp.sin(x), name="hook", mark_type="hook")
        g = pm.mark_gradient(jnp.cos(x))
        del g
        return x * 2.0

    cj = jax.make_jaxpr(f)(1.0)
    out = dce(cj)
    assert _markers(out) == [("boundary", "boundary", 0), ("grad", "grad", 0)]


def test_dce_keeps_fully_read_markers_as_they_are():
    # A marker whose every result is read is kept as the very same equation (the
    # shortcut past its DCE rule); one partly read loses its dead pairs.
    def f(x, y):
        a, b = pm.mark((x, y), name="h", mark_type="hook")
        c, _ = pm.mark((jnp.sin(a), jnp.cos(b)), name="s", mark_type="start")
        return a + b + c

    cj = jax.make_jaxpr(f)(1.0, 2.0)
    out = dce(cj)
    hook, start = (e for e in out.jaxpr.eqns if e.primitive is pm.pipeline_p)
    assert hook is cj.jaxpr.eqns[0]
    assert (start.params["mark_type"], len(start.invars)) == ("start", 1)
    assert "cos" not in {e.primitive.name for e in out.jaxpr.eqns}


def test_dce_keeps_effects():
    def f(x):
        jax.debug.print("x={x}", x=jnp.sin(x))
        return x + 1.0

    cj = jax.make_jaxpr(f)(1.0)
    out = dce(cj)
    # The printing equation (debug_print or debug_callback, by JAX version) returns
    # nothing anybody reads, yet stays, and so does the sin that feeds it.
    assert [e.primitive for e in out.jaxpr.eqns] == [e.primitive for e in cj.jaxpr.eqns]
    assert len(out.jaxpr.eqns) == 3 and out.jaxpr.eqns[1].effects
    assert out.jaxpr.effects == cj.jaxpr.effects


def test_dce_drops_unread_constants_only():
    used, unused = np.arange(3.0, dtype=np.float32), np.ones(4, np.float32)

    def f(x):
        _ = jnp.asarray(unused) * 2.0
        return x + jnp.asarray(used)

    cj = jax.make_jaxpr(f)(np.zeros(3, np.float32))
    assert len(cj.consts) == 2
    out = dce(cj)
    assert len(out.consts) == 1 and np.array_equal(out.consts[0], used)
    _assert_same_outputs(out, cj, [np.ones(3, np.float32)])


def test_dce_after_mark_missing_vars_drops_routes_nobody_uses():
    # The hand-built program returns its hook's operand only through a DropVar; after
    # dce the hook is gone and every added pair is still read.
    cj, _ = _hand_built()
    out = dce(mark_missing_vars(cj))
    assert "hook" not in {e.params.get("mark_type") for e in out.jaxpr.eqns}
    assert _crossing_reads(out) == []


# ----------------------------------------------------------------- random programs


@st.composite
def _random_programs(draw):
    num_inputs = draw(st.integers(1, 3))
    num_ops = draw(st.integers(1, 14))
    ops = [
        (
            draw(st.sampled_from(["sin", "add", "mul", "sub_literal", "sum_broadcast"])),
            draw(st.floats(0, 1, exclude_max=True)),
            draw(st.floats(0, 1, exclude_max=True)),
        )
        for _ in range(num_ops)
    ]
    cuts = sorted(draw(st.sets(st.integers(0, num_ops - 1), max_size=4)) | {0})
    unmarked_prefix = draw(st.integers(0, min(2, cuts[1] if len(cuts) > 1 else num_ops)))
    returned = draw(st.floats(0, 1, exclude_max=True))
    grad = draw(st.booleans())
    return num_inputs, ops, cuts, unmarked_prefix, returned, grad


def _build(num_inputs, ops, cuts, unmarked_prefix, returned):
    bounds = [*cuts, len(ops)]

    def apply(op, values):
        kind, a, b = op
        x, y = values[int(a * len(values))], values[int(b * len(values))]
        if kind == "sin":
            return jnp.sin(x)
        if kind == "add":
            return x + y
        if kind == "mul":
            return x * y
        if kind == "sub_literal":
            return x - 0.5
        return jnp.broadcast_to(jnp.sum(x), x.shape)

    def f(*xs):
        values = list(xs)
        for op in ops[:unmarked_prefix]:
            values.append(apply(op, values))
        for s in range(len(cuts)):
            lo, hi = max(bounds[s], unmarked_prefix), bounds[s + 1]
            # Only the latest value enters the stage through its marker; everything
            # else a stage reads bypasses the markers.
            values.append(pm.mark(values[-1], name=f"s{s}", mark_type="start"))
            for op in ops[lo:hi]:
                values.append(apply(op, values))
            values.append(pm.mark(values[-1], name=f"s{s}", mark_type="end"))
        return values[-1], values[int(returned * len(values))]

    return f


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_random_programs())
def test_random_programs(program):
    num_inputs, ops, cuts, unmarked_prefix, returned, grad = program
    f = _build(num_inputs, ops, cuts, unmarked_prefix, returned)
    if grad:
        g = f

        def f(*xs):
            return jax.value_and_grad(
                lambda *xs: sum(jnp.sum(y) for y in g(*xs)), argnums=tuple(range(len(xs)))
            )(*xs)

    args = [np.linspace(0.1 * (i + 1), 1.0, 3, dtype=np.float32) for i in range(num_inputs)]
    cj = jax.make_jaxpr(f)(*args)
    before = _snapshot(cj)
    plain = remove_markers(cj)
    try:
        find_stage_spans(cj)
    except MarkerError:
        # A backward pass can interleave the mirrored stages of a stage that reads
        # nothing through its start marker; such a program has no stage structure, and
        # mark_missing_vars must refuse it the same way.
        with pytest.raises(MarkerError, match=r"stages cannot nest|never closed|closes stage"):
            mark_missing_vars(cj)
        for out in (plain, dce(cj)):
            check_jaxpr(out.jaxpr)
            _assert_same_outputs(out, cj, args)
        assert _snapshot(cj) == before
        return
    routed = mark_missing_vars(cj)
    cleaned = dce(routed)
    for out in (routed, cleaned, plain):
        check_jaxpr(out.jaxpr)
        _assert_same_outputs(out, cj, args)
    assert _snapshot(cj) == before
    assert _crossing_reads(routed) == []
    assert _crossing_reads(cleaned) == []
    assert str(mark_missing_vars(routed)) == str(routed)
    assert str(dce(cleaned)) == str(cleaned)
    assert str(remove_markers(plain)) == str(plain)
    assert str(remove_markers(routed)) == str(plain)


# ---------------------------------------------------------------- with slice_stages


def _reads_past_the_start_marker(staged):
    """(stage name, equation) pairs where an equation between a stage's start and end
    markers reads a stage input directly instead of through the start marker."""
    bad = []
    for stage in staged.stages:
        eqns = stage.jaxpr.eqns
        openers = [i for i, e in enumerate(eqns) if is_marker(e, "start")]
        closers = [i for i, e in enumerate(eqns) if is_marker(e, "end")]
        if not openers:
            continue
        last = closers[-1] if closers else len(eqns) - 1
        inputs = set(stage.jaxpr.invars)
        for e in eqns[openers[0] + 1 : last + 1]:
            if any(v in inputs for v in e.invars if _is_var(v)):
                bad.append((stage.name, e.primitive.name))
    return bad


@pytest.mark.parametrize(
    "program", ["hand_built", "resnet", "mlp_grad", "resnet_grad", "transformer_grad"]
)
def test_sliced_stages_read_other_stages_only_through_start_markers(program):
    cj, args = PROGRAMS[program]()
    assert _reads_past_the_start_marker(slice_stages(cj)), "the input should bypass markers"
    routed = mark_missing_vars(cj)
    for out in (routed, dce(routed)):
        staged = slice_stages(out)
        assert _reads_past_the_start_marker(staged) == []
        _assert_same_outputs(staged, cj, args)
