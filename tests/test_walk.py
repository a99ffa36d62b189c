"""pipemark.walk: the bodies of higher-order primitives, found alike for every one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive, jaxprs_in_params, new_jaxpr_eqn, no_effects

import pipemark as pm
from pipemark import examples
from pipemark.primitive import is_marker
from pipemark.walk import BODY_PARAMS, CALL_PRIMITIVES, bodies, find_eqn, iter_eqns


def _programs():
    def many(x):
        x = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
        x = lax.cond(x.sum() > 0, jnp.cos, jnp.sin, x)
        x = lax.while_loop(lambda y: y.sum() < 3, lambda y: y + 1, x)
        x = jax.checkpoint(jnp.tanh)(x)
        x = jax.nn.relu(x)  # a custom_jvp
        x = jnp.sort(x) + x.at[0].add(1.0)
        return lax.reduce_window(x, 0.0, lax.add, (2,), (1,), "VALID").sum()

    yield jax.make_jaxpr(jax.jit(many))(jnp.ones(4))

    def smooth(x):
        return jnp.sum(jax.checkpoint(jnp.tanh)(jax.nn.relu(x)) * jnp.sort(x))

    yield jax.make_jaxpr(jax.jit(jax.value_and_grad(smooth)))(jnp.ones(4))
    for ex in (
        examples.transformer(num_layers=2, d_model=8, num_heads=2, seq=4, batch=2),
        examples.resnet(num_blocks=2, width=8, batch=2),
    ):
        yield jax.make_jaxpr(jax.value_and_grad(ex.loss_fn))(*ex.args)


def test_bodies_are_the_jaxprs_in_the_parameters():
    """The walker finds exactly the jaxprs JAX's own helper finds, for every equation
    (the fast paths skip only equations that hold none)."""
    seen = set()
    for cj in _programs():
        for eqn in iter_eqns(cj):
            seen.add(eqn.primitive.name)
            assert [id(b) for _, b in bodies(eqn)] == [
                id(b) for b in jaxprs_in_params(eqn.params)
            ], eqn.primitive.name
    assert {"jit", "scan", "cond", "while", "custom_jvp_call", "sort"} <= seen


def test_known_primitives_name_their_body_parameters():
    cj = jax.make_jaxpr(lambda x: lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0)
    (cond,) = [e for e in cj.eqns if e.primitive.name == "cond"]
    assert [param for param, _ in bodies(cond)] == ["branches", "branches"]
    assert BODY_PARAMS["while"] == ("cond_jaxpr", "body_jaxpr")
    assert {"jit", "remat2", "custom_vjp_call"} <= CALL_PRIMITIVES
    assert "scan" not in CALL_PRIMITIVES


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"axes": (0, 1), "out_sharding": None, "name": "x", "flag": True, "x": 1.5},
        {"new_dtype": np.dtype("float32"), "nested": ((1, 2), ("a",))},
        {"jaxpr": "placeholder"},
        {"fn": print, "values": (1, object()), "more": [np.float32(1)]},
    ],
)
def test_an_unknown_primitive_without_jaxprs_has_no_body(params):
    eqn = new_jaxpr_eqn([], [], Primitive("my_op"), params, no_effects)
    assert bodies(eqn) == []


def test_an_unknown_primitive_is_searched_for_jaxprs():
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    params = {"fn": cj, "branches": (cj, cj.jaxpr), "length": 2}
    eqn = new_jaxpr_eqn([], [], Primitive("my_call"), params, no_effects)
    assert [(p, b) for p, b in bodies(eqn)] == [
        ("fn", cj.jaxpr),
        ("branches", cj.jaxpr),
        ("branches", cj.jaxpr),
    ]


def test_find_eqn_searches_bodies_once():
    def f(x):
        g = jax.jit(lambda y: pm.mark(jnp.sin(y), name="h", mark_type="hook"))
        return g(x) + g(x)

    cj = jax.make_jaxpr(f)(1.0)
    memo = {}
    found = find_eqn(cj, lambda e: is_marker(e, "hook"), memo)
    assert found is not None and found.params["name"] == "h"
    assert find_eqn(cj, lambda e: e.primitive.name == "cos") is None
    # The jitted body appears twice; it is walked once.
    names = [e.primitive.name for e in iter_eqns(cj)]
    assert names.count("sin") == 1 and names.count("jit") == 2
