"""Custom-call identity targets: ``pipeline_marker`` and ``identity``.

Both targets copy each operand to its result. They are typed-FFI handlers (XLA FFI C
API, ``api_version=1``) written with :mod:`ctypes`, so nothing is compiled to register
them:

* on CPU the handler copies host memory and counts what it copied
  (:func:`cpu_copy_stats`), which lets tests prove that donated buffers are never copied;
* on CUDA GPUs the handler launches ``kernels/batched_identity.cu``, compiled once per
  process and device by CuPy, on the stream XLA hands the call, and declares itself safe
  for CUDA-graph (command buffer) capture.

A pair whose result buffer *is* its operand buffer (XLA aliased them, as the
``custom_call`` lowering asks for) costs nothing. Every failure goes back to XLA as an
FFI error, which JAX raises as an exception; the handler never crashes the process and
never returns a silently wrong result.

XLA kills the process when a target name is registered twice, so :func:`register_targets`
registers each (name, platform) exactly once per process, however often it is called.

``import pipemark`` does not import this module's CuPy side: CuPy is imported only when
CUDA targets are registered.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.interpreters import mlir

from pipemark.errors import PipemarkError
from pipemark.primitive import flatten_shape_byte_sizes

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

# ------------------------------------------------------------ the XLA FFI C API
# Layouts from xla/ffi/api/c_api.h (FFI API 0.x, as shipped with jaxlib 0.10 and 0.11).

_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ARG_BUFFER = 1
_ATTR_ARRAY, _ATTR_SCALAR, _ATTR_STRING = 1, 3, 4
_ERROR_INVALID_ARGUMENT = 3
_ERROR_INTERNAL = 13
_TRAIT_COMMAND_BUFFER_COMPATIBLE = 1

# XLA_FFI_DataType -> bytes per element, for every type whose buffers hold whole bytes per
# element. Sub-byte types (S1, S2, S4, U1, U2, U4, F4E2M1FN) may be packed, so a byte
# count from numpy's itemsize could overrun them: the handler refuses them and the
# lowering routes them around the call.
_FFI_DTYPE_BYTES = {
    1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 2, 8: 4, 9: 8, 10: 2, 11: 4, 12: 8, 15: 8,
    16: 2, 18: 16, 19: 1, 20: 1, 23: 1, 24: 1, 25: 1, 28: 1, 29: 1, 33: 1,
}  # fmt: skip


class _ExtensionBase(ctypes.Structure):
    pass


_ExtensionBase._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_ExtensionBase)),
]


class _ApiVersion(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major_version", ctypes.c_int),
        ("minor_version", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _ApiVersion),
        ("traits", ctypes.c_uint32),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("extension_base", _ExtensionBase), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Array(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("size", ctypes.c_size_t), ("data", ctypes.c_void_p)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class _Operands(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("values", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
        ("values", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_ExtensionBase)),
        ("api", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _Operands),
        ("rets", _Operands),
        ("attrs", _Attrs),
    ]


_API_FUNCTIONS = (
    "Error_Create",
    "Error_GetMessage",
    "Error_Destroy",
    "Handler_Register",
    "Stream_Get",
    "Type_Register",
    "ExecutionContext_Get",
    "State_Set",
    "State_Get",
    "DeviceMemory_Allocate",
    "DeviceMemory_Free",
    "ThreadPool_Schedule",
    "ThreadPool_NumThreads",
    "Future_Create",
    "Future_SetAvailable",
    "Future_SetError",
    "RunId_Get",
    "DeviceOrdinal_Get",
)


class _Api(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("api_version", _ApiVersion),
        ("internal_api", ctypes.c_void_p),
        *((name, ctypes.c_void_p) for name in _API_FUNCTIONS),
    ]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


class _StreamGetArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
    ]


class _DeviceOrdinalGetArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("device_ordinal", ctypes.c_int32),
    ]


_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
_API_CALL_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class _FfiError(Exception):
    """A failure to hand back to XLA as an FFI error with ``code``."""

    def __init__(self, message: str, code: int = _ERROR_INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def _api_function(api: _Api, name: str) -> Callable[[Any], int | None]:
    field = getattr(_Api, name)
    if api.struct_size < field.offset + field.size or not getattr(api, name):
        raise _FfiError(f"this XLA's FFI API has no {name}", _ERROR_INTERNAL)
    return _API_CALL_TYPE(getattr(api, name))


def _make_error(api_address: int, message: str, code: int) -> int | None:
    api = _Api.from_address(api_address)
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(), code)
    # XLA copies the message into the error it returns and owns that error from here on.
    return _api_function(api, "Error_Create")(ctypes.addressof(args))


def _call_api(api: _Api, name: str, args: ctypes.Structure) -> None:
    error = _api_function(api, name)(ctypes.addressof(args))
    if error:
        # Passing XLA's own error back would need XLA_FFI_Error_GetMessage/Destroy; a
        # plain message is enough to say which query failed.
        raise _FfiError(f"XLA_FFI_{name} failed", _ERROR_INTERNAL)


def _read_attrs(frame: _CallFrame) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    table = frame.attrs
    for i in range(table.size):
        span = table.names[i].contents
        name = ctypes.string_at(span.ptr, span.len).decode()
        kind, address = table.types[i], table.values[i]
        if kind == _ATTR_STRING:
            value = _ByteSpan.from_address(address)
            attrs[name] = ctypes.string_at(value.ptr, value.len).decode()
        elif kind == _ATTR_ARRAY:
            array = _Array.from_address(address)
            if array.dtype != 5:  # S64: pipemark only sends int64 arrays
                raise _FfiError(f"attribute {name!r} must be an int64 array")
            values = (ctypes.c_int64 * array.size).from_address(array.data) if array.size else ()
            attrs[name] = [int(v) for v in values]
        elif kind == _ATTR_SCALAR:
            attrs[name] = _Scalar.from_address(address)
    return attrs


def _buffers(operands: _Operands, what: str) -> list[_Buffer]:
    buffers = []
    for i in range(operands.size):
        if operands.types[i] != _ARG_BUFFER:
            raise _FfiError(f"{what} {i} is not a buffer")
        buffers.append(_Buffer.from_address(operands.values[i]))
    return buffers


def _buffer_bytes(buffer: _Buffer) -> int:
    itemsize = _FFI_DTYPE_BYTES.get(buffer.dtype)
    if itemsize is None:
        raise _FfiError(f"cannot copy buffers of XLA data type {buffer.dtype} (sub-byte or opaque)")
    return itemsize * int(np.prod([buffer.dims[d] for d in range(buffer.rank)], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class _CopyRequest:
    """What one call of a target must do: copy ``sizes[i]`` bytes ``srcs[i]`` → ``dsts[i]``."""

    srcs: tuple[int, ...]
    dsts: tuple[int, ...]
    sizes: tuple[int, ...]


def _decode_request(frame: _CallFrame) -> _CopyRequest:
    args = _buffers(frame.args, "operand")
    rets = _buffers(frame.rets, "result")
    if len(args) != len(rets):
        raise _FfiError(
            f"an identity call needs one result per operand; got {len(args)} operands and "
            f"{len(rets)} results"
        )
    attrs = _read_attrs(frame)
    sizes = attrs.get("byte_sizes")
    if sizes is None:
        raise _FfiError("missing int64 array attribute 'byte_sizes'")
    if len(sizes) != len(args):
        raise _FfiError(f"'byte_sizes' has {len(sizes)} entries for {len(args)} operands")
    for i, (arg, ret, size) in enumerate(zip(args, rets, sizes)):
        # A wrong size would read or write out of bounds: refuse it rather than trust it.
        for what, buffer in (("operand", arg), ("result", ret)):
            actual = _buffer_bytes(buffer)
            if actual != size:
                raise _FfiError(f"byte_sizes[{i}] is {size} but {what} {i} holds {actual} bytes")
    return _CopyRequest(
        tuple(a.data or 0 for a in args), tuple(r.data or 0 for r in rets), tuple(sizes)
    )


def _make_handler(execute: Callable[[_Api, _CallFrame, _CopyRequest], None], traits: int):
    """A typed-FFI handler (a ctypes function pointer) that answers XLA's metadata query,
    runs ``execute`` in the execute stage, and turns every exception into an FFI error."""

    def handler(frame_pointer):
        frame = frame_pointer.contents
        try:
            extension = frame.extension_start
            if extension and extension.contents.type == _EXTENSION_METADATA:
                metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension))
                metadata = metadata.contents.metadata.contents
                api = _Api.from_address(frame.api)
                if api.api_version.major_version != 0:
                    # The structs above are those of FFI API 0.x; a new major version
                    # may lay them out differently, so refuse rather than misread them.
                    raise _FfiError(
                        "this XLA speaks FFI API "
                        f"{api.api_version.major_version}.{api.api_version.minor_version}; "
                        "pipemark's targets know 0.x. Use pm.lowering('barrier') or "
                        "update pipemark."
                    )
                # The handler uses only ABI-stable parts of API 0.x, so it speaks the
                # version of the XLA that loaded it.
                metadata.api_version = _ApiVersion(
                    ctypes.sizeof(_ApiVersion),
                    None,
                    api.api_version.major_version,
                    api.api_version.minor_version,
                )
                metadata.traits = traits
                return None
            if frame.stage != _STAGE_EXECUTE:
                return None  # registered for the execute stage only
            execute(_Api.from_address(frame.api), frame, _decode_request(frame))
            return None
        except _FfiError as error:
            return _make_error(frame.api, f"pipemark: {error}", error.code)
        except BaseException as error:  # nothing may unwind through XLA's C++ frames
            return _make_error(frame.api, f"pipemark: {error!r}", _ERROR_INTERNAL)

    return _HANDLER_TYPE(handler)


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
    captured CUDA graph do not run the handler and are not counted.
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


def _cpu_execute(api: _Api, frame: _CallFrame, request: _CopyRequest) -> None:
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


def _cuda_execute(api: _Api, frame: _CallFrame, request: _CopyRequest) -> None:
    launches = plan_copies(request.srcs, request.dsts, request.sizes)
    if not launches:
        _count_copies("cuda", 0, 0)
        return
    stream = _StreamGetArgs(ctypes.sizeof(_StreamGetArgs), None, frame.ctx, None)
    _call_api(api, "Stream_Get", stream)
    ordinal = _DeviceOrdinalGetArgs(ctypes.sizeof(_DeviceOrdinalGetArgs), None, frame.ctx, 0)
    _call_api(api, "DeviceOrdinal_Get", ordinal)
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
    platform = platform.lower()
    return "cuda" if platform == "gpu" else platform


def registered_platforms() -> frozenset[str]:
    """The platforms whose targets this process has registered."""
    with _registry_lock:
        return frozenset(_registered)


def register_targets(platform: str = "cpu") -> None:
    """Register ``pipeline_marker`` and ``identity`` for ``platform`` (``"cpu"`` or
    ``"cuda"``), once per process: later calls do nothing.

    For CUDA this imports CuPy (a :class:`PipemarkError` says how to install it) and
    compiles the kernel for every local GPU now, so no compilation happens while XLA
    captures a CUDA graph.
    """
    platform = _canonical_platform(platform)
    with _registry_lock:
        if platform in _registered:
            return
        if platform == "cpu":
            handler = _make_handler(_cpu_execute, traits=0)
        elif platform == "cuda":
            _import_cupy()
            handler = _make_handler(_cuda_execute, traits=_TRAIT_COMMAND_BUFFER_COMPATIBLE)
        else:
            raise PipemarkError(
                f"pipemark has custom-call targets for 'cpu' and 'cuda', not {platform!r}; "
                "use pm.lowering('barrier') or pm.lowering('identity') on this platform."
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
    # plain buffer of numpy's itemsize per element; they skip the call unchanged.
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return True
    return dtype == jax.dtypes.float0 or np.dtype(dtype) in _SUB_BYTE_DTYPES


def lower_marker(ctx: mlir.LoweringRuleContext, *args, name: str, mark_type: str) -> list:
    """Lower one marker to a side-effecting ``pipeline_marker`` custom call.

    The call carries ``name``, ``mark_type`` and ``byte_sizes`` as FFI attributes and
    aliases operand ``i`` to result ``i``, so a donated or intermediate buffer is never
    copied.
    """
    for platform in ctx.platforms or ctx.module_context.platforms:
        register_targets(platform)
    kept = [i for i, aval in enumerate(ctx.avals_in) if not _passes_through_call(aval)]
    avals = [ctx.avals_in[i] for i in kept]
    call = jax.ffi.build_ffi_lowering_function(
        "pipeline_marker",
        has_side_effect=True,
        operand_output_aliases={j: j for j in range(len(kept))},
    )
    op = call(
        ctx.replace(avals_in=avals, avals_out=avals),
        *(args[i] for i in kept),
        name=name,
        mark_type=mark_type,
        byte_sizes=flatten_shape_byte_sizes(avals),
    )
    results = list(args)
    for j, i in enumerate(kept):
        results[i] = op.results[j]
    return results


# ------------------------------------------------------------------- identity call


def identity(*arrays: Any, alias: bool = True) -> tuple[jax.Array, ...]:
    """Put ``arrays`` through the ``identity`` target: one call, one result per array.

    With ``alias=True`` each result reuses its operand's buffer (XLA copies a
    non-donated jit argument first); with ``alias=False`` the target copies every
    buffer itself, which :func:`cpu_copy_stats` counts on CPU.
    """
    check_available()
    arrays = tuple(jax.numpy.asarray(a) for a in arrays)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    call = jax.ffi.ffi_call(
        "identity",
        avals,
        has_side_effect=True,
        input_output_aliases={i: i for i in range(len(arrays))} if alias else None,
    )
    return tuple(call(*arrays, byte_sizes=flatten_shape_byte_sizes(avals)))
