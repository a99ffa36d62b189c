"""Tests of pipemark.runtime.train_step's donation: ``pipeline_train_step(...,
donate=True)`` updates the parameters and optimizer state in their buffers, as
``jax.jit(step, donate_argnums=...)`` does, and equals it; the default leaves the
arrays passed in unchanged; ``step.memory`` counts what donation saves; a step that
raises before its update leaves the state readable either way."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipemark as pm
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests._faults import checked_finite

optax = pytest.importorskip("optax")

WIDTH = 16
# Adam's eps well above float32's rounding of the gradients: at eps 1e-8 a gradient
# element near 0 (a few in a draw) turns a rounding difference between the pipeline's
# microbatch sums and jit's whole-batch sum into a change of its step of up to lr.
EPS = 1e-4


def _layers(params):
    """The (weight, bias) pairs of ``params``, whatever pytree holds them."""
    if isinstance(params, dict):
        return [params[k] for k in sorted(params)]
    return list(params)


def _loss(params, batch):
    """An MLP whose layers are the stages (a boundary after each but the last)."""
    x, y = batch
    layers = _layers(params)
    for k, (w, b) in enumerate(layers):
        x = jnp.tanh(x @ w + b)
        if k < len(layers) - 1:
            pm.mark_pipeline_boundary()
    return jnp.mean((x - y) ** 2)


def _params(kind, num_layers=2, seed=0):
    rng = np.random.default_rng(seed)
    layers = [
        (
            jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / WIDTH**0.5, jnp.float32),
            jnp.asarray(rng.normal(size=WIDTH) * 0.1, jnp.float32),
        )
        for _ in range(num_layers)
    ]
    if kind == "dict":
        return {f"layer{k}": {"w": w, "b": b} for k, (w, b) in enumerate(layers)}
    return tuple(layers) if kind == "tuple" else layers


def _batch(rows=8, seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, WIDTH)), jnp.float32)
    return x, jnp.asarray(rng.normal(size=(rows, WIDTH)), jnp.float32)


def _step(loss_fn, tx):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _dict_loss(params, batch):
    return _loss([(layer["w"], layer["b"]) for layer in _layers(params)], batch)


def _copy(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def _close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def _big(tree):
    """The leaves of ``tree`` but the scalars (optax's step count: every stage's part
    of the update reads it, and the new count is computed on the first slot, so no
    part can take its buffer over; jax.jit keeps such a donation too)."""
    return [x for x in jax.tree_util.tree_leaves(tree) if x.ndim]


@pytest.mark.parametrize(("kind", "donate"), [("dict", False), ("dict", True)])
def test_steps_equal_jit_with_donate_argnums(kind, donate):
    used = pick_devices(2)
    tx = optax.adamw(1e-2, eps=EPS)
    step = _step(_dict_loss if kind == "dict" else _loss, tx)
    batch = _batch()
    with computing_on(used):
        params = _params(kind)
        state = tx.init(params)
        want = _copy((params, state))
        jitted = jax.jit(step, donate_argnums=(0, 1))
    pipe = pm.pipeline_train_step(
        step, num_stages=2, num_microbatches=2, devices=used, donate=donate
    )
    initial = (params, state)
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(initial)]
    with warnings.catch_warnings():
        # No "Some donated buffers were not usable": only what a result takes is donated.
        warnings.simplefilter("error", UserWarning)
        for _ in range(3):
            passed = (params, state)
            params, state, loss = pipe(params, state, batch)
            with computing_on(used):
                *want, want_loss = jitted(*want, batch)
            _close((params, state, loss), (*want, want_loss))
            if donate:  # as jax.jit: each array a result took over is deleted
                assert all(x.is_deleted() for x in _big(passed))
            else:
                assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(passed))
    if not donate:  # the first step's arrays are as they were passed
        for x, kept in zip(jax.tree_util.tree_leaves(initial), before):
            np.testing.assert_array_equal(np.asarray(x), kept)


def _with_a_shared_bias(params, kind):
    """``params`` with the second layer's bias the first's very array."""
    if kind == "dict":
        return {**params, "layer1": {**params["layer1"], "b": params["layer0"]["b"]}}
    (w0, b0), (w1, _) = params
    layers = [(w0, b0), (w1, b0)]
    return tuple(layers) if kind == "tuple" else layers


@settings(max_examples=3, deadline=None)
@given(
    kind=st.sampled_from(["dict", "tuple", "list"]),
    donate=st.booleans(),
    shared=st.booleans(),
    optimizer=st.sampled_from(["adamw", "momentum"]),
)
def test_any_state_is_donated_or_kept_and_equals_jit(kind, donate, shared, optimizer):
    used = pick_devices(2)
    tx = optax.adamw(1e-2, eps=EPS) if optimizer == "adamw" else optax.sgd(1e-2, momentum=0.9)
    step = _step(_dict_loss if kind == "dict" else _loss, tx)
    batch = _batch()
    with computing_on(used):
        params = _params(kind)
        params = _with_a_shared_bias(params, kind) if shared else params
        state = tx.init(params)
        want = jax.jit(step)(params, state, batch)  # jit would not donate one array twice
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, state))]
    pipe = pm.pipeline_train_step(
        step, num_stages=2, num_microbatches=2, devices=used, donate=donate
    )
    _close(pipe(params, state, batch), want)
    leaves = _big((params, state))
    assert all(x.is_deleted() == donate for x in leaves)
    if not donate:
        for x, kept in zip(jax.tree_util.tree_leaves((params, state)), before):
            np.testing.assert_array_equal(np.asarray(x), kept)


def _tied_loss(params, batch):
    """The first stage multiplies by the embedding ``e``, the last by its transpose: a
    weight read by two stages, updated once where its gradients meet."""
    x, y = batch
    h = jnp.tanh(x @ params["e"])
    pm.mark_pipeline_boundary()
    h = jnp.tanh(h @ params["w"])
    pm.mark_pipeline_boundary()
    return jnp.mean((h @ params["e"].T - y) ** 2)


def test_tied_weights_and_an_array_passed_twice_are_donated_safely():
    used = pick_devices(3)
    tx = optax.adam(1e-2, eps=EPS)
    step = _step(_tied_loss, tx)
    batch = _batch()
    with computing_on(used):
        e = jnp.asarray(np.random.default_rng(2).normal(size=(WIDTH, WIDTH)), jnp.float32)
        # The same array at two leaves: jax.jit refuses to donate it twice; the
        # pipeline copies it for one of its donations.
        params = {"e": e, "w": e}
        state = tx.init(params)
        want = jax.jit(step)(_copy(params), _copy(state), batch)
    pipe = pm.pipeline_train_step(step, num_stages=3, num_microbatches=2, devices=used, donate=True)
    got = pipe(params, state, batch)
    _close(got, want)
    assert e.is_deleted()
    with computing_on(used):
        want = jax.jit(step)(*_copy(want[:2]), batch)
    _close(pipe(*got[:2], batch), want)  # a second step from the state where it lies


def _update_bytes(pipe, args):
    return [s.update for s in pipe.memory(*args).slots]


def test_memory_counts_what_donation_saves():
    used = pick_devices(2)
    tx = optax.adamw(1e-2, eps=EPS)
    step = _step(_loss, tx)
    batch = _batch()
    with computing_on(used):
        params = _params("list", num_layers=2)
        state = tx.init(params)
    args = (params, state, batch)
    kept, donated = (
        pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used, donate=d)
        for d in (False, True)
    )
    # Each slot's part of AdamW reads its parameters, both moments and the gradients
    # (4 P) and returns new parameters and moments (3 P). Not donating, the new
    # parameters take the gradients' buffers (the call's own): 6 P. Donating, every
    # result takes the buffer of the value it replaces: 4 P, less by the parameters
    # and one moment's bytes.
    layer = 4 * (WIDTH * WIDTH + WIDTH)  # one stage's parameters, float32
    saved = [a - b for a, b in zip(_update_bytes(kept, args), _update_bytes(donated, args))]
    assert saved == [2 * layer, 2 * layer]
    # What the update holds, measured: the live arrays on each slot right after its
    # part ran (a second step, the state where the first left it).
    measured = {}
    for pipe in (kept, donated):
        first = pipe(*_copy((params, state)), batch)
        measured[pipe.donate] = _held_after_update(pipe, (*first[:2], batch), used)
    for slot in range(2):
        assert measured[False][slot] - measured[True][slot] == 2 * layer


def _held_after_update(pipe, args, used):
    """Per slot, the bytes of live arrays on its device right after its update part."""
    from pipemark.runtime import train_step

    samples = {}
    run_update = train_step.run_update

    def sampled(plan, parts, *rest):
        def sampling(part):
            def run(*inputs):
                out = part.run(*inputs)
                jax.block_until_ready(out)
                device = used[part.worker]
                samples[part.worker] = sum(
                    a.nbytes
                    for a in jax.live_arrays()
                    if not a.is_deleted() and a.devices() == {device}
                )
                return out

            return part._replace(run=run)

        return run_update(plan, [sampling(p) for p in parts], *rest)

    train_step.run_update = sampled
    try:
        jax.block_until_ready(pipe(*args))
    finally:
        train_step.run_update = run_update
    return samples


@pytest.mark.parametrize("donate", [False, True])
def test_a_step_that_raises_before_its_update_leaves_the_state(donate):
    used = pick_devices(2)
    tx = optax.adamw(1e-2, eps=EPS)

    def loss_fn(params, batch):
        (w0, b0), (w1, b1) = params
        x, y = batch
        x = jnp.tanh(x @ w0 + b0)
        pm.mark_pipeline_boundary()
        return jnp.mean((jnp.tanh(checked_finite(x) @ w1 + b1) - y) ** 2)

    step = _step(loss_fn, tx)
    with computing_on(used):
        params = _params("list")
        state = tx.init(params)
    pipe = pm.pipeline_train_step(
        step, num_stages=2, num_microbatches=2, devices=used, donate=donate
    )
    x, y = _batch()
    before = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((params, state))]
    with pytest.raises(pm.PipemarkError):  # rows that do not split into microbatches
        pipe(params, state, (x[:3], y[:3]))
    bad = x.at[0, 0].set(jnp.nan)
    with pytest.raises(Exception, match="non-finite activation"):  # in the second stage
        jax.block_until_ready(pipe(params, state, (bad, y)))
    after = jax.tree_util.tree_leaves((params, state))
    assert not any(leaf.is_deleted() for leaf in after)
    for leaf, kept in zip(after, before):
        np.testing.assert_array_equal(np.asarray(leaf), kept)
    jax.block_until_ready(pipe(params, state, (x, y)))  # and the next good step runs


def test_donate_must_be_a_bool():
    with pytest.raises(pm.PipemarkError, match="donate must be True"):
        pm.pipeline_train_step(lambda p, b: p, num_microbatches=2, donate="yes")
