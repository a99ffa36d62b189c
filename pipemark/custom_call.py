"""Custom-call identity targets: ``pipeline_marker`` and ``identity``.

Both targets copy each operand to its result. On CPU and CUDA they are typed-FFI
handlers (XLA FFI C API, ``api_version=1``) written with :mod:`ctypes` (the API's
structs and the generic handler are in :mod:`pipemark._ffi`), so nothing is compiled to
register them; on TPU a marker is a Pallas kernel (:mod:`pipemark.pallas_identity`):

* on CPU the handler copies host memory and counts what it copied
  (:func:`cpu_copy_stats`), which lets tests prove that donated buffers are never copied;
* on CUDA GPUs the handler launches ``kernels/batched_identity.cu``, compiled once per
  process and device by CuPy, on the stream XLA hands the call, and declares itself safe
  for CUDA-graph (command buffer) capture;
* on TPUs each marker lowers to a side-effecting ``pallas_call`` (a ``tpu_custom_call``
  named after the marker) whose results alias its operands; nothing is registered with
  XLA and no host code runs, so :func:`copy_stats` counts nothing there.

:func:`lower_marker` is the one lowering of every platform: :data:`PLATFORM_LOWERINGS`
says which kernel each platform gets.

A pair whose result buffer *is* its operand buffer (XLA aliased them, as the
``custom_call`` lowering asks for) costs nothing. Every failure goes back to XLA as an
FFI error, which JAX raises as an exception; the handler never crashes the process and
never returns a silently wrong result.

XLA kills the process when a target name is registered twice, so :func:`register_targets`
registers each (name, platform) exactly once per process, however often it is called.

``import pipemark`` does not import this module's CuPy or Pallas side: CuPy is imported
only when CUDA targets are registered, Pallas only for TPUs.

>>> import jax.numpy as jnp
>>> from pipemark import custom_call
>>> x = jnp.arange(3.0)
>>> [float(v) for v in custom_call.identity(x)[0]]
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.interpreters import mlir

from pipemark._ffi import (
    TRAIT_COMMAND_BUFFER_COMPATIBLE,
    Api,
    CallFrame,
    CopyRequest,
    DeviceOrdinalGetArgs,
    StreamGetArgs,
    call_api,
    make_handler,
)
from pipemark.cost import flatten_shape_byte_sizes
from pipemark.errors import PipemarkError

__all__ = [
    "TARGET_NAMES",
    "MAX_PAIRS",
    "KERNEL_NAME",
    "CopyStats",
    "CopyLaunch",
    "check_available",
    "register_targets",
    "registered_platforms",
    "copy_stats",
    "cpu_copy_stats",
    "reset_cpu_copy_stats",
    "identity",
    "plan_copies",
    "launch_copies",
    "kernel_dir",
    "kernel_sources",
    "PLATFORM_LOWERINGS",
    "lower_marker",
]

TARGET_NAMES: tuple[str, ...] = ("pipeline_marker", "identity")
KERNEL_NAME = "pipemark_batched_identity"
KERNEL_FILE = "batched_identity.cu"
MAX_PAIRS = 128  # PIPEMARK_MAX_PAIRS in kernels/batched_identity.cu
BLOCK_THREADS = 256
# Enough blocks to keep every SM of an H200 (132 SMs, 8 blocks of 256 threads each)
# busy on one large buffer; small buffers get fewer.
MAX_BLOCKS_X = 1056
# Bytes one block copies per grid-stride round: 256 threads x one 16-byte word x 4 rounds.
_BYTES_PER_BLOCK = BLOCK_THREADS * 16 * 4

_INSTALL_HINT = "pip install 'pipemark[gpu]'"

# ---------------------------------------------------------------------- CPU target


@dataclasses.dataclass(frozen=True)
class CopyStats:
    """What the CPU targets did since the last :func:`reset_cpu_copy_stats`.

    ``calls``: handler executions; ``copies``: operand→result copies made (a pair whose
    result is its operand is not copied); ``bytes_copied``: their total size.
    """

    calls: int = 0
    copies: int = 0
    bytes_copied: int = 0


_stats_lock = threading.Lock()
_stats: dict[str, CopyStats] = {}


def copy_stats(platform: str = "cpu") -> CopyStats:
    """Counts of what the ``pipeline_marker``/``identity`` targets of ``platform`` did.

    On CUDA, ``copies`` counts the pairs handed to the kernel; calls replayed from a
    captured CUDA graph do not run the handler and are not counted. On TPU nothing is
    counted (all zeros): the Pallas kernel runs on the device without host code; the
    copies XLA inserts before aliased calls are ``copy`` ops in the compiled HLO.
    """
    with _stats_lock:
        return _stats.get(_canonical_platform(platform), CopyStats())


def cpu_copy_stats() -> CopyStats:
    """Counts of what the CPU ``pipeline_marker``/``identity`` targets did."""
    return copy_stats("cpu")


def reset_cpu_copy_stats() -> None:
    """Zero the counters :func:`copy_stats` reports, for every platform."""
    with _stats_lock:
        _stats.clear()


def _count_copies(platform: str, copies: int, copied: int) -> None:
    with _stats_lock:
        stats = _stats.get(platform, CopyStats())
        _stats[platform] = CopyStats(
            stats.calls + 1, stats.copies + copies, stats.bytes_copied + copied
        )


def _cpu_execute(api: Api, frame: CallFrame, request: CopyRequest) -> None:
    del api, frame
    copies = copied = 0
    for src, dst, size in zip(request.srcs, request.dsts, request.sizes):
        if size == 0 or src == dst:
            continue
        ctypes.memmove(dst, src, size)
        copies += 1
        copied += size
    _count_copies("cpu", copies, copied)


# ---------------------------------------------------------------- copy planning


class _CopyPair(ctypes.Structure):  # struct pipemark_copy_pair
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("size", ctypes.c_uint64)]


class CopyTable(ctypes.Structure):
    """``struct pipemark_copy_table`` of ``kernels/batched_identity.cu``: the kernel's only
    parameter, passed by value."""

    _fields_ = [
        ("pairs", _CopyPair * MAX_PAIRS),
        ("count", ctypes.c_uint32),
        ("unused", ctypes.c_uint32),
    ]


@dataclasses.dataclass(frozen=True)
class CopyLaunch:
    """One kernel launch: its parameter table and its grid and block shapes."""

    table: CopyTable
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


def plan_copies(srcs: Sequence[int], dsts: Sequence[int], sizes: Sequence[int]) -> list[CopyLaunch]:
    """The launches of the batched identity kernel that copy ``sizes[i]`` bytes from
    address ``srcs[i]`` to ``dsts[i]``.

    Pairs that need no work (size 0, or destination equal to source) are left out;
    at most :data:`MAX_PAIRS` pairs go in one launch. Raises :class:`PipemarkError` for a
    negative size or ranges that partially overlap (the kernel would race).

    >>> [launch.table.count for launch in plan_copies([0, 4096], [1024, 4096], [8, 8])]
    [1]
    >>> plan_copies([0], [0], [100])
    []
    """
    if not len(srcs) == len(dsts) == len(sizes):
        raise PipemarkError(
            f"plan_copies: got {len(srcs)} sources, {len(dsts)} destinations and "
            f"{len(sizes)} sizes; pass one of each per buffer."
        )
    work = []
    for i, (src, dst, size) in enumerate(zip(srcs, dsts, sizes)):
        src, dst, size = int(src), int(dst), int(size)
        if size < 0:
            raise PipemarkError(f"plan_copies: pair {i} has negative size {size}.")
        if size == 0 or src == dst:
            continue
        if src < dst + size and dst < src + size:
            raise PipemarkError(
                f"plan_copies: pair {i} copies {size} bytes between overlapping ranges "
                f"0x{src:x} and 0x{dst:x}; identity copies need disjoint or equal buffers."
            )
        work.append((src, dst, size))
    launches = []
    for start in range(0, len(work), MAX_PAIRS):
        chunk = work[start : start + MAX_PAIRS]
        table = CopyTable()
        for j, (src, dst, size) in enumerate(chunk):
            table.pairs[j] = _CopyPair(src, dst, size)
        table.count = len(chunk)
        largest = max(size for _, _, size in chunk)
        blocks_x = min(MAX_BLOCKS_X, max(1, -(-largest // _BYTES_PER_BLOCK)))
        launches.append(CopyLaunch(table, (blocks_x, len(chunk), 1), (BLOCK_THREADS, 1, 1)))
    return launches


# --------------------------------------------------------------------- CUDA target


def kernel_dir() -> Path:
    """Where the CUDA sources are: inside the installed package (a wheel ships them as
    ``pipemark/kernels``), else ``kernels/`` of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / KERNEL_FILE).is_file():
            return candidate
    raise PipemarkError(
        f"Cannot find {KERNEL_FILE} in {here / 'kernels'} or {here.parent / 'kernels'}; "
        "reinstall pipemark (its wheel ships the CUDA sources)."
    )


def kernel_sources() -> dict[str, str]:
    """File name → CUDA source of every ``*.cu`` file pipemark ships."""
    return {path.name: path.read_text() for path in sorted(kernel_dir().glob("*.cu"))}


def _import_cupy():
    try:
        import cupy
    except ImportError as error:
        raise PipemarkError(
            "The 'custom_call' lowering on an NVIDIA GPU launches a CUDA kernel through "
            f"CuPy, which is not installed ({error}). Install it with: {_INSTALL_HINT} "
            "(or a cupy-cuda1Nx wheel matching your CUDA), or use "
            "pm.lowering('barrier')."
        ) from None
    return cupy


_cuda_lock = threading.Lock()
_cuda_functions: dict[int, Any] = {}  # device ordinal -> cupy Function


def _cuda_function(device_ordinal: int):
    """The kernel compiled for ``device_ordinal``: once per process and device."""
    with _cuda_lock:
        function = _cuda_functions.get(device_ordinal)
        if function is None:
            cupy = _import_cupy()
            with cupy.cuda.Device(device_ordinal):
                module = cupy.RawModule(
                    code=(kernel_dir() / KERNEL_FILE).read_text(), options=("--std=c++17",)
                )
                function = module.get_function(KERNEL_NAME)
            _cuda_functions[device_ordinal] = function
        return function


def _cuda_execute(api: Api, frame: CallFrame, request: CopyRequest) -> None:
    launches = plan_copies(request.srcs, request.dsts, request.sizes)
    if not launches:
        _count_copies("cuda", 0, 0)
        return
    stream = StreamGetArgs(ctypes.sizeof(StreamGetArgs), None, frame.ctx, None)
    call_api(api, "Stream_Get", stream)
    ordinal = DeviceOrdinalGetArgs(ctypes.sizeof(DeviceOrdinalGetArgs), None, frame.ctx, 0)
    call_api(api, "DeviceOrdinal_Get", ordinal)
    launch_copies(launches, stream.stream or 0, ordinal.device_ordinal)
    _count_copies(
        "cuda",
        sum(launch.table.count for launch in launches),
        sum(launch.table.pairs[i].size for launch in launches for i in range(launch.table.count)),
    )


def launch_copies(launches: Sequence[CopyLaunch], stream: int, device_ordinal: int) -> None:
    """Launch the batched identity kernel for each of ``launches`` (from
    :func:`plan_copies`) on CUDA ``stream`` of device ``device_ordinal``; asynchronous."""
    function = _cuda_function(device_ordinal)
    driver = _import_cupy().cuda.driver
    for launch in launches:
        # cuLaunchKernel copies the table out of host memory before it returns, so the
        # launch is asynchronous and a CUDA-graph capture records the table by value.
        params = (ctypes.c_void_p * 1)(ctypes.addressof(launch.table))
        driver.launchKernel(
            function.ptr, *launch.grid, *launch.block, 0, stream, ctypes.addressof(params), 0
        )


# -------------------------------------------------------------------- registration

_registry_lock = threading.Lock()
_registered: set[str] = set()
_handlers: list[Any] = []  # XLA keeps raw pointers: the ctypes callbacks must live forever


def _canonical_platform(platform: str) -> str:
    if not isinstance(platform, str):
        raise PipemarkError(
            f"platform must be 'cpu', 'cuda' or 'tpu' (a str), got {platform!r} of type "
            f"{type(platform).__name__}."
        )
    platform = platform.lower()
    return "cuda" if platform == "gpu" else platform


def registered_platforms() -> frozenset[str]:
    """The platforms whose targets this process has registered."""
    with _registry_lock:
        return frozenset(_registered)


def register_targets(platform: str = "cpu") -> None:
    """Register ``pipeline_marker`` and ``identity`` for ``platform`` (``"cpu"``,
    ``"cuda"`` or ``"tpu"``), once per process: later calls do nothing.

    For CUDA this imports CuPy (a :class:`PipemarkError` says how to install it) and
    compiles the kernel for every local GPU now, so no compilation happens while XLA
    captures a CUDA graph. For TPU it imports Pallas's TPU side (the marker kernel is a
    ``pallas_call``, which needs no registration with XLA).
    """
    platform = _canonical_platform(platform)
    with _registry_lock:
        if platform in _registered:
            return
        if platform == "tpu":
            _import_pallas_tpu()
            _registered.add(platform)
            return
        if platform == "cpu":
            handler = make_handler(_cpu_execute, traits=0)
        elif platform == "cuda":
            _import_cupy()
            handler = make_handler(_cuda_execute, traits=TRAIT_COMMAND_BUFFER_COMPATIBLE)
        else:
            raise PipemarkError(
                "pipemark has custom-call targets for 'cpu', 'cuda' and 'tpu', not "
                f"{platform!r}; use pm.lowering('barrier') or pm.lowering('identity') on "
                "this platform."
            )
        _handlers.append(handler)
        for name in TARGET_NAMES:
            jax.ffi.register_ffi_target(
                name, jax.ffi.pycapsule(handler), platform=platform, api_version=1
            )
        _registered.add(platform)
    if platform == "cuda":
        for device in jax.local_devices(backend="gpu"):
            _cuda_function(device.local_hardware_id)


def _import_pallas_tpu():
    try:
        from pipemark import pallas_identity
    except ImportError as error:
        raise PipemarkError(
            "The 'custom_call' lowering on a TPU lowers markers to a Pallas kernel, but "
            f"this JAX cannot import Pallas's TPU side ({error}). Install a jax and jaxlib "
            "of the same release, or use pm.lowering('barrier')."
        ) from None
    return pallas_identity


def check_available(platform: str | None = None) -> None:
    """Raise :class:`PipemarkError` unless custom-call markers can run on ``platform``
    (default: JAX's default backend); register the targets when they can."""
    if platform is None:
        platform = jax.default_backend()
    register_targets(platform)


# ------------------------------------------------------------------------ lowering


_SUB_BYTE_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        getattr(jax.numpy, n, None) for n in ("int2", "uint2", "int4", "uint4", "float4_e2m1fn")
    )
    if t is not None
)


def _passes_through_call(aval: Any) -> bool:
    # Extended dtypes (PRNG keys), float0 and sub-byte types (which XLA may pack) have no
    # plain buffer of numpy's itemsize per element, and an empty array has no data: they
    # skip the call unchanged.
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return True
    if 0 in getattr(aval, "shape", ()):
        return True
    return dtype == jax.dtypes.float0 or np.dtype(dtype) in _SUB_BYTE_DTYPES


def _lower_ffi(ctx: mlir.LoweringRuleContext, *args, name: str, mark_type: str):
    """A side-effecting typed-FFI ``pipeline_marker`` call (CPU and CUDA)."""
    call = jax.ffi.build_ffi_lowering_function(
        "pipeline_marker",
        has_side_effect=True,
        operand_output_aliases={j: j for j in range(len(args))},
    )
    op = call(
        ctx,
        *args,
        name=name,
        mark_type=mark_type,
        byte_sizes=flatten_shape_byte_sizes(ctx.avals_in),
    )
    return list(op.results)


def _lower_pallas(ctx: mlir.LoweringRuleContext, *args, name: str, mark_type: str):
    """The aliased Pallas identity kernel (TPU): :func:`pipemark.pallas_identity.lower_marker`."""
    return _import_pallas_tpu().lower_marker(ctx, *args, name=name, mark_type=mark_type)


#: How a marker lowers on each platform under ``pm.lowering("custom_call")``: a rule
#: ``rule(ctx, *operands, name=, mark_type=) -> results`` given only the operands that go
#: through the call. Platforms not listed get the typed-FFI ``pipeline_marker`` call.
PLATFORM_LOWERINGS: dict[str, Any] = {"tpu": _lower_pallas}


def lower_marker(ctx: mlir.LoweringRuleContext, *args, name: str, mark_type: str) -> list:
    """Lower one marker to a side-effecting identity call that carries ``name`` and
    ``mark_type``: on CPU and CUDA a typed-FFI ``pipeline_marker`` call (with
    ``byte_sizes`` as a third FFI attribute), on TPU a Pallas kernel
    (:mod:`pipemark.pallas_identity`).

    Operand ``i`` is aliased to result ``i``, so a donated or intermediate buffer is
    never copied. A lowering for several platforms at once (``jax.export`` with
    ``platforms=[...]``) reaches this rule once per kernel kind:
    :mod:`pipemark.primitive` registers the marker's lowering for ``"tpu"`` on its own,
    so JAX splits TPU from the others.
    """
    platforms = tuple(ctx.platforms or ctx.module_context.platforms)
    rules = {PLATFORM_LOWERINGS.get(_canonical_platform(p), _lower_ffi) for p in platforms}
    if len(rules) != 1:
        raise PipemarkError(
            f"Cannot lower the {mark_type!r} marker {name!r} for platforms {platforms} "
            "in one custom call: they need different kernels. Lower for one of them at a "
            "time, or use pm.lowering('barrier')."
        )
    for platform in platforms:
        register_targets(platform)
    kept = [i for i, aval in enumerate(ctx.avals_in) if not _passes_through_call(aval)]
    avals = [ctx.avals_in[i] for i in kept]
    (rule,) = rules
    outs = rule(
        ctx.replace(avals_in=avals, avals_out=avals),
        *(args[i] for i in kept),
        name=name,
        mark_type=mark_type,
    )
    results = list(args)
    for j, i in enumerate(kept):
        results[i] = outs[j]
    return results


# ------------------------------------------------------------------- identity call


def identity(*arrays: Any, alias: bool = True) -> tuple[jax.Array, ...]:
    """Put ``arrays`` through the ``identity`` target of JAX's default backend: one
    call, one result per array.

    With ``alias=True`` each result reuses its operand's buffer (XLA copies a
    non-donated jit argument first); with ``alias=False`` the target copies every
    buffer itself, which :func:`cpu_copy_stats` counts on CPU. On a TPU this is
    :func:`pipemark.pallas_identity.identity` (copies through VMEM blocks or by DMA).
    """
    check_available()
    if jax.default_backend() == "tpu":
        return _import_pallas_tpu().identity(*arrays, alias=alias)
    arrays = tuple(jax.numpy.asarray(a) for a in arrays)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    call = jax.ffi.ffi_call(
        "identity",
        avals,
        has_side_effect=True,
        input_output_aliases={i: i for i in range(len(arrays))} if alias else None,
    )
    return tuple(call(*arrays, byte_sizes=flatten_shape_byte_sizes(avals)))
