"""Pipelines whose stages run on sub-meshes (``mesh=``): every schedule on 8 host CPU
devices as 2 stages x 2 data x 2 model and as 4 stages x 2 data, against JAX's own
``jax.jit(jax.value_and_grad(loss_fn))`` of the same model with the same shardings;
the gradients' layouts; the one data-parallel reduction per call; the errors.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from pipemark.runtime.execution.run import run_plan
from tests._trees import assert_trees_close

WIDTH, LAYERS, ROWS = 16, 4, 32
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


@functools.cache
def _meshes() -> dict[str, Mesh]:
    return {
        "2x2x2": _mesh((2, 2, 2), ("stage", "data", "model")),
        "4x2": _mesh((4, 2), ("stage", "data")),
        # The reference's mesh: one stage's shape, on the first stage's devices.
        "data-model": _mesh((2, 2), ("data", "model")),
        "data": _mesh((2,), ("data",)),
    }


def _tensor_parallel_mlp(hidden_sharding: NamedSharding | P | None):
    """The residual MLP in Megatron's layout, a boundary between every two layers, its
    hidden activations constrained to ``hidden_sharding``; and its parameter specs."""
    ex = examples.tensor_parallel_mlp(LAYERS, WIDTH, ROWS, hidden_sharding=hidden_sharding)
    return ex.loss_fn, ex.params, examples.tensor_parallel_mlp_specs(LAYERS), ex.batch


def _reference(loss_fn, params, specs, batch, mesh: Mesh):
    """``jax.value_and_grad`` under plain ``jax.jit`` on ``mesh``: parameters laid out
    by ``specs`` (replicated when ``None``), the batch split over ``data``."""
    param_shardings = jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s if s is not None else P()),
        specs if specs is not None else jax.tree_util.tree_map(lambda _: None, params),
        is_leaf=lambda x: x is None or isinstance(x, P),
    )
    batch_sharding = NamedSharding(mesh, P("data"))
    step = jax.jit(
        jax.value_and_grad(loss_fn),
        in_shardings=(param_shardings, (batch_sharding, batch_sharding)),
    )
    return step(params, batch)


@functools.cache
def _case(layout: str):
    meshes = _meshes()
    if layout == "2x2x2":
        hidden = NamedSharding(meshes["data-model"], P("data", "model"))
        loss_fn, params, specs, batch = _tensor_parallel_mlp(hidden)
        want = _reference(loss_fn, params, specs, batch, meshes["data-model"])
    else:
        loss_fn, params, _, batch = _tensor_parallel_mlp(None)
        specs = None
        want = _reference(loss_fn, params, specs, batch, meshes["data"])
    return loss_fn, params, specs, batch, want


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", ["2x2x2", "4x2"])
def test_every_schedule_on_sub_meshes_matches_jax(layout, schedule):
    loss_fn, params, specs, batch, want = _case(layout)
    mesh = _meshes()[layout]
    slots = mesh.shape["stage"]
    # One stage per slot, or two per slot for the schedules that share a device.
    num_stages = slots * (2 if schedule in ("interleaved", "zb-v") else 1)
    if num_stages > LAYERS:
        num_stages = LAYERS
    pipe = pm.pipeline_value_and_grad(
        loss_fn,
        num_stages=num_stages,
        num_microbatches=4,
        schedule=schedule,
        mesh=mesh,
        param_specs=specs,
    )
    got = pipe(params, batch)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    plan = pipe.plan(params, batch)
    assert all(slot.mesh is not None for slot in plan.placement.slots)
    assert {slot.replicas for slot in plan.placement.slots} == {2}


def test_gradients_keep_their_layout_on_their_stage_sub_mesh():
    loss_fn, params, specs, batch, _ = _case("2x2x2")
    mesh = _meshes()["2x2x2"]
    pipe = pm.pipeline_value_and_grad(
        loss_fn, num_stages=2, num_microbatches=2, mesh=mesh, param_specs=specs
    )
    _, grads = pipe(params, batch)
    sub_meshes = [frozenset(mesh.devices[k].flat) for k in range(2)]
    used = set()
    for layer, (ga, gb) in enumerate(grads):
        for grad, spec in zip((ga, gb), specs[layer]):
            assert grad.sharding.spec == spec
            assert frozenset(grad.sharding.device_set) in sub_meshes
            used.add(frozenset(grad.sharding.device_set))
            # Sharded, never gathered: each device holds half of the matrix.
            assert grad.addressable_shards[0].data.size == grad.size // 2
    assert used == set(sub_meshes)  # each stage's gradients on its own sub-mesh


def test_the_parameters_own_shardings_are_the_default_specs():
    loss_fn, params, specs, batch, want = _case("2x2x2")
    mesh = _meshes()["2x2x2"]
    placed = jax.tree_util.tree_map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
        params,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2, mesh=mesh)
    got = pipe(placed, batch)
    assert_trees_close(got, want)
    assert pipe.plan(placed, batch).param_specs[:2] == (P(None, "model"), P("model", None))


@pytest.mark.parametrize("context", ["data-model", "2x2x2"])
@pytest.mark.parametrize("bare", [True, False], ids=["bare-spec", "named-sharding"])
def test_a_pipeline_called_under_set_mesh_runs_each_stage_on_its_sub_mesh(context, bare):
    # As MaxText's train loop calls its step: under jax.set_mesh (one stage's mesh, or
    # the pipeline's), which a model pinning activations with bare specs needs while it
    # is traced; the stage programs still run on their own sub-meshes.
    hidden = P("data", "model")
    if not bare:
        hidden = NamedSharding(_meshes()["data-model"], hidden)
    loss_fn, params, specs, batch = _tensor_parallel_mlp(hidden)
    with jax.sharding.set_mesh(_meshes()["data-model"]):
        want = _reference(loss_fn, params, specs, batch, _meshes()["data-model"])
    pipe = pm.pipeline_value_and_grad(
        loss_fn, num_stages=2, num_microbatches=2, mesh=_meshes()["2x2x2"], param_specs=specs
    )
    with jax.sharding.set_mesh(_meshes()[context]):
        got = pipe(params, batch)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    layouts = {frozenset(g.sharding.device_set) for g in jax.tree_util.tree_leaves(got[1])}
    assert layouts == {frozenset(_meshes()["2x2x2"].devices[k].flat) for k in range(2)}


def test_a_list_of_sub_meshes_is_a_mesh_per_slot():
    loss_fn, params, _, batch, want = _case("4x2")
    devices = jax.devices()
    meshes = [Mesh(np.array(devices[2 * k : 2 * k + 2]), ("data",)) for k in range(4)]
    pipe = pm.pipeline_value_and_grad(loss_fn, num_microbatches=4, mesh=meshes)
    assert_trees_close(pipe(params, batch), want)


def test_a_sum_loss_counts_batch_free_terms_once_over_replicas():
    loss_fn, params, _, batch, _ = _case("4x2")

    def summed(params, batch):  # a sum over rows plus weight decay
        decay = sum(jnp.sum(a * a) for a, _ in params)
        return loss_fn(params, batch) * batch[0].shape[0] + 0.1 * decay

    want = jax.jit(jax.value_and_grad(summed))(params, batch)
    pipe = pm.pipeline_value_and_grad(
        summed, num_microbatches=2, mesh=_meshes()["4x2"], loss_reduction="sum"
    )
    assert_trees_close(pipe(params, batch), want, rtol=1e-5, atol=1e-5)


def _collectives(text: str) -> int:
    return len(re.findall(r"\b(?:all-reduce|reduce-scatter)(?:-start)?\(", text))


def _stage_texts(plan) -> tuple[list[str], list[str]]:
    """The compiled text of each stage program of ``plan`` and of each reduction."""
    stages, reductions = [], []
    for index, unit in plan.units.items():
        program = unit.program
        stage = plan.staged.stages[index]
        args = [
            jax.ShapeDtypeStruct(
                (program.replicas, *v.aval.shape) if sharding.spec == P("data") else v.aval.shape,
                v.aval.dtype,
                sharding=sharding,
            )
            for v, sharding in zip(stage.jaxpr.invars, program.in_shardings)
        ]
        accs = unit.zeros() if unit.zeros is not None else []
        scale = jax.ShapeDtypeStruct((), jnp.float32)
        stages.append(unit.run.lower(accs, args, scale).compile().as_text())
        if unit.finish is not None:
            reductions.append(unit.finish.lower(accs).compile().as_text())
    return stages, reductions


def test_data_parallel_gradients_are_reduced_once_per_call():
    loss_fn, params, _, batch, _ = _case("4x2")
    pipe = pm.pipeline_value_and_grad(loss_fn, num_microbatches=4, mesh=_meshes()["4x2"])
    plan = pipe.plan(params, batch)
    stages, reductions = _stage_texts(plan)
    # No stage program reduces across replicas (it runs once per microbatch) ...
    assert [_collectives(text) for text in stages] == [0] * len(stages)
    # ... each accumulating stage (every backward, and the forward computing the loss)
    # is reduced by one program a call (after its last action: the next test).
    accumulating = [unit for unit in plan.units.values() if unit.accumulated]
    assert len(reductions) == len(accumulating) == LAYERS + 1
    assert all(_collectives(text) >= 1 for text in reductions)


def _logged(plan, log: list):
    """``plan`` with each unit's program and reduction appending ``(thread name, "run"
    or "reduce", stage index)`` to ``log`` when dispatched: the same compiled programs."""

    def logging(kind, index, call):
        def dispatch(*args):
            log.append((threading.current_thread().name, kind, index))
            return call(*args)

        return dispatch

    units = {
        index: dataclasses.replace(
            unit,
            run=logging("run", index, unit.run),
            finish=None if unit.finish is None else logging("reduce", index, unit.finish),
        )
        for index, unit in plan.units.items()
    }
    return dataclasses.replace(plan, units=types.MappingProxyType(units))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("reduce", ["after_stage", "end_of_call"])
def test_each_stage_is_reduced_right_after_its_last_action(reduce, parallel):
    # 4 stages x 2 replicas, 1F1B: with "after_stage" each stage's reduction is
    # dispatched by its worker right after the stage's last program, before that
    # worker's next one (while the stages before it still run their last backwards);
    # with "end_of_call" after every program of the call. Serial: one thread walks all.
    loss_fn, params, _, batch, want = _case("4x2")
    pipe = pm.pipeline_value_and_grad(
        loss_fn, num_microbatches=4, mesh=_meshes()["4x2"], reduce_gradients=reduce
    )
    plan = pipe.plan(params, batch)
    reduced = sorted(i for i, unit in plan.units.items() if unit.finish is not None)
    assert len(reduced) == LAYERS + 1  # every backward, and the forward with the loss
    positions = [{i: n for n, ids in per.items() for i in ids} for per in plan.steps.reductions]
    if reduce == "end_of_call":
        assert positions == [{}] * len(plan.steps.columns)
    else:  # each at its stage's last step in its worker's column
        for column, at in zip(plan.steps.columns, positions, strict=True):
            last = {step.index: n for n, step in enumerate(column)}
            assert at == {i: n for i, n in last.items() if i in reduced}
    log: list = []
    got = run_plan(_logged(plan, log), params, batch, None, parallel=parallel)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    kinds = [kind for _, kind, _ in log]
    assert sorted(index for _, kind, index in log if kind == "reduce") == reduced
    last_run = len(kinds) - 1 - kinds[::-1].index("run")
    if reduce == "end_of_call":
        assert kinds.index("reduce") > last_run
        return
    assert kinds.index("reduce") < last_run  # some while other stages still run
    threads: dict[str, list] = {}
    for thread, kind, index in log:
        threads.setdefault(thread, []).append((kind, index))
    for events in threads.values():  # each reduction the next dispatch of its thread
        for n, (kind, index) in enumerate(events):
            if kind == "reduce":
                ran = [m for m, event in enumerate(events) if event == ("run", index)]
                assert ran and n == ran[-1] + 1, (index, events)


def test_the_data_axis_adds_no_reduction_to_tensor_parallel_stages():
    # Tensor parallelism reduces inside each stage (over "model"); the data axis adds
    # none: the stage programs on 2 x 2 x 2 hold as many as on 2 x 1 x 2.
    loss_fn, params, specs, batch, _ = _case("2x2x2")
    counts = []
    for shape in ((2, 2, 2), (2, 1, 2)):
        mesh = _mesh(shape, ("stage", "data", "model"))
        pipe = pm.pipeline_value_and_grad(
            loss_fn, num_stages=2, num_microbatches=2, mesh=mesh, param_specs=specs
        )
        stages, _ = _stage_texts(pipe.plan(params, batch))
        counts.append([_collectives(text) for text in stages])
    assert counts[0] == counts[1] and sum(counts[0]) > 0


def test_mesh_errors_say_what_to_do():
    loss_fn, params, _, batch, _ = _case("4x2")
    with pytest.raises(PipemarkError, match="without the stage axis 'stage'"):
        pm.pipeline_value_and_grad(loss_fn, num_microbatches=2, mesh=_meshes()["data"])(
            params, batch
        )
    with pytest.raises(PipemarkError, match="does not split into 2 data-parallel replicas"):
        pm.pipeline_value_and_grad(loss_fn, num_microbatches=32, mesh=_meshes()["4x2"])(
            params, batch
        )
    with pytest.raises(PipemarkError, match=r"either devices= .* or mesh="):
        pm.pipeline_value_and_grad(
            loss_fn, num_microbatches=2, mesh=_meshes()["4x2"], devices=jax.devices()
        )
    with pytest.raises(PipemarkError, match="pass mesh= too"):
        pm.pipeline_value_and_grad(loss_fn, num_microbatches=2, param_specs=P())
    with pytest.raises(PipemarkError, match=r"give a jax\.sharding\.PartitionSpec"):
        pm.pipeline_value_and_grad(
            loss_fn, num_microbatches=2, mesh=_meshes()["4x2"], param_specs="model"
        )(params, batch)


@pytest.mark.slow
def test_a_transformer_on_four_stages_of_two_replicas():
    ex = examples.transformer(num_layers=4, d_model=8, num_heads=2, seq=4, batch=16)
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    for schedule in ("1f1b", "zb-h1"):
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn, num_microbatches=4, schedule=schedule, mesh=_meshes()["4x2"]
        )
        assert_trees_close(pipe(*ex.args), want, rtol=1e-5, atol=1e-6)


def test_a_training_step_on_sub_meshes_matches_jax():
    loss_fn, params, specs, batch, _ = _case("2x2x2")
    step, init_state = examples.train_step(loss_fn, optimizer="adam")
    state = init_state(params)
    want = jax.jit(step)(params, state, batch)
    mesh = _meshes()["2x2x2"]
    pipelined = pm.pipeline_train_step(
        step, num_stages=2, num_microbatches=2, mesh=mesh, param_specs=(specs, None)
    )
    got = pipelined(params, state, batch)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    # Each stage's sub-mesh updates its own parameters: they keep their layout there,
    # and the optimizer's moments of them lie there too, not on the first sub-mesh.
    plan = pipelined.plan(params, state, batch)
    readers = {leaf: w for w, leaves in enumerate(plan.steps.params) for leaf in leaves}
    new_params, new_state = got[0], got[1]
    assert new_params[0][0].sharding.spec == P(None, "model")
    leaves = jax.tree_util.tree_leaves(new_params)
    moments = [jax.tree_util.tree_leaves(m) for m in new_state[:2]]  # Adam's m and v
    for leaf, value in enumerate(leaves):
        devices = set(plan.placement.slots[readers[leaf]].devices)
        assert value.sharding.device_set == devices
        for moment in moments:
            assert moment[leaf].sharding.device_set == devices
    assert {frozenset(v.sharding.device_set) for v in leaves} == {
        frozenset(s.devices) for s in plan.placement.slots
    }
    # Called under the pipeline's mesh (as MaxText's train loop sets its own), the same.
    with jax.sharding.set_mesh(mesh):
        assert_trees_close(pipelined(params, state, batch), want, rtol=1e-5, atol=1e-6)


def test_dualpipev_with_reduce_grad_on_sub_meshes_matches_jax():
    # On sub-meshes nothing is fused: an overlapped pair runs as its two programs, a
    # whole backward of a split stage as its B then its W; each stage's replicas are
    # reduced where the schedule's REDUCE_GRAD says (read from torch's grammar).
    loss_fn, params, specs, batch, want = _case("2x2x2")
    schedule = pm.runtime.dualpipev_schedule(4, 4)
    ticks = {a: t for t, _, a in schedule.actions()}
    last = {
        j: max(t for a, t in ticks.items() if a.stage == j and a.kind != "forward")
        for j in range(4)
    }
    text = schedule.to_csv("compute_comms").splitlines()
    for j in range(4):  # a REDUCE_GRAD right after each stage's last backward-like cell
        row = text[schedule.stage_devices[j]].split(",")
        at = max(i for i, cell in enumerate(row) if cell.startswith(str(j)) and cell[1] in "BIW")
        row.insert(at + 1, f"{j}REDUCE_GRAD")
        text[schedule.stage_devices[j]] = ",".join(row)
    read = pm.runtime.schedule_from_csv("\n".join(text), "compute_comms", name="dualpipev")
    assert dict(read.reduce_grad) == last
    pipe = pm.pipeline_value_and_grad(
        loss_fn, num_microbatches=4, schedule=read, mesh=_meshes()["2x2x2"], param_specs=specs
    )
    assert_trees_close(pipe(params, batch), want, rtol=1e-5, atol=1e-6)
    plan = pipe.plan(params, batch)
    assert not plan.fused and plan.steps.num_programs > plan.steps.num_actions
    # Each stage is reduced after the last step of its slot at or before its tick.
    for stage, tick in read.reduce_grad:
        w = plan.units[plan.backward_stages[stage]].worker
        column, per = plan.steps.columns[w], plan.steps.reductions[w]
        (n,) = [n for n, indices in per.items() if plan.backward_stages[stage] in indices]
        assert column[n].tick <= tick and all(step.tick > tick for step in column[n + 1 :])
    assert {i for per in plan.steps.reductions for ids in per.values() for i in ids} == set(
        plan.units
    )
