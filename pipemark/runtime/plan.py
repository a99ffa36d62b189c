"""How a pipeline is planned: trace ``value_and_grad`` of a loss for one microbatch
(:mod:`pipemark.runtime.tracing`), cut it into pipeline stages
(:mod:`pipemark.runtime.pipeline_stages`), schedule them for the pipeline's
:class:`~pipemark.runtime.ScheduleProblem` (:mod:`pipemark.runtime.scheduling`), place
them and compile each stage program once for its slot: the :class:`PipelinePlan`.
:mod:`pipemark.runtime.execution` runs the plan; :mod:`pipemark.runtime.pipeline` is
the API over both.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from pipemark import failures
from pipemark.passes.residuals import RECOMPUTABLE, recompute_residuals
from pipemark.runtime.devices.agreement import check_agreement
from pipemark.runtime.devices.compilation import Unit, compile_fused, compile_units
from pipemark.runtime.devices.placement import (
    Placement,
    Slot,
    mesh_leaf_specs,
    place_stages,
    put_global,
)
from pipemark.runtime.devices.sharding import gathered_spec
from pipemark.runtime.devices.steps import (
    Steps,
    fuse_runs,
    fuse_steps,
    place_reductions,
    resolve_steps,
    without_gathers,
)
from pipemark.runtime.devices.transport import Watchdog
from pipemark.runtime.losses import LOSS_REDUCTIONS
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.pipeline_stages import pipeline_stages, stage_program
from pipemark.runtime.schedules.core import BACKWARD, FORWARD, WEIGHT, Schedule
from pipemark.runtime.schedules.problem import ScheduleProblem
from pipemark.runtime.scheduling import plan_schedule
from pipemark.runtime.tracing import (
    loss_over_microbatches,
    replica_batch,
    trace_loss,
    trace_value_and_grad,
)
from pipemark.staged import StagedJaxpr

__all__ = [
    "LOSS_REDUCTIONS",
    "PipelinePlan",
    "build_plan",
    "plan_from_staged",
]


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
        (:class:`~pipemark.runtime.devices.placement.Placement`).
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
        The schedule's actions resolved (:mod:`pipemark.runtime.devices.steps`), a forward
        fused with the backward that follows it where nothing else reads its outputs.
    fused:
        The fused programs (:func:`~pipemark.runtime.devices.compilation.compile_fused`), by
        the :class:`~pipemark.runtime.devices.compilation.Combined` their steps run
        (``plan.fused[step.fused]``).
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
    fused: Mapping[Any, Unit] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    loss_reduction: str = "mean"
    timeout_s: float | None = 120.0
    #: How many of a worker's actions may be dispatched and not yet computed
    #: (:class:`~pipemark.runtime.PipelineOptions` ``dispatch_ahead``; ``None``: any).
    dispatch_ahead: int | None = 2
    #: At most how many consecutive actions of a worker run as one program
    #: (:class:`~pipemark.runtime.PipelineOptions` ``fuse_actions``).
    fuse_actions: int = 2
    #: Fuse a run only where its program runs at least this many times a call
    #: (``fuse_min_uses``; ``None``: twice the number of microbatches).
    fuse_min_uses: int | None = None
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
    #: On sub-meshes: how the stages gather parameters sharded over the data axis
    #: (:data:`~pipemark.runtime.devices.sharding.FSDP_GATHERS`).
    fsdp_gather: str = "once"
    data_axis: str = "data"
    #: Under jax.distributed: whether each stage's results go to every process
    #: (:class:`~pipemark.runtime.PipelineOptions` ``gather_results``).
    gather_results: bool = True
    #: What the schedule was built for (:class:`~pipemark.runtime.ScheduleProblem`):
    #: ``plan.problem.with_costs(costs)`` rebuilds it for measured costs
    #: (:func:`~pipemark.runtime.build_schedule`).
    problem: ScheduleProblem | None = dataclasses.field(default=None, compare=False)
    #: The forward stages recomputed whole by their backward stages, by name (a memory
    #: budget's choice: :mod:`pipemark.runtime.memory.budget`).
    rematerialized: frozenset[str] = frozenset()
    #: How many marked layers each pipeline stage merges (``None``: its stages are not
    #: merged from marked layers): the options' ``stage_layers``, or the default.
    stage_layers: tuple[int, ...] | None = None
    #: The schedule's actions resolved with every action its own program (no fusion),
    #: as :func:`~pipemark.runtime.execution.action_costs` times them.
    unfused_steps: Steps | None = dataclasses.field(default=None, repr=False, compare=False)
    #: Under jax.distributed, whether stage programs have collectives between processes
    #: (FSDP gathered per microbatch on a sub-mesh that spans processes): then every
    #: process dispatches its steps and transfers one at a time in the one global order
    #: (:attr:`~pipemark.runtime.devices.steps.Steps.order`), as XLA needs of collectives.
    ordered: bool = False
    #: When each stage's accumulators are reduced over their data-parallel replicas
    #: (:class:`~pipemark.runtime.PipelineOptions` ``reduce_gradients``): the plan's
    #: steps say where (:func:`~pipemark.runtime.devices.steps.place_reductions`).
    reduce_gradients: str = "after_stage"

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

    def stage_param_sharding(self, leaf: int, worker: int) -> Any:
        """Where worker ``worker``'s stage programs read parameter leaf ``leaf``: its
        layout there, or, sharded over the data axis and gathered once per call
        (``fsdp_gather="once"``), that layout gathered (the copy a call places there)."""
        sharding = self.param_sharding(leaf, worker)
        if self.param_specs is None or self.fsdp_gather != "once":
            return sharding
        spec = gathered_spec(sharding.spec, self.data_axis)
        return sharding if spec == sharding.spec else NamedSharding(sharding.mesh, spec)

    @property
    def update_worker(self) -> int:
        """The slot a training step's update runs on: this process's first."""
        slots = self.placement.slots
        return next(i for i, s in enumerate(slots) if s.process == self.placement.process)

    def update_sharding(self, position: int, worker: int) -> Any:
        """Where a training step's update reads its input ``position`` (the parameter
        leaves first) on slot ``worker``: a parameter with its layout there, anything
        else whole."""
        if self.param_specs is not None and position < len(self.param_specs):
            return self.param_sharding(position, worker)
        return self.placement.slots[worker].replicated

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

    def result_holders(self) -> tuple[int | None, ...]:
        """Per result of the staged program, the slot whose process alone holds it after
        a call, or ``None`` where every process does: under ``jax.distributed`` with
        ``gather_results=False``, each stage's results stay with its slot's process,
        but for scalars (a loss, a metric: cheap, and the process that logs reads them),
        which go to every process, as results no stage computes do. In one process, or
        with results gathered, every result is ``None``."""
        holders: list[int | None] = []
        for ref in self.staged.outputs:
            unit = self.units.get(ref.stage) if ref.kind == "stage" else None
            held = self.placement.distributed and not self.gather_results and unit is not None
            if held and not self.staged.stages[ref.stage].out_avals[ref.index].shape:
                held = False  # a scalar
            holders.append(unit.worker if held else None)
        return tuple(holders)

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


def build_plan(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    options: PipelineOptions,
    rematerialize: frozenset[str] = frozenset(),
) -> PipelinePlan:
    """Trace ``loss_fn`` once for one microbatch of ``batch``, check it, differentiate
    the traced program, stage, schedule and compile it: the plan
    :func:`pipemark.runtime.execution.run_plan` runs. The forward stages named in
    ``rematerialize`` are recomputed whole by their backward stages."""
    batch_structs, micro, replicas = replica_batch(batch, options)
    loss = trace_loss(loss_fn, params, batch_structs)
    num_param_leaves = len(jax.tree_util.tree_leaves(params))
    evaluations = options.num_microbatches * replicas  # each microbatch (and replica)
    loss = loss_over_microbatches(loss, num_param_leaves, options, evaluations)
    program, out_tree = trace_value_and_grad(loss, params, batch_structs)
    staged, layers = stage_program(
        program, options.num_stages, "loss_fn", options.block_cuts, options.stage_layers
    )
    specs = None
    if options.mesh is not None:
        specs = mesh_leaf_specs(options, params)
    return plan_from_staged(
        staged,
        out_tree,
        num_param_leaves=num_param_leaves,
        microbatch_size=micro,
        options=options,
        param_specs=specs,
        result_specs=None if specs is None else (None, *specs),
        rematerialize=rematerialize,
        stage_layers=layers,
    )


def _gathers_across_processes(
    placement: Placement, options: PipelineOptions, param_specs: Sequence[Any] | None
) -> bool:
    """Whether stage programs gather parameters sharded over the data axis and
    reduce-scatter their gradients (``fsdp_gather="per_microbatch"``) on a stage whose
    sub-mesh spans processes: collectives between processes inside stage programs.
    XLA's CPU client launches a process's programs with collectives one after another
    in the order they were dispatched, and a collective waits for every process: with
    each worker thread and the transfer thread dispatching as they go, two processes
    dispatched one stage's backward and a transfer in opposite orders and each waited
    for the other (CPU, gloo). Such a plan dispatches its steps and transfers in the one
    global order (:attr:`PipelinePlan.ordered`)."""
    if not placement.spanning or options.gathering != "per_microbatch" or param_specs is None:
        return False
    data = options.data_axis
    return any(spec is not None and gathered_spec(spec, data) != spec for spec in param_specs)


def plan_from_staged(
    staged: StagedJaxpr,
    out_tree: Any,
    *,
    num_param_leaves: int,
    microbatch_size: int,
    options: PipelineOptions,
    param_specs: Sequence[Any] | None = None,
    result_specs: Sequence[Any] | None = None,
    rematerialize: frozenset[str] = frozenset(),
    stage_layers: tuple[int, ...] | None = None,
) -> PipelinePlan:
    """Schedule and compile a staged program whose inputs are ``num_param_leaves``
    parameter leaves followed by the batch leaves (split into microbatches). On
    sub-meshes (``options.mesh``), ``param_specs`` lays each parameter leaf out on its
    stage's sub-mesh and ``result_specs`` each result (``None``: replicated). The
    forward stages named in ``rematerialize`` are recomputed whole by their backward
    stages (:func:`pipemark.passes.recompute_residuals`); ``stage_layers`` (recorded in
    the plan) says how many marked layers each stage merged."""
    if options.recompute_residuals or rematerialize:
        # The forward stages named in rematerialize are recomputed whole by their
        # backward (memory_budget asks for them: pipemark.runtime.memory.budget).
        recomputable = RECOMPUTABLE if options.recompute_residuals else frozenset()
        staged = recompute_residuals(
            staged, recomputable, rematerialize, expanding_products=options.recompute_residuals
        )
    stages = pipeline_stages(staged, options.splits_backward)
    problem, schedule = plan_schedule(stages, options)
    placement = place_stages(problem.slots, schedule.stage_devices)
    units = compile_units(
        stages.staged,
        {index: placement.stage_slots[k] for index, k in stages.pipeline_stage().items()},
        placement,
        num_params=num_param_leaves,
        param_specs=param_specs,
        result_specs=result_specs,
        data_axis=options.data_axis,
        num_microbatches=schedule.num_microbatches,
        fsdp_gather=options.gathering,
    )
    units = types.MappingProxyType(units)  # the plan is immutable
    plan = PipelinePlan(
        staged=stages.staged,
        schedule=schedule,
        placement=placement,
        forward_stages=stages.forward,
        backward_stages=stages.backward,
        weight_stages=stages.weight,
        microbatch_size=microbatch_size,
        num_param_leaves=num_param_leaves,
        out_tree=out_tree,
        units=units,
        steps=None,
        loss_reduction=options.loss_reduction,
        timeout_s=options.timeout_s,
        dispatch_ahead=options.dispatch_ahead,
        fuse_actions=options.fuse_actions,
        fuse_min_uses=options.fuse_min_uses,
        param_specs=None if param_specs is None else tuple(param_specs),
        fsdp_gather=options.gathering,
        data_axis=options.data_axis,
        gather_results=options.gather_results,
        problem=problem,
        rematerialized=frozenset(rematerialize),
        stage_layers=stage_layers,
        ordered=_gathers_across_processes(placement, options, param_specs),
        reduce_gradients=options.reduce_gradients,
    )
    return _ready(plan)


def _ready(plan: PipelinePlan) -> PipelinePlan:
    """``plan`` with what every call reuses made once: its resolved steps (and the
    fused programs they run, on single-device slots), the zeros of this process's
    accumulators, each worker's scale on its slot; under
    ``jax.distributed`` the processes checked to make the same plan, and its
    watchdog (and this process's uncaught errors published for the others, for a
    script that did not start with :func:`pipemark.launch.initialize`)."""
    placement, local = plan.placement, plan.placement.local
    resolve = (plan.staged, plan.schedule, plan.roles(), plan.units, placement)
    unfused = steps = resolve_steps(*resolve, plan.num_param_leaves, fuse=False)
    if not placement.meshes:  # a fused program on a sub-mesh is not written yet
        steps = resolve_steps(*resolve, plan.num_param_leaves)
        steps = fuse_steps(steps, plan.staged, plan.roles(), plan.units, placement, plan.schedule)
        steps = fuse_runs(
            steps, plan.fuse_actions, plan.schedule, plan.roles(), plan.units, placement,
            plan.fuse_min_uses,
        )  # fmt: skip
    if not plan.gather_results:
        steps = without_gathers(steps)
    # After the gathers are settled: a stage whose results go to other processes is
    # reduced where they leave (its last action), whatever the option.
    steps = place_reductions(steps, plan.units, placement, plan.reduce_gradients == "after_stage")
    units = plan.units
    fused = {
        step.fused: compile_fused(
            plan.staged, step.fused, units, placement.slots[units[step.index].worker]
        )
        for _, step in steps.serial
        if step.fused is not None
    }
    zeros = {
        index: tuple(unit.zeros())
        for index, unit in plan.units.items()
        if unit.zeros is not None and local[unit.worker] and not unit.donates
    }
    scales = {
        w: put_global([np.float32(plan.device_scale(slot))], [slot.replicated])[0]
        for w, slot in enumerate(placement.slots)
        if local[w]
    }
    watchdog = None
    if placement.distributed:
        failures.install()
        check_agreement(plan, plan.timeout_s)
        watchdog = Watchdog(plan.timeout_s, placement.process)
    return dataclasses.replace(
        plan,
        steps=steps,
        unfused_steps=unfused,
        fused=types.MappingProxyType(fused),
        zeros=zeros,
        scales=scales,
        watchdog=watchdog,
    )
