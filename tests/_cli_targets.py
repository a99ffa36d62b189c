"""Functions for the `pipemark inspect` tests to import by name (tests._cli_targets:NAME)."""

import jax.numpy as jnp

import pipemark as pm


def marked(x, w):
    """Two layers split by a boundary marker."""
    x = jnp.tanh(x @ w)
    pm.mark_pipeline_boundary()
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def plain(x, w):
    """Three layers, no marker."""
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return jnp.sum(x**2)


def with_tokens(tokens, table):
    """An embedding lookup: an int32 argument next to a float one."""
    return jnp.sum(jnp.tanh(jnp.take(table, tokens, axis=0)))


def broken(x, w):
    """Fails while it is traced."""
    return x @ w.T.T.reshape(-1, 7)


NOT_A_FUNCTION = 3
