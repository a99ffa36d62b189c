"""Small helpers for the text pipemark shows people."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1.

    >>> plural(1, "equation"), plural(3, "equation"), plural(2, "entry", "entries")
    ('1 equation', '3 equations', '2 entries')
    """
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"
