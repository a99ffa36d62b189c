"""split_scan: a scan over layers becomes contiguous chunks that stages can cut
between; forward and backward chunks mirror; results stay the same to rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import check_jaxpr, jaxpr_as_fun

import pipemark as pm
from pipemark._compat import scan_operand_counts
from pipemark.cost import estimate_cost
from pipemark.passes import split_scan
from pipemark.passes.scan import chunk_ranges
from tests._trees import assert_trees_within_ulps


def _stacked(num_layers, width=8, seed=0):
    rng = np.random.default_rng(seed)
    ws = jnp.asarray(rng.normal(size=(num_layers, width, width)) * 0.4, jnp.float32)
    bs = jnp.asarray(rng.normal(size=(num_layers, width)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, width)), jnp.float32)
    return (ws, bs), x


def _loss(params, x):
    def body(h, p):
        w, b = p
        return jnp.tanh(h @ w + b), None

    h, _ = lax.scan(body, jnp.sin(x), params)
    return jnp.mean(h**2)


def _scan_lengths(jaxpr_like):
    return [e.params["length"] for e in jaxpr_like.eqns if e.primitive.name == "scan"]


def _run(cj, args):
    return [np.asarray(v) for v in jaxpr_as_fun(cj)(*jax.tree_util.tree_leaves(args))]


@pytest.mark.parametrize("length, chunks, want", [(8, 4, [2, 2, 2, 2]), (7, 4, [2, 2, 2, 1]),
                                                  (3, 4, [1, 1, 1]), (5, 1, [5])])  # fmt: skip
def test_chunk_ranges(length, chunks, want):
    ranges = chunk_ranges(length, chunks)
    assert [b - a for a, b in ranges] == want
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    assert all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))


@pytest.mark.parametrize("num_layers, chunks", [(8, 4), (7, 4), (4, 2)])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_split_scan_is_exact_and_pure(num_layers, chunks, grad):
    params, x = _stacked(num_layers)
    fn = jax.value_and_grad(_loss) if grad else _loss
    cj = jax.make_jaxpr(fn)(params, x)
    before = str(cj), [id(e) for e in cj.eqns]
    split = split_scan(cj, chunks)
    assert (str(cj), [id(e) for e in cj.eqns]) == before
    check_jaxpr(split.jaxpr)
    want = [b - a for a, b in chunk_ranges(num_layers, chunks)]
    forward = [e for e in split.eqns if e.primitive.name == "scan" and not e.params["reverse"]]
    assert [e.params["length"] for e in forward] == want
    if grad:
        backward = [e for e in split.eqns if e.primitive.name == "scan" and e.params["reverse"]]
        assert [e.params["length"] for e in backward] == want[::-1]
    # The same body, in loops of other lengths: XLA compiles (and may unroll and fuse)
    # each loop by its length, so the chunks are other programs and may round apart.
    assert_trees_within_ulps(_run(split, (params, x)), _run(cj, (params, x)))


def test_backward_chunks_read_the_forward_pieces_not_a_concatenation():
    params, x = _stacked(8)
    cj = jax.make_jaxpr(jax.value_and_grad(_loss))(params, x)
    split = split_scan(cj, 4)
    forward = [e for e in split.eqns if e.primitive.name == "scan" and not e.params["reverse"]]
    backward = [e for e in split.eqns if e.primitive.name == "scan" and e.params["reverse"]]
    for k, chunk in enumerate(backward):
        mirror = forward[len(forward) - 1 - k]
        residuals = set(mirror.outvars[scan_operand_counts(mirror.params)[1] :])
        assert residuals & set(chunk.invars), k
    # Only the stacked gradients of the weights are concatenated.
    concats = [e for e in split.eqns if e.primitive.name == "concatenate"]
    assert len(concats) == 2
    assert {e.outvars[0].aval.shape for e in concats} == {(8, 8, 8), (8, 8)}


def test_auto_split_of_a_scanned_model_is_balanced_and_mirrored():
    params, x = _stacked(8, width=32)
    fn = jax.value_and_grad(_loss)
    staged = pm.split(fn, params, x, num_stages=4)
    names = [s.name for s in staged.stages]
    assert names == [f"layer{i}" for i in range(4)] + [f"layer{i}_backward" for i in (3, 2, 1, 0)]
    assert [_scan_lengths(s.jaxpr) for s in staged.stages] == [[2]] * 8
    flops = [s.name and estimate_cost(s.closed_jaxpr).total_flops for s in staged.stages]
    forward = np.asarray(flops[:4], float)
    assert forward.max() / forward.mean() < 1.05
    staged.verify(fn, params, x)


def test_seven_layers_into_four_stages():
    params, x = _stacked(7)
    fn = jax.value_and_grad(_loss)
    staged = pm.split(fn, params, x, num_stages=4)
    assert [_scan_lengths(s.jaxpr) for s in staged.stages[:4]] == [[2], [2], [2], [1]]
    assert [_scan_lengths(s.jaxpr) for s in staged.stages[4:]] == [[1], [2], [2], [2]]
    staged.verify(fn, params, x)


def test_flax_linen_nn_scan():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(16)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=8
            )
            x, _ = scanned()(x, None)
            return nn.Dense(1)(x)

    model, x = Model(), jnp.ones((4, 16))
    params = model.init(jax.random.PRNGKey(0), x)
    fn = jax.value_and_grad(lambda p, x: jnp.mean(model.apply(p, x) ** 2))
    staged = pm.split(fn, params, x, num_stages=4)
    assert [_scan_lengths(s.jaxpr) for s in staged.stages] == [[2]] * 8
    staged.verify(fn, params, x)


def test_flax_nnx_scan_over_vmapped_layers():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.linear(x))

    @nnx.split_rngs(splits=7)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(rngs)

    graphdef, state = nnx.split(create(nnx.Rngs(0)))

    def loss(state, x):
        blocks = nnx.merge(graphdef, state)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def forward(block, x):
            return block(x)

        return jnp.mean(forward(blocks, x) ** 2)

    x = jnp.ones((4, 16))
    fn = jax.value_and_grad(loss)
    staged = pm.split(fn, state, x, num_stages=4)
    assert [_scan_lengths(s.jaxpr) for s in staged.stages[:4]] == [[2], [2], [2], [1]]
    staged.verify(fn, state, x)


def test_equinox_filter_vmap_layers_and_scan():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(keys)

    def loss(layers, x):
        dynamic, static = eqx.partition(layers, eqx.is_array)

        def body(h, d):
            return jax.nn.relu(jax.vmap(eqx.combine(d, static))(h)), None

        return jnp.mean(lax.scan(body, x, dynamic)[0] ** 2)

    x = jnp.ones((4, 16))
    fn = eqx.filter_value_and_grad(loss)
    staged = pm.split(fn, layers, x, num_stages=2)
    assert [_scan_lengths(s.jaxpr) for s in staged.stages] == [[4]] * 4
    staged.verify(fn, layers, x)


def test_light_scans_and_single_chunks_are_left_alone():
    params, x = _stacked(8)
    cj = jax.make_jaxpr(_loss)(params, x)
    assert split_scan(cj, 1) is cj
    assert split_scan(cj, 4, min_cost_fraction=1.0) is cj

    def light(x):  # a cheap scan next to a heavy matmul
        x = x @ jnp.ones((64, 64))
        return lax.scan(lambda c, _: (c + 1.0, None), x, None, length=4)[0]

    cj = jax.make_jaxpr(light)(jnp.ones((64, 64)))
    assert split_scan(cj, 4) is cj


def test_bad_arguments():
    params, x = _stacked(4)
    cj = jax.make_jaxpr(_loss)(params, x)
    with pytest.raises(pm.PipemarkError, match="num_chunks must be a positive int"):
        split_scan(cj, 0)
    with pytest.raises(pm.PipemarkError, match="min_cost_fraction"):
        split_scan(cj, 2, min_cost_fraction=2)
    with pytest.raises(pm.PipemarkError, match=r"scans names equation 0 \(sin.*no scan"):
        split_scan(cj, 2, scans=[0])
    with pytest.raises(pm.PipemarkError, match="split_scan takes"):
        split_scan(cj.jaxpr if cj.jaxpr is not cj else object(), 2)


def _marked_loss(params, x):
    def body(h, p):
        h, p = pm.mark((h, p), name="block", mark_type="start")
        w, b = p
        h = pm.mark(jnp.tanh(h @ w + b), name="block", mark_type="end")
        return h, None

    h, _ = lax.scan(body, jnp.sin(x), params)
    return jnp.mean(h**2)


def test_markers_inside_the_scan_body_make_each_iteration_a_stage():
    params, x = _stacked(4)
    staged = pm.split(_marked_loss, params, x)
    assert [s.name for s in staged.stages] == ["block0", "block1", "block2", "block3"]
    assert [_scan_lengths(s.jaxpr) for s in staged.stages] == [[1]] * 4
    staged.verify(_marked_loss, params, x)


def test_markers_inside_the_scan_body_under_grad_mirror():
    params, x = _stacked(6)
    fn = jax.value_and_grad(_marked_loss)
    staged = pm.split(fn, params, x, num_stages=3)
    names = [s.name for s in staged.stages]
    assert names == ["block0", "block1", "block2", "block2_backward", "block1_backward",
                     "block0_backward"]  # fmt: skip
    assert [_scan_lengths(s.jaxpr) for s in staged.stages] == [[2]] * 6
    for stage in staged.stages:  # no marker is left inside a body
        for eqn in stage.jaxpr.eqns:
            if eqn.primitive.name == "scan":
                assert pm.pipeline_p not in {e.primitive for e in eqn.params["jaxpr"].eqns}
    staged.verify(fn, params, x)


def test_two_stage_names_in_one_scan_body_are_refused():
    def loss(ws, x):
        def body(h, w):
            h = pm.mark(h, name="a", mark_type="start")
            h = pm.mark(jnp.tanh(h @ w), name="a", mark_type="end")
            h = pm.mark(h, name="b", mark_type="start")
            return pm.mark(jnp.sin(h), name="b", mark_type="end"), None

        return lax.scan(body, x, ws)[0]

    with pytest.raises(
        pm.errors.MarkerError, match=r"holds markers of several stages \['a', 'b'\]"
    ):
        pm.split(loss, jnp.ones((3, 4, 4)), jnp.ones((2, 4)))
