"""Keeping a training step's state in host memory between steps (issue 59): which
leaves of the state are offloaded, and the host memory kind they lie in.

``pipeline_train_step(..., offload="optimizer")`` keeps each leaf of the optimizer
state (a leaf of the state that no stage of the pipeline reads, only the update) in
the devices' host memory kind between steps: the update's part that reads it brings it
to its slot's device memory (``jax.device_put`` with its device layout), runs, and
writes the new value straight to host memory (the part's ``out_shardings`` carry the
host memory kind). Which result is a leaf's new value: the step returns its new state
first, laid out as its arguments but the batch (``(new_params, new_opt_state, ...)``
for ``step(params, opt_state, batch)``), as :func:`pipemark.examples.train_step` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from pipemark.errors import HostMemoryError
from pipemark.runtime.plan import PipelinePlan

__all__ = ["HOST_KINDS", "OFFLOADS", "check_offload", "host_memory_kind", "offloaded_leaves"]

#: What ``offload=`` accepts: ``None`` (the default: everything on the devices),
#: ``"optimizer"``, ``"params"`` or ``"params+optimizer"``.
OFFLOADS = (None, "optimizer", "params", "params+optimizer")

#: The memory kinds JAX names host memory by, the preferred first.
HOST_KINDS = ("pinned_host", "unpinned_host")


def check_offload(offload: Any) -> None:
    """Refuse an ``offload`` that :data:`OFFLOADS` does not name.

    >>> check_offload("optimizer")
    """
    if offload in OFFLOADS:
        return
    raise HostMemoryError(
        f"pipeline_train_step: offload must be None (the state stays on the devices), "
        f'"optimizer", "params" or "params+optimizer" (what waits in host memory '
        f"between steps), got {offload!r}."
    )


def host_memory_kind(devices: Sequence[Any]) -> str:
    """The host memory kind every one of ``devices`` has (:data:`HOST_KINDS`, the
    first that all have), for the state offloaded there.

    >>> import jax
    >>> host_memory_kind(jax.devices()[:1])  # on CPU too, from JAX 0.10.2 on
    'pinned_host'
    """
    kinds = [{m.kind for m in d.addressable_memories()} for d in devices]
    for kind in HOST_KINDS:
        if all(kind in have for have in kinds):
            return kind
    have = sorted(set.intersection(*kinds)) if kinds else []
    raise HostMemoryError(
        f"pipeline_train_step(offload=...): the devices {[str(d) for d in devices]} have "
        f"no host memory kind ({' or '.join(HOST_KINDS)}); their memories are {have}. "
        "Run without offload (offload=None), give the pipeline more stages or devices, "
        "or use a JAX version and backend with host memory kinds (TPU; CPU from JAX 0.10.2)."
    )


def offloaded_leaves(
    plan: PipelinePlan, state: Sequence[Any], out_shape: Any, offload: str = "optimizer"
) -> dict[int, int]:
    """Per leaf of the optimizer state (a leaf of ``state``, the step's arguments but
    the batch, that no stage of ``plan`` reads), the index among the step's result
    leaves of its new value: the same index, the step returning its new state first,
    laid out as ``state`` (checked: else a :class:`HostMemoryError` says so). With
    ``"params"`` in ``offload``, the same for each parameter leaf that one slot's stages
    read (a tied weight that two slots read stays on the devices)."""
    if plan.placement.distributed:
        raise HostMemoryError(
            "pipeline_train_step(offload=...) under jax.distributed is not supported yet: "
            "run with offload=None there."
        )
    leaves, treedef = jax.tree_util.tree_flatten(tuple(state))
    outs = tuple(out_shape[: len(state)]) if isinstance(out_shape, (tuple, list)) else None
    out_leaves, out_def = jax.tree_util.tree_flatten(outs)
    if (
        outs is None
        or out_def != treedef
        or any(
            (jax.numpy.shape(a), jax.numpy.result_type(a)) != (b.shape, b.dtype)
            for a, b in zip(leaves, out_leaves)
        )
    ):
        raise HostMemoryError(
            "pipeline_train_step(offload=...) needs the step to return its new state "
            "first, laid out as its arguments but the batch (e.g. return new_params, "
            "new_opt_state, loss for step(params, opt_state, batch)): so it knows which "
            "result replaces which leaf kept in host memory. Return it so, or run "
            "with offload=None."
        )
    readers: dict[int, set[int]] = {}
    for worker, read in enumerate(plan.steps.params):
        for leaf in read:
            readers.setdefault(leaf, set()).add(worker)
    if "params" in offload and plan.param_specs is not None:
        raise HostMemoryError(
            f'pipeline_train_step(offload="{offload}") on sub-meshes (mesh=) is not '
            'supported yet: offload="optimizer" is, or run with offload=None.'
        )
    chosen = {
        i
        for i in range(len(leaves))
        if ("optimizer" in offload and i not in readers)
        or ("params" in offload and len(readers.get(i, ())) == 1)
    }
    return {i: i for i in sorted(chosen)}
