"""How ``pipeline_marker`` equations lower to StableHLO.

Three modes, chosen with :func:`set_lowering` or the :func:`lowering` context manager:

``"barrier"`` (default)
    ``stablehlo.optimization_barrier`` over the operands: XLA may not move computation
    across it while it exists. (On CPU, XLA removes barriers before fusion; a
    ``custom_call`` marker is never fused across.)
``"identity"``
    The operands pass straight through; the marker costs nothing at run time.
``"custom_call"``
    A side-effecting custom call that carries the marker's name and mark type: a
    typed-FFI target on CPU and CUDA, a Pallas kernel on TPU (see
    :mod:`pipemark.custom_call` and :mod:`pipemark.pallas_identity`).

The mode is part of JAX's jit cache key, so a function compiled under one mode is
recompiled, not reused, under another. Its default can also be set with the
``PIPEMARK_LOWERING`` environment variable before pipemark is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from jax.extend.mlir.dialects import stablehlo

from pipemark._compat import LOWERING_MODES, define_lowering_state
from pipemark.errors import PipemarkError

__all__ = ["LOWERING_MODES", "get_lowering", "lower_marker", "lowering", "set_lowering"]

_lowering_state = define_lowering_state()


def _check_mode(mode: object) -> str:
    if mode not in LOWERING_MODES:
        raise PipemarkError(
            f"Unknown lowering mode {mode!r}; choose one of {', '.join(LOWERING_MODES)}."
        )
    if mode == "custom_call":
        _custom_call_lowering()  # raises a PipemarkError when it cannot be used here
    return mode  # type: ignore[return-value]


def set_lowering(mode: str) -> None:
    """Set how markers lower from now on, in every thread: ``"barrier"``,
    ``"identity"`` or ``"custom_call"``."""
    _lowering_state._set(_check_mode(mode))


def get_lowering() -> str:
    """The lowering mode in force in this thread."""
    return _lowering_state.value


@contextlib.contextmanager
def lowering(mode: str) -> Iterator[None]:
    """Lower markers with ``mode`` inside the ``with`` block (this thread only).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> f = jax.jit(lambda x: pm.mark(x, name="a", mark_type="hook") + 1)
    >>> with pm.lowering("identity"):
    ...     "optimization_barrier" in f.lower(1.0).as_text()
    False
    """
    _check_mode(mode)
    with _lowering_state(mode):
        yield


def _custom_call_lowering() -> Callable:
    """The custom-call lowering rule, after checking that JAX's default backend can run
    it (registering its targets there); raises a :class:`PipemarkError` when it cannot,
    e.g. on an NVIDIA GPU without CuPy."""
    from pipemark import custom_call  # its CUDA side imports CuPy only when needed

    custom_call.check_available()
    return _lower_custom_call


def _lower_custom_call(ctx, *args, name: str, mark_type: str):
    if mark_type == "hook":
        # Hooks are taps on values, not stage boundaries: like the original, they keep
        # the barrier lowering and cost no call.
        return _lower_barrier(ctx, *args, name=name, mark_type=mark_type)
    from pipemark import custom_call

    # Registers the targets for the platforms of this lowering, which need not be the
    # default backend's.
    return custom_call.lower_marker(ctx, *args, name=name, mark_type=mark_type)


def _lower_barrier(ctx, *args, name: str, mark_type: str):
    del ctx, name, mark_type
    if not args:  # a zero-operand marker has nothing to fence
        return []
    return list(stablehlo.OptimizationBarrierOp(list(args)).results)


def _lower_identity(ctx, *args, name: str, mark_type: str):
    del ctx, name, mark_type
    return list(args)


def lower_marker(ctx, *args, name: str, mark_type: str):
    """The lowering rule of ``pipeline_marker`` (registered by
    :mod:`pipemark.primitive`): the current mode's."""
    mode = _lowering_state.value
    if mode == "identity":
        rule = _lower_identity
    elif mode == "custom_call":
        rule = _lower_custom_call
    else:
        rule = _lower_barrier
    return rule(ctx, *args, name=name, mark_type=mark_type)
