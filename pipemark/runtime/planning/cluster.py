"""A cluster you may not have, as numbers: :class:`Cluster` (chips, hosts, slices, HBM,
FLOP/s, ICI and DCN bandwidth and latency) and the time collectives take on it
(:func:`collective_seconds`), for the layout planner (:mod:`pipemark.runtime.planning.planner`).

A layout's chips form a mesh whose axes are laid out, innermost first, as
:data:`MESH_ORDER`: tensor parallelism (``tp``) on neighbouring chips, then FSDP, then
the pipeline stages, data parallelism outermost. An axis's *group* (the chips one
collective of that axis spans) then has ``ici`` members in each slice (one ICI domain,
a TPU pod) and spans ``dcn`` slices, joined by the data-centre network:

>>> cluster = tpu_v5e(1024)  # four 256-chip pods
>>> sizes = {"tp": 4, "fsdp": 8, "pp": 4, "dp": 8}
>>> axis_group(cluster, sizes, "fsdp"), axis_group(cluster, sizes, "dp")
(Group(ici=8, dcn=1), Group(ici=2, dcn=4))

Collectives are rings (the bandwidth-optimal algorithm on a torus): an all-reduce of
``n`` bytes over ``p`` chips moves ``2 (p - 1) / p × n`` bytes through each chip and
takes ``2 (p - 1)`` latency steps; a reduce-scatter or an all-gather half of both.
Across slices the ring is hierarchical: within each slice over ICI, then across slices
over DCN on the ``1 / ici`` part each chip holds, then within the slice again.

>>> round(collective_seconds(cluster, "all_reduce", 2**30, Group(16, 1)) * 1e3, 2)
20.16
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import NamedTuple

from pipemark.errors import PipemarkError

__all__ = [
    "COLLECTIVES",
    "MESH_ORDER",
    "Cluster",
    "Group",
    "TOPOLOGIES",
    "TPU_V5E_POD",
    "axis_group",
    "collective_seconds",
    "h100",
    "transfer_seconds",
    "tpu_v5e",
    "tpu_v5p",
    "tpu_v6e",
]

#: The mesh axes of a layout, innermost (neighbouring chips) first.
MESH_ORDER = ("tp", "fsdp", "pp", "dp")
#: The collectives :func:`collective_seconds` times.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
#: How a slice's chips are joined: a 2D or 3D torus of ICI links (a ring along one
#: dimension uses that dimension's two ports), or a switch (NVLink and NVSwitch:
#: every chip reaches every other at all its links' bandwidth).
TOPOLOGIES = ("2d-torus", "3d-torus", "switch")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The chips a plan is for, and what joins them.

    Attributes
    ----------
    name:
        For messages and tables.
    num_chips:
        Chips in all.
    chips_per_host:
        Chips that share one host and its network cards (its DCN bandwidth).
    chips_per_slice:
        Chips joined by ICI (a TPU pod or slice); slices are joined by DCN.
    hbm_bytes:
        Memory per chip a program may use.
    hbm_bandwidth:
        Bytes per second between a chip and its memory (bounds the optimizer update).
    peak_flops:
        Peak bfloat16 FLOP/s per chip.
    ici_link_bandwidth:
        Bytes per second of one ICI port in one direction.
    ici_ports:
        ICI ports per chip (4 on a 2D torus: two per torus dimension).
    ici_latency:
        Seconds per step of a ring collective, or per transfer, over ICI.
    dcn_bandwidth:
        Bytes per second a host sends (and receives) over DCN, shared by its chips.
    dcn_latency:
        Seconds per step of a ring collective, or per transfer, over DCN.
    dispatch_seconds:
        The host's time to dispatch one action (a compiled program call: the
        runtime's placing of its inputs, the call, handing its results over) with no
        ``dispatch_ahead`` bound; a device starts no action before the host has
        dispatched it (0: never late).
    wake_seconds:
        How long a host that waited for the device (a bounded ``dispatch_ahead``)
        takes, after the awaited action ends, to dispatch again.
    bounded_dispatch_seconds:
        The host's time to dispatch one action when ``dispatch_ahead`` bounds it
        (``None``: ``dispatch_seconds``). The runtime then waits for each action's
        results ``dispatch_ahead`` actions later, and its walking thread spends more
        per action than unbounded (:func:`tpu_v5e` says how much, and how measured).
    topology:
        How a slice's chips are joined (:data:`TOPOLOGIES`).

    >>> Cluster("two chips", 2, 2, 2, 2**30, 1e11, 1e12, 1e10, 2, 1e-6, 1e9, 1e-5).num_slices
    1
    """

    name: str
    num_chips: int
    chips_per_host: int
    chips_per_slice: int
    hbm_bytes: int
    hbm_bandwidth: float
    peak_flops: float
    ici_link_bandwidth: float
    ici_ports: int
    ici_latency: float
    dcn_bandwidth: float
    dcn_latency: float
    dispatch_seconds: float = 0.0
    wake_seconds: float = 0.0
    bounded_dispatch_seconds: float | None = None
    topology: str = "2d-torus"

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise PipemarkError(
                f"Cluster {self.name!r}: topology = {self.topology!r}; choose one of {TOPOLOGIES}."
            )
        for name in ("num_chips", "chips_per_host", "chips_per_slice", "hbm_bytes", "ici_ports"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PipemarkError(f"Cluster {self.name!r}: {name} = {value!r}; give an int >= 1.")
        for name in ("hbm_bandwidth", "peak_flops", "ici_link_bandwidth", "dcn_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise PipemarkError(
                    f"Cluster {self.name!r}: {name} = {value!r}; give a number > 0."
                )
        seconds = ("ici_latency", "dcn_latency", "dispatch_seconds", "wake_seconds")
        for name in (*seconds, "bounded_dispatch_seconds"):
            value = getattr(self, name)
            if value is None and name == "bounded_dispatch_seconds":  # dispatch_seconds's
                continue
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise PipemarkError(
                    f"Cluster {self.name!r}: {name} = {value!r}; give a number >= 0"
                    + (" (or None)." if name == "bounded_dispatch_seconds" else ".")
                )
        if self.chips_per_slice % self.chips_per_host or (
            self.num_chips > self.chips_per_slice and self.num_chips % self.chips_per_slice
        ):
            raise PipemarkError(
                f"Cluster {self.name!r}: a slice of {self.chips_per_slice} chips must hold whole "
                f"hosts of {self.chips_per_host}, and {self.num_chips} chips whole slices."
            )

    @property
    def num_slices(self) -> int:
        """Slices (ICI domains) in the cluster."""
        return max(1, self.num_chips // self.chips_per_slice)

    def dispatch_cost(self, dispatch_ahead: int | None) -> float:
        """The host's time to dispatch one action with the runtime's ``dispatch_ahead``
        (``None``: unbounded): ``bounded_dispatch_seconds`` where it is bounded and the
        cluster has one, else ``dispatch_seconds``.

        >>> host = tpu_v5e(1)
        >>> host.dispatch_cost(None), host.dispatch_cost(2)
        (0.00046, 0.00059)
        """
        if dispatch_ahead is None or self.bounded_dispatch_seconds is None:
            return self.dispatch_seconds
        return self.bounded_dispatch_seconds

    def with_chips(self, num_chips: int) -> Cluster:
        """The same kind of cluster with ``num_chips`` chips.

        >>> TPU_V5E_POD.with_chips(1024).num_slices
        4
        """
        return dataclasses.replace(
            self, num_chips=num_chips, name=f"{self.name.split(',')[0]}, {num_chips} chips"
        )


def tpu_v5e(num_chips: int = 256) -> Cluster:
    """Google Cloud TPU v5e chips, 256 to a pod (slice), several pods joined by DCN.

    Figures from Google's TPU v5e page (https://cloud.google.com/tpu/docs/v5e): per chip
    197 TFLOP/s bfloat16, 16 GB HBM2 at 819 GB/s, 400 GB/s of bidirectional ICI over 4
    ports (a 2D torus, 16 × 16 in a pod), so 50 GB/s per port and direction; 8 chips
    and 2 × 100 Gbps NICs per host, which gives the page's 6.4 Tbps of DCN per pod
    (32 hosts × 200 Gbps).

    Choices, with why:

    * ``hbm_bytes`` is what JAX lets a program use on a v5e chip (``bytes_limit``,
      15.75 GiB, recorded in ``benchmarks/results/accelerator-tpu-v5e-*.json``), not
      the 16 GiB the chip has.
    * 8 chips per host (the page's figure; multi-host training slices are also offered
      as 4-chip VMs). Only the DCN bandwidth per chip matters to the planner, and it is
      the same either way: 25 Gbps (3.125 GB/s) per chip, half a host's NICs for half
      its chips.
    * Latencies are not published: 1 µs per ICI step, 25 µs per DCN message
      (assumptions).
    * The host, measured on 2026-12-06 (``benchmarks/results/dispatch-tpu-v5e.json``,
      ``benchmarks/dispatch_cost.py``): 0.46 ms to dispatch an action (the runtime's
      host time per program of a 16-stage GPT pipeline on one v5e chip,
      ``Pipeline.timed_call``'s ``host_s`` over its programs, without
      ``dispatch_ahead``); 0.40 ms to resume after waiting for the chip (a jitted
      program of 0.76 ms dispatched and waited for took 1.29 ms, 0.13 ms of it its
      dispatch); 0.59 ms to dispatch an action under a bound (the same with
      ``dispatch_ahead=2``). That is wall time, which would hold the waits for the
      chip, but the walking thread's CPU time per program rose as much as its wall
      time (0.32 to 0.48 ms against 0.46 to 0.59 ms): the bound costs the thread
      work between two dispatches, not blocked time (``docs/scale.md``). Only
      ``dispatch_ahead=2`` was measured; the planner takes it for every bound.

    >>> cluster = tpu_v5e(1024)
    >>> cluster.num_slices, cluster.dcn_bandwidth / cluster.chips_per_host / 1e9
    (4, 3.125)
    """
    return Cluster(
        name=f"TPU v5e, {num_chips} chips",
        num_chips=num_chips,
        chips_per_host=8,
        chips_per_slice=256,
        hbm_bytes=16_909_336_064,
        hbm_bandwidth=819e9,
        peak_flops=197e12,
        ici_link_bandwidth=50e9,
        ici_ports=4,
        ici_latency=1e-6,
        dcn_bandwidth=25e9,
        dcn_latency=25e-6,
        dispatch_seconds=0.46e-3,
        wake_seconds=0.40e-3,
        bounded_dispatch_seconds=0.59e-3,
    )


#: One TPU v5e pod: 256 chips on one 16 × 16 ICI torus (:func:`tpu_v5e`).
TPU_V5E_POD = tpu_v5e(256)

#: Host dispatch costs measured on a v5e host (:func:`tpu_v5e`); the other presets
#: assume the same (their hosts were not measured).
_HOST = {"dispatch_seconds": 0.46e-3, "wake_seconds": 0.40e-3, "bounded_dispatch_seconds": 0.59e-3}


def _slice_of(owner: str, num_chips: int, slice_chips: int | None, largest: int) -> int:
    """A preset's chips per slice: ``slice_chips``, or all of them up to ``largest``."""
    chips = slice_chips if slice_chips is not None else min(num_chips, largest)
    if chips > largest:
        raise PipemarkError(
            f"{owner}: a slice of {chips} chips; the largest is {largest}: give slice_chips."
        )
    return chips


def tpu_v5p(num_chips: int = 256, slice_chips: int | None = None) -> Cluster:
    """Google Cloud TPU v5p chips, in slices of ``slice_chips`` (default: all of them,
    up to the largest single slice, 6,144 chips) joined by DCN.

    Figures from Google's TPU v5p page (https://cloud.google.com/tpu/docs/v5p): per
    chip 459 TFLOP/s bfloat16, 95 GiB HBM2e at 2,765 GB/s, 1,200 GB/s of bidirectional
    ICI (the page's 4,800 Gbps) over the 6 ports of a 3D torus, so 100 GB/s per port
    and direction; 50 Gbps of DCN per chip, 4 chips a host (the page's 4-chip VM);
    single slices of up to 6,144 chips. Assumed, as for :func:`tpu_v5e`: all 95 GiB
    usable (not measured), 1 µs per ICI step, 25 µs per DCN message, and the v5e
    host's dispatch costs.

    >>> cluster = tpu_v5p(512)
    >>> cluster.num_slices, cluster.peak_flops / 1e12, cluster.topology
    (1, 459.0, '3d-torus')
    """
    return Cluster(
        name=f"TPU v5p, {num_chips} chips",
        num_chips=num_chips,
        chips_per_host=4,
        chips_per_slice=_slice_of("tpu_v5p", num_chips, slice_chips, 6144),
        hbm_bytes=95 * 2**30,
        hbm_bandwidth=2765e9,
        peak_flops=459e12,
        ici_link_bandwidth=100e9,
        ici_ports=6,
        ici_latency=1e-6,
        dcn_bandwidth=4 * 50e9 / 8,
        dcn_latency=25e-6,
        topology="3d-torus",
        **_HOST,
    )


def tpu_v6e(num_chips: int = 256) -> Cluster:
    """Google Cloud TPU v6e (Trillium) chips, 256 to a pod (slice), pods joined by DCN.

    Figures from Google's TPU v6e page (https://cloud.google.com/tpu/docs/v6e): per
    chip 918 TFLOP/s bfloat16, 32 GB HBM at 1,638 GB/s, 800 GB/s of bidirectional ICI
    over 4 ports of a 2D torus (100 GB/s per port and direction), 8 chips a host, 256
    chips a pod. Assumed: 32 GiB usable (the page's GB, as v5e's 16 GB are 16 GiB);
    the page gives no DCN figure, so v5e's 25 Gbps a chip; 1 µs per ICI step, 25 µs
    per DCN message; the v5e host's dispatch costs.

    >>> tpu_v6e(512).num_slices, tpu_v6e().hbm_bandwidth / 1e9
    (2, 1638.0)
    """
    return Cluster(
        name=f"TPU v6e, {num_chips} chips",
        num_chips=num_chips,
        chips_per_host=8,
        chips_per_slice=256,
        hbm_bytes=32 * 2**30,
        hbm_bandwidth=1638e9,
        peak_flops=918e12,
        ici_link_bandwidth=100e9,
        ici_ports=4,
        ici_latency=1e-6,
        dcn_bandwidth=8 * 25e9 / 8,
        dcn_latency=25e-6,
        **_HOST,
    )


def h100(num_gpus: int = 8) -> Cluster:
    """NVIDIA H100 SXM GPUs, 8 to a node joined by NVLink through NVSwitch (a switch,
    not a torus: the node is the planner's slice), nodes joined by InfiniBand.

    Figures from NVIDIA's H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/):
    989 TFLOP/s dense bfloat16 (the sheet's 1,979 is with sparsity), 80 GB HBM3 at
    3.35 TB/s, NVLink 900 GB/s bidirectional per GPU over 18 links (25 GB/s per link and
    direction); from NVIDIA's DGX H100 page (https://www.nvidia.com/en-us/data-center/dgx-h100/):
    8 GPUs a node and 8 ConnectX-7 InfiniBand ports of 400 Gb/s (50 GB/s a GPU).
    Assumed: all 80 × 10⁹ bytes usable (JAX's allocator keeps some), 2 µs per NVLink
    step, 5 µs per InfiniBand message (not published), the v5e host's dispatch costs.

    >>> cluster = h100(64)
    >>> cluster.num_slices, cluster.topology, cluster.dcn_bandwidth / 8 / 1e9
    (8, 'switch', 50.0)
    """
    return Cluster(
        name=f"H100 SXM, {num_gpus} GPUs",
        num_chips=num_gpus,
        chips_per_host=8,
        chips_per_slice=min(num_gpus, 8),
        hbm_bytes=80 * 10**9,
        hbm_bandwidth=3.35e12,
        peak_flops=989e12,
        ici_link_bandwidth=25e9,
        ici_ports=18,
        ici_latency=2e-6,
        dcn_bandwidth=8 * 400e9 / 8,
        dcn_latency=5e-6,
        topology="switch",
        **_HOST,
    )


class Group(NamedTuple):
    """The chips of one collective: ``ici`` in each slice, over ``dcn`` slices."""

    ici: int
    dcn: int

    @property
    def size(self) -> int:
        return self.ici * self.dcn


def _check_sizes(cluster: Cluster, sizes: Mapping[str, int]) -> None:
    unknown = set(sizes) - set(MESH_ORDER)
    if unknown:
        raise PipemarkError(f"Unknown mesh axes {sorted(unknown)}; the axes are {MESH_ORDER}.")
    chips = math.prod(sizes.values())
    if chips > cluster.num_chips:
        raise PipemarkError(
            f"The layout needs {chips} chips but {cluster.name} has {cluster.num_chips}; "
            "choose smaller axes or a larger cluster."
        )


def axis_group(cluster: Cluster, sizes: Mapping[str, int], axis: str) -> Group:
    """The group of ``axis`` in a mesh of ``sizes`` laid out in :data:`MESH_ORDER`:
    how many of its chips share a slice, and how many slices it spans."""
    _check_sizes(cluster, sizes)
    stride = math.prod(sizes.get(a, 1) for a in MESH_ORDER[: MESH_ORDER.index(axis)])
    size = sizes.get(axis, 1)
    if stride * size <= cluster.chips_per_slice:
        return Group(size, 1)
    if stride >= cluster.chips_per_slice:
        return Group(1, size)
    within = cluster.chips_per_slice // stride
    return Group(within, size // within)


def _ici_bandwidth(cluster: Cluster, members: int) -> float:
    """A ring's bytes per second through each chip: on a torus, a group that fits
    along one dimension (at most √ or ∛ of the slice's chips) rings over that
    dimension's two ports, both directions, a larger one over all ports; through a
    switch, always over all its links."""
    if cluster.topology == "switch":
        return cluster.ici_ports * cluster.ici_link_bandwidth
    dims = 3 if cluster.topology == "3d-torus" else 2
    side = (
        math.isqrt(cluster.chips_per_slice)
        if dims == 2
        else round(cluster.chips_per_slice ** (1 / 3))
    )
    ports = 2 if members <= side else cluster.ici_ports
    return ports * cluster.ici_link_bandwidth


def _ring(moved: float, steps: int, bandwidth: float, latency: float) -> float:
    return moved / bandwidth + steps * latency


def collective_seconds(cluster: Cluster, kind: str, nbytes: float, group: Group) -> float:
    """Seconds a ring ``kind`` (:data:`COLLECTIVES`) of ``nbytes`` per chip (the whole
    buffer, before it is scattered or after it is gathered) takes over ``group``."""
    if kind not in COLLECTIVES:
        raise PipemarkError(f"Unknown collective {kind!r}; choose one of {COLLECTIVES}.")
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    rounds = 2 if kind == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather
    m, k = group
    seconds = 0.0
    if m > 1:
        bandwidth = _ici_bandwidth(cluster, m)
        seconds += rounds * _ring((m - 1) / m * nbytes, m - 1, bandwidth, cluster.ici_latency)
    if k > 1:
        per_chip = cluster.dcn_bandwidth / cluster.chips_per_host  # every chip sends at once
        part = nbytes / m
        seconds += rounds * _ring((k - 1) / k * part, k - 1, per_chip, cluster.dcn_latency)
    return seconds


def transfer_seconds(cluster: Cluster, nbytes: float, across_slices: bool) -> float:
    """Seconds to send ``nbytes`` from one chip to another: one ICI port in one
    direction within a slice (all of a chip's links through a switch), the chip's
    share of its host's DCN across slices.

    >>> round(transfer_seconds(TPU_V5E_POD, 50e6, across_slices=False) * 1e3, 3)
    1.001
    """
    if nbytes <= 0:
        return 0.0
    if across_slices:
        return cluster.dcn_latency + nbytes * cluster.chips_per_host / cluster.dcn_bandwidth
    links = cluster.ici_ports if cluster.topology == "switch" else 1
    return cluster.ici_latency + nbytes / (links * cluster.ici_link_bandwidth)
