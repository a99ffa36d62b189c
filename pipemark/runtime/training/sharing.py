"""A parameter that stages of several processes read: brought, at the start of a call,
to each process that reads it and does not hold it.

Under ``jax.distributed`` with ``gather_results=False`` a training step's new
parameters stay where their part of the update computed them. A parameter that stages
of two processes read (a tied embedding: the first stage looks tokens up in it, the last
multiplies by its transpose) is updated once, on one slot, where its gradient's
contributions meet; the other process then holds it as an array with no data
(:func:`~pipemark.runtime.devices.placement.held_elsewhere`), and its stage could not read it.
At the next call the process holding it sends it to every other process whose stages
read it, with the pipeline's own transport, before any stage runs::

    call 1   process 0: stage 0 reads E     process 1: stage 3 reads E
             update of E on slot 0 (process 0): E' held there alone
    call 2   process 0 sends E' to process 1 (one transfer)
             process 0: stage 0 reads E'    process 1: stage 3 reads E'

Both ends decide from what they see, with no message: a process whose array has no
data here receives it from the process whose device the array lies on; a process whose
array is a pipeline's result held alone (:mod:`pipemark.runtime.training.holdings`) sends it to
every other process that reads it. Parameters every process holds (the first call's,
results gathered, a checkpoint restored where the pipeline keeps each leaf) move
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from pipemark.runtime.devices.placement import device_slot
from pipemark.runtime.devices.transport import Transport
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.training.holdings import ALONE, holding

__all__ = ["bring_shared_params", "readers_by_process"]


def readers_by_process(plan: PipelinePlan) -> dict[int, dict[int, int]]:
    """Per parameter leaf that slots of more than one process read: each reading
    process, with its first slot that reads the leaf (a slot that spans processes
    counts for each of them)."""
    slots = plan.placement.slots
    readers: dict[int, dict[int, int]] = {}
    for worker, leaves in enumerate(plan.steps.params):
        for leaf in leaves:
            for process in slots[worker].processes:
                readers.setdefault(leaf, {}).setdefault(process, worker)
    return {leaf: by for leaf, by in sorted(readers.items()) if len(by) > 1}


def _holder(array: Any) -> Any:
    """The device a parameter with no data here lies on (its first, by id: every
    process names the same one), or ``None`` where this process holds data of it or
    it lies on several processes' devices."""
    if not isinstance(array, jax.Array) or array.addressable_shards:
        return None
    devices = sorted(array.sharding.device_set, key=lambda d: d.id)
    if len({d.process_index for d in devices}) != 1:
        return None
    return devices[0]


def _sent_from(array: Any) -> Any:
    """The device this process sends a parameter it holds alone from, or ``None``."""
    if not isinstance(array, jax.Array) or not array.is_fully_addressable:
        return None
    held = holding(array)
    if held is None or held.kind != ALONE:
        return None
    return min(array.sharding.device_set, key=lambda d: d.id)


def bring_shared_params(
    plan: PipelinePlan, leaves: Sequence[Any], transport: Transport | None
) -> list[Any]:
    """``leaves`` (a call's parameter leaves, this process's view) with each parameter
    that this process's stages read but another process holds alone received here, on
    this process's first slot that reads it; a parameter this process holds alone is
    sent to every other process that reads it. Every process calls it with the same
    plan, before the call's stages run; outside ``jax.distributed`` it returns
    ``leaves`` as they are."""
    leaves = list(leaves)
    if transport is None or not plan.placement.distributed:
        return leaves
    me, slots = plan.placement.process, plan.placement.slots
    for leaf, by_process in readers_by_process(plan).items():
        array = leaves[leaf]
        source = _holder(array) if me in by_process else None
        sending = _sent_from(array)
        if source is None and sending is None:
            continue
        types = ((tuple(array.shape), array.dtype),)
        what = f"parameter leaf {leaf}, which stages of several processes read"
        if source is not None:  # held alone by the process of `source`
            target = device_slot(slots[by_process[me]].device)
            (leaves[leaf],) = transport.move(None, types, device_slot(source), target, what)
            continue
        value = jax.device_put(array, sending)  # the whole value, on one device
        for process, worker in sorted(by_process.items()):
            if process != me:
                target = device_slot(slots[worker].device)
                transport.move([value], types, device_slot(sending), target, what)
    return leaves
