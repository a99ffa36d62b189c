"""How the runtime takes a loss's arguments: ``loss_fn(params, *batch)``.

``params`` may hold leaves that are not arrays (an equinox module's activation
function): they are static, as ``eqx.filter_value_and_grad`` holds them, and their
gradients come back as ``None``; a training step's arguments and results may hold such
leaves too (:func:`partition_untraceable`). Every batch argument is split into microbatches along
its leading axis; errors name the argument (``batch argument 1 (y)``).
"""

from __future__ import annotations

import inspect as _pyinspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from pipemark.errors import PipemarkError

__all__ = [
    "PartitionedParams",
    "batch_arg_names",
    "check_batch_args",
    "partition_params",
    "partition_untraceable",
]


def _is_array(leaf: Any) -> bool:
    # As eqx.is_array: JAX and NumPy arrays (and NumPy scalars) are differentiated,
    # everything else is static.
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclass(frozen=True)
class PartitionedParams:
    """``params`` split into its array leaves (``dynamic``, ``None`` elsewhere) and the
    rest (``static``, ``None`` at the arrays; ``None`` itself when every leaf is an
    array); ``key`` tells static parts apart (by
    identity) for caching compiled plans."""

    dynamic: Any
    static: Any
    key: tuple[Any, ...]

    def combine(self, dynamic: Any) -> Any:
        """The full params from a pytree shaped like :attr:`dynamic`."""
        if self.static is None:  # every leaf is an array
            return dynamic
        return jax.tree_util.tree_map(
            lambda d, s: s if d is None else d,
            dynamic,
            self.static,
            is_leaf=lambda x: x is None,
        )


def _is_traceable(leaf: Any) -> bool:
    # What jax.jit traces: arrays, and Python and NumPy scalars (weakly typed).
    return _is_array(leaf) or isinstance(leaf, (bool, int, float, complex))


def partition_untraceable(tree: Any) -> PartitionedParams:
    """Split ``tree`` (a training step's arguments, or its results) into the leaves JAX
    traces (arrays and scalars) and the rest (an equinox module's activation function, a
    string), which are static, as ``eqx.filter_jit`` holds them.

    >>> import jax.numpy as jnp
    >>> part = partition_untraceable(({"w": jnp.ones(2), "act": jnp.tanh, "n": 3},))
    >>> part.dynamic[0]["act"] is None, part.dynamic[0]["n"], part.static[0]["act"] is jnp.tanh
    (True, 3, True)
    """
    return _partition(tree, _is_traceable)


def partition_params(params: Any) -> PartitionedParams:
    """Split ``params`` into arrays and static leaves.

    >>> import jax.numpy as jnp
    >>> part = partition_params({"w": jnp.ones(2), "act": jnp.tanh})
    >>> part.dynamic["act"] is None and part.static["w"] is None
    True
    """
    return _partition(params, _is_array)


def _partition(tree: Any, traced: Callable[[Any], bool]) -> PartitionedParams:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [traced(leaf) for leaf in leaves]
    if all(arrays):  # nothing static (run on every call: no trees rebuilt)
        return PartitionedParams(tree, None, (treedef, None))
    dynamic = treedef.unflatten([x if a else None for x, a in zip(leaves, arrays)])
    static = treedef.unflatten([None if a else x for x, a in zip(leaves, arrays)])
    key = (treedef, tuple(None if a else (type(x), id(x)) for x, a in zip(leaves, arrays)))
    return PartitionedParams(dynamic, static, key)


def batch_arg_names(loss_fn: Callable[..., Any], count: int) -> list[str]:
    """A name per batch argument: ``batch argument 1 (y)`` when ``loss_fn`` names its
    parameters, else ``batch argument 1``."""
    names: list[str | None] = [None] * count
    try:
        params = list(_pyinspect.signature(loss_fn).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    for i, param in enumerate(params[:count]):
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names[i] = param.name
    return [f"batch argument {i}" + (f" ({n})" if n else "") for i, n in enumerate(names)]


def check_batch_args(names: Sequence[str], batch: Sequence[Any], num_microbatches: int) -> None:
    """Every batch argument has arrays that share one leading size, divisible into
    ``num_microbatches``; otherwise a :class:`PipemarkError` naming the argument."""
    sizes: dict[str, int] = {}
    for name, arg in zip(names, batch):
        leaves = jax.tree_util.tree_leaves(arg)
        if not leaves:
            raise PipemarkError(f"{name} holds no arrays to split into microbatches.")
        for leaf in leaves:
            shape = np.shape(leaf)
            if not shape:
                raise PipemarkError(
                    f"{name} holds a scalar; every batch array needs a leading batch axis "
                    "to split into microbatches. Close over scalars in loss_fn instead."
                )
            sizes.setdefault(name, shape[0])
            if shape[0] != sizes[name]:
                raise PipemarkError(
                    f"{name} holds arrays of leading sizes {sizes[name]} and {shape[0]}; "
                    "all batch arrays share the batch axis (axis 0)."
                )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} has {size} rows" for name, size in sizes.items())
        raise PipemarkError(f"The batch arguments differ in size: {listed}; they must agree.")
    for name, size in sizes.items():
        if size % num_microbatches:
            raise PipemarkError(
                f"{name} has {size} rows, which do not split into {num_microbatches} equal "
                "microbatches; pad the batch or choose another num_microbatches."
            )
