"""What each mark type means: the one table that the primitive, the passes, inspection
and the runtime read.

=============  =========================================================================
mark type      role
=============  =========================================================================
``start``      opens stage ``name``; closed by ``end``; its tangent marker is
               ``jvp_start``; transposed into the ``end`` of ``name_backward``
``end``        closes stage ``name``; transposed into the ``start`` of the mirror
``jvp_start``  the tangent copy of ``start`` under :func:`jax.jvp`: opens the same stage
``jvp_end``    the tangent copy of ``end``: closes the same stage
``boundary``   a cut between two layers (no name needed); stays a cut under jvp and
               transpose, so the backward pass is cut at the same places
``grad``       the gradients of a training step: splits the step into the gradient
               computation and the update (:func:`pipemark.mark_gradient`)
``hook``       a side effect at a point of the program (a custom call); not structural
=============  =========================================================================

Stage names follow one rule: the stage that :func:`jax.grad` mirrors from stage
``name`` is ``name + BACKWARD_SUFFIX`` (:func:`backward_name`, :func:`forward_name`);
a training step's update, split off at its ``grad`` marker, is stage
:data:`APPLY_STAGE`. Slicing reads these names once into each stage's
:class:`~pipemark.roles.StageRole`, which the passes carry from then on.

>>> MARK_ROLES["start"].closed_by, MARK_ROLES["start"].tangent, MARK_ROLES["end"].transposed
('end', 'jvp_start', 'start')
>>> sorted(STAGE_MARK_TYPES)
['boundary', 'end', 'jvp_end', 'jvp_start', 'start']
>>> backward_name("layer0"), forward_name("layer0_backward"), forward_name("layer0")
('layer0_backward', 'layer0', None)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "APPLY_STAGE",
    "BACKWARD_SUFFIX",
    "WEIGHT_SUFFIX",
    "weight_name",
    "owner_name",
    "CLOSERS",
    "KEPT_BY_DCE",
    "MARK_ROLES",
    "MARK_TYPES",
    "MarkRole",
    "OPENERS",
    "PAIRED_MARK_TYPES",
    "STAGE_MARK_TYPES",
    "backward_name",
    "forward_name",
]


@dataclass(frozen=True)
class MarkRole:
    """The role of one mark type.

    Attributes
    ----------
    closed_by:
        For a type that opens a stage, the type that closes it; else ``None``.
    opened_by:
        For a type that closes a stage, the type that opens it; else ``None``.
    tangent:
        The type of the marker's tangent copy under :func:`jax.jvp` (``None``: the
        marker has no tangent, as a ``grad`` marker).
    transposed:
        The type of the marker's transpose (the mirrored backward stage's marker), or
        ``None`` when it does not survive transposition.
    mirrored:
        Whether the transposed marker is named :func:`backward_name` of the marker's
        name (a ``hook`` keeps its name).
    delimits:
        Whether passes cut stages at it (so it may not sit inside a ``scan``, ``cond``
        or ``while`` body).
    kept_by_dce:
        Whether dead-code elimination keeps it when nothing reads its results: a pass
        needs it to know where a stage or the update begins.
    """

    closed_by: str | None = None
    opened_by: str | None = None
    tangent: str | None = None
    transposed: str | None = None
    mirrored: bool = True
    delimits: bool = False
    kept_by_dce: bool = False


#: Every mark type and its role, in the order the documentation lists them.
MARK_ROLES: dict[str, MarkRole] = {
    "start": MarkRole(
        closed_by="end", tangent="jvp_start", transposed="end", delimits=True, kept_by_dce=True
    ),
    "end": MarkRole(
        opened_by="start", tangent="jvp_end", transposed="start", delimits=True, kept_by_dce=True
    ),
    "jvp_start": MarkRole(
        closed_by="jvp_end",
        tangent="jvp_start",
        transposed="end",
        delimits=True,
        kept_by_dce=True,
    ),
    "jvp_end": MarkRole(
        opened_by="jvp_start",
        tangent="jvp_end",
        transposed="start",
        delimits=True,
        kept_by_dce=True,
    ),
    "boundary": MarkRole(
        tangent="boundary", transposed="boundary", delimits=True, kept_by_dce=True
    ),
    "grad": MarkRole(mirrored=False, kept_by_dce=True),
    "hook": MarkRole(tangent="hook", transposed="hook", mirrored=False),
}

#: The mark types, in table order.
MARK_TYPES: tuple[str, ...] = tuple(MARK_ROLES)
#: Opening mark type -> the closing type that pairs with it.
OPENERS: dict[str, str] = {t: r.closed_by for t, r in MARK_ROLES.items() if r.closed_by}
#: Closing mark type -> the opening type it pairs with.
CLOSERS: dict[str, str] = {t: r.opened_by for t, r in MARK_ROLES.items() if r.opened_by}
#: The types that open or close a named stage (``boundary`` cuts, it names none).
PAIRED_MARK_TYPES = frozenset(OPENERS) | frozenset(CLOSERS)
#: The types passes cut at.
STAGE_MARK_TYPES = frozenset(t for t, r in MARK_ROLES.items() if r.delimits)
#: The types dead-code elimination keeps.
KEPT_BY_DCE = frozenset(t for t, r in MARK_ROLES.items() if r.kept_by_dce)

#: What a mirrored backward stage's name adds to its forward stage's name.
BACKWARD_SUFFIX = "_backward"
#: What :func:`pipemark.passes.split_backward` appends to a forward stage's name for the
#: weight-gradient half of its backward stage (``layer0`` -> ``layer0_weight``).
WEIGHT_SUFFIX = "_weight"
#: The name of the stage holding a training step's update (after its ``grad`` marker).
APPLY_STAGE = "apply_grad"


def backward_name(name: str) -> str:
    """The name of the backward stage mirroring stage ``name``."""
    return name + BACKWARD_SUFFIX


def weight_name(forward: str) -> str:
    """The name of the weight-gradient stage split off the backward stage of forward
    stage ``forward`` (``layer0`` -> ``layer0_weight``)."""
    return forward + WEIGHT_SUFFIX


def owner_name(name: str) -> str | None:
    """The forward stage a backward stage (``layer0_backward``) or a weight-gradient
    stage (``layer0_weight``) belongs to; ``None`` for a forward stage's name."""
    return forward_name(name) or _stem(name, WEIGHT_SUFFIX)


def forward_name(name: str) -> str | None:
    """The forward stage that backward stage ``name`` mirrors; ``None`` when ``name``
    is not a backward stage's name."""
    return _stem(name, BACKWARD_SUFFIX)


def _stem(name: str, suffix: str) -> str | None:
    """``name`` without ``suffix``; ``None`` unless ``name`` is a longer str ending in it."""
    if isinstance(name, str) and name.endswith(suffix) and name != suffix:
        return name[: -len(suffix)]
    return None
