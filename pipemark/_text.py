"""Small helpers for the text pipemark shows people: plurals, the one way every view
(tables, HTML, plots, schedules, the CLI) writes counts, bytes and percentages, and
lines kept to a width."""

from __future__ import annotations

import re
import textwrap
from typing import Any

__all__ = [
    "display_name",
    "format_bytes",
    "format_count",
    "format_share",
    "plural",
    "type_text",
    "wrap",
    "KEEP_TOGETHER",
]

#: Joins two words :func:`wrap` keeps on one line; shown as a space. No name pipemark
#: shows holds one: :func:`display_name` writes NUL escaped.
KEEP_TOGETHER = "\0"

# Characters that act on a terminal or reorder text instead of showing: C0 and C1
# controls (ANSI escape sequences start with one), zero-width and directional marks,
# line and paragraph separators, bidirectional embeddings, overrides and isolates
# (U+202E makes what follows read backwards), the byte-order mark.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def display_name(name: Any) -> str:
    r"""``name`` with control characters (ANSI escape sequences, bidirectional
    overrides among them) written as Python writes them in a string literal, so that a
    name can neither recolour a terminal, move its cursor nor reorder what is shown.

    >>> display_name("layer\x1b[31m0"), display_name("evil\u202eexe.txt")
    ('layer\\x1b[31m0', 'evil\\u202eexe.txt')
    """
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(name))


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``count`` and ``noun``, in the plural unless ``count`` is 1.

    >>> plural(1, "equation"), plural(3, "equation"), plural(2, "entry", "entries")
    ('1 equation', '3 equations', '2 entries')
    """
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def format_count(n: int) -> str:
    """``n`` exactly below 10 000, else with three significant digits and an SI prefix.

    >>> format_count(9999), format_count(12345), format_count(59_219_712)
    ('9999', '12.3k', '59.2M')
    """
    if abs(n) < 10_000:
        return str(n)
    value = n / 1000.0
    for prefix in ("k", "M", "G", "T"):
        if abs(value) < 999.5:
            return f"{value:.3g}{prefix}"
        value /= 1000.0
    return f"{value:.3g}P" if abs(value) < 999.5 else f"{value:,.0f}P"


def format_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB … with three significant digits.

    >>> format_bytes(16), format_bytes(489_472), format_bytes(7_106_816)
    ('16 B', '478 KiB', '6.78 MiB')
    """
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024.0
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 999.5:
            return f"{value:.3g} {unit}"
        value /= 1024.0
    return f"{value:.3g} TiB" if abs(value) < 999.5 else f"{value:,.0f} TiB"


def format_share(share: float | None) -> str:
    """A fraction as a percentage with one decimal, the way every view writes shares
    and bubbles; ``"-"`` for ``None`` (no share: nothing to divide by).

    >>> format_share(0.5), format_share(1 / 3), format_share(None)
    ('50.0 %', '33.3 %', '-')
    """
    return "-" if share is None else f"{100.0 * share:.1f} %"


def type_text(aval: Any) -> str:
    """An aval as JAX prints it short (``f32[4,8]``)."""
    try:
        return aval.str_short(short_dtypes=True)
    except (AttributeError, TypeError):
        return str(aval)


def wrap(text: str, width: int, indent: str = "  ") -> str:
    """``text`` in lines of at most ``width`` columns, broken at spaces (a word longer
    than a line is cut), the lines after the first starting with ``indent``; words
    joined by :data:`KEEP_TOGETHER` stay on one line.

    >>> print(wrap("balance: 2 forward layers, largest / mean cost 1.001", 30))
    balance: 2 forward layers,
      largest / mean cost 1.001
    """
    lines = textwrap.wrap(
        text,
        width=width,
        subsequent_indent=indent,
        break_long_words=True,
        break_on_hyphens=False,
    )
    return "\n".join(line.replace(KEEP_TOGETHER, " ") for line in lines)
