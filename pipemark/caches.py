"""The caches pipemark keeps between calls, and :func:`clear_caches`.

Each cache is keyed on everything its answer depends on, so a program edited in place
is computed again rather than answered from a stale entry. The modules that keep one
register how to empty it here; :func:`clear_caches` empties them all (to free memory,
or to time a cold run).

>>> import pipemark as pm
>>> pm.clear_caches()
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["clear_caches", "register_cache"]

_CLEARERS: list[Callable[[], None]] = []


def register_cache(clear: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`clear_caches` call ``clear``; returns ``clear``."""
    _CLEARERS.append(clear)
    return clear


def clear_caches() -> None:
    """Empty every cache pipemark keeps: validated marker structure, compiled stage
    programs, and the small helpers' memos."""
    for clear in _CLEARERS:
        clear()
