"""Running a training step's update after its pipeline
(:class:`~pipemark.runtime.train_step.PipelinedStep`): the update cut per slot
(:func:`pipemark.runtime.training.update.split_update`) or whole, each part jitted for its slot,
what each part holds, and the parts run in order, values moving between processes'
slots where a part reads another's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import NamedSharding

from pipemark._compat import DEVICE_ERRORS
from pipemark.cost import nbytes
from pipemark.errors import DeviceOutOfMemory
from pipemark.runtime.devices.placement import Slot, device_slot, held_elsewhere, put_global
from pipemark.runtime.devices.transport import Transport
from pipemark.runtime.memory.estimate import (
    describe_limit,
    format_bytes,
    local_device,
    resident_bytes,
)
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.training.offload import HOST_KINDS
from pipemark.runtime.training.update import (
    StageUpdates,
    UpdatePart,
    input_owners,
    split_update,
    stage_owners,
)

__all__ = [
    "UpdateProgram",
    "crossing_reads",
    "delete_donated",
    "donations",
    "first_update_slot",
    "offloaded_inputs",
    "run_update",
    "split_step_update",
    "update_bytes",
    "update_phase",
    "update_holders",
    "update_programs",
]


class UpdateProgram(NamedTuple):
    """One program of a training step's update (``program``, jitted as ``run``): its
    slot (worker), the positions it reads in the table of the update's values (see
    :class:`~pipemark.runtime.training.update.StageUpdates`), each laid out by ``shardings``, and
    those it computes, each laid out by ``out_shardings`` where it gives one (``None``:
    as ``jax.jit`` chooses); ``donated``: the positions among its inputs whose buffers
    ``run`` takes over (``donate_argnums``: XLA writes a result of the same shape and
    dtype there, and the input is deleted)."""

    worker: int
    program: ClosedJaxpr
    run: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    shardings: tuple[Any, ...]
    out_shardings: tuple[Any, ...] = ()
    donated: tuple[int, ...] = ()


def update_bytes(
    plan: PipelinePlan,
    parts: tuple[UpdateProgram, ...],
    num_args: int,
    leaves: Sequence[Any] | None = None,
) -> dict[int, int]:
    """Per slot of this process that runs a part of the update, what it holds while
    its largest part runs, as :func:`update_phase` counts it."""
    return {w: total for w, (total, _) in update_phase(plan, parts, num_args, leaves).items()}


def update_phase(
    plan: PipelinePlan,
    parts: tuple[UpdateProgram, ...],
    num_args: int,
    leaves: Sequence[Any] | None = None,
) -> dict[int, tuple[int, int]]:
    """Per slot of this process that runs a part of the update, ``(bytes, bytes of
    arrays)`` it holds at most while its parts run, one after the other: each part's
    compiled arguments (parameters, optimizer state, gradients), its results (but
    those XLA writes into a donated argument's buffer) and those of the slot's earlier
    parts, and its temporaries (not arrays); the pipeline's results on the slot that
    the part does not read (they live until the step returns); with the step's
    argument leaves ``leaves`` (``num_args`` of them, the batch's last), those lying on
    the slot that the part does not read. What a slot's earlier part donated is gone,
    but an array at several places of ``leaves``: :func:`run_update` donates copies of
    it, and the array itself lives until the update ends (counted once, with them)."""
    results = _results_left(plan)
    uses = Counter(id(x) for x in leaves or ())
    sizes: dict[int, tuple[int, int]] = {}
    made: dict[int, int] = {}  # per slot, the results of its parts so far
    gone: dict[int, set[int]] = {}  # per slot, the positions its parts so far donated
    for part in parts:
        if not plan.placement.local[part.worker]:
            continue
        structs = [
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=where)
            for aval, where in zip(part.program.in_avals, part.shardings)
        ]
        with jax.set_mesh(None):  # as the call runs it (see __call__)
            analysis = part.run.lower(*structs).compile().memory_analysis()
        before = made.get(part.worker, 0)
        # What a part writes to host memory (offloaded state) leaves the device with it.
        made[part.worker] = before + analysis.output_size_in_bytes - _host_outputs(part)
        donated = gone.setdefault(part.worker, set())
        donated.update(part.donated)
        read = set(part.inputs) | donated
        left = sum(size for r, size in results.get(part.worker, ()) if num_args + r not in read)
        if leaves is not None:
            device = local_device(plan.placement.slots[part.worker])
            kept = {i for i in donated if i < len(leaves) and uses[id(leaves[i])] > 1}
            skip = {id(x) for i, x in enumerate(leaves) if i in read and i not in kept}
            left += resident_bytes(leaves, device, skip)
        # A result written into a donated argument's buffer takes no bytes of its own.
        # Offloaded state (read from and written to host memory) counts as the device
        # copies the part makes of it: the CPU's analysis counts it among the arguments
        # and results (its host_*_size_in_bytes are 0), an upper bound.
        outputs = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
        arrays = analysis.argument_size_in_bytes + before + outputs + left
        total = arrays + analysis.temp_size_in_bytes
        most = sizes.get(part.worker, (0, 0))
        sizes[part.worker] = (max(most[0], total), max(most[1], arrays))
    return sizes


def _host_outputs(part: UpdateProgram) -> int:
    """The bytes of ``part``'s results that it writes to a host memory kind."""
    where = part.out_shardings or (None,) * len(part.outputs)
    return sum(
        nbytes(aval)
        for aval, sharding in zip(part.program.out_avals, where)
        if getattr(sharding, "memory_kind", None) in HOST_KINDS
    )


def _results_left(plan: PipelinePlan) -> dict[int, list[tuple[int, int]]]:
    """Per slot, ``(result, bytes)`` of the results its stages accumulate."""
    left: dict[int, list[tuple[int, int]]] = {}
    for unit in plan.units.values():
        out_avals = plan.staged.stages[unit.index].out_avals
        for r, o in unit.accumulated:
            left.setdefault(unit.worker, []).append((r, nbytes(out_avals[o])))
    return left


def split_step_update(
    plan: PipelinePlan, apply: ClosedJaxpr, num_args: int, per_stage: bool = False
) -> StageUpdates | None:
    """The update of ``plan``'s step split per slot (:func:`split_update`, with the
    rounds that exchange small coupled values such as the partial sums of a global
    norm), or ``None`` where it does not split (a big value couples two slots, or the
    update has effects) or runs whole anyway.

    Under ``jax.distributed`` with ``gather_results=False`` every process cuts the same
    parts (a result no slot owns goes to slot 0, whichever process this is) and runs
    its own slots' (:func:`run_update`). With results gathered (the default) every
    process holds every gradient: it runs the whole update on its own first slot, so
    that every process gets the whole new state, as before.

    ``per_stage``: cut per pipeline stage (:func:`stage_owners`), each part run on its
    stage's slot, where that splits (else per slot): with the state offloaded, a slot
    of several stages then holds one stage's state on its device at a time."""
    if plan.placement.distributed and plan.gather_results:
        return None
    first = first_update_slot(plan)
    if per_stage:
        owners, workers = stage_owners(plan, num_args)
        stages = [s for s, w in sorted(workers.items()) if w == first]
        split = split_update(apply, owners, stages[0]) if stages else None
        if split is not None:
            parts = tuple(p._replace(worker=workers[p.worker]) for p in split.parts)
            return split._replace(parts=parts)
    return split_update(apply, input_owners(plan, num_args), first)


def first_update_slot(plan: PipelinePlan) -> int:
    """Where a result no slot owns is computed, and where the update runs whole: this
    process's first slot, or, when processes keep their own results, slot 0 (every
    process must cut the same parts)."""
    return 0 if plan.placement.distributed and not plan.gather_results else plan.update_worker


def update_programs(
    plan: PipelinePlan,
    apply: ClosedJaxpr,
    split: StageUpdates | None,
    layouts: Mapping[int, Any] | None = None,
    donatable: Collection[int] = (),
    host: Mapping[int, int] | None = None,
    host_kind: str = "pinned_host",
) -> tuple[UpdateProgram, ...]:
    """The parts of ``split`` (where it is ``None``, one part: the whole update
    ``apply`` on the first slot), each jitted and reading its inputs on its slot (a
    sub-mesh's parameters with their layout there: :meth:`PipelinePlan.update_sharding`).
    On sub-meshes, ``layouts`` gives the ``PartitionSpec`` of positions of the update's
    value table (:func:`pipemark.runtime.training.layouts.step_layouts`): the inputs there are
    read, and the results written, in that layout (gradients and optimizer state
    sharded like their parameters). On a sub-mesh that spans processes a result with
    no layout is replicated over the sub-mesh, so that each of its processes holds it
    whole (a result sent to every process is taken from there, :func:`run_update`).
    The positions of the table in ``donatable`` are donated where :func:`donations`
    finds a result to take their buffers. ``host`` maps a result's position to the
    input it replaces (offloaded state, :mod:`pipemark.runtime.training.offload`): that
    result is written to ``host_kind`` memory, laid out as the input is read."""
    if split is None:
        count = len(apply.jaxpr.invars)
        results = tuple(range(count, count + len(apply.jaxpr.outvars)))
        parts: Sequence[UpdatePart] = (
            UpdatePart(first_update_slot(plan), apply, tuple(range(count)), results),
        )
    else:
        parts = split.parts
    layouts = layouts if plan.placement.meshes else None

    def laid_out(position: int, worker: int) -> Any:
        if layouts is None or position not in layouts:
            return None
        return NamedSharding(plan.placement.slots[worker].mesh, layouts[position])

    host = host or {}
    # A donated device buffer cannot take a result written to host memory (XLA aborts
    # the process on CPU): such results and the inputs they replace are not matched.
    donatable = set(donatable) - set(host.values())
    programs = []
    for p, donated in zip(parts, donations(parts, donatable, host)):
        on_device = [laid_out(i, p.worker) or plan.update_sharding(i, p.worker) for i in p.inputs]
        brought = {n for n, i in enumerate(p.inputs) if i in host.values()}
        shardings = tuple(
            s.with_memory_kind(host_kind) if n in brought else s for n, s in enumerate(on_device)
        )
        slot = plan.placement.slots[p.worker]
        whole = slot.replicated if len(slot.processes) > 1 else None
        outs = [
            (
                laid_out(host[k], p.worker) or plan.update_sharding(host[k], p.worker)
            ).with_memory_kind(host_kind)
            if k in host
            else laid_out(k, p.worker) or whole
            for k in p.outputs
        ]
        if any(k in host for k in p.outputs):
            # JAX matches a donated argument with a result of the same memory kind only
            # where every result names one (else it may alias a device buffer with a
            # host result, which aborts the process on CPU): the rest name "device".
            outs = [o or slot.replicated for o in outs]
            outs = [
                o if o.memory_kind in HOST_KINDS else o.with_memory_kind("device") for o in outs
            ]
        run = jax.jit(
            _brought_in(p.program, {n: on_device[n] for n in brought}),
            out_shardings=outs if any(outs) else None,
            donate_argnums=tuple(n for n, i in enumerate(p.inputs) if i in donated),
        )
        programs.append(
            UpdateProgram(
                p.worker, p.program, run, p.inputs, p.outputs, shardings, tuple(outs), donated
            )
        )
    return tuple(programs)


def _brought_in(program: ClosedJaxpr, brought: Mapping[int, Any]) -> Callable:
    """``program`` as a function whose arguments at the positions of ``brought`` (state
    in host memory) it first copies to device memory, laid out by ``brought``'s
    shardings: the copy is part of the program (as a result written to host memory
    is), where JAX 0.12.1 on CPU cannot ``device_put`` a program's host result back."""
    run = jaxpr_as_fun(program)
    if not brought:
        return run

    def bring_in(*args: Any) -> Any:
        return run(
            *(
                jax.device_put(a, brought[n].with_memory_kind("device")) if n in brought else a
                for n, a in enumerate(args)
            )
        )

    return bring_in


def offloaded_inputs(parts: Sequence[UpdateProgram]) -> list[int]:
    """The positions of the update's table that its parts read from host memory (the
    state offloaded there: :mod:`pipemark.runtime.training.offload`), in order."""
    return sorted(
        {
            i
            for p in parts
            for i, sharding in zip(p.inputs, p.shardings)
            if getattr(sharding, "memory_kind", None) in HOST_KINDS
        }
    )


def donations(
    parts: Sequence[UpdatePart], donatable: Collection[int], kept: Collection[int] = ()
) -> list[tuple[int, ...]]:
    """Per part, the positions of ``donatable`` it donates: each in the last part that
    reads it (no part reads it after its buffer is gone), where a result of that part
    of the same shape and dtype is left to take its buffer (an argument no result
    takes is not freed by the donation, and JAX warns that it was not usable). The
    inputs come first in the order a part reads them: the step's state before the
    gradients. A result at a position in ``kept`` (written to host memory) takes none.

    >>> import jax, jax.numpy as jnp
    >>> from pipemark.runtime.training.update import UpdatePart
    >>> sgd = jax.make_jaxpr(lambda w, g: w - 0.1 * g)(jnp.ones(3), jnp.ones(3))
    >>> parts = [UpdatePart(0, sgd, (0, 2), (4,)), UpdatePart(1, sgd, (0, 3), (5,))]
    >>> donations(parts, {0, 2, 3})  # 0 read again by part 1: donated there
    [(2,), (0,)]
    """
    last = {i: n for n, part in enumerate(parts) for i in part.inputs}
    chosen = []
    for n, part in enumerate(parts):
        free = Counter(
            (a.shape, a.dtype)
            for k, a in zip(part.outputs, part.program.out_avals)
            if k not in kept
        )
        reads = Counter(part.inputs)
        mine = []
        for i, aval in zip(part.inputs, part.program.in_avals):
            kind = (aval.shape, aval.dtype)
            if i in donatable and last[i] == n and reads[i] == 1 and free[kind] > 0:
                free[kind] -= 1
                mine.append(i)
        chosen.append(tuple(mine))
    return chosen


def crossing_reads(
    parts: Sequence[UpdateProgram], holders: Sequence[int | None]
) -> list[tuple[int, int, int]]:
    """``(slot, position, source)`` for each input of a part on ``slot`` that another
    slot, ``source``, holds alone (``holders`` as :func:`update_holders` gives them, then
    each part's results held by its slot), in the order the parts run: the values
    :func:`run_update` moves between slots (a global norm's partial sums).

    >>> import jax, jax.numpy as jnp
    >>> from pipemark.runtime.training.update import split_update
    >>> def clipped(w0, w1, g0, g1):
    ...     scale = jnp.minimum(1.0, 0.1 / jnp.sqrt(jnp.sum(g0**2) + jnp.sum(g1**2)))
    ...     return w0 - scale * g0, w1 - scale * g1
    >>> split = split_update(jax.make_jaxpr(clipped)(*[jnp.ones(2)] * 4), [0, 1, 0, 1], 0)
    >>> crossing_reads(split.parts, [None, None, 0, 1])
    [(0, 7, 1), (1, 6, 0)]
    """
    held = dict(enumerate(holders))
    crossing = []
    for part in parts:
        for i in part.inputs:
            source = held.get(i)
            if source is not None and source != part.worker:
                crossing.append((part.worker, i, source))
        held.update((k, part.worker) for k in part.outputs)
    return crossing


def update_holders(plan: PipelinePlan, num_args: int) -> tuple[int | None, ...]:
    """Per input of the update (the step's argument leaves, ``num_args`` of them, then
    the pipeline's accumulated results): the slot whose process alone holds it, or
    ``None`` where every process does (the arguments, which every process passes; every
    result when results are gathered, and in one process)."""
    return (None,) * num_args + plan.result_holders()


def run_update(
    plan: PipelinePlan,
    parts: Sequence[UpdateProgram],
    holders: Sequence[int | None],
    shared: Sequence[int],
    values: dict[int, Any],
    transport: Transport | None,
    donating: bool = False,
) -> dict[int, int | None]:
    """Run the update's parts in order, filling the table ``values`` (its inputs first,
    see :class:`~pipemark.runtime.training.update.StageUpdates`) with what they compute; ``holders``
    says which slot's process alone holds each input (``None``: every one), as
    :func:`update_holders` gives them. Returns the same for every position of the table after the update.

    A part of this process's slot reads its inputs there (``device_put``). Under
    ``jax.distributed`` a part of another process's slot runs there: its results are
    arrays of the global program this process does not hold (as
    :func:`pipemark.runtime.execution.run_plan` returns another process's stages'
    results). A value a part reads from a slot of another process (an exchanged partial
    sum) moves with ``transport``: every process walks the same parts in the same
    order, so both ends of each move meet. The results no slot owns (``shared``) then
    go to every process (``shared``: the positions that do).

    A part donates the positions it names (:class:`UpdateProgram`), a copy of an array
    at several positions of the table (the same array twice in the state), so that no
    buffer still to be read is donated; ``donating``: the caller's state is among them.
    """
    slots, local = plan.placement.slots, plan.placement.local
    # By identity: a step commits each argument once (train_step's _committed), and
    # the pipeline's results and the parts' are arrays of their own.
    uses = Counter(id(v) for v in values.values())
    twice = {k for k, n in uses.items() if n > 1}
    held = dict(enumerate(holders))
    avals: dict[int, Any] = {}
    moved: dict[tuple[int, int], Any] = {}  # (position, slot): a value moved there
    for part in parts:
        reader = slots[part.worker]
        inputs = []
        for i, aval in zip(part.inputs, part.program.in_avals):
            source = held.get(i)
            if source is None or slots[source].process == reader.process:
                inputs.append(values.get(i))
                continue
            if (i, part.worker) not in moved:
                ends = device_slot(slots[source].device), device_slot(reader.device)
                got = _move(plan, [i], values, source, ends, [aval], transport)
                moved[(i, part.worker)] = got[0] if got else None
            inputs.append(moved[(i, part.worker)])
        if local[part.worker]:
            outputs = _run_part(plan, part, inputs, twice, donating)
        else:  # another process computes them: arrays without data here
            where = part.out_shardings or [None] * len(part.outputs)
            outputs = [
                held_elsewhere(a, w or reader.replicated)
                for a, w in zip(part.program.out_avals, where)
            ]
        values.update(zip(part.outputs, outputs))
        held.update((k, part.worker) for k in part.outputs)
        avals.update(zip(part.outputs, part.program.out_avals))
    by_source: dict[int, list[int]] = {}
    for k in shared:  # grouped by the slot that computed them, in slot order
        by_source.setdefault(held[k], []).append(k)
    receivers = plan.placement.receivers()
    for source, positions in sorted(by_source.items()):
        types = [avals[k] for k in positions]
        if local[source] and len(slots[source].processes) > 1:
            # Each process of a sub-mesh that spans processes holds them whole (the
            # part's results are replicated there): its own copy, on its receiver.
            mine = receivers[plan.placement.process]
            values.update(
                (k, jax.device_put(values[k].addressable_data(0), mine)) for k in positions
            )
        for process, device in receivers.items():
            if process not in slots[source].processes:
                ends = device_slot(slots[source].device), device_slot(device)
                got = _move(plan, positions, values, source, ends, types, transport)
                values.update(zip(positions, got or ()))
        held.update(dict.fromkeys(positions))  # every process now holds them
    return held


def delete_donated(
    parts: Sequence[UpdateProgram],
    local: Sequence[bool],
    values: Mapping[int, Any],
    count: int,
) -> None:
    """After the update, delete the arrays at the first ``count`` positions of the
    table ``values`` (the caller's state) that a part of this process donated and that
    are still there: where the part read a copy (the state of a step's first call, as
    a rule made on one device, copied to the slot whose part updates it). So, as with
    ``jax.jit``'s ``donate_argnums``, no donated array outlives the call. An array
    also at a position not donated (a batch leaf) is kept. The positions the parts
    read from host memory (:func:`offloaded_inputs`: state whose new value the update
    writes there, no buffer to donate) that a part of this process read are deleted
    too.

    >>> import jax, jax.numpy as jnp
    >>> sgd = jax.make_jaxpr(lambda w, g: w - 0.1 * g)(jnp.ones(3), jnp.ones(3))
    >>> part = UpdateProgram(0, sgd, None, (0, 1), (2,), (), (), (0,))
    >>> values = {0: jnp.ones(3), 1: jnp.ones(3)}
    >>> delete_donated([part], [True], values, 1)
    >>> values[0].is_deleted(), values[1].is_deleted()
    (True, False)
    """
    donated = {i for p in parts if local[p.worker] for i in p.donated if i < count}
    offloaded = set(offloaded_inputs(parts))
    donated |= {i for p in parts if local[p.worker] for i in p.inputs if i in offloaded}
    kept = {id(v) for i, v in values.items() if i not in donated}
    for i in sorted(donated):
        array = values[i]
        if not isinstance(array, jax.Array) or id(array) in kept:
            continue
        # Deleting waits for nothing: the device frees the buffer once the programs
        # and copies already dispatched to read it are done.
        if array.is_fully_addressable and not array.is_deleted():
            array.delete()


def _run_part(
    plan: PipelinePlan, part: UpdateProgram, inputs: list[Any], twice: Any, donating: bool
) -> Any:
    """``part`` run on its slot, an input it donates copied first where its array is
    also at another position (``id`` in ``twice``: rare, and the copy is its own,
    whether or not ``put_global`` moved it); running out of the device's memory
    raises a :class:`~pipemark.DeviceOutOfMemoryError` naming the part and what it takes."""
    try:
        # A sub-mesh that spans processes takes this process's shards (put_global).
        args = put_global(inputs, part.shardings)
        for n, i in enumerate(part.inputs):
            if i in part.donated and id(inputs[n]) in twice:
                args[n] = jax.device_put(args[n], part.shardings[n], may_alias=False)
        return part.run(*args)
    except DEVICE_ERRORS as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        slot = plan.placement.slots[part.worker]
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)
            for a, where in zip(part.program.in_avals, part.shardings)
        ]
        analysis = part.run.lower(*structs).compile().memory_analysis()
        takes = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
        )
        first = str(error).strip().splitlines()[0]
        raise DeviceOutOfMemory(
            f"Slot {part.worker} ({', '.join(map(str, slot.devices))}) ran out of memory "
            f"running the training step's update after the pipeline (its part on this "
            f"slot): {first} Its arguments (parameters, optimizer state, gradients), "
            f"results and temporaries take {format_bytes(takes)} ({takes} bytes); the "
            f"device's limit is {describe_limit(slot.devices[0])}. Give the pipeline "
            "more stages or devices (each updates its own parameters), a smaller model "
            "or optimizer state, or memory_budget= to be told before it runs. "
            + (
                "With donate=True the parameters and optimizer state that the update's "
                "parts donated before it failed (and possibly this part's) are deleted."
                if donating
                else "The arrays passed in are unchanged."
            )
        ) from error


def _move(
    plan: PipelinePlan,
    positions: Sequence[int],
    values: Mapping[int, Any],
    source: int,
    ends: tuple[Slot, Slot],
    avals: Sequence[Any],
    transport: Transport | None,
) -> list[Any] | None:
    """The values at ``positions`` of the update's table, computed on slot ``source``,
    moved between the devices ``ends`` (the source slot's first device, so that a
    sub-mesh's value goes whole) by ``transport``: on the receiving end's process, the
    values there; ``None`` elsewhere."""
    # Only under jax.distributed does a part read a value of another process's slot.
    if transport is None:
        raise RuntimeError(
            f"the update moves values {list(positions)} between slots of two processes "
            "without a transport between them (only a plan under jax.distributed has one)"
        )
    sent = None
    if ends[0].process == plan.placement.process:  # of a sub-mesh, its first device's
        sent = jax.device_put([values[i] for i in positions], ends[0].device)
    types = tuple((a.shape, a.dtype) for a in avals)
    what = f"values {list(positions)} of the update"
    return transport.move(sent, types, *ends, what)
