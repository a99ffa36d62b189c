"""The training-step entry point: :func:`pipeline_train_step` cuts a step at its grad
marker (:func:`pipemark.passes.split_at_gradient`), runs the part before as a pipeline
(:mod:`pipemark.runtime.pipeline` says how a call runs) and the update after it once,
per slot where the stages' parameters live (:mod:`pipemark.runtime.training.update_run`)."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from pipemark.errors import PipemarkError
from pipemark.exported import ExportedStages
from pipemark.mutation import call_watching_arguments
from pipemark.passes.gradient import split_at_gradient
from pipemark.passes.inline import inline_calls
from pipemark.runtime.arguments import PartitionedParams, partition_untraceable
from pipemark.runtime.calls import (
    record_holders,
    restore_target,
    shape_key,
    shared_params_here,
    traced_call,
)
from pipemark.runtime.devices.placement import available_slots, mesh_leaf_specs
from pipemark.runtime.devices.transport import CollectiveTransport
from pipemark.runtime.execution.plan_export import export_train_step, leaf_names
from pipemark.runtime.execution.run import action_costs, run_plan
from pipemark.runtime.losses import count_batch_free_terms_once
from pipemark.runtime.memory.budget import check_update_within, within_budget
from pipemark.runtime.memory.estimate import (
    MemoryEstimate,
    argument_bytes,
    plan_memory,
    with_host,
    with_update,
)
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.pipeline_stages import stage_program
from pipemark.runtime.plan import PipelinePlan, plan_from_staged
from pipemark.runtime.schedules.core import Schedule
from pipemark.runtime.tracing import replica_batch
from pipemark.runtime.training.keeping import stage_readers
from pipemark.runtime.training.layouts import StepLayouts, step_layouts
from pipemark.runtime.training.offload import check_offload, host_memory_kind, offloaded_leaves
from pipemark.runtime.training.update import StageUpdates
from pipemark.runtime.training.update_run import (
    UpdateProgram,
    crossing_reads,
    delete_donated,
    offloaded_inputs,
    run_update,
    split_step_update,
    update_bytes,
    update_holders,
    update_phase,
    update_programs,
)

__all__ = ["PipelinedStep", "pipeline_train_step"]


def _refuse_spanning_stages(options: PipelineOptions) -> None:
    """A stage whose sub-mesh spans processes updates its parameters where they lie, on
    its processes (results kept there): with results gathered, each process would hold
    and update every stage's parameters alone. Refused then."""
    if not options.gather_results or options.mesh is None:
        return
    if not any(len(s.processes) > 1 for s in available_slots(options)):
        return
    raise PipemarkError(
        "pipeline_train_step with a stage whose sub-mesh spans processes needs "
        "gather_results=False: each stage's processes then update its parameters and "
        "optimizer state where they lie (arrays of the global program over the stage's "
        "sub-mesh). Pass gather_results=False, or lay the mesh out so that each stage's "
        "devices belong to one process."
    )


def _refuse_spanning_update(
    plan: PipelinePlan,
    split: StageUpdates | None,
    parts: tuple[UpdateProgram, ...],
    holders: tuple[int | None, ...],
) -> None:
    """Where a stage's sub-mesh spans processes, each part of the update runs on its
    stage's processes from values they hold: a part that reads a value another stage's
    slot holds (an update that does not split per stage reads every stage's
    gradients) is refused."""
    if not plan.placement.spanning:
        return
    crossing = crossing_reads(parts, holders)
    if not crossing:
        return
    advice = "or lay the mesh out so that each stage's devices belong to one process."
    if split is None:
        raise PipemarkError(
            "pipeline_train_step with a stage whose sub-mesh spans processes: the update "
            "after pm.mark_gradient does not split per stage (a big value couples two "
            "stages' parameters, or it has effects such as a debug print), and it would "
            "run whole in one place. Make each parameter's update read only its own "
            f"stage's values, {advice}"
        )
    slot, position, source = crossing[0]
    raise PipemarkError(
        "pipeline_train_step with a stage whose sub-mesh spans processes: the update's "
        f"part on slot {slot} reads value {position} of the update, which slot {source} "
        "computes (a value coupling the stages, such as the partial sums of a global "
        "norm); moving it between the processes of two sub-meshes is not supported yet. "
        "Update each stage from its own values (e.g. optax.clip_by_block_rms, per leaf, "
        f"instead of optax.clip_by_global_norm), {advice}"
    )


def _refuse_unsplit_batch(replicated: list[Any], batch: Any, error: Exception) -> None:
    """When tracing the step for one microbatch failed and an argument before the batch
    has the batch's leading size, say that only the last argument is split."""
    size = np.shape(jax.tree_util.tree_leaves(batch)[0])[0]
    for i in reversed(range(len(replicated))):  # data usually comes just before the batch
        if any(np.shape(x)[:1] == (size,) for x in jax.tree_util.tree_leaves(replicated[i])):
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise PipemarkError(
                f"Tracing the step for one microbatch failed ({type(error).__name__}: "
                f"{first}). pipeline_train_step splits only the step's last argument (the "
                f"batch) into microbatches, and argument {i} has the batch's leading size "
                f"{size}: if it is data too, pass the data as one argument, e.g. "
                "step(params, state, (x, y)) instead of step(params, state, x, y)."
            ) from error


def _check_accumulable(compute: ClosedJaxpr, compute_full: ClosedJaxpr) -> None:
    """The values the update reads from the gradient part must not depend on the batch
    size: they are accumulated over microbatches."""
    micro_avals = [v.aval for v in compute.jaxpr.outvars]
    full_avals = [v.aval for v in compute_full.jaxpr.outvars]
    for i, (a, b) in enumerate(zip(micro_avals, full_avals)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
            raise PipemarkError(
                f"Value {i} that the update after pm.mark_gradient reads from the "
                f"gradient part is a {a.dtype} (a random key, as jax.random.split "
                "makes before the grad marker): the values the gradient part hands the "
                "update are summed over microbatches, and a key is not a number. Split "
                "the key after pm.mark_gradient (in the update), or pass a key per row "
                "in the batch."
            )
        if a.shape != b.shape:
            raise PipemarkError(
                f"Value {i} that the update after pm.mark_gradient reads from the "
                f"gradient part has shape {a.shape} for one microbatch but {b.shape} for "
                "the whole batch; only values that do not depend on the batch size "
                "(gradients, a mean loss) can be accumulated over microbatches. Reduce "
                "it over the batch before the grad marker."
            )


def _trace_step(step_fn: Callable, args: tuple) -> tuple[ClosedJaxpr, ClosedJaxpr, Any]:
    """``step_fn`` traced on ``args``, its calls inlined (a ``jax.jit`` step holds its
    grad marker inside its body, as :func:`pipemark.split` finds it), cut at the grad
    marker: ``(compute_grad, apply_grad, output shape)``."""
    cj, out_shape = jax.make_jaxpr(
        lambda *a: call_watching_arguments(step_fn, a), return_shape=True
    )(*args)
    compute, apply = split_at_gradient(inline_calls(cj))
    return compute, apply, out_shape


class PipelinedStep:
    """A training step whose gradient part runs as a pipeline; made by
    :func:`pipeline_train_step`."""

    def __init__(
        self,
        step_fn: Callable,
        options: PipelineOptions,
        donate: bool = False,
        offload: str | None = None,
    ) -> None:
        if not isinstance(donate, bool):
            raise PipemarkError(
                "pipeline_train_step: donate must be True (the update takes over the "
                "buffers of the state passed in, as jax.jit's donate_argnums does) or "
                f"False (the arrays passed in are left unchanged), got {donate!r}."
            )
        check_offload(offload)
        self.step_fn = step_fn
        self.options = options
        self.donate = donate
        self.offload = offload
        self._prepared: dict[Any, tuple[PipelinePlan, Callable, Any]] = {}

    def plan(self, *args: Any) -> PipelinePlan:
        """The pipeline plan of the gradient part, for arguments shaped like these."""
        return self._prepare(args)[0].plan

    def _prepare(self, args: tuple[Any, ...]) -> tuple[_Prepared, tuple[Any, ...]]:
        """What a call with ``args`` needs (made once per argument shapes and static
        leaves), and ``args`` with their static leaves taken out (:func:`_traced_step`):
        what the call passes on."""
        if not args:
            raise PipemarkError(
                "A pipelined training step needs at least the batch argument (the last one)."
            )
        part = partition_untraceable(args)
        args = part.dynamic
        key = (part.key, shape_key(args))
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared, args
        *replicated, batch = args
        options = self.options
        results: dict[str, PartitionedParams] = {}
        step_fn = _traced_step(self.step_fn, part, results)
        _refuse_spanning_stages(options)
        batch_structs, micro, replicas = replica_batch(batch, options)
        # The gradient part is traced for one microbatch (it runs per microbatch); the
        # update is traced for the whole batch (it runs once, and may read the batch).
        try:
            compute, _, _ = _trace_step(step_fn, (*replicated, batch_structs))
        except PipemarkError:
            raise
        except (TypeError, ValueError) as error:  # JAX's own, e.g. shapes that disagree
            _refuse_unsplit_batch(replicated, batch, error)
            raise
        compute_full, apply, out_shape = _trace_step(step_fn, args)
        _check_accumulable(compute, compute_full)
        num_replicated = len(jax.tree_util.tree_leaves(tuple(replicated)))
        if options.loss_reduction == "sum":
            # What does not read the batch (weight decay's gradient) counts once.
            compute = count_batch_free_terms_once(
                compute, num_replicated, options.num_microbatches * replicas
            )
        leaves = jax.tree_util.tree_leaves(args)
        num_args = len(leaves)
        layouts = None
        if options.mesh is not None:
            specs = mesh_leaf_specs(options, tuple(replicated), "args")
            # The optimizer state and the gradients laid out like their parameters.
            layouts = step_layouts(compute, apply, specs, num_args)
        # The caller's arrays count where they lie (the first step's, as a rule on one
        # device: the most a step holds there), against a budget too.
        arguments = functools.partial(_argument_bytes, args)
        plan = _step_plan(compute, options, num_replicated, micro, layouts, arguments)
        split = split_step_update(plan, apply, num_args, self.offload is not None)
        distributed = plan.placement.distributed and not plan.placement.spanning
        if split is None and not plan.gather_results and distributed:
            # The whole update reads every stage's gradients: they are gathered, as
            # with gather_results=True (every process then runs it; refused below
            # where a stage spans processes).
            options = dataclasses.replace(options, gather_results=True)
            plan = _step_plan(compute, options, num_replicated, micro, layouts, arguments)
        donatable = _donatable(self.donate, num_replicated, num_args, len(apply.jaxpr.invars))
        host = self._offloaded(plan, replicated, out_shape, apply, split)  # and its kind
        parts = update_programs(plan, apply, split, layouts and layouts.table, donatable, *host)
        holders = update_holders(plan, num_args)
        _refuse_spanning_update(plan, split, parts, holders)
        if options.memory_budget is not None:
            updates = update_bytes(plan, parts, num_args, leaves)
            check_update_within(
                updates,
                plan.placement.slots,
                options.memory_budget,
                distributed=plan.placement.distributed,
                timeout_s=options.timeout_s,
            )
        out_tree = jax.tree_util.tree_structure(out_shape)
        shared: tuple[int, ...] = ()
        if split is not None and plan.placement.distributed:
            # Results no slot owns, and scalars (the loss, a metric), go to every process.
            first = num_args + len(plan.staged.outputs)
            scalars = [first + k for k, v in enumerate(apply.jaxpr.outvars) if not v.aval.shape]
            shared = tuple(sorted({*split.unowned, *scalars}))
        prepared = _Prepared(plan, out_tree, parts, holders, shared, results["part"])
        self._prepared[key] = prepared
        return prepared, args

    def _offloaded(
        self,
        plan: PipelinePlan,
        state: Sequence[Any],
        out_shape: Any,
        apply: ClosedJaxpr,
        split: StageUpdates | None,
    ) -> tuple[dict[int, int], str]:
        """With ``offload``: per result of the update ``apply`` (its position in the
        update's table, whose inputs come first) written to host memory, the input it
        replaces, and the host memory kind (:mod:`pipemark.runtime.training.offload`).
        A leaf that parts on several slots read (Adam's step count: a scalar) stays on
        the devices: a part reads host memory on its own slot alone (JAX 0.12.1 on CPU
        cannot copy a program's host result to another device)."""
        if self.offload is None:
            return {}, "pinned_host"
        kind = host_memory_kind([d for slot in plan.placement.slots for d in slot.devices])
        count = len(apply.jaxpr.invars)
        host = {}
        for i, j in offloaded_leaves(plan, state, out_shape, self.offload).items():
            if split is not None:
                slots = {p.worker for p in split.parts if i in p.inputs or count + j in p.outputs}
                if len(slots) > 1:
                    continue
            host[count + j] = i
        return host, kind

    def action_costs(self, *args: Any, repeat: int = 3) -> dict[str, tuple[float, ...]]:
        """Measured costs of the gradient part's actions, as
        :meth:`Pipeline.action_costs` gives them (the update, run once, is not an action)."""
        prepared, args = self._prepare(args)
        *replicated, batch = args
        return action_costs(prepared.plan, tuple(replicated), batch, repeat)

    def memory(self, *args: Any) -> MemoryEstimate:
        """What a step with these arguments holds on each device slot: the gradient
        part as :meth:`Pipeline.memory` predicts it, and the update after it
        (``SlotMemory.update``: each slot's part of it, the largest where a slot runs
        several rounds, or the whole update on the first slot where it does not split;
        its compiled program's arguments, among them the optimizer state and the
        gradients, its results but those written into a donated argument's buffer, and
        its temporaries; under ``jax.distributed``, of this process's slots). With
        ``donate=True`` the new parameters and optimizer state take the old ones'
        buffers: the update holds one copy of the state, not two."""
        prepared, args = self._prepare(args)
        return _step_memory(prepared.plan, prepared.parts, args)

    def trace(self, *args: Any, path: str | os.PathLike | None = None) -> dict:
        """The gradient part of one step with these arguments, traced as
        :meth:`Pipeline.trace` does (the update, run once, is not an action); written to
        ``path`` when given, and returned."""
        prepared, args = self._prepare(args)
        *replicated, batch = args
        return traced_call(prepared.plan, tuple(replicated), batch, path)

    def export(self, directory: str | os.PathLike, *args: Any) -> ExportedStages:
        """Write the programs a step with these arguments runs (its gradient part's, as
        :meth:`Pipeline.export` writes them, then its update's), and the schedule, to
        ``directory``: a callable of the step's argument leaves (flat) returning its
        result leaves, which :func:`pipemark.load_staged` reads back in any process.

        >>> import tempfile, pipemark as pm
        >>> from pipemark import examples
        >>> ex = examples.mlp(num_layers=2, batch=4)
        >>> step, init_state = examples.train_step(ex.loss_fn)
        >>> pipelined = pm.pipeline_train_step(step, num_stages=1, num_microbatches=2)
        >>> state = init_state(ex.params)
        >>> exported = pipelined.export(tempfile.mkdtemp(), ex.params, state, ex.batch)
        >>> exported.kind, [name for name in exported.programs if name.startswith("update")]
        ('train_step', ['update/0'])
        """
        prepared, args = self._prepare(args)
        out_tree = prepared.out_tree
        results = jax.tree_util.tree_unflatten(out_tree, range(out_tree.num_leaves))
        return export_train_step(
            prepared.plan,
            prepared.parts,
            directory,
            num_outputs=out_tree.num_leaves,
            input_names=leaf_names("args", args),
            output_names=leaf_names("result", results),
        )

    def __call__(self, *args: Any) -> Any:
        return self._call(args, None)

    def abstract_state(self, *args: Any) -> tuple[Any, ...]:
        """The step's state (its arguments but the batch, ``args[:-1]``) as
        ``jax.ShapeDtypeStruct`` s laid out where this pipeline keeps each leaf
        (:mod:`pipemark.runtime.training.keeping`): a parameter on the slot whose stages read it,
        a leaf of the optimizer state on the slot whose part of the update reads it;
        under ``jax.distributed`` on another process's slot where only that process
        reads it (results not gathered), else on this process's own. The target to
        restore a checkpoint to (``orbax.checkpoint.args.StandardRestore``), on this
        layout or another (docs/training.md).

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> ex = examples.mlp(num_layers=2, batch=4)
        >>> step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
        >>> state = init_state(ex.params)
        >>> pipelined = pm.pipeline_train_step(step, num_stages=1, num_microbatches=2)
        >>> params, opt_state = pipelined.abstract_state(ex.params, state, ex.batch)
        >>> jax.tree_util.tree_structure(opt_state) == jax.tree_util.tree_structure(state)
        True
        """
        prepared = self._prepare(args)[0]
        plan = prepared.plan
        state = partition_untraceable(tuple(args[:-1]))
        leaves, treedef = jax.tree_util.tree_flatten(state.dynamic)
        readers = stage_readers(plan, len(leaves))
        for part in prepared.parts:
            for position, sharding in zip(part.inputs, part.shardings):
                if position < len(leaves):
                    readers[position].append((part.worker, sharding))
        return state.combine(treedef.unflatten(restore_target(plan, leaves, readers)))

    def timed_call(self, *args: Any) -> tuple[Any, dict[str, float]]:
        """Like calling the step, and also return the gradient part's timings, as
        :meth:`Pipeline.timed_call` gives them; under ``jax.distributed`` also
        ``update_bytes_sent`` / ``update_bytes_received``: the bytes the update moved
        between this process's slots and other processes' (with
        ``gather_results=False``: the small values its parts exchange, and the results
        no slot owns, which every process gets)."""
        timings: dict[str, float] = {}
        out = self._call(args, timings)
        return out, timings

    def _call(self, args: tuple[Any, ...], timings: dict | None) -> Any:
        prepared, args = self._prepare(args)
        plan, out_tree = prepared.plan, prepared.out_tree
        *replicated, batch = args
        state = shared_params_here(plan, _committed(tuple(replicated)))
        accumulated = run_plan(plan, state, batch, timings)
        if self.donate:
            # A pipeline program that fails on its device (a host callback's error)
            # reports it only once its results are waited for: the update, dispatched
            # first, would have taken the state's buffers. So a donating step waits for
            # this process's results first, and such an error leaves the state intact.
            leaves = jax.tree_util.tree_leaves(accumulated)
            jax.block_until_ready([x for x in leaves if _local_array(x)])
        # The update runs once: each slot its own stages' part, or, where it does not
        # split, whole on the first slot; on a sub-mesh each parameter keeps its layout
        # there. The parts fill one table (StageUpdates): the update's inputs, its
        # results, then the small values slots exchange, each copied to the slots that
        # read it. Under jax.distributed each process runs its own slots' parts (see
        # update_programs and run_update).
        values = dict(enumerate([*jax.tree_util.tree_leaves((*state, batch)), *accumulated]))
        num_inputs = len(values)
        transport = None
        if plan.placement.distributed:
            transport = CollectiveTransport(plan.watchdog, plan.placement.process)
        with jax.set_mesh(None):  # on its slot whatever the caller's mesh (see run_plan)
            held = run_update(
                plan,
                prepared.parts,
                prepared.holders,
                prepared.shared,
                values,
                transport,
                self.donate,
            )
        if self.donate:  # a state leaf copied for its part is deleted too, as jit would
            count = len(jax.tree_util.tree_leaves(state))
            local = plan.placement.local
            delete_donated(prepared.parts, local, values, count)
        if timings is not None and transport is not None:
            timings["update_bytes_sent"] = transport.bytes_sent
            timings["update_bytes_received"] = transport.bytes_received
        positions = range(num_inputs, num_inputs + out_tree.num_leaves)
        outputs = [values[k] for k in positions]
        if plan.gather_results:  # every process ran the whole update: copies everywhere
            record_holders(plan, outputs, [None] * len(outputs))
        else:
            record_holders(plan, outputs, [held.get(k) for k in positions])
        return prepared.results.combine(jax.tree_util.tree_unflatten(out_tree, outputs))


class _Prepared(NamedTuple):
    """What a training step's call needs, made once per argument shapes."""

    plan: PipelinePlan
    out_tree: Any
    parts: tuple[UpdateProgram, ...]  # the update, per slot and round where it splits
    holders: tuple[int | None, ...]  # per input of the update (see update_holders)
    shared: tuple[int, ...]  # results sent to every process (see run_update)
    results: PartitionedParams  # the step's results: their static leaves


def _traced_step(
    step_fn: Callable, part: PartitionedParams, results: dict[str, PartitionedParams]
) -> Callable:
    """``step_fn`` as a function of its arguments' traced leaves (``part.dynamic``),
    returning its results' traced leaves; their static leaves (an equinox module's
    activation function) are held apart, as ``eqx.filter_jit`` holds them: the
    arguments' in ``part``, the results' put in ``results["part"]`` when it is traced."""

    def step(*dynamic: Any) -> Any:
        out = partition_untraceable(step_fn(*part.combine(dynamic)))
        results["part"] = out
        return out.dynamic

    return step


def _donatable(donate: bool, num_state: int, num_args: int, num_inputs: int) -> set[int]:
    """The positions of the update's inputs (the step's ``num_args`` argument leaves,
    its state's ``num_state`` first, then the pipeline's accumulated results) that
    its parts may donate: the accumulated results (gradients, the loss) always, being
    the call's own; the caller's state with ``donate``; never the batch.

    >>> sorted(_donatable(True, 2, 3, 5)), sorted(_donatable(False, 2, 3, 5))
    ([0, 1, 3, 4], [3, 4])
    """
    return {*range(num_args, num_inputs), *(range(num_state) if donate else ())}


def _local_array(x: Any) -> bool:
    """Whether ``x`` is an array this process holds whole (not another process's)."""
    return isinstance(x, jax.Array) and x.is_fully_addressable


def _committed(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """``state`` with each uncommitted array (``jnp.ones``, ``jax.random``'s: on the
    default device, not put there) committed where it lies, which copies nothing. A
    step's results, the next step's state, are committed, and ``jit`` compiles a program
    for uncommitted arguments apart: so the second step compiles nothing. Only the
    first step's state is uncommitted, as a rule, so later steps pass it as it is."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    loose = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.committed]
    if not loose:
        return state
    done: dict[int, Any] = {}  # an array at two places stays one (the update's donation)
    for i in loose:
        x = leaves[i]
        if id(x) not in done:
            done[id(x)] = jax.device_put(x, x.sharding)
        leaves[i] = done[id(x)]
    return treedef.unflatten(leaves)


def _step_plan(
    compute: ClosedJaxpr,
    options: PipelineOptions,
    num_param_leaves: int,
    microbatch_size: int,
    layouts: StepLayouts | None,
    arguments: Callable[[PipelinePlan], list[int]] | None = None,
) -> PipelinePlan:
    """The plan of a training step's gradient part ``compute``, cut as ``options`` say
    (again for each plan a memory budget tries), scheduled and compiled; on
    sub-meshes, its state and results laid out by ``layouts``."""
    out_tree = jax.tree_util.tree_structure([0] * len(compute.jaxpr.outvars))

    def make_plan(chosen: PipelineOptions, remat: frozenset[str]) -> PipelinePlan:
        staged, layers = stage_program(
            compute,
            chosen.num_stages,
            "The gradient part of the step",
            chosen.block_cuts,
            chosen.stage_layers,
        )
        return plan_from_staged(
            staged,
            out_tree,
            num_param_leaves=num_param_leaves,
            microbatch_size=microbatch_size,
            options=chosen,
            param_specs=None if layouts is None else layouts.state,
            result_specs=None if layouts is None else layouts.results,
            rematerialize=remat,
            stage_layers=layers,
        )

    return within_budget(make_plan, options, arguments)


def _argument_bytes(args: tuple[Any, ...], plan: PipelinePlan) -> list[int]:
    """:func:`argument_bytes` of a step's ``args`` (the state, then the batch)."""
    *state, batch = args
    return argument_bytes(plan, tuple(state), batch)


def _step_memory(
    plan: PipelinePlan, parts: tuple[UpdateProgram, ...], args: tuple[Any, ...]
) -> MemoryEstimate:
    """``plan``'s memory for a step of ``args`` (the caller's arrays where they lie,
    :func:`argument_bytes`), with the update after it (:func:`update_phase`). The leaves
    the update reads from host memory (:func:`offloaded_inputs`) count there, where
    they lie between steps, whatever the first step's arrays: twice (the old and the
    new, during the update)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    host: dict[int, int] = {}
    for i in offloaded_inputs(parts):
        struct = jax.ShapeDtypeStruct(np.shape(leaves[i]), jax.numpy.result_type(leaves[i]))
        leaves[i] = struct  # no device's: it lies in host memory between steps
        for worker in {p.worker for p in parts if i in p.inputs}:
            host[worker] = host.get(worker, 0) + 2 * struct.size * struct.dtype.itemsize
    args = treedef.unflatten(leaves)
    estimate = plan_memory(plan, _argument_bytes(args, plan))
    for worker, (update, arrays) in update_phase(plan, parts, len(leaves), leaves).items():
        estimate = with_update(estimate, worker, update, arrays)
    for worker, size in host.items():
        estimate = with_host(estimate, worker, size)
    return estimate


def pipeline_train_step(
    step_fn: Callable[..., Any],
    *,
    num_stages: int | None = None,
    num_microbatches: int,
    schedule: str | Schedule = "1f1b",
    devices: Sequence[Any] | None = None,
    loss_reduction: str = "mean",
    timeout_s: float | None = 120.0,
    block_cuts: str = "prefer",
    mesh: Any = None,
    param_specs: Any = None,
    stage_axis: str = "stage",
    data_axis: str = "data",
    gather_results: bool = True,
    recompute_residuals: bool = True,
    dispatch_ahead: int | None = 2,
    fuse_actions: int = 2,
    fuse_min_uses: int | None = None,
    memory_budget: int | None = None,
    microbatches_in_flight: int | None = None,
    stage_layers: Sequence[int] | None = None,
    fsdp_gather: str | None = None,
    reduce_gradients: str = "after_stage",
    donate: bool = False,
    offload: str | None = None,
) -> PipelinedStep:
    """A training step ``step_fn(*state, batch)`` whose gradients are computed as a
    pipeline and then applied once.

    ``step_fn`` computes gradients with ``jax.grad``/``jax.value_and_grad`` of a loss
    whose layers are marked, marks them with :func:`pipemark.mark_gradient`, and updates
    (see :func:`pipemark.examples.train_step`); a ``jax.jit`` step is inlined first,
    as :func:`pipemark.split` inlines it. It is cut at the grad marker with
    :func:`pipemark.passes.split_at_gradient`: the part before runs as a pipeline over
    ``num_microbatches`` microbatches of ``batch`` (its last argument), every value it
    hands to the update (the gradients, the loss) averaged over microbatches (or added,
    with ``loss_reduction="sum"``); the part after runs once, per stage where the
    stage's parameters live (each device its own stages' new parameters and optimizer
    state; values that couple the stages, such as each device's share of a global
    norm, are small and exchanged: :mod:`pipemark.runtime.training.update`; on sub-meshes,
    ``mesh=``, each stage's sub-mesh, its parameters laid out by ``param_specs``, a
    pytree prefix of the arguments but the batch, or by their own sharding), or, where
    a big value couples two stages, whole on the first stage's device or sub-mesh.

    Under ``jax.distributed`` with ``gather_results=False`` each process runs the
    update's parts of its own slots, from its own stages' gradients (never sent to
    another process) and its own parameters and optimizer state; the small coupled
    values cross processes with the pipeline's transfers, and the results another
    process computed are arrays of the global program this process does not hold (as
    :func:`pipeline_value_and_grad` returns them; a result no stage owns, such as Adam's
    step count or a global norm returned as a metric, goes to every process). With
    ``gather_results=True`` (the default), and where the update does not split, every
    process receives every gradient and runs the whole update on its first slot, so
    every process gets the whole new state. A stage whose sub-mesh spans processes
    needs ``gather_results=False``: its part of the update runs as a global program
    over the sub-mesh in each of its processes, its new parameters and optimizer state
    staying there as arrays of the global program; an update whose part on one stage
    reads a value another stage computes (global-norm clipping) is refused there. The other options are those of :func:`pipeline_value_and_grad`.

    ``donate=True`` donates the step's state (its arguments but the batch) to the
    update, as ``jax.jit(step, donate_argnums=...)`` donates it: each parameter and
    leaf of the optimizer state that the update replaces with a result of its shape
    and dtype is deleted, its new value written in its buffer, so that the update no
    longer holds the old state and the new at once (:meth:`PipelinedStep.memory`
    counts it); read the returned state, not the arrays passed in. A donating step
    waits for the pipeline's results before its update, so that a stage failing on its
    device raises with the state intact; one failing in the update may have deleted
    it (docs/training.md, "Donating the state"). ``False`` (the default) leaves the
    arrays passed in unchanged. Either way the update writes its results into the
    gradients' buffers where it can (they are the call's own).

    ``offload="optimizer"`` keeps the optimizer state (the state's leaves that no stage
    reads, only the update) in the devices' host memory kind between steps
    (``pinned_host``): each part of the update brings its leaves to its device, and
    writes their new values back to host memory; ``"params"`` the parameters, each
    slot bringing its own in for the call; ``"params+optimizer"`` both. The step must return its new state
    first, laid out as its arguments but the batch. A backend without a host memory
    kind raises :class:`~pipemark.errors.HostMemoryError` (docs/training.md,
    "Offloading to host memory").

    >>> import jax, numpy as np, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, batch=4)
    >>> step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    >>> state = init_state(ex.params)
    >>> pipelined = pm.pipeline_train_step(step, num_stages=1, num_microbatches=2)
    >>> new_params, new_state, loss = pipelined(ex.params, state, ex.batch)
    >>> bool(np.allclose(loss, step(ex.params, state, ex.batch)[2], rtol=1e-5))
    True
    """
    if not callable(step_fn):
        raise PipemarkError(
            f"pipeline_train_step: step_fn must be callable, got {type(step_fn).__name__}."
        )
    options = PipelineOptions(
        num_microbatches=num_microbatches,
        num_stages=num_stages,
        schedule=schedule,
        devices=devices,
        loss_reduction=loss_reduction,
        timeout_s=timeout_s,
        block_cuts=block_cuts,
        mesh=mesh,
        param_specs=param_specs,
        stage_axis=stage_axis,
        data_axis=data_axis,
        gather_results=gather_results,
        recompute_residuals=recompute_residuals,
        dispatch_ahead=dispatch_ahead,
        fuse_actions=fuse_actions,
        fuse_min_uses=fuse_min_uses,
        memory_budget=memory_budget,
        microbatches_in_flight=microbatches_in_flight,
        stage_layers=stage_layers,
        fsdp_gather=fsdp_gather,
        reduce_gradients=reduce_gradients,
    )
    return PipelinedStep(step_fn, options, donate, offload)
