"""Where a pipeline keeps each leaf of its state: the target a checkpoint restores to.

A pipeline reads each parameter leaf on the slots whose stages use it, and a training
step's update reads each leaf of the state on the slots whose part of the update uses
it. Restoring a checkpoint straight there (``jax.ShapeDtypeStruct`` s carrying those
shardings: orbax's restore target) puts nothing on a device that does not need it, and
the next call moves nothing. Under ``jax.distributed`` a leaf that only another
process's slots read is restored there (an array with no data in this process), one
that this process reads is restored on this process's first slot that reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from pipemark.runtime.plan import PipelinePlan

__all__ = ["Reader", "abstract_leaves", "kept_shardings", "stage_readers"]

#: A slot that reads a leaf and how it lays it out there: ``(worker, sharding)``.
Reader = tuple[int, Any]


def stage_readers(plan: PipelinePlan, num_leaves: int) -> list[list[Reader]]:
    """Per parameter leaf, the slots whose stages read it, in slot order, with its
    layout there."""
    readers: list[list[Reader]] = [[] for _ in range(num_leaves)]
    for worker, leaves in enumerate(plan.steps.params):
        for leaf in leaves:
            if leaf < num_leaves:
                readers[leaf].append((worker, plan.param_sharding(leaf, worker)))
    return readers


def kept_shardings(plan: PipelinePlan, readers: Sequence[Iterable[Reader]]) -> list[Any]:
    """Per leaf, where this process keeps it: on this process's first slot among its
    ``readers``, else on the first reader's slot (another process's), else (nothing
    reads it) whole on this process's first slot."""
    local = plan.placement.local
    kept = []
    for leaf_readers in readers:
        ordered = sorted(leaf_readers, key=lambda reader: reader[0])
        mine = [sharding for worker, sharding in ordered if local[worker]]
        if mine:
            kept.append(mine[0])
        elif ordered:
            kept.append(ordered[0][1])
        else:
            kept.append(plan.placement.home())
    return kept


def abstract_leaves(leaves: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """``jax.ShapeDtypeStruct`` s of ``leaves`` (arrays, or anything with a shape and a
    dtype) laid out by ``shardings``."""
    return [
        jax.ShapeDtypeStruct(np.shape(leaf), _dtype(leaf), sharding=sharding)
        for leaf, sharding in zip(leaves, shardings)
    ]


def _dtype(leaf: Any) -> Any:
    dtype = getattr(leaf, "dtype", None)
    return dtype if dtype is not None else jax.numpy.result_type(leaf)
