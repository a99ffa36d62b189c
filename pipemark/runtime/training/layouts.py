"""How a training step's update lays out what it reads and writes on sub-meshes:
:func:`update_layouts`.

The parameters have the layout ``param_specs`` gives them; the gradients and the
optimizer state have none of their own. An optimizer such as ``optax.adamw`` updates each
parameter from its own gradient and its own moments, elementwise: ``mu = b1 * mu + (1 -
b1) * g``, ``p - lr * mu / (sqrt(nu) + eps)``. Values tied by elementwise equations of
one shape are laid out alike, so each takes the spec of the parameter it is tied to: a
gradient is accumulated (and reduce-scattered) into its parameter's shards, and the
moments of a parameter sharded over the data axis (FSDP) are sharded the same way, each
device updating its shard. A value tied to no parameter, or to two of different
specs, gets no spec (replicated). A layout is only where values lie, never what they
are: a value given a poor one is moved by ``jax.jit``, not computed differently.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> def update(w, mu, g):
...     mu = 0.9 * mu + 0.1 * g
...     return w - 0.01 * mu, mu, jnp.sum(g * g)
>>> cj = jax.make_jaxpr(update)(jnp.ones((4, 2)), jnp.ones((4, 2)), jnp.ones((4, 2)))
>>> inputs, outputs = update_layouts(cj.jaxpr, {0: P("data", None)})
>>> inputs, outputs
([P('data', None), P('data', None), P('data', None)], [P('data', None), P('data', None), None])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var
from jax.sharding import PartitionSpec as P

__all__ = ["StepLayouts", "step_layouts", "update_layouts"]

#: Primitives whose operands and result may share a shape without their elements
#: corresponding (a square matrix transposed, a product, a sort): they tie nothing.
_NOT_ELEMENTWISE = frozenset(
    (
        "transpose", "rev", "dot_general", "conv_general_dilated", "sort", "cumsum",
        "cumprod", "cummax", "cummin", "cumlogsumexp", "fft", "argsort", "gather",
        "scatter", "scatter-add", "scatter_add", "dynamic_slice", "dynamic_update_slice",
        "reduce_window", "pad", "slice", "concatenate", "reshape", "squeeze",
        "expand_dims", "broadcast_in_dim", "iota", "rng_bit_generator", "random_bits",
        "top_k", "all_gather", "psum", "ppermute",
    )
)  # fmt: skip


def update_layouts(
    jaxpr: Jaxpr, known: Mapping[int, Any]
) -> tuple[list[Any | None], list[Any | None]]:
    """Per input and per output of ``jaxpr``, the spec of the inputs in ``known`` (input
    index -> ``PartitionSpec``) it is tied to by elementwise equations of one shape, or
    ``None``. An input of ``known`` keeps its own spec."""
    parent: dict[Var, Var] = {}

    def root(var: Var) -> Var:
        while var in parent:
            var = parent[var]
        return var

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _NOT_ELEMENTWISE or _has_body(eqn.params):
            continue
        arrays = [v for v in (*eqn.invars, *eqn.outvars) if _array(v)]
        if not arrays or len({tuple(v.aval.shape) for v in arrays}) != 1:
            continue  # a reduction, a broadcast: the shapes differ
        first = root(arrays[0])
        for var in arrays[1:]:
            other = root(var)
            if other is not first:
                parent[other] = first
    specs: dict[Var, Any] = {}
    clashes: set[Var] = set()
    for index, spec in known.items():
        var = jaxpr.invars[index]
        group = root(var)
        if group in specs and specs[group] != spec:
            clashes.add(group)
        specs.setdefault(group, spec)

    def spec_of(atom: Any, own: Any = None) -> Any:
        if own is not None:
            return own
        if not _array(atom):
            return None
        group = root(atom)
        return None if group in clashes else specs.get(group)

    inputs = [spec_of(v, known.get(i)) for i, v in enumerate(jaxpr.invars)]
    outputs = [spec_of(v) for v in jaxpr.outvars]
    return inputs, outputs


def _array(atom: Any) -> bool:
    """Whether ``atom`` is a variable holding an array of at least one dimension."""
    return (
        isinstance(atom, Var)
        and not isinstance(atom, Literal)
        and bool(getattr(atom.aval, "shape", ()))
    )


def _has_body(params: Mapping[str, Any]) -> bool:
    """Whether an equation has a sub-jaxpr (a call, a loop, a custom rule): its results
    are not tied to its operands elementwise."""
    return any(
        hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns")
        for value in params.values()
    )


class StepLayouts(NamedTuple):
    """A training step's layouts on sub-meshes (:func:`step_layouts`)."""

    #: Per leaf of the state (the step's arguments but the batch): its spec.
    state: list[Any]
    #: Per value the gradient part hands the update (a gradient, the loss): the spec
    #: it is accumulated into.
    results: list[Any]
    #: Per position of the update's value table (its inputs, then its results) that
    #: has one: its spec.
    table: dict[int, Any]


def step_layouts(
    compute: ClosedJaxpr, apply: ClosedJaxpr, state_specs: Sequence[Any], num_args: int
) -> StepLayouts:
    """The layouts of a training step cut into ``compute`` (the gradient part, reading
    the state leaves and the batch) and ``apply`` (the update, reading the step's
    ``num_args`` argument leaves and then ``compute``'s results), with ``state_specs``
    a spec per state leaf (``P()`` where ``param_specs`` gives none). A state leaf the
    gradient part does not read (the optimizer state) and ``param_specs`` leaves
    replicated takes the spec of the parameter its update is tied to
    (:func:`update_layouts`), as do the gradients.

    >>> import jax, jax.numpy as jnp
    >>> import pipemark as pm
    >>> def step(w, mu, x):
    ...     g = pm.mark_gradient(jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w))
    ...     mu = 0.9 * mu + g
    ...     return w - 0.1 * mu, mu
    >>> args = (jnp.ones((4, 2)), jnp.zeros((4, 2)), jnp.ones((3, 4)))
    >>> compute, apply = pm.passes.split_at_gradient(jax.make_jaxpr(step)(*args))
    >>> layouts = step_layouts(compute, apply, [P("data", None), P()], num_args=3)
    >>> layouts.state, layouts.results
    ([P('data', None), P('data', None)], [P('data', None)])
    """
    known = {i: spec for i, spec in enumerate(state_specs) if spec != P()}
    inputs, outputs = update_layouts(apply.jaxpr, known)
    read = _read_inputs(compute.jaxpr)
    state = [
        spec if spec != P() or i in read or inputs[i] is None else inputs[i]
        for i, spec in enumerate(state_specs)
    ]
    num_results = len(apply.jaxpr.invars) - num_args
    results = [inputs[num_args + r] or P() for r in range(num_results)]
    table = {i: spec for i, spec in enumerate(state) if spec != P()}
    table.update((num_args + r, spec) for r, spec in enumerate(results) if spec != P())
    first = len(apply.jaxpr.invars)
    table.update((first + k, spec) for k, spec in enumerate(outputs) if spec is not None)
    return StepLayouts(state, results, table)


def _read_inputs(jaxpr: Jaxpr) -> set[int]:
    """The indices of ``jaxpr``'s inputs that an equation or an output reads."""
    used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    used.update(v for v in jaxpr.outvars if isinstance(v, Var))
    return {i for i, v in enumerate(jaxpr.invars) if v in used}
