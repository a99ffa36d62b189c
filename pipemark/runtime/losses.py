"""Loss reductions over microbatches, and the losses that cannot be split.

``"mean"`` averages the microbatch losses and gradients (right for ``jnp.mean`` over
equal microbatches), ``"sum"`` adds them, and ``"sum_over_count"`` takes a loss that
returns ``(sum, count)`` (the summed per-token losses and the number of valid tokens)
and divides the sums over the whole batch by the count over the whole batch: a masked
or weighted mean, exactly as the unsplit program computes it, with no 0 / 0 on a
microbatch that is all padding.

With ``"sum"`` (and ``"sum_over_count"``), a term of the loss that does not read the
batch (weight decay over the parameters, a constant) is the same in every microbatch;
added over the microbatches it would count ``num_microbatches`` times, where the whole
batch's loss counts it once. :func:`count_batch_free_terms_once` divides such terms of
the loss's final sum by the number of microbatches before it is differentiated.

A loss normalised by a count computed from the batch (``sum(l * mask) / sum(mask)``)
gives, averaged per microbatch, another number than over the whole batch. With
``"mean"`` such a division is found in the traced loss and refused
(:func:`find_batch_normaliser`), pointing to ``"sum_over_count"``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from pipemark.errors import describe_eqn
from pipemark.passes.rewrite import dce

__all__ = [
    "LOSS_REDUCTIONS",
    "count_batch_free_terms_once",
    "find_batch_normaliser",
    "microbatch_share",
    "split_count",
]

LOSS_REDUCTIONS = ("mean", "sum", "sum_over_count")


def microbatch_share(value: Any, scale: Any) -> Any:
    """A microbatch's share of an accumulated result: ``value * scale`` (``scale`` is
    ``1/M`` for a mean, 1 for a sum, as an array so that one compiled program serves
    every number of microbatches), in ``value``'s dtype; an integer result (a count) is
    not scaled. The one rule every compiled stage program accumulates by.

    >>> import jax.numpy as jnp
    >>> microbatch_share(jnp.float32(3.0), jnp.float32(0.5)), microbatch_share(jnp.int32(3), 0.5)
    (Array(1.5, dtype=float32), Array(3, dtype=int32))
    """
    if jnp.issubdtype(value.dtype, jnp.inexact):
        return value * scale.astype(value.dtype)
    return value


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


# Primitives through which a sum's terms are followed: (first, second operand's sign).
_SUMS = {"add": (1, 1), "add_any": (1, 1), "sub": (1, -1), "neg": (-1, None)}


def _batch_dependent(jaxpr: Any, num_param_leaves: int) -> set:
    """Every variable of ``jaxpr`` computed from a batch input (an equation reading one,
    inside any sub-program, counts wholly)."""
    dependent = set(jaxpr.invars[num_param_leaves:])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return dependent


def _sum_terms(jaxpr: Any, out: Any) -> list[tuple[int, Any]]:
    """``out`` as a signed sum of terms ``[(sign, atom), ...]``, following the additions,
    subtractions and negations (of equal shapes) that compute it."""
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    terms: list[tuple[int, Any]] = []
    stack = [(1, out)]
    while stack:
        sign, atom = stack.pop()
        eqn = None if isinstance(atom, Literal) else producer.get(atom)
        signs = _SUMS.get(eqn.primitive.name) if eqn is not None else None
        if signs is None or any(v.aval.shape != atom.aval.shape for v in eqn.invars):
            terms.append((sign, atom))
            continue
        for operand, operand_sign in zip(eqn.invars, signs):
            stack.append((sign * operand_sign, operand))
    return terms


def count_batch_free_terms_once(
    cj: ClosedJaxpr, num_param_leaves: int, num_microbatches: int
) -> ClosedJaxpr:
    """``cj`` (inputs: the params' leaves, then the batch's) with every output that is a
    sum rewritten so that its terms that do not read the batch are divided by
    ``num_microbatches``: added over the microbatches, each such term then counts
    once, as in the whole batch's sum. ``cj`` itself when no output has such a term, or
    for one microbatch.

    The terms are those of the output's outermost sum (``+``, ``-``, negation); a
    batch-free term hidden under another operation, like ``2 * (data + decay)``, is not
    found.

    >>> import jax, jax.numpy as jnp
    >>> from jax.extend.core import jaxpr_as_fun
    >>> def loss(w, x):
    ...     return jnp.sum((x * w) ** 2) + 0.1 * w**2
    >>> cj = jax.make_jaxpr(loss)(1.0, jnp.ones(4))
    >>> new = count_batch_free_terms_once(cj, 1, num_microbatches=2)
    >>> round(float(jaxpr_as_fun(new)(1.0, jnp.ones(4))[0]), 4)  # 4 + 0.1 / 2
    4.05
    """
    if num_microbatches == 1:
        return cj
    jaxpr = cj.jaxpr
    dependent = _batch_dependent(jaxpr, num_param_leaves)
    # Per output, its terms as (sign, atom, batch-free). Only floating-point outputs are
    # rewritten: an integer one is added as it is, and scaling would round it away.
    outputs = [
        [
            (sign, atom, isinstance(atom, Literal) or atom not in dependent)
            for sign, atom in _sum_terms(jaxpr, out)
        ]
        if jnp.issubdtype(out.aval.dtype, jnp.inexact)
        else [(1, out, False)]
        for out in jaxpr.outvars
    ]
    if not any(free for terms in outputs for *_, free in terms):
        return cj
    atoms = [atom for terms in outputs for _, atom, _ in terms]
    paths = tuple(f"term[{i}]" for i in range(len(atoms)))
    debug_info = jaxpr.debug_info._replace(result_paths=paths)
    terms_program = jaxpr_as_fun(
        dce(ClosedJaxpr(jaxpr.replace(outvars=atoms, debug_info=debug_info), cj.consts))
    )
    scale = 1.0 / num_microbatches

    def rewritten(*inputs: Any) -> list[Any]:
        values = iter(terms_program(*inputs))
        results = []
        for out, terms in zip(jaxpr.outvars, outputs):
            total = None
            for sign, _, free in terms:
                value = next(values)
                term = (value * scale if free else value) * sign
                total = term if total is None else total + term
            results.append(total.astype(out.aval.dtype))
        return results

    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(rewritten)(*structs)
