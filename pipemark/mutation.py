"""Updates a traced program cannot see: a function that changes its arguments in place.

A jaxpr returns only what the traced function returns. A training step that updates
its state in place (a flax ``nnx.jit`` step calling ``nnx.Optimizer.update``, which
writes new values into the module's ``Variable``\\ s, or a step that assigns into a
dict it was given) computes the new state and then drops it: the traced program returns
the loss alone and the update is lost without a word. :func:`call_watching_arguments`
calls a function under a trace and refuses such a call with a
:class:`StateMutationError` that says how to write the step instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

# StateMutationError is defined with the other errors; it is imported from here too.
from pipemark.errors import StateMutationError

__all__ = ["call_watching_arguments"]


_ADVICE = (
    "A traced program returns only what the function returns, so these updates would be "
    "lost (the program would return, say, the loss alone). Return the new state instead. "
    "With flax nnx, trace a function of the state: graphdef, state = "
    "nnx.split((model, optimizer)); def step(state, batch): model, optimizer = "
    "nnx.merge(graphdef, state); ...; optimizer.update(model, grads); return loss, "
    "nnx.state((model, optimizer)). With a dict of arrays, return a new dict rather than "
    "assigning into the one given."
)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[tuple[str, Any]]]:
    """The arguments' tree structure and their leaves named like ``args[0]['w']``."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    names = ["args", "kwargs"]
    return treedef, [
        (names[path[0].idx] + jax.tree_util.keystr(path[1:]), leaf) for path, leaf in with_paths
    ]


def call_watching_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> Any:
    """``fn(*args, **kwargs)``, called while tracing, refusing a call that replaced
    floating-point traced leaves of its arguments in place with values it does not
    return (or changed the arguments' structure). Integer leaves (an RNG counter) are
    not watched.

    Parameters
    ----------
    fn:
        The function being traced.
    args, kwargs:
        Its arguments, whose array leaves are tracers of the current trace.

    Raises
    ------
    StateMutationError
        When after the call an argument's leaf is no longer the tracer it was and the
        new value is not among the results, naming the leaves' paths and how to return
        the new state instead.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> def step(state, x):
    ...     state["w"] = state["w"] - 0.1 * x  # in place: lost by the trace
    ...     return jnp.sum(x)
    >>> jax.make_jaxpr(lambda s, x: call_watching_arguments(step, (s, x)))({"w": 1.0}, 2.0)
    Traceback (most recent call last):
    ...
    pipemark.errors.StateMutationError: step changed its arguments in place: args[0]['w']. ...
    """
    kwargs = kwargs or {}
    before_tree, before = _leaves(args, kwargs)
    out = fn(*args, **kwargs)
    after_tree, after = _leaves(args, kwargs)
    returned = {id(leaf) for leaf in jax.tree_util.tree_leaves(out)}
    if after_tree != before_tree:
        changed = ["the structure of the arguments"]
    else:
        # A new value the function also returns is not lost (nnx.merge inside the step
        # writes into the state it was given, and the step returns nnx.state(...)).
        # Only floating-point state counts: parameters, optimizer moments, statistics.
        # A counter (nnx.Dropout's RNG count) advanced inside a loss is dropped by
        # jax.jit alike, and refusing it would refuse every loss with dropout.
        changed = [
            path
            for (path, old), (_, new) in zip(before, after)
            if isinstance(old, Tracer)
            and jnp.issubdtype(old.dtype, jnp.inexact)
            and new is not old
            and id(new) not in returned
        ]
    if changed:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        shown = ", ".join(changed[:4]) + (
            f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        )
        raise StateMutationError(f"{name} changed its arguments in place: {shown}. {_ADVICE}")
    return out
