"""Lowering modes: what the StableHLO holds in each, and how the mode is chosen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark.lowering import LOWERING_MODES, get_lowering
from tests._trees import assert_trees_within_ulps

X = jnp.arange(6.0).reshape(2, 3)


def marked(x):
    x = pm.mark(x, name="s", mark_type="start")
    pm.mark_pipeline_boundary()
    return pm.mark(jnp.sin(x), name="s", mark_type="end")


def lowered_text(f, *args) -> str:
    return jax.jit(f).lower(*args).as_text()


def test_default_mode_is_barrier():
    assert get_lowering() == "barrier"
    assert LOWERING_MODES == ("barrier", "identity", "custom_call")


def test_barrier_mode_emits_optimization_barrier():
    with pm.lowering("barrier"):
        text = lowered_text(marked, X)
    # one barrier for each marker with operands; the boundary marker lowers to nothing
    assert text.count("stablehlo.optimization_barrier") == 2


def test_identity_mode_emits_no_barrier():
    with pm.lowering("identity"):
        text = lowered_text(marked, X)
        # Compiled against eager sin: two programs (tests/_exact.py).
        assert_trees_within_ulps(jax.jit(marked)(X), jnp.sin(X))
    assert "optimization_barrier" not in text


def test_context_manager_restores_previous_mode():
    with pm.lowering("identity"):
        assert get_lowering() == "identity"
        with pm.lowering("barrier"):
            assert get_lowering() == "barrier"
        assert get_lowering() == "identity"
    assert get_lowering() == "barrier"


def test_set_lowering_is_global_and_selecting_twice_is_harmless():
    try:
        pm.set_lowering("identity")
        pm.set_lowering("identity")
        assert get_lowering() == "identity"
        assert "optimization_barrier" not in lowered_text(marked, X)
    finally:
        pm.set_lowering("barrier")
    assert "optimization_barrier" in lowered_text(marked, X)


def test_mode_is_part_of_the_jit_cache_key():
    f = jax.jit(marked)
    with pm.lowering("identity"):
        identity_text = f.lower(X).as_text()
        f(X)
    barrier_text = f.lower(X).as_text()
    f(X)
    assert "optimization_barrier" not in identity_text
    assert "optimization_barrier" in barrier_text


def test_grad_lowers_in_both_modes():
    def loss(x):
        return jnp.sum(marked(x) ** 2)

    want = 2 * jnp.sin(X) * jnp.cos(X)
    for mode in ("barrier", "identity"):
        with pm.lowering(mode):
            np.testing.assert_allclose(jax.jit(jax.grad(loss))(X), want, rtol=1e-6)


def test_unknown_mode_is_refused():
    with pytest.raises(pm.PipemarkError, match=r"Unknown lowering mode 'fast'.*barrier, identity"):
        pm.set_lowering("fast")
    with pytest.raises(pm.PipemarkError, match="Unknown lowering mode None"), pm.lowering(None):
        pass
    assert get_lowering() == "barrier"
