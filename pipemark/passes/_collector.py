"""Pause Python's cyclic garbage collector while a pass builds its result.

A pass over a 200k-equation program allocates hundreds of thousands of small objects
(equations, variable lists, dicts) and no reference cycles. While they are being made,
the collector keeps rescanning the young ones, which costs as much as the pass itself
at that size and grows faster than linearly. Reference counting frees everything a pass
drops, so the collector has nothing to find there; it runs again when the pass returns.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collector"]


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Disable the cyclic collector inside the ``with`` block, if it is enabled (a
    nested block, or a caller that disabled it, is left alone)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
