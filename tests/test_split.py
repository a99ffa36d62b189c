"""pm.split: trace and slice in one call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark import examples


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
def test_split_startend_models(kind):
    ex = getattr(examples, kind)()
    staged = pm.split(ex.loss_fn, *ex.args)
    names = [s.name for s in staged.stages]
    prefix = "layer" if kind == "mlp" else "block"
    assert names == [f"{prefix}{i}" for i in range(len(names))]
    staged.verify(ex.loss_fn, *ex.args)


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
def test_split_boundary_models(kind):
    ex = getattr(examples, kind)(markers="boundary")
    staged = pm.split(ex.loss_fn, *ex.args)
    assert [s.name for s in staged.stages] == [f"layer{i}" for i in range(len(staged.stages))]
    assert len(staged.stages) == len(pm.split(getattr(examples, kind)().loss_fn, *ex.args).stages)
    staged.verify(ex.loss_fn, *ex.args)


def test_split_value_and_grad_gives_mirrored_stages():
    ex = examples.mlp(num_layers=3)
    fn = jax.value_and_grad(ex.loss_fn)
    staged = pm.split(fn, *ex.args)
    assert [s.name for s in staged.stages] == [
        "layer0",
        "layer1",
        "layer2",
        "layer2_backward",
        "layer1_backward",
        "layer0_backward",
    ]
    staged.verify(fn, *ex.args)


def test_split_training_step_with_gradient_marker():
    ex = examples.mlp(num_layers=2)
    step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    args = (ex.params, init_state(ex.params), ex.batch)
    staged = pm.split(step, *args)
    assert [s.name for s in staged.stages][:2] == ["layer0", "layer1"]
    staged.verify(step, *args)


def test_split_with_shape_dtype_structs():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        return pm.mark(jnp.sin(x), name="a", mark_type="end")

    staged = pm.split(f, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert staged.stages[0].in_avals[0].shape == (3,)


def test_split_unmarked_error():
    def f(x):
        x = pm.mark(x, name="a", mark_type="start")
        return jnp.sum(pm.mark(jnp.sin(x), name="a", mark_type="end"))

    with pytest.raises(pm.errors.MarkerError, match=r"equation 3 \(reduce_sum.*test_split.py"):
        pm.split(f, jnp.ones(3), unmarked="error")
    assert len(pm.split(f, jnp.ones(3)).stages) == 1


def test_split_num_stages_balances_an_unmarked_model():
    # num_stages hands the program to pm.passes.auto_layers (see tests/passes/test_auto.py).
    ex = examples.mlp(num_layers=4, markers=None)
    staged = pm.split(ex.loss_fn, *ex.args, num_stages=2)
    assert len(staged.stages) == 2
    staged.verify(ex.loss_fn, *ex.args)


def test_split_rejects_unmarked_program_and_non_callable():
    with pytest.raises(pm.errors.MarkerError, match="no start/end markers"):
        pm.split(jnp.sin, jnp.ones(3))
    with pytest.raises(pm.PipemarkError, match="fn must be callable"):
        pm.split(3, jnp.ones(3))
