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
4. **Dispatch** on one worker thread per device (the caller's thread is device 0's).
   The actions are resolved once per plan (inputs, readers, per device). Each worker
   places its parameters and batch slices on its device in one transfer per call, then
   walks its device's column of the schedule in tick order: an action takes its inputs
   (waiting on its worker's condition for a value another device has not published
   yet), dispatches its stage program and publishes the results at once, already
   copied to each reader's device, without waiting for them to be computed: a reader
   dispatches against a value still being computed and XLA starts its program when the
   value is there, so no host thread has to wake up between the two. XLA's CPU client
   runs a small program (and one that calls back into Python) on the dispatching thread
   when its inputs are ready, so one dispatching thread would serialise the devices;
   one thread per device lets them overlap. A value is dropped once its last reader on
   each device has taken it. The first error of any worker wakes the others, which
   stop, and is raised in the caller; an error inside a program that ran asynchronously
   is raised when the caller waits for the accumulators, before returning. With one
   device the schedule is walked on the caller's thread (``_run_plan(...,
   parallel=False)`` does that for any number of devices: same programs in the same
   order per device, hence bit-identical results).

**Sum or mean.** With ``loss_reduction="mean"`` (the default) the microbatch results are
averaged: a loss that is a mean over the batch (``jnp.mean``) has, for equal microbatches,
``loss(batch) = mean_m loss(microbatch_m)`` and, by linearity of the derivative, the
same for the gradients. With ``loss_reduction="sum"`` they are added, which is right
for a loss summed over the batch. A loss that is neither (normalised by something that
depends on the whole batch, batch statistics) cannot be split into microbatches.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from pipemark._compat import copy_to_device
from pipemark.errors import PipemarkError
from pipemark.marks import PAIRED_MARK_TYPES
from pipemark.runtime.arguments import (
    PartitionedParams,
    batch_arg_names,
    check_batch_args,
    partition_params,
)
from pipemark.runtime.losses import split_count
from pipemark.runtime.plan import (
    LOSS_REDUCTIONS,
    PipelinePlan,
    _build_plan,
    _check_positive,
    _has_markers,
    _microbatch_structs,
    _plan_from_staged,
)
from pipemark.runtime.schedules import FORWARD, Schedule

__all__ = [
    "LOSS_REDUCTIONS",
    "Pipeline",
    "PipelinePlan",
    "PipelinedStep",
    "pipeline_value_and_grad",
    "pipeline_train_step",
]


# ---------------------------------------------------------------------- running


def _split_leaf(leaf: Any, num_microbatches: int, micro: int) -> list[Any]:
    if isinstance(leaf, jax.Array):
        # One compiled program for all the slices: slicing a jax.Array op by op costs a
        # dispatch (about 0.3 ms) per microbatch.
        return list(_splitter(num_microbatches)(leaf))
    array = np.asarray(leaf)
    return [array[m * micro : (m + 1) * micro] for m in range(num_microbatches)]


@functools.lru_cache(maxsize=64)
def _splitter(num_microbatches: int) -> Callable[[Any], list[Any]]:
    return jax.jit(lambda x: jnp.split(x, num_microbatches))


class _Cancelled(Exception):
    """Raised in a worker waiting for a value when another worker has failed."""


# Where an action's input comes from (the first item of each entry of _Step.inputs).
_PARAM, _BATCH, _STAGE = 0, 1, 2


class _Step(NamedTuple):
    """One action with everything resolved that does not change between calls."""

    index: int  # sliced stage
    microbatch: int
    accumulate: bool
    # (_PARAM, leaf) | (_BATCH, leaf) | (_STAGE, (microbatch, stage, output))
    inputs: tuple[tuple[int, Any], ...]
    # per passed output: (its position among the program's passed outputs, its key, and
    # how many readers each worker has: ((worker, count), ...))
    sends: tuple[tuple[int, tuple[int, int, int], tuple[tuple[int, int], ...]], ...]


class _Program(NamedTuple):
    """A plan's actions resolved once (cached on the plan): per device worker, its steps
    in run order, and the parameter and batch leaves it reads."""

    columns: tuple[tuple[_Step, ...], ...]
    serial: tuple[tuple[int, _Step], ...]  # (worker, step) in schedule order
    devices: tuple[Any, ...]  # per worker
    params: tuple[tuple[int, ...], ...]  # per worker: parameter leaves it reads
    batch: tuple[tuple[int, ...], ...]  # per worker: batch leaves it reads
    num_actions: int


def _program(plan: PipelinePlan) -> _Program:
    program = plan._program
    if program is not None:
        return program
    staged, schedule = plan.staged, plan.schedule
    num_params = plan.num_param_leaves
    worker_of: dict[Any, int] = {}  # device -> worker position
    for device in plan.devices:
        worker_of.setdefault(device, len(worker_of))
    devices = tuple(worker_of)
    # How many reader stages of each value run on each worker.
    readers: dict[tuple[int, int], dict[int, int]] = {}
    for c, stage in enumerate(staged.stages):
        if c not in plan.units:
            continue
        w = worker_of[plan.units[c].device]
        for ref in stage.inputs:
            if ref.kind == "stage":
                per = readers.setdefault((ref.stage, ref.index), {})
                per[w] = per.get(w, 0) + 1
    columns: list[list[_Step]] = [[] for _ in devices]
    serial: list[tuple[int, _Step]] = []
    params: list[set[int]] = [set() for _ in devices]
    batch: list[set[int]] = [set() for _ in devices]
    for _, _, action in schedule.actions():
        k, m = action.stage, action.microbatch
        index = plan.forward_stages[k] if action.kind == FORWARD else plan.backward_stages[k]
        if index is None:  # a stage without a backward program
            continue
        unit = plan.units[index]
        w = worker_of[unit.device]
        inputs = []
        for ref in staged.stages[index].inputs:
            if ref.kind == "input" and ref.index < num_params:
                inputs.append((_PARAM, ref.index))
                params[w].add(ref.index)
            elif ref.kind == "input":
                inputs.append((_BATCH, ref.index - num_params))
                batch[w].add(ref.index - num_params)
            else:
                inputs.append((_STAGE, (m, ref.stage, ref.index)))
        sends = tuple(
            (
                position,
                (m, index, o),
                tuple(sorted(readers[(index, o)].items())),
            )
            for position, o in enumerate(unit.passed)
        )
        step = _Step(index, m, bool(unit.accumulated), tuple(inputs), sends)
        columns[w].append(step)
        serial.append((w, step))
    program = _Program(
        columns=tuple(tuple(c) for c in columns),
        serial=tuple(serial),
        devices=devices,
        params=tuple(tuple(sorted(p)) for p in params),
        batch=tuple(tuple(sorted(b)) for b in batch),
        num_actions=len(serial),
    )
    plan._program = program
    return program


class _Exchange:
    """The values stages hand to each other, shared by the device workers.

    A producer publishes its outputs as soon as it has dispatched the program that
    computes them (an array not yet computed is a future: a reader can dispatch its own
    program against it, which XLA starts once the value is there), already copied to
    each reader's device; a reader takes its copy, waiting on its worker's condition if
    the producer has not dispatched yet. A copy is dropped once the last reader on its
    device has taken it (the runtime keeps the buffer alive while a program that reads
    it is pending)."""

    def __init__(self, num_workers: int) -> None:
        self._lock = threading.Lock()
        self._arrived = [threading.Condition(self._lock) for _ in range(num_workers)]
        self._values: dict[tuple[tuple[int, int, int], int], list[Any]] = {}
        self.peak = 0
        self.error: BaseException | None = None

    def publish(self, entries: list[tuple[tuple[int, int, int], int, Any, int]]) -> None:
        with self._lock:
            for key, worker, value, count in entries:
                self._values[(key, worker)] = [value, count]
                self._arrived[worker].notify()  # one worker waits per condition
            self.peak = max(self.peak, len(self._values))

    def take(self, key: tuple[int, int, int], worker: int) -> tuple[Any, float]:
        """The copy of a value for ``worker`` (on its device), and the seconds spent
        waiting for its producer."""
        waited = 0.0
        with self._lock:
            slot = self._values.get((key, worker))
            if slot is None and self.error is None:
                start = time.perf_counter()
                arrived = self._arrived[worker]
                while slot is None and self.error is None:
                    arrived.wait()
                    slot = self._values.get((key, worker))
                waited = time.perf_counter() - start
            if self.error is not None:
                raise _Cancelled
            slot[1] -= 1
            if not slot[1]:  # the last reader on this device has it
                del self._values[(key, worker)]
        return slot[0], waited

    def fail(self, error: BaseException) -> None:
        """Record the first error and wake every waiting worker so that it stops."""
        with self._lock:
            if self.error is None:
                self.error = error
            for arrived in self._arrived:
                arrived.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


def _run_plan(
    plan: PipelinePlan,
    params: Any,
    batch: Any,
    timings: dict | None,
    *,
    parallel: bool = True,
) -> Any:
    program = _program(plan)
    staged = plan.staged
    num_micro = plan.schedule.num_microbatches
    param_leaves = jax.tree_util.tree_leaves(params)
    batch_leaves = jax.tree_util.tree_leaves(batch)
    num_params = plan.num_param_leaves
    slices = [_split_leaf(x, num_micro, plan.microbatch_size) for x in batch_leaves]
    exchange = _Exchange(len(program.devices))
    accs: dict[int, list[Any]] = {}  # per stage; each stage's worker alone writes its entry
    units = plan.units
    for index, unit in units.items():
        if unit.zeros is not None:
            # Immutable arrays: the zeros one call starts from serve every later call.
            zeros = plan._zeros.get(index)
            if zeros is None:
                zeros = plan._zeros[index] = unit.zeros()
            accs[index] = zeros
    scale = np.float32(1.0 / num_micro if plan.loss_reduction == "mean" else 1.0)
    threaded = parallel and len(program.devices) > 1
    host_times: list[float] = []
    timed = timings is not None

    def place(worker: int) -> tuple[dict[int, Any], list[list[Any]], Any]:
        """This worker's parameters, batch slices and scale, on its device, in one
        transfer (the scale, the same every call, only once per plan)."""
        device = program.devices[worker]
        need_params, need_batch = program.params[worker], program.batch[worker]
        sources = [param_leaves[i] for i in need_params]
        for j in need_batch:
            sources.extend(slices[j])
        device_scale = plan._scales.get(worker)
        if device_scale is None:
            device_scale = plan._scales[worker] = jax.device_put(scale, device)
        placed = copy_to_device(sources, device)
        on_device = dict(zip(need_params, placed))
        batch_on: list[list[Any]] = [[] for _ in batch_leaves]
        start = len(need_params)
        for j in need_batch:
            batch_on[j] = placed[start : start + num_micro]
            start += num_micro
        return on_device, batch_on, device_scale

    def run_step(
        worker: int, step: _Step, placed: tuple[dict[int, Any], list[list[Any]], Any]
    ) -> float:
        """Dispatch one action and publish its results; the host seconds it spent
        waiting for another worker's value."""
        on_device, batch_on, device_scale = placed
        m = step.microbatch
        inputs = []
        waited = 0.0
        for source, where in step.inputs:
            if source == _STAGE:
                value, w = exchange.take(where, worker)
                waited += w
            elif source == _PARAM:
                value = on_device[where]
            else:
                value = batch_on[where][m]
            inputs.append(value)
        index = step.index
        new_accs, outs = units[index].run(accs.get(index, ()), inputs, device_scale)
        if step.accumulate:
            accs[index] = new_accs
        if step.sends:
            entries = []
            copies: dict[int, list[Any]] = {}
            for position, key, targets in step.sends:
                for reader, count in targets:
                    if reader == worker:
                        entries.append((key, reader, outs[position], count))
                    else:
                        copies.setdefault(reader, []).append((key, position, count))
            for reader, wanted in copies.items():
                # Pushed by the producer, one transfer per reader device: the copy is
                # enqueued behind the producing program, and the reader finds it there.
                moved = copy_to_device([outs[p] for _, p, _ in wanted], program.devices[reader])
                entries.extend((key, reader, v, n) for (key, _, n), v in zip(wanted, moved))
            exchange.publish(entries)
        return waited

    def walk(worker: int, steps: Sequence[_Step]) -> None:
        start = time.perf_counter()
        placed = place(worker)
        waited = 0.0
        for step in steps:
            waited += run_step(worker, step, placed)
        host_times.append(time.perf_counter() - start - waited)

    # threads[k] runs device worker k + 1 (the caller is worker 0).
    threads: list[threading.Thread] = []

    def guarded(worker: int) -> None:
        try:
            # Each worker first starts the next one's thread. Starting a thread costs
            # about 150 µs here; started one after another by the caller, S - 1 of them
            # would delay device 0's first action, which everything else waits for. In
            # the cascade the caller pays one, and worker w starts w thread-starts after
            # the call began, long before a pipeline's first value reaches device w.
            if worker < len(threads):
                threads[worker].start()
            walk(worker, program.columns[worker])
        except _Cancelled:
            pass
        except BaseException as error:  # handed to the caller, which re-raises it
            exchange.fail(error)

    start = time.perf_counter()
    try:
        if threaded:
            threads.extend(
                threading.Thread(target=guarded, args=(w,), name=f"pipemark-device{w}")
                for w in range(1, len(program.devices))
            )
            guarded(0)  # the caller is the first device's worker
            # In order: once worker w has finished it has started worker w + 1, unless
            # starting it failed (then the error is in the exchange).
            for thread in threads:
                if thread.ident is None:
                    break
                thread.join()
            if exchange.error is not None:
                raise exchange.error
            # The call returns once every action is dispatched, like any JAX computation
            # (and like the single-device walk): an error inside a program that runs
            # asynchronously reaches the accumulated results, and is raised where they
            # are used (jax.block_until_ready, printing, conversion to NumPy). Waiting
            # here cost the caller a thread wake-up and the chance to dispatch more work.
        else:
            begin = time.perf_counter()
            placed = [place(w) for w in range(len(program.devices))]
            waited = 0.0
            for worker, step in program.serial:
                waited += run_step(worker, step, placed[worker])
            host_times.append(time.perf_counter() - begin - waited)
        values_left = len(exchange)
    finally:
        exchange.clear()  # after a failure, values nobody will read
    if timed:
        timings["dispatch_s"] = time.perf_counter() - start
        timings["host_s"] = sum(host_times)
        timings["num_actions"] = program.num_actions
        timings["num_ticks"] = plan.schedule.num_ticks
        timings["values_left"] = values_left
        timings["peak_values"] = exchange.peak

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
    """``(params, *batch) -> (loss, grads)`` computed as a pipeline; made by
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
        self._losses: dict[Any, tuple[Callable, Callable | None]] = {}

    def _key(self, params: Any, batch: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten((params, batch))
        return tree, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves)

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
            check_batch_args(names, batch_args, self.num_microbatches)
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
            params = part.combine(dynamic)
            return loss_fn(params, *batch) if num_batch > 1 else loss_fn(params, batch)

        if self.loss_reduction != "sum_over_count":
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
            reduction = "sum" if self.loss_reduction == "sum_over_count" else self.loss_reduction
            plan = self._plans[full_key] = _build_plan(
                self._losses[key][0],
                dynamic,
                batch,
                num_stages=self.num_stages,
                num_microbatches=self.num_microbatches,
                schedule=self.schedule,
                devices=self.devices,
                loss_reduction=reduction,
            )
        return plan

    def _call(self, params: Any, batch_args: tuple, timings: dict | None) -> tuple[Any, Any]:
        key, dynamic, batch, _ = self._bind(params, batch_args)
        loss, grads = _run_plan(self._plan(key, dynamic, batch), dynamic, batch, timings)
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
        workers, without the waits for other devices), ``num_actions``, ``num_ticks``,
        and ``values_left`` / ``peak_values`` (values handed between stages still held
        after the call, which is 0, and the most held at once)."""
        timings: dict[str, float] = {}
        out = self._call(params, batch, timings)
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
        ``num_stages`` a multiple of the number of devices) or a
        :class:`~pipemark.runtime.schedules.Schedule`.
    devices:
        The devices to use; default ``jax.devices()``. Pipeline stage ``i`` runs on
        ``devices[i]`` (on ``devices[i % len(devices)]`` when interleaved).
    loss_reduction:
        ``"mean"`` (default) averages the microbatch losses and gradients, right for a
        loss that is a mean over the batch; ``"sum"`` adds them, right for a sum;
        ``"sum_over_count"`` takes a loss returning ``(sum, count)`` and divides the
        sums over the whole batch by the whole batch's count: a masked or weighted
        mean (see :mod:`pipemark.runtime.losses`). With ``"mean"``, a loss divided by a
        count computed from the batch is refused, naming the division.

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
    _check_positive(num_microbatches, "num_microbatches")
    if num_stages is not None:
        _check_positive(num_stages, "num_stages")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise PipemarkError(
            f"Unknown loss_reduction {loss_reduction!r}; use 'mean' for a loss averaged "
            "over the batch, 'sum' for a loss summed over it, or 'sum_over_count' for a "
            "loss that returns (sum, count): a masked or weighted mean."
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
        if not _has_markers(compute, PAIRED_MARK_TYPES):
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
