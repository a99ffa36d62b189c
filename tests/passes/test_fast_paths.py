"""The fast path of the stage dataflow analysis (a *routed* program's flow read off its
markers, what the insert passes build) gives exactly what the general sweep gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.passes import flow as flow_module
from pipemark.passes._markers import find_stage_spans
from pipemark.passes.flow import routed_flow
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
            yield f"{kind}-boundary-grad={grad}", lambda cj=cj: layers_from_boundaries(cj)
    cj = examples.sized("mlp", 120, markers=None).trace(grad=True)
    n = len(cj.eqns)
    yield "mlp-cuts", lambda: insert_markers(cj, [0, 5, n // 3, n // 2, n - 1])
    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    scoped = jax.make_jaxpr(jax.value_and_grad(_scoped, 1))(x, w)
    yield "scope", lambda: insert_markers_by_scope(scoped)


BUILDERS = dict(_programs())
PROGRAMS = {name: build() for name, build in BUILDERS.items()}


def _no_shortcut(monkeypatch):
    """Make the passes take their general sweep, as for a program that is not routed."""
    clear_caches()  # forget the flows found so far
    monkeypatch.setattr(flow_module, "_routed_flow", lambda jaxpr, spans, known: None)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_inserted_programs_are_routed(name, monkeypatch):
    cj = BUILDERS[name]()
    # The insert passes hand nothing to the next pass: the flow is found afresh.
    assert cj.jaxpr not in flow_module._FLOWS
    fast = routed_flow(cj.jaxpr)
    assert fast is not None and fast.routed and flow_module.stage_flow(cj.jaxpr) is fast
    # A property of the program, not of the object: a copy is routed too.
    assert routed_flow(_copy(cj).jaxpr) is not None
    # The read-off equals the general sweep's answer.
    _no_shortcut(monkeypatch)
    full = flow_module.stage_flow(cj.jaxpr)
    assert not full.routed
    assert full.spans == fast.spans and full.reads == fast.reads
    assert full.exported == fast.exported
    assert [list(m) for m in full.members] == [list(m) for m in fast.members]
    # What leaves each stage in the routed program is exactly its end marker's results.
    leaving = {v for results in fast.leaving for v in results}
    assert fast.exported <= leaving


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_mark_missing_vars_shortcut_matches_the_full_sweep(name, monkeypatch):
    cj = PROGRAMS[name]
    fast = mark_missing_vars(cj)
    _no_shortcut(monkeypatch)
    full = mark_missing_vars(cj)
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
def test_slice_shortcut_matches_the_full_sweep(name, monkeypatch):
    cj = PROGRAMS[name]
    fast = slice_stages(cj)
    _no_shortcut(monkeypatch)
    full = slice_stages(cj)
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


def test_a_value_leaving_a_stage_around_its_end_marker_is_not_routed():
    cj = PROGRAMS["mlp-cuts"]
    spans = find_stage_spans(cj)
    inner = cj.eqns[spans[0].first + 1].outvars[0]  # defined inside stage 0
    edited = ClosedJaxpr(cj.jaxpr.replace(outvars=[*cj.jaxpr.outvars, inner]), cj.consts)
    assert routed_flow(edited.jaxpr) is None
    # The general sweep routes it: the result now leaves through an end marker.
    routed = pm.passes.mark_missing_vars(edited)
    assert routed_flow(routed.jaxpr) is not None
    check_jaxpr(routed.jaxpr)
