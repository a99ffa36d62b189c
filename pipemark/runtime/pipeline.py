"""The pipeline API: :func:`pipeline_value_and_grad` (here) and
:func:`~pipemark.runtime.train_step.pipeline_train_step` (a training step whose gradient
part is such a pipeline) run a loss function's forward and backward stages on several
devices, microbatch by microbatch, following a pipeline schedule.

How a call runs:

1. **Trace once per input shape.** ``loss_fn`` is traced once for *one microbatch*
   (the batch's leading axis divided by ``num_microbatches``), and ``value_and_grad``
   of that traced program is staged (:mod:`pipemark.runtime.plan`). Stage markers
   in ``loss_fn`` (start/end pairs, or boundary markers turned into layers) give forward
   stages and, through the marker's transpose rule, mirrored ``<name>_backward`` stages.
   Without markers, :func:`pipemark.passes.auto.auto_layers` cuts the program into
   ``num_stages`` balanced layers. The program is staged by
   :func:`pipemark.split_jaxpr`, so it is cut, named and its backward routed as
   :func:`pipemark.split` does (:mod:`pipemark.runtime.plan`).
2. **Slice** with :func:`pipemark.passes.slice_stages`. Pipeline stage ``k`` is forward
   stage ``k`` with its mirrored backward stage; both run on the same device, so the
   residuals the backward reads (activations saved by the forward) never move.
3. **Compile** each stage program once with ``jax.jit`` for its device. The compiled
   program also adds the stage's share of the result (the loss, the gradients) into an
   accumulator that stays on the device. Where a device runs a forward and then, for
   the same microbatch, the backward of the same stage, and nothing else reads the
   forward's outputs (one stage; the last stage of 1F1B), the two are compiled into one
   program (:func:`pipemark.runtime.devices.steps.fuse_steps`): the residuals never leave it.
4. **Dispatch** (:func:`pipemark.runtime.execution.run_plan`): one worker thread per
   device walks its device's column of the schedule, and values move between devices
   as soon as they are dispatched; the module's docstring says how.

**Sum or mean.** With ``loss_reduction="mean"`` (the default) the microbatch results are
averaged: a loss that is a mean over the batch (``jnp.mean``) has, for equal microbatches,
``loss(batch) = mean_m loss(microbatch_m)`` and, by linearity of the derivative, the
same for the gradients. With ``loss_reduction="sum"`` they are added, which is right
for a loss summed over the batch (a term that does not read the batch, like weight
decay, is counted once: :func:`pipemark.runtime.losses.count_batch_free_terms_once`).
A loss that is neither (normalised by something that
depends on the whole batch, batch statistics) cannot be split into microbatches.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pipemark.errors import PipemarkError
from pipemark.exported import ExportedStages
from pipemark.mutation import call_watching_arguments
from pipemark.runtime.arguments import (
    PartitionedParams,
    batch_arg_names,
    check_batch_args,
    partition_params,
)
from pipemark.runtime.calls import (
    record_holders,
    restore_target,
    shape_key,
    shared_params_here,
    traced_call,
)
from pipemark.runtime.devices.placement import leaf_specs
from pipemark.runtime.execution.plan_export import export_plan, leaf_names
from pipemark.runtime.execution.run import action_costs, run_plan
from pipemark.runtime.losses import LOSS_REDUCTIONS, split_count
from pipemark.runtime.memory.budget import within_budget
from pipemark.runtime.memory.estimate import MemoryEstimate, argument_bytes, plan_memory
from pipemark.runtime.memory.programs import compiled_programs
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.plan import PipelinePlan, build_plan
from pipemark.runtime.schedules.core import Schedule
from pipemark.runtime.training.keeping import stage_readers

__all__ = ["LOSS_REDUCTIONS", "Pipeline", "pipeline_value_and_grad"]


class Pipeline:
    """``(params, *batch) -> (loss, grads)`` computed as a pipeline; made by
    :func:`pipeline_value_and_grad`.

    The first call for a given input structure and shape traces, slices and compiles
    (:meth:`plan` does only that); later calls reuse the compiled stages.
    """

    def __init__(self, loss_fn: Callable, options: PipelineOptions) -> None:
        self.loss_fn = loss_fn
        self.options = options
        self._plans: dict[Any, PipelinePlan] = {}
        self._losses: dict[Any, tuple[Callable, Callable | None]] = {}

    def _key(self, params: Any, batch: Any) -> Any:
        key = shape_key((params, batch))
        if self.options.mesh is not None and self.options.param_specs is None:
            # The parameters' own shardings lay them out on the sub-meshes.
            specs = leaf_specs(None, params, self.options.stage_axis)
            return (*key, tuple(map(str, specs)))
        return key

    def _bind(self, params: Any, batch_args: tuple) -> tuple[Any, Any, Any, Any]:
        """``(key, dynamic params, batch, part)``: the params' arrays, the batch (one
        argument, or a tuple of several), and the loss over them for this static part."""
        if not batch_args:
            raise PipemarkError(
                "The pipeline takes loss_fn's arguments: (params, batch, ...); no batch "
                "argument was given."
            )
        if len(batch_args) > 1:
            names = batch_arg_names(self.loss_fn, len(batch_args))
            check_batch_args(names, batch_args, self.options.num_microbatches)
        part = partition_params(params)
        batch = batch_args[0] if len(batch_args) == 1 else tuple(batch_args)
        key = (part.key, len(batch_args))
        if key not in self._losses:
            self._losses[key] = self._make_losses(part, len(batch_args))
        return key, part.dynamic, batch, part

    def _make_losses(self, part: PartitionedParams, num_batch: int):
        """The loss the plan differentiates (of the params' arrays and the batch) and,
        for ``"sum_over_count"``, the count over a whole batch."""
        loss_fn = self.loss_fn

        def full(dynamic: Any, batch: Any) -> Any:
            args = (
                (part.combine(dynamic), *batch) if num_batch > 1 else (part.combine(dynamic), batch)
            )
            return call_watching_arguments(loss_fn, args)

        if self.options.loss_reduction != "sum_over_count":
            return full, None
        # Under jit XLA drops whatever the count does not need (the model itself).
        count = jax.jit(lambda dynamic, batch: split_count(full(dynamic, batch))[1])
        return (lambda dynamic, batch: split_count(full(dynamic, batch))[0]), count

    def plan(self, params: Any, *batch: Any) -> PipelinePlan:
        """Trace, slice, schedule and compile for inputs shaped like these (cached)."""
        key, dynamic, batch, _ = self._bind(params, batch)
        return self._plan(key, dynamic, batch)

    def _plan(self, key: Any, dynamic: Any, batch: Any) -> PipelinePlan:
        full_key = (key, self._key(dynamic, batch))
        plan = self._plans.get(full_key)
        if plan is None:
            options = self.options
            if options.loss_reduction == "sum_over_count":
                # The plan adds the sums; the call divides by the whole batch's count.
                options = dataclasses.replace(options, loss_reduction="sum")
            loss = self._losses[key][0]
            plan = self._plans[full_key] = within_budget(
                lambda chosen, remat: build_plan(loss, dynamic, batch, chosen, remat),
                options,
                lambda plan: argument_bytes(plan, dynamic, batch),
            )
        return plan

    def _call(self, params: Any, batch_args: tuple, timings: dict | None) -> tuple[Any, Any]:
        key, dynamic, batch, _ = self._bind(params, batch_args)
        plan = self._plan(key, dynamic, batch)
        dynamic = shared_params_here(plan, dynamic)
        result = run_plan(plan, dynamic, batch, timings)
        count_fn = self._losses[key][1]
        if count_fn is not None:
            count = count_fn(dynamic, batch)
            result = jax.tree_util.tree_map(lambda x: x / count, result)
        record_holders(plan, jax.tree_util.tree_leaves(result), plan.result_holders())
        return result

    def __call__(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        return self._call(params, batch, None)

    def abstract_params(self, params: Any, *batch: Any) -> Any:
        """``params`` as ``jax.ShapeDtypeStruct`` s laid out where this pipeline keeps
        each leaf (:mod:`pipemark.runtime.training.keeping`): on the slot whose stages read it,
        under ``jax.distributed`` on another process's slot where only that process's
        stages read it. The target to restore a checkpoint to
        (``orbax.checkpoint.args.StandardRestore(pipe.abstract_params(params, batch))``),
        on this layout or another. Leaves that are not arrays stay as they are.

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> ex = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=2)
        >>> abstract = pipe.abstract_params(ex.params, ex.batch)
        >>> leaf = jax.tree_util.tree_leaves(abstract)[0]
        >>> leaf.shape == ex.params[0][0].shape, leaf.sharding.device_set == {jax.devices()[0]}
        (True, True)
        """
        key, dynamic, batch_tree, part = self._bind(params, batch)
        plan = self._plan(key, dynamic, batch_tree)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        target = restore_target(plan, leaves, stage_readers(plan, len(leaves)))
        return part.combine(treedef.unflatten(target))

    def timed_call(self, params: Any, *batch: Any) -> tuple[tuple[Any, Any], dict[str, float]]:
        """Like calling the pipeline, and also return timings: ``dispatch_s`` (wall time
        to walk the schedule; it includes the computation only where a worker waited
        for it: programs that XLA runs inline, on the dispatching thread), ``host_s``
        (host time spent placing inputs, dispatching and publishing, summed over the
        workers, without the waits for other devices), in one process also
        ``host_cpu_s`` (the same in CPU time of the walking threads: without the time
        they lost to other threads, such as those computing on CPU devices),
        ``num_actions`` (the schedule's), ``num_programs`` (the programs dispatched:
        fewer where a forward and its backward run as one program), ``num_ticks``,
        and ``values_left`` / ``peak_values`` (values handed between stages still held
        after the call, which is 0, and the most held at once), ``bytes_copied`` (bytes
        of the values copied between this process's slots). Under
        ``jax.distributed`` also ``bytes_sent`` / ``bytes_received`` (between this
        process's stages and other processes'), ``bytes_gathered`` (the results of
        other processes' stages it received at the end) and ``transfer_s`` (time this
        process waited for its transfers)."""
        timings: dict[str, float] = {}
        out = self._call(params, batch, timings)
        return out, timings

    def action_costs(
        self, params: Any, *batch: Any, repeat: int = 3
    ) -> dict[str, tuple[float, ...]]:
        """Measured costs of this pipeline's actions, for :func:`pipemark.simulate_schedule`
        and :func:`pipemark.runtime.zero_bubble_schedule`: ``{"forward": (seconds per stage),
        "backward": ..., "weight": ...}``, each action run alone on its device and waited
        for (median of ``repeat`` walks of every microbatch). Measure with
        ``schedule="zb-h1"`` to get B and W apart; otherwise ``"backward"`` is the whole
        backward and ``"weight"`` is 0.

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(
        ...     loss_fn, num_stages=1, num_microbatches=2, schedule="zb-h1")
        >>> costs = pipe.action_costs(params, batch)
        >>> sorted(costs), len(costs["forward"])
        (['backward', 'forward', 'weight'], 1)
        >>> sim = pm.simulate_schedule(pipe.plan(params, batch).schedule, costs)
        >>> bool(sim.makespan > 0)
        True
        """
        key, dynamic, data, _ = self._bind(params, batch)
        return action_costs(self._plan(key, dynamic, data), dynamic, data, repeat)

    def compiled_programs(self, params: Any, *batch: Any) -> dict[str, jax.stages.Compiled]:
        """The XLA programs a call with inputs like these dispatches, compiled, by stage
        name (``"<forward>+<backward>"`` for a fused pair): read each one's
        ``memory_analysis()`` (temporary, argument and output bytes) or
        ``cost_analysis()``. After a call, JAX's caches give back the programs the call
        compiled; see :func:`pipemark.runtime.memory.programs.compiled_programs`.

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=1, num_microbatches=1)
        >>> programs = pipe.compiled_programs(params, batch)
        >>> list(programs)  # one stage, its forward and backward fused into one program
        ['stage0+stage0_backward']
        >>> programs["stage0+stage0_backward"].memory_analysis().output_size_in_bytes > 0
        True
        """
        return compiled_programs(self.plan(params, *batch))

    def memory(self, params: Any, *batch: Any) -> MemoryEstimate:
        """What a call with inputs like these holds on each device slot, predicted from
        the plan and its compiled programs: parameters, batch, accumulators, the values
        handed between stages that the schedule keeps in flight at once, the largest
        program temporaries, and their sum, next to the device's measured peak where it
        keeps one (see :mod:`pipemark.runtime.memory`). ``print`` it for a table.

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2,
        ...                                   devices=jax.devices()[:2])
        >>> slots = pipe.memory(params, batch).slots
        >>> all(s.predicted_peak >= s.parameters + s.accumulators > 0 for s in slots)
        True
        """
        key, dynamic, batch, _ = self._bind(params, batch)
        plan = self._plan(key, dynamic, batch)
        return plan_memory(plan, argument_bytes(plan, dynamic, batch))

    def trace(self, params: Any, *batch: Any, path: str | os.PathLike | None = None) -> dict:
        """One call with inputs like these, traced: a Chrome / Perfetto trace (JSON
        trace events) with a track per device slot, a slice per action (named
        ``"<stage> mb<microbatch>"``) and an arrow per value handed between slots,
        written to ``path`` when given, and returned. A first call compiles (not
        traced); in the traced one each action is waited for, so its slice is its own
        time on its device (see :mod:`pipemark.runtime.execution.perfetto`). The actions also
        carry these names in a ``jax.profiler`` trace of any call.

        >>> import jax, pipemark as pm
        >>> from pipemark import examples
        >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2,
        ...                                   devices=jax.devices()[:2])
        >>> events = pipe.trace(params, batch)["traceEvents"]
        >>> sorted(e["name"] for e in events if e["ph"] == "X" and e["tid"] == 1)
        ['layer1+layer1_backward mb0', 'layer1+layer1_backward mb1']
        """
        key, dynamic, data, _ = self._bind(params, batch)
        return traced_call(self._plan(key, dynamic, data), dynamic, data, path)

    def export(self, directory: str | os.PathLike, params: Any, *batch: Any) -> ExportedStages:
        """Write the programs a call with inputs like these runs, and its schedule, to
        ``directory`` (:mod:`pipemark.runtime.execution.plan_export`; ``docs/export.md``): a
        callable of the parameters' array leaves and the whole batch's leaves (flat, in
        JAX's order) returning the flat ``(loss, grads)`` leaves, computed by the same
        programs in the same order as a call, which :func:`pipemark.load_staged` reads
        back in any process. For stages on single devices (``devices=``) in one process.

        >>> import tempfile, jax, pipemark as pm
        >>> from pipemark import examples
        >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
        >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=1, num_microbatches=2)
        >>> exported = pipe.export(tempfile.mkdtemp(), params, batch)
        >>> exported.input_names[0], exported.output_names[:2]
        ('params[0][0]', ('result[0]', 'result[1][0][0]'))
        """
        if self.options.loss_reduction == "sum_over_count":
            raise PipemarkError(
                "Export covers loss_reduction 'mean' and 'sum': with 'sum_over_count' a "
                "call divides by a count computed apart from the pipeline's programs."
            )
        key, dynamic, data, _ = self._bind(params, batch)
        plan = self._plan(key, dynamic, data)
        results = jax.tree_util.tree_unflatten(plan.out_tree, range(plan.out_tree.num_leaves))
        return export_plan(
            plan,
            directory,
            input_names=leaf_names("params", dynamic) + leaf_names("batch", data),
            output_names=leaf_names("result", results),
        )


def pipeline_value_and_grad(
    loss_fn: Callable[[Any, Any], Any],
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
) -> Pipeline:
    """``jax.value_and_grad(loss_fn)`` computed as a pipeline over several devices.

    Parameters
    ----------
    loss_fn:
        ``loss_fn(params, *batch)`` returning a scalar loss; gradients are taken with
        respect to ``params`` (its array leaves: other leaves, like an equinox
        module's functions, are static and get ``None`` gradients, as with
        ``eqx.filter_value_and_grad``). Each batch argument is split into microbatches
        along its leading axis. Its layers are marked with :func:`pipemark.mark`
        start/end pairs or :func:`pipemark.mark_pipeline_boundary`; without markers,
        ``num_stages`` cuts it automatically.
    num_stages:
        How many pipeline stages. ``None``: one per marked stage. Fewer than the
        marked stages: consecutive marked stages are merged. Without markers: balanced
        automatically (:func:`pipemark.passes.auto.auto_layers`).
    num_microbatches:
        How many microbatches the batch's leading axis is split into.
    schedule:
        ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"`` (several stages per device:
        ``num_stages`` a multiple of the number of devices), the zero-bubble ``"zb-h1"``
        and ``"zb-v"`` (each backward split into B and W by
        :func:`pipemark.passes.split_backward`; ZB-V puts two stages on each device),
        another name registered with :func:`pipemark.runtime.register_schedule` (all
        are in :data:`pipemark.runtime.SCHEDULES`), or a
        :class:`~pipemark.runtime.schedules.Schedule`.
    devices:
        The devices to use; default ``jax.devices()``. Pipeline stage ``i`` runs on
        ``devices[i]`` (on ``devices[i % len(devices)]`` when interleaved). Under
        ``jax.distributed`` these may be devices of several processes (``jax.devices()``
        is all of them): every process makes the same pipeline and calls it with the
        same arguments, runs only its own devices' stages, and values move between
        processes point to point; every process gets the whole result (see
        ``gather_results``).
    loss_reduction:
        ``"mean"`` (default) averages the microbatch losses and gradients, right for a
        loss that is a mean over the batch; ``"sum"`` adds them, right for a sum;
        ``"sum_over_count"`` takes a loss returning ``(sum, count)`` and divides the
        sums over the whole batch by the whole batch's count: a masked or weighted
        mean (see :mod:`pipemark.runtime.losses`). With ``"mean"``, a loss divided by a
        count computed from the batch is refused, naming the division.
    timeout_s:
        Under ``jax.distributed``: how long a process waits for a value from another
        before it stops with an error naming the stage and the process (``None``:
        for ever).
    block_cuts:
        Without markers: cut between the model's repeated blocks when that costs
        little balance (``"prefer"``), always (``"require"``) or anywhere (``"off"``);
        see :func:`pipemark.passes.auto_layers`.
    mesh:
        Stages on sub-meshes (instead of ``devices``): a ``jax.sharding.Mesh`` with a
        ``stage_axis`` (e.g. axes ``("stage", "data", "model")``), each position along
        it one device slot, or a list of meshes, one per slot. Each stage runs as an
        SPMD program over its sub-mesh: the model's ``with_sharding_constraint``
        annotations apply there, each microbatch is split into data-parallel replicas
        along ``data_axis`` and the gradients are reduced over it once per call
        (:mod:`pipemark.runtime.devices.sharding`; docs: "Stages on sub-meshes").
    param_specs:
        With ``mesh``: a ``PartitionSpec`` per parameter (a pytree prefix of
        ``params``; ``None``: replicated) over the sub-mesh's axes; by default each
        parameter's own ``NamedSharding`` spec. Gradients come back with the same
        layout on their stage's sub-mesh. A spec may name ``data_axis``
        (``P("data", None)``, FSDP): each device then holds a shard of the parameter,
        the stages gather it (``fsdp_gather``) and its gradient is reduce-scattered
        into the same shards.
    stage_axis, data_axis:
        With ``mesh``: the names of its stage and data-parallel axes.
    fsdp_gather:
        How a stage gathers its parameters sharded over ``data_axis``: ``"once"`` per
        call, before its first microbatch, every microbatch reading that copy (and
        accumulating whole gradients per replica, reduce-scattered once per call), or
        ``"per_microbatch"``, inside each stage program, which also reduce-scatters its
        microbatch's gradients (less memory, more collectives). ``None`` (default):
        ``"once"``, unless a ``memory_budget`` is not met with it.
    reduce_gradients:
        With data-parallel replicas: ``"after_stage"`` (default) reduces each stage's
        gradients over them right after the stage's last action, while the other
        stages still compute; ``"end_of_call"`` reduces every stage's after the
        call's last action (see :class:`~pipemark.runtime.PipelineOptions`).
    gather_results:
        Under ``jax.distributed``: ``False`` leaves each result with the process whose
        stage computed it (the others get arrays of the global program they do not
        hold, as ``jax.jit`` returns); ``True`` (default) sends every result to every
        process.
    recompute_residuals:
        ``True`` (default): each backward stage recomputes the residuals that are cheap
        to recompute (casts, elementwise functions, masks, broadcasts) from the fewest
        bytes its forward hands over, a minimum cut
        (:func:`pipemark.passes.recompute_residuals`): less memory held per microbatch
        in flight and less written and read between the two programs. ``False``: the
        forward hands over every residual ``jax.vjp`` keeps.
    dispatch_ahead:
        How many of a device's actions may be dispatched and not yet computed (default
        2; ``None``: no bound). Unbounded, the host runs the whole schedule ahead of
        the device, and the results of every dispatched program take device memory at
        once: every microbatch's residuals, whatever the schedule keeps in flight.
        A fused run of actions (``fuse_actions``) counts as one.
    fuse_actions:
        At most this many consecutive actions of a device run as one program where no
        other device waits for the ones before the last (default 2, where the runs'
        program is shared, ``fuse_min_uses``; 1: each action its own program). With
        many stages on a device (all on one, or an interleaved
        schedule's), fewer programs to dispatch, each with a fixed host cost; each
        distinct run is one more program to compile. See
        :class:`~pipemark.runtime.PipelineOptions`.
    fuse_min_uses:
        Fuse a run only where its program runs at least this many times a call
        (``None``: twice ``num_microbatches``, the runs of identical blocks' stages;
        1: every run). See :class:`~pipemark.runtime.PipelineOptions`.
    memory_budget:
        Bytes each device may hold, as :meth:`Pipeline.memory` predicts it (``None``:
        no limit). The plan then keeps fewer microbatches in flight, rematerialises
        forward stages and moves marked layers between stages until every device
        fits, or raises
        :class:`~pipemark.MemoryBudgetError` saying by how much it cannot
        (:mod:`pipemark.runtime.memory.budget`).
    microbatches_in_flight:
        At most this many microbatches in the pipeline at once (``None``: as many as
        the schedule keeps): the schedule runs in waves of this many microbatches, one
        after another, each device holding the residuals of at most that many (less
        memory; on several devices each wave fills and drains the pipeline).
    stage_layers:
        For a program marked with more layers than ``num_stages``: how many
        consecutive marked layers each stage gets, e.g. ``(3, 5)`` for 8 layers in 2
        stages (``None``: about equal equation counts). The plan's
        ``stage_layers`` says what it used.

    Returns
    -------
    Pipeline
        A function ``(params, *batch) -> (loss, grads)`` equal to
        ``jax.value_and_grad(loss_fn)(params, *batch)`` up to float rounding. Each
        gradient stays on the device of the stage that computed it.

    Raises
    ------
    PipemarkError
        When the batch does not split into ``num_microbatches`` equal parts, there are
        more stages than devices, ``loss_fn`` does not return a scalar, or no markers and
        no ``num_stages`` say where to cut.

    Examples
    --------
    >>> import jax, numpy as np, pipemark as pm
    >>> from pipemark import examples
    >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
    >>> step = pm.pipeline_value_and_grad(loss_fn, num_stages=1, num_microbatches=2)
    >>> loss, grads = step(params, batch)
    >>> want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    >>> bool(np.allclose(loss, want_loss, rtol=1e-5))
    True
    """
    if not callable(loss_fn):
        raise PipemarkError(
            f"pipeline_value_and_grad: loss_fn must be callable, got {type(loss_fn).__name__}."
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
    return Pipeline(loss_fn, options)
