"""Run a pipeline plan: dispatch each device's column of the schedule, move values
between devices, and accumulate the results (:func:`run_plan`).

How a call runs (the plan was traced, sliced and compiled by
:mod:`pipemark.runtime.plan`):

4. **Dispatch** on one worker thread per device (the caller's thread is device 0's).
   The actions are resolved once per plan (inputs, readers, per device). Each worker
   places its parameters and batch slices on its device in one transfer per call, then
   walks its device's column of the schedule in tick order: an action takes its inputs
   (waiting on its worker's condition for a value another device has not published
   yet), dispatches its stage program (a forward and its backward fused into one, where
   the plan fused them) and publishes the results at once, already
   copied to each reader's device, without waiting for them to be computed: a reader
   dispatches against a value still being computed and XLA starts its program when the
   value is there, so no host thread has to wake up between the two. XLA's CPU client
   runs a small program (and one that calls back into Python) on the dispatching thread
   when its inputs are ready, so one dispatching thread would serialise the devices;
   one thread per device lets them overlap. A value is dropped once its last reader on
   each device has taken it. With data-parallel replicas, a worker dispatches each of
   its stages' reductions over them right after the stage's last action
   (``PipelineOptions.reduce_gradients="after_stage"``), while other workers still
   compute; with ``"end_of_call"`` the caller dispatches them all once every action
   is. The first error of any worker wakes the others, which
   stop, and is raised in the caller; an error inside a program that ran asynchronously
   is raised when the caller waits for the accumulators, before returning. With one
   device the schedule is walked on the caller's thread (``run_plan(...,
   parallel=False)`` does that for any number of devices: same programs in the same
   order per device, hence bit-identical results).

   Under ``jax.distributed`` (:func:`_run_processes`) each of this process's devices
   has a worker thread as above, and the caller's thread runs the transfers this
   process is an end of, in the one global order every process derives from the
   schedule (:attr:`pipemark.runtime.devices.steps.Steps.transfers`). A worker publishes a
   value for another process like any other, under the reading worker's index, and
   goes on; the transfer thread takes it when the order reaches its transfer, and
   publishes what it receives for the reading worker. On CPU, XLA runs a collective on
   the thread that dispatches it until the other process arrives, so transfers run on
   a thread of their own: a worker dispatches its next actions while a transfer waits
   for its peer. Where stage programs have collectives between processes
   (:attr:`~pipemark.runtime.plan.PipelinePlan.ordered`), the workers and the transfer
   thread take turns in the global order of steps and transfers
   (:attr:`~pipemark.runtime.devices.steps.Steps.order`), each step computed before the next
   turn: XLA launches a process's collectives in the order they were dispatched, and
   two processes that dispatched them in different orders (or had two in flight at
   once) waited for each other. For the same reason the reduction of a stage whose
   sub-mesh spans processes (a collective between them) runs on the transfer thread,
   at its place in the global order (:class:`~pipemark.runtime.devices.steps.Reduce`): its
   worker hands the accumulators over after the stage's last action.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pipemark._compat import DEVICE_ERRORS, thread_settings
from pipemark.caches import register_cache
from pipemark.errors import DeviceOutOfMemory, PipemarkError
from pipemark.runtime.devices.compilation import Unit, result_shardings
from pipemark.runtime.devices.exchange import Cancelled, Exchange
from pipemark.runtime.devices.placement import device_slot, held_elsewhere, put_global
from pipemark.runtime.devices.steps import (
    PARAM,
    STAGE,
    TRANSFER,
    Gather,
    Key,
    Reduce,
    Step,
    program_name,
    step_name,
    value_type,
)
from pipemark.runtime.devices.transport import CollectiveTransport, InProcessTransport, Transport
from pipemark.runtime.memory.estimate import describe_limit, format_bytes, plan_memory
from pipemark.runtime.memory.programs import compiled_programs
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.schedules.core import BACKWARD, FORWARD, WEIGHT, Action

__all__ = ["STRATEGIES", "ActionRecord", "action_costs", "out_of_memory", "run_plan", "split_leaf"]


def split_leaf(leaf: Any, num_microbatches: int, micro: int, replicas: int = 1) -> list[Any]:
    """A batch leaf's ``num_microbatches`` microbatches of ``micro`` rows; with
    ``replicas > 1``, each shaped ``(replicas, micro // replicas, ...)``."""
    if num_microbatches == 1 and replicas == 1:  # the leaf itself: splitting would copy it
        return [leaf]
    if isinstance(leaf, jax.Array):
        # One compiled program for all the slices: slicing a jax.Array op by op costs a
        # dispatch (about 0.3 ms) per microbatch.
        split = _splitter(num_microbatches, replicas)
        devices = leaf.devices()
        if leaf.committed or len(devices) != 1:
            return list(split(leaf))
        # An uncommitted array would be split on JAX's default device, which need not
        # be where it lies, nor the pipeline's platform (a TPU, for a pipeline given the
        # host CPU's devices): split it where it is.
        with jax.default_device(next(iter(devices))):
            return list(split(leaf))
    array = np.asarray(leaf)
    parts = [array[m * micro : (m + 1) * micro] for m in range(num_microbatches)]
    if replicas > 1:
        parts = [p.reshape(replicas, -1, *p.shape[1:]) for p in parts]
    return parts


@functools.lru_cache(maxsize=64)
def _splitter(num_microbatches: int, replicas: int) -> Callable[[Any], list[Any]]:
    def split(x: Any) -> list[Any]:
        parts = jnp.split(x, num_microbatches)
        if replicas > 1:
            parts = [p.reshape(replicas, -1, *p.shape[1:]) for p in parts]
        return parts

    return jax.jit(split)


register_cache(_splitter.cache_clear)


def _describe(plan: PipelinePlan, keys: Sequence[Key]) -> str:
    """What a transfer carries, for an error message: the stage and microbatch."""
    m, index, _ = keys[0]
    return f"the outputs of stage {plan.staged.stages[index].name!r} (microbatch {m})"


Placed = tuple[dict[int, Any], list[list[Any]], Any]


class ActionRecord(NamedTuple):
    """One action of a traced call (:func:`run_plan`'s ``records``): the worker that
    ran it, its step, and ``time.perf_counter()`` when it started (its inputs computed)
    and when its results were computed."""

    worker: int
    step: Step
    begin: float
    end: float


class _Call:
    """One call of a plan: its inputs, the values in flight, the accumulators. The
    strategies (:data:`STRATEGIES`) walk its steps."""

    def __init__(self, plan: PipelinePlan, params: Any, batch: Any) -> None:
        self.plan = plan
        self.steps = plan.steps
        self.num_micro = num_micro = plan.schedule.num_microbatches
        self.param_leaves = jax.tree_util.tree_leaves(params)
        batch_leaves = jax.tree_util.tree_leaves(batch)
        replicas = plan.placement.slots[0].replicas
        self.slices = [
            split_leaf(x, num_micro, plan.microbatch_size, replicas) for x in batch_leaves
        ]
        self.local = plan.placement.local
        # One mailbox per worker, and one more for the transfer thread (processes).
        self.exchange = Exchange(len(self.local) + 1)
        self.copies: Transport = InProcessTransport()
        # Under jax.distributed: the transport between processes. A value for a worker
        # of another process waits in the exchange (under that worker's index, taken
        # once) until the transfer thread reaches its transfer in the global order.
        self.transport: Transport | None = None
        self.boundary_bytes = (0, 0)  # sent, received between stages (not gathering)
        self.gathered = [0, 0]  # sent, received of stages' results (processes)
        # Per stage; each stage's worker alone writes its entry. A unit that consumes
        # its accumulators starts from zeros of this call's own.
        self.accs: dict[int, Sequence[Any]] = dict(plan.zeros)
        for index, unit in plan.units.items():
            if unit.donates and unit.zeros is not None and self.local[unit.worker]:
                self.accs[index] = unit.zeros()
        self.finished: set[int] = set()  # stages whose replicas are reduced
        self.host_times: list[float] = []
        # The same in CPU time of the walking threads: without the time the host thread
        # lost to other threads (on CPU devices, those computing the stages).
        self.cpu_times: list[float] = []
        # When measuring (action_costs): each action's seconds, from its inputs
        # computed to its results computed and published.
        self.spans: list[tuple[Action, float]] | None = None
        # When tracing (run_plan's records): each action as an ActionRecord.
        self.records: list[ActionRecord] | None = None
        # What a profiler calls each stage's actions (jax.profiler.TraceAnnotation).
        self.stage_names = [stage.name for stage in plan.staged.stages]
        # Under the threaded strategy: threads[k] runs worker k + 1 (the caller is 0).
        self.threads: list[threading.Thread] = []
        # The JAX settings the caller set for its own thread (jax.default_matmul_precision
        # and the like), which each worker thread sets for itself: they are part of what
        # JAX compiles a program for, and a new thread starts without them. Read by the
        # strategies that start threads (16 us: not on a walk on the caller's thread).
        self.settings: Callable[[], Any] = contextlib.nullcontext
        # Per worker, the results of its actions dispatched and perhaps not computed
        # yet: at most plan.dispatch_ahead (see _bound_dispatch).
        self.pending: list[collections.deque] = [collections.deque() for _ in self.local]
        # Where stage programs have collectives between processes (PipelinePlan.ordered):
        # the turn of each of this process's steps and transfers in the global order.
        self.turns: dict[tuple[int, int], int] = {}

    def place(self, worker: int) -> Placed:
        """This worker's parameters, batch slices and scale, on its slot, in one
        transfer."""
        steps, num_micro = self.steps, self.num_micro
        need_params, need_batch = steps.params[worker], steps.batch[worker]
        plan = self.plan
        sources = [self.param_leaves[i] for i in need_params]
        if plan.param_specs is not None:  # sub-meshes: each parameter with its own layout
            # A parameter sharded over the data axis and gathered once per call is
            # gathered here, the copy every microbatch's program reads.
            where = [plan.stage_param_sharding(i, worker) for i in need_params]
            placed = put_global(sources, where)
            batch = [x for j in need_batch for x in self.slices[j]]
            placed = [*placed, *plan.placement.put(batch, worker)]
        else:
            for j in need_batch:
                sources.extend(self.slices[j])
            placed = plan.placement.put(sources, worker)
        on_device = dict(zip(need_params, placed))
        batch_on: list[list[Any]] = [[] for _ in self.slices]
        start = len(need_params)
        for j in need_batch:
            batch_on[j] = placed[start : start + num_micro]
            start += num_micro
        return on_device, batch_on, self.plan.scales[worker]

    def run_step(self, worker: int, step: Step, placed: Placed) -> float:
        """Dispatch one action and publish its results; the host seconds it spent
        waiting for another worker's value."""
        on_device, batch_on, scale = placed
        inputs = []
        waited = 0.0
        for source, where in step.inputs:
            if source == STAGE:
                value, w = self.exchange.take(where, worker)
                waited += w
            elif source == PARAM:
                value = on_device[where]
            else:  # a batch leaf of a microbatch (a fused step's parts may differ)
                value = batch_on[where[0]][where[1]]
            inputs.append(value)
        measuring = self.spans is not None or self.records is not None
        if measuring:  # the action alone, its inputs computed
            jax.block_until_ready(inputs)
        begin = time.perf_counter() if measuring else 0.0
        # Named in a jax.profiler trace (a no-op without one): the programs a stage
        # runs show under the action that dispatched them.
        try:
            with jax.profiler.TraceAnnotation(step_name(step, self.stage_names)):
                new_accs, outs = self.dispatch(step, inputs, scale)
            if step.sends:  # copying a result a device could not hold fails too
                self.publish(worker, step, outs)
        except DEVICE_ERRORS as error:
            failure = out_of_memory(self.plan, worker, step, error)
            if failure is None:
                raise
            raise failure from error
        if self.turns:
            # Computed before the next turn: two programs with collectives between the
            # same processes in flight at once were seen to hang too (CPU, gloo).
            jax.block_until_ready((new_accs, outs))
        ahead = self.plan.dispatch_ahead
        if ahead is not None and not measuring:
            _bound_dispatch(self.plan, worker, self.pending[worker], step, (new_accs, outs))
        if measuring:
            jax.block_until_ready((new_accs, outs))
            end = time.perf_counter()
            if self.spans is not None:
                self.spans.append((step.action, end - begin))
            if self.records is not None:  # list.append: safe from every worker thread
                self.records.append(ActionRecord(worker, step, begin, end))
        return waited

    def dispatch(self, step: Step, inputs: list[Any], scale: Any) -> tuple[Any, Any]:
        """Dispatch a step's program and keep its accumulators; returns them and its
        passed outputs."""
        index, plan = step.index, self.plan
        if step.fused is None:
            new_accs, outs = plan.units[index].run(list(self.accs.get(index, ())), inputs, scale)
            if step.accumulate:
                self.accs[index] = new_accs
            return new_accs, outs
        # A fused step: each part's accumulators, in part order.
        stages = step.fused.stages
        accs = [acc for part in stages for acc in self.accs.get(part, ())]
        new_accs, outs = plan.fused[step.fused].run(accs, inputs, scale)
        if step.accumulate:
            start = 0
            for part in stages:
                count = len(plan.units[part].accumulated)
                if count:
                    self.accs[part] = new_accs[start : start + count]
                start += count
        return new_accs, outs

    def publish(self, worker: int, step: Step, outs: Sequence[Any]) -> None:
        entries = []
        copies: dict[int, list[Any]] = {}
        crossing = self.plan.placement.crossing
        for position, key, targets in step.sends:
            for reader, count in targets:
                if reader == worker:
                    entries.append((key, reader, outs[position], count))
                elif crossing(worker, reader):  # sent when the global order reaches it
                    entries.append(((*key, reader), len(self.local), outs[position], 1))
                else:
                    copies.setdefault(reader, []).append((key, position, count))
        slots = self.plan.placement.slots
        for reader, wanted in copies.items():
            # Pushed by the producer, one transfer per reader slot: the copy is
            # enqueued behind the producing program, and the reader finds it there.
            values = [outs[p] for _, p, _ in wanted]
            moved = self.copies.move(values, (), slots[worker], slots[reader], None)
            entries.extend((key, reader, v, n) for (key, _, n), v in zip(wanted, moved))
        self.exchange.publish(entries)

    def walk(self, worker: int) -> None:
        """Run worker ``worker``'s column of steps."""
        start = time.perf_counter()
        cpu = time.thread_time()
        placed = self.place(worker)
        waited = 0.0
        steps = self.steps
        finals = steps.finals[worker]  # empty in one process
        reductions = steps.reductions[worker] if steps.reductions else {}
        handed = steps.handed[worker] if steps.handed else {}
        turns = self.turns
        mailbox = len(self.local)  # the transfer thread's
        for n, step in enumerate(steps.columns[worker]):
            turn = turns.get((worker, n))
            if turn is not None:  # its collectives (and the finals') in the global order
                self.exchange.wait_turn(turn)
            waited += self.run_step(worker, step, placed)
            for index in reductions.get(n, ()):  # after the stage, or its REDUCE_GRAD
                self.finish_stage(index)
                if turn is not None:  # computed before the next turn, as run_step's
                    jax.block_until_ready(self.accs[index])
            for index in handed.get(n, ()):  # reduced between processes, in the order
                self.exchange.publish([((-2, index, 0), mailbox, self.accs[index], 1)])
            for index in finals.get(n, ()):  # results final: other processes get them
                self.finish_stage(index)
                self.exchange.publish([((-1, index, 0), mailbox, self.accs[index], 1)])
            if turn is not None:
                self.exchange.pass_turn()
        self.host_times.append(time.perf_counter() - start - waited)
        self.cpu_times.append(time.thread_time() - cpu)

    def transfer(self, producer: int, reader: int, keys: Sequence[Key], types: tuple) -> None:
        """One transfer of the values ``keys`` (of ``types``) from worker ``producer``
        to worker ``reader`` (of another process), if this process is one of the two
        ends: the sender waits until its worker has dispatched the values, the receiver
        publishes what it received to its worker. What it carries is put into words
        only if a message needs it."""
        slots = self.plan.placement.slots
        what = functools.partial(_describe, self.plan, keys)
        values = None
        if self.local[producer]:
            mailbox = len(self.local)  # the transfer thread's
            values = [self.exchange.take((*key, reader), mailbox)[0] for key in keys]
        received = self.transport.move(values, types, slots[producer], slots[reader], what)
        if received is not None:
            readers = self.steps.readers
            self.exchange.publish(
                [(key, reader, v, readers[key[1:]][reader]) for key, v in zip(keys, received)]
            )

    def gather(self, gather: Gather) -> None:
        """Every process other than its worker's receives the accumulated results of
        stage ``gather.index``: one transport move to each receiving device in turn,
        which the worker's process sends and that device's process receives (the
        others pass it by). A stage whose sub-mesh spans processes has its results whole
        on each of its devices already (:meth:`reduce`): each of its processes keeps its
        own copy, and the process of its first device sends to the processes outside."""
        transport, index = self.transport, gather.index
        slot = self.plan.placement.slots[gather.worker]
        source = device_slot(slot.device)
        what = f"the results of stage {self.plan.staged.stages[index].name!r}"
        accs = None
        if self.local[gather.worker]:
            if len(slot.processes) > 1:
                # Whole on each of the slot's devices already (reduced on this thread:
                # :meth:`reduce`): each of its processes keeps its own copy, and the one
                # of the slot's first device sends it.
                accs = [_copy_on(v, slot.device) for v in self.accs[index]]
                self.accs[index] = accs
            else:
                accs = self.exchange.take((-1, index, 0), len(self.local))[0]
                if self.plan.placement.meshes:  # a sub-mesh's results go whole, from one device
                    accs = [jax.device_put(v, source.device) for v in accs]
        sent, received = transport.bytes_sent, transport.bytes_received
        for _, receiver in gather.receivers:
            moved = transport.move(accs, gather.types, source, device_slot(receiver), what)
            if moved is not None:
                self.accs[index] = moved
        self.gathered[0] += transport.bytes_sent - sent
        self.gathered[1] += transport.bytes_received - received

    def reduce(self, entry: Reduce, ordered: bool) -> None:
        """Stage ``entry.index``'s accumulators, handed over by its worker, reduced over
        its replicas: a collective between the processes its sub-mesh spans, which each
        of them dispatches here, at its place in the global order. Results to gather
        end whole on each of the slot's devices, as :meth:`gather` sends them.
        ``ordered``: computed before the next turn."""
        index = entry.index
        self.accs[index] = self.exchange.take((-2, index, 0), len(self.local))[0]
        name = self.plan.staged.stages[index].name
        watchdog = self.plan.watchdog
        watchdog.arm(f"for the other processes of stage {name!r} to reduce its replicas")
        try:
            self.finish_stage(index)
            if entry.gathered:
                slot = self.plan.placement.slots[entry.worker]
                accs = list(self.accs[index])
                self.accs[index] = jax.device_put(accs, [slot.replicated] * len(accs))
            if ordered:
                jax.block_until_ready(self.accs[index])
        finally:
            watchdog.disarm()

    def finish(self) -> None:
        """Reduce this process's accumulators over their data-parallel replicas: the
        one cross-replica reduction of a call."""
        for index in self.plan.units:
            self.finish_stage(index)

    def finish_stage(self, index: int) -> None:
        """Stage ``index``'s accumulators reduced over their replicas, once (only this
        process's: results received from others are already reduced)."""
        unit = self.plan.units[index]
        if unit.finish is None or index in self.finished or not self.local[unit.worker]:
            return
        self.finished.add(index)
        self.accs[index] = unit.finish(list(self.accs[index]))

    def release(self, error: BaseException) -> None:
        """Drop what this call holds on the devices (accumulators, batch slices, the
        results of actions dispatched ahead) and the arrays that the frames of
        ``error``'s traceback (and its cause's) hold: after running out of memory, the
        next call (a smaller batch) needs the memory, even while the error is kept."""
        self.accs.clear()
        self.slices = []
        for pending in self.pending:
            pending.clear()
        while error is not None:
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__

    def results(self) -> list[Any]:
        """The accumulated results, in the staged program's output order."""
        plan, num_micro = self.plan, self.num_micro
        staged = plan.staged
        results: list[Any] = [None] * len(staged.outputs)
        for index, unit in plan.units.items():
            accs = self.accs.get(index)
            if accs is None:  # another process's stage, its results not gathered
                accs = _held_elsewhere(plan, unit)
            for slot, (r, _) in enumerate(unit.accumulated):
                results[r] = accs[slot]
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
            results[r] = jax.device_put(total * np.float32(plan.scale), plan.placement.home())
        if self.transport is not None and not plan.gather_results:
            self.share_scalars(results)
        return results

    def share_scalars(self, results: list[Any]) -> None:
        """Under ``jax.distributed`` with results not gathered, each stage's scalar
        results (a loss, a metric) still go to every other process, into ``results``
        (:meth:`~pipemark.runtime.plan.PipelinePlan.result_holders`): one move per stage
        and receiving process, in stage order, so that both ends of each meet."""
        plan, transport = self.plan, self.transport
        holders = plan.result_holders()
        receivers = plan.placement.receivers()
        sent, received = transport.bytes_sent, transport.bytes_received
        for index, unit in sorted(plan.units.items()):
            out_avals = plan.staged.stages[index].out_avals
            scalars = [
                (r, k)
                for k, (r, o) in enumerate(unit.accumulated)
                if holders[r] is None and plan.staged.outputs[r].kind == "stage"
            ]
            if not scalars:
                continue
            slot = plan.placement.slots[unit.worker]
            source = device_slot(slot.device)
            values = None
            if self.local[unit.worker]:
                values = [self.accs[index][k] for _, k in scalars]
                if len(slot.processes) > 1:
                    # Whole on each device of a sub-mesh that spans processes: each of
                    # them keeps its own copy, and the process of its first device sends.
                    values = [_copy_on(v, slot.device) for v in values]
                    for (r, _), value in zip(scalars, values):
                        results[r] = value
                mine = slot.process == plan.placement.process
                values = jax.device_put(values, slot.device) if mine else None
            types = tuple(value_type(out_avals[unit.accumulated[k][1]]) for _, k in scalars)
            what = f"the scalar results of stage {plan.staged.stages[index].name!r}"
            for process, device in receivers.items():
                if process in slot.processes:
                    continue
                moved = transport.move(values, types, source, device_slot(device), what)
                for (r, _), value in zip(scalars, moved or ()):
                    results[r] = value
        self.gathered[0] += transport.bytes_sent - sent
        self.gathered[1] += transport.bytes_received - received


def _copy_on(value: Any, device: Any) -> Any:
    """This process's whole copy of ``value`` (replicated over a sub-mesh that spans
    processes): the one on ``device`` where this process owns it, else its first."""
    shards = value.addressable_shards
    return next((s.data for s in shards if s.device == device), shards[0].data)


def _bound_dispatch(
    plan: PipelinePlan, worker: int, pending: collections.deque, step: Step, results: Any
) -> None:
    """Record an action's results; while more than ``plan.dispatch_ahead`` actions'
    results are recorded, wait for the oldest. A program's results hold device memory
    from its dispatch, and its inputs until it has run: unbounded, the host dispatches
    the whole schedule while the device runs the first actions, and holds the residuals
    of every microbatch at once. Accumulators donated to a later action are gone
    (deleted): that action's own results are waited for in their turn. A device that
    reports running out of memory only when it runs the program raises here, for that
    action (:func:`out_of_memory`).

    It waits for one of the oldest action's results: one program's results are
    computed together, on every device of its slot, and an error in it reaches each,
    while waiting for each of them is a wait per array on the host's dispatching
    thread (for 30 arrays computed already, 8 us against 2.5 us on this CPU)."""
    pending.append((step, results))
    while len(pending) > plan.dispatch_ahead:
        older, values = pending.popleft()
        leaves = jax.tree_util.tree_leaves(values)
        oldest = next((x for x in leaves if not x.is_deleted()), None)
        if oldest is None:  # each donated to a later action, waited for in its turn
            continue
        try:
            oldest.block_until_ready()
        except DEVICE_ERRORS as error:
            failure = out_of_memory(plan, worker, older, error)
            if failure is None:
                raise
            raise failure from error


def out_of_memory(
    plan: PipelinePlan, worker: int, step: Step, error: Exception
) -> DeviceOutOfMemory | None:
    """A :class:`~pipemark.DeviceOutOfMemoryError` for ``error`` where it says that the
    device ran out of memory (XLA's ``RESOURCE_EXHAUSTED``) while slot ``worker`` ran
    ``step``: naming the stage program, the action, the device, the bytes
    :func:`~pipemark.runtime.memory.plan_memory` predicts there and the device's limit
    (``memory_stats()["bytes_limit"]``, where it reports one); ``None`` for any other
    error. Its cause is ``error``.

    >>> import jax
    >>> from pipemark import examples
    >>> import pipemark as pm
    >>> ex = examples.mlp(num_layers=2, batch=4)
    >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=2)
    >>> plan = pipe.plan(*ex.args)
    >>> step = plan.steps.columns[0][0]
    >>> error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes.")
    >>> print(out_of_memory(plan, 0, step, error))  # doctest: +ELLIPSIS
    Slot 0 (cpu:0) ran out of memory running program 'stage0+stage0_backward' (F0s0, the forward of stage 0 for microbatch 0 and B0s0, ...): RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes. The program's results and temporaries take ...; Pipeline.memory predicts a peak of ... on this slot; the device's limit is unknown (cpu reports no bytes_limit). Give the pipeline ...
    >>> out_of_memory(plan, 0, step, RuntimeError("INVALID_ARGUMENT: ...")) is None
    True
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    names = [stage.name for stage in plan.staged.stages]
    slot = plan.placement.slots[worker]
    actions = [part.action for part in step.parts] if step.fused is not None else [step.action]
    name = program_name(step, names)
    predicted = _predicted(plan, worker, name)
    limit = describe_limit(slot.devices[0])
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    failure = DeviceOutOfMemory(
        f"Slot {worker} ({', '.join(map(str, slot.devices))}) ran out of memory running "
        f"program {name!r} "
        f"({' and '.join(f'{a.label()}, the {a.describe()}' for a in actions)}): {first} "
        f"{predicted}; the device's limit is {limit}. Give the pipeline a smaller batch, "
        "more microbatches (fewer rows each) or more stages, or memory_budget= (bytes "
        "per device) to plan within the device's memory. The arrays passed in are "
        "unchanged."
    )
    failure.__cause__ = error
    return failure


def _predicted(plan: PipelinePlan, worker: int, name: str) -> str:
    """What the estimate predicts for slot ``worker`` and its program ``name``, in
    words (:func:`plan_memory`; its compiled results and temporaries)."""
    try:
        peak = plan_memory(plan).slots[worker].predicted_peak
        analysis = compiled_programs(plan)[name].memory_analysis()
    except Exception as error:  # the message must not fail: say why there is no figure
        return f"No prediction ({type(error).__name__} while estimating)"
    program = analysis.output_size_in_bytes + analysis.temp_size_in_bytes
    return (
        f"The program's results and temporaries take {format_bytes(program)} ({program} "
        f"bytes); Pipeline.memory predicts a peak of {format_bytes(peak)} ({peak} bytes) "
        "on this slot"
    )


def _held_elsewhere(plan: PipelinePlan, unit: Unit) -> list[Any]:
    """The results of ``unit``, a stage of another process, as this process sees them
    when they are not gathered: arrays of the global program with no data here, laid
    out as that process holds them (what ``jax.jit`` returns for such arrays)."""
    out_avals = plan.staged.stages[unit.index].out_avals
    shardings = result_shardings(unit, plan.placement.slots[unit.worker])
    return [
        held_elsewhere(out_avals[o], sharding)
        for (_, o), sharding in zip(unit.accumulated, shardings)
    ]


def _run_serial(call: _Call) -> None:
    """Every worker's steps in the schedule's order, on the caller's thread."""
    begin = time.perf_counter()
    cpu = time.thread_time()
    placed = [call.place(w) for w in range(len(call.local))]
    waited = 0.0
    position = [0] * len(call.local)
    reductions = call.steps.reductions or tuple({} for _ in call.local)
    for worker, step in call.steps.serial:
        waited += call.run_step(worker, step, placed[worker])
        for index in reductions[worker].get(position[worker], ()):  # REDUCE_GRAD
            call.finish_stage(index)
        position[worker] += 1
    call.host_times.append(time.perf_counter() - begin - waited)
    call.cpu_times.append(time.thread_time() - cpu)


def _run_threaded(call: _Call) -> None:
    """One thread per worker, each walking its column (the caller is worker 0)."""
    call.settings = thread_settings()
    call.threads = threads = [
        threading.Thread(target=_guarded, args=(call, w), name=f"pipemark-device{w}")
        for w in range(1, len(call.local))
    ]
    _guarded(call, 0)
    # In order: once worker w has finished it has started worker w + 1, unless
    # starting it failed (then the error is in the exchange).
    for thread in threads:
        if thread.ident is None:
            break
        thread.join()
    if call.exchange.error is not None:
        raise call.exchange.error
    # The call returns once every action is dispatched, like any JAX computation
    # (and like the single-device walk): an error inside a program that runs
    # asynchronously reaches the accumulated results, and is raised where they are
    # used (jax.block_until_ready, printing, conversion to NumPy). Waiting here cost
    # the caller a thread wake-up and the chance to dispatch more work.


def _guarded(call: _Call, worker: int) -> None:
    try:
        # Each worker first starts the next one's thread. Starting a thread costs about
        # 150 µs here; started one after another by the caller, S - 1 of them would
        # delay device 0's first action, which everything else waits for. In the
        # cascade the caller pays one, and worker w starts w thread-starts after the
        # call began, long before a pipeline's first value reaches device w.
        if worker < len(call.threads):
            call.threads[worker].start()
        # The mesh context is per thread: without run_plan's set_mesh(None) here too,
        # JAX would compile a program walked on this thread apart from the same program
        # walked on the caller's (a serial walk, action_costs).
        with call.settings(), jax.set_mesh(None):
            call.walk(worker)
    except Cancelled:
        pass
    except BaseException as error:  # handed to the caller, which re-raises it
        call.exchange.fail(error)


def _run_processes(call: _Call) -> None:
    """Under ``jax.distributed``: this process's workers each walk their column on a
    thread of their own, as in the threaded strategy, while the caller's thread walks
    the transfers to and from other processes in the one global order every process
    derives from the schedule (so the two ends of each collective meet in the same
    order, and nothing waits on a process that waits on it). A transfer blocks only the
    transfer thread, which keeps the watchdog armed while it waits: a worker dispatches
    its next action while the values of its last one are still on their way. Each
    stage's accumulated results go to every other process after the transfers between
    stages (in the same order), while the last stages still compute."""
    process = call.plan.placement.process
    call.settings = thread_settings()
    call.transport = transport = CollectiveTransport(call.plan.watchdog, process)
    if call.plan.ordered:
        mine = [(w, n) for w, n in call.steps.order if w == TRANSFER or call.local[w]]
        call.turns = {entry: turn for turn, entry in enumerate(mine)}
    workers = [w for w, mine in enumerate(call.local) if mine]
    threads = [
        threading.Thread(target=_guard, args=(call, call.walk, w), name=f"pipemark-device{w}")
        for w in workers
    ]
    for thread in threads:
        thread.start()
    _guard(call, _walk_transfers, call)
    for thread in threads:
        thread.join()
    if call.exchange.error is not None:
        raise call.exchange.error
    sent, received = call.gathered
    call.boundary_bytes = (transport.bytes_sent - sent, transport.bytes_received - received)


def _walk_transfers(call: _Call) -> None:
    """The transfers this process is an end of, one after another in the global order:
    values between stages, then each stage's results (while the last stages still
    compute). Where the plan orders its programs (:attr:`PipelinePlan.ordered`), each
    waits for its turn, with the watchdog armed: a worker ahead of it may wait in a
    collective for a process that is gone."""
    watchdog, exchange = call.plan.watchdog, call.exchange
    for i, transfer in enumerate(call.steps.transfers):
        turn = call.turns.get((TRANSFER, i))
        if turn is not None:
            watchdog.arm("for its turn, behind a stage program waiting for another process")
            try:
                exchange.wait_turn(turn)
            finally:
                watchdog.disarm()
        if isinstance(transfer, Gather):
            call.gather(transfer)
        elif isinstance(transfer, Reduce):
            call.reduce(transfer, turn is not None)
        else:
            call.transfer(*transfer)
        if turn is not None:
            exchange.pass_turn()


def _guard(call: _Call, walk: Callable[..., None], *args: Any) -> None:
    """Run ``walk`` (under ``run_plan``'s mesh context, as :func:`_guarded` does); its
    error stops the others (through the exchange) and is raised in the caller."""
    try:
        with call.settings(), jax.set_mesh(None):
            walk(*args)
    except Cancelled:
        pass
    except BaseException as error:
        call.exchange.fail(error)


#: How a call walks its plan's steps, by name: ``"serial"`` (every worker's steps on the
#: caller's thread), ``"threaded"`` (a thread per worker), ``"processes"`` (under
#: ``jax.distributed``, this process's workers and the transfers to and from others).
STRATEGIES: dict[str, Callable[[_Call], None]] = {
    "serial": _run_serial,
    "threaded": _run_threaded,
    "processes": _run_processes,
}


def _strategy(plan: PipelinePlan, parallel: bool) -> str:
    if plan.placement.distributed:
        return "processes"
    return "threaded" if parallel and len(plan.placement.slots) > 1 else "serial"


def run_plan(
    plan: PipelinePlan,
    params: Any,
    batch: Any,
    timings: dict | None,
    *,
    parallel: bool = True,
    records: list[ActionRecord] | None = None,
) -> Any:
    """Run ``plan`` on ``params`` and a whole ``batch`` (split into microbatches here)
    and return the accumulated results in the plan's output tree. ``timings``, when a
    dict, receives the dispatch timings (see :meth:`pipemark.Pipeline.timed_call`);
    ``parallel=False`` walks every worker's actions on the caller's thread.
    ``records``, when a list, receives an :class:`ActionRecord` per action, each action
    waited for (its inputs, then its results): a slower call, which
    :mod:`pipemark.runtime.execution.perfetto` draws."""
    # Each program runs on its own slot (a device or a sub-mesh), whatever mesh the
    # caller set with jax.set_mesh (MaxText's train loop does; a model with bare
    # PartitionSpecs must be traced under one): JAX refuses to run a program on devices
    # other than the context mesh's. The loss was traced under it before; its equations
    # carry that mesh, rebuilt on each stage's sub-mesh.
    with jax.set_mesh(None):
        call = _Call(plan, params, batch)
        call.records = records
        start = time.perf_counter()
        try:
            STRATEGIES[_strategy(plan, parallel)](call)
            call.finish()
            values_left = len(call.exchange)
        except DeviceOutOfMemory as error:
            call.release(error)
            raise
        finally:
            call.exchange.clear()  # after a failure, values nobody will read
        dispatch_s = time.perf_counter() - start
        results = call.results()
    if timings is not None:
        timings["dispatch_s"] = dispatch_s
        timings["host_s"] = sum(call.host_times)
        if call.cpu_times:  # in one process (the processes strategy does not measure it)
            timings["host_cpu_s"] = sum(call.cpu_times)
        timings["num_actions"] = call.steps.num_actions
        timings["num_programs"] = call.steps.num_programs
        timings["num_ticks"] = plan.schedule.num_ticks
        timings["values_left"] = values_left
        timings["peak_values"] = call.exchange.peak
        timings["bytes_copied"] = call.copies.bytes_received
        if call.transport is not None:
            timings["bytes_sent"], timings["bytes_received"] = call.boundary_bytes
            timings["bytes_gathered"] = call.gathered[1]
            timings["transfer_s"] = call.transport.seconds
    return jax.tree_util.tree_unflatten(plan.out_tree, results)


def action_costs(
    plan: PipelinePlan, params: Any, batch: Any, repeat: int = 3
) -> dict[str, tuple[float, ...]]:
    """Each action's time on its own, per kind and stage: the plan's actions walked one
    at a time on the caller's thread, each waited for (its inputs computed first, then
    its results), ``repeat`` times after one warm-up walk; the median over microbatches
    and repeats. Costs for :func:`pipemark.simulate_schedule` and
    :func:`pipemark.runtime.zero_bubble_schedule`: ``{"forward": (per stage), "backward": ...,
    "weight": ...}`` in seconds, 0 where a stage has no such program. In a plan whose
    schedule does not split the backward, ``"backward"`` is the whole backward and
    ``"weight"`` is 0. Each action is timed as its own program, also where a call
    runs a forward and its backward as one (fused) program."""
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise PipemarkError(f"repeat must be a positive int, got {repeat!r}.")
    # Every action on its own: the plan's steps without fusion, resolved with the plan.
    plan = dataclasses.replace(plan, steps=plan.unfused_steps, fused={})
    seconds: dict[tuple[str, int], list[float]] = {}
    for walk in range(repeat + 1):
        call = _Call(plan, params, batch)
        if plan.placement.distributed:
            raise PipemarkError(
                "action_costs times every stage on this process's devices; under "
                "jax.distributed, measure on one process with the stages on its own devices."
            )
        call.spans = []
        try:
            with jax.set_mesh(None):  # as run_plan walks them: the same compiled programs
                _run_serial(call)
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
