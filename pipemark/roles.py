"""What a stage is in a training step: :class:`StageRole`, held by each
:class:`~pipemark.staged.Stage`.

A stage is a forward stage (a layer), the backward stage :func:`jax.grad` mirrors from
one (its activation cotangents, or all of its gradients), the weight-gradient half of a
backward split by :func:`pipemark.passes.split_backward`, or a training step's update
(``apply_grad``). A backward or weight-gradient stage names the forward stage it
belongs to, its *owner*.

The role is read off the markers' names once, where a sliced program's stages are made
(:func:`role_from_name`: ``layer0_backward`` mirrors ``layer0``); from then on the
passes carry it: merging, renaming and splitting stages set the new stages' roles from
the old ones, and the pipeline, the views and the plots read the role, never the name.

>>> role_from_name("layer0"), role_from_name("layer0_backward")
(StageRole(kind='forward', owner=None), StageRole(kind='backward', owner='layer0'))
>>> role_from_name("layer0_weight").owner, role_from_name("apply_grad").kind
('layer0', 'apply')
"""

from __future__ import annotations

from dataclasses import dataclass

from pipemark.errors import PipemarkError
from pipemark.marks import APPLY_STAGE, forward_name, owner_name

__all__ = [
    "ACTION_KINDS",
    "APPLY",
    "BACKWARD",
    "FORWARD",
    "MIXED",
    "ROLE_KINDS",
    "WEIGHT",
    "StageRole",
    "role_from_name",
]

#: A forward stage: one layer, or several merged.
FORWARD = "forward"
#: The backward stage mirroring a forward stage (before a split: all its gradients;
#: after: the activation cotangents, B).
BACKWARD = "backward"
#: The parameter-gradient half (W) of a split backward stage.
WEIGHT = "weight"
#: A training step's update, after its ``grad`` marker.
APPLY = "apply"
#: A merge of stages of different roles, or of backward stages of different forward
#: stages: it belongs to no one forward stage, so a pipeline cannot place it.
MIXED = "mixed"
#: The kinds, in the order above.
ROLE_KINDS: tuple[str, ...] = (FORWARD, BACKWARD, WEIGHT, APPLY, MIXED)
#: The kinds of stage program a pipeline schedule runs, one action per pipeline stage
#: and microbatch (:class:`pipemark.runtime.Action`'s ``kind``): the one definition the
#: runtime reads.
ACTION_KINDS: tuple[str, ...] = (FORWARD, BACKWARD, WEIGHT)
_OWNED = frozenset((BACKWARD, WEIGHT))


@dataclass(frozen=True)
class StageRole:
    """The role of a stage.

    Attributes
    ----------
    kind:
        One of :data:`ROLE_KINDS`.
    owner:
        For a ``backward`` or ``weight`` stage, the name of the forward stage it belongs
        to; ``None`` for the other kinds.

    >>> StageRole(BACKWARD, "layer0").belongs_to("layer0")
    True
    """

    kind: str = FORWARD
    owner: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROLE_KINDS:
            raise PipemarkError(
                f"StageRole kind {self.kind!r} is none of {', '.join(map(repr, ROLE_KINDS))}."
            )
        if (self.kind in _OWNED) != isinstance(self.owner, str):
            raise PipemarkError(
                f"A {self.kind} stage's role names its forward stage as owner exactly when "
                f"it is a backward or weight stage; got owner={self.owner!r}."
            )

    def belongs_to(self, forward: str) -> bool:
        """Whether this is the backward or weight stage of forward stage ``forward``."""
        return self.owner == forward

    def renamed(self, names: dict[str, str]) -> StageRole:
        """The role with its owner renamed through ``names`` (old -> new name)."""
        if self.owner is None or self.owner not in names:
            return self
        return StageRole(self.kind, names[self.owner])


def role_from_name(name: str) -> StageRole:
    """The role a stage named ``name`` by its markers has: the one place stage names
    are read as roles (see the module docstring).

    >>> role_from_name("stage1_backward")
    StageRole(kind='backward', owner='stage1')
    """
    if name == APPLY_STAGE:
        return StageRole(APPLY)
    mirrored = forward_name(name)
    if mirrored is not None:
        return StageRole(BACKWARD, mirrored)
    owner = owner_name(name)
    if owner is not None:
        return StageRole(WEIGHT, owner)
    return StageRole(FORWARD)
