"""Tests for pipemark.roles: StageRole, and reading a role off a marker's name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark.marks import APPLY_STAGE, backward_name, weight_name
from pipemark.roles import (
    APPLY,
    BACKWARD,
    FORWARD,
    MIXED,
    ROLE_KINDS,
    WEIGHT,
    StageRole,
    role_from_name,
)
from pipemark.staged import Stage


@pytest.mark.parametrize(
    ("name", "role"),
    [
        ("layer0", StageRole(FORWARD)),
        (backward_name("layer0"), StageRole(BACKWARD, "layer0")),
        (backward_name(backward_name("x")), StageRole(BACKWARD, backward_name("x"))),
        (weight_name("layer0"), StageRole(WEIGHT, "layer0")),
        (APPLY_STAGE, StageRole(APPLY)),
        ("stage0+stage1", StageRole(FORWARD)),
    ],
)
def test_role_from_name(name, role):
    assert role_from_name(name) == role


def test_a_role_is_immutable_and_checked():
    assert ROLE_KINDS == (FORWARD, BACKWARD, WEIGHT, APPLY, MIXED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        StageRole(FORWARD).kind = BACKWARD  # type: ignore[misc]
    with pytest.raises(pm.PipemarkError, match="kind 'sideways'"):
        StageRole("sideways")
    with pytest.raises(pm.PipemarkError, match="owner=None"):
        StageRole(BACKWARD)
    with pytest.raises(pm.PipemarkError, match="owner='layer0'"):
        StageRole(FORWARD, "layer0")


def test_renamed_follows_the_owner_only():
    role = StageRole(WEIGHT, "layer0")
    assert role.renamed({"layer0": "embed"}) == StageRole(WEIGHT, "embed")
    assert role.renamed({"layer1": "x"}) is role
    assert StageRole(FORWARD).renamed({"layer0": "x"}) == StageRole(FORWARD)


def test_sliced_stages_carry_their_roles_and_a_hand_made_stage_reads_its_name():
    def step(x):
        x = pm.mark(x, name="layer0", mark_type="start")
        return jnp.sum(pm.mark(jnp.sin(x), name="layer0", mark_type="end"))

    staged = pm.split(jax.grad(step), 1.0)
    assert [s.role for s in staged.stages] == [
        StageRole(FORWARD),
        StageRole(BACKWARD, "layer0"),
    ]
    stage = staged.stages[1]
    assert Stage(stage.name, stage.closed_jaxpr, stage.inputs).role == stage.role
    forward = Stage(stage.name, stage.closed_jaxpr, stage.inputs, role=StageRole(FORWARD))
    assert forward.role.kind == FORWARD
    with pytest.raises(pm.PipemarkError, match=r"role must be a pipemark\.roles\.StageRole"):
        Stage(stage.name, stage.closed_jaxpr, stage.inputs, role="backward")
