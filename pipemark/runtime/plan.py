"""How a pipeline is planned: trace ``value_and_grad`` of a loss for one microbatch,
slice it into forward and mirrored backward stages, pair them into pipeline stages,
schedule them, and compile each stage program once for its device.
:mod:`pipemark.runtime.execution` runs the plan; :mod:`pipemark.runtime.pipeline` is
the API over both.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import SingleDeviceSharding

from pipemark.caches import register_cache
from pipemark.errors import PipemarkError, StageGraphError
from pipemark.passes.backward_split import split_backward
from pipemark.passes.inline import inline_calls
from pipemark.passes.stages import pair_stages
from pipemark.runtime.losses import (
    LOSS_REDUCTIONS,
    count_batch_free_terms_once,
    find_batch_normaliser,
)
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.registry import SCHEDULES, make_schedule, schedule_entry
from pipemark.runtime.schedules import Schedule
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


@dataclasses.dataclass
class _Unit:
    """One compiled stage program on its device."""

    index: int  # sliced stage index
    device: Any
    run: Callable[[list[Any], list[Any]], tuple[list[Any], list[Any]]]
    zeros: Callable[[], list[Any]] | None
    accumulated: list[tuple[int, int]]  # (program result index, stage output index)
    passed: list[int]  # stage outputs other stages read


@dataclasses.dataclass
class PipelinePlan:
    """What :class:`Pipeline` built for one input shape: the staged program, the
    schedule and where each stage runs.

    Attributes
    ----------
    staged:
        The sliced ``value_and_grad`` program for one microbatch.
    schedule:
        The validated schedule (pipeline stage ``k`` = forward stage ``k`` and its
        mirrored backward stage).
    devices:
        The device of each pipeline stage.
    forward_stages, backward_stages:
        For each pipeline stage, the index in ``staged.stages`` of its forward and
        backward programs (``None`` when a stage has no backward).
    microbatch_size:
        Rows of the batch per microbatch.
    """

    staged: StagedJaxpr
    schedule: Schedule
    devices: tuple[Any, ...]
    forward_stages: tuple[int, ...]
    backward_stages: tuple[int | None, ...]
    weight_stages: tuple[int | None, ...]
    microbatch_size: int
    num_param_leaves: int
    out_tree: Any
    units: dict[int, _Unit] = dataclasses.field(repr=False)
    readers: dict[tuple[int, int], int] = dataclasses.field(repr=False)
    loss_reduction: str = "mean"
    timeout_s: float | None = 120.0
    # Filled by pipemark.runtime.execution on first use: the actions resolved once
    # (its program of steps), each accumulating stage's zeros, and each worker's scale.
    _program: Any = dataclasses.field(default=None, repr=False, compare=False)
    _zeros: dict[int, list[Any]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # Per device worker, the microbatch scale placed on its device.
    _scales: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # Under jax.distributed, the watchdog of its transfers (one thread, for every call).
    _watchdog: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_stages(self) -> int:
        return len(self.forward_stages)

    def bytes_into_process(self, process: int) -> int:
        """The bytes that cross into process ``process``'s stages from other processes'
        per call, by the stage graph: each value once per microbatch and reading device
        (under ``jax.distributed``; 0 in one process)."""
        crossing = set()
        for index, unit in self.units.items():
            if unit.device.process_index != process:
                continue
            stage = self.staged.stages[index]
            for ref, var in zip(stage.inputs, stage.jaxpr.invars):
                if ref.kind == "stage" and self.units[ref.stage].device.process_index != process:
                    crossing.add((ref.stage, ref.index, unit.device, var.aval))
        size = sum(aval.size * aval.dtype.itemsize for *_, aval in crossing)
        return size * self.schedule.num_microbatches


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


# Stage programs compiled in this process, keyed by their text, types and device: the same
# stage program reappears whenever a pipeline is rebuilt for the same microbatch shape
# (another schedule, another number of microbatches), and XLA compilation dominates the
# cost of building a pipeline. Programs with constants are not cached (their text does not
# show the constants' values), nor programs whose text hides an object's identity: the
# printer writes ``<function f at 0xXXXXXXXXXXXX>`` for a callback (``jax.pure_callback``,
# custom derivative rules), so two programs calling different functions of one name print
# alike.
_HIDDEN_ADDRESS = re.compile(r"\bat 0xX+>")
_UNIT_CACHE: dict[Any, tuple[Callable, Callable | None]] = {}
_UNIT_CACHE_SIZE = 256
register_cache(_UNIT_CACHE.clear)


def _unit_key(closed: ClosedJaxpr, accumulated: list[int], passed: list[int], device: Any) -> Any:
    if closed.consts:
        return None
    jaxpr = closed.jaxpr
    text = str(jaxpr)
    if _HIDDEN_ADDRESS.search(text):
        return None
    types = tuple(repr(v.aval) for v in (*jaxpr.invars, *jaxpr.outvars))
    return (text, types, tuple(accumulated), tuple(passed), device.platform, device.id)


def _compile_unit(
    staged: StagedJaxpr, index: int, device: Any, readers: dict[tuple[int, int], int]
) -> _Unit:
    stage = staged.stages[index]
    accumulated = [
        (r, ref.index)
        for r, ref in enumerate(staged.outputs)
        if ref.kind == "stage" and ref.stage == index
    ]
    passed = [o for o in range(len(stage.out_avals)) if readers.get((index, o), 0)]
    key = _unit_key(stage.closed_jaxpr, [o for _, o in accumulated], passed, device)
    cached = _UNIT_CACHE.get(key) if key is not None else None
    if cached is None:
        cached = _jit_unit(stage.closed_jaxpr, [o for _, o in accumulated], passed, device)
        if key is not None:
            if len(_UNIT_CACHE) >= _UNIT_CACHE_SIZE:
                del _UNIT_CACHE[next(iter(_UNIT_CACHE))]
            _UNIT_CACHE[key] = cached
    run, zeros = cached
    return _Unit(index, device, run, zeros, accumulated, passed)


def _jit_unit(
    closed: ClosedJaxpr, accumulated: list[int], passed: list[int], device: Any
) -> tuple[Callable, Callable | None]:
    fun = jaxpr_as_fun(closed)
    avals = [v.aval for v in closed.jaxpr.outvars]

    def contribution(value: Any, scale: Any) -> Any:
        if jnp.issubdtype(value.dtype, jnp.inexact):
            return value * scale.astype(value.dtype)
        return value

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        # scale is 1/M for a mean, 1 for a sum: an argument, so the same compiled program
        # serves every number of microbatches.
        outs = fun(*inputs)
        new = [acc + contribution(outs[o], scale) for acc, o in zip(accs, accumulated)]
        return new, [outs[o] for o in passed]

    sharding = SingleDeviceSharding(device)
    zeros = None
    if accumulated:
        shapes = [(avals[o].shape, avals[o].dtype) for o in accumulated]

        def make_zeros() -> list[Any]:
            return [jnp.zeros(s, d) for s, d in shapes]

        zeros = jax.jit(make_zeros, out_shardings=sharding)
    return jax.jit(run, out_shardings=sharding), zeros


def build_plan(
    loss_fn: Callable, params: Any, batch: Any, options: PipelineOptions
) -> PipelinePlan:
    """Trace ``loss_fn`` once for one microbatch of ``batch``, check it, differentiate
    the traced program, stage, schedule and compile it: the plan
    :func:`pipemark.runtime.execution.run_plan` runs."""
    structs, micro = microbatch_structs(batch, options.num_microbatches)
    batch_structs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), structs)
    loss = _trace_loss(loss_fn, params, batch_structs)
    num_param_leaves = len(jax.tree_util.tree_leaves(params))
    if options.loss_reduction == "mean":
        _refuse_batch_normaliser(loss, num_param_leaves)
    else:  # a sum: the terms without the batch (weight decay) count once, not per microbatch
        loss = count_batch_free_terms_once(loss, num_param_leaves, options.num_microbatches)
    staged, out_tree = _trace_staged(loss, params, batch_structs, options)
    return plan_from_staged(
        staged,
        out_tree,
        num_param_leaves=num_param_leaves,
        microbatch_size=micro,
        options=options,
    )


def _schedule(
    options: PipelineOptions, count: int, edges: set[tuple[int, int]]
) -> tuple[Schedule, list[Any]]:
    """The pipeline's schedule for ``count`` pipeline stages and the devices available,
    checked against each other."""
    devices, schedule = options.devices, options.schedule
    available = list(jax.devices() if devices is None else devices)
    if len({id(d) for d in available}) != len(available):
        raise PipemarkError("devices lists a device twice; give each pipeline device once.")
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
) -> PipelinePlan:
    """Schedule and compile a staged program whose inputs are ``num_param_leaves``
    replicated leaves followed by the batch leaves (split into microbatches)."""
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
    stage_devices = tuple(available[d] for d in plan_schedule.stage_devices)

    readers: dict[tuple[int, int], int] = {}
    for stage in staged.stages:
        for ref in stage.inputs:
            if ref.kind == "stage":
                readers[(ref.stage, ref.index)] = readers.get((ref.stage, ref.index), 0) + 1
    units = {
        index: _compile_unit(staged, index, stage_devices[k], readers)
        for index, k in pipeline_stage.items()
    }
    return PipelinePlan(
        staged=staged,
        schedule=plan_schedule,
        devices=stage_devices,
        forward_stages=tuple(forward),
        backward_stages=tuple(backward),
        weight_stages=tuple(weight),
        microbatch_size=microbatch_size,
        num_param_leaves=num_param_leaves,
        out_tree=out_tree,
        units=units,
        readers=readers,
        loss_reduction=options.loss_reduction,
        timeout_s=options.timeout_s,
    )
