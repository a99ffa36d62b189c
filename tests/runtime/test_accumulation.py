"""A microbatch's results added into the accumulators, a scattered gradient scattered
into its accumulator in place (pipemark/runtime/devices/accumulation.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.runtime.devices import compilation
from pipemark.runtime.devices.accumulation import accumulate, fold_scatters
from pipemark.runtime.losses import microbatch_share

ROWS = jnp.array([0, 2, 0, 5])


def _lookup_grad(table, cotangent, rows=ROWS):
    """The gradient of ``table[rows]``: a scatter-add of the rows' cotangents into zeros."""
    return jax.vjp(lambda t: t[rows], table)[1](cotangent)[0]


def _plain(program, accs, inputs, accumulated, scale):
    """The accumulation as written: each result's share added to its accumulator."""
    outs = jaxpr_as_fun(program)(*inputs)
    return [acc + microbatch_share(outs[o], scale) for acc, o in zip(accs, accumulated)]


def _primitives(program) -> list[str]:
    return [eqn.primitive.name for eqn in program.jaxpr.eqns]


def test_a_tied_tables_gradient_is_its_terms_and_a_scatter():
    def grads(head, table, cotangent):  # the head's share plus the lookup's
        return [head + _lookup_grad(table, cotangent), jnp.sum(cotangent), head * 2.0]

    inputs = [jnp.full((6, 3), 0.25), jnp.ones((6, 3)), jnp.arange(12.0).reshape(4, 3)]
    program = jax.make_jaxpr(grads)(*inputs)
    folded, folds = fold_scatters(program, [0, 1])
    assert "scatter-add" in _primitives(program) and "scatter-add" not in _primitives(folded)
    assert list(folds) == [0]  # a reduction and a product are added as they are
    (fold,) = folds.values()
    assert len(fold.dense) == 1 and len(fold.scatters) == 1  # the zeros operand adds nothing
    assert [v.aval for v in folded.jaxpr.invars] == [v.aval for v in program.jaxpr.invars]
    accs, scale = [jnp.full((6, 3), 10.0), jnp.float32(1.0)], jnp.float32(0.5)
    want = _plain(program, accs, inputs, [0, 1], scale)
    outs = jaxpr_as_fun(folded)(*inputs)
    got = accumulate(accs, outs, [0, 1], folds, scale, starts=False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    # Rows 0 (twice), 2 and 5 receive their cotangents, scaled; the rest only the head.
    np.testing.assert_allclose(got[0][1], 10.0 + 0.5 * 0.25 * np.ones(3))


def test_what_another_reads_is_not_folded():
    def grads(table, cotangent):
        g = _lookup_grad(table, cotangent)
        return [g, g * 3.0]  # the gradient is read again: it must be computed

    inputs = [jnp.ones((6, 3)), jnp.ones((4, 3))]
    program = jax.make_jaxpr(grads)(*inputs)
    assert fold_scatters(program, [0]) == (program, {})
    # An output passed to another step (keep) is not folded either.
    alone = jax.make_jaxpr(lambda t, c: [_lookup_grad(t, c)])(*inputs)
    assert fold_scatters(alone, [0], keep=[0]) == (alone, {})
    assert len(fold_scatters(alone, [0])[1]) == 1
    # A program whose results start the accumulators has none to scatter into.
    assert fold_scatters(alone, [0], starts=True) == (alone, {})
    with pytest.raises(ValueError, match="start the accumulators"):
        folded, folds = fold_scatters(alone, [0])
        outs = jaxpr_as_fun(folded)(*inputs)
        accumulate([], outs, [0], folds, jnp.float32(1.0), starts=True)


@settings(max_examples=25, deadline=None)
@given(
    dense=st.integers(0, 2),
    scatters=st.integers(1, 2),
    into_zeros=st.booleans(),
    rows=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    scale=st.sampled_from([1.0, 0.25]),
)
def test_folding_adds_what_the_plain_accumulation_adds(dense, scatters, into_zeros, rows, scale):
    rows = jnp.array(rows)

    def grads(*xs):
        heads, (table, cotangent) = xs[:dense], xs[dense:]
        total = None
        for k in range(scatters):
            part = _lookup_grad(table, cotangent * (k + 1), rows)
            if not into_zeros:  # a scatter into a value, not into zeros
                part = jax.lax.scatter_add(
                    table * 0.5, rows[:, None], cotangent * (k + 1),
                    jax.lax.ScatterDimensionNumbers((1,), (0,), (0,)),
                )  # fmt: skip
            total = part if total is None else total + part
        for head in heads:
            total = head + total
        return [total]

    shapes = [(6, 3)] * dense + [(6, 3), (len(rows), 3)]
    keys = jax.random.split(jax.random.key(len(rows) + 10 * dense), len(shapes))
    inputs = [jax.random.normal(k, s) for k, s in zip(keys, shapes)]
    program = jax.make_jaxpr(grads)(*inputs)
    folded, folds = fold_scatters(program, [0])
    assert len(folds[0].scatters) == scatters
    accs = [jnp.full((6, 3), 3.0)]
    got = accumulate(accs, jaxpr_as_fun(folded)(*inputs), [0], folds, jnp.float32(scale), False)
    want = _plain(program, accs, inputs, [0], jnp.float32(scale))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_the_compiled_accumulation_scatters_in_place():
    # Without the fold XLA scatters into a copy of the handed-over array (an input it
    # may not overwrite), then adds the sum into the donated accumulator.
    def grads(head, table, cotangent):
        return [head + _lookup_grad(table, cotangent)]

    inputs = [jnp.ones((64, 8)), jnp.ones((64, 8)), jnp.ones((4, 8))]
    program = jax.make_jaxpr(grads)(*inputs)
    folded, folds = fold_scatters(program, [0])

    def plain(accs, inputs, scale):
        return _plain(program, accs, inputs, [0], scale)

    def in_place(accs, inputs, scale):
        return accumulate(accs, jaxpr_as_fun(folded)(*inputs), [0], folds, scale, False)

    args = ([jnp.zeros((64, 8))], inputs, jnp.float32(1.0))
    texts = {
        f.__name__: jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()
        for f in (plain, in_place)
    }
    copies = {name: text.count(" copy(") for name, text in texts.items()}
    assert copies["in_place"] < copies["plain"], copies


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("fuse_actions", [1, 2])
def test_a_llama_pipeline_with_scattered_gradients_equals_jax(tied, fuse_actions, monkeypatch):
    folded = []

    def spy(program, accumulated, keep=(), starts=False):
        found = fold_scatters(program, accumulated, keep, starts)
        folded.extend(found[1])
        return found

    monkeypatch.setattr(compilation, "fold_scatters", spy)
    clear_caches()  # each stage program compiled again, through the spy
    ex = examples.llama(
        2, 32, 2, seq=16, batch=4, vocab=64, d_ff=64, markers="boundary", tied=tied,
        compute_dtype=jnp.float32,
    )  # fmt: skip
    with jax.default_matmul_precision("highest"):
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn, num_stages=2, num_microbatches=2, schedule="interleaved",
            devices=jax.devices()[:1], fuse_actions=fuse_actions,
        )  # fmt: skip
        loss, grads = pipe(*ex.args)
        want_loss, want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert len(folded) == 1  # the embedding's gradient, in the first stage's backward
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)
