"""pipemark.passes.framework: every public pass checks its input, pauses the cyclic
garbage collector while it runs, and checks what it returns under jax_enable_checks."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark import examples
from pipemark._compat import CLOSED_JAXPR_IS_JAXPR
from pipemark.errors import MarkerError, PipemarkError
from pipemark.passes import framework, insert, rewrite, slice
from pipemark.passes.framework import paused_collector


@pytest.fixture(autouse=True)
def _restore_collector():
    """Leave the collector as the test found it, whatever the test did."""
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def _marked():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        x = pm.mark(jnp.sin(x), name="a", mark_type="end")
        x = pm.mark(x, name="b", mark_type="start")
        return pm.mark(jnp.cos(x) * 2.0, name="b", mark_type="end")

    return jax.make_jaxpr(f)(1.0)


def _plain():
    return jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)) + x)(1.0)


def _boundaries():
    return examples.mlp(num_layers=3, markers="boundary").trace(grad=True)


# (pass, module, name of the function the public pass runs inside the pause, program)
PASSES = {
    "insert_markers": (
        lambda cj: pm.passes.insert_markers(cj, [1]),
        insert,
        "_wrap_segments",
        _plain,
    ),
    "layers_from_boundaries": (
        pm.passes.layers_from_boundaries,
        insert,
        "_layers_from_boundaries",
        _boundaries,
    ),
    "slice_stages": (pm.passes.slice_stages, slice, "_slice_stages", _marked),
    "mark_missing_vars": (pm.passes.mark_missing_vars, rewrite, "_mark_missing_vars", _marked),
    "dce": (pm.passes.dce, rewrite, "_dce", _marked),
}


def _spy(monkeypatch, module, name, seen, before=None):
    """Replace ``module.name`` by a wrapper that records ``gc.isenabled()`` when the
    pass calls it (and runs ``before`` first, if given)."""
    original = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        if before is not None:
            before()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


# ------------------------------------------------------------------- the context manager


def test_paused_collector_disables_then_enables():
    gc.enable()
    with paused_collector():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_paused_collector_leaves_a_disabled_collector_disabled():
    gc.disable()
    with paused_collector():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_paused_collector_enables_again_after_an_exception():
    gc.enable()
    with pytest.raises(PipemarkError, match="boom"), paused_collector():
        raise PipemarkError("boom")
    assert gc.isenabled()
    gc.disable()
    with pytest.raises(PipemarkError, match="boom"), paused_collector():
        raise PipemarkError("boom")
    assert not gc.isenabled()


def test_nested_paused_collectors_restore_the_outer_state():
    gc.enable()
    with paused_collector():
        with paused_collector():
            assert not gc.isenabled()
        # The inner block found the collector paused, so it leaves it paused.
        assert not gc.isenabled()
        with pytest.raises(MarkerError), paused_collector():
            raise MarkerError("inner failure")
        assert not gc.isenabled()
    assert gc.isenabled()


def test_paused_collector_uses_only_disable_and_enable(monkeypatch):
    calls = []
    monkeypatch.setattr(framework.gc, "disable", lambda: calls.append("disable"))
    monkeypatch.setattr(framework.gc, "enable", lambda: calls.append("enable"))
    monkeypatch.setattr(framework.gc, "isenabled", lambda: True)
    with paused_collector():
        assert calls == ["disable"]
    assert calls == ["disable", "enable"]


# ------------------------------------------------------------------------- the passes


@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_runs_with_the_collector_paused(monkeypatch, pass_name):
    run, module, inner, program = PASSES[pass_name]
    cj = program()
    seen: list[bool] = []
    _spy(monkeypatch, module, inner, seen)
    gc.enable()
    run(cj)
    assert seen and not any(seen)
    assert gc.isenabled()


@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_pass_leaves_a_disabled_collector_disabled(monkeypatch, pass_name):
    run, module, inner, program = PASSES[pass_name]
    cj = program()
    seen: list[bool] = []
    _spy(monkeypatch, module, inner, seen)
    gc.disable()
    run(cj)
    assert seen == [False] * len(seen) and seen
    assert not gc.isenabled()


def _nested_in_a_stage():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        x = pm.mark(x, name="b", mark_type="start")
        return pm.mark(pm.mark(x, name="b", mark_type="end"), name="a", mark_type="end")

    return jax.make_jaxpr(f)(1.0)


ERRORS = {
    "insert_markers": (lambda: pm.passes.insert_markers(_marked(), [1]), MarkerError),
    "layers_from_boundaries": (
        lambda: pm.passes.layers_from_boundaries(_marked()),
        MarkerError,
    ),
    "slice_stages": (lambda: pm.passes.slice_stages(_marked(), unmarked="bogus"), PipemarkError),
    "slice_stages nested": (lambda: pm.passes.slice_stages(_nested_in_a_stage()), MarkerError),
    "mark_missing_vars": (
        lambda: pm.passes.mark_missing_vars(_nested_in_a_stage()),
        MarkerError,
    ),
    # A list of equations is no ClosedJaxpr on any JAX (an open jaxpr is one from 0.11).
    "dce": (lambda: pm.passes.dce(_marked().jaxpr.eqns), PipemarkError),
}


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_collector_state_survives_a_failing_pass(case, enabled):
    call, error = ERRORS[case]
    if enabled:
        gc.enable()
    else:
        gc.disable()
    with pytest.raises(error):
        call()
    assert gc.isenabled() is enabled


def test_failure_inside_the_paused_part_enables_the_collector(monkeypatch):
    seen: list[bool] = []

    def fail():
        raise MarkerError("failed inside the pass")

    _spy(monkeypatch, slice, "_slice_stages", seen, before=fail)
    gc.enable()
    with pytest.raises(MarkerError, match="failed inside the pass"):
        pm.passes.slice_stages(_marked())
    assert seen == [False]
    assert gc.isenabled()


def test_a_pass_inside_a_pass_restores_the_collector(monkeypatch):
    """A pass that runs another pass while paused: the inner one leaves the collector
    paused for the rest of the outer one, which enables it when it returns."""
    outer_seen: list[bool] = []
    inner_seen: list[bool] = []
    after_inner: list[bool] = []
    cj = _marked()

    def run_inner():
        pm.passes.dce(cj)
        after_inner.append(gc.isenabled())

    _spy(monkeypatch, rewrite, "_dce", inner_seen)
    _spy(monkeypatch, slice, "_slice_stages", outer_seen, before=run_inner)
    gc.enable()
    staged = pm.passes.slice_stages(cj)
    assert [s.name for s in staged.stages] == ["a", "b"]
    assert outer_seen == [False]
    assert inner_seen == [False]
    assert after_inner == [False]
    assert gc.isenabled()


def test_pipeline_of_passes_and_split_keep_the_collector_enabled():
    gc.enable()
    ex = examples.mlp(num_layers=2, markers="boundary")
    staged = pm.split(ex.loss_fn, *ex.args)
    assert len(staged.stages) == 2
    assert gc.isenabled()
    marked = pm.passes.auto_layers(examples.mlp(num_layers=4, markers=None).trace(), 2)
    pm.passes.slice_stages(pm.passes.dce(pm.passes.mark_missing_vars(marked)))
    assert gc.isenabled()


def test_the_test_suite_runs_with_jax_checks():
    assert jax.config.jax_enable_checks


def test_a_pass_that_returns_an_ill_typed_program_fails_under_checks():
    from jax.extend.core import ClosedJaxpr

    @framework.jaxpr_pass
    def drop_first_equation(cj):
        # Reads a variable no equation defines any more: an ill-formed program.
        return ClosedJaxpr(cj.jaxpr.replace(eqns=cj.jaxpr.eqns[1:]), cj.consts)

    cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)
    with pytest.raises(Exception, match=r"Variable '.*' not defined"):
        drop_first_equation(cj)
    with jax.enable_checks(False):
        assert len(drop_first_equation(cj).eqns) == 1  # unchecked without jax checks


# Every public pass, and the arguments it takes after the program.
PUBLIC_PASSES = {
    "inline_calls": (),
    "insert_markers": ([1],),
    "layers_from_boundaries": (),
    "insert_markers_by_scope": (),
    "slice_stages": (),
    "remove_markers": (),
    "mark_missing_vars": (),
    "dce": (),
    "auto_layers": (2,),
    "plan_layers": (2,),
    "split_scan": (2,),
    "layers_from_scans": (),
    "split_at_gradient": (),
    "mark_apply_stage": (),
}


def test_the_list_names_every_pass():
    decorated = {
        name
        for name in pm.passes.__dict__
        if callable(getattr(pm.passes, name)) and hasattr(getattr(pm.passes, name), "__wrapped__")
    }
    assert decorated == set(PUBLIC_PASSES)


@pytest.mark.parametrize(
    "given",
    [
        # JAX 0.11 merged Jaxpr and ClosedJaxpr: from then on an open jaxpr is closed.
        pytest.param(
            "open jaxpr",
            marks=pytest.mark.skipif(
                CLOSED_JAXPR_IS_JAXPR, reason="JAX >= 0.11: ClosedJaxpr is Jaxpr"
            ),
        ),
        "function",
    ],
)
@pytest.mark.parametrize("name", sorted(PUBLIC_PASSES))
def test_every_pass_refuses_what_is_not_a_closed_jaxpr(name, given):
    value = jax.make_jaxpr(jnp.sin)(1.0).jaxpr if given == "open jaxpr" else jnp.sin
    with pytest.raises(PipemarkError, match=rf"^{name} takes a jax.extend.core.ClosedJaxpr"):
        getattr(pm.passes, name)(value, *PUBLIC_PASSES[name])


# ------------------------------------------------------------------ malformed programs


def _hand_built(kind: str):
    """A program with one malformed equation, built by hand as a user's pass might."""
    from jax.extend.core import ClosedJaxpr, Var, new_jaxpr_eqn, no_effects

    cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(3))
    jaxpr = cj.jaxpr
    sin, cos = jaxpr.eqns
    a, b = jaxpr.invars[0], sin.outvars[0]
    f32_3, f32_2 = a.aval, jax.core.ShapedArray((2,), jnp.float32)
    params = {"name": "s", "mark_type": "start"}
    if kind == "counts":
        marker = new_jaxpr_eqn([b], [Var(f32_3), Var(f32_3)], pm.pipeline_p, params, no_effects)
        read = marker.outvars[0]
    elif kind == "avals":
        marker = new_jaxpr_eqn([b], [Var(f32_2)], pm.pipeline_p, params, no_effects)
        read = b
    elif kind == "own operand":
        c = Var(f32_3)
        marker = new_jaxpr_eqn([c], [c], pm.pipeline_p, params, no_effects)
        read = c
    else:  # read before definition
        ghost = Var(f32_3)
        marker = new_jaxpr_eqn([ghost], [Var(f32_3)], pm.pipeline_p, params, no_effects)
        read = marker.outvars[0]
    eqns = [sin, marker, cos.replace(invars=[read])]
    return ClosedJaxpr(jaxpr.replace(eqns=eqns), cj.consts)


MALFORMED = {
    "counts": (
        pm.errors.MarkerError,
        r"equation 1 \(pipeline_marker start 's'.*1 operands and 2 results",
    ),
    "avals": (pm.errors.MarkerError, r"equation 1 \(pipeline_marker start 's'.*f32\[2\]"),
    "own operand": (PipemarkError, r"equation 1 \(pipeline_marker start 's'.*reads"),
    "undefined": (PipemarkError, r"equation 1 \(pipeline_marker start 's'.*reads .* which no"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
@pytest.mark.parametrize("name", sorted(PUBLIC_PASSES))
def test_every_pass_refuses_a_malformed_program(name, kind):
    error, pattern = MALFORMED[kind]
    cj = _hand_built(kind)
    eqns = list(cj.jaxpr.eqns)
    with pytest.raises(error, match=f"^{name}: {pattern}"):
        getattr(pm.passes, name)(cj, *PUBLIC_PASSES[name])
    assert cj.jaxpr.eqns == eqns  # the input is untouched
