"""pipemark.examples.language_model, the demo's model (tests/test_examples.py covers the
other builders)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples

SIZES = {"num_layers": 3, "vocab": 16, "d_model": 8, "num_heads": 2, "seq": 4, "batch": 2}


@pytest.mark.parametrize("markers", ["startend", "boundary"])
def test_markers_do_not_change_loss_or_gradients(markers):
    marked = examples.language_model(markers=markers, **SIZES)
    plain = examples.language_model(markers=None, **SIZES)
    value_marked, grads_marked = jax.value_and_grad(marked.loss_fn)(*marked.args)
    value_plain, grads_plain = jax.value_and_grad(plain.loss_fn)(*plain.args)
    # Eager: the same operations one by one on both sides (markers compute nothing).
    assert np.array_equal(value_marked, value_plain)
    for a, b in zip(jax.tree.leaves(grads_marked), jax.tree.leaves(grads_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_startend_markers_give_mirrored_backward_stages():
    ex = examples.language_model(**SIZES)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    forward = [f"block{i}" for i in range(3)]
    assert [s.name for s in staged.stages] == forward + [f"{n}_backward" for n in reversed(forward)]
    staged.verify(jax.value_and_grad(ex.loss_fn), *ex.args)


def test_targets_are_the_next_tokens_and_the_loss_is_near_uniform():
    ex = examples.language_model(markers=None, **SIZES)
    tokens, targets = ex.batch
    assert np.array_equal(np.asarray(tokens)[:, 1:], np.asarray(targets)[:, :-1])
    assert tokens.dtype == np.int32 and int(tokens.max()) < SIZES["vocab"]
    # Small random weights: the cross-entropy is of the order of log(vocab).
    assert 0.5 * np.log(16) < float(ex.loss_fn(*ex.args)) < 3 * np.log(16)


def test_attention_is_causal():
    # Changing the last token changes no prediction before it: only the last
    # position's loss term may move.
    ex = examples.language_model(markers=None, **{**SIZES, "batch": 1})
    tokens, targets = ex.batch

    def per_position(tokens):
        losses = []
        for t in range(SIZES["seq"]):
            weights = np.zeros(SIZES["seq"], np.float32)
            weights[t] = 1.0
            masked_targets = np.where(weights > 0, np.asarray(targets), -1)
            losses.append(float(ex.loss_fn(ex.params, (tokens, masked_targets))))
        return np.array(losses)

    changed = tokens.at[0, -1].set((tokens[0, -1] + 1) % SIZES["vocab"])
    before, after = per_position(tokens), per_position(changed)
    np.testing.assert_allclose(before[:-1], after[:-1], rtol=1e-6)
    assert before[-1] != after[-1]


def test_bad_sizes_are_pipemark_errors():
    with pytest.raises(pm.PipemarkError, match="d_model \\(10\\) must be a multiple"):
        examples.language_model(d_model=10, num_heads=4)
    with pytest.raises(pm.PipemarkError, match="vocab must be a positive int"):
        examples.language_model(vocab=0)
