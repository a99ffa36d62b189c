"""What a pipeline call holds on each device slot, predicted from its plan:
:func:`estimate_memory`, behind :meth:`pipemark.Pipeline.memory`. Meant as an upper
bound of the device's peak: a plan that ``memory_budget=`` accepts must fit.

Per slot, in bytes:

* ``parameters``: the parameter leaves its stages read, placed there once a call; on
  a sub-mesh, a device's shard of each (laid out by its ``param_specs``: a parameter
  sharded over the data axis, FSDP, counts ``1/D`` of its bytes);
* ``batch``: its stages' batch leaves, all microbatches, placed there once a call;
* ``accumulators``: the loss and gradients its stages accumulate over microbatches
  (donated from one action to the next: one copy; on a sub-mesh a device's shard),
  and what the plan keeps there between calls (the microbatch scale; the zeros that
  accumulators not donated start from). Not the result of a stage's reduction over
  its data-parallel replicas, which replaces them: with ``reduce_gradients=
  "after_stage"`` on a slot with several stages it is made while the others still
  hold their values in flight;
* ``arguments``: the caller's own arrays lying on the slot's device beyond those
  (:func:`argument_bytes`): parameters that other slots read (a model made on one
  device holds them all there), the batch as given, and the microbatches of a batch
  leaf split where it lies for another slot. Only where the estimate is given the
  arrays (:meth:`pipemark.Pipeline.memory` is, and so is a budget); else 0, as when
  each parameter lies on the slot that reads it and the batch on the host;
* ``in_flight``: the values handed between actions (activations sent forward,
  cotangents sent back, residuals a forward keeps for its backward) that the slot
  holds at once, at the action where they and its temporaries are largest
  (:func:`held_in_flight`). Each worker thread dispatches as soon as the values it
  reads are dispatched, so another slot may run ahead as far as the schedule's
  dependencies let it, its results copied here at once: the most any interleaving
  holds. The results and inputs of the last ``dispatch_ahead`` actions, which the
  device may not have run yet, count as well; with ``dispatch_ahead=None`` (no bound)
  those of every earlier action of the slot, which the host may all have dispatched
  before the device ran any. Each value at its bytes on the device where the programs
  are compiled (:func:`plan_memory`): a TPU pads arrays to its tiles, which a program's
  ``memory_analysis()`` counts in its outputs (:func:`device_padding`); else at its
  logical bytes. What the schedule decides: GPipe holds all ``M`` microbatches'
  residuals on the first stage, 1F1B at most ``S``.
  Parameters sharded over the data axis add their gathered copy: with
  ``fsdp_gather="once"`` every such parameter of the slot, held for the whole call;
  with ``"per_microbatch"`` those of the slot's stage that reads the most, held while
  one program runs;
* ``temporaries``: XLA's temporaries (``memory_analysis()``) of the program running
  at that action, when the programs are compiled for the slot. They meet the values
  held while that program runs on the device (:func:`held_while_running`), fewer than
  while the host dispatches it: by then every earlier action has run and the inputs
  it read for the last time are freed. ``in_flight`` is that action's; never less
  than the most in flight alone;
* ``update`` (a training step): the update after the pipeline, each slot's part:
  its compiled arguments (parameters, optimizer state, gradients) and results, its
  earlier parts' results, the pipeline's results it does not read, the caller's arrays
  there it does not read, and its temporaries.

``predicted_peak`` is the largest of the pipeline's sum and the update; ``buffers``
the same without temporaries, the most bytes of arrays at once. On a TPU the device's
``peak_bytes_in_use`` counts buffers (arrays) and not the programs' temporaries
(``jax.jit`` of a step whose program needs 11.3 GiB of temporaries peaks at 2.0 GiB
there): compare it with ``buffers``. On the CPU the test suite compares ``buffers``
with ``jax.live_arrays()`` sampled after every action of a call (tests/runtime/
test_memory.py): never below, at most 1.3 × above in the runs seen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from pipemark.cost import nbytes
from pipemark.runtime.devices.sharding import gathered_spec
from pipemark.runtime.devices.steps import STAGE, Key, program_name
from pipemark.runtime.memory.programs import compiled_programs
from pipemark.runtime.plan import PipelinePlan

__all__ = [
    "MemoryEstimate",
    "SlotMemory",
    "argument_bytes",
    "describe_limit",
    "device_bytes",
    "device_padding",
    "estimate_memory",
    "held_in_flight",
    "held_while_running",
    "format_bytes",
    "local_device",
    "plan_memory",
    "resident_bytes",
    "result_avals",
    "with_host",
    "with_update",
]

_FIELDS = (
    "parameters", "batch", "accumulators", "arguments", "in_flight", "temporaries", "update",
    "buffers", "host",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SlotMemory:
    """One device slot's predicted bytes (see :mod:`pipemark.runtime.memory`);
    ``temporaries`` is ``None`` where the programs were not compiled, ``measured_peak``
    the device's own ``memory_stats()["peak_bytes_in_use"]`` where it keeps one (the
    process's peak so far, not one call's; ``None`` on CPU)."""

    slot: int
    devices: str
    parameters: int
    batch: int
    accumulators: int
    in_flight: int
    temporaries: int | None
    predicted_peak: int
    measured_peak: int | None = None
    #: A training step's update on this slot (its part, or the whole update on the
    #: first slot), after the pipeline: its arguments (parameters, optimizer state,
    #: gradients), results and temporaries. The slot's predicted peak is the larger of
    #: this and the rest.
    update: int | None = None
    #: The caller's own arrays (:func:`argument_bytes`) on this slot's device beyond
    #: ``parameters`` and ``batch``: parameters other slots read, the whole batch as
    #: given, its microbatches where they were split here for another slot, the
    #: optimizer state. 0 where the estimate was not given the arrays.
    arguments: int = 0
    #: The most bytes of arrays the slot holds at once, its programs' temporaries left
    #: out: ``parameters + batch + accumulators + arguments`` and the most in flight,
    #: or a training step's update phase where that is larger. On a device that
    #: counts arrays alone (a TPU's ``peak_bytes_in_use``, JAX's ``live_arrays``),
    #: what to compare with the measured peak.
    buffers: int = 0
    #: What a training step keeps in host memory for this slot (offloaded optimizer
    #: state, ``pipeline_train_step(offload=...)``), at most: the old state and the new
    #: during the update. Not part of ``predicted_peak``, which is the device's.
    host: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per device slot, what a call of a pipeline holds (:class:`SlotMemory`)."""

    slots: tuple[SlotMemory, ...]

    def __str__(self) -> str:
        fields = [
            f
            for f in _FIELDS
            if f not in ("update", "arguments", "host") or any(getattr(s, f) for s in self.slots)
        ]
        head = ("slot", *fields, "predicted_peak", "measured")
        rows = [head]
        for s in self.slots:
            values = [getattr(s, name) for name in fields] + [s.predicted_peak, s.measured_peak]
            rows.append((f"{s.slot} {s.devices}", *(format_bytes(v) for v in values)))
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
        return "\n".join(
            "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in
                      enumerate(zip(row, widths)))
            for row in rows
        )  # fmt: skip


def format_bytes(value: int | None) -> str:
    """``value`` bytes in the largest unit that keeps it at least 1 (``"1.5 GiB"``);
    ``"-"`` for ``None``."""
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def _key_bytes(plan: PipelinePlan, key: Key) -> int:
    _, stage, output = key
    return nbytes(plan.staged.stages[stage].out_avals[output])


def _value_sizes(plan: PipelinePlan, padding: Mapping[str, Fraction] | None) -> Callable:
    """The bytes of a value handed between actions (by its key): its logical bytes, times
    ``padding`` of the program that makes it where given (rounded up)."""
    if not padding:
        return functools.partial(_key_bytes, plan)
    names = [stage.name for stage in plan.staged.stages]
    sizes: dict[Key, int] = {}
    for column in plan.steps.columns:
        for step in column:
            factor = padding.get(program_name(step, names), Fraction(1))
            for _, key, _ in step.sends:
                sizes[key] = math.ceil(_key_bytes(plan, key) * factor)
    return lambda key: sizes[key] if key in sizes else _key_bytes(plan, key)


def device_padding(analysis: Any, accumulators: Sequence[int], passed: Sequence[int]) -> Fraction:
    """How many times their logical bytes a program's passed outputs (the values it
    hands over) take on its device, from its ``memory_analysis()``: never below 1.

    ``output_size_in_bytes`` is every output as the device lays it out (a TPU pads the
    minor dimension to 128 lanes, the second-minor to 8 or 16 sublanes: a bfloat16
    ``[B, H, S, 64]`` array can take twice its bytes), and a table of the outputs (8
    bytes each: on CPU, the logical bytes and that table exactly). Less the table and
    the accumulators (``accumulators``, their logical bytes; at least the bytes aliased
    to donated arguments, the accumulators as the device holds them), what is left is
    the passed outputs' (``passed``, their logical bytes), one factor for them all. An
    accumulator laid out larger than its logical bytes, not donated, counts here.

    >>> from types import SimpleNamespace
    >>> analysis = SimpleNamespace(output_size_in_bytes=8 * 3 + 1000 + 2 * 4096,
    ...                            alias_size_in_bytes=1000)
    >>> device_padding(analysis, accumulators=[1000], passed=[2048, 2048])
    Fraction(2, 1)
    """
    logical = sum(passed)
    table = 8 * (len(accumulators) + len(passed))
    held = (
        analysis.output_size_in_bytes - table - max(analysis.alias_size_in_bytes, sum(accumulators))
    )
    if logical == 0 or held <= logical:
        return Fraction(1)
    return Fraction(held, logical)


def _in_flight(
    plan: PipelinePlan,
    temporaries: Mapping[str, int] | None = None,
    padding: Mapping[str, Fraction] | None = None,
) -> list[tuple]:
    """Per slot, ``(most bytes in flight, (bytes in flight, temporaries) at the action
    where their sum is largest)``: the values in flight as :func:`held_in_flight`
    bounds them, and beside each program's temporaries those
    :func:`held_while_running` bounds, never less than the most in flight alone."""
    names = [stage.name for stage in plan.staged.stages]
    worst = []
    for worker, column in enumerate(plan.steps.columns):
        walk = _walk(plan, worker, padding)
        most = max(_held_at(walk, n) for n in range(len(column))) if column else 0
        peak = (most, 0)
        for step, held in zip(column, _while_running(walk)):
            temp = (temporaries or {}).get(program_name(step, names), 0)
            if held + temp > sum(peak):
                peak = (held, temp)
        worst.append((most, peak))
    return worst


@dataclasses.dataclass(frozen=True)
class _Walk:
    """One slot's column walked (:func:`_walk`): per action, the bytes of values in
    flight from other actions when it is dispatched (``live``), the values it reads or
    makes (``keys``); per value read here, its last reader here; the bytes of a value;
    how many of the slot's latest actions may be dispatched and not yet run."""

    live: list[int]
    keys: list[frozenset]
    last_read: dict
    size: Callable
    window: int

    def beyond(self, held: set, n: int) -> int:
        """The bytes of the values in ``held`` that no action after ``n`` here reads
        (the rest are in ``live[n]``)."""
        return sum(self.size(k) for k in held if self.last_read.get(k, -1) < n)


def _held_at(walk: _Walk, n: int) -> int:
    """:func:`held_in_flight` at action ``n``: while the host dispatches it, the
    values in flight and what the actions in the dispatch window read or make."""
    recent = range(max(0, n + 1 - walk.window), n + 1)
    return walk.live[n] + walk.beyond({k for m in recent for k in walk.keys[m]}, n)


def _while_running(walk: _Walk) -> list[int]:
    """Per action ``j``, the most bytes of values in flight while the device runs it
    (:func:`held_while_running`)."""
    # Per action, its results no action here reads (sent to other slots), summed.
    away = [0]
    for keys in walk.keys:
        away.append(away[-1] + sum(walk.size(k) for k in keys if k not in walk.last_read))
    running = []
    for j in range(len(walk.live)):
        # walk.beyond(keys of j..n, n), kept as n grows rather than summed again at
        # each n: unbounded, the window is the whole column (67 s at 589 actions).
        held: set = set()
        beyond = 0  # bytes of the held values that no action after n reads
        at_last_read: dict[int, int] = {}  # the others' bytes, by their last reader
        most = 0
        for n in range(j, min(len(walk.live), j + walk.window)):
            beyond += at_last_read.pop(n - 1, 0)
            for key in walk.keys[n] - held:
                held.add(key)
                last = walk.last_read.get(key, -1)
                if last < n:
                    beyond += walk.size(key)
                else:
                    at_last_read[last] = at_last_read.get(last, 0) + walk.size(key)
            sending = away[j] - away[max(0, n + 1 - walk.window)]
            most = max(most, walk.live[n] + beyond + sending)
        running.append(most)
    return running


def held_while_running(
    plan: PipelinePlan, worker: int, padding: Mapping[str, Fraction] | None = None
) -> list[int]:
    """For each action of slot ``worker``, the most bytes of values in flight the slot
    holds while the device runs it: what its temporaries meet. Below
    :func:`held_in_flight`, which bounds the slot while the host dispatches an action:
    by the time the device runs action ``j``, every earlier action of the slot has
    run, and the values they read for the last time are freed. The host may have
    dispatched up to ``plan.dispatch_ahead`` more (any number where unbounded), so
    the most over each such ``n``: the values in flight at ``n``'s dispatch, what the
    actions ``j..n`` read or make that no later action here reads, and the results
    of earlier actions in ``n``'s window still on their way to other slots.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, width=8, batch=8)
    >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=4,
    ...     schedule="gpipe", devices=jax.devices()[:2], dispatch_ahead=1)
    >>> plan = pipe.plan(*ex.args)
    >>> running, dispatching = held_while_running(plan, 0), held_in_flight(plan, 0)
    >>> # While B1..B3 run, the inputs of the backward before them are freed; while
    >>> # F0 runs, F1 may be dispatched: F0 meets its residuals.
    >>> all(r < d for r, d in zip(running[5:], dispatching[5:])) and running[0] > dispatching[0]
    True
    >>> max(running) <= max(dispatching)
    True
    """
    return _while_running(_walk(plan, worker, padding))


def held_in_flight(
    plan: PipelinePlan, worker: int, padding: Mapping[str, Fraction] | None = None
) -> list[int]:
    """For each action of slot ``worker``, in its order, the most bytes of values in
    flight the slot holds while it runs: the values other actions hand it (copied onto
    it when they are dispatched) until its last action that reads them, and what the
    ``plan.dispatch_ahead`` actions before it hold until the device has run them: their
    results, even where another slot reads them or this one read them already, and
    their inputs. With ``dispatch_ahead=None`` (no bound) the host may dispatch the
    whole column before the device runs any of it: every action before it counts.
    ``padding``: per program name, how many times their logical bytes the values it
    hands over take on the device (:func:`device_padding`); else their logical bytes.

    A bound however the workers' threads interleave: each walks its own column,
    dispatching an action as soon as the values it reads are dispatched, so while this
    slot runs its ``n``-th action another may be as far ahead as those values allow,
    its results arriving here long before this slot reads them. The walk finds the
    largest prefix of each other column whose inputs the prefixes make, this slot's
    first ``n + 1`` actions among them (it only grows with ``n``).

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, width=8, batch=8)
    >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=4,
    ...     schedule="gpipe", devices=jax.devices()[:2], dispatch_ahead=1)
    >>> # F0..F3 keep 1..4 microbatches' residuals; by the time F3 runs, slot 1 may
    >>> # have sent back all 4 cotangents: the most, then less with each backward.
    >>> held = held_in_flight(pipe.plan(*ex.args), 0)
    >>> held[:4] == sorted(held[:4]) and max(held) == held[3] > held[4] > held[7]
    True
    """
    walk = _walk(plan, worker, padding)
    return [_held_at(walk, n) for n in range(len(walk.live))]


def _walk(plan: PipelinePlan, worker: int, padding: Mapping[str, Fraction] | None) -> _Walk:
    """Slot ``worker``'s column walked with every other column dispatched as far as
    the values dispatched so far allow (:func:`_advance`): see :class:`_Walk`."""
    columns = plan.steps.columns
    last_read: dict[Key, int] = {}  # per value read here, its last reader here
    for n, step in enumerate(columns[worker]):
        for source, key in step.inputs:
            if source == STAGE:
                last_read[key] = n
    expire: dict[int, list[int]] = {}  # position -> bytes no longer held after it
    done = [0] * len(columns)  # each column's prefix dispatched
    made: set[Key] = set()
    size = _value_sizes(plan, padding)
    live, live_at = 0, []

    def dispatch(step: Any) -> None:
        nonlocal live
        for _, key, _ in step.sends:
            made.add(key)
            if key in last_read:
                held = size(key)
                live += held
                expire.setdefault(last_read[key], []).append(held)

    for n, step in enumerate(columns[worker]):
        done[worker] = n + 1
        dispatch(step)
        _advance(columns, worker, done, made, dispatch)
        live_at.append(live)
        live -= sum(expire.pop(n, ()))
    keys = [
        frozenset((*(k for _, k, _ in step.sends), *(k for src, k in step.inputs if src == STAGE)))
        for step in columns[worker]
    ]
    # The worker waits for its oldest results once it has dispatched the next
    # action: while that one is dispatched, dispatch_ahead more are held. Unbounded,
    # none of the column's earlier actions need have run.
    ahead = plan.dispatch_ahead
    window = len(columns[worker]) if ahead is None else ahead + 1
    return _Walk(live_at, keys, last_read, size, max(window, 1))


def _advance(
    columns: Any, worker: int, done: list[int], made: set[Key], dispatch: Callable
) -> None:
    """Every column but ``worker``'s dispatched as far as the values in ``made`` allow
    (``dispatch`` called on each action, which adds its results to ``made``)."""
    moved = True
    while moved:
        moved = False
        for other, column in enumerate(columns):
            if other == worker:
                continue
            while done[other] < len(column) and all(
                key in made for source, key in column[done[other]].inputs if source == STAGE
            ):
                dispatch(column[done[other]])
                done[other] += 1
                moved = True


def plan_memory(plan: PipelinePlan, arguments: Sequence[int] | None = None) -> MemoryEstimate:
    """:func:`estimate_memory` of ``plan`` (and the caller's ``arguments``, as it takes
    them) with its programs' temporaries, and the values they hand over as large as the
    device lays them out (:func:`device_padding`), the programs compiled here where they
    are not yet (JAX's caches give back those a call compiled; stages on sub-meshes are
    not compiled here: their temporaries are not counted, their values at their logical
    bytes)."""
    if plan.placement.meshes:
        return estimate_memory(plan, None, arguments)
    temporaries, padding = {}, {}
    for name, program in compiled_programs(plan).items():
        analysis = program.memory_analysis()
        temporaries[name] = analysis.temp_size_in_bytes
        accumulators, passed = program.out_info  # as the program returns them
        padding[name] = device_padding(
            analysis,
            [nbytes(x) for x in jax.tree_util.tree_leaves(accumulators)],
            [nbytes(x) for x in jax.tree_util.tree_leaves(passed)],
        )
    return estimate_memory(plan, temporaries, arguments, padding)


def estimate_memory(
    plan: PipelinePlan,
    temporaries: Mapping[str, int] | None = None,
    arguments: Sequence[int] | None = None,
    padding: Mapping[str, Fraction] | None = None,
) -> MemoryEstimate:
    """What a call of ``plan`` holds on each device slot (see the module's text).
    ``temporaries``: each program's temporary bytes by name (as
    :func:`pipemark.runtime.memory.programs.compiled_programs` names them), or ``None``;
    ``arguments``: per slot, the caller's arrays there beyond what the pipeline places
    (:func:`argument_bytes`), or ``None`` (none: each parameter lies on the slot that
    reads it, the batch on the host); ``padding``: per program name, how many times
    their logical bytes the values it hands over take on the device
    (:func:`device_padding`), or ``None`` (their logical bytes).

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> from pipemark.runtime.memory.estimate import estimate_memory
    >>> loss_fn, params, batch = examples.mlp(num_layers=2, width=64, batch=8)
    >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=4,
    ...                                   schedule="gpipe", devices=jax.devices()[:2])
    >>> first, last = estimate_memory(pipe.plan(params, batch)).slots
    >>> first.parameters == last.parameters == (64 * 64 + 64) * 4
    True
    """
    staged, steps = plan.staged, plan.steps
    avals = staged.in_avals
    num_micro = plan.schedule.num_microbatches
    worst = _in_flight(plan, temporaries, padding)
    slots = []
    for worker, slot in enumerate(plan.placement.slots):
        parameters = sum(
            device_bytes(avals[i], plan.param_sharding(i, worker)) for i in steps.params[worker]
        )
        batch = num_micro * sum(
            nbytes(avals[plan.num_param_leaves + j]) for j in steps.batch[worker]
        )
        accumulators = sum(
            _accumulator_bytes(plan, unit) for unit in plan.units.values() if unit.worker == worker
        )
        accumulators += _kept_by_plan(plan, worker)
        most, (flight, temp) = worst[worker]
        gathered = _gathered(plan, worker)  # FSDP: held with whatever is in flight
        flight, most = flight + gathered, most + gathered
        given = arguments[worker] if arguments is not None else 0
        base = parameters + batch + accumulators + given
        slots.append(
            SlotMemory(
                slot=worker,
                devices=", ".join(str(d) for d in slot.devices),
                parameters=parameters,
                batch=batch,
                accumulators=accumulators,
                in_flight=flight,
                temporaries=temp if temporaries is not None else None,
                predicted_peak=base + flight + temp,
                measured_peak=_measured(local_device(slot)),
                arguments=given,
                buffers=base + most,
            )
        )
    return MemoryEstimate(tuple(slots))


def device_bytes(aval: Any, sharding: Any) -> int:
    """The bytes of one device's shard of a value of type ``aval`` laid out by
    ``sharding`` (a ``NamedSharding``; anything else: the whole value), the largest
    where the shards are uneven.

    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    >>> device_bytes(jax.ShapeDtypeStruct((8, 6), np.float32), NamedSharding(mesh, P("data")))
    96
    """
    if not isinstance(sharding, NamedSharding):
        return nbytes(aval)
    shape = list(aval.shape)
    for dim, entry in enumerate(sharding.spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        count = math.prod(sharding.mesh.shape[n] for n in names if isinstance(n, str))
        shape[dim] = -(-shape[dim] // count)
    return math.prod(shape) * np.dtype(aval.dtype).itemsize


def _accumulator_bytes(plan: PipelinePlan, unit: Any) -> int:
    """A device's bytes of ``unit``'s accumulators: on a sub-mesh, a replica's whole
    value, or a shard of a gradient reduced per microbatch (``fsdp_gather``)."""
    out_avals = plan.staged.stages[unit.index].out_avals
    if unit.program is None:
        return sum(nbytes(out_avals[o]) for _, o in unit.accumulated)
    program = unit.program
    total = 0
    for (_, o), sharding, per_replica in zip(
        unit.accumulated, program.accumulator_shardings, program.per_replica
    ):
        aval = out_avals[o]
        if per_replica:
            aval = jax.ShapeDtypeStruct((program.replicas, *aval.shape), aval.dtype)
        total += device_bytes(aval, sharding)
    return total


def _gathered(plan: PipelinePlan, worker: int) -> int:
    """The bytes of the gathered copies of the data-sharded parameters that a device of
    slot ``worker`` holds at once (see the module's text)."""
    if plan.param_specs is None:
        return 0
    avals, mine = plan.staged.in_avals, set(plan.steps.params[worker])

    def copy(leaf: int) -> int:  # a device's gathered copy; 0 unless data-sharded
        sharding = plan.param_sharding(leaf, worker)
        spec = gathered_spec(sharding.spec, plan.data_axis)
        if spec == sharding.spec or sharding.mesh.shape.get(plan.data_axis, 1) == 1:
            return 0
        return device_bytes(avals[leaf], NamedSharding(sharding.mesh, spec))

    if plan.fsdp_gather == "once":
        return sum(copy(leaf) for leaf in mine)
    return max(
        (
            sum(copy(ref.index) for ref in plan.staged.stages[unit.index].inputs
                if ref.kind == "input" and ref.index in mine)
            for unit in plan.units.values()
            if unit.worker == worker
        ),
        default=0,
    )  # fmt: skip


def _kept_by_plan(plan: PipelinePlan, worker: int) -> int:
    """The bytes a device of slot ``worker`` holds of the arrays ``plan`` keeps there
    between calls: the microbatch scale its programs take (a float32, whole on each
    device), and the zeros that the accumulators of a program that does not donate
    them start from (a second copy of those accumulators). Counted from their types,
    the same in every process (a process makes them for its own slots alone)."""
    zeros = sum(
        _accumulator_bytes(plan, unit)
        for unit in plan.units.values()
        if unit.worker == worker and unit.zeros is not None and not unit.donates
    )
    return zeros + np.dtype(np.float32).itemsize


def local_device(slot: Any) -> Any:
    """The slot's first device that this process holds (a sub-mesh may span
    processes), else its first device: where this process sees the caller's arrays."""
    me = jax.process_index()
    mine = (d for d in slot.devices if getattr(d, "process_index", me) == me)
    return next(mine, slot.devices[0])


def with_update(
    estimate: MemoryEstimate, slot: int, update: int, buffers: int | None = None
) -> MemoryEstimate:
    """``estimate`` with a part of a training step's update holding ``update`` bytes on
    slot ``slot``, ``buffers`` of them arrays (``None``: all; the rest are its
    temporaries): that slot's predicted peak is the larger of the two phases. The parts
    a slot runs run one after the other: called again for the same slot, the larger
    part counts.

    >>> one = SlotMemory(0, "cpu:0", 0, 0, 0, 0, None, predicted_peak=100, buffers=100)
    >>> estimate = with_update(MemoryEstimate((one,)), 0, 300, buffers=250)
    >>> [(s.update, s.predicted_peak, s.buffers) for s in with_update(estimate, 0, 200).slots]
    [(300, 300, 250)]
    """
    slots = list(estimate.slots)
    one = slots[slot]
    update, buffers = max(update, one.update or 0), update if buffers is None else buffers
    slots[slot] = dataclasses.replace(
        one,
        update=update,
        predicted_peak=max(one.predicted_peak, update),
        buffers=max(one.buffers, buffers),
    )
    return MemoryEstimate(tuple(slots))


def with_host(estimate: MemoryEstimate, slot: int, host: int) -> MemoryEstimate:
    """``estimate`` with ``host`` more bytes kept in host memory for slot ``slot``.

    >>> one = SlotMemory(0, "cpu:0", 0, 0, 0, 0, None, predicted_peak=100)
    >>> with_host(MemoryEstimate((one,)), 0, 64).slots[0].host
    64
    """
    slots = list(estimate.slots)
    slots[slot] = dataclasses.replace(slots[slot], host=slots[slot].host + host)
    return MemoryEstimate(tuple(slots))


def argument_bytes(plan: PipelinePlan, params: Any, batch: Any) -> list[int]:
    """Per slot of ``plan``, the bytes of the caller's arrays (``params``, the leaves
    the plan calls parameters, and ``batch``) that lie on the slot's first device
    that this process holds (:func:`local_device`) and that :func:`estimate_memory`
    does not count already: the parameters other slots read, each batch leaf as given,
    and its microbatches where it is split here (a ``jax.Array`` is split where it
    lies) for another slot. NumPy arrays take no device memory. Under
    ``jax.distributed``, what this process sees: another process's arrays on a slot
    it holds no device of are not counted (a ``memory_budget`` judges each slot by the
    process that predicts the most there, :mod:`pipemark.runtime.memory.budget`).

    >>> import jax, numpy as np, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, width=8, batch=8)
    >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=2,
    ...                                   devices=jax.devices()[:2])
    >>> params = jax.device_put(ex.params, jax.devices()[0])
    >>> x, y = (np.asarray(leaf) for leaf in ex.batch)
    >>> argument_bytes(pipe.plan(params, (x, y)), params, (x, y))  # the 2nd layer's
    [288, 0]
    """
    steps = plan.steps
    param_leaves = jax.tree_util.tree_leaves(params)
    batch_leaves = jax.tree_util.tree_leaves(batch)
    replicas = plan.placement.slots[0].replicas
    split = plan.schedule.num_microbatches > 1 or replicas > 1  # else the leaf itself
    sizes = []
    for worker, slot in enumerate(plan.placement.slots):
        device = local_device(slot)  # where this process's arrays lie
        reads = set(steps.params[worker])
        counted = {id(x) for i, x in enumerate(param_leaves) if i in reads}
        total = resident_bytes(param_leaves, device, counted)
        counted.update(id(x) for x in param_leaves)
        total += resident_bytes(batch_leaves, device, counted)
        if split:  # each occurrence of a leaf is split apart
            reads = set(steps.batch[worker])
            total += sum(_bytes_on(x, device) for j, x in enumerate(batch_leaves) if j not in reads)
        sizes.append(total)
    return sizes


def resident_bytes(leaves: Sequence[Any], device: Any, skip: Any = frozenset()) -> int:
    """The bytes on ``device`` of the distinct ``jax.Array`` s among ``leaves`` (each
    array once, however often it appears), but those whose ``id`` is in ``skip``.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.device_put(jnp.ones(4), jax.devices()[0])
    >>> resident_bytes([x, x, jnp.ones(2)], jax.devices()[0], skip={id(x)})
    8
    """
    seen = set(skip)
    total = 0
    for leaf in leaves:
        if id(leaf) not in seen:
            seen.add(id(leaf))
            total += _bytes_on(leaf, device)
    return total


def _bytes_on(leaf: Any, device: Any) -> int:
    """The bytes of ``leaf``'s shards on ``device`` (0 for what is not a live
    ``jax.Array`` there)."""
    if not isinstance(leaf, jax.Array) or leaf.is_deleted() or device not in leaf.devices():
        return 0
    if getattr(leaf.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host"):
        return 0  # in the host's memory (offloaded state), not the device's
    if len(leaf.devices()) == 1:
        return leaf.nbytes
    return sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)


def result_avals(plan: PipelinePlan) -> list[Any]:
    """The type of each result a call of ``plan`` accumulates, in output order."""
    staged = plan.staged
    avals = []
    for ref in staged.outputs:
        if ref.kind == "stage":
            avals.append(staged.stages[ref.stage].out_avals[ref.index])
        elif ref.kind == "input":
            avals.append(staged.in_avals[ref.index])
        else:
            value = np.asarray(getattr(ref.value, "val", ref.value))
            avals.append(jax.ShapeDtypeStruct(value.shape, value.dtype))
    return avals


def describe_limit(device: Any) -> str:
    """``device``'s memory limit (``memory_stats()["bytes_limit"]``) in words, or that
    it reports none.

    >>> import jax
    >>> describe_limit(jax.devices("cpu")[0])
    'unknown (cpu reports no bytes_limit)'
    """
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without statistics may raise instead of returning None
        stats = {}
    limit = stats.get("bytes_limit")
    if limit is None:
        return f"unknown ({device.platform} reports no bytes_limit)"
    return f"{format_bytes(limit)} ({limit} bytes)"


def _measured(device: Any) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without statistics may raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")
