"""Plan a training step for a cluster you do not have: :func:`predict_layout` predicts
the step time and per-chip peak memory of one :class:`~pipemark.runtime.planning.workload.Layout`
of a model (:class:`~pipemark.runtime.planning.workload.Transformer` or
:class:`~pipemark.runtime.planning.workload.MeasuredPipeline`) on a
:class:`~pipemark.runtime.planning.cluster.Cluster`; :func:`rank_layouts` predicts every layout
of a search space, refuses those that do not fit in HBM, ranks the rest and says why
the best wins (:meth:`Ranking.explain`).

How a step is predicted:

1. **Compute**: the pipeline's actions on :func:`~pipemark.simulate_schedule` (the same
   simulator the runtime's schedules are compared on), each action's cost from the
   model (:class:`~pipemark.runtime.planning.workload.StageWork`), the values between stages
   delayed by their transfer (:func:`~pipemark.runtime.planning.cluster.transfer_seconds`: ICI
   within a slice, DCN across). Tensor-parallel collectives are inside the actions.
2. **FSDP gather**: a stage's bfloat16 weights are all-gathered layer by layer ahead
   of the compute that needs them (``Layout.gather``): once a step, before the stage's
   first forward, or before each forward and backward action. The action waits for
   the first layer's part and for what the gather takes beyond its other layers'
   compute.
3. **Gradient reduction** (``Layout.reduce``): float32 gradients reduce-scattered
   over FSDP and all-reduced over DP, once a step (delayed: they accumulate over the
   microbatches), or the reduce-scatter after every microbatch's gradients and the
   DP all-reduce once, or both every microbatch. A device's reductions queue on its
   network one after another; with ``overlap=True`` each starts layer by layer during
   the action that makes its gradients (the last layers' gradients are final first),
   otherwise when that action ends; with ``reduce_gradients="end_of_call"`` (the
   runtime's option) the reduction once a step waits for the pipeline's last action.
   Whatever runs past the device's last action is *exposed*.
4. **Update**: AdamW reads and writes about 30 bytes per parameter of the chip's FSDP
   shard (float32 master, two moments, gradient; bfloat16 weights) at HBM bandwidth.

Per-chip peak memory: bfloat16 weights (2 bytes a parameter, sharded by TP; by FSDP
too when gathered every microbatch, with two layers whole), float32 gradient
accumulators (4, sharded by TP; by FSDP too when reduce-scattered every microbatch,
with one layer's whole), AdamW's float32 master and moments (12, sharded by TP and
FSDP), the activations of the microbatches in flight (walking each device's actions in
schedule order: a microbatch's activations are held from its forward to its last
backward action of that stage; with ``dispatch_ahead`` the forwards dispatched ahead of
the action running hold theirs too, except one run with its own backward as one
program) and the largest temporary of a stage's program.

>>> from pipemark.runtime.planning.cluster import tpu_v5e
>>> from pipemark.runtime.planning.workload import Layout, Transformer
>>> layout = Layout(pp=4, fsdp=64, microbatches=16, remat=True)
>>> p = predict_layout(Transformer.llama2_7b(), layout, tpu_v5e(256), global_batch=1024)
>>> p.fits, round(p.step_seconds, 1), round(p.bubble_fraction, 2)
(True, 7.9, 0.19)
>>> p.compute
"measured: TPU v5 lite layer records of 2026-12-07, nearest family 'base'"
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from pipemark.errors import PipemarkError
from pipemark.roles import BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.options import GRADIENT_REDUCTIONS, check_positive
from pipemark.runtime.planning.cluster import (
    Cluster,
    axis_group,
    collective_seconds,
    transfer_seconds,
)
from pipemark.runtime.planning.dispatches import programs, stage_classes
from pipemark.runtime.planning.workload import Layout, StageWork
from pipemark.runtime.schedules.core import Action, Schedule
from pipemark.runtime.schedules.problem import ScheduleProblem
from pipemark.runtime.schedules.registry import build_schedule, schedule_entry
from pipemark.runtime.schedules.simulation import Simulation, simulate_schedule

__all__ = [
    "HBM_MARGIN",
    "LayoutPrediction",
    "Ranking",
    "Refusal",
    "predict_layout",
    "rank_layouts",
    "search_layouts",
]
_GIB = 2**30
#: The fraction of each chip's HBM a layout must leave free (:func:`rank_layouts`): the
#: memory model counts weights, gradients, optimizer state, activations and the logits,
#: not XLA's other temporaries, its copies or the allocator's fragmentation. 10 %: the
#: runtime's own memory prediction, which reads the compiled programs' temporaries,
#: came within 0.88-1.15 x of the peaks measured on v5e (docs/benchmarks/tpu-v5e.md), and a
#: layout predicted closer than that to the limit cannot be told from one that does
#: not fit.
HBM_MARGIN = 0.10
_UPDATE_BYTES = 30  # AdamW: read and write master, moments, gradient; write bf16 weights


@dataclasses.dataclass(frozen=True)
class LayoutPrediction:
    """What :func:`predict_layout` predicts for one layout, in seconds and bytes.

    ``step_seconds`` is the busiest device's end: its compute (``compute_seconds``,
    of which ``tp_seconds`` are exposed tensor-parallel collectives), the FSDP gather
    its first forwards wait for (``gather_seconds``), its idle time inside the
    pipeline (``idle_seconds``: bubble and transfer waits), its waits for the host to
    dispatch its next action (``host_seconds``), the gradient reduction left after its
    last action (``reduction_seconds``) and the update (``update_seconds``).
    ``memory`` breaks the worst chip's peak down; ``usable_bytes`` is the HBM a layout
    may fill (``hbm_bytes`` less the margin kept free). ``compute`` says where the
    compute seconds come from: the measured layer records (and, for another chip than
    the one measured, the specifications they were scaled by), or an assumed
    ``efficiency``."""

    layout: Layout
    cluster: str
    step_seconds: float
    compute_seconds: float
    tp_seconds: float
    gather_seconds: float
    idle_seconds: float
    host_seconds: float
    reduction_seconds: float
    update_seconds: float
    bubble_fraction: float
    peak_bytes: float
    hbm_bytes: int
    usable_bytes: float
    memory: dict[str, float]
    mfu: float
    compute: str = ""

    @property
    def fits(self) -> bool:
        """Whether the peak fits in the chip's HBM with the margin left free."""
        return self.peak_bytes <= self.usable_bytes

    @property
    def exposed_communication(self) -> float:
        """Seconds of the step spent waiting for collectives: TP, FSDP gather, reduction."""
        return self.tp_seconds + self.gather_seconds + self.reduction_seconds

    def summary(self) -> str:
        """One line: the layout, its step, MFU, bubble, exposed communication, memory."""
        return (
            f"{self.layout}: {self.step_seconds:.3f} s/step, MFU {self.mfu:.0%}, bubble "
            f"{self.bubble_fraction:.0%}, exposed communication {self.exposed_communication:.3f} s, "
            f"peak {self.peak_bytes / _GIB:.1f} of {self.usable_bytes / _GIB:.1f} GiB usable "
            f"({self.hbm_bytes / _GIB:.1f} GiB less the margin)"
        )


def _tp_seconds(cluster: Cluster, layout: Layout) -> Callable[[float], float]:
    group = axis_group(cluster, layout.sizes, "tp")
    return functools.partial(collective_seconds, cluster, "all_reduce", group=group)


@functools.lru_cache(maxsize=256)
def _schedule(name: str, stages: int, devices: int, microbatches: int, ratios: tuple) -> Schedule:
    """The schedule for stages of equal costs in these ``(F, B, W)`` ratios."""
    forward, backward, weight = ratios
    problem = ScheduleProblem(
        stages,
        microbatches,
        splits_backward=schedule_entry(name).splits_backward,
        num_devices=devices,
        forward_time=forward,
        backward_time=backward,
        weight_time=weight,
    )
    return build_schedule(name, problem)


def _build(layout: Layout, work: StageWork) -> Schedule:
    """The layout's schedule. A zero-bubble builder places actions by their costs (and
    takes seconds for large pipelines): it is given equal stages in the model's mean
    F : B : W ratios, rounded to a quarter, so that similar layouts share one build; the
    simulation then runs it with each stage's own costs."""
    count = len(work.forward)
    forward = sum(work.forward) / count or 1.0
    ratios = tuple(
        round(4 * sum(values) / count / forward) / 4
        for values in (work.forward, work.backward, work.weight)
    )
    return _schedule(layout.schedule, layout.num_stages, layout.pp, layout.microbatches, ratios)


@functools.lru_cache(maxsize=256)
def _orders(
    schedule: Schedule,
) -> tuple[tuple[tuple[Action, ...], ...], dict[tuple[int, int], Action]]:
    """Each device's actions in order, and the action that makes each (stage,
    microbatch)'s parameter gradients: its weight action where the backward is split,
    else its backward."""
    orders = tuple(tuple(order) for order in schedule.device_orders())
    made: dict[tuple[int, int], Action] = {}
    for order in orders:
        for action in order:
            if action.kind == WEIGHT or (
                action.kind == BACKWARD and (action.stage, action.microbatch) not in made
            ):
                made[(action.stage, action.microbatch)] = action
    return orders, made


def _transfer(cluster: Cluster, layout: Layout, work: StageWork, schedule: Schedule):
    """The delay of a value from ``producer`` to ``reader``: the stage boundary's bytes
    over ICI, or over DCN where the two pipeline ranks are in different slices."""
    group = axis_group(cluster, layout.sizes, "pp")
    devices = schedule.stage_devices

    def delay(producer: Action, reader: Action) -> float:
        a, b = devices[producer.stage], devices[reader.stage]
        across = group.dcn > 1 and a // group.ici != b // group.ici
        sender = min(producer.stage, reader.stage)
        return transfer_seconds(cluster, work.boundary_bytes[sender], across)

    return delay


def _layer_parameters(work: StageWork, stage: int) -> float:
    return work.parameters[stage] / work.layers[stage]


def _hidden_behind(collective: float, compute: float, layers: int) -> float:
    """What a collective done layer by layer ahead of (or behind) ``compute`` leaves
    exposed: one layer's part, or what it takes beyond the other layers' compute."""
    return max(collective / layers, collective - compute * (layers - 1) / layers)


def _gather_cost(cluster: Cluster, layout: Layout, work: StageWork, table: dict):
    """The FSDP gather an action waits for (0 without FSDP): the whole stage before its
    first forward, or before every forward and backward (``gather="microbatch"``)."""
    if layout.fsdp == 1:
        return lambda action: 0.0
    group = axis_group(cluster, layout.sizes, "fsdp")
    seconds = [
        collective_seconds(cluster, "all_gather", 2 * p / layout.tp, group) for p in work.parameters
    ]

    def wait(action: Action) -> float:
        j = action.stage
        if layout.gather == "step":
            due = action.kind == FORWARD and action.microbatch == 0
        else:
            due = action.kind in (FORWARD, BACKWARD)
        if not due:
            return 0.0
        return _hidden_behind(seconds[j], table[action.kind][j], work.layers[j])

    return wait


def _reductions(cluster: Cluster, layout: Layout, parameters: float) -> tuple[float, float]:
    """Seconds of the reduce-scatter of a stage's float32 gradients over FSDP, and of
    the all-reduce of the shard over DP."""
    nbytes = 4 * parameters / layout.tp
    sizes = layout.sizes
    scatter = collective_seconds(
        cluster, "reduce_scatter", nbytes, axis_group(cluster, sizes, "fsdp")
    )
    shard = nbytes / layout.fsdp
    return scatter, collective_seconds(
        cluster, "all_reduce", shard, axis_group(cluster, sizes, "dp")
    )


def _reduction_chunks(
    cluster: Cluster,
    layout: Layout,
    work: StageWork,
    schedule: Schedule,
    simulation: Simulation,
    overlap: bool,
    at_end: bool = False,
) -> list[list[tuple[float, float]]]:
    """Per device, ``(ready, seconds)`` of each piece of gradient reduction: a
    collective after a gradient action, in one piece ready when the action ends, or
    (``overlap``) one a layer, ready as the action goes; with ``at_end``, the
    reduction once a step ready when the pipeline's last action ends."""
    made = _orders(schedule)[1]
    last = {}
    for action in made.values():
        old = last.get(action.stage)
        if old is None or simulation.finish[action] > simulation.finish[old]:
            last[action.stage] = action
    end_of_step = max(simulation.finish.values(), default=0.0)
    seconds = [_reductions(cluster, layout, p) for p in work.parameters]
    chunks: list[list[tuple[float, float]]] = [[] for _ in range(schedule.num_devices)]
    for action in made.values():
        j = action.stage
        device = schedule.stage_devices[j]
        scatter, allreduce = seconds[j]
        # What each gradient action reduces, and what the stage's reduces once a step.
        each, once = {
            "step": (0.0, scatter + allreduce),
            "scatter": (scatter, allreduce),
        }.get(layout.reduce, (scatter + allreduce, 0.0))
        if action != last[j]:
            once = 0.0
        elif at_end and once:
            chunks[device].append((end_of_step, once))
            once = 0.0
        total = each + once
        if not total:
            continue
        begin, end = simulation.start[action], simulation.finish[action]
        parts = work.layers[j] if overlap else 1
        for i in range(parts):
            ready = begin + (end - begin) * (i + 1) / parts if overlap else end
            chunks[device].append((ready, total / parts))
    return chunks


def _device_ends(simulation: Simulation, schedule: Schedule, chunks) -> list[float]:
    """Per device, when its last gradient reduction ends (or its last action, if
    later): its reductions queued on its network in the order they become ready."""
    ends = []
    for d, order in enumerate(_orders(schedule)[0]):
        clock = max((simulation.finish[a] for a in order), default=0.0)
        network = 0.0
        for ready, length in sorted(chunks[d]):
            network = max(network, ready) + length
        ends.append(max(clock, network))
    return ends


def _in_flight(
    work: StageWork, schedule: Schedule, column: Sequence[tuple[Action, ...]], ahead: int | None
) -> float:
    """The most activation bytes a device holds: each (stage, microbatch)'s from its
    forward to the action that makes its gradients, and while a program runs, those of
    the forwards in the next ``ahead`` programs (``dispatch_ahead``: dispatched already,
    their results allocated; ``None``: every later program), as the runtime's memory
    model counts them (:func:`pipemark.runtime.memory.held_in_flight`). ``column``: the
    device's programs in order (:func:`pipemark.runtime.planning.dispatches.programs`)."""
    made = _orders(schedule)[1]
    freed = set(made.values())
    # What dispatching each program allocates: its forwards' activations, but those
    # whose gradients it makes too (a forward run with its backward stays inside).
    sizes = [
        sum(
            work.activation_bytes[a.stage]
            for a in unit
            if a.kind == FORWARD and made.get(a[:2]) not in unit
        )
        for unit in column
    ]
    prefix = list(itertools.accumulate(sizes, initial=0.0))  # prefix[n]: sum(sizes[:n])
    live = peak = 0.0
    for n, unit in enumerate(column):
        live += sum(work.activation_bytes[a.stage] for a in unit if a.kind == FORWARD)
        end = len(column) if ahead is None else min(len(column), n + 1 + ahead)
        peak = max(peak, live + prefix[end] - prefix[n + 1])
        live -= sum(work.activation_bytes[a.stage] for a in unit if a in freed)
    return peak


def _chip_parts(
    layout: Layout, work: StageWork, stages: Sequence[int], activations: float
) -> dict[str, float]:
    """The bytes a chip holding ``stages`` needs, by part (see the module's text)."""
    tp, fsdp = layout.tp, layout.fsdp
    parameters = sum(work.parameters[j] for j in stages)
    layer = max(_layer_parameters(work, j) for j in stages) / tp
    weights = 2 * parameters / tp
    if layout.gather == "microbatch" and fsdp > 1:
        weights = 2 * parameters / (tp * fsdp) + 2 * 2 * layer
    gradients = 4 * parameters / tp
    if layout.reduce != "step" and fsdp > 1:
        gradients = 4 * parameters / (tp * fsdp) + 4 * layer
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer": 12 * parameters / (tp * fsdp),
        "activations": activations,
        "temporaries": max(work.temporary_bytes[j] for j in stages),
    }


def _memory(
    layout: Layout,
    work: StageWork,
    schedule: Schedule,
    ahead: int | None,
    fused: Mapping[Action, tuple[Action, ...]],
) -> tuple[float, dict[str, float]]:
    """The worst chip's peak bytes and their parts (``ahead``: ``dispatch_ahead``;
    ``fused``: the programs, :func:`_programs`)."""
    worst: tuple[float, dict[str, float]] = (-1.0, {})
    for d, order in enumerate(_orders(schedule)[0]):
        stages = [j for j, device in enumerate(schedule.stage_devices) if device == d]
        column = [fused[a] for a in order if a in fused]
        parts = _chip_parts(layout, work, stages, _in_flight(work, schedule, column, ahead))
        if sum(parts.values()) > worst[0]:
            worst = (sum(parts.values()), parts)
    return worst


def _state_bytes(layout: Layout, work: StageWork) -> tuple[float, dict[str, float]]:
    """A lower bound of the layout's peak a chip, without simulating it: the largest of
    a stage's state and one microbatch's activations (every device holds a stage)."""
    worst: tuple[float, dict[str, float]] = (-1.0, {})
    for j, held in enumerate(work.activation_bytes):
        parts = _chip_parts(layout, work, [j], held)
        if sum(parts.values()) > worst[0]:
            worst = (sum(parts.values()), parts)
    return worst


def _least_seconds(layout: Layout, work: StageWork) -> float:
    """A lower bound of the layout's step, without simulating it: the pipeline's
    compute spread evenly over its devices; with one stage a device, also the first
    device's work and then the backwards of the first microbatch's other stages (its
    last action needs them), and the last device's work after the first microbatch's
    forwards of the stages before it."""
    m, count = layout.microbatches, len(work.forward)
    per_stage = [m * (f + b + w) for f, b, w in zip(work.forward, work.backward, work.weight)]
    bound = sum(per_stage) / layout.pp
    if layout.stages_per_device == 1 and count > 1:
        first = per_stage[0] + sum(work.backward[1:])
        last = sum(work.forward[:-1]) + per_stage[-1]
        bound = max(bound, first, last)
    return bound


def predict_layout(
    model: Any,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch: int,
    overlap: bool = True,
    update: bool = True,
    dispatch_ahead: int | None = 2,
    hbm_margin: float = HBM_MARGIN,
    reduce_gradients: str = "after_stage",
    fuse_actions: int = 2,
    fuse_min_uses: int | None = None,
) -> LayoutPrediction:
    """Predict one step of ``model`` (a :class:`~pipemark.runtime.planning.workload.Transformer`
    or :class:`~pipemark.runtime.planning.workload.MeasuredPipeline`) laid out as ``layout`` on
    ``cluster``, ``global_batch`` sequences (rows) a step (see the module's text).
    ``overlap``: whether a gradient reduction starts during the backward that makes
    its gradients (else when it ends); ``reduce_gradients``: the runtime's option of
    that name, ``"after_stage"`` (as ``overlap`` says) or ``"end_of_call"`` (a
    stage's reduction once a step starts when the pipeline's last action ends, the
    reductions every microbatch as ``overlap`` says); ``update``: whether the step
    ends with the optimizer update;
    ``dispatch_ahead``: the runtime's option of that name (its default, 2), how far
    the host may dispatch ahead of a device (each action then costs the host
    :meth:`~pipemark.runtime.planning.cluster.Cluster.dispatch_cost`); ``fuse_actions`` and
    ``fuse_min_uses``: the runtime's options, which actions of a device it runs as one
    program, one dispatch (:mod:`pipemark.runtime.planning.dispatches`; no runs fused on a
    layout over several hosts); ``hbm_margin``: the fraction of HBM a layout must
    leave free to fit (:data:`HBM_MARGIN`).

    >>> from pipemark.runtime.planning.workload import MeasuredPipeline
    >>> from pipemark.runtime.planning.cluster import tpu_v5e
    >>> measured = MeasuredPipeline({"forward": 1.0, "backward": 2.0},
    ...                             Layout(pp=2, microbatches=4), global_batch=4)
    >>> p = predict_layout(measured, Layout(pp=2, microbatches=4), tpu_v5e(2),
    ...                    global_batch=4, update=False)
    >>> round(p.step_seconds, 2), round(p.bubble_fraction, 3)  # (M + S - 1)(F + B)
    (15.0, 0.2)
    >>> p.host_seconds  # the first action's dispatch: 0.59 ms on a v5e host, bounded
    0.00059
    """
    _check_options(layout, cluster, reduce_gradients, fuse_actions, fuse_min_uses)
    usable = _usable_bytes(cluster, hbm_margin)
    work = model.stage_work(
        layout, global_batch=global_batch, peak_flops=cluster.peak_flops,
        tp_seconds=_tp_seconds(cluster, layout), hbm_bandwidth=cluster.hbm_bandwidth,
    )  # fmt: skip
    schedule = _build(layout, work)
    table = work.costs
    split = schedule.splits_backward
    gather = _gather_cost(cluster, layout, work, table)

    def cost(action: Action) -> float:
        own = table[action.kind][action.stage]
        if action.kind == BACKWARD and not split:
            own += table[WEIGHT][action.stage]
        return own + gather(action)

    # A backward that a splitting schedule runs whole (DualPipeV) pays B + W: the
    # simulator asks this cost for its weight half.
    delay = _transfer(cluster, layout, work, schedule)
    fused = _programs(layout, cluster, work, schedule, fuse_actions, fuse_min_uses)
    simulation = simulate_schedule(
        schedule, cost, transfer=delay, dispatch=cluster.dispatch_cost(dispatch_ahead),
        dispatch_ahead=dispatch_ahead, wake=cluster.wake_seconds, programs=fused,
    )  # fmt: skip
    at_end = reduce_gradients == "end_of_call"
    chunks = _reduction_chunks(cluster, layout, work, schedule, simulation, overlap, at_end)
    ends = _device_ends(simulation, schedule, chunks)
    waits = [0.0] * schedule.num_devices
    for order in _orders(schedule)[0]:
        for action in order:
            waits[schedule.stage_devices[action.stage]] += gather(action)
    prediction = _prediction(
        layout, cluster, work, schedule, simulation, ends, waits, update, dispatch_ahead, fused
    )
    return dataclasses.replace(prediction, usable_bytes=usable)


def _programs(
    layout: Layout,
    cluster: Cluster,
    work: StageWork,
    schedule: Schedule,
    fuse_actions: int = 2,
    fuse_min_uses: int | None = None,
) -> dict[Action, tuple[Action, ...]]:
    """The programs the runtime dispatches for the layout's schedule (no runs fused
    under ``jax.distributed``: a layout over several hosts)."""
    classes = stage_classes(list(zip(work.forward, work.backward, work.weight, work.parameters)))
    return programs(
        schedule, classes, fuse_actions=fuse_actions, fuse_min_uses=fuse_min_uses,
        distributed=layout.chips > cluster.chips_per_host,
    )  # fmt: skip


def _check_options(
    layout: Layout, cluster: Cluster, reduce_gradients: str, fuse: Any, min_uses: Any
) -> None:
    """:func:`predict_layout`'s arguments that the cluster or the runtime refuses."""
    if layout.chips > cluster.num_chips:
        raise PipemarkError(
            f"{layout} needs {layout.chips} chips but {cluster.name} has {cluster.num_chips}."
        )
    if reduce_gradients not in GRADIENT_REDUCTIONS:
        raise PipemarkError(
            f"reduce_gradients is {reduce_gradients!r}; use one of {GRADIENT_REDUCTIONS} "
            "(the runtime's option of that name)."
        )
    check_positive(fuse, "fuse_actions")
    if min_uses is not None:
        check_positive(min_uses, "fuse_min_uses (or None)")


def _usable_bytes(cluster: Cluster, margin: Any) -> float:
    """The HBM a layout may fill: ``cluster.hbm_bytes`` less ``margin`` of it."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise PipemarkError(
            f"hbm_margin = {margin!r}; give the fraction of HBM to keep free, in [0, 1)."
        )
    return cluster.hbm_bytes * (1 - margin)


def _prediction(
    layout: Layout,
    cluster: Cluster,
    work: StageWork,
    schedule: Schedule,
    simulation: Simulation,
    ends: list[float],
    waits: list[float],
    update: bool,
    ahead: int | None,
    fused: Mapping[Action, tuple[Action, ...]],
) -> LayoutPrediction:
    """The parts of the step on its busiest device, and the memory (``ahead``:
    ``dispatch_ahead``; ``fused``: the programs)."""
    shard = [0.0] * schedule.num_devices
    tp = [0.0] * schedule.num_devices
    m = schedule.num_microbatches
    for j, device in enumerate(schedule.stage_devices):
        shard[device] += work.parameters[j] / (layout.tp * layout.fsdp)
        tp[device] += m * work.tp_seconds[j]
    updates = [_UPDATE_BYTES * s / cluster.hbm_bandwidth if update else 0.0 for s in shard]
    totals = [e + u for e, u in zip(ends, updates)]
    d = max(range(len(totals)), key=totals.__getitem__)
    makespan = max((simulation.finish[a] for a in _orders(schedule)[0][d]), default=0.0)
    busy = simulation.busy[d]
    peak, parts = _memory(layout, work, schedule, ahead, fused)
    step = totals[d]
    flops = work.flops
    return LayoutPrediction(
        layout=layout,
        cluster=cluster.name,
        step_seconds=step,
        compute_seconds=busy - tp[d] - waits[d],
        tp_seconds=tp[d],
        gather_seconds=waits[d],
        idle_seconds=makespan - busy - simulation.host_wait[d],
        host_seconds=simulation.host_wait[d],
        reduction_seconds=ends[d] - makespan,
        update_seconds=updates[d],
        bubble_fraction=simulation.bubble_fraction,
        peak_bytes=peak,
        hbm_bytes=cluster.hbm_bytes,
        usable_bytes=float(cluster.hbm_bytes),
        memory=parts,
        mfu=flops / (layout.chips * cluster.peak_flops * step) if flops and step else 0.0,
        compute=work.compute,
    )


def search_layouts(
    model: Any,
    cluster: Cluster,
    *,
    global_batch: int,
    schedules: Sequence[str] = ("1f1b", "interleaved", "zb-h1", "zb-v"),
    tensor_parallel: Sequence[int] = (1, 2, 4, 8),
    max_pp: int = 8,
    microbatch_factors: Sequence[int] = (1, 2, 4),
) -> list[Layout]:
    """Layouts of all of ``cluster``'s chips: powers of two for PP (up to ``max_pp``, at
    most one stage a layer) and TP (``tensor_parallel``); the rest all FSDP, all DP, or
    FSDP within a slice and DP across slices; microbatches ``pp × microbatch_factors``
    (1, 2 and 4 without a pipeline: gradient accumulation) that split
    ``global_batch``; each schedule (only 1F1B without a pipeline); with and without
    rematerialisation; with FSDP, each way to gather and reduce but reducing every
    microbatch over DP (never faster than delaying it, and no smaller).

    >>> from pipemark.runtime.planning.cluster import tpu_v5e
    >>> from pipemark.runtime.planning.workload import Transformer
    >>> len(search_layouts(Transformer.llama2_7b(), tpu_v5e(256), global_batch=1024)) > 100
    True
    """
    layers = getattr(model, "layers", None)
    chips = cluster.num_chips
    found = []
    for tp in tensor_parallel:
        for pp in _powers(chips // tp if chips % tp == 0 else 0, max_pp):
            replicas = chips // (tp * pp)
            for fsdp in sorted({1, replicas, max(1, replicas // cluster.num_slices)}):
                shapes = (pp, replicas // fsdp, fsdp, tp)
                for schedule in schedules if pp > 1 else ("1f1b",):
                    for microbatches in (pp * f for f in microbatch_factors):
                        if global_batch % (replicas * microbatches):
                            continue
                        for extra in _variants(fsdp):
                            layout = _layout(*shapes, schedule, microbatches, **extra)
                            if layout is not None and (
                                layers is None or layout.num_stages <= layers
                            ):
                                found.append(layout)
    return found


def _variants(fsdp: int) -> list[dict[str, Any]]:
    modes = [("step", "step")]
    if fsdp > 1:
        modes += [("step", "scatter"), ("microbatch", "scatter")]
    return [
        {"remat": remat, "gather": gather, "reduce": reduce}
        for remat in (False, True)
        for gather, reduce in modes
    ]


def _powers(limit: int, most: int) -> list[int]:
    """The powers of two that divide ``limit``, up to ``most``."""
    return [p for p in (2**i for i in range(32)) if p <= most and limit and limit % p == 0]


def _layout(pp, dp, fsdp, tp, schedule, microbatches, **extra) -> Layout | None:
    try:
        return Layout(pp, dp, fsdp, tp, schedule, microbatches, **extra)
    except PipemarkError:  # a schedule that cannot take these sizes is left out
        return None


class Refusal(NamedTuple):
    """A layout that does not fit: its peak bytes a chip (where its weights,
    gradients, optimizer state and one microbatch's activations alone do not fit, that
    lower bound), their parts, and ``step_seconds``: a lower bound of its step (its
    compute spread evenly over the pipeline's devices; it is not simulated)."""

    layout: Layout
    peak_bytes: float
    step_seconds: float
    memory: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Ranking:
    """What :func:`rank_layouts` found: ``ranked`` (the layouts simulated that fit,
    fastest first), ``refused`` (those that do not, :class:`Refusal`) and ``skipped``
    (how many were not simulated: slower than the ranking's last by a lower bound)."""

    model: str
    cluster: str
    global_batch: int
    ranked: tuple[LayoutPrediction, ...]
    refused: tuple[Refusal, ...]
    skipped: int = 0

    @property
    def best(self) -> LayoutPrediction:
        if not self.ranked:
            raise PipemarkError(
                f"No layout of {self.model} fits on {self.cluster}: give more chips, a smaller "
                "global batch, or allow rematerialisation and more microbatches."
            )
        return self.ranked[0]

    def table(self, top: int = 5) -> str:
        """The ``top`` layouts as a markdown table."""
        rows = [
            "| # | layout | step (s) | MFU | bubble | exposed comm. (s) | peak (GiB) |",
            "|---|---|---|---|---|---|---|",
        ]
        for i, p in enumerate(self.ranked[:top], 1):
            rows.append(
                f"| {i} | {p.layout} | {p.step_seconds:.2f} | {p.mfu:.0%} | "
                f"{p.bubble_fraction:.0%} | {p.exposed_communication:.3f} | "
                f"{p.peak_bytes / _GIB:.1f} |"
            )
        return "\n".join(rows)

    def explain(self) -> str:
        """Why the best layout wins: its step broken down, against the runner-up and
        against the fastest layout that does not fit."""
        best = self.best
        lines = [
            f"{self.model} on {self.cluster}, {self.global_batch} sequences a step: "
            f"{len(self.ranked)} layouts simulated fit, {len(self.refused)} do not fit, "
            f"{self.skipped} skipped (their compute alone is slower than the ranking's last).",
            f"Best: {best.summary()}.",
            f"  step = compute {best.compute_seconds:.3f} s + pipeline idle "
            f"{best.idle_seconds:.3f} s + waiting for the host {best.host_seconds:.3f} s + "
            f"exposed TP {best.tp_seconds:.3f} s + FSDP gather {best.gather_seconds:.3f} s + "
            f"gradient reduction {best.reduction_seconds:.3f} s + update "
            f"{best.update_seconds:.3f} s; headroom "
            f"{(best.usable_bytes - best.peak_bytes) / _GIB:.1f} GiB beyond the margin of "
            f"{(best.hbm_bytes - best.usable_bytes) / _GIB:.1f} GiB kept free.",
        ]
        if len(self.ranked) > 1:
            lines.append(_versus(best, self.ranked[1], "runner-up"))
        others = [p for p in self.ranked[1:] if _shape(p.layout) != _shape(best.layout)]
        if others and others[0] is not self.ranked[1]:
            lines.append(_versus(best, others[0], "best other PP × DP × FSDP × TP"))
        if self.refused:
            # The refused layout with the least compute per device: what memory costs.
            quick = self.refused[0]
            lines.append(
                f"Refused for memory, among others: {quick.layout}, whose compute alone "
                f"would take {quick.step_seconds:.3f} s a step, needs "
                f"{quick.peak_bytes / _GIB:.1f} GiB a chip ({_largest(quick.memory)})."
            )
        return "\n".join(lines)


def _shape(layout: Layout) -> tuple[int, ...]:
    return layout.pp, layout.dp, layout.fsdp, layout.tp


_PARTS = {
    "compute_seconds": "compute",
    "idle_seconds": "pipeline bubble and transfer waits",
    "host_seconds": "waiting for the host's dispatch",
    "tp_seconds": "exposed TP collectives",
    "gather_seconds": "FSDP gather",
    "reduction_seconds": "exposed gradient reduction",
    "update_seconds": "optimizer update",
}


def _versus(best: LayoutPrediction, other: LayoutPrediction, what: str) -> str:
    """Where ``other``'s extra time goes, part by part."""
    gaps = sorted(
        ((getattr(other, f) - getattr(best, f), name) for f, name in _PARTS.items()),
        reverse=True,
    )
    slower = other.step_seconds / best.step_seconds - 1
    shown = ", ".join(f"{name} {gap:+.3f} s" for gap, name in gaps if abs(gap) >= 5e-4)
    return f"Against the {what}, {other.layout} ({slower:.1%} slower): {shown or 'the same parts'}."


def _largest(memory: dict[str, float]) -> str:
    parts = sorted(memory.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {size / _GIB:.1f} GiB" for name, size in parts[:2])


def rank_layouts(
    model: Any,
    cluster: Cluster,
    *,
    global_batch: int,
    layouts: Iterable[Layout] | None = None,
    overlap: bool = True,
    top: int = 10,
    hbm_margin: float = HBM_MARGIN,
    dispatch_ahead: int | None = 2,
) -> Ranking:
    """Predict ``layouts`` (:func:`search_layouts` by default) of ``model`` on
    ``cluster``; rank those that fit by step time (ties: the smaller peak memory).

    A layout fits if its predicted peak leaves ``hbm_margin`` of the chip's HBM free
    (:data:`HBM_MARGIN`: for what the memory model leaves out). A layout whose
    weights, gradients, optimizer state and one microbatch's activations alone do not
    fit is refused unsimulated. The others are simulated
    fastest-first by a lower bound of their step (their compute spread evenly over the
    pipeline's devices); once ``top`` layouts fit and the next bound is slower than the
    ``top``-th, the rest are skipped (``Ranking.skipped``): none of them could enter
    the ``top``.

    >>> from pipemark.runtime.planning.cluster import tpu_v5e
    >>> from pipemark.runtime.planning.workload import Transformer
    >>> ranking = rank_layouts(Transformer.llama2_7b(), tpu_v5e(256), global_batch=1024,
    ...     layouts=[Layout(pp=4, fsdp=64, microbatches=16, remat=True),
    ...              Layout(pp=1, dp=256, microbatches=4)])
    >>> [str(p.layout) for p in ranking.ranked], len(ranking.refused)
    (['PP 4 × DP 1 × FSDP 64 × TP 1, 1f1b, M 16, remat'], 1)
    """
    usable = _usable_bytes(cluster, hbm_margin)
    if layouts is None:
        layouts = search_layouts(model, cluster, global_batch=global_batch)
    refused: list[Refusal] = []
    candidates = []
    for layout in layouts:
        work = model.stage_work(
            layout, global_batch=global_batch, peak_flops=cluster.peak_flops,
            hbm_bandwidth=cluster.hbm_bandwidth,
        )  # fmt: skip
        least, parts = _state_bytes(layout, work)
        if least > usable:
            refused.append(Refusal(layout, least, _least_seconds(layout, work), parts))
        else:
            candidates.append((_least_seconds(layout, work), str(layout), layout))
    candidates.sort(key=lambda c: c[:2])
    fitting: list[LayoutPrediction] = []
    skipped = 0
    for i, (bound, _, layout) in enumerate(candidates):
        if len(fitting) >= top and bound > sorted(p.step_seconds for p in fitting)[top - 1]:
            skipped = len(candidates) - i
            break
        work = model.stage_work(
            layout, global_batch=global_batch, peak_flops=cluster.peak_flops,
            hbm_bandwidth=cluster.hbm_bandwidth,
        )  # fmt: skip
        schedule = _build(layout, work)
        fused = _programs(layout, cluster, work, schedule)
        peak, parts = _memory(layout, work, schedule, dispatch_ahead, fused)
        if peak > usable:  # refused before it is simulated
            refused.append(Refusal(layout, peak, bound, parts))
            continue
        fitting.append(
            predict_layout(
                model,
                layout,
                cluster,
                global_batch=global_batch,
                overlap=overlap,
                dispatch_ahead=dispatch_ahead,
                hbm_margin=hbm_margin,
            )
        )
    return Ranking(
        model=getattr(model, "name", type(model).__name__),
        cluster=cluster.name,
        global_batch=global_batch,
        ranked=tuple(sorted(fitting, key=lambda p: (p.step_seconds, p.peak_bytes, str(p.layout)))),
        refused=tuple(sorted(refused, key=lambda r: (r.step_seconds, str(r.layout)))),
        skipped=skipped,
    )
