"""The TPU identity kernel of custom-call markers, written in Pallas (Mosaic TPU).

On a TPU, ``pm.lowering("custom_call")`` lowers each marker (but hooks) to one
``pallas_call`` of this module (:func:`lower_marker`, which
:mod:`pipemark.custom_call` calls for platform ``"tpu"``). XLA sees a
``tpu_custom_call``:

* **named after the marker**: its ``kernel_name`` is ``pipeline_marker.<mark type>.<name>``
  (see :func:`kernel_name`) and its ``kernel_metadata`` frontend attribute holds the exact
  ``{"mark_type": ..., "name": ...}`` as JSON; ``pallas_call`` also puts the kernel
  name on the op's name stack, so its ``op_name`` metadata
  (``jit(step)/pipeline_marker.start.layer0/pallas_call``), which profilers show,
  names the marker;
* **side-effecting** (``pltpu.SideEffectType.SIDE_EFFECTING``): XLA never removes it,
  even when its results are unused, and never merges two of them, so it stays a stage
  boundary;
* **aliased**: result *i* is operand *i*'s buffer (``input_output_aliases``) and the
  kernel body does nothing. Where the operand is still needed after the marker (a jit
  argument that is not donated, a value read again later), XLA copies it before the
  call, as it does for the CPU and CUDA targets.

The operands stay in HBM (``memory_space=pl.ANY``): the kernel never stages them through
VMEM. :func:`identity` with ``alias=False`` copies instead: arrays of rank 2 or more
stream through VMEM in row blocks (:func:`copy_blocks`; on a TPU v5e this reaches
XLA's own copy bandwidth, where HBM-to-HBM DMAs reach about 0.9 of it), the others go
HBM to HBM by DMA, a large one as several concurrent DMAs (:func:`dma_slices`).

A scalar goes through the kernel as a ``(1, 1)`` array and a ``bool`` array as ``uint8``
(Mosaic takes no rank-0 blocks and no ``bool`` DMAs); :mod:`pipemark.custom_call`
keeps empty arrays, PRNG keys, ``float0`` and sub-byte values out of the call.

This module imports Pallas; ``import pipemark`` never imports it (:mod:`pipemark.custom_call`
does, when it registers the TPU target or lowers for a TPU). Off a TPU, Pallas runs the
kernel with ``interpret=True``, which is how the tests run it on CPU:

>>> import jax.numpy as jnp
>>> from pipemark import pallas_identity
>>> [int(v) for v in pallas_identity.identity(jnp.arange(3), interpret=True)[0]]
[0, 1, 2]
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.interpreters import mlir

from pipemark._compat import pallas_side_effecting
from pipemark.errors import PipemarkError

__all__ = [
    "KERNEL_PREFIX",
    "DEFAULT_DMAS",
    "DEFAULT_BLOCK_BYTES",
    "kernel_name",
    "dma_slices",
    "copy_blocks",
    "identity_call",
    "identity",
    "lower_marker",
    "lowering_for_tpu",
]

KERNEL_PREFIX = "pipeline_marker"
#: At most this many concurrent DMAs copy one array in :func:`identity` (``alias=False``).
DEFAULT_DMAS = 4
# A DMA moves at least this much: a smaller array is one DMA.
MIN_DMA_BYTES = 16 * 2**20
#: The VMEM one grid step of :func:`identity`'s blocked copy moves, all arrays together
#: (double-buffered in and out, 4 times this is in VMEM: under v5e's default 16 MiB).
DEFAULT_BLOCK_BYTES = 2 * 2**20
# Rows of a 2-D array a DMA slice starts on: a multiple of every TPU sublane tiling
# (8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit values), so no slice cuts a tile.
ROW_ALIGNMENT = 32


def kernel_name(name: str, mark_type: str) -> str:
    """The ``kernel_name`` of a marker's kernel in the HLO (JAX replaces characters
    other than letters, digits, ``_``, ``.`` and ``-`` by ``_``).

    >>> kernel_name("layer0", "start")
    'pipeline_marker.start.layer0'
    """
    return f"{KERNEL_PREFIX}.{mark_type}.{name}"


def dma_slices(shape: Sequence[int], itemsize: int, dmas: int = DEFAULT_DMAS) -> tuple:
    """How :func:`identity` copies an array of ``shape`` and ``itemsize``-byte elements:
    ``(None,)`` for one DMA of the whole array, else ``(start, stop)`` row ranges of its
    leading axis, one DMA each, at most ``dmas`` of them and none under 16 MiB.

    A 2-D array is cut at multiples of 32 rows (whole TPU tiles); a 1-D array is never
    cut.

    >>> dma_slices((4096, 4096), 4)  # 64 MiB of float32
    ((0, 1024), (1024, 2048), (2048, 3072), (3072, 4096))
    >>> dma_slices((100, 7), 4)
    (None,)
    """
    nbytes = math.prod(shape) * itemsize
    count = min(dmas, nbytes // MIN_DMA_BYTES)
    if len(shape) < 2 or count < 2:
        return (None,)
    align = ROW_ALIGNMENT if len(shape) == 2 else 1
    count = min(count, shape[0] // align)
    if count < 2:
        return (None,)
    units = shape[0] // align
    cuts = [align * (units * i // count) for i in range(1, count)]
    bounds = [0, *cuts, shape[0]]
    return tuple(itertools.pairwise(bounds))


def _sublane_rows(shape: Sequence[int], itemsize: int) -> int:
    # A 2-D block's rows must be whole sublane tiles (8 rows of 32-bit values, 16 of
    # 16-bit, 32 of 8-bit); higher ranks keep their last two axes whole, so any count
    # of leading rows is a valid block.
    return 8 * max(1, 4 // itemsize) if len(shape) == 2 else 1


def copy_blocks(
    shapes: Sequence[Sequence[int]],
    itemsizes: Sequence[int],
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[int, tuple]:
    """How :func:`identity` (``alias=False``) copies arrays of ``shapes`` and
    ``itemsizes``-byte elements: ``(steps, rows)``, the grid's step count and, per
    array, the rows of its leading axis one step copies through VMEM, or ``None``
    where it goes by DMA instead (rank 0 or 1, 64-bit, empty, or a block of whole
    tiles bigger than ``block_bytes``). The steps share ``block_bytes`` out among the
    blocked arrays by size; an array with fewer blocks than steps is copied once.

    >>> copy_blocks([(4096, 4096), (4096,), (64, 128)], [4, 4, 2])  # float32, bfloat16
    (32, (128, None, 16))
    """
    rows: list = []
    for shape, itemsize in zip(shapes, itemsizes):
        row_bytes = math.prod(shape[1:]) * itemsize
        tile = _sublane_rows(shape, itemsize) * row_bytes
        small = len(shape) < 2 or itemsize > 4 or row_bytes == 0 or shape[0] == 0
        rows.append(None if small or tile > block_bytes else row_bytes)
    total = sum(math.prod(s) * i for s, i, r in zip(shapes, itemsizes, rows) if r)
    steps = max(1, -(-total // block_bytes))
    for index, (shape, itemsize, row_bytes) in enumerate(zip(shapes, itemsizes, rows)):
        if row_bytes is not None:
            align = _sublane_rows(shape, itemsize)
            count = -(-shape[0] // steps)
            rows[index] = min(shape[0], -(-count // align) * align)
    # Whole tiles may leave the last steps with nothing to copy: drop them.
    blocks = [-(-s[0] // r) for s, r in zip(shapes, rows) if r is not None]
    return max(blocks, default=1), tuple(rows)


def _dma_copies(plans: tuple, refs: Sequence[Any]) -> list[Any]:
    """The kernel's DMAs: per operand, one per row range of its plan (``(None,)``: the
    whole array), none for a blocked operand (``"blocked"``) or an aliased one
    (``()``: result i is operand i's buffer, the data is already where it belongs).
    ``refs`` are the operands, the results, then a DMA semaphore per DMA."""
    count = len(plans)
    sources, destinations, semaphores = refs[:count], refs[count : 2 * count], refs[2 * count :]
    copies = []
    for source, destination, slices in zip(sources, destinations, plans):
        for rows in () if slices == "blocked" else slices:
            src, dst = source, destination
            if rows is not None:
                part = pl.ds(rows[0], rows[1] - rows[0])
                src, dst = source.at[part], destination.at[part]
            copies.append(pltpu.make_async_copy(src, dst, semaphores[len(copies)]))
    return copies


def _dma_parts(plans: tuple) -> dict:
    """The pallas_call arguments of a kernel that only copies by DMA (or aliases)."""
    return dict(
        kernel=lambda *refs: _copy_kernel(plans, *refs),
        scratch_shapes=[pltpu.SemaphoreType.DMA(()) for p in plans for _ in p],
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(plans),
    )


def _copy_kernel(plans: tuple, *refs: Any) -> None:
    copies = _dma_copies(plans, refs)
    # Start every DMA before waiting for any: they run concurrently.
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.wait()


def _blocked_kernel(steps: int, plans: tuple, *refs: Any) -> None:
    # Blocked operands arrive as VMEM blocks, one per grid step (Pallas double-buffers
    # them); the others are whole HBM refs, copied by DMAs started at the first step
    # and waited for at the last, so they overlap the blocks' stream.
    count = len(plans)
    for source, destination, plan in zip(refs[:count], refs[count : 2 * count], plans):
        if plan == "blocked":
            destination[...] = source[...]
    copies, step = _dma_copies(plans, refs), pl.program_id(0)

    @pl.when(step == 0)
    def _():
        for copy in copies:
            copy.start()

    @pl.when(step == steps - 1)
    def _():
        for copy in copies:
            copy.wait()


def _block_spec(shape: Sequence[int], rows: int | None) -> Any:
    if rows is None:
        return pl.BlockSpec(memory_space=pl.ANY)
    last = -(-shape[0] // rows) - 1
    zeros = (0,) * (len(shape) - 1)
    # Past its last block an array's index stays put: Pallas fetches and writes back
    # a block only when its index changes, so a small array is copied once.
    return pl.BlockSpec((rows, *shape[1:]), lambda i: (jnp.minimum(i, last), *zeros))


def _copy_call(shaped: Sequence[jax.Array], dmas: int, block_bytes: int | None) -> dict:
    """The pallas_call arguments of the copying kernel over ``shaped``."""
    steps, rows = 1, (None,) * len(shaped)
    if block_bytes is not None:
        sizes = [a.dtype.itemsize for a in shaped]
        steps, rows = copy_blocks([a.shape for a in shaped], sizes, block_bytes)
    if all(r is None for r in rows):
        return _dma_parts(tuple(dma_slices(a.shape, a.dtype.itemsize, dmas) for a in shaped))
    plans = tuple(
        "blocked" if r is not None else dma_slices(a.shape, a.dtype.itemsize, dmas)
        for a, r in zip(shaped, rows)
    )
    vmem = 4 * sum(math.prod(a.shape[1:]) * a.dtype.itemsize * r for a, r in zip(shaped, rows) if r)
    return dict(
        kernel=lambda *refs: _blocked_kernel(steps, plans, *refs),
        scratch_shapes=[pltpu.SemaphoreType.DMA(()) for p in plans if p != "blocked" for _ in p],
        in_specs=[_block_spec(a.shape, r) for a, r in zip(shaped, rows)],
        grid=(steps,),
        # The DMAs span steps (started at the first, waited for at the last): the steps
        # run in order on one core. Above the default scoped VMEM, ask for what it takes.
        compiler_params=dict(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem + 8 * 2**20 if vmem > 12 * 2**20 else None,
        ),
    )


def _to_kernel(array: jax.Array) -> jax.Array:
    if array.dtype == jnp.bool_:  # Mosaic DMAs refuse bool; uint8 has the same bytes
        array = array.astype(jnp.uint8)
    return array.reshape(1, 1) if array.ndim == 0 else array  # no rank-0 blocks


def _from_kernel(result: jax.Array, original: jax.Array) -> jax.Array:
    return result.reshape(original.shape).astype(original.dtype)


def identity_call(
    arrays: Sequence[jax.Array],
    *,
    name: str,
    metadata: Mapping[str, str],
    alias: bool,
    dmas: int = DEFAULT_DMAS,
    block_bytes: int | None = DEFAULT_BLOCK_BYTES,
    interpret: bool = False,
) -> list[jax.Array]:
    """One side-effecting ``pallas_call`` named ``name`` with ``metadata`` (strings, put
    in the HLO as JSON) that returns ``arrays``: aliased to them (``alias=True``, the
    kernel does nothing) or copied, through VMEM in blocks where :func:`copy_blocks`
    says so and by DMA otherwise (every array by DMA with ``block_bytes=None``).
    Traceable (use it under ``jax.jit``); not differentiable: :func:`identity` is.
    ``arrays`` may be empty.

    >>> import jax.numpy as jnp
    >>> out = identity_call([jnp.ones(2)], name="k", metadata={}, alias=False, interpret=True)
    >>> [float(v) for v in out[0]]
    [1.0, 1.0]
    """
    shaped = [_to_kernel(a) for a in arrays]
    # A scalar is copied even when aliasing: on a TPU v5e its (1, 1) operand aliased
    # to the result came back as other bytes (seen with JAX 0.10.2); 4 bytes cost nothing.
    aliased = [alias and a.ndim > 0 for a in arrays]
    if alias:
        parts = _dma_parts(tuple(() if keep else (None,) for keep in aliased))
    else:
        parts = _copy_call(shaped, dmas, block_bytes)
    params = dict(parts.pop("compiler_params", {}))
    call = pl.pallas_call(
        parts.pop("kernel"),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in shaped],
        out_specs=list(parts["in_specs"]),
        input_output_aliases={i: i for i, keep in enumerate(aliased) if keep},
        compiler_params=pltpu.CompilerParams(has_side_effects=pallas_side_effecting(), **params),
        **parts,
        name=name,
        metadata=dict(metadata),
        interpret=interpret,
    )
    results = call(*shaped)  # pallas_call puts its name on the op's name stack
    return [_from_kernel(r, a) for r, a in zip(results, arrays)]


def identity(
    *arrays: Any,
    alias: bool = True,
    name: str = "identity",
    dmas: int = DEFAULT_DMAS,
    block_bytes: int | None = DEFAULT_BLOCK_BYTES,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Put ``arrays`` through the identity kernel: one call named ``name``, one result
    per array, equal to it. Works under ``jit``, ``vmap`` and ``grad`` (the derivative
    is the identity, outside the kernel).

    ``alias=True``: each result reuses its operand's buffer and the kernel copies
    nothing (XLA copies an operand it still needs). ``alias=False``: the kernel copies
    every array, those of rank 2 or more through VMEM in blocks, ``block_bytes`` a grid
    step for all of them (:func:`copy_blocks`), the others HBM to HBM by DMA, at most
    ``dmas`` concurrent DMAs an array (:func:`dma_slices`); ``block_bytes=None`` copies
    every array by DMA. ``interpret=True`` runs the kernel with Pallas's interpreter, on
    any backend (CPU included).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jnp.sum(identity(x, alias=False, interpret=True)[0] ** 2)
    >>> [float(v) for v in jax.grad(f)(jnp.arange(3.0))]
    [0.0, 2.0, 4.0]
    """
    if not isinstance(dmas, int) or isinstance(dmas, bool) or dmas < 1:
        raise PipemarkError(f"dmas must be a positive int (DMAs per array), got {dmas!r}.")
    if block_bytes is not None and (
        not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 1
    ):
        raise PipemarkError(
            f"block_bytes must be a positive int (bytes a grid step copies) or None "
            f"(every array by DMA), got {block_bytes!r}."
        )
    arrays = tuple(jnp.asarray(a) for a in arrays)

    @jax.custom_jvp
    def call(*values):
        return tuple(
            identity_call(
                values,
                name=name,
                metadata={"name": name},
                alias=alias,
                dmas=dmas,
                block_bytes=block_bytes,
                interpret=interpret,
            )
        )

    @call.defjvp
    def _(primals, tangents):
        # The identity's derivative is the identity: tangents skip the kernel, which
        # Pallas could not differentiate (it has no JVP for aliased or DMA kernels).
        return call(*primals), tuple(tangents)

    return call(*arrays)


def _lowering_hint(error: Exception) -> str:
    text = str(error)
    if "device kind" in text:
        return (
            "JAX's Pallas TPU lowering asks the TPU's kind for a rank-1 operand: lower on "
            "a TPU, or inside `with pipemark.pallas_identity.lowering_for_tpu():`."
        )
    if "partitioned" in text or "Replica lowering" in text:
        return (
            "A Pallas kernel runs on one device and XLA cannot partition it: mark inside "
            "jax.shard_map, or use pm.lowering('barrier') for a program sharded over "
            "several devices."
        )
    return "Use pm.lowering('barrier') for this program, or report the error."


def lower_marker(
    ctx: mlir.LoweringRuleContext,
    *values: Any,
    name: str,
    mark_type: str,
    interpret: bool = False,
) -> list:
    """Lower one marker over ``values`` (arrays the kernel takes: :mod:`pipemark.custom_call`
    leaves the others out) to the aliased identity kernel, named and described by
    ``name`` and ``mark_type``. ``interpret=True`` lowers Pallas's interpreter instead
    (any platform; for tests). Raises :class:`PipemarkError` where Pallas cannot lower
    the kernel (a program sharded over several devices, a rank-1 operand lowered for a
    TPU on a host without one)."""

    def marker(*arrays):
        return identity_call(
            arrays,
            name=kernel_name(name, mark_type),
            metadata={"name": name, "mark_type": mark_type},
            alias=True,
            interpret=interpret,
        )

    try:
        return list(mlir.lower_fun(marker, multiple_results=True)(ctx, *values))
    except (NotImplementedError, ValueError) as error:
        raise PipemarkError(
            f"Cannot lower the {mark_type!r} marker {name!r} to the Pallas TPU identity "
            f"kernel: {str(error).strip().rstrip('.')}. {_lowering_hint(error)}"
        ) from error


@contextlib.contextmanager
def lowering_for_tpu(device_kind: str = "TPU v5 lite", num_cores: int = 1) -> Iterator[None]:
    """Lower for a TPU of ``device_kind`` on a host without one (``jax.export`` with
    ``platforms=["tpu"]``, ``.trace(...).lower(lowering_platforms=("tpu",))``): JAX's
    Pallas TPU lowering reads the TPU's kind from the abstract mesh for rank-1 operands.
    Make the arguments before entering: inside, newer JAX refuses eager operations
    (``jnp.ones``...) because the only mesh there is abstract; shapes
    (``jax.ShapeDtypeStruct``) need no device at all.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> f = jax.jit(lambda x: pm.mark(x, name="a", mark_type="start"))
    >>> x = jax.ShapeDtypeStruct((4,), jnp.float32)
    >>> with pm.lowering("custom_call"), lowering_for_tpu():
    ...     text = jax.export.export(f, platforms=["tpu"])(x).mlir_module()
    >>> 'kernel_name = "pipeline_marker.start.a"' in text
    True
    """
    device = jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=num_cores, platform="tpu"
    )
    mesh = jax.sharding.AbstractMesh((1,), ("pipemark_tpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
