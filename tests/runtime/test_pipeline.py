"""Tests for pipemark.runtime.pipeline: pipeline_value_and_grad and pipeline_train_step.

The multi-device cases run in one subprocess (``_multidevice.py``) with 4 host CPU
devices, because XLA reads ``--xla_force_host_platform_device_count`` only when JAX
starts; this process has already started JAX with one device. The subprocess runs once
per test session, shared by pytest-xdist workers through a file lock, and prints one JSON
line per case; each case is then its own test here.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from tests._once import run_script_once
from tests.runtime._multidevice import cases, train_cases

_SCRIPT = Path(__file__).with_name("_multidevice.py")
_CASE_NAMES = [name for name, _, _ in cases()]


@pytest.fixture(scope="session")
def multidevice(tmp_path_factory) -> dict[str, dict]:
    out = run_script_once(
        tmp_path_factory,
        _SCRIPT,
        "pipemark-runtime-multidevice",
        xla_flags="--xla_force_host_platform_device_count=4",
    )
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {line["case"]: line for line in lines}


def test_subprocess_has_four_devices_and_import_skips_matplotlib(multidevice):
    assert multidevice["devices"]["count"] == 4
    # `import pipemark` must not import matplotlib (plotting loads it lazily).
    assert multidevice["import"]["matplotlib"] is False


@pytest.mark.parametrize("name", _CASE_NAMES)
def test_loss_and_every_gradient_equal_value_and_grad(multidevice, name):
    result = multidevice.get(name)
    assert result is not None, f"case {name} did not run"
    assert result["same_structure"]
    # worst = max |got - want| / (1e-6 + 1e-5 |want|) per leaf: float32 tolerance.
    assert len(result["worst"]) > 1
    assert max(result["worst"]) < 1.0, result["worst"]
    assert result["repeat_worst"] < 1.0
    stages = result["num_stages"]
    if name.endswith("interleaved2"):
        assert result["stage_devices"] == [0, 1, 0, 1]
    else:
        # stage i on device i, and each gradient stays on its stage's device
        assert result["stage_devices"] == list(range(stages))
        assert result["grad_devices"] == list(range(stages))
    expected_stages = int(name.split("-S")[1].split("-")[0])
    assert stages == expected_stages
    assert result["schedule"] == name.rsplit("-", 1)[1].rstrip("2")


@pytest.mark.parametrize("name", [name for name, _, _ in train_cases()])
def test_pipelined_training_step_equals_the_step(multidevice, name):
    result = multidevice.get(name)
    assert result is not None, f"case {name} did not run"
    assert result["same_structure"]
    # new params, new optimizer state and loss, all to float32 tolerance
    assert len(result["worst"]) > 3
    assert max(result["worst"]) < 1.0, result["worst"]
    assert result["num_stages"] == int(name.split("-S")[1].split("-")[0])
    assert result["schedule"] == name.rsplit("-", 1)[1]


def test_skip_connections_enter_the_stage_graph(multidevice):
    # resnet(skip=2): block i reads block i - 2, so stage 2 reads 0 and 3 reads 1.
    for name in ("resnet_skip-S4-M4-1f1b", "resnet_bypass-S4-M4-1f1b"):
        assert multidevice[name]["predecessors"] == [[], [0], [0, 1], [1, 2]]


# ----------------------------------------------------------- single device, in process


def test_one_stage_pipeline_equals_value_and_grad():
    ex = examples.mlp(num_layers=2, width=4, batch=6)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=3)
    loss, grads = pipeline(*ex.args)
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plan = pipeline.plan(*ex.args)
    assert plan.num_stages == 1
    assert plan.microbatch_size == 2
    assert [s.name for s in plan.staged.stages] == ["stage0", "stage0_backward"]
    assert plan.schedule.num_ticks == 6


def test_num_stages_merges_consecutive_marked_stages():
    # An interleaved schedule over one device runs every stage there, so this needs no
    # extra devices.
    ex = examples.mlp(num_layers=4, width=4, batch=4)
    pipeline = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, schedule="interleaved"
    )
    plan = pipeline.plan(*ex.args)
    assert plan.num_stages == 2
    assert plan.schedule.stage_devices == (0, 0)

    def layers(index):
        stage = plan.staged.stages[index]
        return sorted({e.params["name"] for e in stage.jaxpr.eqns if e.primitive is pm.pipeline_p})

    forward = [layers(k) for k in plan.forward_stages]
    backward = [layers(k) for k in plan.backward_stages]
    # consecutive layers, each in exactly one stage, mirrored by the backward stages
    assert [name for group in forward for name in group] == [f"layer{i}" for i in range(4)]
    assert all(forward) and len(forward) == 2
    assert backward == [[f"{name}_backward" for name in group] for group in forward]
    loss, grads = pipeline(*ex.args)
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _mlp():
    return examples.mlp(num_layers=2, width=4, batch=6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(num_microbatches=4), r"batch of 6 does not split into 4 .* \[1, 2, 3, 6\]"),
        (dict(num_microbatches=2), r"2 stages but only 1 device.*xla_force_host_platform"),
        (dict(num_stages=3, num_microbatches=1), r"num_stages=3, but loss_fn marks only 2"),
        (dict(num_microbatches=0), r"num_microbatches must be a positive int"),
        (dict(num_microbatches=1, loss_reduction="max"), r"Unknown loss_reduction 'max'"),
        (dict(num_microbatches=1, schedule="zigzag"), r"Unknown schedule 'zigzag'"),
    ],
)
def test_errors_with_advice(options, message):
    ex = _mlp()
    with pytest.raises(PipemarkError, match=message):
        pm.pipeline_value_and_grad(ex.loss_fn, **options)(*ex.args)


def test_non_scalar_loss_is_refused():
    ex = _mlp()

    def per_row(params, batch):
        return jnp.sum(batch[0] @ params[0][0], axis=1)

    with pytest.raises(PipemarkError, match=r"float32\[6\].*scalar floating-point loss"):
        pm.pipeline_value_and_grad(per_row, num_stages=1, num_microbatches=1)(*ex.args)

    def with_aux(params, batch):
        return ex.loss_fn(params, batch), 0.0

    with pytest.raises(PipemarkError, match="not one array"):
        pm.pipeline_value_and_grad(with_aux, num_stages=1, num_microbatches=1)(*ex.args)


def test_unmarked_loss_needs_num_stages():
    ex = examples.mlp(num_layers=2, width=4, batch=2, markers=None)
    with pytest.raises(PipemarkError, match="Pass num_stages="):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=1)(*ex.args)


def test_batch_leaves_must_share_a_batch_axis():
    ex = _mlp()
    x, y = ex.batch
    with pytest.raises(PipemarkError, match=r"different leading sizes \[3, 6\]"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=1)(
            ex.params, (x, y[:3])
        )
    with pytest.raises(PipemarkError, match="is a scalar"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=1)(
            ex.params, (x, jnp.float32(1.0))
        )


def test_more_stages_than_devices_with_explicit_devices():
    ex = _mlp()
    with pytest.raises(PipemarkError, match="schedule='interleaved'"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=1, devices=jax.devices()[:1])(
            *ex.args
        )


def test_a_schedule_object_places_its_stages_itself():
    # A Schedule that puts every stage on one device runs on one device: the stage
    # count needs no more devices than the schedule's own placement.
    ex = _mlp()
    stages = 2  # the MLP's two marked layers
    schedule = pm.runtime.schedule_from_orders(
        [[a for _, _, a in pm.make_schedule("1f1b", stages, 2).actions()]],
        stage_devices=(0,) * stages,
        num_microbatches=2,
    )
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_microbatches=2, devices=jax.devices()[:1], schedule=schedule
    )
    loss, grads = pipe(*ex.args)
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert pipe.plan(*ex.args).schedule.num_devices == 1
    assert np.allclose(loss, want_loss, rtol=1e-6)
    assert all(
        np.allclose(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
    )


def test_training_step_on_one_device_and_its_errors():
    ex = examples.mlp(num_layers=2, width=4, batch=4)
    step, _ = examples.train_step(ex.loss_fn, optimizer="sgd")
    pipelined = pm.pipeline_train_step(step, num_stages=1, num_microbatches=2)
    new_params, _, loss = pipelined(ex.params, (), ex.batch)
    want_params, _, want_loss = step(ex.params, (), ex.batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(
        jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(want_params)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    costs = pipelined.action_costs(ex.params, (), ex.batch, repeat=1)
    assert len(costs["forward"]) == 1 and costs["forward"][0] > 0 == costs["weight"][0]

    def unmarked(params, batch):
        return jax.grad(ex.loss_fn)(params, batch)

    with pytest.raises(pm.MarkerError, match="no grad marker"):
        pm.pipeline_train_step(unmarked, num_stages=1, num_microbatches=2)(ex.params, ex.batch)

    def per_row_residual(params, batch):
        doubled = batch[0] * 2.0  # computed before the grad marker, read after it
        grads = pm.mark_gradient(jax.grad(ex.loss_fn)(params, batch))
        return grads, doubled + 1.0

    with pytest.raises(PipemarkError, match=r"shape \(2, 4\) for one microbatch but \(4, 4\)"):
        pm.pipeline_train_step(per_row_residual, num_stages=1, num_microbatches=2)(
            ex.params, ex.batch
        )
    with pytest.raises(PipemarkError, match="step_fn must be callable"):
        pm.pipeline_train_step(3, num_microbatches=2)


def _scaled_callback_loss(factor: float):
    """A marked one-stage loss whose only difference from another factor's is the
    callback it calls: every such callback is named ``scale`` and prints alike."""

    def scale(x):
        return np.asarray(x) * np.float32(factor)

    def loss_fn(params, batch):
        x, w = pm.mark((batch, params), name="stage0", mark_type="start")
        h = x @ w
        # pure_callback has no derivative: call it on a value without one.
        y = jax.pure_callback(scale, jax.ShapeDtypeStruct(h.shape, h.dtype), lax.stop_gradient(h))
        return pm.mark(jnp.mean(y + h), name="stage0", mark_type="end")

    return loss_fn


def test_stage_programs_calling_different_callbacks_are_not_shared():
    # The compiled-stage cache is keyed by program text; a callback prints as
    # <function scale at 0xXXXX>, so two programs calling different functions of one name
    # would share the first one's compiled code.
    params, batch = jnp.eye(3), jnp.ones((4, 3))
    for factor in (1.0, 3.0):
        loss_fn = _scaled_callback_loss(factor)
        loss, _ = pm.pipeline_value_and_grad(loss_fn, num_microbatches=2)(params, batch)
        np.testing.assert_allclose(loss, loss_fn(params, batch), rtol=1e-6)


def test_flax_optax_train_step_runs_as_a_pipeline():
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.tanh(nn.Dense(16)(x))
            return nn.Dense(2)(x)

    model, opt = Model(), optax.adamw(1e-2)
    x, y = jnp.ones((8, 8)), jnp.zeros((8, 2))
    params = model.init(jax.random.PRNGKey(0), x)
    state = opt.init(params)

    def loss(params, batch):
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = opt.update(pm.mark_gradient(grads), state, params)
        return optax.apply_updates(params, updates), state, value

    pipelined = pm.pipeline_train_step(
        step, num_stages=2, num_microbatches=2, schedule="interleaved"
    )
    names = [s.name for s in pipelined.plan(params, state, (x, y)).staged.stages]
    assert names == ["layer0", "layer1", "layer1_backward", "layer0_backward"]
    got = pipelined(params, state, (x, y))
    want = jax.jit(step)(params, state, (x, y))
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got[:2]), jax.tree_util.tree_leaves(want[:2])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("suffix", ["_backward", "_weight"])
def test_a_forward_stage_named_like_a_backward_half_is_refused(suffix):
    def loss_fn(w, x):
        x, w = pm.mark((x, w), name="layer" + suffix, mark_type="start")
        return jnp.mean(pm.mark(jnp.tanh(x @ w), name="layer" + suffix, mark_type="end"))

    pipe = pm.pipeline_value_and_grad(loss_fn, num_microbatches=1, devices=jax.devices()[:1])
    with pytest.raises(pm.StageGraphError, match="'_backward' or '_weight' suffix"):
        pipe(jnp.eye(2), jnp.ones((2, 2)))
