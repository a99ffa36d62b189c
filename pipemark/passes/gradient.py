"""Split a training step at its ``grad`` marker into gradient computation and
gradient application.

A pipeline runs the forward and backward stages many times (once per micro-batch) and
applies the accumulated gradients once; :func:`split_at_gradient` separates the two.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, JaxprEqn, Literal, Var

from pipemark.errors import MarkerError, describe_eqn
from pipemark.marks import APPLY_STAGE
from pipemark.passes._markers import find_stage_spans
from pipemark.passes.framework import jaxpr_pass
from pipemark.passes.rewrite import dce
from pipemark.primitive import is_marker, mark_pipeline_jaxpreqn
from pipemark.walk import bodies, find_eqn

__all__ = [
    "apply_start",
    "grad_marker_index",
    "mark_apply_stage",
    "split_at_gradient",
]


def _is_grad_marker(eqn: JaxprEqn) -> bool:
    return is_marker(eqn, "grad")


def grad_marker_index(jaxpr: Jaxpr) -> int | None:
    """The index of the program's top-level ``grad`` marker, or ``None`` when it has
    none; :class:`MarkerError` when it has two (a step marks its gradients once).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def step(w):
    ...     g = pm.mark_gradient(jax.grad(lambda w: jnp.sum(jnp.sin(w)))(w))
    ...     return w - 0.1 * g
    >>> cj = jax.make_jaxpr(step)(jnp.ones(3))
    >>> cj.eqns[grad_marker_index(cj.jaxpr)].params["mark_type"]
    'grad'
    """
    found = [i for i, eqn in enumerate(jaxpr.eqns) if is_marker(eqn, "grad")]
    if len(found) > 1:
        first, second = found[:2]
        raise MarkerError(
            f"{describe_eqn(jaxpr.eqns[second], second)} is a second grad marker; the "
            f"first is {describe_eqn(jaxpr.eqns[first], first)}. split_at_gradient cuts "
            "at exactly one: mark all gradients with a single pm.mark_gradient(grads) "
            "call over the whole gradient pytree."
        )
    return found[0] if found else None


def apply_start(jaxpr: Jaxpr) -> int | None:
    """Where a training step's optimizer update begins: right after its top-level
    ``grad`` marker, when equations follow it; else ``None``."""
    marker = grad_marker_index(jaxpr)
    if marker is None or marker + 1 >= len(jaxpr.eqns):
        return None
    return marker + 1


def _grad_marker_index(jaxpr: Jaxpr) -> int:
    found = grad_marker_index(jaxpr)
    if found is not None:
        return found
    memo: dict[int, JaxprEqn | None] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if any(find_eqn(body, _is_grad_marker, memo) for _, body in bodies(eqn)):
            raise MarkerError(
                f"{describe_eqn(eqn, i)} holds the grad marker inside its body; "
                "split_at_gradient cuts only the top level of a program. Call "
                "pm.mark_gradient outside the jit/scan/cond, or trace the step without "
                "an inner jax.jit."
            )
    raise MarkerError(
        "The program has no grad marker, so split_at_gradient cannot tell where the "
        "gradients are complete. Mark them in the training step: "
        "grads = pm.mark_gradient(grads)."
    )


def _effects(eqns: list[JaxprEqn]) -> frozenset[Any]:
    effects: set[Any] = set()
    for eqn in eqns:
        effects.update(eqn.effects)
    return frozenset(effects)


def _closed(
    cj: ClosedJaxpr,
    invars: list[Var],
    outvars: list[Any],
    eqns: list[JaxprEqn],
    debug_info: DebugInfo,
) -> ClosedJaxpr:
    """A closed jaxpr over ``eqns`` that keeps only the constants it reads."""
    read: set[Var] = {v for v in outvars if not isinstance(v, Literal)}
    for eqn in eqns:
        read.update(v for v in eqn.invars if not isinstance(v, Literal))
    kept = [(v, c) for v, c in zip(cj.jaxpr.constvars, cj.consts) if v in read]
    jaxpr = Jaxpr([v for v, _ in kept], invars, outvars, eqns, _effects(eqns), debug_info)
    return ClosedJaxpr(jaxpr, [c for _, c in kept])


@jaxpr_pass
def split_at_gradient(cj: ClosedJaxpr) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """Cut a training step at its ``grad`` marker (:func:`pipemark.mark_gradient`).

    Returns ``(compute_grad, apply_grad)``:

    ``compute_grad``
        Takes the program's inputs. Holds the equations before the grad marker that
        the gradients, or anything after the marker, need (stage markers included, so
        it can be sliced into pipeline stages). Returns the gradients (the grad marker's
        operands, in order), then the *residuals*: values computed before the marker
        that the equations after it, or the program's outputs, read (e.g. the loss).
    ``apply_grad``
        Takes the program's inputs, then the gradients, then the residuals. Holds the
        equations after the grad marker (e.g. the optimizer update) and returns the
        program's outputs.

    So ``apply_grad(*args, *compute_grad(*args))`` computes what the program computes
    (call each through ``jax.extend.core.jaxpr_as_fun``). The grad marker itself is in
    neither part: its results are ``apply_grad``'s gradient inputs. Constants go to the
    part that reads them.

    Parameters
    ----------
    cj:
        A closed jaxpr with exactly one top-level ``grad`` marker.

    Returns
    -------
    tuple of ClosedJaxpr
        ``(compute_grad, apply_grad)``.

    Raises
    ------
    MarkerError
        When the program has no grad marker (or only one inside a ``jit``/``scan``
        body), has more than one, or the grad marker lies inside a pipeline stage (the
        stage's start and end markers would land in different parts), or its markers
        are malformed.
    PipemarkError
        When ``cj`` is not a ``ClosedJaxpr``.

    Examples
    --------
    Before (``g`` is the gradient, ``e`` the loss)::

        { lambda ; a:f32[] b:f32[]. let
            c:f32[] = sin a
            d:f32[] = cos a
            e:f32[] = mul b c
            f:f32[] = mul b 1.0:f32[]
            g:f32[] = mul f d
            h:f32[] = pipeline_marker[mark_type=grad name=grad] g
            i:f32[] = mul 0.1:f32[] h
            j:f32[] = sub a i
          in (j, e) }

    After, ``compute_grad`` (returns the gradient ``g`` and the residual ``e``)::

        { lambda ; a:f32[] b:f32[]. let
            c:f32[] = sin a
            d:f32[] = cos a
            e:f32[] = mul b c
            f:f32[] = mul b 1.0:f32[]
            g:f32[] = mul f d
          in (g, e) }

    and ``apply_grad`` (inputs: ``a b``, the gradient, the residual)::

        { lambda ; a:f32[] b:f32[] c:f32[] d:f32[]. let
            e:f32[] = mul 0.1:f32[] c
            f:f32[] = sub a e
          in (f, d) }

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: x * jnp.sin(w))(w)
    ...     return w - 0.1 * pm.mark_gradient(g), loss
    >>> compute_grad, apply_grad = split_at_gradient(jax.make_jaxpr(step)(1.0, 2.0))
    >>> len(compute_grad.jaxpr.outvars), len(apply_grad.jaxpr.invars)
    (2, 4)
    """
    jaxpr = cj.jaxpr
    eqns = jaxpr.eqns
    g = _grad_marker_index(jaxpr)
    marker = eqns[g]
    for span in find_stage_spans(jaxpr, allow_boundaries=True):
        # A backward stage JAX left open runs to where the gradients are complete.
        if not span.implicit_end and span.first < g < span.last:
            raise MarkerError(
                f"{describe_eqn(marker, g)} lies inside stage {span.name!r}, which opens "
                f"at {describe_eqn(eqns[span.first], span.first)}; splitting there would "
                "put the stage's start and end markers in different programs. Mark the "
                "gradients after the stage's end marker (after jax.grad returns)."
            )

    before, after = eqns[:g], eqns[g + 1 :]
    defined_before: set[Var] = set()
    for eqn in before:
        defined_before.update(eqn.outvars)
    # Values computed before the marker and read after it (or returned) cross the cut.
    residuals: list[Var] = []
    crossing: set[Var] = set()

    def note(atom: Any) -> None:
        if not isinstance(atom, Literal) and atom in defined_before and atom not in crossing:
            crossing.add(atom)
            residuals.append(atom)

    for eqn in after:
        for v in eqn.invars:
            note(v)
    for v in jaxpr.outvars:
        note(v)

    # Name the new inputs and outputs, so printed and lowered programs stay readable.
    info = jaxpr.debug_info
    arg_names = info.safe_arg_names(len(jaxpr.invars))
    grad_names = tuple(f"grad[{i}]" for i in range(len(marker.invars)))
    residual_names = tuple(f"residual[{i}]" for i in range(len(residuals)))
    compute_grad = dce(
        _closed(
            cj,
            list(jaxpr.invars),
            [*marker.invars, *residuals],
            list(before),
            DebugInfo(info.traced_for, info.func_src_info, arg_names, grad_names + residual_names),
        )
    )
    # A grad result nobody reads may be a DropVar; apply_grad still takes an input there.
    gradients = [v if type(v) is Var else Var(v.aval) for v in marker.outvars]
    apply_grad = _closed(
        cj,
        [*jaxpr.invars, *gradients, *residuals],
        list(jaxpr.outvars),
        list(after),
        DebugInfo(
            info.traced_for,
            info.func_src_info,
            arg_names + grad_names + residual_names,
            info.safe_result_paths(len(jaxpr.outvars)),
        ),
    )
    return compute_grad, apply_grad


@jaxpr_pass
def mark_apply_stage(cj: ClosedJaxpr, name: str = APPLY_STAGE) -> ClosedJaxpr:
    """Wrap a training step's optimizer update (the equations after its ``grad``
    marker) in a stage of its own named ``name``, when they are outside every stage.

    Without it, slicing a marked training step folds the update into the last backward
    stage, which a pipeline runs once per micro-batch; the update runs once per step.
    The new stage's start and end markers carry no values (the slicer finds what the
    stage reads). A program without a top-level grad marker, or whose equations after
    it are already in a stage, is returned as it is.

    Before/after (``s`` is the grad marker's result)::

        ... s = pipeline_marker[grad] g ; w2 = sub w s ; return w2
        ... s = pipeline_marker[grad] g ; pipeline_marker[start apply_grad] ;
            w2 = sub w s ; pipeline_marker[end apply_grad] ; return w2

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def step(w):
    ...     w = pm.mark(w, name="layer0", mark_type="start")
    ...     loss_grad = jax.grad(lambda w: jnp.sum(jnp.sin(w)))
    ...     g = pm.mark_gradient(loss_grad(pm.mark(w, name="layer0", mark_type="end")))
    ...     return w - 0.1 * g
    >>> staged = pm.passes.slice_stages(mark_apply_stage(jax.make_jaxpr(step)(jnp.ones(3))))
    >>> [s.name for s in staged.stages]
    ['layer0', 'apply_grad']
    """
    jaxpr = cj.jaxpr
    begin = apply_start(jaxpr)
    if begin is None:
        return cj
    if any(span.last >= begin for span in find_stage_spans(jaxpr, allow_boundaries=True)):
        return cj
    eqns = jaxpr.eqns
    start = mark_pipeline_jaxpreqn([], [], name, "start")
    end = mark_pipeline_jaxpreqn([], [], name, "end")
    new_eqns = [*eqns[:begin], start, *eqns[begin:], end]
    return ClosedJaxpr(jaxpr.replace(eqns=new_eqns), cj.consts)
