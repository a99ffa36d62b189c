"""Loss reductions over microbatches, and the losses that cannot be split.

``"mean"`` averages the microbatch losses and gradients (right for ``jnp.mean`` over
equal microbatches), ``"sum"`` adds them, and ``"sum_over_count"`` takes a loss that
returns ``(sum, count)`` (the summed per-token losses and the number of valid tokens)
and divides the sums over the whole batch by the count over the whole batch: a masked
or weighted mean, exactly as the unsplit program computes it, with no 0 / 0 on a
microbatch that is all padding.

A loss normalised by a count computed from the batch (``sum(l * mask) / sum(mask)``)
gives, averaged per microbatch, another number than over the whole batch. With
``"mean"`` such a division is found in the traced loss and refused
(:func:`find_batch_normaliser`), pointing to ``"sum_over_count"``.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Literal

from pipemark.errors import describe_eqn

__all__ = ["LOSS_REDUCTIONS", "find_batch_normaliser", "split_count"]

LOSS_REDUCTIONS = ("mean", "sum", "sum_over_count")


def find_batch_normaliser(cj: ClosedJaxpr, num_param_leaves: int) -> str | None:
    """The description of a division in the loss program ``cj`` (inputs: the params'
    leaves, then the batch's) whose divisor depends on the batch and not on the
    parameters: a count of valid tokens, a sum of weights. ``None`` when there is none.

    >>> import jax, jax.numpy as jnp
    >>> def masked(w, x, mask):
    ...     return jnp.sum((x * w) ** 2 * mask) / jnp.sum(mask)
    >>> cj = jax.make_jaxpr(masked)(1.0, jnp.ones(4), jnp.ones(4))
    >>> find_batch_normaliser(cj, 1).startswith("equation")
    True
    >>> cj = jax.make_jaxpr(lambda w, x: jnp.mean((x * w) ** 2))(1.0, jnp.ones(4))
    >>> find_batch_normaliser(cj, 1) is None
    True
    """
    jaxpr = cj.jaxpr
    from_params = set(jaxpr.invars[:num_param_leaves])
    from_batch = set(jaxpr.invars[num_param_leaves:])
    for index, eqn in enumerate(jaxpr.eqns):
        reads = [v for v in eqn.invars if not isinstance(v, Literal)]
        on_params = any(v in from_params for v in reads)
        on_batch = any(v in from_batch for v in reads)
        if eqn.primitive.name == "div" and not isinstance(eqn.invars[1], Literal):
            divisor = eqn.invars[1]
            # A scalar made from the batch alone: a count or a total weight. (Dividing
            # elementwise by batch values, or per example, splits fine.)
            if divisor.aval.shape == () and divisor in from_batch and divisor not in from_params:
                return describe_eqn(eqn, index)
        if on_params:
            from_params.update(eqn.outvars)
        if on_batch:
            from_batch.update(eqn.outvars)
    return None


def split_count(out: Any) -> tuple[Any, Any]:
    """``(sum, count)`` from what a ``"sum_over_count"`` loss returned."""
    from pipemark.errors import PipemarkError

    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise PipemarkError(
            "loss_reduction='sum_over_count' needs loss_fn to return (sum, count): the "
            "sum of the per-example (or per-token) losses and how many were counted, "
            f"e.g. (jnp.sum(losses * mask), jnp.sum(mask)); it returned {type(out).__name__}."
        )
    return out[0], out[1]
