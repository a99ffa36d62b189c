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

A result that depends on values of two slots couples them (global-norm clipping reads
every gradient): the update then stays one program on the first slot, as before, and
:func:`split_update` returns ``None``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal

from pipemark.passes.rewrite import dce
from pipemark.runtime.plan import PipelinePlan

__all__ = ["StageUpdates", "input_owners", "split_update"]


class StageUpdates(NamedTuple):
    """A training step's update as one program per device slot.

    Attributes
    ----------
    parts:
        Per slot that runs a part: ``(worker, program, inputs, outputs)``, the program
        reading the update's inputs at positions ``inputs`` and computing its results
        at positions ``outputs``.
    """

    parts: tuple[tuple[int, ClosedJaxpr, tuple[int, ...], tuple[int, ...]], ...]


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


def split_update(apply: ClosedJaxpr, owners: list[int | None], first: int) -> StageUpdates | None:
    """``apply`` (a training step's update) cut into one program per slot, given the
    slot that owns each of its inputs (``None``: none); a result no slot owns goes to
    slot ``first``. ``None`` where a result depends on values of two slots, or where
    every result would go to one slot anyway.

    >>> import jax, jax.numpy as jnp
    >>> update = jax.make_jaxpr(lambda w0, w1, g0, g1: (w0 - 0.1 * g0, w1 - 0.1 * g1))(
    ...     *[jnp.ones(2)] * 4)
    >>> parts = split_update(update, [0, 1, 0, 1], first=0).parts
    >>> [(worker, inputs, outputs) for worker, _, inputs, outputs in parts]
    [(0, (0, 2), (0,)), (1, (1, 3), (1,))]
    >>> split_update(jax.make_jaxpr(lambda w0, w1: w0 + w1)(1.0, 2.0), [0, 1], 0) is None
    True
    """
    jaxpr = apply.jaxpr
    owned: dict[Any, frozenset[int]] = {
        v: frozenset() if o is None else frozenset({o}) for v, o in zip(jaxpr.invars, owners)
    }
    for eqn in jaxpr.eqns:
        union = frozenset().union(*(owned.get(v, frozenset()) for v in _vars(eqn.invars)))
        owned.update((v, union) for v in eqn.outvars)
    where: list[int] = []
    for v in jaxpr.outvars:
        sets = owned.get(v, frozenset()) if type(v) is not Literal else frozenset()
        if len(sets) > 1:
            return None  # this result couples two slots' values
        where.append(next(iter(sets)) if sets else first)
    if len(set(where)) < 2:
        return None
    parts = []
    for worker in sorted(set(where)):
        outputs = tuple(k for k, w in enumerate(where) if w == worker)
        parts.append((worker, *_part(apply, outputs), outputs))
    return StageUpdates(tuple(parts))


def _vars(atoms: Any) -> list[Any]:
    return [a for a in atoms if type(a) is not Literal]


def _part(apply: ClosedJaxpr, outputs: tuple[int, ...]) -> tuple[ClosedJaxpr, tuple[int, ...]]:
    """The program computing ``apply``'s results ``outputs`` from the inputs they read,
    and the positions of those inputs."""
    jaxpr = apply.jaxpr
    outvars = [jaxpr.outvars[k] for k in outputs]
    whole = Jaxpr(
        jaxpr.constvars, jaxpr.invars, outvars, jaxpr.eqns, jaxpr.effects,
        _info(range(len(jaxpr.invars)), outputs),
    )  # fmt: skip
    lean = dce(ClosedJaxpr(whole, apply.consts)).jaxpr
    read = {v for e in lean.eqns for v in _vars(e.invars)} | set(_vars(lean.outvars))
    inputs = tuple(i for i, v in enumerate(lean.invars) if v in read)
    part = Jaxpr(
        lean.constvars, [lean.invars[i] for i in inputs], lean.outvars, lean.eqns,
        lean.effects, _info(inputs, outputs),
    )  # fmt: skip
    return ClosedJaxpr(part, apply.consts), inputs


def _info(inputs: Any, outputs: Any) -> DebugInfo:
    return DebugInfo(
        "pipemark update",
        "a slot's part of the update",
        tuple(f"input[{i}]" for i in inputs),
        tuple(f"result[{k}]" for k in outputs),
    )
