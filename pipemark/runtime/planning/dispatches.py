"""The programs a pipeline's runtime dispatches for a schedule, as the layout planner
(:mod:`pipemark.runtime.planning.planner`) counts them: which actions of a device run as one
program.

The runtime runs an action a program, but for four kinds of fused steps
(:mod:`pipemark.runtime.devices.steps`): an overlapped pair of a schedule (DualPipeV's); a last
stage's (one whose outputs no other stage reads) forward with its own backward right
after it (``fuse_steps``; none under a schedule that splits the backward: the weight
step reads the forward's outputs too); under such a schedule, a first stage's (one that
reads no other stage) weight step inside its backward, having no input gradient to make
apart from it; and runs of up to ``fuse_actions`` consecutive programs of a device that no other
device waits for before the run's last (``fuse_runs``), where the run's program is
dispatched at least ``fuse_min_uses`` times a call. The planner has no stage programs to
compare, so it takes stages for alike as the runtime finds identical blocks: the
middle stages of equal work; the first (it reads the batch) and the last (the loss)
each unlike any other. Under ``jax.distributed`` (a layout over several hosts) the
runtime fuses no runs.

>>> from pipemark.runtime.schedules.problem import ScheduleProblem
>>> from pipemark.runtime.schedules.registry import build_schedule
>>> schedule = build_schedule("interleaved", ScheduleProblem(16, 8, num_devices=1))
>>> alike = stage_classes([1.0] * 16)
>>> len(programs(schedule, alike, fuse_actions=1))  # 256 actions, 8 F + B pairs
248
>>> len(programs(schedule, alike, fuse_actions=2))  # and a middle F with another's B
164
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

from pipemark.roles import BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.schedules.core import Action, Schedule, dependencies

__all__ = ["programs", "stage_classes"]

Program = tuple[Action, ...]


def stage_classes(work: Sequence[Hashable]) -> tuple[Hashable, ...]:
    """Which stages' programs the planner takes for one (equal classes): the middle
    stages by their ``work`` (anything that tells stages apart, such as their costs),
    the first and the last stage each alone.

    >>> stage_classes([1.0, 1.0, 1.0, 2.0, 1.0])
    ('first', ('middle', 1.0), ('middle', 1.0), ('middle', 2.0), 'last')
    """
    last = len(work) - 1
    return tuple(
        "first" if j == 0 else "last" if j == last else ("middle", w) for j, w in enumerate(work)
    )


def programs(
    schedule: Schedule,
    classes: Sequence[Hashable],
    *,
    fuse_actions: int = 2,
    fuse_min_uses: int | None = None,
    distributed: bool = False,
) -> dict[Action, Program]:
    """Each program the runtime dispatches for ``schedule``, keyed by its first action,
    in each device's order (the options as :class:`~pipemark.PipelineOptions`'s;
    ``classes``: :func:`stage_classes`; ``distributed``: under ``jax.distributed``,
    where no runs are fused)."""
    units = [_steps(schedule, order) for order in schedule.device_orders()]
    if fuse_actions >= 2 and not distributed:
        units = _fused_runs(schedule, units, classes, fuse_actions, fuse_min_uses)
    return {unit[0]: unit for column in units for unit in column}


def _steps(schedule: Schedule, order: Sequence[Action]) -> list[Program]:
    """A device's actions as the runtime's steps before runs are fused: overlapped
    pairs; the last stage's forward with its own backward right after it; and where the
    schedule splits the backward, a first stage's (one that reads no other stage) weight
    step in its backward's, which has no input gradient to make apart from it."""
    pairs = dict(schedule.overlapped)
    last = {j for j, s in enumerate(schedule.successors) if not s}
    split = schedule.splits_backward
    first = {j for j, p in enumerate(schedule.predecessors) if not p}
    steps: list[Program] = []
    for n, action in enumerate(order):
        after = order[n + 1] if n + 1 < len(order) else None
        if (steps and action in steps[-1]) or (
            split and action.kind == WEIGHT and action.stage in first
        ):
            continue
        if action in pairs:
            unit: Program = (action, pairs[action])
        elif (
            not split
            and action.kind == FORWARD
            and action.stage in last
            and (after == action._replace(kind=BACKWARD))
        ):
            unit = (action, after)
        elif split and action.kind == BACKWARD and action.stage in first:
            weight = action._replace(kind=WEIGHT)
            unit = (action, weight) if weight in order else (action,)
        else:
            unit = (action,)
        steps.append(unit)
    return steps


def _fused_runs(
    schedule: Schedule,
    columns: list[list[Program]],
    classes: Sequence[Hashable],
    size: int,
    min_uses: int | None,
) -> list[list[Program]]:
    """``columns`` with the runs ``fuse_runs`` fuses as one program each."""
    preds, succ = schedule.predecessors, schedule.successors
    needs = {a: dependencies(a, preds, succ) for column in columns for u in column for a in u}
    readers: dict[Action, list[Action]] = collections.defaultdict(list)
    for action, needed in needs.items():
        for n in needed:
            readers[n].append(action)
    device = schedule.stage_devices
    runs = []  # (device, the run's steps, the run's program)
    for d, column in enumerate(columns):
        for run in _runs(column, d, size, needs, readers, device):
            if len(run) > 1:
                runs.append((d, run, _program_key(d, run, needs, classes)))
    uses = collections.Counter(key for _, _, key in runs)
    least = 2 * schedule.num_microbatches if min_uses is None else min_uses
    fused = {run[0]: run for d, run, key in runs if uses[key] >= least}
    out = []
    for column in columns:
        merged: list[Program] = []
        skip = 0
        for n, unit in enumerate(column):
            if n < skip:
                continue
            run = fused.get(unit)
            merged.append(tuple(a for u in run for a in u) if run else unit)
            skip = n + (len(run) if run else 1)
        out.append(merged)
    return out


def _runs(column, d, size, needs, readers, device) -> list[list[Program]]:
    """``column`` cut into runs: a step joins the run before it if it fits in ``size``
    actions, runs no stage program the run runs (a stage's forward, backward and weight
    step are three: the runtime's accumulators are one argument each), reads from other stages only
    what was made on its device, and the run's last step hands its outputs to this
    device only."""
    runs: list[list[Program]] = []
    actions = 0
    for unit in column:
        run = runs[-1] if runs else []
        kinds = {(a.stage, a.kind) for u in run for a in u}
        joins = (
            run
            and actions + len(unit) <= size
            and not kinds & {(a.stage, a.kind) for a in unit}
            and all(device[r.stage] == d for a in run[-1] for r in readers[a])
            and all(device[n.stage] == d for a in unit for n in needs[a])
        )
        if joins:
            run.append(unit)
            actions += len(unit)
        else:
            runs.append([unit])
            actions = len(unit)
    return runs


def _program_key(d: int, run: list[Program], needs, classes) -> tuple:
    """What the run's program is compiled from: its actions' kinds and stage classes,
    which of its earlier actions each reads, and which are of its own stage (they read
    the same parameters, one argument of the program); per device, since the runtime
    compiles a slot's programs apart."""
    actions = [a for unit in run for a in unit]
    position = {a: n for n, a in enumerate(actions)}
    return (d, tuple(
        (a.kind, classes[a.stage],
         tuple(sorted(position[n] for n in needs[a] if n in position)),
         tuple(m for m, b in enumerate(actions[:n]) if b.stage == a.stage))
        for n, a in enumerate(actions)
    ))  # fmt: skip
