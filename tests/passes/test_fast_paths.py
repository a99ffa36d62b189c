"""The shortcuts the passes take on programs another pass built (recorded in the marker
caches) give exactly what the full computation gives on a copy of the same program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.passes import _markers
from pipemark.passes.insert import insert_markers, insert_markers_by_scope, layers_from_boundaries
from pipemark.passes.rewrite import mark_missing_vars
from pipemark.passes.slice import slice_stages


def _copy(cj: ClosedJaxpr) -> ClosedJaxpr:
    """The same program in a new Jaxpr object: in no cache, so passes do the full work."""
    j = cj.jaxpr
    return ClosedJaxpr(
        Jaxpr(j.constvars, j.invars, j.outvars, list(j.eqns), j.effects, j.debug_info),
        cj.consts,
    )


def _scoped(x, w):
    with jax.named_scope("embed"):
        x = jnp.tanh(x @ w)
    with jax.named_scope("body"):
        x = jnp.sin(x) * w.sum()
    with jax.named_scope("head"):
        return jnp.sum(x * x)


def _programs():
    for kind in ("mlp", "transformer", "resnet"):
        for grad in (False, True):
            cj = examples.sized(kind, 150, markers="boundary").trace(grad=grad)
            yield f"{kind}-boundary-grad={grad}", layers_from_boundaries(cj)
    cj = examples.sized("mlp", 120, markers=None).trace(grad=True)
    n = len(cj.eqns)
    yield "mlp-cuts", insert_markers(cj, [0, 5, n // 3, n // 2, n - 1])
    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    yield "scope", insert_markers_by_scope(jax.make_jaxpr(jax.value_and_grad(_scoped, 1))(x, w))


PROGRAMS = dict(_programs())


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_inserted_programs_are_recorded_as_routed(name):
    cj = PROGRAMS[name]
    assert _markers.stage_spans_routed(cj.jaxpr)
    assert not _markers.stage_spans_routed(_copy(cj).jaxpr)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_mark_missing_vars_shortcut_matches_the_full_sweep(name):
    cj = PROGRAMS[name]
    fast = mark_missing_vars(cj)
    full = mark_missing_vars(_copy(cj))
    assert fast.jaxpr is not cj.jaxpr and fast.jaxpr.eqns is not cj.jaxpr.eqns
    assert len(fast.eqns) == len(full.eqns)
    assert all(a is b for a, b in zip(fast.eqns, full.eqns))
    assert all(a is b for a, b in zip(fast.jaxpr.outvars, full.jaxpr.outvars))
    assert fast.jaxpr.invars == full.jaxpr.invars
    assert fast.jaxpr.constvars == full.jaxpr.constvars
    assert fast.jaxpr.effects == full.jaxpr.effects
    assert fast.jaxpr.debug_info == full.jaxpr.debug_info
    check_jaxpr(fast.jaxpr)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_slice_shortcut_matches_the_full_sweep(name):
    cj = PROGRAMS[name]
    fast = slice_stages(cj)
    full = slice_stages(_copy(cj))
    assert len(fast.stages) == len(full.stages)
    for a, b in zip(fast.stages, full.stages):
        assert a.name == b.name
        assert a.inputs == b.inputs
        assert a.eqn_indices == b.eqn_indices
        ja, jb = a.closed_jaxpr.jaxpr, b.closed_jaxpr.jaxpr
        assert ja.invars == jb.invars and ja.outvars == jb.outvars
        assert ja.constvars == jb.constvars
        assert all(x is y for x, y in zip(ja.eqns, jb.eqns)) and len(ja.eqns) == len(jb.eqns)
        assert ja.effects == jb.effects
        assert ja.debug_info == jb.debug_info
        assert a.closed_jaxpr.consts == b.closed_jaxpr.consts
        check_jaxpr(ja)
    assert fast.outputs == full.outputs
    assert fast.invars == full.invars


def test_an_edited_program_is_no_longer_routed():
    cj = PROGRAMS["mlp-cuts"]
    edited = ClosedJaxpr(cj.jaxpr.replace(eqns=list(cj.eqns)), cj.consts)
    assert not _markers.stage_spans_routed(edited.jaxpr)
    eqns = list(cj.eqns)
    # Same length, one equation swapped for another object: the record no longer holds.
    cj.jaxpr.eqns[1] = eqns[1].replace()
    try:
        assert not _markers.stage_spans_routed(cj.jaxpr)
    finally:
        cj.jaxpr.eqns[1] = eqns[1]
    assert _markers.stage_spans_routed(cj.jaxpr)
    assert pm.passes.mark_missing_vars(cj).eqns[1] is eqns[1]
