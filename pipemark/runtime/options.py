"""The options of a pipeline, checked once: :class:`PipelineOptions`.

:func:`pipemark.pipeline_value_and_grad` and :func:`pipemark.pipeline_train_step`
take them as keywords and build one of these; the planner reads it.

>>> PipelineOptions(num_microbatches=4, schedule="gpipe").schedule
'gpipe'
>>> PipelineOptions(num_microbatches=0)
Traceback (most recent call last):
...
pipemark.errors.PipemarkError: num_microbatches must be a positive int, got 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.passes.auto import check_block_cuts
from pipemark.runtime.devices.sharding import FSDP_GATHERS
from pipemark.runtime.losses import LOSS_REDUCTIONS
from pipemark.runtime.schedules.core import Schedule
from pipemark.runtime.schedules.registry import schedule_entry

__all__ = ["GRADIENT_REDUCTIONS", "PipelineOptions", "check_positive"]

#: When a call reduces each stage's accumulated results (gradients, loss) over its
#: data-parallel replicas (``PipelineOptions.reduce_gradients``): right after the
#: stage's last action, on its slot, while other stages still compute; or once every
#: action is dispatched, at the end of the call.
GRADIENT_REDUCTIONS = ("after_stage", "end_of_call")


def check_positive(value: Any, what: str) -> int:
    """``value`` when it is a positive ``int`` (not a ``bool``), else a
    :class:`PipemarkError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipemarkError(f"{what} must be a positive int, got {value!r}.")
    return value


def _check_layers(stage_layers: Any) -> tuple[int, ...]:
    if isinstance(stage_layers, (str, bytes)) or not hasattr(stage_layers, "__iter__"):
        raise PipemarkError(
            f"stage_layers must be a sequence of positive ints (the marked layers of each "
            f"stage) or None, got {stage_layers!r}."
        )
    return tuple(check_positive(n, "each of stage_layers") for n in stage_layers)


@dataclass(frozen=True)
class PipelineOptions:
    """How to run a pipeline.

    Attributes
    ----------
    num_microbatches:
        How many microbatches each batch argument's leading axis is split into.
    num_stages:
        How many pipeline stages; ``None``: one per marked stage. Fewer than the marked
        stages merges consecutive ones; without markers the program is balanced
        automatically.
    block_cuts:
        When balancing automatically: cut between the model's repeated blocks if that
        costs little balance (``"prefer"``), always (``"require"``) or anywhere
        (``"off"``); see :func:`pipemark.passes.auto_layers`.
    schedule:
        The name of a registered schedule (:data:`pipemark.runtime.SCHEDULES`:
        ``"1f1b"``, ``"gpipe"``, ``"interleaved"``, the zero-bubble ``"zb-h1"`` or
        ``"zb-v"``, whose backward is split into B and W by
        :func:`pipemark.passes.split_backward`, or one added with
        :func:`pipemark.runtime.register_schedule`) or a
        :class:`~pipemark.runtime.schedules.Schedule`.
    devices:
        The devices to use (``None``: ``jax.devices()``), one per device slot of the
        schedule.
    mesh:
        Instead of ``devices``: a ``jax.sharding.Mesh`` with a ``stage_axis`` (each
        position along it one device slot, a sub-mesh of the other axes) or a list of
        meshes, one per slot; each stage then runs as an SPMD program over its
        sub-mesh (:mod:`pipemark.runtime.devices.sharding`).
    param_specs:
        With ``mesh``: how each parameter lies on its stage's sub-mesh, a
        ``PartitionSpec`` per leaf (a pytree prefix of the parameters; ``None``:
        replicated). Default: the spec of each parameter's own ``NamedSharding``, else
        replicated.
        A spec may name the data axis (``P("data", None)``: FSDP): each device keeps
        its shard of the parameter, the stages gather it as ``fsdp_gather`` says, and
        its gradient (and, in a training step, its optimizer state) comes back sharded
        the same way.
    stage_axis, data_axis:
        With ``mesh``: the names of its stage axis and of its data-parallel axis (each
        microbatch is split into replicas along it, and gradients are reduced over it
        once per step).
    fsdp_gather:
        With parameters sharded over the data axis: ``"once"`` (each stage's
        parameters gathered once per call, the copy every microbatch reads; their
        gradients accumulated whole per replica and reduce-scattered once), or
        ``"per_microbatch"`` (each stage program gathers the parameters it reads, and
        reduce-scatters its microbatch's gradients into shards: no whole copy outlives
        a program, for an all-gather and a reduce-scatter per program). ``None``
        (default): ``"once"``, or with a ``memory_budget`` that the once-gathered
        copy does not fit, ``"per_microbatch"``.
    reduce_gradients:
        With data-parallel replicas (a data axis on the stages' sub-meshes): when
        each stage's accumulated gradients (and loss) are reduced over them, once per
        call (an all-reduce; a reduce-scatter for FSDP ``param_specs``).
        ``"after_stage"`` (default): right after the stage's last action, dispatched
        by its slot's worker, so the reduction of a stage that finished early runs
        while the others still compute their last backwards (what a pipeline on
        accelerators hides it behind). ``"end_of_call"``: every stage's after the
        call's last action is dispatched. A schedule's own ``reduce_grad``
        (``REDUCE_GRAD``) places its stages' reductions either way; under
        ``jax.distributed`` with ``gather_results=True`` each stage's results are
        reduced after its last action either way, to be sent on from there.
    loss_reduction:
        One of :data:`~pipemark.runtime.losses.LOSS_REDUCTIONS`.
    timeout_s:
        Under ``jax.distributed`` (stages on devices of several processes): the most
        seconds a process waits for a value from another before it stops with an
        error naming the stage, microbatch and process it waited for (a process that
        died or raised cannot answer). ``None``: wait for ever.
    gather_results:
        Under ``jax.distributed``: ``True`` (default), every process gets every result
        (each stage's results are sent to the other processes once final); ``False``,
        a process holds the results of its own stages only, and the others are arrays
        of the global program that the process which computed them holds
        (``is_fully_addressable`` is ``False``), as ``jax.jit`` returns arrays held by
        other processes: nothing moves after a stage's last action, and no process
        needs memory for the whole model's gradients.
    recompute_residuals:
        ``True`` (default): each backward stage recomputes what is cheap to recompute of
        its forward's residuals from the fewest bytes the forward hands over
        (:func:`pipemark.passes.recompute_residuals`); ``False``: the forward hands over
        every residual ``jax.vjp`` keeps.
    dispatch_ahead:
        How many of a device slot's actions may be dispatched and not yet computed
        (``None``: no bound). JAX dispatches asynchronously and a program's results
        take device memory when it is dispatched; without a bound the host runs the
        whole schedule ahead of the device, and every microbatch's residuals are held
        at once whatever the schedule keeps in flight (:meth:`pipemark.Pipeline.memory`
        then counts what all of a slot's actions hold). Default 2: the device always
        has the next program queued. A fused run (``fuse_actions``) counts as one.
    fuse_actions:
        At most this many consecutive actions of a device slot run as one program,
        where no other slot waits for the ones before the last (each reads only values
        its own slot made; all but the last hand their outputs to their own slot only;
        :func:`pipemark.runtime.devices.steps.fuse_runs`): a slot holding many stages (an
        interleaved schedule's, or all stages on one device) dispatches fewer
        programs, each with a fixed cost on the host. Each distinct run is a program
        to compile. Default 2 (with ``fuse_min_uses``' default, only runs whose
        program many dispatches share are fused: at 16 stages on one TPU v5e chip
        the step took 1.05 x a scan accumulation's, not 1.12 x, for one compilation
        more); 1: every action its own program.
    fuse_min_uses:
        With ``fuse_actions`` above 1: a run is fused only where the program it
        becomes runs at least this many times a call (``None``, the default: twice
        the number of microbatches, so that only runs of identical blocks' stages,
        one program for many dispatches, are fused; 1: every run). Each distinct
        fused program is one more compilation, a few seconds on a TPU, which a run
        dispatched once per microbatch does not repay in the first call.
    memory_budget:
        Bytes each device slot may hold, as :meth:`pipemark.Pipeline.memory` predicts
        it (``None``: no limit); see :mod:`pipemark.runtime.memory.budget`.
    microbatches_in_flight:
        At most this many microbatches in the pipeline at once (``None``: as many as
        the schedule keeps): the schedule runs in waves of this many
        (:attr:`~pipemark.runtime.ScheduleProblem.microbatches_in_flight`).
    stage_layers:
        For a program marked with more layers than stages: how many consecutive marked
        layers each stage gets (``None``: about equal equation counts); see
        :func:`pipemark.passes.merge_consecutive`.
    """

    num_microbatches: int
    num_stages: int | None = None
    schedule: str | Schedule = "1f1b"
    devices: Sequence[Any] | None = field(default=None)
    loss_reduction: str = "mean"
    timeout_s: float | None = 120.0
    block_cuts: str = "prefer"
    mesh: Any = None
    param_specs: Any = None
    stage_axis: str = "stage"
    data_axis: str = "data"
    gather_results: bool = True
    recompute_residuals: bool = True
    dispatch_ahead: int | None = 2
    fuse_actions: int = 2
    fuse_min_uses: int | None = None
    memory_budget: int | None = None
    microbatches_in_flight: int | None = None
    stage_layers: tuple[int, ...] | None = None
    fsdp_gather: str | None = None
    reduce_gradients: str = "after_stage"

    def __post_init__(self) -> None:
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not self.timeout_s > 0
        ):
            raise PipemarkError(
                f"timeout_s must be a positive number of seconds or None, got {self.timeout_s!r}."
            )
        check_positive(self.num_microbatches, "num_microbatches")
        if self.dispatch_ahead is not None:
            check_positive(self.dispatch_ahead, "dispatch_ahead (or None)")
        check_positive(self.fuse_actions, "fuse_actions")
        if self.fuse_min_uses is not None:
            check_positive(self.fuse_min_uses, "fuse_min_uses (or None)")
        if self.memory_budget is not None:
            check_positive(self.memory_budget, "memory_budget (bytes per device, or None)")
        if self.microbatches_in_flight is not None:
            check_positive(self.microbatches_in_flight, "microbatches_in_flight (or None)")
        if not isinstance(self.recompute_residuals, bool):
            raise PipemarkError(
                "recompute_residuals must be True (each backward stage recomputes the cheap "
                "residuals of its forward) or False (the forward hands over every one), got "
                f"{self.recompute_residuals!r}."
            )
        if not isinstance(self.gather_results, bool):
            raise PipemarkError(
                f"gather_results must be True (every process gets every result) or False "
                f"(each process its own stages'), got {self.gather_results!r}."
            )
        if self.num_stages is not None:
            check_positive(self.num_stages, "num_stages")
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", _check_layers(self.stage_layers))
        check_block_cuts(self.block_cuts)
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise PipemarkError(
                f"Unknown loss_reduction {self.loss_reduction!r}; use 'mean' for a loss "
                "averaged over the batch, 'sum' for a loss summed over it, or "
                "'sum_over_count' for a loss that returns (sum, count): a masked or "
                "weighted mean."
            )
        if not isinstance(self.schedule, Schedule):
            schedule_entry(self.schedule)  # an unknown name: the error lists the known
        if self.devices is not None:
            object.__setattr__(self, "devices", _check_devices(self.devices))
        self._check_mesh()

    def _check_mesh(self) -> None:
        for name in ("stage_axis", "data_axis"):
            if not isinstance(getattr(self, name), str):
                raise PipemarkError(
                    f"{name} must be an axis name (a str), got {getattr(self, name)!r}."
                )
        if self.fsdp_gather is not None and self.fsdp_gather not in FSDP_GATHERS:
            raise PipemarkError(
                f"fsdp_gather is {self.fsdp_gather!r}; use 'once' (gather each stage's "
                "data-sharded parameters once per call), 'per_microbatch' (in every "
                "stage program, to hold less) or None (once, unless a memory_budget "
                "needs per_microbatch)."
            )
        if self.reduce_gradients not in GRADIENT_REDUCTIONS:
            raise PipemarkError(
                f"reduce_gradients is {self.reduce_gradients!r}; use 'after_stage' (each "
                "stage's gradients reduced over its data-parallel replicas right after its "
                "last action) or 'end_of_call' (every stage's after the call's last action)."
            )
        if self.mesh is None:
            if self.param_specs is not None:
                raise PipemarkError(
                    "param_specs lays parameters out on the stages' sub-meshes; pass "
                    "mesh= too (a jax.sharding.Mesh with a stage axis), or drop param_specs."
                )
            return
        if self.devices is not None:
            raise PipemarkError(
                "Pass either devices= (one device per slot) or mesh= (a sub-mesh per slot), "
                "not both."
            )

    @property
    def gathering(self) -> str:
        """How the stages gather parameters sharded over the data axis: ``fsdp_gather``,
        ``"once"`` where it is ``None``."""
        return self.fsdp_gather or "once"

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs the backward as B and W (a zero-bubble schedule)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.splits_backward
        return schedule_entry(self.schedule).splits_backward

    @property
    def schedule_name(self) -> str:
        """The schedule's name (``"interleaved"`` places several stages per device)."""
        return self.schedule.name if isinstance(self.schedule, Schedule) else self.schedule


def _check_devices(devices: Any) -> tuple[Any, ...]:
    """``devices`` as a tuple of ``jax.Device`` objects, or a named error: an empty list,
    a device's name where the device is wanted, a single device not in a list."""
    import jax

    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise PipemarkError(
            f"devices is {devices!r}; give a list of jax devices, e.g. jax.devices()[:2]."
        )
    devices = tuple(devices)
    if not devices:
        raise PipemarkError(
            "devices is empty; give at least one jax device (e.g. jax.devices()), or "
            "leave devices=None to use every device."
        )
    for i, device in enumerate(devices):
        if not isinstance(device, jax.Device):
            hint = " (a device's name: pass the device itself, from jax.devices())"
            raise PipemarkError(
                f"devices[{i}] is {device!r}, not a jax.Device"
                f"{hint if isinstance(device, str) else ''}; give devices from "
                "jax.devices() or jax.local_devices()."
            )
    return devices
