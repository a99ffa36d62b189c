"""One call from a function to a staged program: :func:`split`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pipemark.errors import PipemarkError
from pipemark.passes.auto import auto_layers
from pipemark.passes.insert import layers_from_boundaries
from pipemark.passes.slice import slice_stages
from pipemark.primitive import pipeline_p
from pipemark.staged import StagedJaxpr

__all__ = ["split"]


def split(
    fn: Callable[..., Any],
    *args: Any,
    num_stages: int | None = None,
    unmarked: str = "assign",
) -> StagedJaxpr:
    """Trace ``fn(*args)`` and cut it into stages at the markers it contains.

    A program marked with :func:`pipemark.mark_pipeline_boundary` is first turned into
    start/end layers with :func:`pipemark.passes.layers_from_boundaries`; a program
    marked with start/end pairs (:func:`pipemark.mark`) is sliced as it is. Equations
    outside every stage are handled as ``unmarked`` says (see
    :func:`pipemark.passes.slice_stages`).

    The staged program takes the same arguments as ``fn`` (pytrees are flattened) and
    returns ``fn``'s results as a flat list.

    Parameters
    ----------
    fn:
        The function to split, e.g. a loss or ``jax.value_and_grad(loss)``.
    *args:
        Example arguments (arrays or ``jax.ShapeDtypeStruct``) to trace with.
    num_stages:
        Balance the program automatically into this many stages with
        :func:`pipemark.passes.auto_layers` (``fn`` must then have no stage markers).
        For a ``value_and_grad`` function these are the forward stages; the backward
        part gets as many mirrored ``_backward`` stages.
    unmarked:
        ``"assign"`` or ``"error"``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = jnp.sin(x)
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> staged = pm.split(f, 1.0)
    >>> [s.name for s in staged.stages]
    ['layer0', 'layer1']
    >>> staged.verify(f, 1.0)
    """
    if not callable(fn):
        raise PipemarkError(f"split: fn must be callable, got {type(fn).__name__}.")
    cj = jax.make_jaxpr(fn)(*args)
    if num_stages is not None:
        return slice_stages(auto_layers(cj, num_stages), unmarked=unmarked)
    if any(
        eqn.primitive is pipeline_p and eqn.params.get("mark_type") == "boundary"
        for eqn in cj.jaxpr.eqns
    ):
        cj = layers_from_boundaries(cj)
    return slice_stages(cj, unmarked=unmarked)
