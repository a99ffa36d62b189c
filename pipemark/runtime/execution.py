"""Run a pipeline plan: dispatch each device's column of the schedule, move values
between devices, and accumulate the results (:func:`run_plan`).

How a call runs (the plan was traced, sliced and compiled by
:mod:`pipemark.runtime.plan`):

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
   device the schedule is walked on the caller's thread (``run_plan(...,
   parallel=False)`` does that for any number of devices: same programs in the same
   order per device, hence bit-identical results).
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

from pipemark._compat import copy_to_device
from pipemark.caches import register_cache
from pipemark.errors import PipemarkError
from pipemark.runtime.agreement import check_agreement
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.schedules import BACKWARD, FORWARD, WEIGHT, Action
from pipemark.runtime.transport import Transport, Watchdog

__all__ = ["action_costs", "run_plan", "split_leaf"]


# ---------------------------------------------------------------------- running


def split_leaf(leaf: Any, num_microbatches: int, micro: int) -> list[Any]:
    if isinstance(leaf, jax.Array):
        # One compiled program for all the slices: slicing a jax.Array op by op costs a
        # dispatch (about 0.3 ms) per microbatch.
        return list(_splitter(num_microbatches)(leaf))
    array = np.asarray(leaf)
    return [array[m * micro : (m + 1) * micro] for m in range(num_microbatches)]


@functools.lru_cache(maxsize=64)
def _splitter(num_microbatches: int) -> Callable[[Any], list[Any]]:
    return jax.jit(lambda x: jnp.split(x, num_microbatches))


register_cache(_splitter.cache_clear)


class _Cancelled(Exception):
    """Raised in a worker waiting for a value when another worker has failed."""


# Where an action's input comes from (the first item of each entry of _Step.inputs).
_PARAM, _BATCH, _STAGE = 0, 1, 2


class _Step(NamedTuple):
    """One action with everything resolved that does not change between calls."""

    index: int  # sliced stage
    microbatch: int
    action: Action  # the schedule's action it runs
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
    owner: dict[int, int]  # sliced stage -> its worker
    readers: dict[tuple[int, int], dict[int, int]]  # stage output -> {worker: readers}
    # Under jax.distributed, per entry of ``serial``: the transfers into its worker that
    # precede it, as (producer worker, the keys it sends, their (shape, dtype)); empty
    # in one process.
    incoming: tuple[tuple[tuple[int, tuple[tuple[int, int, int], ...], tuple], ...], ...]


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
        index = {
            FORWARD: plan.forward_stages,
            BACKWARD: plan.backward_stages,
            WEIGHT: plan.weight_stages,
        }[action.kind][k]
        if index is None:  # a stage without a backward (or weight) program
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
        step = _Step(index, m, action, bool(unit.accumulated), tuple(inputs), sends)
        columns[w].append(step)
        serial.append((w, step))
    owner = {index: worker_of[unit.device] for index, unit in plan.units.items()}
    program = _Program(
        columns=tuple(tuple(c) for c in columns),
        serial=tuple(serial),
        devices=devices,
        params=tuple(tuple(sorted(p)) for p in params),
        batch=tuple(tuple(sorted(b)) for b in batch),
        num_actions=len(serial),
        owner=owner,
        readers=readers,
        incoming=_incoming(serial, owner, devices, staged.stages),
    )
    plan._program = program
    return program


def _incoming(
    serial: list[tuple[int, _Step]], owner: dict[int, int], devices: tuple, stages: Sequence
) -> tuple:
    """For each action in the global order, the values it reads from workers of other
    processes that no earlier action on its worker received, grouped by producer: the
    producer, the values' keys and their ``(shape, dtype)``."""
    me = jax.process_index()
    process = [getattr(d, "process_index", me) for d in devices]
    moved: set[tuple[tuple[int, int, int], int]] = set()
    incoming = []
    for worker, step in serial:
        per_producer: dict[int, list[tuple[int, int, int]]] = {}
        for source, key in step.inputs:
            if source != _STAGE or (key, worker) in moved:
                continue
            producer = owner[key[1]]
            if process[producer] != process[worker]:
                moved.add((key, worker))
                per_producer.setdefault(producer, []).append(key)
        incoming.append(
            tuple(
                (p, tuple(keys), tuple(_type(stages[i].out_avals[o]) for _, i, o in keys))
                for p, keys in per_producer.items()
            )
        )
    return tuple(incoming)


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


def run_plan(
    plan: PipelinePlan,
    params: Any,
    batch: Any,
    timings: dict | None,
    *,
    parallel: bool = True,
) -> Any:
    """Run ``plan`` on ``params`` and a whole ``batch`` (split into microbatches here)
    and return the accumulated results in the plan's output tree. ``timings``, when a
    dict, receives the dispatch timings (see :meth:`pipemark.Pipeline.timed_call`);
    ``parallel=False`` walks every device's actions on the caller's thread."""
    call = _Call(plan, params, batch)
    start = time.perf_counter()
    try:
        if not all(call.local):
            call.run_processes()
        elif parallel and len(call.program.devices) > 1:
            call.run_threaded()
        else:
            call.run_serial()
        values_left = len(call.exchange)
    finally:
        call.exchange.clear()  # after a failure, values nobody will read
    if timings is not None:
        timings["dispatch_s"] = time.perf_counter() - start
        timings["host_s"] = sum(call.host_times)
        timings["num_actions"] = call.program.num_actions
        timings["num_ticks"] = plan.schedule.num_ticks
        timings["values_left"] = values_left
        timings["peak_values"] = call.exchange.peak
        if call.transport is not None:
            timings["bytes_sent"], timings["bytes_received"] = call.boundary_bytes
            timings["bytes_gathered"] = call.transport.bytes_received - call.boundary_bytes[1]
            timings["transfer_s"] = call.transport.seconds
    return jax.tree_util.tree_unflatten(plan.out_tree, call.results())


def action_costs(
    plan: PipelinePlan, params: Any, batch: Any, repeat: int = 3
) -> dict[str, tuple[float, ...]]:
    """Each action's time on its own, per kind and stage: the plan's actions walked one
    at a time on the caller's thread, each waited for (its inputs computed first, then
    its results), ``repeat`` times after one warm-up walk; the median over microbatches
    and repeats. Costs for :func:`pipemark.simulate_schedule` and
    :func:`pipemark.zero_bubble_schedule`: ``{"forward": (per stage), "backward": ...,
    "weight": ...}`` in seconds, 0 where a stage has no such program. In a plan whose
    schedule does not split the backward, ``"backward"`` is the whole backward and
    ``"weight"`` is 0."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise PipemarkError(f"repeat must be a positive int, got {repeat!r}.")
    seconds: dict[tuple[str, int], list[float]] = {}
    for walk in range(repeat + 1):
        call = _Call(plan, params, batch)
        if not all(call.local):
            raise PipemarkError(
                "action_costs times every stage on this process's devices; under "
                "jax.distributed, measure on one process with the stages on its own devices."
            )
        call.spans = []
        try:
            call.run_serial()
        finally:
            call.exchange.clear()
        for action, took in call.spans if walk else ():  # the first walk warms up
            seconds.setdefault((action.kind, action.stage), []).append(took)
    count = len(plan.schedule.stage_devices)
    return {
        kind: tuple(
            float(np.median(seconds[(kind, k)])) if (kind, k) in seconds else 0.0
            for k in range(count)
        )
        for kind in (FORWARD, BACKWARD, WEIGHT)
    }


def _type(aval: Any) -> tuple[tuple[int, ...], Any]:
    return tuple(aval.shape), np.dtype(aval.dtype)


def _describe(plan: PipelinePlan, keys: list[tuple[int, int, int]]) -> str:
    """What a transfer carries, for an error message: the stage and microbatch."""
    m, index, _ = keys[0]
    return f"the outputs of stage {plan.staged.stages[index].name!r} (microbatch {m})"


class _Call:
    """One call of a plan: its inputs, the values in flight, the accumulators."""

    def __init__(self, plan: PipelinePlan, params: Any, batch: Any) -> None:
        self.plan = plan
        self.program = program = _program(plan)
        self.num_micro = num_micro = plan.schedule.num_microbatches
        self.param_leaves = jax.tree_util.tree_leaves(params)
        batch_leaves = jax.tree_util.tree_leaves(batch)
        self.slices = [split_leaf(x, num_micro, plan.microbatch_size) for x in batch_leaves]
        self.exchange = _Exchange(len(program.devices))
        # Which workers' devices belong to this process (all of them but under
        # jax.distributed), and the values this process hands to other processes.
        me = jax.process_index()
        self.local = [getattr(d, "process_index", me) == me for d in program.devices]
        self.outbox: dict[tuple[tuple[int, int, int], int], Any] = {}
        self.transport: Transport | None = None
        self.boundary_bytes = (0, 0)  # sent, received between stages (not gathering)
        # Per stage; each stage's worker alone writes its entry.
        self.accs: dict[int, list[Any]] = {}
        for index, unit in plan.units.items():
            if unit.zeros is not None and self.local[program.owner[index]]:
                # Immutable arrays: the zeros one call starts from serve every later call.
                zeros = plan._zeros.get(index)
                if zeros is None:
                    zeros = plan._zeros[index] = unit.zeros()
                self.accs[index] = zeros
        self.scale = np.float32(1.0 / num_micro if plan.loss_reduction == "mean" else 1.0)
        self.host_times: list[float] = []
        # When measuring (action_costs): each action's seconds, from its inputs
        # computed to its results computed and published.
        self.spans: list[tuple[Action, float]] | None = None
        # threads[k] runs device worker k + 1 (the caller is worker 0).
        self.threads: list[threading.Thread] = []

    def place(self, worker: int) -> tuple[dict[int, Any], list[list[Any]], Any]:
        """This worker's parameters, batch slices and scale, on its device, in one
        transfer (the scale, the same every call, only once per plan)."""
        program, plan, num_micro = self.program, self.plan, self.num_micro
        device = program.devices[worker]
        need_params, need_batch = program.params[worker], program.batch[worker]
        sources = [self.param_leaves[i] for i in need_params]
        for j in need_batch:
            sources.extend(self.slices[j])
        device_scale = plan._scales.get(worker)
        if device_scale is None:
            device_scale = plan._scales[worker] = jax.device_put(self.scale, device)
        placed = copy_to_device(sources, device)
        on_device = dict(zip(need_params, placed))
        batch_on: list[list[Any]] = [[] for _ in self.slices]
        start = len(need_params)
        for j in need_batch:
            batch_on[j] = placed[start : start + num_micro]
            start += num_micro
        return on_device, batch_on, device_scale

    def run_step(
        self, worker: int, step: _Step, placed: tuple[dict[int, Any], list[list[Any]], Any]
    ) -> float:
        """Dispatch one action and publish its results; the host seconds it spent
        waiting for another worker's value."""
        on_device, batch_on, device_scale = placed
        m = step.microbatch
        inputs = []
        waited = 0.0
        for source, where in step.inputs:
            if source == _STAGE:
                value, w = self.exchange.take(where, worker)
                waited += w
            elif source == _PARAM:
                value = on_device[where]
            else:
                value = batch_on[where][m]
            inputs.append(value)
        if self.spans is not None:  # measuring: the action alone, its inputs computed
            jax.block_until_ready(inputs)
        begin = time.perf_counter() if self.spans is not None else 0.0
        index = step.index
        new_accs, outs = self.plan.units[index].run(self.accs.get(index, ()), inputs, device_scale)
        if step.accumulate:
            self.accs[index] = new_accs
        if step.sends:
            self.publish(worker, step, outs)
        if self.spans is not None:
            jax.block_until_ready((new_accs, outs))
            self.spans.append((step.action, time.perf_counter() - begin))
        return waited

    def publish(self, worker: int, step: _Step, outs: Sequence[Any]) -> None:
        entries = []
        copies: dict[int, list[Any]] = {}
        for position, key, targets in step.sends:
            for reader, count in targets:
                if reader == worker:
                    entries.append((key, reader, outs[position], count))
                elif not self.local[reader]:  # sent when the global order reaches it
                    self.outbox[(key, reader)] = outs[position]
                else:
                    copies.setdefault(reader, []).append((key, position, count))
        for reader, wanted in copies.items():
            # Pushed by the producer, one transfer per reader device: the copy is
            # enqueued behind the producing program, and the reader finds it there.
            moved = copy_to_device([outs[p] for _, p, _ in wanted], self.program.devices[reader])
            entries.extend((key, reader, v, n) for (key, _, n), v in zip(wanted, moved))
        self.exchange.publish(entries)

    def walk(self, worker: int) -> None:
        start = time.perf_counter()
        placed = self.place(worker)
        waited = 0.0
        for step in self.program.columns[worker]:
            waited += self.run_step(worker, step, placed)
        self.host_times.append(time.perf_counter() - start - waited)

    def guarded(self, worker: int) -> None:
        try:
            # Each worker first starts the next one's thread. Starting a thread costs
            # about 150 µs here; started one after another by the caller, S - 1 of them
            # would delay device 0's first action, which everything else waits for. In
            # the cascade the caller pays one, and worker w starts w thread-starts after
            # the call began, long before a pipeline's first value reaches device w.
            if worker < len(self.threads):
                self.threads[worker].start()
            self.walk(worker)
        except _Cancelled:
            pass
        except BaseException as error:  # handed to the caller, which re-raises it
            self.exchange.fail(error)

    def run_threaded(self) -> None:
        self.threads.extend(
            threading.Thread(target=self.guarded, args=(w,), name=f"pipemark-device{w}")
            for w in range(1, len(self.program.devices))
        )
        self.guarded(0)  # the caller is the first device's worker
        # In order: once worker w has finished it has started worker w + 1, unless
        # starting it failed (then the error is in the exchange).
        for thread in self.threads:
            if thread.ident is None:
                break
            thread.join()
        if self.exchange.error is not None:
            raise self.exchange.error
        # The call returns once every action is dispatched, like any JAX computation
        # (and like the single-device walk): an error inside a program that runs
        # asynchronously reaches the accumulated results, and is raised where they
        # are used (jax.block_until_ready, printing, conversion to NumPy). Waiting
        # here cost the caller a thread wake-up and the chance to dispatch more work.

    def run_serial(self) -> None:
        begin = time.perf_counter()
        placed = [self.place(w) for w in range(len(self.program.devices))]
        waited = 0.0
        for worker, step in self.program.serial:
            waited += self.run_step(worker, step, placed[worker])
        self.host_times.append(time.perf_counter() - begin - waited)

    def run_processes(self) -> None:
        """Under ``jax.distributed``: run this process's workers' actions, and move
        values to and from other processes, walking the schedule's one global order
        (every process walks it, so the two ends of each transfer meet in the same
        order and nothing waits on a process that waits on it). Then every process
        receives the accumulated results of the others' stages."""
        program, plan = self.program, self.plan
        if plan._watchdog is None:  # the plan's first call: one watching thread per plan
            check_agreement(plan, plan.timeout_s)
            plan._watchdog = Watchdog(plan.timeout_s)
        self.transport = Transport(plan._watchdog)
        start = time.perf_counter()
        placed = {w: self.place(w) for w, mine in enumerate(self.local) if mine}
        for (worker, step), incoming in zip(program.serial, program.incoming):
            for producer, keys, types in incoming:
                self.transfer(producer, worker, keys, types)
            if self.local[worker]:
                self.run_step(worker, step, placed[worker])
        self.boundary_bytes = (self.transport.bytes_sent, self.transport.bytes_received)
        self.gather()
        self.host_times.append(time.perf_counter() - start - self.transport.seconds)

    def transfer(
        self, producer: int, reader: int, keys: Sequence[tuple[int, int, int]], types: tuple
    ) -> None:
        """One transfer of the values ``keys`` (of ``types``) from worker ``producer``
        to worker ``reader`` (of another process), if this process is one of the two
        ends. What it carries is put into words only if a message needs it."""
        devices = self.program.devices
        what = functools.partial(_describe, self.plan, keys)
        if self.local[producer]:
            values = [self.outbox.pop((key, reader)) for key in keys]
            self.transport.send(values, devices[producer], devices[reader], what)
        elif self.local[reader]:
            values = self.transport.receive(types, devices[producer], devices[reader], what)
            readers = self.program.readers
            self.exchange.publish(
                [(key, reader, v, readers[key[1:]][reader]) for key, v in zip(keys, values)]
            )

    def gather(self) -> None:
        """Every process receives the accumulated results of every other process's
        stages (in one order all processes walk: stage by stage, process by process)."""
        program, transport = self.program, self.transport
        # One device of each process receives for it: a pipeline device where the
        # process has one, else its first device (a process may own no stage: more
        # processes than stage devices).
        first: dict[int, Any] = {}
        for device in (*program.devices, *jax.devices()):
            first.setdefault(device.process_index, device)
        me = jax.process_index()
        for index in sorted(self.plan.units):
            unit = self.plan.units[index]
            if not unit.accumulated:
                continue
            source = program.owner[index]
            out_avals = self.plan.staged.stages[index].out_avals
            types = [_type(out_avals[o]) for _, o in unit.accumulated]
            what = f"the results of stage {self.plan.staged.stages[index].name!r}"
            sender = program.devices[source]
            for process, receiver in first.items():
                if process == sender.process_index:
                    continue
                if self.local[source]:
                    transport.send(self.accs[index], sender, receiver, what)
                elif process == me:
                    self.accs[index] = transport.receive(types, sender, receiver, what)

    def results(self) -> list[Any]:
        """The accumulated results, in the staged program's output order."""
        plan, num_micro = self.plan, self.num_micro
        staged = plan.staged
        results: list[Any] = [None] * len(staged.outputs)
        for index, unit in plan.units.items():
            for slot, (r, _) in enumerate(unit.accumulated):
                results[r] = self.accs[index][slot]
        num_params = plan.num_param_leaves
        for r, ref in enumerate(staged.outputs):
            if ref.kind == "stage":
                continue
            # A result that is a program input or a constant: the same reduction, on the host.
            if ref.kind == "input":
                parts = [
                    np.asarray(self.param_leaves[ref.index])
                    if ref.index < num_params
                    else np.asarray(self.slices[ref.index - num_params][m])
                    for m in range(num_micro)
                ]
            else:
                value = getattr(ref.value, "val", ref.value)
                parts = [np.asarray(value)] * num_micro
            total = sum(parts[1:], parts[0])
            mean = plan.loss_reduction == "mean"
            results[r] = jnp.asarray(total * self.scale if mean else total)
        return results
