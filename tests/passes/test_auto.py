"""Tests for pipemark.passes.auto: optimal balanced layers, mirrored backward stages."""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend.core import Var, check_jaxpr, jaxpr_as_fun

import pipemark as pm
from pipemark import examples
from pipemark._compat import CLOSED_JAXPR_IS_JAXPR
from pipemark.cost import nbytes
from pipemark.passes.auto import balanced_cuts, crossing_bytes, equation_costs

# ------------------------------------------------------------------------- helpers


def _parts(costs, cuts):
    bounds = [0, *cuts, len(costs)]
    return [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]


def _brute_force(costs, k, cut_bytes, tolerance):
    """(optimal bottleneck, fewest bytes among partitions within the tolerance)."""
    n = len(costs)
    options = [(max(_parts(costs, c)), c) for c in itertools.combinations(range(1, n), k - 1)]
    best = min(b for b, _ in options)
    bound = max(math.floor(best * (1 + tolerance)), best)
    fewest = min(sum(cut_bytes[i] for i in c) for b, c in options if b <= bound)
    return best, bound, fewest


def _markers(cj):
    return [
        (i, e.params["name"], e.params["mark_type"])
        for i, e in enumerate(cj.eqns)
        if e.primitive is pm.pipeline_p
    ]


def _layer_spans(cj):
    """Equation index ranges (between each start and its end) per layer name."""
    spans, open_at = {}, {}
    for i, name, kind in _markers(cj):
        if kind == "start":
            open_at[name] = i
        else:
            spans[name] = (open_at.pop(name) + 1, i)
    return spans


def _run(cj, args):
    return jaxpr_as_fun(cj)(*jax.tree_util.tree_leaves(args))


def _assert_same_results(marked, original, args):
    for got, want in zip(_run(marked, args), _run(original, args), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------ the pure algorithm


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 20), min_size=1, max_size=9),
    data=st.data(),
)
def test_balanced_cuts_match_brute_force(costs, data):
    n = len(costs)
    k = data.draw(st.integers(1, n), label="parts")
    cut_bytes = data.draw(st.lists(st.integers(0, 5), min_size=n + 1, max_size=n + 1))
    tolerance = data.draw(st.sampled_from([0.0, 0.1, 0.5]), label="tolerance")
    if sum(costs) == 0:
        costs[0] = 1
    cuts = balanced_cuts(costs, k, cut_bytes=cut_bytes, tolerance=tolerance)
    assert len(cuts) == k - 1 and cuts == sorted(set(cuts))
    assert all(0 < c < n for c in cuts)
    best, bound, fewest = _brute_force(costs, k, cut_bytes, tolerance)
    assert max(_parts(costs, cuts)) <= bound
    if tolerance == 0:
        assert max(_parts(costs, cuts)) == best
    assert sum(cut_bytes[c] for c in cuts) == fewest


def test_balanced_cuts_prefers_the_even_split_among_equal_bytes():
    assert balanced_cuts([1] * 12, 3, tolerance=0.5) == [4, 8]


def test_balanced_cuts_errors():
    with pytest.raises(pm.PipemarkError, match="Cannot cut 2 equations into 3"):
        balanced_cuts([1, 1], 3)
    with pytest.raises(pm.PipemarkError, match="positive int"):
        balanced_cuts([1, 1], 0)
    with pytest.raises(pm.PipemarkError, match="tolerance"):
        balanced_cuts([1, 1], 1, tolerance=-1)
    with pytest.raises(pm.PipemarkError, match="cut_bytes needs 3 entries"):
        balanced_cuts([1, 1], 2, cut_bytes=[0, 0])
    with pytest.raises(pm.PipemarkError, match=">= 0"):
        balanced_cuts([1, -1], 2)


def test_crossing_bytes_counts_live_values():
    def f(x):
        a = jnp.sin(x)  # 0
        b = jnp.cos(a)  # 1
        return a + b  # 2: a is live across both cuts

    cj = jax.make_jaxpr(f)(jnp.ones(4))
    assert crossing_bytes(cj).tolist() == [0, 16, 32, 0]
    assert crossing_bytes(cj, 0, 2).tolist() == [0, 16, 0]  # reads after stop ignored


# ---------------------------------------------------------- small random programs


@st.composite
def _programs(draw):
    """A random chain of matmuls, tanh and skip additions over widths <= 6."""
    steps = draw(st.lists(st.sampled_from(["dot", "tanh", "skip", "sum"]), min_size=2, max_size=8))
    widths = draw(st.lists(st.integers(1, 6), min_size=len(steps), max_size=len(steps)))

    def f(x):
        seen = [x]
        for step, width in zip(steps, widths):
            if step == "dot":
                x = x @ jnp.ones((x.shape[-1], width), jnp.float32)
            elif step == "tanh":
                x = jnp.tanh(x)
            elif step == "skip":
                older = seen[len(seen) // 2]
                x = x + (older if older.shape == x.shape else 1.0)
            else:
                x = x + jnp.sum(x)
            seen.append(x)
        return x

    return jax.make_jaxpr(f)(jnp.ones((2, 3), jnp.float32))


@settings(max_examples=25, deadline=None)
@given(cj=_programs(), data=st.data())
def test_auto_layers_is_bottleneck_optimal_on_random_programs(cj, data):
    costs = equation_costs(cj).tolist()
    if sum(costs) == 0 or len(costs) < 1:
        return
    k = data.draw(st.integers(1, min(len(costs), 4)), label="layers")
    marked = pm.passes.auto_layers(cj, k, tolerance=0.0)
    check_jaxpr(marked.jaxpr)
    spans = _layer_spans(marked)
    assert list(spans) == [f"layer{i}" for i in range(k)]
    layer_costs = [sum(equation_costs(marked)[a:b]) for a, b in spans.values()]
    best, _, _ = _brute_force(costs, k, crossing_bytes(cj).tolist(), 0.0)
    assert max(layer_costs) == best
    _assert_same_results(marked, cj, [np.ones((2, 3), np.float32)])


# --------------------------------------------------------------------- models


def test_forward_transformer_cuts_between_blocks():
    ex = examples.transformer(num_layers=8, d_model=32, num_heads=4, seq=16, markers=None)
    cj = ex.trace()
    one = len(examples.transformer(num_layers=1, markers=None).trace().eqns)
    two = len(examples.transformer(num_layers=2, markers=None).trace().eqns)
    per_block = two - one
    marked = pm.passes.auto_layers(cj, 4)
    check_jaxpr(marked.jaxpr)
    # Each layer holds exactly two whole blocks (the last also the loss).
    starts = [i for i, _, kind in _markers(marked) if kind == "start"]
    cuts = [s - 2 * k for k, s in enumerate(starts)][1:]  # undo the inserted markers
    assert cuts == [2 * per_block, 4 * per_block, 6 * per_block]
    # Only the residual stream crosses each cut.
    residual = nbytes(cj.jaxpr.invars[-2].aval)
    assert [crossing_bytes(cj)[c] for c in cuts] == [residual] * 3
    _assert_same_results(marked, cj, ex.args)


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.6])
def test_two_layers_of_a_transformer_match_brute_force(tolerance):
    ex = examples.transformer(num_layers=3, d_model=16, num_heads=2, seq=8, markers=None)
    cj = ex.trace()
    costs = equation_costs(cj).tolist()
    best, bound, fewest = _brute_force(costs, 2, crossing_bytes(cj).tolist(), tolerance)
    marked = pm.passes.auto_layers(cj, 2, tolerance=tolerance)
    (a0, b0), _ = _layer_spans(marked).values()
    cut = b0 - a0  # the number of equations in the first layer
    assert max(_parts(costs, [cut])) <= bound
    if tolerance == 0:
        assert max(_parts(costs, [cut])) == best
    assert crossing_bytes(cj)[cut] == fewest


def _stage_sources(marked):
    """For each stage: the stages whose values its start marker reads."""
    made_by, current, reads = {}, None, {}
    for eqn in marked.eqns:
        if eqn.primitive is pm.pipeline_p and eqn.params["mark_type"] == "start":
            current = eqn.params["name"]
            reads[current] = {made_by[v] for v in eqn.invars if isinstance(v, Var) and v in made_by}
        for v in eqn.outvars:
            made_by[v] = current
    return reads


def test_value_and_grad_transformer_mirrors_the_forward_layers():
    ex = examples.transformer(num_layers=8, d_model=16, num_heads=2, seq=8, markers=None)
    cj = ex.trace(grad=True)
    marked = pm.passes.auto_layers(cj, 4)
    check_jaxpr(marked.jaxpr)
    names = [name for _, name, kind in _markers(marked) if kind == "start"]
    assert names == [
        "layer0", "layer1", "layer2", "layer3",
        "layer3_backward", "layer2_backward", "layer1_backward", "layer0_backward",
    ]  # fmt: skip
    # Each backward stage reads residuals only from its own forward layer, and the
    # cotangent from the backward stage before it.
    sources = _stage_sources(marked)
    assert sources["layer3_backward"] == {"layer3"}
    for i in range(3):
        assert sources[f"layer{i}_backward"] == {f"layer{i}", f"layer{i + 1}_backward"}
    _assert_same_results(marked, cj, ex.args)
    staged = pm.passes.slice_stages(marked)
    assert [s.name for s in staged.stages] == names


def test_value_and_grad_markers_match_what_grad_of_marked_layers_gives():
    ex = examples.mlp(num_layers=4, markers=None)
    marked = pm.passes.auto_layers(ex.trace(grad=True), 2)
    reference = examples.mlp(num_layers=2, markers="startend").trace(grad=True)
    kinds = [(kind, name.endswith("_backward")) for _, name, kind in _markers(marked)]
    reference_kinds = [(kind, name.endswith("_backward")) for _, name, kind in _markers(reference)]
    assert kinds == reference_kinds


def test_mirror_backward_false_balances_everything_as_one_sequence():
    ex = examples.mlp(num_layers=4, markers=None)
    marked = pm.passes.auto_layers(ex.trace(grad=True), 3, mirror_backward=False)
    assert [n for _, n, k in _markers(marked) if k == "start"] == ["layer0", "layer1", "layer2"]


def test_skip_connections_split_and_run():
    ex = examples.resnet(num_blocks=6, skip=3, markers=None)
    for grad in (False, True):
        cj = ex.trace(grad=grad)
        marked = pm.passes.auto_layers(cj, 3)
        check_jaxpr(marked.jaxpr)
        _assert_same_results(marked, cj, ex.args)
        staged = pm.passes.slice_stages(marked)
        staged.verify(jaxpr_as_fun(cj), *jax.tree_util.tree_leaves(ex.args))
    # Block 0's output feeds block 3: layer 0 -> layer 2 directly with 3 layers of 2.
    sources = _stage_sources(pm.passes.auto_layers(ex.trace(), 3))
    assert "layer0" in sources["layer2"]


def test_scan_over_layers_is_cut_into_one_chunk_per_layer():
    weights = jnp.ones((6, 8, 8)) / 8

    def f(x, ws):
        x = jnp.sin(x)
        x, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(x)

    cj = jax.make_jaxpr(f)(jnp.ones((4, 8)), weights)
    costs = equation_costs(cj)
    scan_index = [e.primitive.name for e in cj.eqns].index("scan")
    assert costs[scan_index] > 0.9 * costs.sum()
    marked = pm.passes.auto_layers(cj, 3, tolerance=0.0)
    lengths = [
        [e.params["length"] for e in marked.eqns[a:b] if e.primitive.name == "scan"]
        for a, b in _layer_spans(marked).values()
    ]
    assert lengths == [[2], [2], [2]]
    args = (jnp.linspace(0, 1, 32).reshape(4, 8), weights)
    pm.passes.slice_stages(marked).verify(f, *args)


def test_without_scan_splitting_the_scan_is_indivisible_and_named():
    weights = jnp.ones((6, 8, 8)) / 8

    def f(x, ws):
        x = jnp.sin(x)
        x, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.sum(x)

    cj = jax.make_jaxpr(f)(jnp.ones((4, 8)), weights)
    # The whole body stays in one layer; the best a split can do is to give the scan a
    # layer of its own, and the bottleneck is then the scan's cost.
    with pytest.warns(pm.PipemarkWarning, match=r"equation 1 \(scan.*holds 9\d % of the cost"):
        marked = pm.passes.auto_layers(cj, 3, tolerance=0.0, split_scans=False)
    layers = [
        [e.primitive.name for e in marked.eqns[a:b]] for a, b in _layer_spans(marked).values()
    ]
    assert layers == [["sin"], ["scan"], ["reduce_sum"]]


def test_a_dominant_while_loop_is_named_in_a_warning():
    def f(x, w):
        x = jnp.sin(x)
        _, x = lax.while_loop(lambda c: c[0] < 8, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))
        return jnp.sum(x)

    cj = jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 8)))
    with pytest.warns(pm.PipemarkWarning, match=r"\(while.*cannot cut inside it"):
        pm.passes.auto_layers(cj, 2)


def test_determinism():
    ex = examples.transformer(num_layers=4, markers=None)
    first = pm.passes.auto_layers(ex.trace(grad=True), 3)
    second = pm.passes.auto_layers(ex.trace(grad=True), 3)
    assert str(first) == str(second)


def test_input_is_left_untouched():
    ex = examples.mlp(num_layers=3, markers=None)
    cj = ex.trace()
    before = str(cj)
    eqns = list(cj.eqns)
    pm.passes.auto_layers(cj, 3)
    assert str(cj) == before and all(a is b for a, b in zip(eqns, cj.eqns, strict=True))


@pytest.mark.parametrize("cost", ["flops", "bytes", "equations", "xla", lambda e: 1.5])
def test_cost_choices(cost):
    ex = examples.mlp(num_layers=4, markers=None)
    cj = ex.trace()
    marked = pm.passes.auto_layers(cj, 2, cost=cost)
    assert len(_layer_spans(marked)) == 2
    _assert_same_results(marked, cj, ex.args)


def test_equation_cost_split_has_equal_counts():
    cj = examples.mlp(num_layers=4, markers=None).trace()
    spans = _layer_spans(pm.passes.auto_layers(cj, 2, cost="equations", tolerance=0))
    sizes = [b - a for a, b in spans.values()]
    assert max(sizes) == math.ceil(len(cj.eqns) / 2)


def test_custom_names():
    cj = examples.mlp(num_layers=2, markers=None).trace(grad=True)
    marked = pm.passes.auto_layers(cj, 2, names=["a", "b"])
    assert [n for _, n, k in _markers(marked) if k == "start"] == [
        "a", "b", "b_backward", "a_backward"
    ]  # fmt: skip


# --------------------------------------------------------------------- errors


def test_more_layers_than_equations():
    cj = jax.make_jaxpr(lambda x: jnp.sin(jnp.cos(x)))(1.0)
    with pytest.raises(pm.PipemarkError, match=r"has 2 equations, too few for 3.*at most 2"):
        pm.passes.auto_layers(cj, 3)


def test_backward_with_too_few_equations():
    cj = jax.make_jaxpr(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) * 2.0)))(jnp.ones(3))
    with pytest.raises(pm.PipemarkError, match="too few"):
        pm.passes.auto_layers(cj, 10)


def test_zero_cost_program():
    cj = jax.make_jaxpr(lambda x: jnp.reshape(jnp.transpose(x), (6,)))(jnp.ones((2, 3)))
    with pytest.raises(pm.PipemarkError, match=r"costs 0 under cost='flops'.*cost='equations'"):
        pm.passes.auto_layers(cj, 2)
    assert len(_layer_spans(pm.passes.auto_layers(cj, 2, cost="bytes"))) == 2


def test_unknown_cost_name():
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(pm.PipemarkError, match=r"Unknown cost 'time'.*'flops'.*function"):
        pm.passes.auto_layers(cj, 1, cost="time")


def test_bad_arguments():
    cj = jax.make_jaxpr(lambda x: jnp.sin(jnp.cos(x)))(1.0)
    with pytest.raises(pm.PipemarkError, match="num_layers must be a positive int"):
        pm.passes.auto_layers(cj, 0)
    with pytest.raises(pm.PipemarkError, match="num_layers must be a positive int"):
        pm.passes.auto_layers(cj, 1.5)
    with pytest.raises(pm.PipemarkError, match="tolerance"):
        pm.passes.auto_layers(cj, 1, tolerance=-0.1)
    with pytest.raises(pm.PipemarkError, match="names has 1 entries for 2 layers"):
        pm.passes.auto_layers(cj, 2, names=["a"])
    if not CLOSED_JAXPR_IS_JAXPR:  # JAX >= 0.11: ClosedJaxpr is Jaxpr
        with pytest.raises(pm.PipemarkError, match="ClosedJaxpr"):
            pm.passes.auto_layers(cj.jaxpr, 1)
    with pytest.raises(pm.PipemarkError, match="negative, infinite or NaN"):
        pm.passes.auto_layers(cj, 1, cost=lambda e: -1.0)


def test_already_marked_program():
    cj = examples.mlp(num_layers=2).trace()
    with pytest.raises(
        pm.MarkerError, match=r"equation 0 \(pipeline_marker start 'layer0'.*remove_markers"
    ):
        pm.passes.auto_layers(cj, 2)


def test_split_with_num_stages_balances_automatically():
    ex = examples.mlp(num_layers=4, markers=None)
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args, num_stages=2)
    assert [s.name for s in staged.stages] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward"
    ]  # fmt: skip
    reference = jax.make_jaxpr(fn)(*ex.args)
    staged.verify(jaxpr_as_fun(reference), *jax.tree_util.tree_leaves(ex.args))
    marked = examples.mlp(num_layers=2)
    with pytest.raises(pm.MarkerError, match="already has stage markers"):
        pm.split(marked.loss_fn, *marked.args, num_stages=2)


def _blocks_of(stage):
    from pipemark._compat import name_stack_scopes

    found = set()
    for eqn in stage.jaxpr.eqns:
        scopes = name_stack_scopes(eqn.source_info)[0]
        found.update(s for s in scopes if s.startswith("Block_"))
    return found


def test_flax_transformer_is_cut_between_blocks_not_inside_attention():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)(h, h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(32)(nn.gelu(nn.Dense(128)(h)))

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(8):
                x = Block(name=f"Block_{i}")(x)
            return x

    # A random input: LayerNorm of a constant row divides by ~0 (NaN gradients).
    model, x = Transformer(), jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    params = model.init(jax.random.PRNGKey(0), x)
    fn = jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
    staged = pm.split(fn, params, x, num_stages=4)
    forward = staged.stages[:4]
    assert [_blocks_of(s) for s in forward] == [
        {f"Block_{2 * k}", f"Block_{2 * k + 1}"} for k in range(4)
    ]
    ends = pm.views.stage_ends(staged)
    assert [ends[s.name].split("/")[1] for s in forward[:3]] == ["Block_1", "Block_3", "Block_5"]
    staged.verify(fn, params, x)


def _blocks_read(staged, stage):
    # The block indices of the parameters a stage reads, from their pytree paths.
    names = staged.input_names
    found = {
        re.search(r"blocks'?\]?\[(\d+)\]", names[r.index])
        for r in stage.inputs
        if r.kind == "input"
    }
    return {int(m.group(1)) for m in found if m}


def test_nnx_transformer_is_cut_between_blocks():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(32, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(32, rngs=rngs)
            self.up = nnx.Linear(32, 128, rngs=rngs)
            self.down = nnx.Linear(128, 32, rngs=rngs)

        def __call__(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(8)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))  # not constant: LayerNorm
    fn = jax.value_and_grad(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))
    staged = pm.split(fn, state, x, num_stages=4)
    forward = staged.stages[:4]
    assert [_blocks_read(staged, s) for s in forward] == [{2 * k, 2 * k + 1} for k in range(4)]
    ends = pm.views.stage_ends(staged)
    assert [ends[s.name] for s in forward] == [f"s['blocks'][{2 * k + 1}]" for k in range(4)]
    staged.verify(fn, state, x)


def _eqx_transformer(eqx, num_blocks):
    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        drop: eqx.nn.Dropout  # a bool flag and a float: static, as eqx.filter_jit has them
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(32), eqx.nn.LayerNorm(32)
            self.attn = eqx.nn.MultiheadAttention(2, 32, key=k1)
            self.drop = eqx.nn.Dropout(0.1, inference=True)
            self.mlp = eqx.nn.MLP(32, 32, 128, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.ln1)(x)
            x = x + self.drop(self.attn(h, h, h))
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class Model(eqx.Module):
        blocks: list

        def __init__(self, key):
            self.blocks = [Block(k) for k in jax.random.split(key, num_blocks)]

        def __call__(self, x):
            for block in self.blocks:
                x = jax.vmap(block)(x)
            return x

    return Model(jax.random.PRNGKey(0))


def test_equinox_transformer_with_dropout_is_cut_between_blocks():
    eqx = pytest.importorskip("equinox")
    model, x = _eqx_transformer(eqx, 8), jnp.ones((2, 8, 32))
    fn = eqx.filter_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))
    staged = pm.split(fn, model, x, num_stages=4)
    forward = staged.stages[:4]
    assert [_blocks_read(staged, s) for s in forward] == [{2 * k, 2 * k + 1} for k in range(4)]
    ends = pm.views.stage_ends(staged)
    assert [ends[s.name] for s in forward] == [f"m.blocks[{2 * k + 1}]" for k in range(4)]
    staged.verify(fn, model, x)
    # Dropout's flag is static: flipping it is another program, not a silent rerun.
    other = eqx.tree_at(lambda m: m.blocks[0].drop.inference, model, False)
    with pytest.raises(pm.SignatureError, match=r"blocks\[0\]\.drop\.inference"):
        staged(other, x)
