"""Pipeline schedules as data: which device runs which stage for which microbatch, tick
by tick.

A :class:`Schedule` is a grid of ticks × devices. Each cell holds one :class:`Action`
(the forward or the backward of one stage for one microbatch) or ``None`` (the device
idles: a *bubble*). Every tick lasts one unit of time, whatever the action; the grid is
the order in which the runtime dispatches work, and a plot of it is the usual picture of
a pipeline.

Stages need not form a chain. The *stage graph* lists, for each forward stage, the
stages whose outputs it reads (a skip connection is an edge that jumps over stages).
A schedule is valid when every action runs after everything it needs:

* the forward of stage ``j`` for microbatch ``m`` after the forward of every
  predecessor of ``j`` for ``m``;
* the backward of stage ``j`` for ``m`` after the forward of ``j`` for ``m`` and after
  the backward of every successor of ``j`` for ``m``;
* in a zero-bubble schedule, whose backward is split in two
  (:func:`pipemark.passes.split_backward`: B, the activation cotangents, and W, the
  parameter gradients), the weight action of ``j`` for ``m`` after its backward
  action. A backward action with a weight action for the same stage and microbatch is
  the first half (torch's ``I``); one without is the whole backward (torch's ``B``). A
  schedule may mix the two, microbatch by microbatch (DualPipeV does).

A schedule fits a pipeline whose stage graph is another when its ticks meet every
dependency of the pipeline's graph too (:func:`check_schedule_fits`): one built for a
chain runs a pipeline whose last stage also reads the first (tied embeddings), with the
pipeline's graph in place of its own.

Two actions of one device may run as one dispatched unit (:attr:`Schedule.overlapped`,
torch's ``OVERLAP_F_B``): a forward and a backward on adjacent ticks, the second's
inputs ready before the first's tick, compiled into one program so that XLA may
overlap them.

The builders (:func:`gpipe_schedule`, :func:`one_f_one_b_schedule`,
:func:`interleaved_schedule`) give each device an *order* of actions and let
:func:`schedule_from_orders` place each action at the first tick where its inputs are
ready, so the same builders are correct for any stage graph.

>>> s = one_f_one_b_schedule(num_stages=2, num_microbatches=3)
>>> print(s)
1f1b: 2 stages, 3 microbatches, 2 devices, 8 ticks, bubble 25.0 %
tick      0   1   2   3   4   5   6   7
device 0  F0  F1  .   B0  F2  B1  .   B2
device 1  .   F0  B0  F1  B1  F2  B2  .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pipemark._text import format_share, plural
from pipemark.errors import PipemarkError, StageGraphError
from pipemark.roles import ACTION_KINDS, BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.schedules.csv_cells import FORMATS, OVERLAP, Cell, write_rows

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "Action",
    "Schedule",
    "schedule_from_orders",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_schedule",
    "check_schedule_fits",
    "ideal_bubble_fraction",
    "in_waves",
]

# The action kinds (FORWARD, BACKWARD and WEIGHT, the parameter-gradient half of a
# backward split by pipemark.passes.split_backward) are stage roles, defined once in
# pipemark.roles and re-exported here.


class Action(NamedTuple):
    """The forward, backward (or, split, its weight half) of one stage for one
    microbatch.

    >>> Action(stage=1, microbatch=0, kind="backward")
    Action(stage=1, microbatch=0, kind='backward')
    >>> Action(1, 0, "backward").label(one_stage_per_device=True)
    'B0'
    """

    stage: int
    microbatch: int
    kind: str

    def label(self, one_stage_per_device: bool = False) -> str:
        """``F3`` / ``B3`` / ``W3`` (``F3s1`` when a device holds several stages)."""
        text = f"{self.kind[0].upper()}{self.microbatch}"
        return text if one_stage_per_device else f"{text}s{self.stage}"

    def describe(self) -> str:
        return f"{self.kind} of stage {self.stage} for microbatch {self.microbatch}"


# ---------------------------------------------------------------------- stage graph


def _chain(num_stages: int) -> tuple[tuple[int, ...], ...]:
    return tuple(() if j == 0 else (j - 1,) for j in range(num_stages))


def _check_count(value: Any, what: str, advice: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipemarkError(f"{what} must be a positive int, got {value!r}. {advice}")
    return value


def normalize_stage_graph(stage_graph: Any, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """The predecessors of each forward stage, from one of:

    ``None``
        A chain: stage ``j`` reads stage ``j - 1``.
    a ``networkx.DiGraph``
        With nodes ``0 .. num_stages - 1`` (isolated nodes allowed).
    a mapping ``{stage: predecessors}``
        Stages that are not keys have no predecessors.
    an iterable of ``(source, target)`` edges.

    Raises :class:`StageGraphError` for a node outside ``0 .. num_stages - 1``, a
    self-loop or a cycle (naming it).

    >>> normalize_stage_graph([(0, 1), (1, 2), (0, 2)], 3)
    ((), (0,), (0, 1))
    """
    num_stages = _check_count(num_stages, "num_stages", "Give the number of pipeline stages.")
    if stage_graph is None:
        return _chain(num_stages)
    if hasattr(stage_graph, "edges") and hasattr(stage_graph, "nodes"):
        nodes = list(stage_graph.nodes)
        edges = list(stage_graph.edges)
    elif isinstance(stage_graph, Mapping):
        nodes = list(stage_graph)
        edges = [(p, j) for j, preds in stage_graph.items() for p in preds]
    else:
        try:
            edges = [tuple(e) for e in stage_graph]
        except TypeError:
            raise StageGraphError(
                f"Cannot read a stage graph from {type(stage_graph).__name__}; pass None "
                "(a chain), a networkx.DiGraph, a {stage: predecessors} mapping or a list "
                "of (source, target) edges between stage indices."
            ) from None
        nodes = []
    preds: list[set[int]] = [set() for _ in range(num_stages)]
    for node in nodes:
        _check_stage_node(node, num_stages)
    for edge in edges:
        if len(edge) != 2:
            raise StageGraphError(f"Stage graph edge {edge!r} is not a (source, target) pair.")
        source, target = (_check_stage_node(n, num_stages) for n in edge)
        if source == target:
            raise StageGraphError(
                f"Stage graph edge {edge!r} is a self-loop; a stage cannot read its own "
                "outputs across a pipeline boundary. Remove the edge."
            )
        preds[target].add(source)
    result = tuple(tuple(sorted(p)) for p in preds)
    _check_acyclic(result)
    return result


def _check_stage_node(node: Any, num_stages: int) -> int:
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < num_stages:
        raise StageGraphError(
            f"Stage graph node {node!r} is not a stage index in 0..{num_stages - 1}. "
            "Number the forward stages 0, 1, ... in program order (StagedJaxpr.graph "
            "names them; map names to indices first)."
        )
    return node


def _check_acyclic(preds: Sequence[Sequence[int]]) -> None:
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(preds)))
    graph.add_edges_from((p, j) for j, ps in enumerate(preds) for p in ps)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
    raise StageGraphError(
        f"The stage graph has a cycle: {path}. Pipeline stages must depend on each other "
        "without cycles; merge the stages on the cycle into one stage."
    )


def stage_successors(preds: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """The stages that read each stage, from the predecessors of each.

    >>> stage_successors(((), (0,), (0, 1)))
    ((1, 2), (2,), ())
    """
    succ: list[list[int]] = [[] for _ in preds]
    for j, ps in enumerate(preds):
        for p in ps:
            succ[p].append(j)
    return tuple(tuple(s) for s in succ)


def _depth_to_sink(preds: Sequence[Sequence[int]]) -> list[int]:
    """For each stage, the number of edges on the longest path to a stage that nothing
    reads (S - 1 - j on a chain): how many forwards must be in flight before the
    stage's first backward can arrive."""
    import networkx as nx

    succ = stage_successors(preds)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(preds)))
    graph.add_edges_from((p, j) for j, ps in enumerate(preds) for p in ps)
    depth = [0] * len(preds)
    for j in reversed(list(nx.topological_sort(graph))):
        depth[j] = max((depth[s] + 1 for s in succ[j]), default=0)
    return depth


def dependencies(
    action: Action, preds: Sequence[Sequence[int]], succ: Sequence[Sequence[int]]
) -> list[Action]:
    """What ``action`` needs to have run before it (see the module docstring)."""
    j, m = action.stage, action.microbatch
    if action.kind == FORWARD:
        return [Action(p, m, FORWARD) for p in preds[j]]
    if action.kind == WEIGHT:
        return [Action(j, m, BACKWARD)]
    return [Action(j, m, FORWARD)] + [Action(s, m, BACKWARD) for s in succ[j]]


def crossings(
    action: Action, stage_devices: Sequence[int], preds: Sequence[Sequence[int]]
) -> tuple[bool, bool]:
    """Whether ``action`` reads values from another device and whether it sends values
    to another device, on the stage graph ``preds`` with stage ``j`` on device
    ``stage_devices[j]``: a forward reads its predecessors' outputs and sends to its
    successors, a backward the other way round (a weight action neither).

    >>> crossings(Action(0, 0, BACKWARD), (0, 1, 0), ((), (0,), (0,)))
    (True, False)
    """
    if action.kind == WEIGHT:
        return False, False
    here = stage_devices[action.stage]
    before = preds[action.stage]
    after = [j for j, ps in enumerate(preds) if action.stage in ps]
    if action.kind == BACKWARD:
        before, after = after, before
    return (
        any(stage_devices[s] != here for s in before),
        any(stage_devices[s] != here for s in after),
    )


# ------------------------------------------------------------------------- Schedule


def ideal_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of a GPipe or 1F1B pipeline of equal stages on a chain,
    ``(S - 1) / (M + S - 1)``.

    >>> ideal_bubble_fraction(4, 8)
    0.2727272727272727
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@dataclass(frozen=True)
class Schedule:
    """A validated pipeline schedule.

    Attributes
    ----------
    name:
        ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or a name of your own.
    num_microbatches:
        How many microbatches go through the pipeline.
    stage_devices:
        The device index of each forward stage (its backward runs on the same device,
        next to the residuals it reads).
    predecessors:
        The stage graph: the stages each forward stage reads from.
    ticks:
        ``ticks[t][d]`` is the :class:`Action` device ``d`` runs at tick ``t``, or
        ``None``.
    overlapped:
        Pairs of actions run as one dispatched unit (torch's ``OVERLAP_F_B``): a forward
        and then a backward of one device, on adjacent ticks, the backward's inputs
        ready before the forward's tick and neither reading the other; the runtime
        compiles each pair into one program.
    reduce_grad:
        ``(stage, tick)`` pairs: the stage's gradients are reduced over its
        data-parallel replicas after its device's action at that tick (torch's
        ``REDUCE_GRAD``; at most one per stage, after its last backward and weight
        actions). Stages not listed are reduced at the end of a call.

    Building one checks it; :class:`StageGraphError` says which action runs too early
    (or twice, or never, or on the wrong device) and what to move.

    >>> F, B = "forward", "backward"
    >>> Schedule("mine", 1, (0, 1), ((), (0,)),
    ...          ((Action(0, 0, F), None), (None, Action(1, 0, F)),
    ...           (None, Action(1, 0, B)), (Action(0, 0, B), None))).num_ticks
    4
    """

    name: str
    num_microbatches: int
    stage_devices: tuple[int, ...]
    predecessors: tuple[tuple[int, ...], ...]
    ticks: tuple[tuple[Action | None, ...], ...]
    overlapped: tuple[tuple[Action, Action], ...] = ()
    reduce_grad: tuple[tuple[int, int], ...] = ()
    _finish: dict[Action, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_devices", tuple(self.stage_devices))
        object.__setattr__(self, "predecessors", tuple(tuple(p) for p in self.predecessors))
        object.__setattr__(self, "ticks", tuple(tuple(t) for t in self.ticks))
        object.__setattr__(self, "overlapped", tuple(tuple(p) for p in self.overlapped))
        object.__setattr__(self, "reduce_grad", tuple(tuple(r) for r in self.reduce_grad))
        object.__setattr__(self, "_finish", _validate(self))

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def num_devices(self) -> int:
        return len(self.ticks[0]) if self.ticks else max(self.stage_devices) + 1

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        return stage_successors(self.predecessors)

    @property
    def stage_graph(self) -> dict[int, tuple[int, ...]]:
        """The stage graph, ``{stage: its predecessors}``: what another schedule for the
        same pipeline is built with, e.g. ``pm.runtime.zero_bubble_schedule(S, M, costs=...,
        stage_graph=pipe.plan(params, batch).schedule.stage_graph)``.

        >>> one_f_one_b_schedule(3, 2).stage_graph
        {0: (), 1: (0,), 2: (1,)}
        """
        return dict(enumerate(self.predecessors))

    @property
    def splits_backward(self) -> bool:
        """Whether the backward is split into backward and weight actions."""
        return any(a.kind == WEIGHT for tick in self.ticks for a in tick if a)

    @property
    def whole_backwards(self) -> frozenset[tuple[int, int]]:
        """The ``(stage, microbatch)`` whose backward action is the whole backward in a
        schedule that splits others (no weight action of its own); empty where the
        schedule splits none or all.

        >>> F, B, W = FORWARD, BACKWARD, WEIGHT
        >>> schedule_from_orders([[Action(0, 0, F), Action(0, 0, B), Action(0, 1, F),
        ...     Action(0, 1, B), Action(0, 1, W)]], stage_devices=(0,),
        ...     num_microbatches=2).whole_backwards
        frozenset({(0, 0)})
        """
        if not self.splits_backward:
            return frozenset()
        actions = self._finish
        return frozenset(
            (a.stage, a.microbatch)
            for a in actions
            if a.kind == BACKWARD and a._replace(kind=WEIGHT) not in actions
        )

    def crosses(self, action: Action) -> tuple[bool, bool]:
        """Whether ``action`` reads values from another device and whether it sends
        values to another device (:func:`crossings` by this schedule's stage graph and
        stages' devices). The transfers a ``"compute_comms"`` CSV writes
        (:meth:`to_csv`) and is checked against.

        >>> one_f_one_b_schedule(2, 1).crosses(Action(0, 0, FORWARD))
        (False, True)
        """
        return crossings(action, self.stage_devices, self.predecessors)

    @property
    def bubble_fraction(self) -> float:
        """The fraction of device × tick cells that are idle."""
        cells = self.num_ticks * self.num_devices
        busy = sum(a is not None for tick in self.ticks for a in tick)
        return (cells - busy) / cells

    def actions(self) -> list[tuple[int, int, Action]]:
        """Every action as ``(tick, device, action)``, in dispatch order (tick by tick,
        device by device)."""
        return [(t, d, a) for t, tick in enumerate(self.ticks) for d, a in enumerate(tick) if a]

    def device_orders(self) -> list[list[Action]]:
        """The actions of each device in the order it runs them."""
        orders: list[list[Action]] = [[] for _ in range(self.num_devices)]
        for _, d, a in self.actions():
            orders[d].append(a)
        return orders

    def in_flight(self) -> tuple[int, ...]:
        """Per device, the most microbatches it holds at once: whose forward (of any
        stage on the device) has run and whose last backward (or weight) action there
        has not; each holds its residuals on the device until then.

        >>> gpipe_schedule(2, 4).in_flight(), one_f_one_b_schedule(2, 4).in_flight()
        ((4, 4), (2, 1))
        """
        remaining: list[dict[int, int]] = [{} for _ in range(self.num_devices)]
        for _, d, a in self.actions():
            if a.kind != FORWARD:
                remaining[d][a.microbatch] = remaining[d].get(a.microbatch, 0) + 1
        most = [0] * self.num_devices
        held: list[set[int]] = [set() for _ in range(self.num_devices)]
        for _, d, a in self.actions():
            if a.kind == FORWARD:
                held[d].add(a.microbatch)
                most[d] = max(most[d], len(held[d]))
                continue
            remaining[d][a.microbatch] -= 1
            if not remaining[d][a.microbatch]:
                held[d].discard(a.microbatch)
        return tuple(most)

    def to_text(self) -> str:
        """A text grid: one row per device, one column per tick, ``.`` for idle."""
        single = len(set(self.stage_devices)) == self.num_stages
        header = (
            f"{self.name}: {plural(self.num_stages, 'stage')}, "
            f"{plural(self.num_microbatches, 'microbatch', 'microbatches')}, "
            f"{plural(self.num_devices, 'device')}, {plural(self.num_ticks, 'tick')}, "
            f"bubble {format_share(self.bubble_fraction)}"
        )
        rows = [["tick", *map(str, range(self.num_ticks))]]
        for d in range(self.num_devices):
            cells = [a.label(single) if a else "." for a in (t[d] for t in self.ticks)]
            rows.append([f"device {d}", *cells])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([header, *lines])

    def __str__(self) -> str:
        return self.to_text()

    def to_csv(self, format: str = "compute_only", path: Any = None) -> str:
        """The schedule in ``torch.distributed.pipelining``'s CSV grammar (what its
        ``_load_csv`` and :func:`pipemark.runtime.schedule_from_csv` read): one row per device,
        one cell per action (``2F0``; ``I`` for a backward whose weight action runs
        apart, ``B`` for a whole one, ``W``; an overlapped pair as
        ``(0F3;3B1)OVERLAP_F_B``) and ``REDUCE_GRAD`` after the action
        :attr:`reduce_grad` names. ``format="compute_only"`` writes an empty cell for
        each idle tick; ``"compute_comms"`` writes no idle cells but each transfer
        between devices (:meth:`crosses`): ``RECV_F`` / ``RECV_B`` right before the
        action that reads it, ``SEND_F`` / ``SEND_B`` right after the one that sends
        it. With ``path``, also writes the text there.

        >>> print(one_f_one_b_schedule(2, 2).to_csv(), end="")
        0F0,0F1,,0B0,,0B1
        ,1F0,1B0,1F1,1B1
        >>> print(one_f_one_b_schedule(2, 1).to_csv("compute_comms"), end="")
        0F0,0SEND_F0,0RECV_B0,0B0
        1RECV_F0,1F0,1B0,1SEND_B0
        """
        if format not in FORMATS:
            raise PipemarkError(
                f"Unknown CSV format {format!r}; choose {' or '.join(map(repr, FORMATS))}."
            )
        rows = [self._csv_row(d, format == "compute_comms") for d in range(self.num_devices)]
        text = write_rows(rows)
        if path is not None:
            with open(path, "w", newline="") as file:
                file.write(text)
        return text

    def _csv_row(self, device: int, comms: bool) -> list[Cell | None]:
        """Device ``device``'s row of :meth:`to_csv`."""
        second = {pair[1] for pair in self.overlapped}
        first = {pair[0]: pair for pair in self.overlapped}
        reductions: dict[int, list[int]] = {}
        for stage, tick in self.reduce_grad:
            if self.stage_devices[stage] == device:
                reductions.setdefault(tick, []).append(stage)
        row: list[Cell | None] = []
        for t, tick in enumerate(self.ticks):
            action = tick[device]
            if action in second:
                pass  # written with the first of its pair
            elif action is None:
                if not comms:
                    row.append(None)
            else:
                unit = first.get(action, (action,))
                row += [self._transfer(a, "RECV") for a in unit if comms and self.crosses(a)[0]]
                cells = tuple(self._compute_cell(a) for a in unit)
                row.append(cells[0] if len(cells) == 1 else Cell(-1, OVERLAP, None, cells))
                row += [self._transfer(a, "SEND") for a in unit if comms and self.crosses(a)[1]]
            if action is not None and action not in first:
                row += [Cell(stage, "REDUCE_GRAD") for stage in reductions.get(t, ())]
        while row and row[-1] is None:
            row.pop()
        return row

    def _compute_cell(self, action: Action) -> Cell:
        if action.kind == FORWARD:
            kind = "F"
        elif action.kind == WEIGHT:
            kind = "W"
        else:
            kind = "I" if action._replace(kind=WEIGHT) in self._finish else "B"
        return Cell(action.stage, kind, action.microbatch)

    @staticmethod
    def _transfer(action: Action, direction: str) -> Cell:
        """``RECV`` / ``SEND`` cell of ``action``'s transfer, named by the stage that
        receives or sends (``F`` for forward values, ``B`` for cotangents)."""
        suffix = "F" if action.kind == FORWARD else "B"
        return Cell(action.stage, f"{direction}_{suffix}", action.microbatch)


def _action_ticks(schedule: Schedule, num_stages: int, m_count: int) -> dict[Action, int]:
    """The tick of each action of ``schedule``, every cell checked (its type, that it
    belongs to this pipeline and to its stage's device, that it runs once)."""
    stage_devices = schedule.stage_devices
    num_devices = len(schedule.ticks[0])
    when: dict[Action, int] = {}
    for t, tick in enumerate(schedule.ticks):
        if len(tick) != num_devices:
            raise StageGraphError(
                f"Tick {t} has {len(tick)} cells but tick 0 has {num_devices}; give every "
                "tick one cell (an Action or None) per device."
            )
        for d, action in enumerate(tick):
            if action is None:
                continue
            if not isinstance(action, Action):
                raise StageGraphError(
                    f"Tick {t}, device {d} holds {action!r}; a cell is an Action or None."
                )
            _check_action(action, f"Tick {t}, device {d}")
            if action.kind not in ACTION_KINDS or not (
                0 <= action.stage < num_stages and 0 <= action.microbatch < m_count
            ):
                raise StageGraphError(
                    f"Tick {t}, device {d}: {action!r} is not an action of this pipeline "
                    f"(stages 0..{num_stages - 1}, microbatches 0..{m_count - 1}, kind "
                    "'forward', 'backward' or 'weight')."
                )
            if stage_devices[action.stage] != d:
                raise StageGraphError(
                    f"Tick {t}: the {action.describe()} runs on device {d}, but stage "
                    f"{action.stage} lives on device {stage_devices[action.stage]}. Move it "
                    "to that device's row."
                )
            if action in when:
                raise StageGraphError(
                    f"The {action.describe()} runs twice, at ticks {when[action]} and {t}; "
                    "remove one."
                )
            when[action] = t
    return when


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_action(action: Any, where: str) -> None:
    """An :class:`Action` whose stage and microbatch are ints (``True`` would pass for
    stage 1, ``0.0`` for stage 0 until it indexed a list) and whose kind is a str."""
    if not isinstance(action, Action):
        raise StageGraphError(f"{where} holds {action!r}; give an Action(stage, microbatch, kind).")
    for name in ("stage", "microbatch"):
        value = getattr(action, name)
        if not _is_index(value):
            raise StageGraphError(
                f"{where}: {action!r} has {name} {value!r} ({type(value).__name__}); "
                f"an Action's {name} is an int."
            )
    if not isinstance(action.kind, str):
        raise StageGraphError(
            f"{where}: {action!r} has kind {action.kind!r}; give 'forward', 'backward' or 'weight'."
        )


def _validate(schedule: Schedule) -> dict[Action, int]:
    """Check a schedule; return the tick at which each action runs."""
    m_count = _check_count(
        schedule.num_microbatches, "num_microbatches", "Split the batch into at least one."
    )
    stage_devices = schedule.stage_devices
    num_stages = len(stage_devices)
    if num_stages == 0:
        raise StageGraphError("A schedule needs at least one stage.")
    if len(schedule.predecessors) != num_stages:
        raise StageGraphError(
            f"The schedule has {num_stages} stage devices but a stage graph of "
            f"{len(schedule.predecessors)} stages; give one predecessor list per stage."
        )
    preds = normalize_stage_graph(dict(enumerate(schedule.predecessors)), num_stages)
    succ = stage_successors(preds)
    if not schedule.ticks:
        raise StageGraphError("The schedule has no ticks; every action must run once.")
    num_devices = len(schedule.ticks[0])
    for j, d in enumerate(stage_devices):
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < num_devices:
            raise StageGraphError(
                f"Stage {j} is placed on device {d!r}, but the schedule has "
                f"{num_devices} devices (0..{num_devices - 1})."
            )
    when = _action_ticks(schedule, num_stages, m_count)
    # A weight action is optional per stage and microbatch: without one, the backward
    # action is the whole backward.
    missing = [
        Action(j, m, k)
        for j in range(num_stages)
        for m in range(m_count)
        for k in (FORWARD, BACKWARD)
        if Action(j, m, k) not in when
    ]
    if missing:
        shown = "; ".join(a.describe() for a in missing[:3])
        raise StageGraphError(
            f"{len(missing)} action(s) never run, e.g. the {shown}. Every stage runs "
            "its forward and its backward once per microbatch (a weight action, where "
            "the backward is split, after the backward)."
        )
    for action, t in when.items():
        for need in dependencies(action, preds, succ):
            if when[need] >= t:
                raise StageGraphError(
                    f"Tick {t}: the {action.describe()} runs before the {need.describe()} "
                    f"(tick {when[need]}) has finished, but reads its results. Move it to "
                    f"tick {when[need] + 1} or later (or build the schedule with "
                    "schedule_from_orders, which places each action once its inputs are "
                    "ready)."
                )
    _check_overlapped(schedule, when, preds, succ)
    _check_reduce_grad(schedule, when)
    return when


def _check_overlapped(
    schedule: Schedule,
    when: Mapping[Action, int],
    preds: Sequence[Sequence[int]],
    succ: Sequence[Sequence[int]],
) -> None:
    """Each overlapped pair is a forward and then a backward of one device on adjacent
    ticks, neither reading the other, the backward's inputs ready before the forward's
    tick (so the pair can start as one unit), and no action is in two pairs."""
    paired: set[Action] = set()
    for pair in schedule.overlapped:
        if len(pair) != 2 or not all(isinstance(a, Action) and a in when for a in pair):
            raise StageGraphError(
                f"Overlapped pair {pair!r} is not two actions of this schedule; give "
                "(forward, backward) Actions that it runs."
            )
        first, second = pair
        what = f"The overlapped pair ({first.describe()}; {second.describe()})"
        if first.kind != FORWARD or second.kind != BACKWARD:
            raise StageGraphError(f"{what} is not a forward and then a backward.")
        if paired & set(pair):
            raise StageGraphError(f"{what} shares an action with another pair.")
        paired.update(pair)
        t = when[first]
        if (
            when[second] != t + 1
            or schedule.stage_devices[first.stage] != (schedule.stage_devices[second.stage])
        ):
            raise StageGraphError(
                f"{what} runs at ticks {t} and {when[second]}; an overlapped pair runs on "
                "one device, the backward at the tick after the forward."
            )
        late = [n for n in dependencies(second, preds, succ) if when[n] >= t]
        if late:
            raise StageGraphError(
                f"{what}: the backward reads the {late[0].describe()} (tick "
                f"{when[late[0]]}), which is not done before the pair starts at tick {t}; "
                "a pair runs as one unit once everything both read is ready."
            )


def _check_reduce_grad(schedule: Schedule, when: Mapping[Action, int]) -> None:
    """Each ``(stage, tick)`` of :attr:`Schedule.reduce_grad` names a stage once and a
    tick where the stage's device runs an action (not the first of an overlapped pair),
    at or after every backward and weight action of that stage."""
    seen: set[int] = set()
    firsts = {pair[0] for pair in schedule.overlapped}
    for entry in schedule.reduce_grad:
        stage, tick = entry if len(entry) == 2 else (None, None)
        if not (_is_index(stage) and 0 <= stage < schedule.num_stages) or stage in seen:
            raise StageGraphError(
                f"reduce_grad entry {entry!r}: give (stage, tick) once per stage, with a "
                f"stage in 0..{schedule.num_stages - 1}."
            )
        seen.add(stage)
        device = schedule.stage_devices[stage]
        cell = schedule.ticks[tick][device] if _is_index(tick) and 0 <= tick < len(
            schedule.ticks
        ) else None  # fmt: skip
        if cell is None or cell in firsts:
            raise StageGraphError(
                f"The gradients of stage {stage} are reduced after tick {tick!r}, where "
                f"device {device} runs no action that ends a unit; name the tick of the "
                "action the reduction follows."
            )
        last = max(t for a, t in when.items() if a.stage == stage and a.kind != FORWARD)
        if tick < last:
            raise StageGraphError(
                f"The gradients of stage {stage} are reduced after tick {tick}, before its "
                f"last backward or weight action (tick {last}); reduce them after it."
            )


# ------------------------------------------------------------------------- builders


def schedule_from_orders(
    orders: Sequence[Sequence[Action]],
    *,
    stage_devices: Sequence[int],
    num_microbatches: int,
    stage_graph: Any = None,
    name: str = "custom",
    overlapped: Sequence[tuple[Action, Action]] = (),
    earliest: Mapping[Action, int] | None = None,
) -> Schedule:
    """Place each device's actions, in the given order, at the first tick where
    everything they need has run (and not before ``earliest[action]``, where given).
    Each ``overlapped`` pair (a forward and then a backward, adjacent in one device's
    order) runs as one unit: the forward waits until the backward's inputs are ready
    too, and the backward follows at the next tick (:attr:`Schedule.overlapped`).

    Raises :class:`StageGraphError` when the orders deadlock (each blocked device waits
    for an action queued behind another blocked one), naming the blocked actions.

    >>> F, B = "forward", "backward"
    >>> s = schedule_from_orders(
    ...     [[Action(0, 0, F), Action(0, 0, B)], [Action(1, 0, F), Action(1, 0, B)]],
    ...     stage_devices=(0, 1), num_microbatches=1)
    >>> s.num_ticks, s.bubble_fraction
    (4, 0.5)
    """
    num_stages = len(stage_devices)
    preds = normalize_stage_graph(stage_graph, num_stages)
    succ = stage_successors(preds)
    queues = [list(o) for o in orders]
    for d, queue in enumerate(queues):
        for i, action in enumerate(queue):
            _check_action(action, f"orders[{d}][{i}]")
            if action.kind not in ACTION_KINDS or not 0 <= action.stage < num_stages:
                raise StageGraphError(
                    f"orders[{d}][{i}]: {action!r} is not an action of this pipeline "
                    f"(stages 0..{num_stages - 1}, kind 'forward', 'backward' or 'weight')."
                )
    position = [0] * len(queues)
    finished: dict[Action, int] = {}
    ticks: list[tuple[Action | None, ...]] = []
    remaining = sum(len(q) for q in queues)
    partner = dict(tuple(pair) for pair in overlapped)  # first -> second
    earliest = earliest or {}

    def ready(action: Action, t: int, unit: Action | None = None) -> bool:
        needs = dependencies(action, preds, succ)
        return all(finished.get(n, t) < t for n in needs if n != unit)

    while remaining:
        t = len(ticks)
        tick: list[Action | None] = [None] * len(queues)
        for d, queue in enumerate(queues):
            if position[d] == len(queue):
                continue
            action = queue[position[d]]
            if earliest.get(action, 0) > t or not ready(action, t):
                continue
            if action not in partner or ready(partner[action], t, action):
                tick[d] = action
        if not any(tick) and any(
            earliest.get(q[position[d]], 0) > t
            for d, q in enumerate(queues)
            if position[d] < len(q)
        ):
            ticks.append(tuple(tick))  # an idle tick the orders ask for
            continue
        if not any(tick):
            blocked = [
                f"device {d} waits to run the {q[position[d]].describe()}"
                for d, q in enumerate(queues)
                if position[d] < len(q)
            ]
            raise StageGraphError(
                f"The device orders deadlock at tick {t}: {'; '.join(blocked)}. Reorder "
                "the actions so that each one's inputs are produced earlier in some "
                "device's order."
            )
        for d, action in enumerate(tick):
            if action is not None:
                finished[action] = t
                position[d] += 1
                remaining -= 1
        ticks.append(tuple(tick))
    return Schedule(
        name,
        num_microbatches,
        tuple(stage_devices),
        preds,
        tuple(ticks),
        tuple(tuple(pair) for pair in overlapped),
    )


def in_waves(waves: Sequence[Schedule], name: str | None = None) -> Schedule:
    """One schedule that runs ``waves`` one after another on each device: the
    microbatches of each wave numbered after the previous wave's. Every device runs all
    of one wave's actions before any of the next's, so a device holds no more
    microbatches at once than in the wave that holds the most
    (:meth:`Schedule.in_flight`); where a device would wait between waves, the next
    wave's first actions fill in (each action is placed at the first tick its inputs
    are ready, as :func:`schedule_from_orders` places them). This is how
    ``microbatches_in_flight`` bounds a schedule's memory: 8 microbatches of GPipe on
    two devices in waves of 2 hold 2 at once instead of 8, and take 24 ticks instead
    of 18 (each wave fills and drains the pipeline).

    >>> waves = in_waves([gpipe_schedule(2, 2)] * 4)
    >>> waves.num_microbatches, waves.in_flight(), waves.num_ticks
    (8, (2, 2), 24)
    >>> gpipe_schedule(2, 8).in_flight(), gpipe_schedule(2, 8).num_ticks
    ((8, 8), 18)
    """
    if not waves:
        raise PipemarkError("in_waves needs at least one schedule.")
    first = waves[0]
    orders: list[list[Action]] = [[] for _ in range(first.num_devices)]
    overlapped: list[tuple[Action, ...]] = []
    start = 0
    for wave in waves:
        if wave.stage_devices != first.stage_devices or wave.predecessors != first.predecessors:
            raise PipemarkError(
                f"in_waves: the schedule {wave.name!r} places its stages on devices "
                f"{wave.stage_devices} (stage graph {_edges_text(wave.predecessors)}), "
                f"but {first.name!r} on {first.stage_devices} "
                f"({_edges_text(first.predecessors)}); build every wave for one pipeline."
            )
        for d, order in enumerate(wave.device_orders()):
            orders[d] += [a._replace(microbatch=a.microbatch + start) for a in order]
        overlapped += [
            tuple(a._replace(microbatch=a.microbatch + start) for a in pair)
            for pair in wave.overlapped
        ]
        start += wave.num_microbatches
    return schedule_from_orders(
        orders,
        stage_devices=first.stage_devices,
        num_microbatches=start,
        stage_graph=first.stage_graph,
        name=name or first.name,
        overlapped=overlapped,
    )


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    _check_count(num_stages, "num_stages", "Give the number of pipeline stages.")
    _check_count(
        num_microbatches, "num_microbatches", "Split the batch into at least one microbatch."
    )


def gpipe_schedule(num_stages: int, num_microbatches: int, *, stage_graph: Any = None) -> Schedule:
    """GPipe: every device runs all its forwards, then all its backwards. Stage ``j`` on
    device ``j``. Peak memory: every microbatch's residuals live at once.

    >>> print(gpipe_schedule(2, 2))
    gpipe: 2 stages, 2 microbatches, 2 devices, 6 ticks, bubble 33.3 %
    tick      0   1   2   3   4   5
    device 0  F0  F1  .   .   B0  B1
    device 1  .   F0  F1  B0  B1  .
    """
    _check_sizes(num_stages, num_microbatches)
    m = range(num_microbatches)
    orders = [
        [Action(j, i, FORWARD) for i in m] + [Action(j, i, BACKWARD) for i in m]
        for j in range(num_stages)
    ]
    return schedule_from_orders(
        orders,
        stage_devices=tuple(range(num_stages)),
        num_microbatches=num_microbatches,
        stage_graph=stage_graph,
        name="gpipe",
    )


def one_f_one_b_schedule(
    num_stages: int,
    num_microbatches: int,
    *,
    stage_graph: Any = None,
    extra_in_flight: int = 0,
) -> Schedule:
    """1F1B: after a warm-up of forwards, each device alternates one forward and one
    backward, so at most ``depth + 1`` microbatches' residuals are alive on it (``depth``
    is the longest path from the stage to the last one: ``S - 1 - j`` on a chain). Same
    bubble as GPipe, far less memory. Stage ``j`` on device ``j``.

    >>> print(one_f_one_b_schedule(3, 4))
    1f1b: 3 stages, 4 microbatches, 3 devices, 12 ticks, bubble 33.3 %
    tick      0   1   2   3   4   5   6   7   8   9   10  11
    device 0  F0  F1  F2  .   .   B0  F3  B1  .   B2  .   B3
    device 1  .   F0  F1  .   B0  F2  B1  F3  B2  .   B3  .
    device 2  .   .   F0  B0  F1  B1  F2  B2  F3  B3  .   .

    ``extra_in_flight`` more forwards in the warm-up of every stage but the last ones
    (each holding one more microbatch's residuals) hide the latency of transfers
    between devices. In plain 1F1B, device ``j``'s forward of microbatch ``m`` follows
    its backward of ``m - depth - 1``, whose cotangent comes from device ``j + 1``, so
    each microbatch waits for a transfer each way; with one more forward in flight the
    transfers run while the devices compute (``simulate_schedule(..., transfer=t)``
    shows it):

    >>> from pipemark.runtime.schedules.simulation import simulate_schedule
    >>> costs = {"forward": 1.0, "backward": 2.0}
    >>> [simulate_schedule(one_f_one_b_schedule(2, 8, extra_in_flight=k), costs,
    ...                    transfer=1.0).makespan for k in (0, 1)]  # 36 without transfers
    [44.0, 38.0]
    """
    _check_sizes(num_stages, num_microbatches)
    if (
        isinstance(extra_in_flight, bool)
        or not isinstance(extra_in_flight, int)
        or extra_in_flight < 0
    ):
        raise PipemarkError(
            f"extra_in_flight must be an int >= 0, got {extra_in_flight!r} (0 is plain "
            "1F1B; 1 hides the latency of transfers between devices)."
        )
    preds = normalize_stage_graph(stage_graph, num_stages)
    depth = _depth_to_sink(preds)
    orders = []
    for j in range(num_stages):
        warmup = min(depth[j] + extra_in_flight if depth[j] else 0, num_microbatches)
        order = [Action(j, i, FORWARD) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [Action(j, warmup + i, FORWARD), Action(j, i, BACKWARD)]
        order += [
            Action(j, i, BACKWARD) for i in range(num_microbatches - warmup, num_microbatches)
        ]
        orders.append(order)
    return schedule_from_orders(
        orders,
        stage_devices=tuple(range(num_stages)),
        num_microbatches=num_microbatches,
        stage_graph=dict(enumerate(preds)),
        name="1f1b",
    )


def interleaved_schedule(
    num_stages: int,
    num_microbatches: int,
    *,
    num_devices: int,
    stage_graph: Any = None,
) -> Schedule:
    """Interleaved 1F1B: ``num_stages = v * num_devices`` stages, stage ``j`` on device
    ``j % num_devices``, so each device holds ``v`` non-adjacent stages (model chunks)
    and the bubble shrinks by about ``v``. Microbatches enter in groups of
    ``num_devices``; each device runs a group through one chunk, then through the next.

    ``num_microbatches`` must be a multiple of ``num_devices`` (else the groups cannot
    rotate through the chunks without stalling).

    >>> s = interleaved_schedule(4, 4, num_devices=2)
    >>> s.num_ticks, s.stage_devices
    (18, (0, 1, 0, 1))
    """
    _check_sizes(num_stages, num_microbatches)
    _check_count(num_devices, "num_devices", "Give the number of devices.")
    if num_stages % num_devices:
        raise PipemarkError(
            f"An interleaved schedule puts the same number of stages on every device, but "
            f"{num_stages} stages do not divide over {num_devices} devices. Use a multiple "
            f"of {num_devices} stages (num_stages={num_devices * -(-num_stages // num_devices)})."
        )
    if num_microbatches % num_devices:
        raise PipemarkError(
            f"An interleaved schedule sends microbatches in groups of num_devices "
            f"({num_devices}), but num_microbatches={num_microbatches} is not a multiple of "
            f"it. Use {num_devices * -(-num_microbatches // num_devices)} microbatches, or "
            "the '1f1b' schedule."
        )
    chunks = num_stages // num_devices
    total = chunks * num_microbatches

    def forward(d: int, k: int) -> Action:
        group, within = divmod(k, num_devices * chunks)
        chunk, lane = divmod(within, num_devices)
        return Action(chunk * num_devices + d, group * num_devices + lane, FORWARD)

    def backward(d: int, k: int) -> Action:
        group, within = divmod(k, num_devices * chunks)
        chunk, lane = divmod(within, num_devices)
        return Action((chunks - 1 - chunk) * num_devices + d, group * num_devices + lane, BACKWARD)

    orders = []
    for d in range(num_devices):
        warmup = min((num_devices - d - 1) * 2 + (chunks - 1) * num_devices, total)
        order = [forward(d, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(d, warmup + k), backward(d, k)]
        order += [backward(d, k) for k in range(total - warmup, total)]
        orders.append(order)
    return schedule_from_orders(
        orders,
        stage_devices=tuple(j % num_devices for j in range(num_stages)),
        num_microbatches=num_microbatches,
        stage_graph=stage_graph,
        name="interleaved",
    )


def check_schedule_fits(
    schedule: Schedule, num_stages: int, num_microbatches: int, stage_graph: Any = None
) -> Schedule:
    """``schedule`` on a pipeline of ``num_stages`` stages, ``num_microbatches``
    microbatches and the stage graph ``stage_graph`` (``None``: a chain): the same
    actions at the same ticks, with the pipeline's graph, so that what is derived from
    the graph (the transfers, the simulation, the programs fused) is the pipeline's
    (``schedule`` itself where the graphs are equal).

    A schedule built for another graph fits where its order meets every dependency of
    the pipeline's (the module docstring lists them): one built for a chain fits a
    pipeline whose last stage also reads the first (tied embeddings: edge 0->3), since
    the chain runs stage 0's forward before stage 3's and stage 3's backward before
    stage 0's. A :class:`PipemarkError` for other sizes; a :class:`StageGraphError`
    naming the edge and the first action that would run before a value it reads.

    >>> fitted = check_schedule_fits(gpipe_schedule(4, 2), 4, 2, [(0, 1), (1, 2), (2, 3), (0, 3)])
    >>> fitted.stage_graph[3], fitted.ticks == gpipe_schedule(4, 2).ticks
    ((0, 2), True)
    """
    if schedule.num_stages != num_stages or schedule.num_microbatches != num_microbatches:
        raise PipemarkError(
            f"The schedule {schedule.name!r} is for {schedule.num_stages} stages and "
            f"{schedule.num_microbatches} microbatches, but the pipeline has {num_stages} "
            f"stages and {num_microbatches} microbatches. Build it for these sizes."
        )
    preds = normalize_stage_graph(stage_graph, num_stages)
    if schedule.predecessors == preds:
        return schedule
    unmet = _first_unmet(schedule, preds)
    if unmet is not None:
        raise _unmet_error(schedule, preds, *unmet)
    return dataclasses.replace(schedule, predecessors=preds)


def _first_unmet(
    schedule: Schedule, preds: Sequence[Sequence[int]]
) -> tuple[Action, int, Action] | None:
    """The first action of ``schedule`` (in dispatch order) that would run before a
    value it reads on the stage graph ``preds``, the tick it reads its inputs at (the
    backward of an overlapped pair reads them when the pair starts, at its forward's
    tick) and the action of that value; ``None`` when every action runs after what it
    reads."""
    succ = stage_successors(preds)
    when = schedule._finish
    starts = {second: when[first] for first, second in schedule.overlapped}
    for t, _, action in schedule.actions():
        start = starts.get(action, t)
        for need in dependencies(action, preds, succ):
            if when[need] >= start:
                return action, start, need
    return None


def _unmet_error(
    schedule: Schedule, preds: Sequence[Sequence[int]], action: Action, start: int, need: Action
) -> StageGraphError:
    """The error of :func:`check_schedule_fits` for ``action``, which reads its inputs
    at tick ``start``, before ``need``, whose values it reads on the stage graph
    ``preds``, has run."""
    if action.kind == FORWARD:
        source, target = need.stage, action.stage
        reads = f"the forward of stage {target} reads the outputs of stage {source}"
    else:
        source, target = action.stage, need.stage
        reads = f"the backward of stage {source} reads the cotangents stage {target} sends back"
    paired = start != schedule._finish[action]
    return StageGraphError(
        f"The schedule {schedule.name!r} runs {action.label()} (the {action.describe()}) "
        f"at tick {start}{' in an overlapped pair' if paired else ''}, before "
        f"{need.label()} (the {need.describe()}, tick {schedule._finish[need]}) has "
        f"finished, but the pipeline's stage graph has the edge {source}->{target}: "
        f"{reads}. The "
        f"schedule was built for the stage graph {_edges_text(schedule.predecessors)}, "
        f"the pipeline's is {_edges_text(preds)}. Order {need.label()} before "
        f"{action.label()}, or build the schedule with stage_graph="
        f"{dict(enumerate(preds))} (schedule_from_orders and schedule_from_csv place each "
        "action once what it reads is ready)."
    )


def _edges_text(preds: Iterable[Iterable[int]]) -> str:
    edges = [f"{p}->{j}" for j, ps in enumerate(preds) for p in ps]
    return "{" + ", ".join(edges) + "}"
