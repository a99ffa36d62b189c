"""Pipelines whose parameters are sharded over their stage sub-mesh's data axis (FSDP,
``param_specs`` of ``P("data", None)``) on the 8 host CPU devices: loss and gradients
against ``jax.jit(jax.value_and_grad(loss))``, a training step with ``optax.adamw``
against ``jax.jit`` of the same step, with the parameters gathered once per call and
per microbatch; the bytes each device holds as the data axis grows; the memory budget's
choice; the specs refused.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark import examples
from tests._devices import devices
from tests._trees import assert_trees_within_ulps

LAYERS, WIDTH, ROWS = 4, 16, 32
FSDP = [(P("data", None), P("data", None))] * LAYERS
GATHERS = ("once", "per_microbatch")


def _mesh(data: int) -> Mesh:
    return Mesh(np.array(devices(2 * data)).reshape(2, data), ("stage", "data"))


@functools.cache
def _model():
    return examples.tensor_parallel_mlp(LAYERS, WIDTH, ROWS, num_stages=2)


def _per_device(tree) -> int:
    """The most bytes any one device holds of ``tree``'s arrays (their shards)."""
    held: dict = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.mark.parametrize(
    "gather, reduce",
    [("once", "after_stage"), ("per_microbatch", "after_stage"), ("once", "end_of_call")],
)
def test_value_and_grad_with_data_sharded_parameters_matches_jax(gather, reduce):
    # Gathered once, each stage's gradients are reduce-scattered once a call: right
    # after its last backward (the default), or after the call's last action.
    ex = _model()
    mesh = _mesh(4)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_microbatches=2,
        mesh=mesh,
        param_specs=FSDP,
        fsdp_gather=gather,
        reduce_gradients=reduce,
    )
    got = pipe(ex.params, ex.batch)
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(ex.params, ex.batch)
    assert_trees_within_ulps(got, want, ulps=8)
    sub_meshes = {frozenset(mesh.devices[k].flat) for k in range(2)}
    for grad in jax.tree_util.tree_leaves(got[1]):
        # Reduce-scattered: each device of its stage's sub-mesh holds a quarter.
        assert grad.sharding.spec == P("data", None)
        assert frozenset(grad.sharding.device_set) in sub_meshes
        assert {s.data.shape for s in grad.addressable_shards} == {(WIDTH // 4, WIDTH)}
    plan = pipe.plan(ex.params, ex.batch)
    # The stage programs read the parameters gathered (once per call, before them), or
    # sharded (each gathers them itself).
    read = {
        unit.program.in_shardings[k].spec
        for index, unit in plan.units.items()
        for k, ref in enumerate(plan.staged.stages[index].inputs)
        if ref.kind == "input" and ref.index < plan.num_param_leaves
    }
    assert read == {P(None, None) if gather == "once" else P("data", None)}
    assert plan.fsdp_gather == gather


def _adamw_step(loss_fn):
    tx = optax.adamw(1e-2, weight_decay=0.1)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, tx.init


@pytest.mark.parametrize("gather", GATHERS)
def test_adamw_training_steps_on_the_shards_match_jax(gather):
    ex = _model()
    step, init = _adamw_step(ex.loss_fn)
    pipelined = pm.pipeline_train_step(
        step, num_microbatches=2, mesh=_mesh(2), param_specs=(FSDP, None), fsdp_gather=gather
    )
    got = want = (ex.params, init(ex.params))
    reference = jax.jit(step)
    for _ in range(3):
        *got, loss = pipelined(*got, ex.batch)
        *want, want_loss = reference(*want, ex.batch)
        assert_trees_within_ulps((got, loss), (want, want_loss), ulps=8)
    params, opt_state = got
    mu, nu = opt_state[0].mu, opt_state[0].nu
    for leaf in jax.tree_util.tree_leaves((params, mu, nu)):  # updated on their shards
        assert leaf.sharding.spec == P("data", None)
        assert {s.data.shape for s in leaf.addressable_shards} == {(WIDTH // 2, WIDTH)}


def test_bytes_per_device_fall_with_the_data_axis():
    ex = _model()
    step, init = _adamw_step(ex.loss_fn)
    # Each stage holds 2 layers of two 16 x 16 float32 matrices: 4 KiB, 1/D of it on
    # each device of its sub-mesh; the optimizer state two moments of them, and Adam's
    # step count (4 bytes, replicated).
    stage_bytes = 2 * 2 * WIDTH * WIDTH * 4
    for data in (2, 4):
        mesh = _mesh(data)
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn, num_microbatches=2, mesh=mesh, param_specs=FSDP
        )
        _, grads = pipe(ex.params, ex.batch)
        pipelined = pm.pipeline_train_step(
            step, num_microbatches=2, mesh=mesh, param_specs=(FSDP, None)
        )
        params, opt_state, _ = pipelined(ex.params, init(ex.params), ex.batch)
        assert _per_device(params) == _per_device(grads) == stage_bytes // data
        assert _per_device(opt_state) == 2 * stage_bytes // data + 4
        memory = pipe.memory(ex.params, ex.batch).slots
        assert [s.parameters for s in memory] == [stage_bytes // data] * 2


def test_a_memory_budget_gathers_per_microbatch_where_once_does_not_fit():
    ex = _model()

    def peak(**options):
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn, num_microbatches=2, mesh=_mesh(4), param_specs=FSDP, **options
        )
        return pipe, max(s.predicted_peak for s in pipe.memory(ex.params, ex.batch).slots)

    _, once = peak(fsdp_gather="once")
    _, per_microbatch = peak(fsdp_gather="per_microbatch")
    # The gradients accumulate in shards: a quarter of the bytes per device.
    assert per_microbatch < once
    pipe, _ = peak(memory_budget=per_microbatch)
    assert pipe.plan(ex.params, ex.batch).fsdp_gather == "per_microbatch"
    pipe, _ = peak(memory_budget=once)
    assert pipe.plan(ex.params, ex.batch).fsdp_gather == "once"
    with pytest.raises(pm.MemoryBudgetError):  # asked for, never changed
        peak(fsdp_gather="once", memory_budget=per_microbatch)[0].plan(ex.params, ex.batch)


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            [(P(), P(None, "data"))] * LAYERS,
            r"Parameter params\[0\]\[1\] of shape \(6, 6\) has param_specs "
            r"P\(None, 'data'\): dimension 1 \(6\) does not split into the 4 shards of "
            r"\('data',\)\. Shard a dimension divisible by 4",
        ),
        (
            [(P("data", "data"), P())] * LAYERS,
            r"params\[0\]\[0\] .* names axis 'data' twice",
        ),
        ([(P("data", None, None), P())] * LAYERS, r"3 entries for 2 dimensions"),
        ([(P("expert"), P())] * LAYERS, r"names axis 'expert', which the stages' sub-mesh"),
    ],
)
def test_bad_specs_are_refused_naming_the_parameter(specs, message):
    # A width of 6 does not split over a data axis of 4.
    ex = examples.tensor_parallel_mlp(LAYERS, 6, 8, num_stages=2) if "(6" in message else _model()
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_microbatches=2, mesh=_mesh(4), param_specs=specs
    )
    with pytest.raises(pm.PipemarkError, match=message):
        pipe(ex.params, ex.batch)
