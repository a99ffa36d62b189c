"""The cells of a pipeline schedule written as CSV by ``torch.distributed.pipelining``
(``_dump_csv`` / ``_load_csv``, torchtitan's ``pipeline_parallel_schedule_csv``): one
row per rank, one action per cell, an empty cell an idle step.

A cell is ``<stage><type><microbatch>`` (``2F0``: the forward of stage 2 for microbatch
0), ``<stage><type>`` for the types without a microbatch (``1REDUCE_GRAD``), or an
overlapped pair ``(<cell>;<cell>)OVERLAP_F_B``. The types (:data:`CELL_TYPES`) are the
compute ones, ``F`` (forward), ``B`` (whole backward), ``I`` (input gradient: the first
half of a split backward) and ``W`` (weight gradient: the second), and those a
``"compute_comms"`` file adds: ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``,
``REDUCE_GRAD``, ``UNSHARD``, ``RESHARD``. This module reads and writes cells and rows;
:func:`pipemark.runtime.schedules.schedule_csv.schedule_from_csv` gives them meaning, and
:meth:`pipemark.runtime.Schedule.to_csv` writes a schedule with them.

>>> parse_cell("(0F3;3B1)OVERLAP_F_B")
Cell(stage=-1, type='OVERLAP_F_B', microbatch=None, parts=(Cell(stage=0, type='F', microbatch=3, parts=()), Cell(stage=3, type='B', microbatch=1, parts=())))
>>> format_cell(Cell(1, "REDUCE_GRAD"))
'1REDUCE_GRAD'
"""

from __future__ import annotations

import csv
import io
import re
from typing import NamedTuple

from pipemark.roles import BACKWARD, FORWARD, WEIGHT

__all__ = [
    "CELL_TYPES",
    "COMMUNICATION",
    "COMPUTE",
    "FORMATS",
    "OVERLAP",
    "Cell",
    "CellError",
    "format_cell",
    "parse_cell",
    "read_rows",
    "write_rows",
]

#: ``format=`` of a schedule CSV: compute actions only (the transfers are inferred), or
#: compute and communication actions as written.
FORMATS: tuple[str, ...] = ("compute_only", "compute_comms")

#: The compute types, with the action kind each runs (``B`` and ``I`` both run the
#: backward action: whole without a ``W`` for the same stage and microbatch, its input
#: half with one).
COMPUTE: dict[str, str] = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD, "W": WEIGHT}
#: Transfers between ranks: ``SEND_F`` after a forward whose outputs another rank
#: reads, ``RECV_F`` before a forward that reads another rank's; the same with ``_B``
#: for the cotangents a backward sends back.
COMMUNICATION: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: A forward and a backward run as one dispatched unit.
OVERLAP = "OVERLAP_F_B"
#: Every type a cell may have.
CELL_TYPES: tuple[str, ...] = (
    *COMPUTE,
    *COMMUNICATION,
    "REDUCE_GRAD",
    "UNSHARD",
    "RESHARD",
    OVERLAP,
)
_WITHOUT_MICROBATCH = frozenset(("REDUCE_GRAD", "UNSHARD", "RESHARD"))
# Longest names first, so that RECV_F is not read as R + ...; anchored at both ends.
_SINGLE = re.compile(
    r"(\d+)(" + "|".join(sorted(set(CELL_TYPES) - {OVERLAP}, key=len, reverse=True)) + r")(\d*)"
)


class CellError(ValueError):
    """A cell that is not in the grammar; :func:`read_rows`' callers name its row and
    column."""


class Cell(NamedTuple):
    """One parsed cell: ``stage``, ``type`` (one of :data:`CELL_TYPES`), ``microbatch``
    (``None`` for the types without one), and for an overlapped pair its two cells
    (``stage`` is then -1)."""

    stage: int
    type: str
    microbatch: int | None = None
    parts: tuple[Cell, ...] = ()


def parse_cell(text: str) -> Cell | None:
    """The cell ``text`` holds, ``None`` for an empty one; a :class:`CellError` saying
    what is wrong otherwise.

    >>> parse_cell("3SEND_B1"), parse_cell("  ")
    (Cell(stage=3, type='SEND_B', microbatch=1, parts=()), None)
    """
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        close = text.find(")")
        kind = text[close + 1 :] if close > 0 else ""
        if kind != OVERLAP:
            raise CellError(f"{text!r} is not an overlapped pair '(<cell>;<cell>){OVERLAP}'.")
        parts = tuple(_single(part) for part in text[1:close].split(";"))
        if len(parts) != 2 or parts[0].type != "F" or parts[1].type not in ("B", "I"):
            raise CellError(
                f"{text!r}: an {OVERLAP} pair is a forward and then a backward, e.g. "
                f"'(0F3;3B1){OVERLAP}'."
            )
        return Cell(-1, OVERLAP, None, parts)
    return _single(text)


def _single(text: str) -> Cell:
    match = _SINGLE.fullmatch(text.strip())
    if match is None:
        raise CellError(
            f"{text.strip()!r} is not an action: write <stage><type><microbatch> (e.g. "
            f"'2F0'), with a type among {', '.join(CELL_TYPES)}."
        )
    stage, kind, micro = match.groups()
    if kind in _WITHOUT_MICROBATCH and micro:
        raise CellError(f"{text.strip()!r}: a {kind} cell names a stage, no microbatch.")
    if kind not in _WITHOUT_MICROBATCH and not micro:
        raise CellError(f"{text.strip()!r}: a {kind} cell names a microbatch after its type.")
    return Cell(int(stage), kind, int(micro) if micro else None)


def format_cell(cell: Cell | None) -> str:
    """The text of ``cell`` (empty for ``None``), as torch writes it.

    >>> format_cell(Cell(-1, OVERLAP, None, (Cell(0, "F", 3), Cell(3, "B", 1))))
    '(0F3;3B1)OVERLAP_F_B'
    """
    if cell is None:
        return ""
    if cell.parts:
        return f"({';'.join(map(format_cell, cell.parts))}){cell.type}"
    micro = "" if cell.microbatch is None else str(cell.microbatch)
    return f"{cell.stage}{cell.type}{micro}"


def read_rows(text: str) -> list[list[str]]:
    """The rows of a CSV text, each a list of its cells' text (no trailing empty
    row)."""
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    return rows


def write_rows(rows: list[list[Cell | None]]) -> str:
    """CSV text of ``rows`` of cells, as ``csv.writer`` writes torch's files (with
    ``\\n`` line ends, which torch's ``csv.reader`` reads as it reads its own)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([format_cell(cell) for cell in row])
    return out.getvalue()
