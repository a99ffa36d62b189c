"""Run a loss function's forward and backward stages on several devices, microbatch by
microbatch, following a pipeline schedule: :func:`pipeline_value_and_grad`.

How a call runs:

1. **Trace once per input shape.** ``jax.value_and_grad(loss_fn)`` is traced for *one
   microbatch* (the batch's leading axis divided by ``num_microbatches``). Stage markers
   in ``loss_fn`` (start/end pairs, or boundary markers turned into layers) give forward
   stages and, through the marker's transpose rule, mirrored ``<name>_backward`` stages.
   Without markers, :func:`pipemark.passes.auto.auto_layers` cuts the program into
   ``num_stages`` balanced layers.
2. **Slice** with :func:`pipemark.passes.slice_stages`. Pipeline stage ``k`` is forward
   stage ``k`` with its mirrored backward stage; both run on the same device, so the
   residuals the backward reads (activations saved by the forward) never move.
3. **Compile** each stage program once with ``jax.jit`` for its device. The compiled
   program also adds the stage's share of the result (the loss, the gradients) into an
   accumulator that stays on the device.
4. **Dispatch** the schedule tick by tick. Each action fetches its inputs (parameters
   placed once per call, the microbatch's slice of the batch, values from other stages
   moved with ``jax.device_put``), runs, and keeps its outputs per microbatch until
   every stage that reads them has run. Dispatch is asynchronous, so the devices work in
   parallel while the host walks the grid.

**Sum or mean.** With ``loss_reduction="mean"`` (the default) the microbatch results are
averaged: a loss that is a mean over the batch (``jnp.mean``) has, for equal microbatches,
``loss(batch) = mean_m loss(microbatch_m)`` and, by linearity of the derivative, the
same for the gradients. With ``loss_reduction="sum"`` they are added, which is right
for a loss summed over the batch. A loss that is neither (normalised by something that
depends on the whole batch, batch statistics) cannot be split into microbatches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import SingleDeviceSharding

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.primitive import pipeline_p
from pipemark.runtime.schedules import FORWARD, Schedule, make_schedule
from pipemark.staged import StagedJaxpr

__all__ = [
    "LOSS_REDUCTIONS",
    "Pipeline",
    "PipelinePlan",
    "PipelinedStep",
    "pipeline_value_and_grad",
    "pipeline_train_step",
]

LOSS_REDUCTIONS = ("mean", "sum")
_BACKWARD_SUFFIX = "_backward"
_STAGE_MARK_TYPES = frozenset(("start", "end", "jvp_start", "jvp_end"))


# ------------------------------------------------------------------------ checks


def _check_positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipemarkError(f"{what} must be a positive int, got {value!r}.")
    return value


def _microbatch_structs(batch: Any, num_microbatches: int) -> tuple[list[Any], int]:
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


def _check_loss(loss_fn: Callable, params: Any, batch_structs: Any) -> None:
    out = jax.eval_shape(loss_fn, params, batch_structs)
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


# ------------------------------------------------------------------- stage plan


def _has_markers(cj: ClosedJaxpr, mark_types: frozenset[str]) -> bool:
    return any(
        e.primitive is pipeline_p and e.params["mark_type"] in mark_types for e in cj.jaxpr.eqns
    )


def _trace_staged(
    loss_fn: Callable,
    params: Any,
    batch_structs: Any,
    num_stages: int | None,
) -> tuple[StagedJaxpr, Any]:
    """Trace value_and_grad for one microbatch and cut it into forward and mirrored
    backward stages. Returns the staged program and the output tree."""
    from pipemark.passes import layers_from_boundaries, slice_stages

    vag = jax.value_and_grad(loss_fn)
    forward = jax.make_jaxpr(loss_fn)(params, batch_structs)
    if _has_markers(forward, _STAGE_MARK_TYPES):
        cj, out_shape = jax.make_jaxpr(vag, return_shape=True)(params, batch_structs)
    elif _has_markers(forward, frozenset(("boundary",))):
        # Boundary markers have no operands, so their transpose delimits nothing. Turn
        # them into start/end layers in the forward program, then differentiate that:
        # the start/end markers' transpose rule gives the mirrored backward stages.
        layered = jaxpr_as_fun(layers_from_boundaries(forward))
        param_leaves, param_tree = jax.tree_util.tree_flatten(params)
        batch_leaves = jax.tree_util.tree_leaves(batch_structs)

        def flat_loss(p, b):
            return layered(*p, *b)[0]

        cj = jax.make_jaxpr(jax.value_and_grad(flat_loss))(param_leaves, batch_leaves)
        _, out_shape = jax.make_jaxpr(vag, return_shape=True)(params, batch_structs)
        del param_tree
    else:
        if num_stages is None:
            raise PipemarkError(
                "loss_fn has no pipeline markers, so pipeline_value_and_grad cannot tell "
                "where to cut it. Pass num_stages= to cut it automatically into balanced "
                "stages, or mark the layers with pm.mark(..., mark_type='start'/'end') or "
                "pm.mark_pipeline_boundary()."
            )
        from pipemark.passes.auto import auto_layers

        cj, out_shape = jax.make_jaxpr(vag, return_shape=True)(params, batch_structs)
        cj = auto_layers(cj, num_stages)
    return slice_stages(cj), jax.tree_util.tree_structure(out_shape)


def _pair_stages(staged: StagedJaxpr) -> tuple[list[int], list[int | None]]:
    """Sliced-stage indices of each pipeline stage's forward and backward programs."""
    names = [s.name for s in staged.stages]
    forward = [k for k, n in enumerate(names) if not n.endswith(_BACKWARD_SUFFIX)]
    position = {names[k]: k for k in range(len(names))}
    backward: list[int | None] = [position.get(names[k] + _BACKWARD_SUFFIX) for k in forward]
    paired = {b for b in backward if b is not None}
    for k, name in enumerate(names):
        if name.endswith(_BACKWARD_SUFFIX) and k not in paired:
            raise StageGraphError(
                f"Stage {name!r} has no forward stage named "
                f"{name[: -len(_BACKWARD_SUFFIX)]!r} to pair with; the runtime runs each "
                "backward stage on the device of its forward stage. Do not name a forward "
                "stage with a '_backward' suffix."
            )
    return forward, backward


def _merge_into(staged: StagedJaxpr, num_stages: int) -> StagedJaxpr:
    """Merge consecutive marked stages (and their mirrored backward stages) into
    ``num_stages`` pipeline stages of about equal equation counts."""
    from pipemark.passes import merge_stages

    forward, backward = _pair_stages(staged)
    if num_stages == len(forward):
        return staged
    if num_stages > len(forward):
        raise PipemarkError(
            f"num_stages={num_stages}, but loss_fn marks only {len(forward)} stages. Mark "
            f"more layers, or pass num_stages <= {len(forward)}."
        )
    weights = [
        staged.stages[f].num_eqns + (staged.stages[b].num_eqns if b is not None else 0)
        for f, b in zip(forward, backward)
    ]
    prefix = np.cumsum([0, *weights])
    cuts = [0]
    for g in range(1, num_stages):
        # The first cut after the g-th share of the work, leaving a layer per group.
        target = prefix[-1] * g / num_stages
        cut = int(np.searchsorted(prefix, target))
        cut = min(max(cut, cuts[-1] + 1), len(forward) - (num_stages - g))
        cuts.append(cut)
    cuts.append(len(forward))
    groups: dict[str, list[int]] = {}
    for g in range(num_stages):
        members = range(cuts[g], cuts[g + 1])
        groups[f"stage{g}"] = [forward[i] for i in members]
        back = [backward[i] for i in members if backward[i] is not None]
        if back:
            groups[f"stage{g}{_BACKWARD_SUFFIX}"] = back
    return merge_stages(staged, groups)


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
    microbatch_size: int
    num_param_leaves: int
    out_tree: Any
    units: dict[int, _Unit] = dataclasses.field(repr=False)
    readers: dict[tuple[int, int], int] = dataclasses.field(repr=False)
    loss_reduction: str = "mean"

    @property
    def num_stages(self) -> int:
        return len(self.forward_stages)


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
# show the constants' values).
_UNIT_CACHE: dict[Any, tuple[Callable, Callable | None]] = {}
_UNIT_CACHE_SIZE = 256


def _unit_key(closed: ClosedJaxpr, accumulated: list[int], passed: list[int], device: Any) -> Any:
    if closed.consts:
        return None
    jaxpr = closed.jaxpr
    types = tuple(repr(v.aval) for v in (*jaxpr.invars, *jaxpr.outvars))
    return (str(jaxpr), types, tuple(accumulated), tuple(passed), device.platform, device.id)


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


def _build_plan(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    *,
    num_stages: int | None,
    num_microbatches: int,
    schedule: str | Schedule,
    devices: Sequence[Any] | None,
    loss_reduction: str,
) -> PipelinePlan:
    structs, micro = _microbatch_structs(batch, num_microbatches)
    batch_structs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), structs)
    _check_loss(loss_fn, params, batch_structs)
    staged, out_tree = _trace_staged(loss_fn, params, batch_structs, num_stages)
    return _plan_from_staged(
        staged,
        out_tree,
        num_param_leaves=len(jax.tree_util.tree_leaves(params)),
        microbatch_size=micro,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=devices,
        loss_reduction=loss_reduction,
    )


def _plan_from_staged(
    staged: StagedJaxpr,
    out_tree: Any,
    *,
    num_param_leaves: int,
    microbatch_size: int,
    num_stages: int | None,
    num_microbatches: int,
    schedule: str | Schedule,
    devices: Sequence[Any] | None,
    loss_reduction: str,
) -> PipelinePlan:
    """Schedule and compile a staged program whose inputs are ``num_param_leaves``
    replicated leaves followed by the batch leaves (split into microbatches)."""
    if num_stages is not None:
        staged = _merge_into(staged, _check_positive(num_stages, "num_stages"))
    forward, backward = _pair_stages(staged)
    count = len(forward)
    pipeline_stage: dict[int, int] = {}
    for k, (f, b) in enumerate(zip(forward, backward)):
        pipeline_stage[f] = k
        if b is not None:
            pipeline_stage[b] = k
    is_backward = {b for b in backward if b is not None}
    edges = _stage_edges(staged, pipeline_stage, is_backward)

    available = list(jax.devices() if devices is None else devices)
    if len({id(d) for d in available}) != len(available):
        raise PipemarkError("devices lists a device twice; give each pipeline device once.")
    kind = schedule.name if isinstance(schedule, Schedule) else schedule
    if kind == "interleaved":
        num_devices = len(available)
    else:
        num_devices = count
        if count > len(available):
            raise PipemarkError(
                f"The pipeline has {count} stages but only {len(available)} device(s) "
                f"({', '.join(str(d) for d in available)}); each stage needs its own "
                f"device. Pass num_stages={len(available)} (consecutive marked stages are "
                "merged), give more devices (on CPU, set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={count} before JAX starts), or use "
                "schedule='interleaved' to put several stages on each device."
            )
    plan_schedule = make_schedule(
        schedule,
        count,
        num_microbatches,
        stage_graph=sorted(edges),
        num_devices=num_devices,
    )
    if plan_schedule.num_devices > len(available):
        raise PipemarkError(
            f"The schedule {plan_schedule.name!r} uses {plan_schedule.num_devices} devices "
            f"but only {len(available)} are available; pass devices= with enough devices."
        )
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
        microbatch_size=microbatch_size,
        num_param_leaves=num_param_leaves,
        out_tree=out_tree,
        units=units,
        readers=readers,
        loss_reduction=loss_reduction,
    )


# ---------------------------------------------------------------------- running


def _split_leaf(leaf: Any, num_microbatches: int, micro: int) -> list[Any]:
    if isinstance(leaf, jax.Array):
        return [leaf[m * micro : (m + 1) * micro] for m in range(num_microbatches)]
    array = np.asarray(leaf)
    return [array[m * micro : (m + 1) * micro] for m in range(num_microbatches)]


def _run_plan(plan: PipelinePlan, params: Any, batch: Any, timings: dict | None) -> Any:
    staged = plan.staged
    schedule = plan.schedule
    num_micro = schedule.num_microbatches
    param_leaves = jax.tree_util.tree_leaves(params)
    batch_leaves = jax.tree_util.tree_leaves(batch)
    num_params = plan.num_param_leaves
    slices = [_split_leaf(x, num_micro, plan.microbatch_size) for x in batch_leaves]

    placed_inputs: dict[tuple[int, int, Any], Any] = {}  # (input, microbatch, device)
    values: dict[tuple[int, int, int], dict[Any, Any]] = {}  # (mb, stage, out) -> copies
    remaining: dict[tuple[int, int, int], int] = {}
    accs: dict[int, list[Any]] = {}

    def fetch_input(i: int, m: int, device: Any) -> Any:
        key = (i, -1 if i < num_params else m, device)
        value = placed_inputs.get(key)
        if value is None:
            source = param_leaves[i] if i < num_params else slices[i - num_params][m]
            value = placed_inputs[key] = jax.device_put(source, device)
        return value

    def fetch_stage(stage: int, out: int, m: int, device: Any) -> Any:
        key = (m, stage, out)
        copies = values[key]
        value = copies.get(device)
        if value is None:
            value = copies[device] = jax.device_put(next(iter(copies.values())), device)
        left = remaining[key] - 1
        if left:
            remaining[key] = left
        else:  # the last reader has it: free every copy
            del values[key], remaining[key]
        return value

    scale = np.float32(1.0 / num_micro if plan.loss_reduction == "mean" else 1.0)
    scales: dict[Any, Any] = {}
    start = time.perf_counter()
    for _, _, action in schedule.actions():
        k, m = action.stage, action.microbatch
        index = plan.forward_stages[k] if action.kind == FORWARD else plan.backward_stages[k]
        if index is None:  # a stage without a backward program
            continue
        unit = plan.units[index]
        stage = staged.stages[index]
        device = unit.device
        inputs = [
            fetch_input(ref.index, m, device)
            if ref.kind == "input"
            else fetch_stage(ref.stage, ref.index, m, device)
            for ref in stage.inputs
        ]
        if unit.zeros is not None and index not in accs:
            accs[index] = unit.zeros()
        device_scale = scales.get(device)
        if device_scale is None:
            device_scale = scales[device] = jax.device_put(scale, device)
        new_accs, outs = unit.run(accs.get(index, []), inputs, device_scale)
        if unit.accumulated:
            accs[index] = new_accs
        for o, value in zip(unit.passed, outs):
            values[(m, index, o)] = {device: value}
            remaining[(m, index, o)] = plan.readers[(index, o)]
    if timings is not None:
        timings["dispatch_s"] = time.perf_counter() - start
        timings["num_actions"] = sum(
            1
            for _, _, a in schedule.actions()
            if (plan.forward_stages if a.kind == FORWARD else plan.backward_stages)[a.stage]
            is not None
        )
        timings["num_ticks"] = schedule.num_ticks
    values.clear()  # every reader has run: nothing is left but, defensively, free it all

    results: list[Any] = [None] * len(staged.outputs)
    for index, unit in plan.units.items():
        for slot, (r, _) in enumerate(unit.accumulated):
            results[r] = accs[index][slot]
    for r, ref in enumerate(staged.outputs):
        if ref.kind == "stage":
            continue
        # A result that is a program input or a constant: the same reduction, on the host.
        if ref.kind == "input":
            parts = [
                np.asarray(param_leaves[ref.index])
                if ref.index < num_params
                else np.asarray(slices[ref.index - num_params][m])
                for m in range(num_micro)
            ]
        else:
            value = getattr(ref.value, "val", ref.value)
            parts = [np.asarray(value)] * num_micro
        total = sum(parts[1:], parts[0])
        results[r] = jnp.asarray(total * scale if plan.loss_reduction == "mean" else total)
    return jax.tree_util.tree_unflatten(plan.out_tree, results)


# ------------------------------------------------------------------------ public


class Pipeline:
    """``(params, batch) -> (loss, grads)`` computed as a pipeline; made by
    :func:`pipeline_value_and_grad`.

    The first call for a given input structure and shape traces, slices and compiles
    (:meth:`plan` does only that); later calls reuse the compiled stages.
    """

    def __init__(
        self,
        loss_fn: Callable,
        *,
        num_stages: int | None,
        num_microbatches: int,
        schedule: str | Schedule,
        devices: Sequence[Any] | None,
        loss_reduction: str,
    ) -> None:
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.devices = devices
        self.loss_reduction = loss_reduction
        self._plans: dict[Any, PipelinePlan] = {}

    def _key(self, params: Any, batch: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((params, batch))
        return tree, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves)

    def plan(self, params: Any, batch: Any) -> PipelinePlan:
        """Trace, slice, schedule and compile for inputs shaped like these (cached)."""
        key = self._key(params, batch)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _build_plan(
                self.loss_fn,
                params,
                batch,
                num_stages=self.num_stages,
                num_microbatches=self.num_microbatches,
                schedule=self.schedule,
                devices=self.devices,
                loss_reduction=self.loss_reduction,
            )
        return plan

    def __call__(self, params: Any, batch: Any) -> tuple[Any, Any]:
        return _run_plan(self.plan(params, batch), params, batch, None)

    def timed_call(self, params: Any, batch: Any) -> tuple[tuple[Any, Any], dict[str, float]]:
        """Like calling the pipeline, and also return timings: ``dispatch_s`` (host time
        to walk the schedule and dispatch every action), ``num_actions`` and
        ``num_ticks``. The results are not waited for."""
        timings: dict[str, float] = {}
        out = _run_plan(self.plan(params, batch), params, batch, timings)
        return out, timings


def pipeline_value_and_grad(
    loss_fn: Callable[[Any, Any], Any],
    *,
    num_stages: int | None = None,
    num_microbatches: int,
    schedule: str | Schedule = "1f1b",
    devices: Sequence[Any] | None = None,
    loss_reduction: str = "mean",
) -> Pipeline:
    """``jax.value_and_grad(loss_fn)`` computed as a pipeline over several devices.

    Parameters
    ----------
    loss_fn:
        ``loss_fn(params, batch)`` returning a scalar loss; gradients are taken with
        respect to ``params``. Its layers are marked with :func:`pipemark.mark`
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
        ``num_stages`` a multiple of the number of devices) or a
        :class:`~pipemark.runtime.schedules.Schedule`.
    devices:
        The devices to use; default ``jax.devices()``. Pipeline stage ``i`` runs on
        ``devices[i]`` (on ``devices[i % len(devices)]`` when interleaved).
    loss_reduction:
        ``"mean"`` (default) averages the microbatch losses and gradients, right for a
        loss that is a mean over the batch; ``"sum"`` adds them, right for a sum.

    Returns
    -------
    Pipeline
        A function ``(params, batch) -> (loss, grads)`` equal to
        ``jax.value_and_grad(loss_fn)(params, batch)`` up to float rounding. Each
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
    _check_positive(num_microbatches, "num_microbatches")
    if num_stages is not None:
        _check_positive(num_stages, "num_stages")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise PipemarkError(
            f"Unknown loss_reduction {loss_reduction!r}; use 'mean' for a loss averaged "
            "over the batch or 'sum' for a loss summed over it."
        )
    if not isinstance(schedule, Schedule) and schedule not in ("gpipe", "1f1b", "interleaved"):
        raise PipemarkError(
            f"Unknown schedule {schedule!r}; choose 'gpipe', '1f1b' or 'interleaved', or "
            "pass a pm.Schedule."
        )
    return Pipeline(
        loss_fn,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=devices,
        loss_reduction=loss_reduction,
    )


# ------------------------------------------------------------------ training step


class PipelinedStep:
    """A training step whose gradient part runs as a pipeline; made by
    :func:`pipeline_train_step`."""

    def __init__(self, step_fn: Callable, **options: Any) -> None:
        self.step_fn = step_fn
        self.options = options
        self._prepared: dict[Any, tuple[PipelinePlan, Callable, Any]] = {}

    def plan(self, *args: Any) -> PipelinePlan:
        """The pipeline plan of the gradient part, for arguments shaped like these."""
        return self._prepare(args)[0]

    def _prepare(self, args: tuple[Any, ...]) -> tuple[PipelinePlan, Callable, Any]:
        from pipemark.passes import slice_stages, split_at_gradient

        if not args:
            raise PipemarkError(
                "A pipelined training step needs at least the batch argument (the last one)."
            )
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves))
        prepared = self._prepared.get(key)
        if prepared is not None:
            return prepared
        *replicated, batch = args
        num_micro = self.options["num_microbatches"]
        structs, micro = _microbatch_structs(batch, num_micro)
        batch_structs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(batch), structs)
        # The gradient part is traced for one microbatch (it runs per microbatch); the
        # update is traced for the whole batch (it runs once, and may read the batch).
        compute, _ = split_at_gradient(jax.make_jaxpr(self.step_fn)(*replicated, batch_structs))
        full, out_shape = jax.make_jaxpr(self.step_fn, return_shape=True)(*args)
        compute_full, apply = split_at_gradient(full)
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
        num_stages = self.options["num_stages"]
        if not _has_markers(compute, _STAGE_MARK_TYPES):
            if num_stages is None:
                raise PipemarkError(
                    "The gradient part of the step has no start/end stage markers; mark the "
                    "loss's layers with pm.mark(..., mark_type='start'/'end') or pass "
                    "num_stages= to cut it automatically."
                )
            from pipemark.passes.auto import auto_layers

            compute = auto_layers(compute, num_stages)
        plan = _plan_from_staged(
            slice_stages(compute),
            jax.tree_util.tree_structure([0] * len(micro_avals)),
            num_param_leaves=len(jax.tree_util.tree_leaves(tuple(replicated))),
            microbatch_size=micro,
            num_stages=num_stages,
            num_microbatches=num_micro,
            schedule=self.options["schedule"],
            devices=self.options["devices"],
            loss_reduction=self.options["loss_reduction"],
        )
        prepared = (
            plan,
            jax.jit(jaxpr_as_fun(apply)),
            jax.tree_util.tree_structure(out_shape),
        )
        self._prepared[key] = prepared
        return prepared

    def __call__(self, *args: Any) -> Any:
        plan, apply, out_tree = self._prepare(args)
        *replicated, batch = args
        accumulated = _run_plan(plan, tuple(replicated), batch, None)
        # The update runs once, on the first stage's device, over the whole inputs and
        # the accumulated gradients.
        inputs = jax.device_put([*jax.tree_util.tree_leaves(args), *accumulated], plan.devices[0])
        return jax.tree_util.tree_unflatten(out_tree, apply(*inputs))


def pipeline_train_step(
    step_fn: Callable[..., Any],
    *,
    num_stages: int | None = None,
    num_microbatches: int,
    schedule: str | Schedule = "1f1b",
    devices: Sequence[Any] | None = None,
    loss_reduction: str = "mean",
) -> PipelinedStep:
    """A training step ``step_fn(*state, batch)`` whose gradients are computed as a
    pipeline and then applied once.

    ``step_fn`` computes gradients with ``jax.grad``/``jax.value_and_grad`` of a loss
    whose layers are marked, marks them with :func:`pipemark.mark_gradient`, and updates
    (see :func:`pipemark.examples.train_step`). It is cut at the grad marker with
    :func:`pipemark.passes.split_at_gradient`: the part before runs as a pipeline over
    ``num_microbatches`` microbatches of ``batch`` (its last argument), every value it
    hands to the update (the gradients, the loss) averaged over microbatches (or added,
    with ``loss_reduction="sum"``); the part after runs once, on the first stage's
    device, with those values. The other options are those of
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
    checked = pipeline_value_and_grad(
        step_fn,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=devices,
        loss_reduction=loss_reduction,
    )
    return PipelinedStep(
        step_fn,
        num_stages=checked.num_stages,
        num_microbatches=checked.num_microbatches,
        schedule=checked.schedule,
        devices=checked.devices,
        loss_reduction=checked.loss_reduction,
    )
