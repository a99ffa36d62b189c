"""The least a pipelined training script needs (docs/training.md explains each part):
``python examples/train_minimal.py`` in one process, or
``python -m pipemark.launch -n 2 examples/train_minimal.py`` in two.
"""

import jax
import jax.numpy as jnp
import optax

import pipemark as pm
from pipemark import launch

STAGES, MICROBATCHES, STEPS, SIZES = 2, 4, 20, (8, 32, 32, 32, 1)
tx = optax.adam(1e-2)


def loss_fn(params, batch):
    x, y = batch
    for i, (w, b) in enumerate(params):
        if i:
            pm.mark_pipeline_boundary()  # stages are cut between layers
        x = x @ w + b if i == len(params) - 1 else jnp.tanh(x @ w + b)
    return jnp.mean((x - y) ** 2)


def step(params, opt_state, batch):  # as for jax.jit; the batch comes last
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def batch_at(k):  # the same global batch in every process, from the step number
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), k), (32, SIZES[0]))
    return x, jnp.sin(x[:, :1] + x[:, 1:2])


def init_params(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [(jax.random.normal(k, (m, n)) / m**0.5, jnp.zeros(n))
            for k, m, n in zip(keys, SIZES[:-1], SIZES[1:])]  # fmt: skip


if __name__ == "__main__":
    launch.start_jax(cpu_devices=STAGES)  # first: join the other processes; CPU devices
    params = init_params(jax.random.key(0))
    state = (params, tx.init(params))
    devices = pm.runtime.stage_devices(STAGES)  # consecutive stages in one process
    pipelined = pm.pipeline_train_step(
        step, num_stages=STAGES, num_microbatches=MICROBATCHES, devices=devices
    )
    for k in range(STEPS):
        *state, loss = pipelined(*state, batch_at(k))
        if jax.process_index() == 0:  # the loss reaches every process; one prints it
            print(f"step {k}: loss {float(loss):.6f}")
