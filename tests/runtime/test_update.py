"""Tests of pipemark.runtime.training.update: a training step's update runs per device slot,
where each stage's parameters live, and equals the step ``jax.jit`` runs; an update that
couples the stages through small values (global-norm clipping) exchanges them, one that
couples them through big values stays one program on the first slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.runtime.training import update
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests._trees import assert_trees_within_ulps
from tests.runtime._steps import mlp_train_step


def _close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _slot_of(x):
    (device,) = x.devices()
    return device


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_slot_updates_its_own_stages_parameters(optimizer):
    used, ex, step, state = mlp_train_step(optimizer, num_layers=4, width=16, batch=16)
    with computing_on(used):
        want = jax.jit(step)(ex.params, state, ex.batch)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    new_params, new_state, loss = pipelined(ex.params, state, ex.batch)
    _close((new_params, new_state, loss), want)
    # Each new parameter (and its optimizer state) where its stage ran: the plan's
    # own placement of the parameter, not the first slot.
    plan = pipelined.plan(ex.params, state, ex.batch)
    readers = {leaf: w for w, leaves in enumerate(plan.steps.params) for leaf in leaves}
    slots = plan.placement.slots
    for leaf, value in enumerate(jax.tree_util.tree_leaves(new_params)):
        assert _slot_of(value) in slots[readers[leaf]].devices
    assert {_slot_of(v) for v in jax.tree_util.tree_leaves(new_params)} == set(used)
    # A second step from the returned state, which lies on the stages' slots already.
    with computing_on(used):
        want = jax.jit(step)(*want[:2], ex.batch)
    _close(pipelined(new_params, new_state, ex.batch), want)


def test_the_update_per_slot_is_counted_on_each_slot():
    used, ex, step, state = mlp_train_step("adam", num_layers=4, width=64, batch=16)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    slots = pipelined.memory(ex.params, state, ex.batch).slots
    assert all(s.update for s in slots)  # both slots run a part of the update
    # Adam's part on a slot reads its parameters, gradients and two moments: at least
    # four times the parameters that slot holds.
    assert all(s.update >= 4 * s.parameters for s in slots)


def _optax_step(loss_fn, optimizer, metric=None):
    """A step with an optax optimizer; ``metric(grads, new_params)`` an extra result."""
    optax = pytest.importorskip("optax")

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        loss, grads = pm.mark_gradient((loss, grads))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if metric is None:
            return new_params, opt_state, loss
        return new_params, opt_state, loss, metric(grads, new_params)

    return step


def _global_norm(tree):
    """optax's global norm: ``optax.tree.norm``, or ``optax.global_norm`` (deprecated
    since) in the optax versions before it."""
    optax = pytest.importorskip("optax")
    tree_functions = getattr(optax, "tree", None)
    if hasattr(tree_functions, "norm"):
        return tree_functions.norm(tree)
    return optax.global_norm(tree)


def _stage_slots(pipelined, args):
    """Per parameter leaf, the devices of the slot whose stages read it."""
    plan = pipelined.plan(*args)
    slots = plan.placement.slots
    return {
        leaf: slots[worker].devices
        for worker, leaves in enumerate(plan.steps.params)
        for leaf in leaves
    }


def test_global_norm_clipping_runs_per_stage_exchanging_the_partial_norms():
    optax = pytest.importorskip("optax")
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=16)
        optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
        step = _optax_step(ex.loss_fn, optimizer)
        state = optimizer.init(ex.params)
        want = jax.jit(step)(ex.params, state, ex.batch)
        # The threshold clips: the gradients' global norm is above it.
        assert _global_norm(jax.grad(ex.loss_fn)(ex.params, ex.batch)) > 0.1
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    new_params, new_state, loss = pipelined(ex.params, state, ex.batch)
    _close((new_params, new_state, loss), want)
    # Each new parameter, and Adam's two moments of it, on its stage's slot.
    stage_slots = _stage_slots(pipelined, (ex.params, state, ex.batch))
    adam = new_state[1][0]
    for moments in (new_params, adam.mu, adam.nu):
        for leaf, value in enumerate(jax.tree_util.tree_leaves(moments)):
            assert _slot_of(value) in stage_slots[leaf]
    assert {_slot_of(v) for v in jax.tree_util.tree_leaves(new_params)} == set(used)
    # A second step from the returned state, which lies on the stages' slots already.
    with computing_on(used):
        want = jax.jit(step)(*want[:2], ex.batch)
    _close(pipelined(new_params, new_state, ex.batch), want)
    # Each slot counts the larger of its two parts (partial norms, then its update):
    # Adam's part reads at least four times the parameters the slot holds.
    slots = pipelined.memory(ex.params, state, ex.batch).slots
    assert all(s.update >= 4 * s.parameters for s in slots)


def test_the_global_norm_returned_as_a_result_goes_to_the_first_slot():
    optax = pytest.importorskip("optax")
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=16, batch=16)
        optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))
        # Two shared results: the norm of the gradients, and the norm of the new
        # parameters, which is exchanged after the first exchange (another round).
        step = _optax_step(ex.loss_fn, optimizer, lambda g, p: (_global_norm(g), _global_norm(p)))
        state = optimizer.init(ex.params)
        want = jax.jit(step)(ex.params, state, ex.batch)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    new_params, new_state, loss, norms = pipelined(ex.params, state, ex.batch)
    _close((new_params, new_state, loss, norms), want)
    plan = pipelined.plan(ex.params, state, ex.batch)
    first = plan.placement.slots[plan.update_worker].devices
    assert all(_slot_of(norm) in first for norm in norms)
    stage_slots = _stage_slots(pipelined, (ex.params, state, ex.batch))
    for leaf, value in enumerate(jax.tree_util.tree_leaves(new_params)):
        assert _slot_of(value) in stage_slots[leaf]


def test_an_update_that_couples_big_values_stays_on_the_first_slot():
    optax = pytest.importorskip("optax")
    used = pick_devices(2)
    # 160 x 160 float32 weights: 100 KiB, above EXCHANGE_LIMIT.
    width = 160
    assert width * width * 4 > update.EXCHANGE_LIMIT
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=width, batch=16)
        optimizer = optax.sgd(0.1)
        # A result that adds the first and the last stage's new weight matrices.
        step = _optax_step(ex.loss_fn, optimizer, lambda g, p: p[0][0] + p[-1][0])
        state = optimizer.init(ex.params)
        want = jax.jit(step)(ex.params, state, ex.batch)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=4, devices=used)
    got = pipelined(ex.params, state, ex.batch)
    _close(got, want)
    plan = pipelined.plan(ex.params, state, ex.batch)
    first = plan.placement.slots[plan.update_worker].devices
    assert all(_slot_of(v) in first for v in jax.tree_util.tree_leaves(got))


def _clipped(w0, w1, w2, g0, g1, g2):
    """Clipping by the global norm, by hand: three slots' weights and gradients."""
    norm = jnp.sqrt(jnp.sum(g0**2) + jnp.sum(g1**2) + jnp.sum(g2**2))
    scale = jnp.minimum(1.0, 0.1 / norm)
    new = (w0 - scale * g0, w1 - scale * g1, w2 - scale * g2)
    return (*new, norm, jnp.sqrt(sum(jnp.sum(w**2) for w in new)))


def _run_parts(split, args, num_results):
    """The parts run in order on one table of values, as PipelinedStep runs them."""
    values = dict(enumerate(args))
    for part in split.parts:
        outputs = jax.jit(jax.extend.core.jaxpr_as_fun(part.program))(
            *[values[i] for i in part.inputs]
        )
        values.update(zip(part.outputs, outputs))
    return [values[len(args) + k] for k in range(num_results)]


def test_split_update_exchanges_small_coupled_values_in_rounds():
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) for _ in range(6)]
    apply = jax.make_jaxpr(_clipped)(*args)
    owners = [0, 1, 2, 0, 1, 2]
    split = update.split_update(apply, owners, first=0)
    # Table: 6 inputs, 5 results (positions 6..10), then the exchanged values.
    structure = [(p.worker, p.inputs, p.outputs) for p in split.parts]
    assert structure == [
        # Round 1: each slot's sum of squares of its gradient (a scalar).
        (0, (3,), (11,)),
        (1, (4,), (12,)),
        (2, (5,), (13,)),
        # Round 2: each slot's sum of squares of its new weight, which reads the
        # first round's values.
        (0, (0, 3, 11, 12, 13), (14,)),
        (1, (1, 4, 11, 12, 13), (15,)),
        (2, (2, 5, 11, 12, 13), (16,)),
        # The results: each slot its own weight; the two norms (shared) on slot 0.
        (0, (0, 3, 11, 12, 13, 14, 15, 16), (6, 9, 10)),
        (1, (1, 4, 11, 12, 13), (7,)),
        (2, (2, 5, 11, 12, 13), (8,)),
    ]
    assert [aval.shape for aval in split.exchanged] == [()] * 6
    for part in split.parts:
        jax.extend.core.check_jaxpr(part.program.jaxpr)
        # No part reads an input another slot owns.
        assert all(owners[i] == part.worker for i in part.inputs if i < len(owners))
    want = jax.jit(_clipped)(*args)
    assert want[3] > 0.1  # it clips
    for got, expected in zip(_run_parts(split, args, 5), want):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_split_update_keeps_a_big_coupling_whole():
    small, big = jnp.ones((4, 4)), jnp.ones((256, 256))  # 64 B and 256 KiB
    couple = jax.make_jaxpr(lambda w0, w1: (w0 + w1, w1))
    # A small value crosses slots: the sum stays with the first operand's slot.
    split = update.split_update(couple(small, small), [0, 1], first=0)
    assert [(p.worker, p.inputs, p.outputs) for p in split.parts] == [
        (0, (0, 1), (2,)),
        (1, (1,), (3,)),
    ]
    assert split.exchanged == ()  # w1 is an input: read where it is, no round
    # A big one would be copied: no split.
    assert update.split_update(couple(big, big), [0, 1], first=0) is None
    # Nor where every result goes to one slot anyway.
    assert update.split_update(couple(small, small), [0, 0], first=0) is None


def test_each_part_keeps_the_constants_it_reads():
    # Arrays the update closes over are constants of its program; dce gives each part
    # only those it reads, which must line up with the part's constant variables.
    c0, c1 = np.arange(3.0, dtype=np.float32), np.full(3, 2.0, np.float32)

    def scaled(w0, w1):
        return w0 * jnp.asarray(c0), w1 * jnp.asarray(c1)

    args = [jnp.ones(3), jnp.ones(3)]
    apply = jax.make_jaxpr(scaled)(*args)
    assert len(apply.consts) == 2
    split = update.split_update(apply, [0, 1], first=0)
    assert [len(p.program.consts) for p in split.parts] == [1, 1]
    # The parts and jax.jit(scaled) are other programs (tests/_exact.py).
    assert_trees_within_ulps(list(_run_parts(split, args, 2)), list(jax.jit(scaled)(*args)))
