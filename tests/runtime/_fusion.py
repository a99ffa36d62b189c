"""The pipeline of the tests of fused forward and backward steps
(tests/runtime/test_steps.py, which checks what is fused, and
tests/runtime/test_execution.py, which runs it): a small MLP on one device per stage,
and a plan's steps as they are before fusion."""

from __future__ import annotations

import pipemark as pm
from pipemark import examples
from pipemark.runtime.devices.steps import resolve_steps
from tests._devices import computing_on
from tests._devices import devices as pick_devices


def mlp_pipeline(
    num_stages: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    devices: int | None = None,
    batch: int = 8,
    *,
    num_layers: int = 4,
    width: int = 8,
    recompute_residuals: bool = True,
    **options,
) -> tuple[pm.runtime.Pipeline, examples.Example]:
    """``pm.pipeline_value_and_grad`` of an MLP (4 layers of width 8 by default) on
    ``devices`` devices (by default one per stage; :func:`tests._devices.devices`), and
    the MLP, its arrays made on the pipeline's first device; ``options``: more of
    ``pm.pipeline_value_and_grad``'s."""
    used = pick_devices(devices or num_stages)
    with computing_on(used):
        ex = examples.mlp(num_layers=num_layers, width=width, batch=batch)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=used,
        recompute_residuals=recompute_residuals,
        **options,
    )
    return pipe, ex


def unfused_steps(plan):
    """``plan``'s steps as :func:`resolve_steps` makes them, no forward folded into a
    backward."""
    return resolve_steps(
        plan.staged,
        plan.schedule,
        plan.roles(),
        plan.units,
        plan.placement,
        plan.num_param_leaves,
        fuse=False,
    )
