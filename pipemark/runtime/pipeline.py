"""The pipeline API: :func:`pipeline_value_and_grad` and :func:`pipeline_train_step`
run a loss function's forward and backward stages on several devices, microbatch by
microbatch, following a pipeline schedule.

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
   program (:func:`pipemark.runtime.steps.fuse_steps`): the residuals never leave it.
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from pipemark.errors import PipemarkError
from pipemark.exported import ExportedStages
from pipemark.mutation import call_watching_arguments
from pipemark.passes.gradient import split_at_gradient
from pipemark.passes.inline import inline_calls
from pipemark.runtime.arguments import (
    PartitionedParams,
    batch_arg_names,
    check_batch_args,
    partition_params,
)
from pipemark.runtime.budget import PlanMaker, check_update_within, plan_within_budget
from pipemark.runtime.execution import action_costs, run_plan
from pipemark.runtime.losses import LOSS_REDUCTIONS, count_batch_free_terms_once, split_count
from pipemark.runtime.memory import MemoryEstimate, plan_memory, with_update
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.perfetto import trace_events, write_trace
from pipemark.runtime.pipeline_stages import stage_program
from pipemark.runtime.placement import Slot, device_slot, held_elsewhere, leaf_specs
from pipemark.runtime.plan import PipelinePlan, build_plan, plan_from_staged
from pipemark.runtime.plan_export import export_plan, export_train_step, leaf_names
from pipemark.runtime.programs import compiled_programs
from pipemark.runtime.schedules import Schedule
from pipemark.runtime.tracing import replica_batch
from pipemark.runtime.transport import CollectiveTransport, Transport
from pipemark.runtime.update import StageUpdates, UpdatePart, input_owners, split_update

__all__ = [
    "LOSS_REDUCTIONS",
    "Pipeline",
    "PipelinePlan",
    "PipelinedStep",
    "pipeline_value_and_grad",
    "pipeline_train_step",
]


# ------------------------------------------------------------------------ public


def _shape_key(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], np.dtype], ...]]:
    """What a plan is built for: the tree's structure and each leaf's shape and dtype
    as JAX would trace it. Computed on every call: an array's own shape and dtype
    (``jnp.result_type`` costs about 15 µs a leaf), others through JAX's rules."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    types = []
    for x in leaves:
        if isinstance(x, (jax.Array, np.ndarray)):
            types.append((x.shape, jax.dtypes.canonicalize_dtype(x.dtype)))
        else:  # a Python or NumPy scalar: its dtype is JAX's choice
            types.append((np.shape(x), np.dtype(jnp.result_type(x))))
    return structure, tuple(types)


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
        key = _shape_key((params, batch))
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
                lambda chosen, remat: build_plan(loss, dynamic, batch, chosen, remat), options
            )
        return plan

    def _call(self, params: Any, batch_args: tuple, timings: dict | None) -> tuple[Any, Any]:
        key, dynamic, batch, _ = self._bind(params, batch_args)
        loss, grads = run_plan(self._plan(key, dynamic, batch), dynamic, batch, timings)
        count_fn = self._losses[key][1]
        if count_fn is None:
            return loss, grads
        count = count_fn(dynamic, batch)
        return loss / count, jax.tree_util.tree_map(lambda g: g / count, grads)

    def __call__(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        return self._call(params, batch, None)

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
        and :func:`pipemark.zero_bubble_schedule`: ``{"forward": (seconds per stage),
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
        compiled; see :func:`pipemark.runtime.programs.compiled_programs`.

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
        return plan_memory(self.plan(params, *batch))

    def trace(self, params: Any, *batch: Any, path: str | os.PathLike | None = None) -> dict:
        """One call with inputs like these, traced: a Chrome / Perfetto trace (JSON
        trace events) with a track per device slot, a slice per action (named
        ``"<stage> mb<microbatch>"``) and an arrow per value handed between slots,
        written to ``path`` when given, and returned. A first call compiles (not
        traced); in the traced one each action is waited for, so its slice is its own
        time on its device (see :mod:`pipemark.runtime.perfetto`). The actions also
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
        return _traced_call(self._plan(key, dynamic, data), dynamic, data, path)

    def export(self, directory: str | os.PathLike, params: Any, *batch: Any) -> ExportedStages:
        """Write the programs a call with inputs like these runs, and its schedule, to
        ``directory`` (:mod:`pipemark.runtime.plan_export`; ``docs/export.md``): a
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


def within_budget(make_plan: PlanMaker, options: PipelineOptions) -> PipelinePlan:
    """``make_plan(options, frozenset())``, or with a ``memory_budget``, the plan
    within it (:func:`pipemark.runtime.budget.plan_within_budget`)."""
    if options.memory_budget is None:
        return make_plan(options, frozenset())
    return plan_within_budget(make_plan, options)


def _traced_call(plan: PipelinePlan, params: Any, batch: Any, path: Any) -> dict:
    """A warm-up call of ``plan``, then one recorded, as a trace (written to ``path``)."""
    jax.block_until_ready(run_plan(plan, params, batch, None))
    records: list = []
    jax.block_until_ready(run_plan(plan, params, batch, None, records=records))
    trace = trace_events(plan, records)
    if path is not None:
        write_trace(path, trace)
    return trace


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
    memory_budget: int | None = None,
    microbatches_in_flight: int | None = None,
    stage_layers: Sequence[int] | None = None,
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
        (:mod:`pipemark.runtime.sharding`; docs: "Stages on sub-meshes").
    param_specs:
        With ``mesh``: a ``PartitionSpec`` per parameter (a pytree prefix of
        ``params``; ``None``: replicated) over the sub-mesh's axes; by default each
        parameter's own ``NamedSharding`` spec. Gradients come back with the same
        layout on their stage's sub-mesh.
    stage_axis, data_axis:
        With ``mesh``: the names of its stage and data-parallel axes.
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
    memory_budget:
        Bytes each device may hold, as :meth:`Pipeline.memory` predicts it (``None``:
        no limit). The plan then keeps fewer microbatches in flight, rematerialises
        forward stages and moves marked layers between stages until every device
        fits, or raises
        :class:`~pipemark.MemoryBudgetError` saying by how much it cannot
        (:mod:`pipemark.runtime.budget`).
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
        memory_budget=memory_budget,
        microbatches_in_flight=microbatches_in_flight,
        stage_layers=stage_layers,
    )
    return Pipeline(loss_fn, options)


# ------------------------------------------------------------------ training step


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

    def __init__(self, step_fn: Callable, options: PipelineOptions) -> None:
        self.step_fn = step_fn
        self.options = options
        self._prepared: dict[Any, tuple[PipelinePlan, Callable, Any]] = {}

    def plan(self, *args: Any) -> PipelinePlan:
        """The pipeline plan of the gradient part, for arguments shaped like these."""
        return self._prepare(args)[0]

    def _prepare(self, args: tuple[Any, ...]) -> _Prepared:
        if not args:
            raise PipemarkError(
                "A pipelined training step needs at least the batch argument (the last one)."
            )
        key = _shape_key(args)
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        *replicated, batch = args
        options = self.options
        batch_structs, micro, replicas = replica_batch(batch, options)
        # The gradient part is traced for one microbatch (it runs per microbatch); the
        # update is traced for the whole batch (it runs once, and may read the batch).
        try:
            compute, _, _ = _trace_step(self.step_fn, (*replicated, batch_structs))
        except PipemarkError:
            raise
        except (TypeError, ValueError) as error:  # JAX's own, e.g. shapes that disagree
            _refuse_unsplit_batch(replicated, batch, error)
            raise
        compute_full, apply, out_shape = _trace_step(self.step_fn, args)
        _check_accumulable(compute, compute_full)
        num_replicated = len(jax.tree_util.tree_leaves(tuple(replicated)))
        if options.loss_reduction == "sum":
            # What does not read the batch (weight decay's gradient) counts once.
            compute = count_batch_free_terms_once(
                compute, num_replicated, options.num_microbatches * replicas
            )
        specs = None
        if options.mesh is not None:
            specs = leaf_specs(options.param_specs, tuple(replicated), options.stage_axis)
        plan = _step_plan(compute, options, num_replicated, micro, specs)
        num_args = len(jax.tree_util.tree_leaves(args))
        split = _split(plan, apply, num_args)
        if split is None and not plan.gather_results and plan.placement.distributed:
            # The whole update reads every stage's gradients: they are gathered, as
            # with gather_results=True (every process then runs it).
            options = dataclasses.replace(options, gather_results=True)
            plan = _step_plan(compute, options, num_replicated, micro, specs)
        parts = _update_parts(plan, apply, split)
        if options.memory_budget is not None:
            updates = _update_bytes(plan, parts)
            check_update_within(updates, plan.placement.slots, options.memory_budget)
        out_tree = jax.tree_util.tree_structure(out_shape)
        shared = split.unowned if split is not None and plan.placement.distributed else ()
        prepared = _Prepared(plan, out_tree, parts, _update_holders(plan, num_args), shared)
        self._prepared[key] = prepared
        return prepared

    def action_costs(self, *args: Any, repeat: int = 3) -> dict[str, tuple[float, ...]]:
        """Measured costs of the gradient part's actions, as
        :meth:`Pipeline.action_costs` gives them (the update, run once, is not an action)."""
        plan = self._prepare(args)[0]
        *replicated, batch = args
        return action_costs(plan, tuple(replicated), batch, repeat)

    def memory(self, *args: Any) -> MemoryEstimate:
        """What a step with these arguments holds on each device slot: the gradient
        part as :meth:`Pipeline.memory` predicts it, and the update after it
        (``SlotMemory.update``: each slot's part of it, the largest where a slot runs
        several rounds, or the whole update on the first slot where it does not split;
        its compiled program's arguments, among them the optimizer state and the
        gradients, its results and temporaries; under ``jax.distributed``, of this
        process's slots)."""
        prepared = self._prepare(args)
        return _step_memory(prepared.plan, prepared.parts)

    def trace(self, *args: Any, path: str | os.PathLike | None = None) -> dict:
        """The gradient part of one step with these arguments, traced as
        :meth:`Pipeline.trace` does (the update, run once, is not an action); written to
        ``path`` when given, and returned."""
        plan = self._prepare(args)[0]
        *replicated, batch = args
        return _traced_call(plan, tuple(replicated), batch, path)

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
        prepared = self._prepare(args)
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
        prepared = self._prepare(args)
        plan, out_tree = prepared.plan, prepared.out_tree
        *replicated, batch = args
        accumulated = run_plan(plan, tuple(replicated), batch, timings)
        # The update runs once: each slot its own stages' part, or, where it does not
        # split, whole on the first slot; on a sub-mesh each parameter keeps its layout
        # there. The parts fill one table (StageUpdates): the update's inputs, its
        # results, then the small values slots exchange, each copied to the slots that
        # read it. Under jax.distributed each process runs its own slots' parts (see
        # _update_parts and _run_update).
        values = dict(enumerate([*jax.tree_util.tree_leaves(args), *accumulated]))
        num_inputs = len(values)
        transport = None
        if plan.placement.distributed:
            transport = CollectiveTransport(plan.watchdog, plan.placement.process)
        with jax.set_mesh(None):  # on its slot whatever the caller's mesh (see run_plan)
            _run_update(plan, prepared, values, transport)
        if timings is not None and transport is not None:
            timings["update_bytes_sent"] = transport.bytes_sent
            timings["update_bytes_received"] = transport.bytes_received
        outputs = [values[num_inputs + k] for k in range(out_tree.num_leaves)]
        return jax.tree_util.tree_unflatten(out_tree, outputs)


def _step_plan(
    compute: ClosedJaxpr,
    options: PipelineOptions,
    num_param_leaves: int,
    microbatch_size: int,
    param_specs: Any,
) -> PipelinePlan:
    """The plan of a training step's gradient part ``compute``, cut as ``options`` say
    (again for each plan a memory budget tries), scheduled and compiled."""
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
            param_specs=param_specs,
            rematerialize=remat,
            stage_layers=layers,
        )

    return within_budget(make_plan, options)


def _step_memory(plan: PipelinePlan, parts: tuple[_UpdatePart, ...]) -> MemoryEstimate:
    """``plan``'s memory with the update after it (:func:`_update_bytes`)."""
    estimate = plan_memory(plan)
    for worker, update in _update_bytes(plan, parts).items():
        estimate = with_update(estimate, worker, update)
    return estimate


def _update_bytes(plan: PipelinePlan, parts: tuple[_UpdatePart, ...]) -> dict[int, int]:
    """Per slot of this process that runs a part of the update, what its largest part
    holds: the compiled program's arguments (the optimizer state, the gradients),
    results and temporaries (another process's parts are compiled, and measured,
    there). A slot that runs several parts (values it exchanges with the other slots,
    then its results) holds them one after the other."""
    sizes: dict[int, int] = {}
    for part in parts:
        if not plan.placement.local[part.worker]:
            continue
        structs = [
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=where)
            for aval, where in zip(part.program.in_avals, part.shardings)
        ]
        with jax.set_mesh(None):  # as the call runs it (see __call__)
            analysis = part.run.lower(*structs).compile().memory_analysis()
        update = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
        )
        sizes[part.worker] = max(sizes.get(part.worker, 0), update)
    return sizes


class _UpdatePart(NamedTuple):
    """One program of a training step's update (``program``, jitted as ``run``): its
    slot (worker), the positions it reads in the table of the update's values (see
    :class:`~pipemark.runtime.update.StageUpdates`), each laid out by ``shardings``, and
    those it computes."""

    worker: int
    program: ClosedJaxpr
    run: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    shardings: tuple[Any, ...]


class _Prepared(NamedTuple):
    """What a training step's call needs, made once per argument shapes."""

    plan: PipelinePlan
    out_tree: Any
    parts: tuple[_UpdatePart, ...]  # the update, per slot and round where it splits
    holders: tuple[int | None, ...]  # per input of the update (see _update_holders)
    shared: tuple[int, ...]  # results sent to every process (see _run_update)


def _split(plan: PipelinePlan, apply: ClosedJaxpr, num_args: int) -> StageUpdates | None:
    """The update of ``plan``'s step split per slot (:func:`split_update`, with the
    rounds that exchange small coupled values such as the partial sums of a global
    norm), or ``None`` where it does not split (a big value couples two slots, or the
    update has effects) or runs whole anyway.

    Under ``jax.distributed`` with ``gather_results=False`` every process cuts the same
    parts (a result no slot owns goes to slot 0, whichever process this is) and runs
    its own slots' (:func:`_run_update`). With results gathered (the default) every
    process holds every gradient: it runs the whole update on its own first slot, so
    that every process gets the whole new state, as before."""
    if plan.placement.distributed and plan.gather_results:
        return None
    return split_update(apply, input_owners(plan, num_args), _first_update_slot(plan))


def _first_update_slot(plan: PipelinePlan) -> int:
    """Where a result no slot owns is computed, and where the update runs whole: this
    process's first slot, or, when processes keep their own results, slot 0 (every
    process must cut the same parts)."""
    return 0 if plan.placement.distributed and not plan.gather_results else plan.update_worker


def _update_parts(
    plan: PipelinePlan, apply: ClosedJaxpr, split: StageUpdates | None
) -> tuple[_UpdatePart, ...]:
    """The parts of ``split`` (where it is ``None``, one part: the whole update
    ``apply`` on the first slot), each jitted and reading its inputs on its slot (a
    sub-mesh's parameters with their layout there: :meth:`PipelinePlan.update_sharding`)."""
    if split is None:
        count = len(apply.jaxpr.invars)
        results = tuple(range(count, count + len(apply.jaxpr.outvars)))
        parts: Sequence[UpdatePart] = (
            UpdatePart(_first_update_slot(plan), apply, tuple(range(count)), results),
        )
    else:
        parts = split.parts
    return tuple(
        _UpdatePart(
            p.worker,
            p.program,
            jax.jit(jaxpr_as_fun(p.program)),
            p.inputs,
            p.outputs,
            tuple(plan.update_sharding(i, p.worker) for i in p.inputs),
        )
        for p in parts
    )


def _update_holders(plan: PipelinePlan, num_args: int) -> tuple[int | None, ...]:
    """Per input of the update (the step's argument leaves, ``num_args`` of them, then
    the pipeline's accumulated results): the slot whose process alone holds it, or
    ``None`` where every process does (the arguments, which every process passes; every
    result when results are gathered, and in one process)."""
    holders: list[int | None] = [None] * num_args
    for ref in plan.staged.outputs:
        unit = plan.units.get(ref.stage) if ref.kind == "stage" else None
        held = plan.placement.distributed and not plan.gather_results and unit is not None
        holders.append(unit.worker if held else None)
    return tuple(holders)


def _run_update(
    plan: PipelinePlan,
    prepared: _Prepared,
    values: dict[int, Any],
    transport: Transport | None,
) -> None:
    """Run the update's parts in order, filling the table ``values`` (its inputs first,
    see :class:`~pipemark.runtime.update.StageUpdates`) with what they compute; the
    ``prepared`` holders say which slot's process alone holds each input (``None``:
    every one).

    A part of this process's slot reads its inputs there (``device_put``). Under
    ``jax.distributed`` a part of another process's slot runs there: its results are
    arrays of the global program this process does not hold (as
    :func:`pipemark.runtime.execution.run_plan` returns another process's stages'
    results). A value a part reads from a slot of another process (an exchanged partial
    sum) moves with ``transport``: every process walks the same parts in the same
    order, so both ends of each move meet. The results no slot owns (``shared``) then
    go to every process.
    """
    slots, local = plan.placement.slots, plan.placement.local
    held = dict(enumerate(prepared.holders))
    avals: dict[int, Any] = {}
    moved: dict[tuple[int, int], Any] = {}  # (position, slot): a value moved there
    for part in prepared.parts:
        reader = slots[part.worker]
        inputs = []
        for i, aval in zip(part.inputs, part.program.in_avals):
            source = held.get(i)
            if source is None or slots[source].process == reader.process:
                inputs.append(values.get(i))
                continue
            if (i, part.worker) not in moved:
                ends = device_slot(slots[source].device), device_slot(reader.device)
                got = _move(plan, [i], values, source, ends, [aval], transport)
                moved[(i, part.worker)] = got[0] if got else None
            inputs.append(moved[(i, part.worker)])
        if local[part.worker]:
            outputs = part.run(*jax.device_put(inputs, list(part.shardings)))
        else:  # another process computes them: arrays without data here
            outputs = [held_elsewhere(a, reader.replicated) for a in part.program.out_avals]
        values.update(zip(part.outputs, outputs))
        held.update((k, part.worker) for k in part.outputs)
        avals.update(zip(part.outputs, part.program.out_avals))
    if prepared.shared:
        source = held[prepared.shared[0]]  # the first slot computes them all
        types = [avals[k] for k in prepared.shared]
        for process, device in plan.placement.receivers().items():
            if process != slots[source].process:
                ends = device_slot(slots[source].device), device_slot(device)
                got = _move(plan, prepared.shared, values, source, ends, types, transport)
                values.update(zip(prepared.shared, got or ()))


def _move(
    plan: PipelinePlan,
    positions: Sequence[int],
    values: Mapping[int, Any],
    source: int,
    ends: tuple[Slot, Slot],
    avals: Sequence[Any],
    transport: Transport | None,
) -> list[Any] | None:
    """The values at ``positions`` of the update's table, computed on slot ``source``,
    moved between the devices ``ends`` (the source slot's first device, so that a
    sub-mesh's value goes whole) by ``transport``: on the receiving end's process, the
    values there; ``None`` elsewhere."""
    # Only under jax.distributed does a part read a value of another process's slot.
    assert transport is not None
    sent = None
    if plan.placement.local[source]:
        sent = jax.device_put([values[i] for i in positions], ends[0].device)
    types = tuple((a.shape, a.dtype) for a in avals)
    what = f"values {list(positions)} of the update"
    return transport.move(sent, types, *ends, what)


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
    memory_budget: int | None = None,
    microbatches_in_flight: int | None = None,
    stage_layers: Sequence[int] | None = None,
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
    norm, are small and exchanged: :mod:`pipemark.runtime.update`; on sub-meshes,
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
    every process gets the whole new state. The other options are those of
    :func:`pipeline_value_and_grad`.

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
        memory_budget=memory_budget,
        microbatches_in_flight=microbatches_in_flight,
        stage_layers=stage_layers,
    )
    return PipelinedStep(step_fn, options)
