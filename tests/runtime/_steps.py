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
