"""Where a pipeline's stages run: :class:`Placement` maps each device slot of a schedule
to a :class:`Slot` (one device, or a sub-mesh) with the shardings values take there.
It is the one module of the runtime that knows about processes: which slots this
process runs, which process receives what, where a training step's update runs.

>>> import jax
>>> from pipemark.runtime.placement import place_stages
>>> placement = place_stages(jax.devices()[:2], stage_devices=(0, 1, 0))
>>> [str(slot) for slot in placement.slots], placement.stage_slots
(['cpu:0', 'cpu:1'], (0, 1, 0))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from pipemark._compat import copy_to_device

__all__ = ["Placement", "Slot", "device_slot", "place_stages", "put_on"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """The devices one schedule device slot's stages run on.

    Attributes
    ----------
    devices:
        Its devices (one, or a sub-mesh's, in the mesh's order).
    mesh:
        The sub-mesh, or ``None`` for a single device.
    sharding:
        How a value handed between stages, or a microbatch, lies on the slot.
    process:
        The process that owns the devices (all of them: a slot lies in one process).
    """

    devices: tuple[Any, ...]
    mesh: Any
    sharding: Any
    process: int

    @property
    def device(self) -> Any:
        """The slot's first device."""
        return self.devices[0]

    def __str__(self) -> str:
        if self.mesh is None:
            return str(self.device)
        shape = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        return f"mesh({shape}) from {self.device}"


def put_on(values: Sequence[Any], slot: Slot) -> list[Any]:
    """``values`` copied onto ``slot`` (laid out by its sharding), in one transfer."""
    if slot.mesh is None:
        return copy_to_device(list(values), slot.device)
    return jax.device_put(list(values), slot.sharding)


def device_slot(device: Any) -> Slot:
    """A slot of one device."""
    return Slot((device,), None, SingleDeviceSharding(device), _process_of(device))


def _process_of(device: Any) -> int:
    return getattr(device, "process_index", jax.process_index())


@dataclasses.dataclass(frozen=True)
class Placement:
    """The slots a plan runs on and which slot runs each pipeline stage.

    Attributes
    ----------
    slots:
        The workers' slots, in the order of the first pipeline stage each runs (the
        caller's thread is worker 0: the first stage's).
    stage_slots:
        For each pipeline stage, its worker (an index into ``slots``).
    process:
        This process's index.
    """

    slots: tuple[Slot, ...]
    stage_slots: tuple[int, ...]
    process: int

    @property
    def local(self) -> tuple[bool, ...]:
        """Per worker, whether this process runs it."""
        return tuple(slot.process == self.process for slot in self.slots)

    @property
    def distributed(self) -> bool:
        """Whether some worker belongs to another process (under ``jax.distributed``)."""
        return not all(self.local)

    def stage_devices(self) -> tuple[Any, ...]:
        """The first device of each pipeline stage's slot."""
        return tuple(self.slots[w].device for w in self.stage_slots)

    def put(self, values: Sequence[Any], worker: int) -> list[Any]:
        """``values`` copied onto worker ``worker``'s slot, in one transfer."""
        return put_on(values, self.slots[worker])

    def receivers(self) -> dict[int, Any]:
        """Per process, the device that receives the results of other processes'
        stages: one of its pipeline devices where it has one, else its first device (a
        process may own no stage: more processes than stage slots)."""
        first: dict[int, Any] = {}
        for device in (*(s.device for s in self.slots), *jax.devices()):
            first.setdefault(_process_of(device), device)
        return first

    def own_device(self) -> Any:
        """The first device of this process's first pipeline stage: where a training
        step's update runs (under ``jax.distributed``, every process runs it on its own
        and so holds the whole state)."""
        return next(s.device for s in self.slots if s.process == self.process)


def place_stages(available: Sequence[Any], stage_devices: Sequence[int]) -> Placement:
    """The placement of pipeline stages whose schedule puts stage ``k`` on device slot
    ``stage_devices[k]``, slot ``d`` being ``available[d]`` (a device)."""
    order: dict[int, int] = {}  # schedule slot -> worker
    for d in stage_devices:
        order.setdefault(d, len(order))
    slots = tuple(device_slot(available[d]) for d in order)
    return Placement(slots, tuple(order[d] for d in stage_devices), jax.process_index())
