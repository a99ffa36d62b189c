"""The parts of XLA's FFI C API that pipemark's custom-call targets use, in :mod:`ctypes`.

A typed-FFI handler is a C function that XLA calls with a call frame: the operands,
results and attributes of one call, and a table of API functions (make an error, get
the stream, get the device ordinal). :func:`make_handler` wraps a Python function into
such a handler: it answers XLA's metadata query (API version, traits), decodes the
frame into a :class:`CopyRequest` (operand and result addresses and byte counts, each
checked against the buffers' shapes), and turns every exception into an FFI error, so
nothing unwinds through XLA's C++ frames. :mod:`pipemark.custom_call` registers the
handlers it makes as the ``pipeline_marker`` and ``identity`` targets.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "Api",
    "CallFrame",
    "CopyRequest",
    "DeviceOrdinalGetArgs",
    "FfiError",
    "StreamGetArgs",
    "TRAIT_COMMAND_BUFFER_COMPATIBLE",
    "call_api",
    "make_handler",
]

# Layouts from xla/ffi/api/c_api.h (FFI API 0.x, as shipped with jaxlib 0.10 and 0.11).

_EXTENSION_METADATA = 1
_STAGE_EXECUTE = 3
_ARG_BUFFER = 1
_ATTR_ARRAY, _ATTR_SCALAR, _ATTR_STRING = 1, 3, 4
_ERROR_INVALID_ARGUMENT = 3
_ERROR_INTERNAL = 13
TRAIT_COMMAND_BUFFER_COMPATIBLE = 1

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


class CallFrame(ctypes.Structure):
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


class Api(ctypes.Structure):
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


class StreamGetArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stream", ctypes.c_void_p),
    ]


class DeviceOrdinalGetArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("device_ordinal", ctypes.c_int32),
    ]


_HANDLER_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(CallFrame))
_API_CALL_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class FfiError(Exception):
    """A failure to hand back to XLA as an FFI error with ``code``."""

    def __init__(self, message: str, code: int = _ERROR_INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def _api_function(api: Api, name: str) -> Callable[[Any], int | None]:
    field = getattr(Api, name)
    if api.struct_size < field.offset + field.size or not getattr(api, name):
        raise FfiError(f"this XLA's FFI API has no {name}", _ERROR_INTERNAL)
    return _API_CALL_TYPE(getattr(api, name))


def _make_error(api_address: int, message: str, code: int) -> int | None:
    api = Api.from_address(api_address)
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(), code)
    # XLA copies the message into the error it returns and owns that error from here on.
    return _api_function(api, "Error_Create")(ctypes.addressof(args))


def call_api(api: Api, name: str, args: ctypes.Structure) -> None:
    error = _api_function(api, name)(ctypes.addressof(args))
    if error:
        # Passing XLA's own error back would need XLA_FFI_Error_GetMessage/Destroy; a
        # plain message is enough to say which query failed.
        raise FfiError(f"XLA_FFI_{name} failed", _ERROR_INTERNAL)


def _read_attrs(frame: CallFrame) -> dict[str, Any]:
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
                raise FfiError(f"attribute {name!r} must be an int64 array")
            values = (ctypes.c_int64 * array.size).from_address(array.data) if array.size else ()
            attrs[name] = [int(v) for v in values]
        elif kind == _ATTR_SCALAR:
            attrs[name] = _Scalar.from_address(address)
    return attrs


def _buffers(operands: _Operands, what: str) -> list[_Buffer]:
    buffers = []
    for i in range(operands.size):
        if operands.types[i] != _ARG_BUFFER:
            raise FfiError(f"{what} {i} is not a buffer")
        buffers.append(_Buffer.from_address(operands.values[i]))
    return buffers


def _buffer_bytes(buffer: _Buffer) -> int:
    itemsize = _FFI_DTYPE_BYTES.get(buffer.dtype)
    if itemsize is None:
        raise FfiError(f"cannot copy buffers of XLA data type {buffer.dtype} (sub-byte or opaque)")
    return itemsize * int(np.prod([buffer.dims[d] for d in range(buffer.rank)], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class CopyRequest:
    """What one call of a target must do: copy ``sizes[i]`` bytes ``srcs[i]`` → ``dsts[i]``."""

    srcs: tuple[int, ...]
    dsts: tuple[int, ...]
    sizes: tuple[int, ...]


def _decode_request(frame: CallFrame) -> CopyRequest:
    args = _buffers(frame.args, "operand")
    rets = _buffers(frame.rets, "result")
    if len(args) != len(rets):
        raise FfiError(
            f"an identity call needs one result per operand; got {len(args)} operands and "
            f"{len(rets)} results"
        )
    attrs = _read_attrs(frame)
    sizes = attrs.get("byte_sizes")
    if sizes is None:
        raise FfiError("missing int64 array attribute 'byte_sizes'")
    if len(sizes) != len(args):
        raise FfiError(f"'byte_sizes' has {len(sizes)} entries for {len(args)} operands")
    for i, (arg, ret, size) in enumerate(zip(args, rets, sizes)):
        # A wrong size would read or write out of bounds: refuse it rather than trust it.
        for what, buffer in (("operand", arg), ("result", ret)):
            actual = _buffer_bytes(buffer)
            if actual != size:
                raise FfiError(f"byte_sizes[{i}] is {size} but {what} {i} holds {actual} bytes")
    return CopyRequest(
        tuple(a.data or 0 for a in args), tuple(r.data or 0 for r in rets), tuple(sizes)
    )


def make_handler(execute: Callable[[Api, CallFrame, CopyRequest], None], traits: int):
    """A typed-FFI handler (a ctypes function pointer) that answers XLA's metadata query,
    runs ``execute`` in the execute stage, and turns every exception into an FFI error."""

    def handler(frame_pointer):
        frame = frame_pointer.contents
        try:
            extension = frame.extension_start
            if extension and extension.contents.type == _EXTENSION_METADATA:
                metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension))
                metadata = metadata.contents.metadata.contents
                api = Api.from_address(frame.api)
                if api.api_version.major_version != 0:
                    # The structs above are those of FFI API 0.x; a new major version
                    # may lay them out differently, so refuse rather than misread them.
                    raise FfiError(
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
            execute(Api.from_address(frame.api), frame, _decode_request(frame))
            return None
        except FfiError as error:
            return _make_error(frame.api, f"pipemark: {error}", error.code)
        except BaseException as error:  # nothing may unwind through XLA's C++ frames
            return _make_error(frame.api, f"pipemark: {error!r}", _ERROR_INTERNAL)

    return _HANDLER_TYPE(handler)
