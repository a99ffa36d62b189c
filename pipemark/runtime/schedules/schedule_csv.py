"""Read a pipeline schedule from ``torch.distributed.pipelining``'s CSV:
:func:`schedule_from_csv` (its cells: :mod:`pipemark.runtime.schedules.csv_cells`;
:meth:`pipemark.runtime.Schedule.to_csv` writes one).

Each row is a device (torch's rank) and lists the actions it runs, in order. The stage
of each action says where the stage lives (a stage on two rows is refused), so looped
(stage ``j`` on rank ``j % D``) and V-shaped placements are both read off the file. A
``B`` is a whole backward, an ``I`` the input half of one whose ``W`` runs apart, and a
schedule may mix them; ``(0F3;3B1)OVERLAP_F_B`` runs a forward and a backward as one
dispatched unit. Each action runs at the first tick where what it reads is ready, and
not before the ticks of the cells before it in its row: an empty cell is an idle tick, a
pair takes two, the other cells none (torch writes its grids for its own timing model;
what pipemark runs is the order).

The stage graph is a chain unless ``stage_graph=`` says otherwise, as torch's pipelines
are. A pipeline whose graph has more edges (a skip connection, tied embeddings read by
the first and the last stage) runs the schedule all the same where the file's order
meets them (:func:`~pipemark.runtime.schedules.check_schedule_fits`), and moves the
values its own graph says.

``format="compute_comms"`` files also list the transfers: each ``SEND_F`` / ``RECV_F``
/ ``SEND_B`` / ``RECV_B`` is checked against those pipemark infers from the stage graph
and the placement (:meth:`~pipemark.runtime.Schedule.crosses`): an extra or misplaced
one (a receive after the action that reads it, a send before the one that computes it,
either on another row) is refused, naming it, and so is a missing one that a chain of
the stages needs too (torch writes every one of those); the transfers that only the
edges of ``stage_graph=`` beyond a chain need have no cell in torch's files, and
pipemark makes them all the same. ``REDUCE_GRAD`` is kept where
it is written (:attr:`~pipemark.runtime.Schedule.reduce_grad`): it must follow every
backward and weight action of its stage in the stage's row. ``UNSHARD`` and ``RESHARD``
(FSDP parameter gathering) are accepted on their stage's row and ignored: pipemark
gathers parameters sharded over the data axis as the pipeline's ``fsdp_gather`` says,
not where these cells stand.

>>> s = schedule_from_csv("0F0,0F1,0B0,0B1\\n,1F0,1B0,1F1,1B1")
>>> s.stage_devices, s.num_microbatches, s.num_ticks
((0, 1), 2, 6)
>>> schedule_from_csv("0B0,0F0\\n1F0,1B0")
Traceback (most recent call last):
...
pipemark.errors.PipemarkError: Row 0, cell 0 ('0B0'): the backward of stage 0 for microbatch 0 comes before the forward of stage 0 for microbatch 0 (row 0, cell 1 ('0F0')); run the forward first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from pipemark.errors import PipemarkError
from pipemark.roles import BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.schedules.core import (
    Action,
    Schedule,
    crossings,
    normalize_stage_graph,
    schedule_from_orders,
)
from pipemark.runtime.schedules.csv_cells import (
    COMMUNICATION,
    COMPUTE,
    FORMATS,
    OVERLAP,
    Cell,
    CellError,
    parse_cell,
    read_rows,
)

__all__ = ["schedule_from_csv"]


class _Where(NamedTuple):
    """A cell's place in the file, and its text."""

    row: int
    column: int
    text: str

    def __str__(self) -> str:
        return f"Row {self.row}, cell {self.column} ({self.text!r})"

    def inline(self) -> str:
        """The place, within a sentence."""
        return f"row {self.row}, cell {self.column} ({self.text!r})"


class _File(NamedTuple):
    """What the rows hold: per row its compute units (one action, or an overlapped
    pair) with their cells, and every other cell."""

    units: list[list[tuple[tuple[Action, ...], _Where]]]
    others: list[tuple[Cell, _Where]]  # SEND/RECV, REDUCE_GRAD, UNSHARD, RESHARD
    earliest: dict[Action, int]  # the tick of each action's column
    typed: dict[Action, str]  # the type each compute action is written with (F B I W)
    cells: dict[Action, _Where]


def schedule_from_csv(
    path_or_text: str | os.PathLike,
    format: str = "compute_only",
    *,
    stage_graph: Any = None,
    name: str = "csv",
) -> Schedule:
    """The :class:`~pipemark.runtime.Schedule` a CSV file (or its text) of
    ``torch.distributed.pipelining`` describes; see the module docstring for what each
    cell means and what is checked.

    Parameters
    ----------
    path_or_text:
        A file's path, or the CSV text itself (a string that names no file).
    format:
        ``"compute_only"`` (compute actions, plus ``REDUCE_GRAD`` / ``UNSHARD`` /
        ``RESHARD``; the transfers are inferred) or ``"compute_comms"`` (the transfers
        written too, and checked).
    stage_graph:
        The stages' graph as every builder takes it (``None``: a chain, as torch's
        schedules are). A pipeline runs the schedule on its own graph where the order
        meets it, so this is needed only for an order that a chain's dependencies
        deadlock (stages that do not read one another), or for the schedule's own
        uses (its simulation, its transfers).
    name:
        The schedule's name.

    Raises
    ------
    PipemarkError
        For a malformed file, naming the row and cell (both counted from 0, as torch
        counts ranks and steps): an unknown action, a backward before its forward, a
        stage on two rows, a missing microbatch, a transfer pipemark does not infer.
    """
    if format not in FORMATS:
        raise PipemarkError(
            f"Unknown CSV format {format!r}; choose {' or '.join(map(repr, FORMATS))}."
        )
    text = _text(path_or_text)
    parsed = _parse(read_rows(text), format)
    devices = _stage_devices(parsed)
    _check_actions(parsed, len(devices))
    orders = [[a for unit, _ in row for a in unit] for row in parsed.units]
    pairs = [unit for row in parsed.units for unit, _ in row if len(unit) == 2]
    try:
        schedule = schedule_from_orders(
            orders,
            stage_devices=devices,
            num_microbatches=1 + max(a.microbatch for a in parsed.cells),
            stage_graph=stage_graph,
            name=name,
            overlapped=pairs,
            earliest=parsed.earliest,
        )
    except PipemarkError as error:
        named = [f"{where}" for a, where in parsed.cells.items() if a.describe() in str(error)]
        raise PipemarkError(f"{error} In the file: {'; '.join(named[:4])}.") from error
    _check_others(parsed, schedule, format)
    return _with_reductions(parsed, schedule)


def _text(path_or_text: str | os.PathLike) -> str:
    if isinstance(path_or_text, os.PathLike) or (
        isinstance(path_or_text, str) and "\n" not in path_or_text and os.path.isfile(path_or_text)
    ):
        with open(path_or_text, newline="") as file:
            return file.read()
    if not isinstance(path_or_text, str):
        raise PipemarkError(
            f"schedule_from_csv takes a file's path or the CSV text, got "
            f"{type(path_or_text).__name__}."
        )
    return path_or_text


def _parse(rows: list[list[str]], format: str) -> _File:
    """Every cell of ``rows`` parsed, in order (see :class:`_File`)."""
    parsed = _File([[] for _ in rows], [], {}, {}, {})
    for r, row in enumerate(rows):
        tick = 0  # the tick the next cell's action may run at, at the earliest
        for c, text in enumerate(row):
            where = _Where(r, c, text.strip())
            try:
                cell = parse_cell(text)
            except CellError as error:
                raise PipemarkError(f"{where}: {error}") from None
            if cell is None:
                tick += 1
                continue
            if cell.type in COMMUNICATION and format == "compute_only":
                raise PipemarkError(
                    f"{where}: a transfer in a compute_only file; read it with "
                    "format='compute_comms', or leave the transfers out (pipemark infers "
                    "them)."
                )
            if cell.type not in COMPUTE and cell.type != OVERLAP:
                parsed.others.append((cell, where))
                continue
            unit = tuple(_action(part, where, parsed) for part in (cell.parts or (cell,)))
            for action in unit:
                parsed.earliest[action] = tick
                tick += 1
            parsed.units[r].append((unit, where))
    if not parsed.cells:
        raise PipemarkError("The CSV holds no compute action (F, B, I, W); nothing to run.")
    return parsed


def _action(cell: Cell, where: _Where, parsed: _File) -> Action:
    action = Action(cell.stage, cell.microbatch, COMPUTE[cell.type])
    if action in parsed.cells:
        raise PipemarkError(
            f"{where}: the {action.describe()} runs a second time (first at "
            f"{parsed.cells[action].inline()}); every action runs once."
        )
    parsed.cells[action] = where
    parsed.typed[action] = cell.type
    return action


def _stage_devices(parsed: _File) -> tuple[int, ...]:
    """The row of each stage, from its actions: a stage on two rows is refused, and
    every stage up to the highest one named has actions."""
    device: dict[int, tuple[int, _Where]] = {}
    for action, where in parsed.cells.items():
        seen = device.setdefault(action.stage, (where.row, where))
        if seen[0] != where.row:
            raise PipemarkError(
                f"{where}: stage {action.stage} is on row {where.row} here but on row "
                f"{seen[0]} at {seen[1].inline()}; a stage lives on one device. Move "
                "its actions to one row."
            )
    count = 1 + max(device)
    missing = [j for j in range(count) if j not in device]
    if missing:
        raise PipemarkError(
            f"Stage(s) {missing} have no action in the file, but stage {count - 1} has; "
            "number the stages 0, 1, ... without gaps."
        )
    return tuple(device[j][0] for j in range(count))


def _check_actions(parsed: _File, num_stages: int) -> None:
    """In each row, cell by cell, a backward after its forward and ``W`` after ``I``;
    then per stage and microbatch a forward and one backward (``B``, or ``I`` and
    ``W``)."""
    typed, cells = parsed.typed, parsed.cells
    for action, _ in sorted(cells.items(), key=lambda item: item[1][:2]):
        need = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(action.kind)
        if need is not None:
            _check_before(parsed, action._replace(kind=need), action)
    last = max(cells, key=lambda a: a.microbatch)
    micro = 1 + last.microbatch
    for j in range(num_stages):
        for m in range(micro):
            forward, backward, weight = (Action(j, m, k) for k in (FORWARD, BACKWARD, WEIGHT))
            for action in (forward, backward):
                if action not in cells:
                    raise PipemarkError(
                        f"Microbatch {m} is missing: the file has no {action.describe()}, "
                        f"but runs microbatches up to {last.microbatch} "
                        f"({cells[last].inline()}); every stage runs its forward and "
                        "backward for every microbatch 0, 1, ..."
                    )
            if typed[backward] == "I" and weight not in cells:
                raise PipemarkError(
                    f"{cells[backward]}: an input-gradient half (I) without its W; write B "
                    "for a whole backward, or add the W."
                )
            if weight in cells and typed[backward] == "B":
                raise PipemarkError(
                    f"{cells[weight]}: a W after a whole backward (B, at "
                    f"{cells[backward].inline()}); write I for the backward's first half."
                )


def _check_before(parsed: _File, earlier: Action, later: Action) -> None:
    """``earlier`` runs in ``later``'s row, in a cell before it (a stage lives on one
    row)."""
    cells = parsed.cells
    second = cells[later]
    first = cells.get(earlier)
    if first is None or first.column >= second.column:
        where = "which the file never runs" if first is None else first.inline()
        same = first is not None and first.column == second.column
        raise PipemarkError(
            f"{second}: the {later.describe()} comes "
            f"{'in the same pair as' if same else 'before'} the {earlier.describe()} "
            f"({where}); run the {earlier.kind} first."
        )


def _check_others(parsed: _File, schedule: Schedule, format: str) -> None:
    """The transfers, reductions and (un)shards: each on its stage's row, naming an
    action of the file; transfers where pipemark infers them, and all of those present
    in a ``compute_comms`` file."""
    found: set[tuple[str, int, int | None]] = set()
    for cell, where in parsed.others:
        if not 0 <= cell.stage < schedule.num_stages:
            raise PipemarkError(f"{where}: no stage {cell.stage} runs in this file.")
        if schedule.stage_devices[cell.stage] != where.row:
            raise PipemarkError(
                f"{where}: stage {cell.stage} lives on row "
                f"{schedule.stage_devices[cell.stage]}; write its {cell.type} there."
            )
        if cell.type in COMMUNICATION:
            _check_transfer(parsed, schedule, cell, where)
            found.add((cell.type, cell.stage, cell.microbatch))
    if format == "compute_comms":
        _check_listed(parsed, schedule, found)


def _check_listed(
    parsed: _File, schedule: Schedule, found: set[tuple[str, int, int | None]]
) -> None:
    """Every transfer a chain of the file's stages needs (what torch, whose pipelines
    are chains, writes) that the schedule's stage graph needs too is in ``found``; those
    only the graph's edges beyond a chain need, pipemark makes without a cell."""
    chain = normalize_stage_graph(None, schedule.num_stages)
    devices = schedule.stage_devices
    missing = [
        f"{kind}{suffix} of stage {a.stage} for microbatch {a.microbatch} (row {devices[a.stage]})"
        for a in parsed.cells
        for kind, needed, written in zip(
            ("RECV", "SEND"), schedule.crosses(a), crossings(a, devices, chain)
        )
        if needed and written
        for suffix in ["_F" if a.kind == FORWARD else "_B"]
        if (kind + suffix, a.stage, a.microbatch) not in found
    ]
    if missing:
        raise PipemarkError(
            f"The file's transfers miss {len(missing)} that pipemark infers from the "
            f"stage graph and the stages' rows, e.g. {'; '.join(missing[:3])}."
        )


def _check_transfer(parsed: _File, schedule: Schedule, cell: Cell, where: _Where) -> None:
    """One SEND/RECV cell: the action it carries values of, on the same row, after it
    (SEND) or before it (RECV), and a transfer pipemark infers."""
    direction, suffix = cell.type.split("_")
    action = Action(cell.stage, cell.microbatch, FORWARD if suffix == "F" else BACKWARD)
    if action not in parsed.cells:
        raise PipemarkError(f"{where}: names the {action.describe()}, which the file never runs.")
    reads, sends = schedule.crosses(action)
    if not (sends if direction == "SEND" else reads):
        other = "to" if direction == "SEND" else "from"
        raise PipemarkError(
            f"{where}: pipemark infers no such transfer: the {action.describe()} "
            f"{'sends' if direction == 'SEND' else 'receives'} nothing {other} another "
            "device (by the stage graph and the stages' rows). Remove the cell."
        )
    at = parsed.cells[action]
    if (at.column < where.column) != (direction == "SEND"):
        order = "after" if direction == "SEND" else "before"
        raise PipemarkError(
            f"{where}: a {cell.type} comes {order} the action whose values it carries, "
            f"the {action.describe()} ({at.inline()}); move it."
        )


def _with_reductions(parsed: _File, schedule: Schedule) -> Schedule:
    """``schedule`` with each REDUCE_GRAD after the action of the compute cell before it
    in its row."""
    ticks = {a: t for t, _, a in schedule.actions()}
    reductions: list[tuple[int, int]] = []
    for cell, where in parsed.others:
        if cell.type != "REDUCE_GRAD":
            continue
        before = [unit for unit, at in parsed.units[where.row] if at.column < where.column]
        if not before:
            raise PipemarkError(f"{where}: a REDUCE_GRAD before any action of its row.")
        if any(r[0] == cell.stage for r in reductions):
            raise PipemarkError(f"{where}: stage {cell.stage}'s gradients are reduced twice.")
        reductions.append((cell.stage, ticks[before[-1][-1]]))
        late = [
            a
            for a in parsed.cells
            if a.stage == cell.stage and a.kind != FORWARD and ticks[a] > reductions[-1][1]
        ]
        if late:
            raise PipemarkError(
                f"{where}: reduces stage {cell.stage}'s gradients before its "
                f"{late[0].describe()} ({parsed.cells[late[0]].inline()}); move the "
                "REDUCE_GRAD after it."
            )
    if not reductions:
        return schedule
    return dataclasses.replace(schedule, reduce_grad=tuple(reductions))
