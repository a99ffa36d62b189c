"""The staging entry: from a function (:func:`split`) or a traced program
(:func:`split_jaxpr`) to a staged program, and to its HTML view (:func:`show`). The
CLI and the runtime stage programs through :func:`split_jaxpr` too, so all of them cut,
name and route the backward pass alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr

from pipemark.errors import PipemarkError, check_closed_jaxpr
from pipemark.marks import STAGE_MARK_TYPES
from pipemark.passes.auto import check_block_cuts, plan_layers
from pipemark.passes.gradient import mark_apply_stage
from pipemark.passes.inline import inline_calls
from pipemark.passes.insert import layers_from_boundaries
from pipemark.passes.scan import layers_from_scans, scans_with_layer_markers
from pipemark.passes.slice import slice_stages
from pipemark.passes.stages import merge_consecutive
from pipemark.primitive import is_marker
from pipemark.signature import Signature
from pipemark.staged import StagedJaxpr
from pipemark.views.html_view import HTMLView, to_html

__all__ = ["cuts_at_marked_layers", "has_stage_markers", "show", "split", "split_jaxpr"]


def split(
    fn: Callable[..., Any],
    *args: Any,
    num_stages: int | None = None,
    unmarked: str = "assign",
    block_cuts: str = "prefer",
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    **kwargs: Any,
) -> StagedJaxpr:
    """Trace ``fn(*args, **kwargs)`` and cut it into stages at the markers it contains.

    A program marked with :func:`pipemark.mark_pipeline_boundary` is first turned into
    start/end layers with :func:`pipemark.passes.layers_from_boundaries`; a program
    marked with start/end pairs (:func:`pipemark.mark`) is sliced as it is. Equations
    outside every stage are handled as ``unmarked`` says (see
    :func:`pipemark.passes.slice_stages`).

    Arguments are traced as ``eqx.filter_jit`` traces them: array leaves (and Python
    numbers) become the program's inputs, every other leaf (an equinox module's
    activation function, a string) and the arguments named by ``static_argnums`` /
    ``static_argnames`` are static. The staged program is called like ``fn``, checks
    that its arguments have the traced pytree structure and static values
    (:class:`~pipemark.signature.SignatureError` otherwise), and returns ``fn``'s
    array results as a flat list.

    Parameters
    ----------
    fn:
        The function to split, e.g. a loss or ``jax.value_and_grad(loss)``.
    *args, **kwargs:
        Example arguments (pytrees of arrays or ``jax.ShapeDtypeStruct``) to trace
        with. ``num_stages``, ``unmarked``, ``block_cuts``, ``static_argnums`` and
        ``static_argnames`` are this function's own; to pass a keyword of that name to ``fn``, bind it
        with ``functools.partial``.
    num_stages:
        Without stage markers in ``fn``: balance the program automatically into this
        many stages with :func:`pipemark.passes.auto_layers`. With markers: merge
        consecutive marked stages into this many (:func:`pipemark.passes.merge_consecutive`),
        as the pipeline runtime and ``pipemark inspect --num-stages`` do. For a
        ``value_and_grad`` function these are the forward stages; the backward part gets
        as many mirrored ``_backward`` stages. The staged program's
        :attr:`~pipemark.staged.StagedJaxpr.balance` reports how balanced automatic
        stages are.
    unmarked:
        ``"assign"`` or ``"error"``.
    block_cuts:
        With ``num_stages``: cut between the model's repeated blocks when that costs
        little balance (``"prefer"``), always (``"require"``) or never look for them
        (``"off"``); see :func:`pipemark.passes.auto_layers`.
    static_argnums, static_argnames:
        Arguments held static, like :func:`jax.jit`'s.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x, *, scale):
    ...     x = jnp.sin(x) * scale
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> staged = pm.split(f, 1.0, scale=2.0)
    >>> [s.name for s in staged.stages]
    ['layer0', 'layer1']
    >>> staged.verify(f, 1.0, scale=2.0).passed
    True
    """
    if not callable(fn):
        raise PipemarkError(f"split: fn must be callable, got {type(fn).__name__}.")
    signature = Signature.of(
        args, kwargs, static_argnums=static_argnums, static_argnames=static_argnames, fn=fn
    )
    cj = signature.trace(fn, args, kwargs)
    staged = split_jaxpr(cj, num_stages=num_stages, unmarked=unmarked, block_cuts=block_cuts)
    return staged.with_signature(signature)


def split_jaxpr(
    cj: ClosedJaxpr,
    *,
    num_stages: int | None = None,
    unmarked: str = "assign",
    block_cuts: str = "prefer",
) -> StagedJaxpr:
    """What :func:`split` does after tracing, for a program traced already: inline
    calls (:func:`pipemark.passes.inline_calls`), then cut it into ``num_stages``
    balanced stages (:func:`pipemark.passes.auto_layers`), or at its markers (boundary
    markers through :func:`pipemark.passes.layers_from_boundaries`, a training step's
    update into an ``apply_grad`` stage) and slice it, merging consecutive marked
    stages into ``num_stages`` when it is given (:func:`pipemark.passes.merge_consecutive`).
    ``block_cuts`` is :func:`pipemark.passes.auto_layers`'s.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(jax.jit(lambda x: jnp.cos(jnp.sin(x))))(1.0)
    >>> [s.name for s in pm.split_jaxpr(cj, num_stages=2).stages]
    ['layer0', 'layer1']
    """
    check_closed_jaxpr(cj, "split_jaxpr")
    check_block_cuts(block_cuts)
    cj = inline_calls(cj)
    if scans_with_layer_markers(cj):
        # A scan whose body is marked as one layer: its iterations (or num_stages
        # chunks of them) become the stages.
        cj, num_stages = layers_from_scans(cj, num_stages), None
    if num_stages is not None and not cuts_at_marked_layers(cj):
        plan = plan_layers(cj, num_stages, block_cuts=block_cuts)
        return slice_stages(plan.program, unmarked=unmarked).with_balance(plan.balance)
    if any(is_marker(eqn, "boundary") for eqn in cj.jaxpr.eqns):
        cj = layers_from_boundaries(cj)
    staged = slice_stages(mark_apply_stage(cj), unmarked=unmarked)
    # A marked program and num_stages: consecutive marked stages are merged.
    return staged if num_stages is None else merge_consecutive(staged, num_stages)


def cuts_at_marked_layers(cj: ClosedJaxpr) -> bool:
    """Whether :func:`split_jaxpr` cuts ``cj`` (calls inlined) into one stage per layer
    its top-level markers delimit, merging consecutive ones into ``num_stages``
    (:func:`pipemark.passes.merge_consecutive`): not a program it balances
    automatically, nor a scan over marked layers.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.sin(x)
    >>> cuts_at_marked_layers(jax.make_jaxpr(f)(1.0)), cuts_at_marked_layers(
    ...     jax.make_jaxpr(jnp.sin)(1.0))
    (True, False)
    """
    if scans_with_layer_markers(cj):
        return False
    return _has_top_level_stage_markers(cj)


def _has_top_level_stage_markers(cj: ClosedJaxpr) -> bool:
    return any(is_marker(eqn, STAGE_MARK_TYPES) for eqn in cj.jaxpr.eqns)


def has_stage_markers(cj: ClosedJaxpr) -> bool:
    """Whether :func:`split_jaxpr` would cut ``cj`` at its own markers: a stage marker
    at the top level once calls are inlined, or a scan whose body marks one layer.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.sin(x)
    >>> has_stage_markers(jax.make_jaxpr(jax.jit(f))(1.0))
    True
    >>> has_stage_markers(jax.make_jaxpr(jnp.sin)(1.0))
    False
    """
    cj = inline_calls(cj)
    return bool(scans_with_layer_markers(cj)) or _has_top_level_stage_markers(cj)


def show(program: ClosedJaxpr | StagedJaxpr, **options: Any) -> HTMLView:
    """The HTML view of a marked ``ClosedJaxpr`` (staged by :func:`split_jaxpr`) or of
    a ``StagedJaxpr``. In a notebook, leave it as a cell's last expression to display it.

    ``options`` go to :func:`pipemark.views.to_html`. A program without stage markers
    raises :class:`~pipemark.errors.MarkerError`; cut it with
    ``pm.split_jaxpr(cj, num_stages=...)`` first.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = jnp.sin(x)
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> view = show(jax.make_jaxpr(f)(1.0))
    >>> view._repr_html_().startswith('<div class="pipemark-view">')
    True
    """
    if isinstance(program, ClosedJaxpr):
        program = split_jaxpr(program)
    elif not isinstance(program, StagedJaxpr):
        raise PipemarkError(
            f"show takes a marked ClosedJaxpr or a StagedJaxpr, got {type(program).__name__}; "
            "trace a function first: jax.make_jaxpr(fn)(*args)."
        )
    return HTMLView(program, to_html(program, **options))
