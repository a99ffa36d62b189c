"""Differential fuzzing (#24 item 3): random programs built from the idioms real models
use (:mod:`tests._programs`) go through every public entry — ``pm.split`` at boundary
markers and with ``num_stages``, ``pm.passes.inline_calls``, ``pm.passes.split_scan``,
``pm.passes.split_backward`` — and each result, values and gradients, is compared with
JAX's own evaluation of the original function (eager ``fn`` and
``jax.value_and_grad``), never with a program a pipemark pass touched. The runtime's
schedules are fuzzed in ``tests/runtime/test_differential.py``.

Profiles: ``PIPEMARK_FUZZ=ci`` (default; the example counts below, seeded),
``PIPEMARK_FUZZ=half`` and ``third`` (half and a third as many: ``make test`` runs a
third with seed 0 and ``make test-newest`` with seed 1, so the two JAX environments try
different programs, together two thirds of a ``ci`` run, for CI's time) and ``PIPEMARK_FUZZ=long`` (ten times
as many); ``PIPEMARK_FUZZ_SEED`` picks another seed than 0. Measured (2026-12-04, one core, jax 0.10.2 CPU): an example with control flow
(scan, cond, while, checkpoint) costs about 0.45 s when its gradient is checked too,
mostly compiling the bodies JAX's transposition makes afresh for each program (the
staged program's and eager ``jax.value_and_grad``'s alike), so those tests run 290
examples; straight-line programs (every other idiom) cost about 0.07 s and run 1,710,
for 2,000 in all; the long profile runs 20,000.
"""

from __future__ import annotations

import os

import jax
import pytest
from hypothesis import HealthCheck, given, reject, seed, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

import pipemark as pm
from tests._programs import (
    SCANS,
    Recipe,
    Step,
    assert_close,
    build,
    describe,
    inputs,
    loss_of,
    recipes,
)

PROFILE = os.environ.get("PIPEMARK_FUZZ", "ci")
_SCALES = {"ci": 1.0, "half": 0.5, "third": 1 / 3, "long": 10.0}
if PROFILE not in _SCALES:
    raise ValueError(f"PIPEMARK_FUZZ must be one of {sorted(_SCALES)}, got {PROFILE!r}")
SCALE = _SCALES[PROFILE]
SEED = int(os.environ.get("PIPEMARK_FUZZ_SEED", "0"))


@pytest.fixture(autouse=True, scope="module")
def _without_jax_checks():
    # The suite runs JAX with jax_enable_checks (conftest); here JAX's re-checking of
    # every jaxpr it builds and runs costs ~15 % of each example, and checks nothing the
    # comparison with JAX's own results does not (pipemark's passes still check theirs).
    with jax.enable_checks(False):
        yield


def fuzz(examples: int):
    """Hypothesis settings for a test run ``examples`` times in the ci profile."""

    def wrap(test):
        test = settings(
            max_examples=max(1, int(examples * SCALE)),
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )(test)
        # Slow (conftest.py runs slow tests first, so the workers share them).
        return pytest.mark.slow(seed(SEED)(test))

    return wrap


def _flat(params, x):
    return jax.tree_util.tree_leaves((params, x))


def _check_values(staged_call, recipe, what):
    params, x = inputs(0)
    want = build(recipe)(params, x)
    assert_close(staged_call(params, x), want, what, recipe)


def _check_grads(staged_call, recipe, what, want=None):
    """``staged_call`` against eager ``jax.value_and_grad`` of the recipe's loss, or
    against ``want``, that value computed before for the same recipe."""
    params, x = inputs(1)
    if want is None:
        want = jax.value_and_grad(loss_of(recipe))(params, x)
    assert_close(staged_call(params, x), want, what, recipe)


@fuzz(60)
@given(recipe=recipes(markers=True))
def test_split_at_markers(recipe):
    """pm.split(fn, ...) at boundary markers, and pm.split(value_and_grad(loss), ...)."""
    params, x = inputs(0)
    _check_values(pm.split(build(recipe), params, x), recipe, "pm.split")
    if not recipe.differentiable:
        return  # JAX cannot reverse-differentiate a while loop
    grad = jax.value_and_grad(loss_of(recipe))
    _check_grads(pm.split(grad, params, x), recipe, "pm.split(value_and_grad)")


# An unbalanced cut is what a tiny random program gives; the warning says so.
@pytest.mark.filterwarnings("ignore:.*cannot be balanced:pipemark.errors.PipemarkWarning")
@fuzz(60)
@given(recipe=recipes(), num_stages=st.integers(1, 4))
def test_split_num_stages(recipe, num_stages):
    params, x = inputs(0)
    staged = _split_or_reject(build(recipe), params, x, num_stages)
    _check_values(staged, recipe, f"pm.split(num_stages={num_stages})")
    if not recipe.differentiable:
        return
    grad = jax.value_and_grad(loss_of(recipe))
    staged = _split_or_reject(grad, params, x, num_stages)
    _check_grads(staged, recipe, f"pm.split(value_and_grad, num_stages={num_stages})")


def _split_or_reject(fn, params, x, num_stages):
    """pm.split into num_stages, or reject the example when the program has fewer
    equations than stages (refused, rightly, with a PipemarkError saying so)."""
    try:
        return pm.split(fn, params, x, num_stages=num_stages)
    except pm.PipemarkError as error:
        if "too few for" not in str(error):
            raise
        reject()


def _inlined(fn):
    def call(params, x):
        cj = jax.make_jaxpr(fn)(params, x)
        return jaxpr_as_fun(pm.passes.inline_calls(cj))(*_flat(params, x))

    return call


@fuzz(60)
@given(recipe=recipes(markers=True))
def test_inline_calls(recipe):
    _check_values(_inlined(build(recipe)), recipe, "inline_calls")
    if recipe.differentiable:
        _check_grads(_inlined(jax.value_and_grad(loss_of(recipe))), recipe, "inline_calls(grad)")


def _scan_split(fn, num_chunks):
    def call(params, x):
        cj = jax.make_jaxpr(fn)(params, x)
        split = pm.passes.split_scan(cj, num_chunks, min_cost_fraction=0.0)
        return jaxpr_as_fun(split)(*_flat(params, x))

    return call


@fuzz(40)
@given(recipe=recipes(needs=SCANS), num_chunks=st.integers(2, 4))
def test_split_scan(recipe, num_chunks):
    what = f"split_scan({num_chunks})"
    _check_values(_scan_split(build(recipe), num_chunks), recipe, what)
    if not recipe.differentiable:
        return
    grad = jax.value_and_grad(loss_of(recipe))
    _check_grads(_scan_split(grad, num_chunks), recipe, what + " of value_and_grad")


@pytest.mark.filterwarnings("ignore:.*cannot be balanced:pipemark.errors.PipemarkWarning")
@fuzz(40)
@given(
    recipe=recipes(markers=True, differentiable=True) | recipes(differentiable=True),
    num_stages=st.integers(1, 4),
)
def test_split_backward(recipe, num_stages):
    """split_backward of a staged gradient, cut at its markers or into num_stages."""
    params, x = inputs(1)
    grad = jax.value_and_grad(loss_of(recipe))
    if recipe.marked:
        num_stages = None  # a marked program is cut at its markers
    staged = _split_or_reject(grad, params, x, num_stages)
    _check_grads(pm.passes.split_backward(staged), recipe, "split_backward")


def test_describe_prints_the_program():
    recipe = Recipe(
        (Step("jit", (0, 0, 0), arg="silu", times=2), Step("scan", (1,), flag=True)),
        outputs=(0,),
        boundaries=(0,),
    )
    assert describe(recipe).splitlines() == [
        "def fn(params, x):  # v0 = x; w = params['w'], b = params['b']",
        "    v1 = jit helper silu x2 on v0, v0, v0 (on w[0]: False)",
        "    pm.mark_pipeline_boundary()",
        "    v2 = scan(_layer, v1, stack, reverse=True)",
        "    return {'out': v2, 'aux': (v0,)}",
    ]


# Most of the example count: straight-line programs (every idiom but control flow:
# jitted helpers called 1-3 times, nested jit, activations, custom_jvp/custom_vjp, tied
# weights, pytrees, markers inside a jitted helper), values and gradients, through
# pm.split at markers, pm.split with num_stages and inline_calls. Control flow is above,
# with fewer examples: its bodies are compiled afresh for each program.
@pytest.mark.filterwarnings("ignore:.*cannot be balanced:pipemark.errors.PipemarkWarning")
@fuzz(int(os.environ.get("PIPEMARK_FUZZ_STRAIGHT", "1710")))
@given(recipe=recipes(markers=True, straight=True), num_stages=st.integers(1, 4))
def test_straight_line_programs_every_entry(recipe, num_stages):
    params, x = inputs(0)
    grad = jax.value_and_grad(loss_of(recipe))
    _check_values(pm.split(build(recipe), params, x), recipe, "pm.split")
    # JAX's gradient of this program, computed eagerly once for the two checks of it:
    # the same program on the same inputs. Computing it again cost 9-22 % of this test.
    want = grad(*inputs(1))
    _check_grads(pm.split(grad, params, x), recipe, "pm.split(value_and_grad)", want)
    _check_grads(_inlined(grad), recipe, "inline_calls(grad)", want)
    if "marked_jit" in recipe.kinds:
        return  # a marker inside a helper: num_stages would merge marked stages instead
    unmarked = Recipe(recipe.steps, recipe.outputs, ())
    staged = _split_or_reject(jax.value_and_grad(loss_of(unmarked)), params, x, num_stages)
    _check_grads(staged, unmarked, f"pm.split(value_and_grad, num_stages={num_stages})")
