"""The model of the command-line example on docs/real-models.md (a flax linen MLP)."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 256, 256, 256):
            x = nn.gelu(nn.Dense(width)(x))
        return nn.Dense(1)(x)


def loss(params, x, y):
    return jnp.mean((MLP().apply(params, x) - y) ** 2)


def make_args():
    x, y = jnp.ones((32, 256)), jnp.zeros((32, 1))
    return (MLP().init(jax.random.PRNGKey(0), x), x, y)
