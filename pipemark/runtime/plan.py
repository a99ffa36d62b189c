"""How a pipeline is planned: trace ``value_and_grad`` of a loss for one microbatch,
slice it into forward and mirrored backward stages, pair them into pipeline stages,
schedule them, and compile each stage program once for its device.
:mod:`pipemark.runtime.execution` runs the plan; :mod:`pipemark.runtime.pipeline` is
the API over both.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import NamedSharding

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.passes.backward_split import split_backward
from pipemark.passes.inline import inline_calls
from pipemark.passes.stages import pair_stages
from pipemark.runtime.agreement import check_agreement
from pipemark.runtime.compilation import Unit, compile_fused, compile_units
from pipemark.runtime.losses import (
    LOSS_REDUCTIONS,
    count_batch_free_terms_once,
    find_batch_normaliser,
)
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.placement import Placement, Slot, available_slots, leaf_specs, place_stages
from pipemark.runtime.registry import SCHEDULES, make_schedule, schedule_entry
from pipemark.runtime.schedules import BACKWARD, FORWARD, WEIGHT, Schedule
from pipemark.runtime.steps import Steps, fuse_steps, resolve_steps, without_gathers
from pipemark.runtime.transport import Watchdog
from pipemark.staged import StagedJaxpr
from pipemark.staging import has_stage_markers, split_jaxpr

__all__ = [
    "LOSS_REDUCTIONS",
    "PipelinePlan",
    "build_plan",
    "microbatch_structs",
    "plan_from_staged",
    "stage_program",
]


# ------------------------------------------------------------------------ checks


def microbatch_structs(batch: Any, num_microbatches: int) -> tuple[list[Any], int]:
    """The ShapeDtypeStruct of one microbatch of each batch leaf, and the microbatch
    size."""
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise PipemarkError(
            "The batch has no arrays to split into microbatches; pass the data as the "
            "second argument, loss_fn(params, batch)."
        )
    sizes = set()
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise PipemarkError(
                f"Batch leaf {i} is a scalar; every batch array needs a leading batch axis "
                "to split into microbatches. Move scalars into params or close over them "
                "in loss_fn."
            )
        sizes.add(shape[0])
    if len(sizes) != 1:
        raise PipemarkError(
            f"The batch arrays have different leading sizes {sorted(sizes)}; all of them "
            "must share the batch axis (axis 0) that is split into microbatches."
        )
    (size,) = sizes
    if size % num_microbatches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise PipemarkError(
            f"A batch of {size} does not split into {num_microbatches} equal microbatches. "
            f"Use num_microbatches in {divisors}, or pad the batch to a multiple of "
            f"{num_microbatches}."
        )
    micro = size // num_microbatches
    structs = [jax.ShapeDtypeStruct((micro, *np.shape(x)[1:]), jnp.result_type(x)) for x in leaves]
    return structs, micro


def _trace_loss(loss_fn: Callable, params: Any, batch_structs: Any) -> ClosedJaxpr:
    """The loss traced for one microbatch, its calls inlined: the one trace of
    ``loss_fn`` that the checks, the rewrites and the differentiation all read."""
    cj, out = jax.make_jaxpr(loss_fn, return_shape=True)(params, batch_structs)
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != 1 or not hasattr(out, "shape"):
        raise PipemarkError(
            f"loss_fn returns {jax.tree_util.tree_structure(out)}, not one array. "
            "pipeline_value_and_grad differentiates a scalar loss: return only the loss "
            "(auxiliary outputs are not supported)."
        )
    if out.shape != () or not jnp.issubdtype(out.dtype, jnp.inexact):
        raise PipemarkError(
            f"loss_fn returns {out.dtype}{list(out.shape)}; pipeline_value_and_grad needs a "
            "scalar floating-point loss. Reduce it over the batch (jnp.mean or jnp.sum, "
            "and pass loss_reduction= accordingly)."
        )
    return inline_calls(cj)


def _refuse_batch_normaliser(loss: ClosedJaxpr, num_param_leaves: int) -> None:
    """A mean normalised by a count from the batch cannot be averaged per microbatch."""
    found = find_batch_normaliser(loss, num_param_leaves)
    if found is not None:
        raise PipemarkError(
            f"loss_fn divides by a count computed from the batch at {found} (a masked or "
            "weighted mean). Averaging it per microbatch differs from the mean over the "
            "whole batch, and a microbatch that is all padding divides 0 by 0. Return "
            "(sum, count) instead, e.g. (jnp.sum(losses * mask), jnp.sum(mask)), and pass "
            "loss_reduction='sum_over_count'."
        )


# ------------------------------------------------------------------- stage plan


def stage_program(
    cj: ClosedJaxpr, num_stages: int | None, what: str, block_cuts: str = "prefer"
) -> StagedJaxpr:
    """Cut a traced program for the runtime as :func:`pipemark.split` cuts it (through
    :func:`pipemark.split_jaxpr`): at its markers, or, without any, into ``num_stages``
    balanced stages under the split policy ``block_cuts`` (``what`` names the program
    in the error when there is neither)."""
    # Inlined once here; has_stage_markers and split_jaxpr then find nothing to inline.
    cj = inline_calls(cj)
    if num_stages is None and not has_stage_markers(cj):
        raise PipemarkError(
            f"{what} has no pipeline markers, so the pipeline cannot tell where to cut it. "
            "Pass num_stages= to cut it automatically into balanced stages, or mark the "
            "layers with pm.mark(..., mark_type='start'/'end') or "
            "pm.mark_pipeline_boundary()."
        )
    # Marked stages are merged into num_stages, or an unmarked program is cut into
    # num_stages, exactly as pm.split and the CLI do.
    return split_jaxpr(cj, num_stages=num_stages, block_cuts=block_cuts)


def _trace_staged(
    loss: ClosedJaxpr, params: Any, batch_structs: Any, options: PipelineOptions
) -> tuple[StagedJaxpr, Any]:
    """Differentiate the traced loss (``value_and_grad`` of the program, not of
    ``loss_fn`` again) and cut it into forward and mirrored backward stages. Returns the
    staged program and the output tree."""
    program = jaxpr_as_fun(loss)

    def replayed(params: Any, batch: Any) -> Any:
        leaves = jax.tree_util.tree_leaves((params, batch))
        return program(*leaves)[0]

    cj, out_shape = jax.make_jaxpr(jax.value_and_grad(replayed), return_shape=True)(
        params, batch_structs
    )
    staged = stage_program(cj, options.num_stages, "loss_fn", options.block_cuts)
    return staged, jax.tree_util.tree_structure(out_shape)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What :class:`Pipeline` built for one input shape: the staged program, the
    schedule, where each stage runs and its compiled programs. Immutable: running it
    (:func:`pipemark.runtime.execution.run_plan`) changes nothing in it.

    Attributes
    ----------
    staged:
        The sliced ``value_and_grad`` program for one microbatch.
    schedule:
        The validated schedule (pipeline stage ``k`` = forward stage ``k`` and its
        mirrored backward stage).
    placement:
        The slot (device or sub-mesh) of each pipeline stage
        (:class:`~pipemark.runtime.placement.Placement`).
    forward_stages, backward_stages, weight_stages:
        For each pipeline stage, the index in ``staged.stages`` of its forward,
        backward and weight-gradient programs (``None`` where it has none).
    microbatch_size:
        Rows of the batch per microbatch.
    num_param_leaves:
        How many of the staged program's inputs are parameter leaves (the rest is the
        batch, split into microbatches).
    out_tree:
        The tree of the accumulated results.
    units:
        The compiled stage programs this process runs, by stage index.
    steps:
        The schedule's actions resolved (:mod:`pipemark.runtime.steps`), a forward
        fused with the backward that follows it where nothing else reads its outputs.
    fused:
        The fused programs (:func:`~pipemark.runtime.compilation.compile_fused`), by
        backward stage index.
    """

    staged: StagedJaxpr
    schedule: Schedule
    placement: Placement
    forward_stages: tuple[int, ...]
    backward_stages: tuple[int | None, ...]
    weight_stages: tuple[int | None, ...]
    microbatch_size: int
    num_param_leaves: int
    out_tree: Any
    units: Mapping[int, Unit] = dataclasses.field(repr=False, compare=False)
    steps: Steps = dataclasses.field(repr=False, compare=False)
    fused: Mapping[int, Unit] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    loss_reduction: str = "mean"
    timeout_s: float | None = 120.0
    # Per accumulating stage of this process, the zeros its accumulators start from
    # (immutable arrays: one set serves every call), and per worker of this process the
    # microbatch scale on its slot.
    zeros: Mapping[int, tuple[Any, ...]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    scales: Mapping[int, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # Under jax.distributed, the watchdog of its transfers (one thread, for every call).
    watchdog: Watchdog | None = dataclasses.field(default=None, repr=False, compare=False)
    #: On sub-meshes: each parameter leaf's ``PartitionSpec`` on its stage's sub-mesh.
    param_specs: tuple[Any, ...] | None = None
    #: Under jax.distributed: whether each stage's results go to every process
    #: (:class:`~pipemark.runtime.PipelineOptions` ``gather_results``).
    gather_results: bool = True

    @property
    def num_stages(self) -> int:
        return len(self.forward_stages)

    @property
    def devices(self) -> tuple[Any, ...]:
        """The (first) device of each pipeline stage."""
        return self.placement.stage_devices()

    @property
    def scale(self) -> float:
        """What each microbatch's share is multiplied by: ``1/M`` for a mean, else 1."""
        num_micro = self.schedule.num_microbatches
        return 1.0 / num_micro if self.loss_reduction == "mean" else 1.0

    def device_scale(self, slot: Slot) -> float:
        """What each replica's share of a microbatch is multiplied by on ``slot``."""
        mean = self.loss_reduction == "mean"
        return self.scale / slot.replicas if mean else self.scale

    def param_sharding(self, leaf: int, worker: int) -> Any:
        """Where parameter leaf ``leaf`` lies on worker ``worker``'s slot."""
        slot = self.placement.slots[worker]
        if self.param_specs is None:
            return slot.replicated
        return NamedSharding(slot.mesh, self.param_specs[leaf])

    def update_shardings(self, count: int) -> list[Any]:
        """Where a training step's update reads its ``count`` inputs (the parameter
        leaves first): this process's first slot, each parameter with its layout there
        and everything else whole."""
        slot = next(s for s in self.placement.slots if s.process == self.placement.process)
        if self.param_specs is None:
            return [slot.replicated] * count
        specs = [NamedSharding(slot.mesh, spec) for spec in self.param_specs]
        return [*specs, *[slot.replicated] * (count - len(specs))]

    def slot(self, index: int) -> Slot:
        """The slot (device or sub-mesh) that runs stage ``index`` of ``staged``."""
        return self.placement.slots[self.units[index].worker]

    def roles(self) -> dict[str, tuple[int | None, ...]]:
        """Per action kind, the stage index of each pipeline stage's program."""
        return {
            FORWARD: self.forward_stages,
            BACKWARD: self.backward_stages,
            WEIGHT: self.weight_stages,
        }

    def bytes_into_process(self, process: int) -> int:
        """The bytes that cross into process ``process``'s stages from other processes'
        per call, by the stage graph: each value once per microbatch (and replica) and
        reading slot (under ``jax.distributed``; 0 in one process)."""
        slots = self.placement.slots
        crossing = set()
        for index, unit in self.units.items():
            if slots[unit.worker].process != process:
                continue
            stage = self.staged.stages[index]
            for ref, var in zip(stage.inputs, stage.jaxpr.invars):
                producer = self.units[ref.stage].worker if ref.kind == "stage" else None
                if producer is not None and slots[producer].process != process:
                    crossing.add((ref.stage, ref.index, unit.worker, var.aval))
        # Each value once per replica of each microbatch (the stage program is traced
        # for one replica's rows).
        replicas = slots[0].replicas
        size = sum(aval.size * aval.dtype.itemsize for *_, aval in crossing)
        return size * self.schedule.num_microbatches * replicas


def _stage_edges(
    staged: StagedJaxpr, pipeline_stage: dict[int, int], is_backward: set[int]
) -> set[tuple[int, int]]:
    """Edges of the pipeline-stage graph that make every cross-stage read safe: a value
    read from another pipeline stage orders the two stages (see the module docstring of
    :mod:`pipemark.runtime.schedules`)."""
    edges: set[tuple[int, int]] = set()
    for c, stage in enumerate(staged.stages):
        for ref in stage.inputs:
            if ref.kind != "stage":
                continue
            p = ref.stage
            if c not in is_backward and p in is_backward:
                raise StageGraphError(
                    f"Forward stage {stage.name!r} reads a value of backward stage "
                    f"{staged.stages[p].name!r}; a pipeline runs every forward before the "
                    "matching backward. Keep gradient computations out of the forward "
                    "stages."
                )
            a, b = pipeline_stage[p], pipeline_stage[c]
            if a != b:
                edges.add((min(a, b), max(a, b)))
    return edges


def build_plan(
    loss_fn: Callable, params: Any, batch: Any, options: PipelineOptions
) -> PipelinePlan:
    """Trace ``loss_fn`` once for one microbatch of ``batch``, check it, differentiate
    the traced program, stage, schedule and compile it: the plan
    :func:`pipemark.runtime.execution.run_plan` runs."""
    batch_structs, micro, replicas = replica_batch(batch, options)
    loss = _trace_loss(loss_fn, params, batch_structs)
    num_param_leaves = len(jax.tree_util.tree_leaves(params))
    if options.loss_reduction == "mean":
        _refuse_batch_normaliser(loss, num_param_leaves)
    else:  # a sum: the terms without the batch (weight decay) count once, not per microbatch
        evaluations = options.num_microbatches * replicas  # (and replica)
        loss = count_batch_free_terms_once(loss, num_param_leaves, evaluations)
    staged, out_tree = _trace_staged(loss, params, batch_structs, options)
    specs = None
    if options.mesh is not None:
        specs = leaf_specs(options.param_specs, params, options.stage_axis)
    return plan_from_staged(
        staged,
        out_tree,
        num_param_leaves=num_param_leaves,
        microbatch_size=micro,
        options=options,
        param_specs=specs,
        result_specs=None if specs is None else (None, *specs),
    )


def replica_batch(batch: Any, options: PipelineOptions) -> tuple[Any, int, int]:
    """What a stage program is traced for: the batch's tree of ShapeDtypeStructs for one
    replica's rows of one microbatch (on sub-meshes with a data axis, a microbatch is
    split into replicas), the microbatch's rows and the number of replicas."""
    structs, micro = microbatch_structs(batch, options.num_microbatches)
    replicas = replicas_of(options, micro)
    structs = [
        jax.ShapeDtypeStruct((s.shape[0] // replicas, *s.shape[1:]), s.dtype) for s in structs
    ]
    tree = jax.tree_util.tree_structure(batch)
    return jax.tree_util.tree_unflatten(tree, structs), micro, replicas


def replicas_of(options: PipelineOptions, microbatch_size: int) -> int:
    """The data-parallel replicas each microbatch is split into (1 without a mesh, or
    without a data axis), checked to divide the microbatch's rows."""
    if options.mesh is None:
        return 1
    replicas = available_slots(options)[0].replicas
    if microbatch_size % replicas:
        raise PipemarkError(
            f"A microbatch of {microbatch_size} rows does not split into {replicas} "
            f"data-parallel replicas (the mesh's {options.data_axis!r} axis). Use a batch "
            f"that is a multiple of num_microbatches x {replicas}, or fewer microbatches."
        )
    return replicas


def _schedule(
    options: PipelineOptions, count: int, edges: set[tuple[int, int]]
) -> tuple[Schedule, list[Any]]:
    """The pipeline's schedule for ``count`` pipeline stages and the devices available,
    checked against each other."""
    schedule = options.schedule
    available = available_slots(options)
    if isinstance(schedule, Schedule) or not schedule_entry(schedule).one_stage_per_device:
        # Several stages may share a device (a Schedule places its own): the devices
        # it uses are checked against those available below.
        num_devices = len(available)
    else:  # one stage per device
        num_devices = count
        if count > len(available):
            sharing = " or ".join(
                repr(name) for name in SCHEDULES if not schedule_entry(name).one_stage_per_device
            )
            raise PipemarkError(
                f"The pipeline has {count} stages but only {len(available)} device(s) "
                f"({', '.join(str(d) for d in available)}); each stage needs its own "
                f"device. Pass num_stages={len(available)} (consecutive marked stages are "
                "merged), give more devices (on CPU, set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={count} before JAX starts), or use "
                f"schedule={sharing} to put several stages on each device."
            )
    plan_schedule = make_schedule(
        schedule,
        count,
        options.num_microbatches,
        stage_graph=sorted(edges),
        num_devices=num_devices,
    )
    if plan_schedule.num_devices > len(available):
        raise PipemarkError(
            f"The schedule {plan_schedule.name!r} uses {plan_schedule.num_devices} devices "
            f"but only {len(available)} are available; pass devices= with enough devices."
        )
    return plan_schedule, available


def plan_from_staged(
    staged: StagedJaxpr,
    out_tree: Any,
    *,
    num_param_leaves: int,
    microbatch_size: int,
    options: PipelineOptions,
    param_specs: Sequence[Any] | None = None,
    result_specs: Sequence[Any] | None = None,
) -> PipelinePlan:
    """Schedule and compile a staged program whose inputs are ``num_param_leaves``
    parameter leaves followed by the batch leaves (split into microbatches). On
    sub-meshes (``options.mesh``), ``param_specs`` lays each parameter leaf out on its
    stage's sub-mesh and ``result_specs`` each result (``None``: replicated)."""
    if options.splits_backward:
        # A zero-bubble schedule runs each backward's parameter gradients (W) apart.
        staged = split_backward(staged)
    forward, backward, weight = pair_stages(staged)
    count = len(forward)
    pipeline_stage: dict[int, int] = {}
    for k, (f, b, w) in enumerate(zip(forward, backward, weight)):
        pipeline_stage[f] = k
        for other in (b, w):
            if other is not None:
                pipeline_stage[other] = k
    is_backward = {b for b in (*backward, *weight) if b is not None}
    edges = _stage_edges(staged, pipeline_stage, is_backward)

    plan_schedule, available = _schedule(options, count, edges)
    placement = place_stages(available, plan_schedule.stage_devices)
    units = compile_units(
        staged,
        {index: placement.stage_slots[k] for index, k in pipeline_stage.items()},
        placement,
        num_params=num_param_leaves,
        param_specs=param_specs,
        result_specs=result_specs,
        data_axis=options.data_axis,
        num_microbatches=plan_schedule.num_microbatches,
    )
    units = types.MappingProxyType(units)  # the plan is immutable
    plan = PipelinePlan(
        staged=staged,
        schedule=plan_schedule,
        placement=placement,
        forward_stages=tuple(forward),
        backward_stages=tuple(backward),
        weight_stages=tuple(weight),
        microbatch_size=microbatch_size,
        num_param_leaves=num_param_leaves,
        out_tree=out_tree,
        units=units,
        steps=None,
        loss_reduction=options.loss_reduction,
        timeout_s=options.timeout_s,
        param_specs=None if param_specs is None else tuple(param_specs),
        gather_results=options.gather_results,
    )
    return _ready(plan)


def _ready(plan: PipelinePlan) -> PipelinePlan:
    """``plan`` with what every call reuses made once: its resolved steps (and the
    fused programs they run, on single-device slots), the zeros of this process's
    accumulators, each worker's scale on its slot; under
    ``jax.distributed`` the processes checked to make the same plan, and its
    watchdog."""
    placement, local = plan.placement, plan.placement.local
    steps = resolve_steps(
        plan.staged, plan.schedule, plan.roles(), plan.units, placement, plan.num_param_leaves
    )
    pairs: dict[int, int] = {}
    if not placement.meshes:  # a fused program on a sub-mesh is not written yet
        steps, pairs = fuse_steps(steps, plan.staged, plan.roles(), plan.units, placement)
    if not plan.gather_results:
        steps = without_gathers(steps)
    units = plan.units
    fused = {
        backward: compile_fused(
            plan.staged, units[forward], units[backward], placement.slots[units[backward].worker]
        )
        for backward, forward in pairs.items()
    }
    zeros = {
        index: tuple(unit.zeros())
        for index, unit in plan.units.items()
        if unit.zeros is not None and local[unit.worker] and not unit.donates
    }
    scales = {
        w: jax.device_put(np.float32(plan.device_scale(slot)), slot.replicated)
        for w, slot in enumerate(placement.slots)
        if local[w]
    }
    watchdog = None
    if placement.distributed:
        check_agreement(plan, plan.timeout_s)
        watchdog = Watchdog(plan.timeout_s)
    return dataclasses.replace(
        plan,
        steps=steps,
        fused=types.MappingProxyType(fused),
        zeros=zeros,
        scales=scales,
        watchdog=watchdog,
    )
