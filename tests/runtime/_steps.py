"""The training step of the update, memory and budget tests
(tests/runtime/test_update.py, test_memory.py, test_budget.py): an example MLP's
``pipemark.examples.train_step`` with its optimizer state, made on the first of two
devices (the default backend's, else the host CPU's)."""

from __future__ import annotations

from typing import Any, NamedTuple

from pipemark import examples
from tests._devices import computing_on
from tests._devices import devices as pick_devices


class TrainCase(NamedTuple):
    used: list[Any]  # the two devices the pipeline runs on
    ex: Any  # the example: loss_fn, params, batch
    step: Any  # the training step, step(params, state, batch)
    state: Any  # the optimizer's state for ex.params


def mlp_train_step(optimizer: str, **mlp: int) -> TrainCase:
    """``examples.mlp(**mlp)``'s training step with ``optimizer`` and its state."""
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(**mlp)
        step, init = examples.train_step(ex.loss_fn, optimizer=optimizer)
        state = init(ex.params)
    return TrainCase(used, ex, step, state)


def optax_step(loss_fn, tx):
    """The training step as a user writes it with the optax optimizer ``tx``, its
    gradients marked for the pipeline (``pm.mark_gradient``)."""
    import jax
    import optax

    import pipemark as pm

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
