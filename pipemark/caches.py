"""The caches pipemark keeps between calls, and :func:`clear_caches`.

Each cache is keyed on everything its answer depends on, so a program edited in place
is computed again rather than answered from a stale entry. The modules that keep one
register how to empty it here; :func:`clear_caches` empties them all (to free memory,
or to time a cold run).

>>> from pipemark.caches import clear_caches
>>> clear_caches()
"""

from __future__ import annotations

import gc
from collections.abc import Callable

__all__ = ["clear_caches", "register_cache"]

_CLEARERS: list[Callable[[], None]] = []


def register_cache(clear: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`clear_caches` call ``clear``; returns ``clear``."""
    _CLEARERS.append(clear)
    return clear


def clear_caches() -> None:
    """Empty every cache pipemark keeps: validated marker structure, compiled stage
    programs, and the small helpers' memos; then hand the freed heap back to the
    operating system.

    Memory: each input shape a pipeline compiles for costs about 15 MB of process
    memory on CPU (its stage programs; ``jax.jit`` of the whole step costs about 4 MB).
    Dropping the pipeline frees it, but glibc keeps freed heap pages for reuse, so the
    process's resident size does not shrink; measured, ``jax.clear_caches()`` changes
    nothing and ``malloc_trim`` returns all of it. So this function ends with
    ``malloc_trim(0)`` where the C library is glibc (Linux); elsewhere the freed memory
    is still reused by later allocations, it is only not returned. On JAX 0.12 JAX's
    own caches also hold the compiled stage programs until ``jax.clear_caches()``
    (which empties them for every function, so pipemark does not call it)."""
    for clear in _CLEARERS:
        clear()
    gc.collect()  # what the caches held, unreachable now, freed before the trim
    _trim_heap()


def _trim_heap() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
