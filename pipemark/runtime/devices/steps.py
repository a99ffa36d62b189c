"""A plan's actions resolved once, when it is built: :func:`resolve_steps`.

For each worker, the :class:`Step` objects it runs, in run order: which stage program,
for which microbatch, where each input comes from (a parameter leaf, a batch leaf of a
microbatch, or an output of another stage for the same microbatch) and which workers
read each of its outputs. Under ``jax.distributed`` also the transfers between this
process and the others, in the one global order every process walks
(:attr:`Steps.transfers`), and that order with the steps in it (:attr:`Steps.order`).

Some steps run several stage programs as one (a *fused* step, one program:
:func:`pipemark.runtime.devices.compilation.compile_fused`): the schedule's overlapped pairs
(:attr:`pipemark.runtime.Schedule.overlapped`), a whole backward where the plan split
the stage's backward into B and W for other microbatches (the two halves in one
program), by :func:`fuse_steps`, a forward with the backward right after it on its
worker for the same pipeline stage and microbatch when no other stage reads the
forward's outputs (one stage; the last stage of 1F1B), and, by :func:`fuse_runs`, runs
of a worker's consecutive steps that no other worker waits for
(``PipelineOptions.fuse_actions``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from pipemark.runtime.devices.compilation import ARGUMENT, Combined, Unit
from pipemark.runtime.devices.placement import Placement
from pipemark.runtime.schedules.core import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from pipemark.staged import StagedJaxpr

__all__ = [
    "BATCH",
    "PARAM",
    "STAGE",
    "TRANSFER",
    "Gather",
    "Reduce",
    "Step",
    "Steps",
    "Transfer",
    "fuse_group",
    "fuse_runs",
    "fuse_steps",
    "place_reductions",
    "program_name",
    "resolve_steps",
    "step_name",
    "without_gathers",
]

#: Where a step's input comes from (the first item of each entry of :attr:`Step.inputs`):
#: ``(PARAM, leaf)``, ``(BATCH, (leaf, microbatch))``, ``(STAGE, key)``.
PARAM, BATCH, STAGE = 0, 1, 2

#: The worker of a transfer's entries in :attr:`Steps.order`.
TRANSFER = -1

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


class Reduce(NamedTuple):
    """The accumulators of stage ``index``, whose sub-mesh spans processes, reduced over
    its data-parallel replicas by the transfer thread at this place in the global
    order (the reduction is a collective between those processes); handed over by its
    worker after the step named in :attr:`Steps.handed`. ``gathered``: its results
    then go to the other processes (:class:`Gather`), whole on each of its devices."""

    worker: int
    index: int
    gathered: bool


class Step(NamedTuple):
    """One action with everything resolved that does not change between calls."""

    index: int  # sliced stage
    microbatch: int
    action: Action  # the schedule's action it runs
    accumulate: bool
    # (PARAM, leaf) | (BATCH, (leaf, microbatch)) | (STAGE, (microbatch, stage, output))
    inputs: tuple[tuple[int, Any], ...]
    # per passed output: (its position among the program's passed outputs, its key, and
    # how many readers each worker has: ((worker, count), ...))
    sends: tuple[tuple[int, Key, tuple[tuple[int, int], ...]], ...]
    # A fused step: the stage programs it runs as one (plan.fused[step.fused]); its
    # index, microbatch and action are its last part's. None: its own stage's program.
    fused: Combined | None = None
    # A fused step's parts, each the step it would be alone, in program order.
    parts: tuple[Step, ...] = ()
    # The schedule's tick of its action (a fused step's first part's).
    tick: int = -1


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
    # dtype)), then each stage's results gathered to the other processes; empty in one
    # process.
    transfers: tuple[Transfer | Gather | Reduce, ...]
    # Under jax.distributed, per worker: {position in its column: stage index} of the
    # actions after which a stage's results are final; empty in one process.
    finals: tuple[dict[int, tuple[int, ...]], ...]
    # Per worker, {position in its column: stage indices} reduced over their
    # data-parallel replicas after that step (the schedule's REDUCE_GRAD).
    reductions: tuple[dict[int, tuple[int, ...]], ...] = ()
    # Under jax.distributed: the steps of every worker, as (worker, position in its
    # column), and this process's transfers, as (TRANSFER, index in transfers), in
    # the one global order (where a stage program has collectives between processes,
    # every process dispatches its share of them in this order: execution/run.py).
    order: tuple[tuple[int, int], ...] = ()
    # Per worker, {position in its column: stage indices} whose accumulators it hands
    # to the transfer thread after that step, to be reduced there (Reduce): stages
    # whose sub-mesh spans processes; empty otherwise.
    handed: tuple[dict[int, tuple[int, ...]], ...] = ()

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
    *,
    fuse: bool = True,
) -> Steps:
    """The steps of ``schedule`` over ``staged``'s stage programs: ``roles[kind][k]`` is
    the stage index of pipeline stage ``k``'s ``kind`` (forward, backward, weight)
    program, ``None`` where it has none. A backward the schedule runs whole on a stage
    whose backward the plan split runs as its B and W; with ``fuse``, the steps of each
    such backward and of each overlapped pair are one fused step (without, they run one
    after another, as :func:`~pipemark.runtime.execution.action_costs` times them)."""
    readers = _stage_readers(staged, units)
    columns: list[list[Step]] = [[] for _ in placement.slots]
    serial: list[tuple[int, Step]] = []
    params: list[set[int]] = [set() for _ in placement.slots]
    batch: list[set[int]] = [set() for _ in placement.slots]
    pairs = dict(schedule.overlapped)
    seconds = set(pairs.values())
    num_actions = 0
    for t, _, action in schedule.actions():
        if action in seconds:  # resolved with the first of its pair
            continue
        group: list[Step] = []
        for a in (action, pairs[action]) if action in pairs else (action,):
            made = _action_steps(a, t, schedule, staged, roles, units, readers, num_params)
            num_actions += bool(made)
            group += made
        if fuse and len(group) > 1:
            group = [fuse_group(group)]
        for step in group:
            w = units[step.index].worker
            for source, where in step.inputs:
                if source == PARAM:
                    params[w].add(where)
                elif source == BATCH:
                    batch[w].add(where[0])
            columns[w].append(step)
            serial.append((w, step))
    transfers, order = _transfers(serial, units, placement, staged)
    return Steps(
        columns=tuple(tuple(c) for c in columns),
        serial=tuple(serial),
        params=tuple(tuple(sorted(p)) for p in params),
        batch=tuple(tuple(sorted(b)) for b in batch),
        num_actions=num_actions,
        readers=readers,
        transfers=transfers,
        finals=_finals(columns, units, placement),
        reductions=_reductions(columns, schedule, roles, units),
        order=order,
    )


def _stage_readers(
    staged: StagedJaxpr, units: Mapping[int, Unit]
) -> dict[tuple[int, int], dict[int, int]]:
    """Per stage output, how many stage inputs read it on each worker."""
    readers: dict[tuple[int, int], dict[int, int]] = {}
    for c, stage in enumerate(staged.stages):
        if c in units:
            for ref in stage.inputs:
                if ref.kind == "stage":
                    per = readers.setdefault((ref.stage, ref.index), {})
                    per[units[c].worker] = per.get(units[c].worker, 0) + 1
    return readers


def _action_steps(
    action: Action,
    tick: int,
    schedule: Schedule,
    staged: StagedJaxpr,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
    readers: dict[tuple[int, int], dict[int, int]],
    num_params: int,
) -> list[Step]:
    """The steps of one action: none for a stage without that program, its B and W for
    a backward the schedule runs whole where the plan split it, else one."""
    kinds = [action.kind]
    whole = (action.stage, action.microbatch) in schedule.whole_backwards
    if action.kind == BACKWARD and whole and roles[WEIGHT][action.stage] is not None:
        kinds.append(WEIGHT)
    steps = []
    for kind in kinds:
        index = roles[kind][action.stage]
        if index is None:  # a stage without a backward (or weight) program
            continue
        unit, m = units[index], action.microbatch
        inputs = []
        for ref in staged.stages[index].inputs:
            if ref.kind == "input" and ref.index < num_params:
                inputs.append((PARAM, ref.index))
            elif ref.kind == "input":
                inputs.append((BATCH, (ref.index - num_params, m)))
            else:
                inputs.append((STAGE, (m, ref.stage, ref.index)))
        sends = tuple(
            (position, (m, index, o), tuple(sorted(readers[(index, o)].items())))
            for position, o in enumerate(unit.passed)
        )
        own = action._replace(kind=kind)
        steps.append(Step(index, m, own, bool(unit.accumulated), tuple(inputs), sends, tick=tick))
    return steps


def fuse_group(group: Sequence[Step]) -> Step:
    """The steps ``group`` (of one worker) as one fused step: a part reads what an
    earlier part computed for the same microbatch inside the program, the parameter and
    batch leaves several parts read once, and sends only what other steps read. It has
    its last part's index, microbatch and action and its first part's tick (so it runs
    where the group starts: everything its parts read is ready by then).

    >>> a = Step(0, 1, Action(0, 1, "forward"), False, ((PARAM, 0),), ((0, (1, 0, 0), ((0, 1),)),))
    >>> b = Step(1, 1, Action(0, 1, "backward"), True, ((PARAM, 0), (STAGE, (1, 0, 0))), ())
    >>> fused = fuse_group([a, b])
    >>> fused.inputs, fused.sends, fused.fused.reads
    (((0, 0),), (), (((-1, 0),), ((-1, 0), (0, 0))))
    """
    arguments: list[tuple[int, Any]] = []
    position: dict[tuple[int, Any], int] = {}
    reads = []
    made = {(part.microbatch, part.index): p for p, part in enumerate(group)}
    inside: dict[Key, int] = {}  # how many reads of each value stay inside the program
    for part in group:
        part_reads = []
        for entry in part.inputs:
            source, where = entry
            producer = made.get(where[:2]) if source == STAGE else None
            if producer is not None:
                part_reads.append((producer, where[2]))
                inside[where] = inside.get(where, 0) + 1
                continue
            if source == STAGE or entry not in position:  # each stage reads its own value
                position.setdefault(entry, len(arguments))
                part_reads.append((ARGUMENT, len(arguments)))
                arguments.append(entry)
            else:  # a parameter or batch leaf several parts read: passed once
                part_reads.append((ARGUMENT, position[entry]))
        reads.append(tuple(part_reads))
    passed, sends = [], []
    for p, part in enumerate(group):
        for _, key, targets in part.sends:
            left = _readers_outside(targets, inside.get(key, 0))
            if left:
                sends.append((len(passed), key, left))
                passed.append((p, key[2]))
    combined = Combined(tuple(part.index for part in group), tuple(reads), tuple(passed))
    last = group[-1]
    return last._replace(
        accumulate=any(part.accumulate for part in group),
        inputs=tuple(arguments),
        sends=tuple(sends),
        fused=combined,
        parts=tuple(group),
        tick=group[0].tick,
    )


def _readers_outside(
    targets: tuple[tuple[int, int], ...], inside: int
) -> tuple[tuple[int, int], ...]:
    """``targets`` (readers per worker) less the ``inside`` reads a fused program
    serves itself (all on its own worker, the one whose count covers them)."""
    if not inside:
        return targets
    left = []
    for worker, count in targets:
        own = min(count, inside)
        inside -= own
        if count - own:
            left.append((worker, count - own))
    return tuple(left)


def fuse_steps(
    steps: Steps,
    staged: StagedJaxpr,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
    placement: Placement,
    schedule: Schedule | None = None,
) -> Steps:
    """``steps`` with each forward step folded into the backward step right after it in
    its worker's column, when both are the same pipeline stage's for the same
    microbatch and no stage other than that backward reads the forward's outputs (so
    nothing waits for them, and they need not leave the program). The fused step takes
    the backward's place in its column and in the serial walk, and the forward's in the
    order of transfers between processes (:attr:`Steps.transfers`): it reads nothing
    from another stage that the forward does not, and one tick later the transfer of
    the forward's inputs would come after transfers of that tick that wait on other
    stages' backwards (under 1F1B over four processes, the last stage idled 22-25 ms
    before each of its last three microbatches, until the stage before it had sent
    its previous backward's cotangent).

    With one stage, every forward is fused with its backward under 1F1B; with several,
    the last stage's are (the others pass their outputs on); under a zero-bubble
    schedule none are (the weight-gradient step reads the forward's outputs too).
    """
    pairs = _fusable_pairs(staged, roles)
    fused_steps: dict[int, Step] = {}  # id of a backward step -> its fused step
    at_forward: dict[int, Step] = {}  # id of a forward step -> its fused step
    folded: set[int] = set()  # ids of the forward steps folded into one
    for column in steps.columns:
        for first, second in itertools.pairwise(column):
            if (
                first.fused is None
                and second.fused is None
                and pairs.get(second.index) == first.index
                and first.microbatch == second.microbatch
                and id(first) not in folded
            ):
                folded.add(id(first))
                fused = fuse_group([first, second])
                fused_steps[id(second)] = at_forward[id(first)] = fused._replace(tick=second.tick)
    if not fused_steps:
        return steps
    columns, serial = _replaced(steps, fused_steps, folded)
    # Each fused step in the forward's place: its worker's steps in column order still
    # (the two were next to each other there).
    walk = [(w, at_forward.get(id(s), s)) for w, s in steps.serial if id(s) not in fused_steps]
    transfers, order = _transfers(walk, units, placement, staged)
    return steps._replace(
        columns=columns,
        serial=serial,
        transfers=transfers,
        order=order,
        finals=_finals([list(c) for c in columns], units, placement),
        reductions=(
            steps.reductions
            if schedule is None
            else _reductions([list(c) for c in columns], schedule, roles, units)
        ),
    )


def fuse_runs(
    steps: Steps,
    size: int,
    schedule: Schedule,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
    placement: Placement,
    min_uses: int | None = None,
) -> Steps:
    """``steps`` with runs of up to ``size`` consecutive actions of a worker's column run
    as one fused step (``PipelineOptions.fuse_actions``), where no other worker waits
    for the actions before a run's last: a step joins the run before it if the values
    it reads from other stages were made on its own worker (before the run, or inside
    it) and the run's last step hands its outputs to its own worker only. Each stage
    runs at most once in a run (its accumulators are one argument of the program). A
    step fused already joins with its parts. Under ``jax.distributed`` nothing is
    fused here.

    What it saves is dispatch: a slot holding many stages (an interleaved schedule's
    virtual stages, or every stage on one device) runs a program per action, and the
    host's fixed cost per program adds up (S 16 on one TPU v5e chip: 248 programs a
    step at ~0.46 ms of host time each, 118 ms of a 139 ms step, docs/benchmarks/tpu-v5e-measurements.md).
    A run takes its first step's tick and place in the serial walk: everything it
    reads is ready there.

    A run is fused only where the program it becomes is dispatched at least
    ``min_uses`` times a call (``PipelineOptions.fuse_min_uses``; ``None``: twice the
    number of microbatches): runs of the same stage programs wired alike (the stages of
    identical blocks) are one program. Each distinct fused program is one more XLA
    compilation, seconds each on a TPU, and compiled one after the other (what a
    program reads from another on its device arrives in the layout XLA chose for it),
    while what it saves is the host's cost of the dispatches it replaces: at S 16 on
    one TPU v5e chip, fusing every run of 2 made the first call 2.27 x the scan's
    (15 programs compiled, not 6), and most of what it saved came from one program, a
    middle block's forward with another's backward, dispatched 84 times a call.

    The layout planner counts the same programs from a schedule alone
    (:mod:`pipemark.runtime.planning.dispatches`, which a test checks against this).

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, batch=4)
    >>> def parts(fuse_actions, fuse_min_uses=None):
    ...     pipe = pm.pipeline_value_and_grad(
    ...         ex.loss_fn, num_stages=2, num_microbatches=2, schedule="interleaved",
    ...         devices=jax.devices()[:1], fuse_actions=fuse_actions,
    ...         fuse_min_uses=fuse_min_uses)
    ...     column = pipe.plan(*ex.args).steps.columns[0]
    ...     return [[part.action.label() for part in s.parts or (s,)] for s in column]
    >>> parts(1)  # the last stage's forward and backward are one program already
    [['F0s0'], ['F0s1', 'B0s1'], ['F1s0'], ['B0s0'], ['F1s1', 'B1s1'], ['B1s0']]
    >>> parts(4)  # each run's program once a call: fused only when asked for
    [['F0s0'], ['F0s1', 'B0s1'], ['F1s0'], ['B0s0'], ['F1s1', 'B1s1'], ['B1s0']]
    >>> parts(4, fuse_min_uses=1)
    [['F0s0', 'F0s1', 'B0s1'], ['F1s0', 'B0s0', 'F1s1', 'B1s1'], ['B1s0']]
    """
    if size < 2 or placement.distributed:
        return steps
    if min_uses is None:
        min_uses = 2 * schedule.num_microbatches
    runs = []  # (its steps, the run as one step, what its program is compiled from)
    for w, column in enumerate(steps.columns):
        for run in _runs(column, w, size, units):
            if len(run) > 1:
                fused = fuse_group([part for step in run for part in step.parts or (step,)])
                runs.append((run, fused, _program_of(fused, units)))
    uses = collections.Counter(program for _, _, program in runs)
    firsts: dict[int, Step] = {}  # id of each fused run's first step -> the run's step
    rest: set[int] = set()  # ids of the other steps of the fused runs
    for run, fused, program in runs:
        if uses[program] >= min_uses:
            firsts[id(run[0])] = fused
            rest.update(id(step) for step in run[1:])
    if not firsts:
        return steps
    columns, serial = _replaced(steps, firsts, rest)
    return steps._replace(
        columns=columns,
        serial=serial,
        reductions=_reductions([list(c) for c in columns], schedule, roles, units),
    )


def _replaced(
    steps: Steps, replace: Mapping[int, Step], dropped: set[int]
) -> tuple[tuple[tuple[Step, ...], ...], tuple[tuple[int, Step], ...]]:
    """``steps``' columns and serial walk with each step whose ``id`` is in ``replace``
    replaced by its fused step, and the steps whose ``id`` is in ``dropped`` (folded
    into a fused step elsewhere) left out."""
    columns = tuple(
        tuple(replace.get(id(s), s) for s in column if id(s) not in dropped)
        for column in steps.columns
    )
    serial = tuple((w, replace.get(id(s), s)) for w, s in steps.serial if id(s) not in dropped)
    return columns, serial


def _program_of(fused: Step, units: Mapping[int, Unit]) -> tuple:
    """What the program of a fused step is compiled from: its parts' stage programs
    (one function for stages of identical programs on one slot,
    :func:`pipemark.runtime.devices.compilation.compile_units`) and how they are wired."""
    combined = fused.fused
    return (tuple(units[i].run for i in combined.stages), combined.reads, combined.passed)


def _runs(
    column: Sequence[Step], worker: int, size: int, units: Mapping[int, Unit]
) -> list[list[Step]]:
    """``column`` cut into the runs :func:`fuse_runs` fuses (a run of one: as it is)."""
    runs: list[list[Step]] = []
    actions = 0  # in the last run
    for step in column:
        count = len(step.parts) or 1
        run = runs[-1] if runs else []
        stages = {index for earlier in run for index in _stages_of(earlier)}
        joins = (
            run
            and actions + count <= size
            and not stages & set(_stages_of(step))
            and all(r == worker for _, _, targets in run[-1].sends for r, _ in targets)
            and all(units[k[1]].worker == worker for src, k in step.inputs if src == STAGE)
        )
        if joins:
            run.append(step)
            actions += count
        else:
            runs.append([step])
            actions = count
    return runs


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


def _reductions(
    columns: Sequence[Sequence[Step]],
    schedule: Schedule,
    roles: Mapping[str, Sequence[int | None]],
    units: Mapping[int, Unit],
) -> tuple[dict[int, tuple[int, ...]], ...]:
    """Per worker, {position in its column: stage indices} whose gradients are reduced
    over their replicas after that step (the schedule's ``reduce_grad``)."""
    per: list[dict[int, tuple[int, ...]]] = [{} for _ in columns]
    for stage, tick in schedule.reduce_grad:
        indices = [roles[kind][stage] for kind in (FORWARD, BACKWARD, WEIGHT)]
        indices = [i for i in indices if i is not None and i in units]
        if not indices:
            continue
        w = units[indices[0]].worker
        n = max((n for n, step in enumerate(columns[w]) if step.tick <= tick), default=None)
        if n is not None:
            per[w][n] = per[w].get(n, ()) + tuple(indices)
    return tuple(per)


def place_reductions(
    steps: Steps, units: Mapping[int, Unit], placement: Placement, after_stage: bool
) -> Steps:
    """``steps`` with the reduction of each accumulating stage over its data-parallel
    replicas placed (``PipelineOptions.reduce_gradients``): with ``after_stage``,
    right after the stage's last step in its worker's column, where the schedule's
    ``reduce_grad`` does not place it (:attr:`Steps.reductions`); else where the
    schedule places it, the rest at the end of the call.

    A stage whose sub-mesh spans processes is reduced by a collective between them,
    which every process must dispatch in the same order as the transfers: its
    reduction, and with its results gathered its last step's (:attr:`Steps.finals`),
    become a :class:`Reduce` in the global order after the step and the transfers of
    its outputs, its worker handing its accumulators over (:attr:`Steps.handed`).

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2, batch=4)
    >>> pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=2,
    ...                                   schedule="gpipe", devices=jax.devices()[:2])
    >>> plan = pipe.plan(*ex.args)
    >>> [[step.action.label() for step in column] for column in plan.steps.columns]
    [['F0s0', 'F1s0', 'B0s0', 'B1s0'], ['F0s1', 'F1s1', 'B0s1', 'B1s1']]
    >>> plan.forward_stages, plan.backward_stages
    ((0, 1), (3, 2))

    Per worker, ``{position in its column: stage indices}``: the loss (stage 1's
    forward) after its last forward, each backward's gradients after its last
    backward:

    >>> [sorted(per.items()) for per in plan.steps.reductions]
    [[(3, (3,))], [(1, (1,)), (3, (2,))]]
    """
    columns = steps.columns
    reductions = [dict(per) for per in steps.reductions or [{} for _ in columns]]
    placed = {i for per in reductions for indices in per.values() for i in indices}
    for w, column in enumerate(columns if after_stage else ()):
        last = {
            index: n
            for n, step in enumerate(column)
            for index in _stages_of(step)
            if units[index].accumulated
        }
        for index, n in sorted(last.items()):
            if index not in placed:
                reductions[w][n] = (*reductions[w].get(n, ()), index)
    steps = steps._replace(reductions=tuple(reductions))
    spanning = {i for i, unit in units.items() if len(placement.slots[unit.worker].processes) > 1}
    return _handed_over(steps, spanning, placement) if spanning else steps


def _handed_over(steps: Steps, spanning: set[int], placement: Placement) -> Steps:
    """``steps`` with the reductions of the stages ``spanning`` (and their last steps'
    :attr:`Steps.finals`) handed over to the transfer thread, each at its first
    place (:class:`Reduce`)."""
    reductions = [dict(per) for per in steps.reductions]
    finals = [dict(per) for per in steps.finals]
    gathered = {i for per in finals for indices in per.values() for i in indices}
    handed: list[dict[int, tuple[int, ...]]] = [{} for _ in steps.columns]
    for w in range(len(steps.columns)):
        at: dict[int, int] = {}  # each stage handed over once, at its first place
        for per in (reductions[w], finals[w]):
            for n, indices in list(per.items()):
                for i in indices:
                    if i in spanning:
                        at[i] = min(at.get(i, n), n)
                per[n] = tuple(i for i in indices if i not in spanning)
                if not per[n]:
                    del per[n]
        for index, n in sorted(at.items()):
            handed[w][n] = (*handed[w].get(n, ()), index)
    transfers, order = _with_reduces(steps, handed, gathered, placement)
    return steps._replace(
        reductions=tuple(reductions),
        finals=tuple(finals),
        handed=tuple(handed),
        transfers=transfers,
        order=order,
    )


def _with_reduces(
    steps: Steps,
    handed: Sequence[dict[int, tuple[int, ...]]],
    gathered: set[int],
    placement: Placement,
) -> tuple[tuple[Transfer | Gather | Reduce, ...], tuple[tuple[int, int], ...]]:
    """:attr:`Steps.transfers` and :attr:`Steps.order` with a :class:`Reduce` for each
    stage this process's workers hand over, after the step that hands it over and
    after the transfers of that step's outputs to other processes (every process of
    its slot is an end of each): the transfer thread runs one collective at a time,
    and a reduction before them would hold up the stages waiting for those values."""
    handing: dict[tuple[int, int], tuple[int, int]] = {}  # (microbatch, stage): its step
    for w, per in enumerate(handed):
        if placement.process in placement.slots[w].processes:
            for n in per:
                step = steps.columns[w][n]
                for part in step.parts or (step,):
                    handing[(part.microbatch, part.index)] = (w, n)
    handing_steps = set(handing.values())
    last: dict[tuple[int, int], int] = {}  # handing step -> its last entry in the order
    for p, (w, n) in enumerate(steps.order):
        if w != TRANSFER:
            if (w, n) in handing_steps:
                last[(w, n)] = p
        elif not isinstance(entry := steps.transfers[n], Gather):  # values between stages
            for key in entry[2]:
                if key[:2] in handing:
                    last[handing[key[:2]]] = p
    due: dict[int, list[tuple[int, int]]] = {}
    for step_at, p in sorted(last.items()):
        due.setdefault(p, []).append(step_at)
    transfers: list[Transfer | Gather | Reduce] = []
    order: list[tuple[int, int]] = []
    for p, (w, n) in enumerate(steps.order):
        if w == TRANSFER:
            order.append((TRANSFER, len(transfers)))
            transfers.append(steps.transfers[n])
        else:
            order.append((w, n))
        for worker, position in due.get(p, ()):
            for index in handed[worker][position]:
                order.append((TRANSFER, len(transfers)))
                transfers.append(Reduce(worker, index, index in gathered))
    return tuple(transfers), tuple(order)


def without_gathers(steps: Steps) -> Steps:
    """``steps`` without sending each stage's results to the other processes once final
    (:class:`Gather`): each process keeps its own stages' results
    (``PipelineOptions(gather_results=False)``)."""
    transfers = tuple(t for t in steps.transfers if not isinstance(t, Gather))
    # The gathers come last in both (see _transfers).
    order = tuple((w, i) for w, i in steps.order if w != TRANSFER or i < len(transfers))
    return steps._replace(transfers=transfers, finals=tuple({} for _ in steps.finals), order=order)


def _transfers(
    serial: list[tuple[int, Step]],
    units: Mapping[int, Unit],
    placement: Placement,
    staged: StagedJaxpr,
) -> tuple[tuple[Transfer | Gather, ...], tuple[tuple[int, int], ...]]:
    """The transfers this process is an end of, in the global order: before each action
    (in the schedule's order), the values it reads from workers of other processes that
    no earlier action on its worker received, one transfer per producer; then each
    stage's results to every other process, in the order of the stages' last actions.
    Every process derives the same order from the same schedule, so the two ends of
    each collective meet (gloo hangs or aborts otherwise).

    A gather waits for its stage's last action to be computed, and every receiving
    process waits with it: placed right after that action, it held the other
    processes' transfers whose values were ready (in a traced 1F1B call over four
    processes, the third stage's next-to-last cotangent waited 17 ms for the last
    stage's results). At the end, the early stages' results still cross while the last
    stages compute.

    Also that order with the steps in it (:attr:`Steps.order`): each step after the
    transfers into it, as ``(worker, position in its column)``, each transfer as
    ``(TRANSFER, index)``."""
    if not placement.distributed:
        return (), ()
    process = [slot.processes for slot in placement.slots]
    last = {
        index: n
        for n, (_, step) in enumerate(serial)
        for index in _stages_of(step)
        if units[index].accumulated
    }
    receivers = placement.receivers()
    moved: set[tuple[Key, int]] = set()
    transfers: list[Transfer] = []
    gathers: list[Gather] = []
    order: list[tuple[int, int]] = []
    positions = [0] * len(placement.slots)  # per worker, its steps so far
    for n, (worker, step) in enumerate(serial):
        per_producer: dict[int, list[Key]] = {}
        for source, key in step.inputs:
            if source != STAGE or (key, worker) in moved:
                continue
            producer = units[key[1]].worker
            if placement.crossing(producer, worker):
                moved.add((key, worker))
                per_producer.setdefault(producer, []).append(key)
        for p, keys in per_producer.items():
            if placement.process not in process[p] | process[worker]:
                continue  # between other processes
            types = tuple(_passed_type(staged, placement, p, i, o) for _, i, o in keys)
            order.append((TRANSFER, len(transfers)))
            transfers.append((p, worker, tuple(keys), types))
        order.append((worker, positions[worker]))
        positions[worker] += 1
        for index in _stages_of(step):
            if last.get(index) != n:
                continue
            out_avals = staged.stages[index].out_avals
            types = tuple(value_type(out_avals[o]) for _, o in units[index].accumulated)
            # A process owning part of the slot keeps its own copy of the results.
            others = tuple((q, d) for q, d in receivers.items() if q not in process[worker])
            gathers.append(Gather(worker, index, types, others))
    order += [(TRANSFER, len(transfers) + g) for g in range(len(gathers))]
    return (*transfers, *gathers), tuple(order)


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
    """The name of the program ``step`` runs: its stage's, its parts' joined by ``+``
    for a fused step (``"layer1+layer1_backward"``)."""
    if step.fused is None:
        return stage_names[step.index]
    return "+".join(stage_names[index] for index in step.fused.stages)


def step_name(step: Step, stage_names: Sequence[str]) -> str:
    """What profilers and traces call ``step``: its program's name and its microbatch
    (a fused step's parts' microbatches, where they differ); a split backward's weight
    half says so.

    >>> from pipemark.runtime.schedules.core import Action
    >>> step = Step(1, 2, Action(0, 2, "backward"), True, (), ())
    >>> step_name(step, ["layer0", "layer0_backward"])
    'layer0_backward mb2'
    >>> forward = Step(0, 3, Action(0, 3, "forward"), False, (), ())
    >>> step_name(fuse_group([forward, step]), ["layer0", "layer0_backward"])
    'layer0+layer0_backward mb3+2'
    """
    # Once per action a call dispatches: kept to a few string operations.
    name = program_name(step, stage_names)
    if step.fused is not None:
        micro = [part.microbatch for part in step.parts]
        if len(set(micro)) > 1:
            return f"{name} mb{'+'.join(map(str, micro))}"
    if step.action.kind == WEIGHT and step.fused is None:
        return f"{name} (weight) mb{step.microbatch}"
    return f"{name} mb{step.microbatch}"


def _stages_of(step: Step) -> tuple[int, ...]:
    """The stages a step runs: its own, or a fused step's parts'."""
    return (step.index,) if step.fused is None else step.fused.stages


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
