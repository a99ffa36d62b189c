"""What both pipeline entry points (:class:`~pipemark.runtime.pipeline.Pipeline` and
:class:`~pipemark.runtime.train_step.PipelinedStep`) do around a call: the key a plan is
built for, a traced call, and, under ``jax.distributed``, bringing a parameter that
stages of several processes read to each of them, saying which process holds each result
(so that orbax saves it where it is) and where a restored leaf goes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipemark.runtime.devices.transport import CollectiveTransport
from pipemark.runtime.execution.perfetto import trace_events, write_trace
from pipemark.runtime.execution.run import run_plan
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.training.holdings import record_results
from pipemark.runtime.training.keeping import Reader, abstract_leaves, kept_shardings
from pipemark.runtime.training.orbax_arrays import install as install_orbax_handler
from pipemark.runtime.training.sharing import bring_shared_params

__all__ = ["record_holders", "restore_target", "shape_key", "shared_params_here", "traced_call"]


def shape_key(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], np.dtype], ...]]:
    """What a plan is built for: the tree's structure and each leaf's shape and dtype
    as JAX would trace it. Computed on every call: an array's own shape and dtype
    (``jnp.result_type`` costs about 15 µs a leaf), others through JAX's rules."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    types = []
    for x in leaves:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            types.append((x.shape, x.dtype))  # a typed random key: as it is
        elif isinstance(x, (jax.Array, np.ndarray)):
            types.append((x.shape, jax.dtypes.canonicalize_dtype(x.dtype)))
        else:  # a Python or NumPy scalar: its dtype is JAX's choice
            types.append((np.shape(x), np.dtype(jnp.result_type(x))))
    return structure, tuple(types)


def shared_params_here(plan: PipelinePlan, params: Any) -> Any:
    """``params`` (a call's parameters, this process's view) with each leaf that this
    process's stages read and another process holds alone brought here, and each leaf
    this process holds alone sent to the other processes that read it
    (:mod:`pipemark.runtime.training.sharing`). Every process calls it before the call runs."""
    if not plan.placement.distributed:
        return params
    leaves, treedef = jax.tree_util.tree_flatten(params)
    transport = CollectiveTransport(plan.watchdog, plan.placement.process)
    return treedef.unflatten(bring_shared_params(plan, leaves, transport))


def record_holders(
    plan: PipelinePlan, results: Sequence[Any], holders: Sequence[int | None]
) -> None:
    """Under ``jax.distributed``, say which process holds each of a call's results
    (:mod:`pipemark.runtime.training.holdings`), so that orbax saves them
    (:mod:`pipemark.runtime.training.orbax_arrays`)."""
    if plan.placement.distributed:
        record_results(plan.placement, results, holders)
        install_orbax_handler()


def restore_target(
    plan: PipelinePlan, leaves: Sequence[Any], readers: Sequence[Sequence[Reader]]
) -> list[Any]:
    """``leaves`` as ``jax.ShapeDtypeStruct`` s laid out where ``plan`` keeps each
    (:func:`~pipemark.runtime.training.keeping.kept_shardings` of its ``readers``): orbax's
    restore target. Under ``jax.distributed`` this installs pipemark's orbax handler,
    which restores a leaf kept by another process as held there."""
    shardings = kept_shardings(plan, readers)
    if plan.placement.distributed:
        install_orbax_handler()
    return abstract_leaves(leaves, shardings)


def traced_call(plan: PipelinePlan, params: Any, batch: Any, path: Any) -> dict:
    """A warm-up call of ``plan``, then one recorded, as a trace (written to ``path``)."""
    jax.block_until_ready(run_plan(plan, params, batch, None))
    records: list = []
    jax.block_until_ready(run_plan(plan, params, batch, None, records=records))
    trace = trace_events(plan, records)
    if path is not None:
        write_trace(path, trace)
    return trace
