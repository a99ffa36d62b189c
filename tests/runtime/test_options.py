"""PipelineOptions: what a pipeline is asked to do, checked before anything is traced."""

from __future__ import annotations

import jax
import pytest

import pipemark as pm
from pipemark import examples


@pytest.mark.parametrize(
    "devices, message",
    [
        ([], r"devices is empty; give at least one jax device"),
        (["cpu:0", "cpu:1"], r"devices\[0\] is 'cpu:0', not a jax.Device \(a device's name"),
        ("cpu", r"devices is 'cpu'; give a list of jax devices"),
        (jax.devices()[0], r"devices is .*; give a list of jax devices"),
        ([jax.devices()[0], 3], r"devices\[1\] is 3, not a jax.Device;"),
    ],
)
def test_bad_devices_are_named_before_tracing(devices, message):
    ex = examples.mlp(2)
    with pytest.raises(pm.PipemarkError, match=message):
        pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=1, devices=devices)


def test_devices_may_be_any_iterable_of_devices():
    ex = examples.mlp(2)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=1, num_microbatches=1, devices=iter(jax.devices()[:1])
    )
    loss, _ = pipe(*ex.args)
    want, _ = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
