"""Hostile input, as properties over random cases (#16): malformed markers are refused
by every pass with a named error and the input untouched; any stage name is shown as
written; any --arg text is parsed or refused in one line."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.extend.core import ClosedJaxpr, Var, new_jaxpr_eqn, no_effects

import pipemark as pm
from pipemark.cli import CommandError, parse_arg_spec

PASSES = {
    "inline_calls": (),
    "insert_markers": ([1],),
    "layers_from_boundaries": (),
    "slice_stages": (),
    "remove_markers": (),
    "mark_missing_vars": (),
    "dce": (),
    "auto_layers": (2,),
    "mark_apply_stage": (),
}


def _program(length: int) -> ClosedJaxpr:
    def f(x):
        for _ in range(length):
            x = jnp.sin(x)
        return x

    return jax.make_jaxpr(f)(jnp.ones(3))


def _corrupt(cj: ClosedJaxpr, where: int, kind: str) -> ClosedJaxpr:
    """``cj`` with a malformed marker inserted before equation ``where``."""
    jaxpr = cj.jaxpr
    eqns = list(jaxpr.eqns)
    source = jaxpr.invars[0] if where == 0 else eqns[where - 1].outvars[0]
    aval = source.aval
    params = {"name": "bad", "mark_type": "start"}
    if kind == "extra result":
        marker = new_jaxpr_eqn([source], [Var(aval), Var(aval)], pm.pipeline_p, params, no_effects)
    elif kind == "other shape":
        other = jax.core.ShapedArray((aval.shape[0] + 1,), aval.dtype)
        marker = new_jaxpr_eqn([source], [Var(other)], pm.pipeline_p, params, no_effects)
    elif kind == "own operand":
        ghost = Var(aval)
        marker = new_jaxpr_eqn([ghost], [ghost], pm.pipeline_p, params, no_effects)
    else:  # reads a variable nothing defines
        marker = new_jaxpr_eqn([Var(aval)], [Var(aval)], pm.pipeline_p, params, no_effects)
    eqns.insert(where, marker)
    return ClosedJaxpr(jaxpr.replace(eqns=eqns), cj.consts)


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(2, 6),
    data=st.data(),
    kind=st.sampled_from(["extra result", "other shape", "own operand", "undefined"]),
    name=st.sampled_from(sorted(PASSES)),
)
def test_every_pass_refuses_a_malformed_marker_by_name(length, data, kind, name):
    cj = _corrupt(_program(length), data.draw(st.integers(0, length)), kind)
    before = list(cj.jaxpr.eqns)
    with pytest.raises(pm.PipemarkError, match=rf"^{name}: equation \d+ \(pipeline_marker"):
        getattr(pm.passes, name)(cj, *PASSES[name])
    assert cj.jaxpr.eqns == before


@settings(max_examples=40, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=3, unique=True))
@example(names=["0", "\\["])  # rich's markup escape left this one to be read as "["
def test_any_stage_name_is_shown_as_written(names):
    def f(x):
        for name in names:
            x = pm.mark(x, name=name, mark_type="start")
            x = pm.mark(jnp.sin(x), name=name, mark_type="end")
        return x

    staged = pm.split(f, 1.0)
    views = [
        pm.views.summary(staged, style="plain"),
        pm.views.stage_inputs(staged),
        pm.views.to_html(staged),
    ]
    pytest.importorskip("rich")
    views.append(pm.views.summary(staged, style="rich"))
    shown = [pm.views.display_name(name) for name in names]
    for text in views:
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text)  # no raw control character
    for name in shown:
        assert name in views[0] and name in views[-1]


@settings(max_examples=200, deadline=None)
@given(spec=st.text(max_size=24) | st.from_regex(r"[a-z0-9]{0,6}\[[0-9, ]{0,30}\]", fullmatch=True))
def test_any_arg_spec_is_parsed_or_refused_in_one_line(spec):
    try:
        parsed = parse_arg_spec(spec)
    except CommandError as error:
        assert "\n" not in str(error)
        return
    assert isinstance(parsed, jax.ShapeDtypeStruct)
