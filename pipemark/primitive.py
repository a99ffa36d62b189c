"""The ``pipeline_marker`` primitive and its rules.

A pipeline marker is an identity function on any number of arrays that carries two
parameters: ``name`` (a stage or marker name) and ``mark_type``. Passes find markers in
a jaxpr and cut the program there; the marker itself never changes a value.

Order inside this module follows the life of a primitive: the primitive, its impl and
abstract evaluation, then its rules under each transformation (jvp, transpose, batching,
dead-code elimination), then the public functions that bind it or build equations.
Lowering lives in :mod:`pipemark.lowering`.

How each mark type behaves under the transformations (also in ``docs/mark-types.md``):

=========== ============================ ================================ ============
mark type   jvp: tangent marker          transpose: cotangent marker      DCE
=========== ============================ ================================ ============
start       ``jvp_start``, same name     ``end``, name + ``_backward``    kept
end         ``jvp_end``, same name       ``start``, name + ``_backward``  kept
jvp_start   ``jvp_start``, same name     ``end``, name + ``_backward``    kept
jvp_end     ``jvp_end``, same name       ``start``, name + ``_backward``  kept
boundary    ``boundary``, same name      ``boundary``, name + ``_backward`` kept
grad        none (tangent passes)        none (cotangent passes)          kept
hook        ``hook``, same name          ``hook``, same name              if used
=========== ============================ ================================ ============

Symbolic-zero tangents and cotangents are never put through a marker: they carry no
data, and instantiating them would move zero-filled buffers across a stage boundary.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import JaxprEqn, Primitive, Var, new_jaxpr_eqn, no_effects
from jax.interpreters import ad, batching

from pipemark._compat import register_dce_rule, register_lowering
from pipemark.errors import MarkerError
from pipemark.lowering import lower_marker
from pipemark.marks import KEPT_BY_DCE, MARK_ROLES, MARK_TYPES, PAIRED_MARK_TYPES, backward_name

__all__ = [
    "MARK_TYPES",
    "pipeline_p",
    "mark",
    "mark_pipeline_boundary",
    "mark_gradient",
    "mark_pipeline_jaxpreqn",
    "mark_hook_jaxpreqn",
    "is_marker",
]

# Frames inside pipemark are not the user's: leave them out of the source line JAX
# records for each traced equation, as JAX does for its own frames.
source_info_util.register_exclusion(os.path.dirname(__file__))

pipeline_p = Primitive("pipeline_marker")
pipeline_p.multiple_results = True


def is_marker(eqn: JaxprEqn, mark_type: str | Collection[str] | None = None) -> bool:
    """Whether ``eqn`` is a pipeline marker (of ``mark_type``, or of one of the types
    in a collection such as :data:`pipemark.marks.STAGE_MARK_TYPES`, when given).

    >>> import jax, pipemark as pm
    >>> from pipemark.marks import STAGE_MARK_TYPES
    >>> cj = jax.make_jaxpr(lambda x: pm.mark(x, name="a", mark_type="start"))(1.0)
    >>> is_marker(cj.eqns[0]), is_marker(cj.eqns[0], "end"), is_marker(cj.eqns[0], STAGE_MARK_TYPES)
    (True, False, True)
    """
    if eqn.primitive is not pipeline_p:
        return False
    if mark_type is None:
        return True
    found = eqn.params.get("mark_type")
    return found == mark_type if isinstance(mark_type, str) else found in mark_type


def _check_params(name: Any, mark_type: Any) -> None:
    if mark_type not in MARK_TYPES:
        raise MarkerError(
            f"Unknown mark type: {mark_type!r}. A pipeline marker's mark_type must be "
            f"one of {', '.join(MARK_TYPES)}."
        )
    if not isinstance(name, str):
        raise MarkerError(
            f"A pipeline marker's name must be a str, got {name!r} of type {type(name).__name__}."
        )


# ----------------------------------------------------------------------------- impl


def _marker_impl(*args, name: str, mark_type: str):
    # Outside any transformation a marker is the identity on its operands.
    del name, mark_type
    return list(args)


pipeline_p.def_impl(_marker_impl)


def _marker_abstract_eval(*avals, name: str, mark_type: str):
    del name, mark_type
    return list(avals)


pipeline_p.def_abstract_eval(_marker_abstract_eval)


# ------------------------------------------------------------------------------ jvp


def _bind_over_nonzero(values, name: str, mark_type: str, zero_aval):
    """Bind a marker over the non-Zero entries of ``values``; Zero entries pass
    through as fresh Zeros of ``zero_aval(i)``."""
    keep = [i for i, v in enumerate(values) if type(v) is not ad.Zero]
    marked = (
        pipeline_p.bind(*(values[i] for i in keep), name=name, mark_type=mark_type) if keep else []
    )
    out = [ad.Zero(zero_aval(i)) for i in range(len(values))]
    for i, v in zip(keep, marked):
        out[i] = v
    return out, bool(keep)


def _marker_jvp(primals, tangents, *, name: str, mark_type: str):
    primals_out = pipeline_p.bind(*primals, name=name, mark_type=mark_type)
    tangent_mark_type = MARK_ROLES[mark_type].tangent
    if tangent_mark_type is None or all(type(t) is ad.Zero for t in tangents):
        # `grad` marks a value as a gradient; its tangent is not one, so it passes
        # through unmarked. Markers whose tangents are all symbolic zeros get no
        # tangent marker: there is no data for it to delimit.
        return primals_out, list(tangents)
    tangents_out, _ = _bind_over_nonzero(
        list(tangents),
        name,
        tangent_mark_type,
        lambda i: jax.typeof(primals[i]).to_tangent_aval(),
    )
    return primals_out, tangents_out


ad.primitive_jvps[pipeline_p] = _marker_jvp


# ------------------------------------------------------------------------ transpose


def _marker_transpose(cotangents, *args, name: str, mark_type: str):
    def operand_aval(i):
        arg = args[i]
        return arg.aval if ad.is_undefined_primal(arg) else jax.typeof(arg)

    # Only linear operands get a cotangent; the rest pass no data through the marker.
    cotangents = [
        ct if ct is not None and ad.is_undefined_primal(arg) else ad.Zero(operand_aval(i))
        for i, (arg, ct) in enumerate(zip(args, cotangents))
    ]
    role = MARK_ROLES[mark_type]
    if role.transposed is None:  # grad: the cotangent passes through unmarked
        cts_in = cotangents
    else:
        new_name = backward_name(name) if role.mirrored else name
        cts_in, any_marked = _bind_over_nonzero(cotangents, new_name, role.transposed, operand_aval)
        if not any_marked and role.kept_by_dce:
            # Keep the backward stage delimited even when no cotangent flows through
            # this marker, so every mirrored stage still has its start and its end.
            pipeline_p.bind(name=new_name, mark_type=role.transposed)
    return [ct if ad.is_undefined_primal(arg) else None for arg, ct in zip(args, cts_in)]


ad.primitive_transposes[pipeline_p] = _marker_transpose


# ------------------------------------------------------------------------- batching


def _marker_batch(batched_args, batch_dims, *, name: str, mark_type: str):
    # The marker is elementwise-trivial: batched operands keep their batch dimension.
    outs = pipeline_p.bind(*batched_args, name=name, mark_type=mark_type)
    return outs, list(batch_dims)


batching.primitive_batchers[pipeline_p] = _marker_batch


# ------------------------------------------------------------------------------ DCE


def _marker_dce(used_outputs: list[bool], eqn: JaxprEqn):
    """Drop the operand/result pairs nobody reads; keep a structural marker even when
    it is left with no operands, and drop a ``hook`` marker that no one reads."""
    mark_type = eqn.params["mark_type"]
    if not any(used_outputs) and mark_type not in KEPT_BY_DCE:
        return [False] * len(eqn.invars), None
    if all(used_outputs):
        return [True] * len(eqn.invars), eqn
    new_eqn = eqn.replace(
        invars=[v for v, used in zip(eqn.invars, used_outputs) if used],
        outvars=[v for v, used in zip(eqn.outvars, used_outputs) if used],
    )
    return list(used_outputs), new_eqn


register_dce_rule(pipeline_p, _marker_dce)

# Lowering to StableHLO: one of three modes (pipemark.lowering). The same rule is
# registered for "tpu" on its own so that a lowering for several platforms at once
# (jax.export(..., platforms=["cpu", "tpu"])) calls it separately for the TPU, whose
# custom-call marker is a Pallas kernel, and for the others, whose is a typed-FFI call.
register_lowering(pipeline_p, lower_marker)
register_lowering(pipeline_p, lower_marker, platform="tpu")


# ------------------------------------------------------------------------ public API


def _check_leaf(leaf: Any, where: str) -> None:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return
    raise MarkerError(
        f"{where}: cannot mark {leaf!r} of type {type(leaf).__name__}; every leaf of a "
        "marked pytree must be an array or a Python/NumPy scalar. Keep non-array "
        "values out of the marked tree."
    )


def mark(tree: Any, *, name: str, mark_type: str) -> Any:
    """Put every array leaf of ``tree`` through one pipeline marker.

    Returns a pytree of the same structure whose leaves equal the inputs. In a traced
    program the leaves become the outputs of one ``pipeline_marker`` equation, so a
    pass can cut the program there.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x, w):
    ...     x, w = pm.mark((x, w), name="layer0", mark_type="start")
    ...     (y,) = pm.mark((jnp.tanh(x @ w),), name="layer0", mark_type="end")
    ...     return y
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    >>> [e.params["mark_type"] for e in jaxpr.eqns if e.primitive is pm.pipeline_p]
    ['start', 'end']
    """
    _check_params(name, mark_type)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for leaf in leaves:
        _check_leaf(leaf, f"mark(name={name!r}, mark_type={mark_type!r})")
    out = pipeline_p.bind(*leaves, name=name, mark_type=mark_type)
    return jax.tree_util.tree_unflatten(treedef, out)


def mark_pipeline_boundary() -> None:
    """Mark the boundary between two pipeline layers at this point of the program.

    The marker has no operands and no results: it records *where* the program is cut.
    :func:`pipemark.passes.layers_from_boundaries` turns the equations between
    boundaries into layers wrapped in start/end markers.
    """
    pipeline_p.bind(name="boundary", mark_type="boundary")


def mark_gradient(grad: Any) -> Any:
    """Mark a pytree of gradients, returning it unchanged.

    :func:`pipemark.passes.split_at_gradient` cuts a training step at this marker into
    the part that computes gradients and the part that applies them.
    """
    return mark(grad, name="grad", mark_type="grad")


def check_marker_vars(invars: Sequence[Any], outvars: Sequence[Any], what: str) -> None:
    """A :class:`MarkerError` (naming ``what``) unless a marker's operands and results
    pair up: as many of each, each result a ``Var`` of its operand's shape and dtype."""
    if len(invars) != len(outvars):
        raise MarkerError(
            f"{what}: a marker has one result per operand, got {len(invars)} operands "
            f"and {len(outvars)} results."
        )
    for i, (a, b) in enumerate(zip(invars, outvars)):
        if not isinstance(b, Var):
            raise MarkerError(f"{what}: result {i} is {b!r}, not a jaxpr Var.")
        if a.aval.shape != b.aval.shape or a.aval.dtype != b.aval.dtype:
            raise MarkerError(
                f"{what}: operand {i} has type {a.aval.str_short(short_dtypes=True)} but result {i} has "
                f"type {b.aval.str_short(short_dtypes=True)}; a marker's result must match its operand."
            )


def mark_pipeline_jaxpreqn(
    invars: Sequence[Any], outvars: Sequence[Var], name: str, mark_type: str
) -> JaxprEqn:
    """Make a start/end (or jvp_start/jvp_end) marker equation from jaxpr variables.

    For passes that build jaxprs by hand. Raises :class:`MarkerError` (a ``ValueError``,
    as the original function raised) for any other mark type.
    """
    if mark_type not in PAIRED_MARK_TYPES:
        raise MarkerError(
            f"Unknown mark type: {mark_type!r}. mark_pipeline_jaxpreqn builds start, "
            "end, jvp_start and jvp_end markers; use mark_hook_jaxpreqn for hooks."
        )
    _check_params(name, mark_type)
    check_marker_vars(invars, outvars, f"mark_pipeline_jaxpreqn(name={name!r})")
    return new_jaxpr_eqn(
        list(invars),
        list(outvars),
        pipeline_p,
        {"name": name, "mark_type": mark_type},
        no_effects,
    )


def mark_hook_jaxpreqn(invars: Sequence[Any], outvars: Sequence[Var]) -> JaxprEqn:
    """Make a ``hook`` marker equation (name ``"hook"``) from jaxpr variables."""
    check_marker_vars(invars, outvars, "mark_hook_jaxpreqn")
    return new_jaxpr_eqn(
        list(invars),
        list(outvars),
        pipeline_p,
        {"name": "hook", "mark_type": "hook"},
        no_effects,
    )
