"""Where a pipeline's stages run: :class:`Placement` maps each device slot of a schedule
to a :class:`Slot` (one device, or a sub-mesh) with the shardings values take there.
It is the one module of the runtime that knows about processes: which slots this
process runs, which process receives what, where a training step's update runs.

>>> import jax
>>> from pipemark.runtime.devices.placement import place_stages
>>> placement = place_stages(jax.devices()[:2], stage_devices=(0, 1, 0))
>>> [str(slot) for slot in placement.slots], placement.stage_slots
(['cpu:0', 'cpu:1'], (0, 1, 0))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, make_single_device_sharding
from jax.sharding import PartitionSpec as P

from pipemark._compat import copy_to_device
from pipemark.errors import PipemarkError
from pipemark.runtime.devices.sharding import stage_meshes

__all__ = [
    "Placement",
    "Slot",
    "available_slots",
    "bring_in",
    "device_slot",
    "held_elsewhere",
    "in_host_memory",
    "leaf_specs",
    "mesh_leaf_specs",
    "mesh_slot",
    "place_stages",
    "put_global",
    "put_on",
]


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
        How a value handed between stages, or a microbatch, lies on the slot (on a
        sub-mesh with a data axis: its leading replica axis along that axis).
    process:
        The process that owns the slot's first device (on a sub-mesh that spans
        processes, :attr:`processes` names every one).
    replicated:
        How a value whole on every device of the slot lies there.
    replicas:
        How many data-parallel replicas of each microbatch the slot runs.
    """

    devices: tuple[Any, ...]
    mesh: Any
    sharding: Any
    process: int
    #: A value whole on every device of the slot (a scalar, a replicated parameter).
    replicated: Any = None
    #: Data-parallel replicas of each microbatch (the size of the mesh's data axis).
    replicas: int = 1

    @property
    def device(self) -> Any:
        """The slot's first device."""
        return self.devices[0]

    @property
    def processes(self) -> frozenset[int]:
        """The processes that own the slot's devices: one, or several for a sub-mesh
        that spans processes (each of them runs the slot's programs, on its devices)."""
        return frozenset(_process_of(d) for d in self.devices)

    def __str__(self) -> str:
        if self.mesh is None:
            return str(self.device)
        shape = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        return f"mesh({shape}) from {self.device}"


def put_on(values: Sequence[Any], slot: Slot) -> list[Any]:
    """``values`` copied onto ``slot`` (laid out by its sharding), in one transfer;
    those in its device's host memory (offloaded parameters) by a program
    (:func:`bring_in`)."""
    values = list(values)
    if slot.mesh is None:
        host = [i for i, v in enumerate(values) if in_host_memory(v, slot.device)]
        if host:
            brought = bring_in(slot.sharding)(*[values[i] for i in host])
            rest = [i for i in range(len(values)) if i not in set(host)]
            moved = copy_to_device([values[i] for i in rest], slot.device) if rest else []
            done = dict(zip(host, brought)) | dict(zip(rest, moved))
            return [done[i] for i in range(len(values))]
        return copy_to_device(values, slot.device)
    return put_global(values, [slot.sharding] * len(values))


def in_host_memory(value: Any, device: Any) -> bool:
    """Whether ``value`` is an array in ``device``'s host memory (``pinned_host`` or
    ``unpinned_host``)."""
    if not isinstance(value, jax.Array) or value.is_deleted():
        return False
    kind = getattr(value.sharding, "memory_kind", None)
    return kind in ("pinned_host", "unpinned_host") and value.devices() == {device}


@functools.lru_cache(maxsize=64)
def bring_in(sharding: Any) -> Any:
    """A jitted program copying its arguments, arrays in host memory, to device memory
    laid out by ``sharding``: where JAX 0.12.1 on CPU cannot ``jax.device_put`` a
    program's host result back to the device, a program can read it (docs/memory.md,
    "Host memory kinds")."""
    device = sharding.with_memory_kind("device")
    return jax.jit(lambda *xs: [jax.device_put(x, device) for x in xs])


def put_global(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """``values`` laid out by ``shardings``. A sharding over devices of several
    processes (a sub-mesh that spans processes) takes from each value, which every
    such process holds whole (the pipeline's arguments), the shards of this process's
    devices: ``jax.device_put`` refuses an array committed to one device there. A value
    that is an array of the global program already (parameters kept sharded over those
    processes, FSDP) is used as it is where it lies so, else resharded by
    ``jax.device_put``, a collective of the processes owning it.

    >>> import jax, numpy as np
    >>> sharding = jax.sharding.make_single_device_sharding(jax.devices()[1])
    >>> [v.sharding == sharding for v in put_global([np.ones(2)], [sharding])]
    [True]
    """
    values = list(values)
    if all(s.is_fully_addressable for s in shardings):
        return jax.device_put(values, list(shardings)) if values else []
    return [_put_one(v, s) for v, s in zip(values, shardings)]


def _put_one(value: Any, sharding: Any) -> Any:
    """``value`` laid out by ``sharding``, a sharding over devices of several processes
    (:func:`put_global`)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return value if value.sharding == sharding else jax.device_put(value, sharding)
    return jax.make_array_from_callback(np.shape(value), sharding, lambda index: value[index])


def _not_on(values: list[Any], sharding: Any) -> list[int]:
    """The positions of ``values`` that are not arrays laid out by ``sharding`` (checked
    on every call, for every parameter: a comparison costs about 1 µs, a copy of an
    array onto its own device about 4 µs)."""
    moving = []
    for i, value in enumerate(values):
        if not (
            isinstance(value, jax.Array) and not value.is_deleted() and value.sharding == sharding
        ):
            moving.append(i)
    return moving


def held_elsewhere(aval: Any, sharding: Any) -> jax.Array:
    """A value of type ``aval`` laid out by ``sharding`` on another process's devices,
    as this process sees it: an array of the global program with no data here (what
    ``jax.jit`` returns for such a result)."""
    return jax.make_array_from_single_device_arrays(
        tuple(aval.shape), sharding, [], dtype=aval.dtype
    )


def device_slot(device: Any) -> Slot:
    """A slot of one device."""
    sharding = make_single_device_sharding(device)
    return Slot((device,), None, sharding, _process_of(device), sharding)


def mesh_slot(mesh: Mesh, data_axis: str) -> Slot:
    """A slot of a sub-mesh (its devices of one process or of several), with
    ``mesh.shape[data_axis]`` replicas (1 without that axis)."""
    replicas = int(mesh.shape.get(data_axis, 1))
    sharding = NamedSharding(mesh, P(data_axis) if replicas > 1 else P())
    devices = tuple(mesh.devices.flat)
    return Slot(
        devices, mesh, sharding, _process_of(devices[0]), NamedSharding(mesh, P()), replicas
    )


def available_slots(options: Any) -> list[Slot]:
    """The device slots a pipeline with these options may use: ``options.devices`` (or
    every device), a slot each; or, with ``options.mesh``, one sub-mesh each."""
    if options.mesh is None:
        devices = list(jax.devices() if options.devices is None else options.devices)
        if len({id(d) for d in devices}) != len(devices):
            raise PipemarkError("devices lists a device twice; give each pipeline device once.")
        return [device_slot(d) for d in devices]
    mesh = options.mesh
    if isinstance(mesh, Mesh):
        if options.stage_axis not in mesh.shape:
            raise PipemarkError(
                f"The mesh's axes are {tuple(mesh.axis_names)}, without the stage axis "
                f"{options.stage_axis!r}: name one axis {options.stage_axis!r} (or pass "
                "stage_axis=), each position along it one pipeline slot, or give a list of "
                "sub-meshes."
            )
        count = int(mesh.shape[options.stage_axis])
    else:
        count = len(mesh) if isinstance(mesh, Sequence) else 0
    meshes = stage_meshes(mesh, count, options.stage_axis)
    return [mesh_slot(m, options.data_axis) for m in meshes]


def leaf_specs(param_specs: Any, params: Any, stage_axis: str) -> list[Any]:
    """A ``PartitionSpec`` per array leaf of ``params``: from ``param_specs`` (a pytree
    prefix of ``params``; ``None`` replicated), or, without it, each leaf's own
    ``NamedSharding``'s spec (the stage axis left out), else replicated."""
    leaves = jax.tree_util.tree_leaves(params)
    if param_specs is None:
        return [_own_spec(leaf, stage_axis) for leaf in leaves]
    try:
        expanded = jax.tree_util.tree_map(
            lambda spec, sub: _Group([spec] * len(jax.tree_util.tree_leaves(sub))),
            param_specs,
            params,
            is_leaf=lambda x: x is None or isinstance(x, P),
        )
    except (ValueError, TypeError) as error:
        raise PipemarkError(
            "param_specs must be a pytree prefix of the parameters, with a "
            f"jax.sharding.PartitionSpec (or None: replicated) at each leaf: {error}"
        ) from None
    specs = [
        P() if spec is None else spec
        for group in jax.tree_util.tree_leaves(expanded, is_leaf=lambda x: isinstance(x, _Group))
        for spec in group.specs
    ]
    for spec in specs:
        if not isinstance(spec, P):
            raise PipemarkError(
                f"param_specs holds {spec!r}; give a jax.sharding.PartitionSpec (or None: "
                "replicated) for each parameter."
            )
    return specs


def mesh_leaf_specs(options: Any, params: Any, what: str = "params") -> list[Any]:
    """:func:`leaf_specs` of ``params`` for ``options.mesh``, each checked against the
    stages' sub-mesh: every axis it names exists there, once, and divides the
    dimension it shards (a parameter sharded over the data axis, FSDP, included).
    Raises a :class:`PipemarkError` naming the parameter (``what`` and its path) and
    saying what to do.

    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh
    >>> from pipemark.runtime.options import PipelineOptions
    >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "data"))
    >>> options = PipelineOptions(num_microbatches=2, mesh=mesh, param_specs={"w": P("data")})
    >>> mesh_leaf_specs(options, {"w": np.ones((3, 4))})
    Traceback (most recent call last):
    ...
    pipemark.errors.PipemarkError: Parameter params['w'] of shape (3, 4) has param_specs P('data',): ...
    """
    specs = leaf_specs(options.param_specs, params, options.stage_axis)
    mesh = options.mesh
    first = mesh if isinstance(mesh, Mesh) else next(iter(mesh), None)
    if not isinstance(first, Mesh):
        return specs  # available_slots says what is wrong with the mesh
    sizes = {n: int(k) for n, k in first.shape.items() if n != options.stage_axis}
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    leaves = jax.tree_util.tree_leaves(params)
    for path, leaf, spec in zip(paths, leaves, specs):
        problem = _spec_problem(tuple(getattr(leaf, "shape", ())), spec, sizes)
        if problem:
            raise PipemarkError(
                f"Parameter {what}{path} of shape {tuple(getattr(leaf, 'shape', ()))} has "
                f"param_specs {spec}: {problem}"
            )
    return specs


def _spec_problem(shape: tuple[int, ...], spec: Any, sizes: Mapping[str, int]) -> str | None:
    """What is wrong with laying out an array of ``shape`` by ``spec`` on a sub-mesh of
    axis ``sizes``, with what to do; ``None`` where nothing is."""
    if len(spec) > len(shape):
        return (
            f"{len(spec)} entries for {len(shape)} dimensions. Give at most one entry "
            "per dimension."
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None]
        for name in names:
            if name not in sizes:
                return (
                    f"it names axis {name!r}, which the stages' sub-mesh {dict(sizes)} "
                    "lacks. Name only the sub-mesh's axes."
                )
            if name in seen:
                return f"it names axis {name!r} twice. Shard each dimension over other axes."
            seen.add(name)
        count = math.prod(sizes[n] for n in names)
        if shape[dim] % count:
            return (
                f"dimension {dim} ({shape[dim]}) does not split into the {count} shards "
                f"of {tuple(names)}. Shard a dimension divisible by {count} instead (or "
                "pad this one), or leave the parameter replicated (None)."
            )
    return None


class _Group:
    """The specs of the leaves under one entry of a prefix tree (a pytree leaf)."""

    def __init__(self, specs: list[Any]) -> None:
        self.specs = specs


def _own_spec(leaf: Any, stage_axis: str) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return P()
    entries = []
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n != stage_axis)
        entries.append(kept[0] if len(kept) == 1 else (kept or None))
    return P(*entries)


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

    @cached_property
    def local(self) -> tuple[bool, ...]:
        """Per worker, whether this process runs it (owns devices of its slot: a slot
        that spans processes runs in each of them)."""
        return tuple(self.process in slot.processes for slot in self.slots)

    @cached_property
    def distributed(self) -> bool:
        """Whether some worker's devices belong to another process (under
        ``jax.distributed``)."""
        return any(slot.processes != {self.process} for slot in self.slots)

    @cached_property
    def spanning(self) -> bool:
        """Whether some slot's sub-mesh spans processes."""
        return any(len(slot.processes) > 1 for slot in self.slots)

    def crossing(self, producer: int, reader: int) -> bool:
        """Whether a value from worker ``producer`` to worker ``reader`` moves between
        processes (as a collective of every process owning devices of either slot),
        rather than within this process (or stays on its slot)."""
        if producer == reader or not self.distributed:
            return False
        processes = self._processes  # made once: a worker asks for each value it sends
        return len(processes[producer] | processes[reader]) > 1

    @cached_property
    def _processes(self) -> tuple[frozenset[int], ...]:
        return tuple(slot.processes for slot in self.slots)

    def stage_devices(self) -> tuple[Any, ...]:
        """The first device of each pipeline stage's slot."""
        return tuple(self.slots[w].device for w in self.stage_slots)

    def put(self, values: Sequence[Any], worker: int) -> list[Any]:
        """``values`` copied onto worker ``worker``'s slot, in one transfer; arrays
        already laid out there (the parameters, on the first stage's device, as a rule)
        are used as they are."""
        slot = self.slots[worker]
        values = list(values)
        moving = _not_on(values, slot.sharding)
        if not moving:
            return values
        if len(moving) < len(values):
            moved = put_on([values[i] for i in moving], slot)
            for i, value in zip(moving, moved):
                values[i] = value
            return values
        return put_on(values, slot)

    @property
    def meshes(self) -> bool:
        """Whether the slots are sub-meshes (else single devices)."""
        return self.slots[0].mesh is not None

    def receivers(self) -> dict[int, Any]:
        """Per process, the device that receives the results of other processes'
        stages: one of its pipeline devices where it has one, else its first device (a
        process may own no stage: more processes than stage slots)."""
        first: dict[int, Any] = {}
        # The slots' platform, not the default backend's: a pipeline given the host
        # CPU's devices on an accelerator machine receives on the CPU too.
        platform = self.slots[0].device.platform
        for device in (*(d for s in self.slots for d in s.devices), *jax.devices(platform)):
            first.setdefault(_process_of(device), device)
        return first

    def home(self) -> Any:
        """Where this process keeps a result that no stage computes (a program input or
        a constant, such as the zero gradient of a parameter under ``stop_gradient``):
        whole on its first slot, or, in a process that runs no slot, on its receiving
        device (:meth:`receivers`). Never JAX's default device, which may be another
        platform's than the pipeline's."""
        # A slot of this process alone: one that spans processes would make the result
        # an array of the global program, not this process's own copy.
        mine = next((s for s in self.slots if s.processes == {self.process}), None)
        if mine is not None:
            return mine.replicated
        return make_single_device_sharding(self.receivers()[self.process])


def place_stages(available: Sequence[Any], stage_devices: Sequence[int]) -> Placement:
    """The placement of pipeline stages whose schedule puts stage ``k`` on device slot
    ``stage_devices[k]``, slot ``d`` being ``available[d]`` (a :class:`Slot`, or a
    device)."""
    order: dict[int, int] = {}  # schedule slot -> worker
    for d in stage_devices:
        order.setdefault(d, len(order))
    slots = tuple(
        available[d] if isinstance(available[d], Slot) else device_slot(available[d]) for d in order
    )
    return Placement(slots, tuple(order[d] for d in stage_devices), jax.process_index())
