"""A training step's update, run per stage where the stage's parameters live:
:func:`split_update` and :class:`StageUpdates`.

``pm.pipeline_train_step`` runs the step's update (the program after its grad marker)
once, after the pipeline. An optimizer such as ``optax.adam`` updates each parameter
from its own gradient and its own state: the update of the parameters a stage reads
needs nothing of another stage's. :func:`split_update` gives each input of the update
an owner (a parameter leaf: the device slot whose stages read it; an accumulated
result, a gradient: the slot of the stage that computed it; the optimizer state and the
batch: none yet), propagates owners from inputs to results, and cuts the update into
one program per slot (:func:`pipemark.passes.dce` of the update keeping that slot's
results; a value no slot owns, such as Adam's step count, is recomputed where it is
needed, and a result no slot owns goes to the first slot). No slot then holds another
stage's gradients or optimizer state: each slot's program reads the optimizer state of
its own parameters, and returns it where it was computed.

An equation that reads values of two slots couples them: global-norm clipping adds up
every slot's sum of squares of its gradients. What crosses slots there is small (one
scalar per gradient leaf), so the slots exchange those values instead of gathering the
gradients. A coupling equation's result stays on a slot whose operand is as big as the
result (``g / norm`` stays with the gradient ``g``), or else is
*shared* (``s0 + s1``, the norm, the clip factor: small), recomputed on every slot
that needs it; the operands it reads from the other slots are that slot's *exchanged*
values, computed there first and sent to the slots that read them. A shared result
(the global norm returned as a metric) goes to the first slot, which then reads the
exchanged values too. Before, slot 0 owning ``w0`` and ``g0``, slot 1 ``w1`` and
``g1``::

    s0 = sum(g0 * g0)                    # slot 0
    s1 = sum(g1 * g1)                    # slot 1
    scale = min(1, 0.1 / sqrt(s0 + s1))  # couples the slots: shared
    return w0 - scale * g0, w1 - scale * g1

After, in two rounds (:class:`StageUpdates`)::

    round 1   slot 0: s0 from g0          slot 1: s1 from g1
              (s0 and s1, 4 bytes each, are sent to the other slot)
    round 2   slot 0: w0 - scale * g0     slot 1: w1 - scale * g1
              from w0, g0, s0, s1         from w1, g1, s0, s1

A value exchanged after another exchange (the norm of the clipped gradients, returned
as a metric) takes one more round, whose parts recompute what they need of their
slot's update (elementwise work, done again in the last round). A scalar never keeps
a coupling equation on its slot (so that a sum of many slots' scalars is shared and
takes one exchange): a scalar parameter clipped by the global norm is exchanged, and
its new value and optimizer state are shared, on the first slot.
Where one slot would send more than :data:`EXCHANGE_LIMIT` bytes (a result adds two
stages' whole parameter matrices), or the update has effects (a debug print, which
every part would repeat), the update stays one program on the first slot, and
:func:`split_update` returns ``None``. On sub-meshes each part reads a parameter with
its layout on its stage's sub-mesh. Under ``jax.distributed`` with
``gather_results=False`` each process runs its own slots' parts, and the exchanged
values that cross processes move with the pipeline's transport
(:class:`pipemark.runtime.PipelinedStep`); with results gathered, every process runs the
whole update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var

from pipemark.cost import nbytes
from pipemark.passes.framework import jaxpr_pass
from pipemark.passes.rewrite import dce
from pipemark.runtime.plan import PipelinePlan
from pipemark.staged import substitute_operands

__all__ = [
    "EXCHANGE_LIMIT",
    "StageUpdates",
    "UpdatePart",
    "input_owners",
    "split_update",
    "stage_owners",
]

#: The most bytes one slot sends the others for a split update. Global-norm clipping
#: sends one scalar per gradient leaf (4 KiB for a thousand leaves); a limit far above
#: that and far below any parameter matrix worth keeping on its stage (a 128 x 128
#: float32 matrix is 64 KiB) keeps big coupled values (a result that adds two stages'
#: parameters) from being copied between slots: such an update runs whole instead.
EXCHANGE_LIMIT = 64 * 1024


class UpdatePart(NamedTuple):
    """One program of a split update, run on slot ``worker``: it reads the values at
    positions ``inputs`` of the update's value table (see :class:`StageUpdates`) and
    computes those at positions ``outputs``."""

    worker: int
    program: ClosedJaxpr
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


class StageUpdates(NamedTuple):
    """A training step's update as programs per device slot, run in order.

    The parts read and write one table of values: the update's ``n`` inputs (positions
    ``0 .. n-1``), its ``r`` results (``n .. n+r-1``), then the values exchanged between
    slots (``n+r ..``). A part that computes exchanged values runs before every part
    that reads them; a value read on another slot than the one that computed it is
    copied there (it is small: :data:`EXCHANGE_LIMIT`).

    Attributes
    ----------
    parts:
        The :class:`UpdatePart` of each slot in each round, in the order they run: the
        rounds that compute exchanged values, then one part per slot computing its
        results.
    exchanged:
        The type (aval) of each exchanged value that a part computes, in table order.
    unowned:
        The table positions of the results no slot owns (shared, or of inputs no slot
        owns, such as Adam's step count), which the first slot computes: under
        ``jax.distributed`` every process needs them (the step count is read by every
        slot's part of the next update), so they are sent to every other process.
    """

    parts: tuple[UpdatePart, ...]
    exchanged: tuple[Any, ...] = ()
    unowned: tuple[int, ...] = ()


def input_owners(plan: PipelinePlan, num_args: int) -> list[int | None]:
    """Per input of a training step's update (the step's argument leaves, ``num_args``
    of them, then the pipeline's accumulated results): the slot it belongs to, or
    ``None``. A parameter leaf belongs to the slot whose stages read it (``None`` when
    several or none do); a result to the slot of the stage that computed it."""
    readers: dict[int, set[int]] = {}
    for worker, leaves in enumerate(plan.steps.params):
        for leaf in leaves:
            readers.setdefault(leaf, set()).add(worker)
    owners: list[int | None] = []
    for i in range(num_args):
        workers = readers.get(i, set()) if i < plan.num_param_leaves else set()
        owners.append(next(iter(workers)) if len(workers) == 1 else None)
    for ref in plan.staged.outputs:
        unit = plan.units.get(ref.stage) if ref.kind == "stage" else None
        owners.append(None if unit is None else unit.worker)
    return owners


def stage_owners(plan: PipelinePlan, num_args: int) -> tuple[list[int | None], dict[int, int]]:
    """As :func:`input_owners`, by pipeline stage rather than slot (so that a slot that
    runs several stages updates each apart: with its state offloaded, one stage's at a
    time on the device); and the slot of each pipeline stage."""
    stage_of = {
        index: stage
        for indices in plan.roles().values()
        for stage, index in enumerate(indices)
        if index is not None
    }
    readers: dict[int, set[int | None]] = {}
    for index, program in enumerate(plan.staged.stages):
        for ref in program.inputs:
            if ref.kind == "input" and ref.index < plan.num_param_leaves:
                readers.setdefault(ref.index, set()).add(stage_of.get(index))
    owners: list[int | None] = []
    for i in range(num_args):
        stages = readers.get(i, set())
        owners.append(next(iter(stages)) if len(stages) == 1 else None)
    for ref in plan.staged.outputs:
        owners.append(stage_of.get(ref.stage) if ref.kind == "stage" else None)
    workers = {stage_of[i]: unit.worker for i, unit in plan.units.items() if i in stage_of}
    return owners, workers


@jaxpr_pass
def split_update(
    apply: ClosedJaxpr, owners: Sequence[int | None], first: int
) -> StageUpdates | None:
    """``apply`` (a training step's update) cut into programs per slot, given the slot
    that owns each of its inputs (``None``: none); a result no slot owns goes to slot
    ``first``. ``None`` where every result would go to one slot anyway, where a slot
    would send more than :data:`EXCHANGE_LIMIT` bytes, or where the update has effects.

    Each slot updates its own parameters:

    >>> import jax, jax.numpy as jnp
    >>> update = jax.make_jaxpr(lambda w0, w1, g0, g1: (w0 - 0.1 * g0, w1 - 0.1 * g1))(
    ...     *[jnp.ones(2)] * 4)
    >>> parts = split_update(update, [0, 1, 0, 1], first=0).parts
    >>> [(part.worker, part.inputs, part.outputs) for part in parts]
    [(0, (0, 2), (4,)), (1, (1, 3), (5,))]

    (Positions in the table of values: the 4 inputs, then the 2 results.) Clipped by
    the global norm, each slot's sum of squares (positions 6 and 7, after the results)
    is computed on its slot first, then read by both:

    >>> def clipped(w0, w1, g0, g1):
    ...     scale = jnp.minimum(1.0, 0.1 / jnp.sqrt(jnp.sum(g0**2) + jnp.sum(g1**2)))
    ...     return w0 - scale * g0, w1 - scale * g1
    >>> split = split_update(jax.make_jaxpr(clipped)(*[jnp.ones(2)] * 4), [0, 1, 0, 1], 0)
    >>> [(part.worker, part.inputs, part.outputs) for part in split.parts]
    [(0, (2,), (6,)), (1, (3,), (7,)), (0, (0, 2, 6, 7), (4,)), (1, (1, 3, 6, 7), (5,))]
    >>> split.exchanged
    (ShapedArray(float32[]), ShapedArray(float32[]))

    Adding two slots' whole matrices would copy one of them: no split.

    >>> big = jnp.ones((256, 256))
    >>> split_update(jax.make_jaxpr(lambda w0, w1: (w0 + w1, w1))(big, big), [0, 1], 0)
    """
    jaxpr = apply.jaxpr
    if jaxpr.effects:
        return None  # every part would keep the effect: it must run once, in one place
    flow = _Flow.of(jaxpr, owners)
    owner = [flow.owner_of(v) for v in jaxpr.outvars]
    where = [first if slot is None else slot for slot in owner]
    if len(set(where)) < 2 or not flow.small():
        return None
    num_inputs, num_results = len(jaxpr.invars), len(jaxpr.outvars)
    # Exchanged values that are inputs already have a table position; the others are
    # computed by a part, into positions after the results.
    computed = [v for v in flow.exchanged if v not in flow.inputs]
    position = {v: num_inputs + num_results + j for j, v in enumerate(computed)}
    parts = []
    for round_ in range(1 + max(map(flow.round_of, computed), default=-1)):
        # This round's values read only earlier rounds' (see _Flow.of).
        ready = {v: p for v, p in position.items() if flow.round_of(v) < round_}
        now = [v for v in computed if flow.round_of(v) == round_]
        for worker in sorted({flow.exchanged[v] for v in now}):
            values = [v for v in now if flow.exchanged[v] == worker]
            outputs = tuple(position[v] for v in values)
            parts.append(UpdatePart(worker, *_part(apply, values, ready, outputs), outputs))
    for worker in sorted(set(where)):
        results = [k for k, w in enumerate(where) if w == worker]
        outputs = tuple(num_inputs + k for k in results)
        values = [jaxpr.outvars[k] for k in results]
        parts.append(UpdatePart(worker, *_part(apply, values, position, outputs), outputs))
    unowned = tuple(num_inputs + k for k, slot in enumerate(owner) if slot is None)
    return StageUpdates(tuple(parts), tuple(v.aval for v in computed), unowned)


class _Flow(NamedTuple):
    """Owners carried through an update: the slots owning each value (one: that slot's;
    several: shared, recomputed on each slot that needs it; absent: none), the values
    each slot sends the others (in the order the program reads them) with their slot,
    and per value the number of exchange rounds it waits for."""

    inputs: frozenset[Any]
    owners: dict[Any, frozenset[int]]
    exchanged: dict[Any, int]
    rounds: dict[Any, int]

    @staticmethod
    def of(jaxpr: Jaxpr, owned_by: Sequence[int | None]) -> _Flow:
        """The flow of ``jaxpr`` whose inputs are owned by ``owned_by``.

        An equation reading values of one slot (and values no slot owns) belongs to
        that slot. One reading values of several slots (its operands' owners together)
        couples them: its result stays on a slot whose operand is as big as the result
        (:func:`_home`), or else is shared; the operands of one slot other than that
        are exchanged. A result waits for the rounds its operands wait for, and one
        more after an exchanged operand.
        """
        owners = {v: frozenset({o}) for v, o in zip(jaxpr.invars, owned_by) if o is not None}
        exchanged: dict[Any, int] = {}
        rounds: dict[Any, int] = {}
        for eqn in jaxpr.eqns:
            reads = _vars(eqn.invars)
            slots = frozenset().union(*(owners.get(v, ()) for v in reads))
            wait = max((rounds.get(v, 0) for v in reads), default=0)
            if len(slots) > 1:
                home = _home(eqn.outvars, reads, owners)
                for v in reads:
                    one = owners.get(v, ())
                    if len(one) == 1 and one != home:
                        exchanged.setdefault(v, next(iter(one)))
                        wait = max(wait, rounds.get(v, 0) + 1)
                slots = home or slots
            for v in eqn.outvars:
                if slots:
                    owners[v] = slots
                if wait:
                    rounds[v] = wait
        return _Flow(frozenset(jaxpr.invars), owners, exchanged, rounds)

    def owner_of(self, atom: Any) -> int | None:
        """The slot owning ``atom``; ``None`` for a value no slot or several own."""
        slots = () if type(atom) is Literal else self.owners.get(atom, ())
        return next(iter(slots)) if len(slots) == 1 else None

    def round_of(self, var: Any) -> int:
        return self.rounds.get(var, 0)

    def small(self) -> bool:
        """Whether each slot sends at most :data:`EXCHANGE_LIMIT` bytes."""
        sent: dict[int, int] = {}
        for v, worker in self.exchanged.items():
            sent[worker] = sent.get(worker, 0) + nbytes(v.aval)
        return all(size <= EXCHANGE_LIMIT for size in sent.values())


def _home(
    results: Sequence[Any], reads: Sequence[Any], owners: Mapping[Any, frozenset[int]]
) -> frozenset[int] | None:
    """Where an equation coupling several slots runs: the slot whose operands as big as
    its result (not scalars) hold the most bytes, first read on ties; ``None`` (shared)
    where there is none.

    Clipping a gradient by the global norm (``g / norm``) stays with the gradient, and
    only the norm crosses slots; adding two slots' partial sums of squares (scalars) is
    shared: every slot recomputes it from both, so that a sum over many slots' leaves
    takes one exchange, not one per slot.
    """
    size = max((nbytes(v.aval) for v in results), default=0)
    held: dict[frozenset[int], int] = {}
    for v in reads:
        one = owners.get(v, frozenset())
        as_big = math.prod(getattr(v.aval, "shape", ())) > 1 and nbytes(v.aval) >= size
        if len(one) == 1 and as_big:
            held[one] = held.get(one, 0) + nbytes(v.aval)
    return max(held, key=held.__getitem__) if held else None


def _vars(atoms: Any) -> list[Any]:
    return [a for a in atoms if type(a) is not Literal]


def _part(
    apply: ClosedJaxpr, values: list[Any], ready: Mapping[Any, int], outputs: tuple[int, ...]
) -> tuple[ClosedJaxpr, tuple[int, ...]]:
    """The program computing ``values`` of ``apply`` (at table positions ``outputs``)
    from the inputs they read, where each value of ``ready`` (at its table position) is
    read from the table instead of computed; and the table positions it reads."""
    jaxpr = apply.jaxpr
    # Each ready value becomes a fresh input, read in place of its own variable: the
    # equations that computed it are then dead (unless they compute something else
    # the part needs), and dce drops them.
    fresh = {v: Var(v.aval) for v in ready}
    outvars = [fresh.get(v, v) if type(v) is not Literal else v for v in values]
    invars = [*jaxpr.invars, *fresh.values()]
    positions = [*range(len(jaxpr.invars)), *ready.values()]
    whole = Jaxpr(
        jaxpr.constvars, invars, outvars, substitute_operands(jaxpr.eqns, fresh),
        jaxpr.effects, _info(positions, outputs),
    )  # fmt: skip
    # dce drops the constants nobody reads: the part keeps its own.
    cleaned = dce(ClosedJaxpr(whole, apply.consts))
    lean = cleaned.jaxpr
    read = {v for e in lean.eqns for v in _vars(e.invars)} | set(_vars(lean.outvars))
    kept = [i for i, v in enumerate(lean.invars) if v in read]
    inputs = tuple(positions[i] for i in kept)
    part = Jaxpr(
        lean.constvars, [lean.invars[i] for i in kept], lean.outvars, lean.eqns,
        lean.effects, _info(inputs, outputs),
    )  # fmt: skip
    return ClosedJaxpr(part, cleaned.consts), inputs


def _info(inputs: Sequence[int], outputs: Sequence[int]) -> DebugInfo:
    return DebugInfo(
        "pipemark update",
        "a slot's part of the update",
        tuple(f"value[{i}]" for i in inputs),
        tuple(f"value[{k}]" for k in outputs),
    )
