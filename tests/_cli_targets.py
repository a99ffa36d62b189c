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


def flax_loss(params, x):
    """A flax linen MLP's loss: its parameters are a nested dict."""
    return jnp.mean(_flax_model().apply(params, x) ** 2)


def flax_args():
    """Example arguments for flax_loss: (params, x)."""
    import jax

    x = jnp.ones((4, 8))
    return (_flax_model().init(jax.random.PRNGKey(0), x), x)


def flax_args_dict():
    """The same, as a dict of args and kwargs."""
    params, x = flax_args()
    return {"args": (params,), "kwargs": {"x": x}}


def _flax_model():
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.tanh(nn.Dense(8)(x))
            return nn.Dense(1)(x)

    return Model()


def failing_args():
    """Raises while making the arguments."""
    raise RuntimeError("no data here")


def wrong_args():
    """Returns something that is not a tuple of arguments."""
    return 3


def hostile_names(x, w):
    """Stages named with rich markup and an ANSI escape sequence."""
    x = pm.mark((x, w), name="[bold]x[/]", mark_type="start")[0]
    x = pm.mark(jnp.tanh(x @ w), name="[bold]x[/]", mark_type="end")
    x = pm.mark((x, w), name="[/]", mark_type="start")[0]
    x = pm.mark(jnp.tanh(x @ w), name="[/]", mark_type="end")
    x = pm.mark((x, w), name="red\x1b[31m[link=http://x]", mark_type="start")[0]
    return jnp.sum(pm.mark(x, name="red\x1b[31m[link=http://x]", mark_type="end") ** 2)


def exits(x, w):
    """Calls sys.exit(0) while it is traced."""
    import sys

    sys.exit(0)


def four_layers(x, w):
    """Four layers split by boundary markers."""
    for i in range(4):
        if i:
            pm.mark_pipeline_boundary()
        x = jnp.tanh(x @ w) * (1.0 + i)
    return jnp.mean(x**2)


def hostile_args():
    """Raises with terminal control characters and a right-to-left override in its
    message, as a user's exception might."""
    raise RuntimeError("no \x1b[2J\x1b[31mdata\u202e here")


def evil_names(x, w):
    """A stage named with a right-to-left override and an ANSI escape."""
    x = pm.mark(x, name="a\u202eb", mark_type="start")
    x = pm.mark(jnp.tanh(x @ w), name="a\u202eb", mark_type="end")
    x = pm.mark(x, name="c\x1b[31m", mark_type="start")
    return pm.mark(jnp.sum(x**2), name="c\x1b[31m", mark_type="end")


def pipeline_loss(w, x):
    """Parameters first, then the batch, as pipeline_value_and_grad takes them."""
    x = jnp.tanh(x @ w)
    pm.mark_pipeline_boundary()
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def no_batch(w):
    """Parameters only: nothing to split into microbatches."""
    w = jnp.tanh(w)
    pm.mark_pipeline_boundary()
    return jnp.sum(w**2)
