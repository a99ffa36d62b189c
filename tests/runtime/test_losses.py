"""count_batch_free_terms_once: the terms of a summed output that do not read the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from pipemark.runtime.losses import count_batch_free_terms_once

W, X = jnp.float32(0.7), jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)


def _data(w, x):
    return jnp.sum(jnp.sin(x * w))


def test_batch_free_terms_are_divided_and_the_rest_kept():
    def loss(w, x):
        return _data(w, x) - 0.5 * w**2 + 3.0

    new = count_batch_free_terms_once(jax.make_jaxpr(loss)(W, X), 1, num_microbatches=4)
    got = jaxpr_as_fun(new)(W, X)[0]
    want = jax.jit(lambda w, x: _data(w, x) + (-0.5 * w**2 + 3.0) / 4)(W, X)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_what_is_left_as_it_is():
    cases = {
        # Every term reads the batch.
        "data only": lambda w, x: _data(w, x) + jnp.sum(x),
        # A batch-free term under a product: documented as not found.
        "under a product": lambda w, x: 2.0 * (_data(w, x) + w**2),
    }
    for name, fn in cases.items():
        cj = jax.make_jaxpr(fn)(W, X)
        assert count_batch_free_terms_once(cj, 1, num_microbatches=4) is cj, name
    # One microbatch: nothing to divide.
    cj = jax.make_jaxpr(lambda w, x: _data(w, x) + w)(W, X)
    assert count_batch_free_terms_once(cj, 1, num_microbatches=1) is cj


def test_integer_outputs_are_not_scaled():
    def step(w, count, x):
        return _data(w, x) + w, count + 1

    cj = jax.make_jaxpr(step)(W, jnp.int32(5), X)
    got = jaxpr_as_fun(count_batch_free_terms_once(cj, 2, num_microbatches=2))(W, jnp.int32(5), X)
    assert int(got[1]) == 6 and got[1].dtype == jnp.int32
    np.testing.assert_allclose(got[0], jax.jit(lambda w, x: _data(w, x) + w / 2)(W, X), rtol=1e-6)
