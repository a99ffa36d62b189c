"""Run by tests/runtime/test_distributed.py: stages whose sub-meshes span processes.

Processes of 2 host CPU devices each; the mesh ``("stage", "data")`` is 2 x P for P
processes: with 2 processes each stage spans both (stage k has device k of each), with
4 each stage spans two (stage 0 processes 0 and 1, stage 1 processes 2 and 3). Or one
process of 2 x P devices, the same mesh (``reference``). An MLP's loss and gradients
under 1F1B (and, with 2 processes, interleaved: two stages per slot), saved per
process with ``jax.jit`` of ``jax.value_and_grad`` in the same process; each process
writes its process id first (``pid-MODE-P``), for a test to check none is left. With
2 processes, also an ``optax.adamw`` training step of the MLP and what is refused
there (:func:`train_checks`). In ``run``, the same processes also run FSDP in the
stages, and an ``optax.adamw`` step of it (:func:`fsdp_checks`), with its memory
(:func:`memory_checks`), a memory budget (:func:`budget_checks`), orbax checkpoints of
its state and export's refusal (:func:`checkpoint_checks`).

    python -m pipemark.launch -n 2 tests/runtime/_distributed_span.py OUT_DIR run
    python tests/runtime/_distributed_span.py OUT_DIR reference 2   # 4 devices, one process
    python -m pipemark.launch -n 2 tests/runtime/_distributed_span.py OUT_DIR die
"""

from __future__ import annotations

import importlib.util
import os
import sys

if __name__ == "__main__":
    OUT, MODE = sys.argv[1], sys.argv[2]
    PROCESSES = int(
        os.environ.get("PIPEMARK_NUM_PROCESSES", sys.argv[3] if len(sys.argv) > 3 else 2)
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if MODE == "reference":
        jax.config.update("jax_num_cpu_devices", 2 * PROCESSES)
    else:
        jax.config.update("jax_num_cpu_devices", 2)
        from pipemark.launch import initialize

        initialize()

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark import examples
from pipemark.runtime.devices.steps import Gather, Reduce
from tests.runtime._steps import optax_step

#: (schedule, stages): interleaved puts two stages on each slot; with 4 processes (a
#: longer run) 1F1B alone.
SCHEDULES = {2: (("1f1b", 2), ("interleaved", 4)), 4: (("1f1b", 2),)}


def span_mesh(processes: int) -> Mesh:
    """The 2 x ``processes`` mesh ``("stage", "data")`` over ``processes`` x 2 devices
    (process-major, as ``jax.devices()`` sorted by process): each stage spans
    ``processes / 2`` processes, or both of two."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(processes, 2)
    grid = grid.T if processes == 2 else grid.reshape(2, processes)
    return Mesh(grid, ("stage", "data"))


def refusal(call, *args) -> str:
    """The message of the ``PipemarkError`` that ``call(*args)`` raises ('' if none)."""
    try:
        call(*args)
    except pm.PipemarkError as error:
        return str(error)
    return ""


def train_twice(prefix: str, step, pipelined, params, pipelined_params, opt_state, batch):
    """Two steps of ``pipelined`` (from ``pipelined_params``) and of ``jax.jit(step)`` in
    this process (from ``params``): each result leaf of jit's (``PREFIX-want-I``) and as
    far as this process holds the pipeline's (``PREFIX-held-I``, :func:`_local_view`),
    with how many of its leaves are arrays of the global program
    (``PREFIX-global``), and the result tree's new state for more checks."""
    jitted = jax.jit(step)
    want = jitted(*jitted(params, opt_state, batch)[:2], batch)
    got = pipelined(*pipelined(pipelined_params, opt_state, batch)[:2], batch)
    saved = {}
    leaves = jax.tree_util.tree_leaves(got)
    for i, (w, g) in enumerate(zip(jax.tree_util.tree_leaves(want), leaves)):
        saved[f"{prefix}-want-{i}"] = np.asarray(w)
        saved[f"{prefix}-held-{i}"] = _local_view(g)
    saved[f"{prefix}-global"] = np.array(sum(not x.is_fully_addressable for x in leaves))
    return saved, got


def train_checks(mesh: Mesh, mlp) -> dict[str, np.ndarray]:
    """A training step while a stage spans processes (``gather_results=False``): the
    MLP's ``optax.adamw`` step, its parameters replicated over each stage's sub-mesh, two
    steps (:func:`train_twice`, prefix ``train``); the messages refusing it with
    results gathered (``refused-gathered``) and with global-norm clipping
    (``refused-clip``)."""
    tx = optax.adamw(1e-2, weight_decay=0.1)
    step = optax_step(mlp.loss_fn, tx)
    options = dict(num_stages=2, num_microbatches=4, mesh=mesh, timeout_s=60)
    pipelined = pm.pipeline_train_step(step, **options, gather_results=False)
    state = tx.init(mlp.params)
    saved, _ = train_twice("train", step, pipelined, mlp.params, mlp.params, state, mlp.batch)
    gathered = pm.pipeline_train_step(step, **options)
    saved["refused-gathered"] = refusal(gathered, mlp.params, state, mlp.batch)
    clip = optax.chain(optax.clip_by_global_norm(1.0), tx)
    clipped = pm.pipeline_train_step(optax_step(mlp.loss_fn, clip), **options, gather_results=False)
    saved["refused-clip"] = refusal(clipped, mlp.params, clip.init(mlp.params), mlp.batch)
    return saved


#: The tensor-parallel MLP's 4 layers of two 16 x 16 matrices, each sharded by rows
#: over its stage's data axis (FSDP).
FSDP = [(P("data", None), P("data", None))] * 4


def _sharded(params: list, mesh: Mesh) -> list:
    """``params`` (two layers per stage) as arrays of the global program laid out as
    ``FSDP`` says on their stage's sub-mesh: each device keeps its rows alone (what a
    job keeps between steps that never holds a whole parameter)."""
    sharded = []
    for layer, pair in enumerate(params):
        where = NamedSharding(Mesh(mesh.devices[layer // 2], ("data",)), P("data", None))
        sharded.append(
            tuple(
                jax.make_array_from_callback(
                    w.shape, where, np.asarray(w).__getitem__, dtype=w.dtype
                )
                for w in pair
            )
        )
    return sharded


def _local_view(leaf: jax.Array) -> np.ndarray:
    """``leaf`` as far as this process holds it: its shards in place, NaN elsewhere
    (whole where it is this process's own array: a scalar, Adam's integer count)."""
    if leaf.is_fully_addressable:
        return np.asarray(leaf)
    if not leaf.shape and leaf.addressable_shards:  # Adam's count, whole on each device
        return np.asarray(leaf.addressable_shards[0].data)
    view = np.full(leaf.shape, np.nan, leaf.dtype)
    for shard in leaf.addressable_shards:
        view[shard.index] = np.asarray(shard.data)
    return view


def _device_bytes(tree) -> np.ndarray:
    """Per device of this process, the bytes of ``tree``'s shards it holds."""
    held = dict.fromkeys(jax.local_devices(), 0)
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return np.array(list(held.values()))


def fsdp_checks(mesh: Mesh, processes: int) -> dict[str, np.ndarray]:
    """FSDP in stages that span processes: the tensor-parallel MLP (two stages of two
    layers), its parameters sharded over each stage's data axis (``FSDP``), loss and
    gradients of ``pipeline_value_and_grad`` with ``fsdp_gather="once"``, with
    ``jax.jit`` of ``jax.value_and_grad`` in this process (``fsdp-want-I``). The
    parameters kept sharded (``_sharded``) and the gradients kept where computed
    (``gather_results=False``: ``fsdp-held-I``, this process's shards, NaN elsewhere),
    with the bytes each device of this process holds of them (``fsdp-param-bytes``,
    ``fsdp-grad-bytes``); with 2 processes, also the parameters whole and every
    result gathered (``fsdp-once-I``). The same with ``fsdp_gather="per_microbatch"``
    (each stage program gathers its parameters between the processes:
    ``fsdp-per-microbatch-I``, as ``fsdp-held-I``), whether each of the two plans
    orders its programs (``fsdp-ordered``), and whether that order walks each
    worker's steps and the transfers each in turn (``fsdp-order-walks``). With
    ``fsdp_gather="once"`` and ``reduce_gradients="end_of_call"`` too
    (``fsdp-end-of-call-I``); whether each of the three plans places its reductions
    between the processes in the global order (``fsdp-reduces-placed``,
    :func:`reduces_placed`). Two
    ``optax.adamw`` training steps from the sharded parameters (:func:`train_twice`,
    prefix ``fsdp-train``), with the bytes each device of this process holds of the
    new parameters and of Adam's first moments (``fsdp-train-param-bytes``,
    ``fsdp-train-mu-bytes``)."""
    ex = examples.tensor_parallel_mlp(4, 16, 32, num_stages=2)
    saved = {}
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(ex.params, ex.batch)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(want)):
        saved[f"fsdp-want-{i}"] = np.asarray(leaf)
    options = dict(num_microbatches=2, mesh=mesh, param_specs=FSDP, timeout_s=60)
    if processes == 2:
        whole = pm.pipeline_value_and_grad(ex.loss_fn, **options)
        for i, leaf in enumerate(jax.tree_util.tree_leaves(whole(ex.params, ex.batch))):
            assert leaf.is_fully_addressable, (i, leaf.sharding)  # whole here
            saved[f"fsdp-once-{i}"] = np.asarray(leaf)
    params = _sharded(ex.params, mesh)
    held = pm.pipeline_value_and_grad(ex.loss_fn, **options, gather_results=False)
    loss, grads = held(params, ex.batch)
    for i, leaf in enumerate([loss, *jax.tree_util.tree_leaves(grads)]):
        saved[f"fsdp-held-{i}"] = _local_view(leaf)
    saved["fsdp-param-bytes"] = _device_bytes(params)
    saved["fsdp-grad-bytes"] = _device_bytes(grads)
    per_microbatch = pm.pipeline_value_and_grad(
        ex.loss_fn, **options, gather_results=False, fsdp_gather="per_microbatch"
    )
    loss_pm, grads_pm = per_microbatch(params, ex.batch)
    # Each stage's gradients reduce-scattered after the call's last action instead.
    at_end = pm.pipeline_value_and_grad(
        ex.loss_fn, **options, gather_results=False, reduce_gradients="end_of_call"
    )
    loss_end, grads_end = at_end(params, ex.batch)
    for i, leaf in enumerate([loss_end, *jax.tree_util.tree_leaves(grads_end)]):
        saved[f"fsdp-end-of-call-{i}"] = _local_view(leaf)
    plans = [pipe.plan(params, ex.batch) for pipe in (held, per_microbatch, at_end)]
    saved["fsdp-reduces-placed"] = np.array([reduces_placed(plan) for plan in plans])
    saved["fsdp-ordered"] = np.array([plan.ordered for plan in plans[:2]])
    order = plans[1].steps.order  # each worker's steps, each transfer once, in order
    saved["fsdp-order-walks"] = np.array(
        [
            [n for v, n in order if v == w] == list(range(len(c)))
            for w, c in enumerate(plans[1].steps.columns)
        ]
        + [[n for v, n in order if v == -1] == list(range(len(plans[1].steps.transfers)))]
    )
    for i, leaf in enumerate([loss_pm, *jax.tree_util.tree_leaves(grads_pm)]):
        saved[f"fsdp-per-microbatch-{i}"] = _local_view(leaf)
    tx = optax.adamw(1e-2, weight_decay=0.1)
    step = optax_step(ex.loss_fn, tx)
    train = pm.pipeline_train_step(
        step, **{**options, "param_specs": (FSDP, None)}, gather_results=False
    )
    trained, (params, opt_state, _) = train_twice(
        "fsdp-train", step, train, ex.params, params, tx.init(ex.params), ex.batch
    )
    saved.update(trained)
    saved["fsdp-train-param-bytes"] = _device_bytes(params)
    saved["fsdp-train-mu-bytes"] = _device_bytes(opt_state[0].mu)
    sharded = _sharded(ex.params, mesh)
    saved.update(memory_checks(held.memory(sharded, ex.batch), sharded, ex.batch, mesh))
    saved.update(budget_checks(ex, sharded, options, processes))
    state = {"params": params, "opt_state": opt_state, "grads": grads}
    saved.update(checkpoint_checks(held, train, (sharded, tx.init(ex.params), ex.batch), state))
    return saved


def reduces_placed(plan) -> bool:
    """Whether ``plan`` reduces each accumulating stage of this process (all span
    processes here) between the processes in the one global order as its
    ``reduce_gradients`` says: with ``"after_stage"`` once (a ``Reduce`` on the
    transfer thread), handed over at the stage's last step and placed after that step
    and after every transfer of its outputs; with ``"end_of_call"`` never in the order
    (at the end of the call, every process in the same stage order)."""
    steps, units = plan.steps, plan.units
    reduces = [(i, t) for i, t in enumerate(steps.transfers) if isinstance(t, Reduce)]
    if plan.reduce_gradients == "end_of_call":
        return not reduces and not any(steps.handed)
    mine = {i for i, u in units.items() if u.accumulated and plan.placement.local[u.worker]}
    if sorted(t.index for _, t in reduces) != sorted(mine):
        return False
    where = {entry: p for p, entry in enumerate(steps.order)}
    for i, reduce in reduces:
        column = steps.columns[reduce.worker]
        (n,) = [n for n, ids in steps.handed[reduce.worker].items() if reduce.index in ids]
        if n != max(m for m, step in enumerate(column) if step.index == reduce.index):
            return False
        made = (column[n].microbatch, column[n].index)
        before = [where[(reduce.worker, n)]] + [
            where[(-1, j)]
            for j, t in enumerate(steps.transfers)
            if not isinstance(t, (Gather, Reduce)) and any(key[:2] == made for key in t[2])
        ]
        if where[(-1, i)] < max(before):
            return False
    return True


def memory_checks(estimate, params: list, batch, mesh: Mesh) -> dict[str, np.ndarray]:
    """``Pipeline.memory`` of the FSDP pipeline (``estimate``, for ``params`` sharded
    as ``_sharded`` lays them out): per slot, its ``parameters``, ``batch``,
    ``accumulators``, ``arguments`` and ``in_flight`` bytes (``memory-slots``), next to
    what JAX's arrays hold on this process's first device of the slot (``memory-held``:
    the shards of the slot's two layers, the batch as made here; -1 where this process
    holds no device of the slot)."""
    me = jax.process_index()
    rows, held = [], []
    for k, slot in enumerate(estimate.slots):
        fields = ("parameters", "batch", "accumulators", "arguments", "in_flight")
        rows.append([getattr(slot, name) for name in fields])
        mine = [d for d in mesh.devices[k].flat if d.process_index == me]
        trees = (params[2 * k : 2 * k + 2], batch)
        held.append([_device_bytes_on(tree, mine[0]) if mine else -1 for tree in trees])
    return {"memory-slots": np.array(rows), "memory-held": np.array(held)}


def _device_bytes_on(tree, device) -> int:
    """The bytes of ``tree``'s shards on ``device``, as JAX's arrays hold them."""
    shards = [s for x in jax.tree_util.tree_leaves(tree) for s in x.addressable_shards]
    return sum(s.data.nbytes for s in shards if s.device == device)


#: Per number of processes, a memory budget (bytes per device) that the FSDP
#: pipeline's first plan exceeds on a slot, as the processes holding the batch there
#: see it (the others do not), and that rematerialising a forward stage meets.
BUDGET = {2: 20 * 1024, 4: 17 * 1024 + 512}
#: A budget that no change meets.
TOO_SMALL = 12 * 1024


def budget_checks(ex, params: list, options: dict, processes: int) -> dict[str, np.ndarray]:
    """``memory_budget`` with stages that span processes: the plan the budget makes
    (``budget-plan``: schedule and forward stages rematerialised), its slots'
    predicted peaks here (``budget-peaks``), its loss and gradients (``budget-held-I``,
    as ``fsdp-held-I``); the message refusing ``TOO_SMALL`` (``refused-budget``)."""
    budgeted = pm.pipeline_value_and_grad(
        ex.loss_fn, **options, gather_results=False, memory_budget=BUDGET[processes]
    )
    plan = budgeted.plan(params, ex.batch)
    saved = {"budget-plan": f"{plan.schedule.name}; {sorted(plan.rematerialized)}"}
    saved["budget-peaks"] = np.array(
        [s.predicted_peak for s in budgeted.memory(params, ex.batch).slots]
    )
    loss, grads = budgeted(params, ex.batch)
    for i, leaf in enumerate([loss, *jax.tree_util.tree_leaves(grads)]):
        saved[f"budget-held-{i}"] = _local_view(leaf)
    small = pm.pipeline_value_and_grad(
        ex.loss_fn, **options, gather_results=False, memory_budget=TOO_SMALL
    )
    saved["refused-budget"] = refusal(small.plan, params, ex.batch)
    return saved


def checkpoint_checks(held, train, args: tuple, state: dict) -> dict[str, np.ndarray]:
    """``state`` (the FSDP step's new parameters and optimizer state, and the
    gradients ``held`` kept where computed) saved by every process with orbax's
    ``StandardCheckpointer`` and restored onto ``train.abstract_state(*args)`` and
    ``held.abstract_params``: each leaf as saved and as restored, as far as this
    process holds it (``orbax-saved-I``, ``orbax-restored-I``), and how many restored
    leaves lie as the target says (``orbax-as-target``). Without orbax, nothing.
    Export refused, with its message (``refused-export``, ``refused-export-step``)."""
    saved = {
        "refused-export": refusal(held.export, os.path.join(OUT, "export"), *args[::2]),
        "refused-export-step": refusal(train.export, os.path.join(OUT, "export-step"), *args),
    }
    if importlib.util.find_spec("orbax.checkpoint") is None:
        return saved
    import orbax.checkpoint as ocp

    params, opt_state = train.abstract_state(*args)
    target = {"params": params, "opt_state": opt_state}
    target["grads"] = held.abstract_params(*args[::2])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(OUT, "checkpoint"), state)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(os.path.join(OUT, "checkpoint"), target)
    leaves = [jax.tree_util.tree_leaves(tree) for tree in (state, back, target)]
    for i, (was, got, _) in enumerate(zip(*leaves)):
        saved[f"orbax-saved-{i}"] = _local_view(was)
        saved[f"orbax-restored-{i}"] = _local_view(got)
    saved["orbax-as-target"] = np.array(sum(g.sharding == t.sharding for _, g, t in zip(*leaves)))
    return saved


def main() -> None:
    me = jax.process_index()
    with open(os.path.join(OUT, f"pid-{MODE}-{me}"), "w") as f:
        f.write(str(os.getpid()))
    if MODE == "die" and me == 1:
        # Die after the processes agreed on the call, before the first transfer.
        from pipemark.runtime import plan

        plan.Watchdog = lambda *args: os._exit(3)
    mesh = span_mesh(PROCESSES)
    mlp = examples.mlp(num_layers=4, width=16, batch=16)
    saved = {}
    want = jax.jit(jax.value_and_grad(mlp.loss_fn))(mlp.params, mlp.batch)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(want)):
        saved[f"want-{i}"] = np.asarray(leaf)
    for schedule, stages in SCHEDULES[PROCESSES]:
        step = pm.pipeline_value_and_grad(
            mlp.loss_fn,
            num_stages=stages,
            num_microbatches=4,
            schedule=schedule,
            mesh=mesh,
            timeout_s=60,
        )
        for i, leaf in enumerate(jax.tree_util.tree_leaves(step(mlp.params, mlp.batch))):
            assert leaf.is_fully_addressable, (schedule, i, leaf.sharding)  # whole here
            saved[f"{schedule}-{i}"] = np.asarray(leaf)
    if MODE == "run" and PROCESSES == 2:
        saved.update(train_checks(mesh, mlp))
    if MODE == "run":
        saved.update(fsdp_checks(mesh, PROCESSES))
    np.savez(os.path.join(OUT, f"{MODE}-{me}.npz"), **saved)
    print(f"process {me}: done", flush=True)


if __name__ == "__main__":
    main()
