"""What a pipeline call holds on each device slot, predicted from its plan:
:func:`estimate_memory`, behind :meth:`pipemark.Pipeline.memory`.

Per slot, in bytes:

* ``parameters``: the parameter leaves its stages read, placed there once a call; on
  a sub-mesh, a device's shard of each (laid out by its ``param_specs``: a parameter
  sharded over the data axis, FSDP, counts ``1/D`` of its bytes);
* ``batch``: its stages' batch leaves, all microbatches, placed there once a call;
* ``accumulators``: the loss and gradients its stages accumulate over microbatches;
* ``in_flight``: the most bytes of values handed between stages (activations sent
  forward, cotangents sent back, residuals a forward keeps for its backward) that the
  slot holds at once, with the outputs of the action running then. Counted from the
  schedule: the plan's actions in schedule order, a value held on each reading slot
  from the action that makes it until its last reader there ran. This is what the
  schedule decides: GPipe holds all ``M`` microbatches' residuals on the first
  stage, 1F1B at most ``S``. Parameters sharded over the data axis add their
  gathered copy: with ``fsdp_gather="once"`` every such parameter of the slot, held
  for the whole call; with ``"per_microbatch"`` those of the slot's stage that reads
  the most, held while one program runs;
* ``temporaries``: the largest of XLA's temporaries (``memory_analysis()``) over the
  programs the slot runs, when they are compiled for it.

The predicted peak is their sum, taking the in-flight bytes and the temporaries at the
action where the two together are largest. On a TPU the device's
``peak_bytes_in_use`` counts buffers (arrays) and not the programs' temporaries
(``jax.jit`` of a step whose program needs 11.3 GiB of temporaries peaks at 2.0 GiB
there): compare it with the predicted peak less ``temporaries``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from pipemark.cost import nbytes
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.programs import compiled_programs
from pipemark.runtime.sharding import gathered_spec
from pipemark.runtime.steps import STAGE, Key, program_name

__all__ = [
    "MemoryEstimate",
    "SlotMemory",
    "device_bytes",
    "estimate_memory",
    "format_bytes",
    "plan_memory",
    "result_avals",
    "with_update",
]

_FIELDS = ("parameters", "batch", "accumulators", "in_flight", "temporaries", "update")


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


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per device slot, what a call of a pipeline holds (:class:`SlotMemory`)."""

    slots: tuple[SlotMemory, ...]

    def __str__(self) -> str:
        fields = [f for f in _FIELDS if f != "update" or any(s.update for s in self.slots)]
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


def _in_flight(plan: PipelinePlan, temporaries: Mapping[str, int] | None = None) -> list[tuple]:
    """Per slot, ``(bytes in flight, temporaries)`` at the action where their sum is
    largest: the plan's actions walked in schedule order, each value held on each
    slot that reads it from the action that makes it until its last read there. The
    results of the slot's next ``plan.dispatch_ahead`` actions count too: dispatched,
    they hold their memory before the device runs them."""
    count = len(plan.placement.slots)
    names = [stage.name for stage in plan.staged.stages]
    made_by = [[_made(plan, step) for step in column] for column in plan.steps.columns]
    ahead = plan.dispatch_ahead or 0  # None: unbounded, counted as the schedule's walk
    position = [0] * count
    live, held = [0] * count, {}
    worst: list[tuple[int, int]] = [(0, 0)] * count
    for worker, step in plan.steps.serial:
        n = position[worker]
        position[worker] += 1
        made = sum(made_by[worker][n : n + 1 + ahead])
        temp = (temporaries or {}).get(program_name(step, names), 0)
        if live[worker] + made + temp > sum(worst[worker]):
            worst[worker] = (live[worker] + made, temp)
        for _, key, readers in step.sends:
            for reader, reads in readers:
                held[(key, reader)] = reads
                live[reader] += _key_bytes(plan, key)
        for source, key in step.inputs:
            if source == STAGE and (key, worker) in held:
                held[(key, worker)] -= 1
                if held[(key, worker)] == 0:
                    del held[(key, worker)]
                    live[worker] -= _key_bytes(plan, key)
    return worst


def _made(plan: PipelinePlan, step: Any) -> int:
    """The bytes of the values an action hands to other actions."""
    return sum(_key_bytes(plan, key) for _, key, _ in step.sends)


def plan_memory(plan: PipelinePlan) -> MemoryEstimate:
    """:func:`estimate_memory` of ``plan`` with its programs' temporaries, compiled
    here where they are not yet (JAX's caches give back those a call compiled; stages
    on sub-meshes are not compiled here, and their temporaries are not counted)."""
    temporaries = None
    if not plan.placement.meshes:
        programs = compiled_programs(plan)
        temporaries = {n: p.memory_analysis().temp_size_in_bytes for n, p in programs.items()}
    return estimate_memory(plan, temporaries)


def estimate_memory(
    plan: PipelinePlan, temporaries: Mapping[str, int] | None = None
) -> MemoryEstimate:
    """What a call of ``plan`` holds on each device slot (see the module's text).
    ``temporaries``: each program's temporary bytes by name (as
    :func:`pipemark.runtime.programs.compiled_programs` names them), or ``None``.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> from pipemark.runtime.memory import estimate_memory
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
    worst = _in_flight(plan, temporaries)
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
        flight, temp = worst[worker]
        flight += _gathered(plan, worker)
        slots.append(
            SlotMemory(
                slot=worker,
                devices=", ".join(str(d) for d in slot.devices),
                parameters=parameters,
                batch=batch,
                accumulators=accumulators,
                in_flight=flight,
                temporaries=temp if temporaries is not None else None,
                predicted_peak=parameters + batch + accumulators + flight + temp,
                measured_peak=_measured(slot.devices[0]),
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


def with_update(estimate: MemoryEstimate, slot: int, update: int) -> MemoryEstimate:
    """``estimate`` with a part of a training step's update holding ``update`` bytes on
    slot ``slot``: that slot's predicted peak is the larger of the two phases. The parts
    a slot runs run one after the other: called again for the same slot, the larger
    part counts.

    >>> one = SlotMemory(0, "cpu:0", 0, 0, 0, 0, None, predicted_peak=100)
    >>> estimate = with_update(MemoryEstimate((one,)), 0, 300)
    >>> [(s.update, s.predicted_peak) for s in with_update(estimate, 0, 200).slots]
    [(300, 300)]
    """
    slots = list(estimate.slots)
    one = slots[slot]
    update = max(update, one.update or 0)
    slots[slot] = dataclasses.replace(
        one, update=update, predicted_peak=max(one.predicted_peak, update)
    )
    return MemoryEstimate(tuple(slots))


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


def _measured(device: Any) -> int | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without statistics may raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")
