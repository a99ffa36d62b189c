"""A plan's actions resolved once, when it is built: :func:`resolve_steps`.

For each worker, the :class:`Step` objects it runs, in run order: which stage program,
for which microbatch, where each input comes from (a parameter leaf, a batch leaf, or
an output of another stage for the same microbatch) and which workers read each of its
outputs. Under ``jax.distributed`` also the transfers between this process and the
others, in the one global order every process walks (:attr:`Steps.transfers`).
:func:`fuse_steps` then folds a forward step into the backward step that follows it on
its worker, for the same pipeline stage and microbatch, when no other stage reads the
forward's outputs (one stage; the last stage of 1F1B): the pair runs as one program
(:func:`pipemark.runtime.compilation.compile_fused`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from pipemark.runtime.compilation import EXTRA, Unit, fused_wiring
from pipemark.runtime.placement import Placement
from pipemark.runtime.schedules import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from pipemark.staged import StagedJaxpr

__all__ = [
    "BATCH",
    "PARAM",
    "STAGE",
    "Gather",
    "Step",
    "Steps",
    "Transfer",
    "fuse_steps",
    "program_name",
    "resolve_steps",
    "step_name",
    "without_gathers",
]

#: Where a step's input comes from (the first item of each entry of :attr:`Step.inputs`).
PARAM, BATCH, STAGE = 0, 1, 2

#: A value handed between stages: ``(microbatch, stage index, output index)``.
Key = tuple[int, int, int]

#: One transfer between processes: ``(producer worker, reader worker, keys, types)``,
#: the values ``keys`` of ``(shape, dtype)`` ``types`` in one collective.
Transfer = tuple[int, int, tuple[Key, ...], tuple]


class Gather(NamedTuple):
    """The accumulated results (loss, gradients) of stage ``index``, sent by its
    worker's process to every other process once its last action is dispatched."""

    worker: int
    index: int
    types: tuple  # the results' (shape, dtype)
    receivers: tuple[tuple[int, Any], ...]  # (process, receiving device), the others


class Step(NamedTuple):
    """One action with everything resolved that does not change between calls."""

    index: int  # sliced stage
    microbatch: int
    action: Action  # the schedule's action it runs
    accumulate: bool
    # (PARAM, leaf) | (BATCH, leaf) | (STAGE, (microbatch, stage, output))
    inputs: tuple[tuple[int, Any], ...]
    # per passed output: (its position among the program's passed outputs, its key, and
    # how many readers each worker has: ((worker, count), ...))
    sends: tuple[tuple[int, Key, tuple[tuple[int, int], ...]], ...]
    # A fused step (fuse_steps): the forward stage whose program runs first, in one
    # program with this backward stage's; its inputs come first in ``inputs``.
    fused: int | None = None


class Steps(NamedTuple):
    """A plan's actions resolved once: per worker, its steps in run order, and the
    parameter and batch leaves it reads."""

    columns: tuple[tuple[Step, ...], ...]
    serial: tuple[tuple[int, Step], ...]  # (worker, step) in schedule order
    params: tuple[tuple[int, ...], ...]  # per worker: parameter leaves it reads
    batch: tuple[tuple[int, ...], ...]  # per worker: batch leaves it reads
    num_actions: int  # the schedule's actions (a fused step is two)
    readers: dict[tuple[int, int], dict[int, int]]  # stage output -> {worker: readers}
    # Under jax.distributed: the transfers this process is an end of, in the global
    # order, as (producer worker, reader worker, the keys it sends, their (shape,
    # dtype)), and each stage's results gathered after its last action; empty in one
    # process.
    transfers: tuple[Transfer | Gather, ...]
    # Under jax.distributed, per worker: {position in its column: stage index} of the
    # actions after which a stage's results are final; empty in one process.
    finals: tuple[dict[int, tuple[int, ...]], ...]

    @property
    def num_programs(self) -> int:
        """How many programs a call dispatches (fewer than actions where steps are fused)."""
        return len(self.serial)


def resolve_steps(
    staged: StagedJaxpr,
    schedule: Schedule,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
    placement: Placement,
    num_params: int,
) -> Steps:
    """The steps of ``schedule`` over ``staged``'s stage programs: ``roles[kind][k]`` is
    the stage index of pipeline stage ``k``'s ``kind`` (forward, backward, weight)
    program, ``None`` where it has none."""
    num_workers = len(placement.slots)
    readers: dict[tuple[int, int], dict[int, int]] = {}  # readers per worker
    for c, stage in enumerate(staged.stages):
        if c in units:
            for ref in stage.inputs:
                if ref.kind == "stage":
                    per = readers.setdefault((ref.stage, ref.index), {})
                    per[units[c].worker] = per.get(units[c].worker, 0) + 1
    columns: list[list[Step]] = [[] for _ in range(num_workers)]
    serial: list[tuple[int, Step]] = []
    params: list[set[int]] = [set() for _ in range(num_workers)]
    batch: list[set[int]] = [set() for _ in range(num_workers)]
    for _, _, action in schedule.actions():
        index = roles[action.kind][action.stage]
        if index is None:  # a stage without a backward (or weight) program
            continue
        unit, m = units[index], action.microbatch
        w = unit.worker
        inputs = []
        for ref in staged.stages[index].inputs:
            if ref.kind == "input" and ref.index < num_params:
                inputs.append((PARAM, ref.index))
                params[w].add(ref.index)
            elif ref.kind == "input":
                inputs.append((BATCH, ref.index - num_params))
                batch[w].add(ref.index - num_params)
            else:
                inputs.append((STAGE, (m, ref.stage, ref.index)))
        sends = tuple(
            (position, (m, index, o), tuple(sorted(readers[(index, o)].items())))
            for position, o in enumerate(unit.passed)
        )
        step = Step(index, m, action, bool(unit.accumulated), tuple(inputs), sends)
        columns[w].append(step)
        serial.append((w, step))
    return Steps(
        columns=tuple(tuple(c) for c in columns),
        serial=tuple(serial),
        params=tuple(tuple(sorted(p)) for p in params),
        batch=tuple(tuple(sorted(b)) for b in batch),
        num_actions=len(serial),
        readers=readers,
        transfers=_transfers(serial, units, placement, staged),
        finals=_finals(columns, units, placement),
    )


def fuse_steps(
    steps: Steps,
    staged: StagedJaxpr,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
    placement: Placement,
) -> tuple[Steps, dict[int, int]]:
    """``steps`` with each forward step folded into the backward step right after it in
    its worker's column, when both are the same pipeline stage's for the same
    microbatch and no stage other than that backward reads the forward's outputs (so
    nothing waits for them, and they need not leave the program). The fused step takes
    the backward's place in the global order. Returns the steps and the stage pairs
    fused, ``{backward index: forward index}``, for which a fused program is needed.

    With one stage, every forward is fused with its backward under 1F1B; with several,
    the last stage's are (the others pass their outputs on); under a zero-bubble
    schedule none are (the weight-gradient step reads the forward's outputs too).
    """
    pairs = _fusable_pairs(staged, roles)
    fused_steps: dict[int, Step] = {}  # id of a backward step -> its fused step
    folded: set[int] = set()  # ids of the forward steps folded into one
    for column in steps.columns:
        for first, second in itertools.pairwise(column):
            if (
                pairs.get(second.index) == first.index
                and first.microbatch == second.microbatch
                and id(first) not in folded
            ):
                folded.add(id(first))
                fused_steps[id(second)] = _fused_step(first, second)
    if not fused_steps:
        return steps, {}
    columns = tuple(
        tuple(fused_steps.get(id(s), s) for s in column if id(s) not in folded)
        for column in steps.columns
    )
    serial = tuple((w, fused_steps.get(id(s), s)) for w, s in steps.serial if id(s) not in folded)
    used = {s.index: s.fused for s in fused_steps.values()}
    return (
        steps._replace(
            columns=columns,
            serial=serial,
            transfers=_transfers(list(serial), units, placement, staged),
            finals=_finals([list(c) for c in columns], units, placement),
        ),
        used,
    )


def _fusable_pairs(
    staged: StagedJaxpr, roles: Mapping[str, Sequence[int | None]]
) -> dict[int, int]:
    """``{backward index: forward index}`` of the pipeline stages whose forward outputs
    only their backward reads."""
    read_by: dict[int, set[int]] = {}  # stage -> the stages reading its outputs
    for c, stage in enumerate(staged.stages):
        for ref in stage.inputs:
            if ref.kind == "stage":
                read_by.setdefault(ref.stage, set()).add(c)
    pairs = {}
    for forward, backward in zip(roles[FORWARD], roles[BACKWARD]):
        if backward is not None and read_by.get(forward, set()) <= {backward}:
            pairs[backward] = forward
    return pairs


def without_gathers(steps: Steps) -> Steps:
    """``steps`` without sending each stage's results to the other processes once final
    (:class:`Gather`): each process keeps its own stages' results
    (``PipelineOptions(gather_results=False)``)."""
    return steps._replace(
        transfers=tuple(t for t in steps.transfers if not isinstance(t, Gather)),
        finals=tuple({} for _ in steps.finals),
    )


def _fused_step(forward: Step, backward: Step) -> Step:
    """The step running ``forward`` and then ``backward`` as one program: the forward's
    inputs, then the backward's that are neither the forward's outputs nor its inputs
    (:func:`~pipemark.runtime.compilation.fused_wiring`)."""
    here = (forward.microbatch, forward.index)
    wiring = fused_wiring(
        forward.inputs,
        backward.inputs,
        lambda entry: entry[1][2] if entry[0] == STAGE and entry[1][:2] == here else None,
        lambda entry: entry[0] != STAGE,
    )
    extra = tuple(entry for entry, (kind, _) in zip(backward.inputs, wiring) if kind == EXTRA)
    return backward._replace(
        accumulate=forward.accumulate or backward.accumulate,
        inputs=forward.inputs + extra,
        fused=forward.index,
    )


def _transfers(
    serial: list[tuple[int, Step]],
    units: Mapping[int, Unit],
    placement: Placement,
    staged: StagedJaxpr,
) -> tuple[Transfer | Gather, ...]:
    """The transfers this process is an end of, in the global order: before each action
    (in the schedule's order), the values it reads from workers of other processes that
    no earlier action on its worker received, one transfer per producer; after a
    stage's last action, its results to every other process. Every process derives the
    same order from the same schedule, so the two ends of each collective meet (gloo
    hangs or aborts otherwise)."""
    if not placement.distributed:
        return ()
    process = [slot.process for slot in placement.slots]
    last = {
        index: n
        for n, (_, step) in enumerate(serial)
        for index in _stages_of(step)
        if units[index].accumulated
    }
    receivers = placement.receivers()
    moved: set[tuple[Key, int]] = set()
    transfers: list[Transfer | Gather] = []
    for n, (worker, step) in enumerate(serial):
        per_producer: dict[int, list[Key]] = {}
        for source, key in step.inputs:
            if source != STAGE or (key, worker) in moved:
                continue
            producer = units[key[1]].worker
            if process[producer] != process[worker]:
                moved.add((key, worker))
                per_producer.setdefault(producer, []).append(key)
        for p, keys in per_producer.items():
            if placement.process not in (process[p], process[worker]):
                continue  # between two other processes
            types = tuple(_passed_type(staged, placement, p, i, o) for _, i, o in keys)
            transfers.append((p, worker, tuple(keys), types))
        for index in _stages_of(step):
            if last.get(index) != n:
                continue
            out_avals = staged.stages[index].out_avals
            types = tuple(value_type(out_avals[o]) for _, o in units[index].accumulated)
            others = tuple((q, d) for q, d in receivers.items() if q != process[worker])
            transfers.append(Gather(worker, index, types, others))
    return tuple(transfers)


def _finals(
    columns: list[list[Step]], units: Mapping[int, Unit], placement: Placement
) -> tuple[dict[int, tuple[int, ...]], ...]:
    """Per worker, {position in its column: stage indices} of the last action of each
    stage with results (two for a fused step), which other processes receive once it
    is dispatched."""
    if not placement.distributed:
        return tuple({} for _ in columns)
    finals = []
    for column in columns:
        last = {
            index: n
            for n, step in enumerate(column)
            for index in _stages_of(step)
            if units[index].accumulated
        }
        per: dict[int, list[int]] = {}
        for index, n in last.items():
            per.setdefault(n, []).append(index)
        finals.append({n: tuple(indices) for n, indices in per.items()})
    return tuple(finals)


def program_name(step: Step, stage_names: Sequence[str]) -> str:
    """The name of the program ``step`` runs: its stage's, ``"<forward>+<backward>"``
    for a forward and backward fused into one (:func:`fuse_steps`)."""
    name = stage_names[step.index]
    return name if step.fused is None else f"{stage_names[step.fused]}+{name}"


def step_name(step: Step, stage_names: Sequence[str]) -> str:
    """What profilers and traces call ``step``: its stage's name (a fused step's two,
    joined by ``+``) and its microbatch; a split backward's weight half says so.

    >>> from pipemark.runtime.schedules import Action
    >>> step = Step(1, 2, Action(0, 2, "backward"), True, (), ())
    >>> step_name(step, ["layer0", "layer0_backward"])
    'layer0_backward mb2'
    >>> step_name(step._replace(fused=0), ["layer0", "layer0_backward"])
    'layer0+layer0_backward mb2'
    """
    # Once per action a call dispatches: kept to a few string operations.
    name = program_name(step, stage_names)
    if step.action.kind == WEIGHT:
        return f"{name} (weight) mb{step.microbatch}"
    return f"{name} mb{step.microbatch}"


def _stages_of(step: Step) -> tuple[int, ...]:
    """The stages a step runs: its own, and the forward folded into it (fused)."""
    return (step.index,) if step.fused is None else (step.fused, step.index)


def _passed_type(
    staged: Any, placement: Placement, worker: int, index: int, output: int
) -> tuple[tuple[int, ...], Any]:
    """The ``(shape, dtype)`` of output ``output`` of stage ``index`` as it leaves
    worker ``worker``: with data-parallel replicas, a leading replica axis."""
    shape, dtype = value_type(staged.stages[index].out_avals[output])
    replicas = placement.slots[worker].replicas
    return ((replicas, *shape) if replicas > 1 else shape), dtype


def value_type(aval: Any) -> tuple[tuple[int, ...], Any]:
    """An abstract value's ``(shape, dtype)``."""
    return tuple(aval.shape), np.dtype(aval.dtype)
