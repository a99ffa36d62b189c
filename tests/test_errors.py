"""Every error the primitive's public functions raise: its type and its message."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal, Var

import pipemark as pm
from pipemark.errors import describe_eqn

X = jnp.ones((2, 3))


def test_hierarchy():
    assert issubclass(pm.errors.MarkerError, pm.PipemarkError)
    assert issubclass(pm.errors.StageGraphError, pm.PipemarkError)
    # The original functions raised ValueError; code catching that keeps working.
    assert issubclass(pm.errors.MarkerError, ValueError)
    # Running out of device memory is both ours and Python's (tests/runtime/test_memory.py).
    assert issubclass(pm.DeviceOutOfMemoryError, pm.PipemarkError)
    assert issubclass(pm.DeviceOutOfMemoryError, MemoryError)


@pytest.mark.parametrize("bad", ["begin", "START", "", None, 3])
def test_mark_unknown_mark_type(bad):
    with pytest.raises(pm.errors.MarkerError, match=rf"Unknown mark type: {bad!r}\. .*start, end"):
        pm.mark(X, name="a", mark_type=bad)


def test_mark_name_must_be_str():
    with pytest.raises(pm.errors.MarkerError, match=r"name must be a str, got 7 of type int"):
        pm.mark(X, name=7, mark_type="start")


@pytest.mark.parametrize(
    ("leaf", "shown"),
    [("text", "'text' of type str"), (object, "<class 'object'> of type type")],
)
def test_mark_non_array_leaf(leaf, shown):
    with pytest.raises(pm.errors.MarkerError, match=rf"cannot mark {shown}; every leaf"):
        pm.mark({"x": X, "bad": leaf}, name="a", mark_type="start")


def test_mark_non_array_leaf_under_jit_names_the_marker():
    with pytest.raises(pm.errors.MarkerError, match=r"mark\(name='layer3', mark_type='end'\)"):
        jax.jit(lambda x: pm.mark((x, "oops"), name="layer3", mark_type="end"))(X)


@pytest.mark.parametrize("bad", ["boundary", "grad", "hook", "stop"])
def test_mark_pipeline_jaxpreqn_refuses_other_mark_types(bad):
    v = Var(jax.typeof(X))
    with pytest.raises(
        pm.errors.MarkerError, match=rf"Unknown mark type: '{bad}'\..*mark_hook_jaxpreqn"
    ):
        pm.mark_pipeline_jaxpreqn([v], [Var(jax.typeof(X))], "s", bad)
    with pytest.raises(ValueError):  # what the original raised
        pm.mark_pipeline_jaxpreqn([v], [Var(jax.typeof(X))], "s", bad)


def test_mark_pipeline_jaxpreqn_name_must_be_str():
    v = Var(jax.typeof(X))
    with pytest.raises(pm.errors.MarkerError, match="name must be a str"):
        pm.mark_pipeline_jaxpreqn([v], [Var(jax.typeof(X))], None, "start")


def test_eqn_builders_check_arity_and_types():
    a, b = Var(jax.typeof(X)), Var(jax.typeof(X))
    with pytest.raises(
        pm.errors.MarkerError, match=r"one result per operand, got 2 operands and 1"
    ):
        pm.mark_pipeline_jaxpreqn([a, b], [Var(jax.typeof(X))], "s", "start")
    other = Var(jax.typeof(jnp.ones(4, jnp.int32)))
    with pytest.raises(
        pm.errors.MarkerError, match=r"operand 0 has type f32\[2,3\] but result 0 has type i32\[4\]"
    ):
        pm.mark_hook_jaxpreqn([a], [other])
    lit = Literal(np.float32(1.0), jax.typeof(np.float32(1.0)))
    with pytest.raises(
        pm.errors.MarkerError, match=r"mark_hook_jaxpreqn: result 0 is .* not a jaxpr Var"
    ):
        pm.mark_hook_jaxpreqn([lit], [lit])


@pytest.mark.parametrize("bad", ["f32[2]", 3, None])
def test_flatten_shape_byte_sizes_bad_leaf(bad):
    shown = re.escape(f"{bad!r} of type {type(bad).__name__} has no shape")
    with pytest.raises(pm.PipemarkError, match=shown):
        pm.flatten_shape_byte_sizes((jax.ShapeDtypeStruct((2,), jnp.float32), bad))


def test_describe_eqn_names_index_primitive_marker_and_source_line():
    def f(x):
        return pm.mark(jnp.sin(x), name="layer0", mark_type="end")

    eqns = jax.make_jaxpr(f)(X).eqns
    text = describe_eqn(eqns[1], 1)
    assert text.startswith("equation 1 (pipeline_marker end 'layer0', ")
    assert "test_errors.py:" in text and text.endswith(".f))")
    assert describe_eqn(eqns[0]).startswith("equation (sin, ")
    hand_built = pm.mark_hook_jaxpreqn([Var(jax.typeof(X))], [Var(jax.typeof(X))])
    assert describe_eqn(hand_built, 4) == "equation 4 (pipeline_marker hook 'hook')"
