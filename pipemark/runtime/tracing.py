"""What the planner traces: one microbatch of the loss, checked, and its
``value_and_grad``.

:func:`replica_batch` gives the types of one microbatch (on sub-meshes with a data
axis, one replica's rows of it); :func:`trace_loss` traces ``loss_fn`` on them once and
checks what it returns; :func:`loss_over_microbatches` refuses a mean that cannot be
averaged per microbatch, or has a sum count its batch-free terms once;
:func:`trace_value_and_grad` differentiates the traced program (not ``loss_fn``
again). :mod:`pipemark.runtime.pipeline_stages` then cuts it into stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from pipemark.errors import PipemarkError
from pipemark.passes.inline import inline_calls
from pipemark.runtime.devices.placement import available_slots
from pipemark.runtime.losses import count_batch_free_terms_once, find_batch_normaliser
from pipemark.runtime.options import PipelineOptions

__all__ = [
    "loss_over_microbatches",
    "microbatch_structs",
    "replica_batch",
    "replicas_of",
    "trace_loss",
    "trace_value_and_grad",
]


def microbatch_structs(batch: Any, num_microbatches: int) -> tuple[list[Any], int]:
    """The ShapeDtypeStruct of one microbatch of each batch leaf, and the microbatch
    size."""
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise PipemarkError(
            "The batch has no arrays to split into microbatches; pass the data as the "
            "second argument, loss_fn(params, batch)."
        )
    sizes = set()
    for i, leaf in enumerate(leaves):
        shape = np.shape(leaf)
        if len(shape) == 0:
            raise PipemarkError(
                f"Batch leaf {i} is a scalar; every batch array needs a leading batch axis "
                "to split into microbatches. Move scalars into params or close over them "
                "in loss_fn."
            )
        sizes.add(shape[0])
    if len(sizes) != 1:
        raise PipemarkError(
            f"The batch arrays have different leading sizes {sorted(sizes)}; all of them "
            "must share the batch axis (axis 0) that is split into microbatches."
        )
    (size,) = sizes
    if size % num_microbatches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise PipemarkError(
            f"A batch of {size} does not split into {num_microbatches} equal microbatches. "
            f"Use num_microbatches in {divisors}, or pad the batch to a multiple of "
            f"{num_microbatches}."
        )
    micro = size // num_microbatches
    structs = [jax.ShapeDtypeStruct((micro, *np.shape(x)[1:]), jnp.result_type(x)) for x in leaves]
    return structs, micro


def replica_batch(batch: Any, options: PipelineOptions) -> tuple[Any, int, int]:
    """What a stage program is traced for: the batch's tree of ShapeDtypeStructs for one
    replica's rows of one microbatch (on sub-meshes with a data axis, a microbatch is
    split into replicas), the microbatch's rows and the number of replicas."""
    structs, micro = microbatch_structs(batch, options.num_microbatches)
    replicas = replicas_of(options, micro)
    structs = [
        jax.ShapeDtypeStruct((s.shape[0] // replicas, *s.shape[1:]), s.dtype) for s in structs
    ]
    tree = jax.tree_util.tree_structure(batch)
    return jax.tree_util.tree_unflatten(tree, structs), micro, replicas


def replicas_of(options: PipelineOptions, microbatch_size: int) -> int:
    """The data-parallel replicas each microbatch is split into (1 without a mesh, or
    without a data axis), checked to divide the microbatch's rows."""
    if options.mesh is None:
        return 1
    replicas = available_slots(options)[0].replicas
    if microbatch_size % replicas:
        raise PipemarkError(
            f"A microbatch of {microbatch_size} rows does not split into {replicas} "
            f"data-parallel replicas (the mesh's {options.data_axis!r} axis). Use a batch "
            f"that is a multiple of num_microbatches x {replicas}, or fewer microbatches."
        )
    return replicas


def trace_loss(loss_fn: Callable, params: Any, batch_structs: Any) -> ClosedJaxpr:
    """The loss traced for one microbatch, its calls inlined: the one trace of
    ``loss_fn`` that the checks, the rewrites and the differentiation all read."""
    cj, out = jax.make_jaxpr(loss_fn, return_shape=True)(params, batch_structs)
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != 1 or not hasattr(out, "shape"):
        raise PipemarkError(
            f"loss_fn returns {jax.tree_util.tree_structure(out)}, not one array. "
            "pipeline_value_and_grad differentiates a scalar loss: return only the loss "
            "(auxiliary outputs are not supported)."
        )
    if out.shape != () or not jnp.issubdtype(out.dtype, jnp.inexact):
        raise PipemarkError(
            f"loss_fn returns {out.dtype}{list(out.shape)}; pipeline_value_and_grad needs a "
            "scalar floating-point loss. Reduce it over the batch (jnp.mean or jnp.sum, "
            "and pass loss_reduction= accordingly)."
        )
    return inline_calls(cj)


def loss_over_microbatches(
    loss: ClosedJaxpr, num_param_leaves: int, options: PipelineOptions, evaluations: int
) -> ClosedJaxpr:
    """The traced ``loss`` as the pipeline adds it up over ``evaluations`` microbatches
    (and replicas): a mean is refused where it is normalised by a count from the batch;
    with a sum, the terms that do not read the batch (weight decay) count once, not per
    microbatch."""
    if options.loss_reduction == "mean":
        _refuse_batch_normaliser(loss, num_param_leaves)
        return loss
    return count_batch_free_terms_once(loss, num_param_leaves, evaluations)


def _refuse_batch_normaliser(loss: ClosedJaxpr, num_param_leaves: int) -> None:
    """A mean normalised by a count from the batch cannot be averaged per microbatch."""
    found = find_batch_normaliser(loss, num_param_leaves)
    if found is not None:
        raise PipemarkError(
            f"loss_fn divides by a count computed from the batch at {found} (a masked or "
            "weighted mean). Averaging it per microbatch differs from the mean over the "
            "whole batch, and a microbatch that is all padding divides 0 by 0. Return "
            "(sum, count) instead, e.g. (jnp.sum(losses * mask), jnp.sum(mask)), and pass "
            "loss_reduction='sum_over_count'."
        )


def trace_value_and_grad(
    loss: ClosedJaxpr, params: Any, batch_structs: Any
) -> tuple[ClosedJaxpr, Any]:
    """``value_and_grad`` of the traced ``loss`` (of the program, not of ``loss_fn``
    again), traced for ``params`` and one microbatch's ``batch_structs``: the program
    and its output tree."""
    program = jaxpr_as_fun(loss)

    def replayed(params: Any, batch: Any) -> Any:
        leaves = jax.tree_util.tree_leaves((params, batch))
        return program(*leaves)[0]

    cj, out_shape = jax.make_jaxpr(jax.value_and_grad(replayed), return_shape=True)(
        params, batch_structs
    )
    return cj, jax.tree_util.tree_structure(out_shape)
