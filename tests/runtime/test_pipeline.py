"""Tests for pipemark.runtime.pipeline: pipeline_value_and_grad and pipeline_train_step.

The multi-device cases run here, in the test process, on the devices
``tests._devices.devices`` gives (on the CPU: the 8 host devices the root conftest.py
asks JAX for, of which these use up to 4; on one TPU chip: the host CPU's, with the
reference computed there too); each case is its own test and compares with
``jax.jit(jax.value_and_grad(loss_fn))`` of the user's loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pipemark as pm
from pipemark import examples
from pipemark.errors import PipemarkError
from tests._devices import computing_on, devices
from tests._trees import assert_trees_close


def _summed_mlp(rows: int) -> examples.Example:
    ex = examples.mlp(num_layers=2, width=8, batch=rows)

    def loss_fn(params, batch):  # a sum over the batch rather than a mean
        return ex.loss_fn(params, batch) * batch[0].shape[0]

    return examples.Example(loss_fn, ex.params, ex.batch)


_MODELS = {
    "mlp": lambda rows: examples.mlp(num_layers=4, width=8, batch=rows),
    "mlp_boundary": lambda rows: examples.mlp(
        num_layers=4, width=8, batch=rows, markers="boundary"
    ),
    "mlp_auto": lambda rows: examples.mlp(num_layers=4, width=8, batch=rows, markers=None),
    "mlp_sum": _summed_mlp,
    "transformer": lambda rows: examples.transformer(
        num_layers=4, d_model=8, num_heads=2, seq=4, batch=rows
    ),
    "resnet_skip": lambda rows: examples.resnet(num_blocks=4, width=8, batch=rows, skip=2),
    "resnet_bypass": lambda rows: examples.resnet(
        num_blocks=4, width=8, batch=rows, skip=2, route_skips=False
    ),
    # Wide enough for XLA's CPU client to run the stage programs asynchronously (it runs
    # programs estimated under 1000 flops inline, on the dispatching thread): the
    # workers then dispatch ahead of the devices and readers get values still being
    # computed, as on an accelerator.
    "mlp_wide": lambda rows: examples.mlp(num_layers=4, width=48, batch=rows),
    "resnet_skip_wide": lambda rows: examples.resnet(num_blocks=4, width=48, batch=rows, skip=2),
}


@functools.cache
def _example(model: str, rows: int) -> examples.Example:
    """One example per model and batch size, shared by the cases that differ only in
    stages and schedule, so that its reference is computed once (per test worker)."""
    return _MODELS[model](rows)


@functools.cache
def _reference(model: str, rows: int, platform: str):
    """``jax.jit(jax.value_and_grad(loss_fn))`` of the example, computed on ``platform``
    (the pipeline's)."""
    ex = _example(model, rows)
    with computing_on(jax.devices(platform)):
        return jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)


def _case(model, rows, stages, micro, schedule="1f1b", *, num_stages=True, **options):
    """A multi-device case: ``stages`` is the stage count the plan must have; it is
    passed as ``num_stages`` unless ``num_stages=False`` (the markers give it). The
    pipeline gets ``options["devices"]`` devices, by default one a stage."""
    options = dict(num_microbatches=micro, schedule=schedule, **options)
    if num_stages:
        options["num_stages"] = stages
    suffix = f"{schedule}{options.get('devices', '')}"
    return pytest.param(model, rows, options, stages, id=f"{model}-S{stages}-M{micro}-{suffix}")


MULTIDEVICE = [
    *(
        _case(model, rows * micro, stages, micro, schedule)
        for model, rows in (("mlp", 2), ("transformer", 1))
        for stages in (2, 4)
        for micro in (1, 4, 8)
        for schedule in ("gpipe", "1f1b")
    ),
    *(_case("resnet_skip", 8, 4, 4, schedule, num_stages=False) for schedule in ("gpipe", "1f1b")),
    _case("resnet_bypass", 8, 4, 4, num_stages=False),
    _case("mlp_boundary", 4, 4, 2, num_stages=False),
    _case("mlp_auto", 8, 2, 4),
    _case("mlp", 8, 4, 4, "interleaved", num_stages=False, devices=2),
    _case("mlp_sum", 8, 2, 4, num_stages=False, loss_reduction="sum"),
    *(
        case
        for schedule in ("gpipe", "1f1b")
        for case in (
            _case("mlp_wide", 32, 4, 8, schedule, num_stages=False),
            _case("resnet_skip_wide", 16, 4, 4, schedule, num_stages=False),
        )
    ),
]


def test_the_host_platform_has_the_devices_conftest_asks_for():
    assert jax.config.jax_num_cpu_devices == 8
    assert len(jax.devices("cpu")) == 8


def test_without_devices_a_pipeline_takes_the_default_backends_first_ones():
    if len(jax.devices()) < 2:
        pytest.skip(f"the default backend ({jax.default_backend()}) has one device")
    ex = _example("mlp", 4)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=2)
    assert list(pipeline.plan(*ex.args).devices) == jax.devices()[:2]
    _, grads = pipeline(*ex.args)
    assert {d for g in jax.tree_util.tree_leaves(grads) for d in g.devices()} == set(
        jax.devices()[:2]
    )


@pytest.mark.parametrize(("model", "rows", "options", "stages"), MULTIDEVICE)
def test_loss_and_every_gradient_equal_value_and_grad(model, rows, options, stages):
    ex = _example(model, rows)
    used = devices(options.get("devices", stages))
    want = _reference(model, rows, used[0].platform)
    options = dict(options, devices=used)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, **options)
    loss, grads = pipeline(*ex.args)
    assert assert_trees_close((loss, grads), want, rtol=1e-5, atol=1e-6) > 1
    again, _ = pipeline(*ex.args)  # the compiled plan is reused
    np.testing.assert_allclose(again, want[0], rtol=1e-5, atol=1e-6, err_msg="second call")
    plan = pipeline.plan(*ex.args)
    assert plan.num_stages == stages
    assert plan.schedule.name == options["schedule"]
    if options["schedule"] == "interleaved":  # 4 stages on 2 devices, round robin
        assert list(plan.devices) == used * 2
    else:  # stage i on device i, and each gradient stays on its stage's device
        assert list(plan.devices) == used
        grad_devices = {d for g in jax.tree_util.tree_leaves(grads) for d in g.devices()}
        assert grad_devices == set(used)
    if model.startswith("resnet"):
        # resnet(skip=2): block i reads block i - 2, so stage 2 reads 0 and 3 reads 1,
        # whether the skips are routed through the stages between or bypass them.
        assert [list(p) for p in plan.schedule.predecessors] == [[], [0], [0, 1], [1, 2]]


@pytest.mark.parametrize(
    ("optimizer", "options", "stages"),
    [
        pytest.param("sgd", dict(num_stages=2, num_microbatches=4), 2, id="sgd-S2-M4-1f1b"),
        pytest.param("adam", dict(num_microbatches=4, schedule="gpipe"), 4, id="adam-S4-M4-gpipe"),
    ],
)
def test_pipelined_training_step_equals_the_step(optimizer, options, stages):
    ex = examples.mlp(num_layers=4, width=8, batch=8)
    step, init_state = examples.train_step(ex.loss_fn, optimizer=optimizer)
    state = init_state(ex.params)
    used = devices(stages)
    pipelined = pm.pipeline_train_step(step, devices=used, **options)
    got = pipelined(ex.params, state, ex.batch)
    with computing_on(used):
        want = jax.jit(step)(ex.params, state, ex.batch)
    # new params, new optimizer state and loss, all to float32 tolerance
    assert assert_trees_close(got, want, rtol=1e-5, atol=1e-6) > 3
    plan = pipelined.plan(ex.params, state, ex.batch)
    assert plan.num_stages == stages
    assert plan.schedule.name == options.get("schedule", "1f1b")


# ----------------------------------------------------------- one device


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
        ex.loss_fn,
        num_stages=2,
        num_microbatches=2,
        schedule="interleaved",
        devices=devices(1),
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
        (
            dict(num_microbatches=2, devices=devices(1)),
            r"2 stages but only 1 device.*xla_force_host_platform",
        ),
        (dict(num_stages=3, num_microbatches=1), r"num_stages=3, but the program marks only 2"),
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
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=1, devices=devices(1))(*ex.args)


def _stopped_loss(params, batch):
    """Two layers, and a term whose parameter is under ``stop_gradient``: its gradient
    is a constant zero, which no stage computes."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"])
    pm.mark_pipeline_boundary()
    return jnp.mean((h @ params["w2"] - y) ** 2) + lax.stop_gradient(params["offset"])


def test_a_pipeline_away_from_the_default_device_keeps_everything_on_its_devices():
    # The host CPU's last two devices: not JAX's default device, and on an accelerator
    # machine not even its platform. Every result, the constant gradient included, and
    # a training step's update are on the pipeline's devices, committed there.
    used = [d for d in jax.devices("cpu") if d != jax.devices()[0]][-2:]
    params = {"w1": jnp.eye(3) * 0.5, "w2": jnp.ones((3, 2)), "offset": jnp.float32(1.0)}
    batch = (jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.ones((4, 2)))
    pipe = pm.pipeline_value_and_grad(_stopped_loss, num_microbatches=2, devices=used)
    got = pipe(params, batch)
    assert "const" in {ref.kind for ref in pipe.plan(params, batch).staged.outputs}
    for leaf in jax.tree_util.tree_leaves(got):
        assert leaf.committed and leaf.devices() <= set(used), leaf.devices()
    with computing_on(used):
        want = jax.jit(jax.value_and_grad(_stopped_loss))(params, batch)
    assert assert_trees_close(got, want) == 4

    def step(params, batch):
        loss, grads = jax.value_and_grad(_stopped_loss)(params, batch)
        grads = pm.mark_gradient(grads)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    stepped = pm.pipeline_train_step(step, num_microbatches=2, devices=used)(params, batch)
    for leaf in jax.tree_util.tree_leaves(stepped):  # each updated where its stage runs
        assert leaf.committed and leaf.devices() <= set(used), leaf.devices()


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
        ex.loss_fn, num_microbatches=2, devices=devices(1), schedule=schedule
    )
    loss, grads = pipe(*ex.args)
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert pipe.plan(*ex.args).schedule.num_devices == 1
    assert np.allclose(loss, want_loss, rtol=1e-6)
    assert all(
        np.allclose(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
    )


@pytest.mark.parametrize("model", ["mlp_wide", "resnet_skip_wide"])
def test_one_f_one_b_with_a_forward_more_in_flight_equals_value_and_grad(model):
    # The latency-hiding 1F1B (one more forward in flight before each stage's first
    # backward) on 4 devices: same results as jax.value_and_grad, on a chain and on a
    # stage graph with skips (the schedule gets the pipeline's graph).
    rows = 32 if model == "mlp_wide" else 16
    ex = _example(model, rows)
    used = devices(4)
    want = _reference(model, rows, used[0].platform)
    graph = (
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4, devices=used)
        .plan(*ex.args)
        .schedule
    )
    schedule = pm.runtime.one_f_one_b_schedule(
        4, 4, stage_graph=dict(enumerate(graph.predecessors)), extra_in_flight=1
    )
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_microbatches=4, schedule=schedule, devices=used
    )
    assert assert_trees_close(pipe(*ex.args), want, rtol=1e-5, atol=1e-6) > 1
    first_backward = [
        next(i for i, a in enumerate(order) if a.kind != "forward")
        for order in pipe.plan(*ex.args).schedule.device_orders()
    ]
    assert first_backward[0] == 4  # stage 0: depth 3, one more


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

    with pytest.raises(pm.errors.MarkerError, match="no grad marker"):
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

    step, init_state = examples.train_step(ex.loss_fn, optimizer="sgd")

    def separate_data(params, state, x, y):  # the batch as two arguments
        return step(params, state, (x, y))

    with pytest.raises(PipemarkError, match=r"argument 2 has the batch's leading size 4.*\(x, y\)"):
        pm.pipeline_train_step(separate_data, num_stages=1, num_microbatches=2)(
            ex.params, init_state(ex.params), *ex.batch
        )


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
        step, num_stages=2, num_microbatches=2, schedule="interleaved", devices=devices(1)
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

    pipe = pm.pipeline_value_and_grad(loss_fn, num_microbatches=1, devices=devices(1))
    with pytest.raises(pm.errors.StageGraphError, match="'_backward' or '_weight' suffix"):
        pipe(jnp.eye(2), jnp.ones((2, 2)))


# ------------------------------------------------- one staging entry, one trace


def _counted_loss(calls: list):
    def loss_fn(params, batch):
        calls.append(1)
        x = batch
        for i, w in enumerate(params):
            if i:
                pm.mark_pipeline_boundary()
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    return loss_fn


def test_the_loss_is_traced_once_per_input_shape():
    params = [jnp.eye(3) * 0.5, jnp.eye(3) * 0.7]
    for reduction in ("mean", "sum"):
        calls: list = []
        pipe = pm.pipeline_value_and_grad(
            _counted_loss(calls),
            num_microbatches=2,
            loss_reduction=reduction,
            schedule="interleaved",
            devices=devices(1),
        )
        pipe(params, jnp.ones((4, 3)))
        pipe(params, jnp.ones((4, 3)) * 2.0)
        assert len(calls) == 1
        pipe(params, jnp.ones((8, 3)))  # another shape: one more trace
        assert len(calls) == 2


def test_a_marked_program_and_num_stages_give_one_answer(capsys):
    from pipemark.cli import main
    from tests._cli_targets import four_layers

    x, w = jnp.ones((4, 8)) * 0.1, jnp.eye(8) * 0.9
    split = pm.split(jax.value_and_grad(four_layers), x, w, num_stages=2)
    names = [s.name for s in split.stages]
    assert names == ["stage0", "stage1", "stage1_backward", "stage0_backward"]
    pipe = pm.pipeline_value_and_grad(
        four_layers,
        num_stages=2,
        num_microbatches=1,
        schedule="interleaved",
        devices=devices(1),
    )
    runtime = pipe.plan(x, w).staged
    assert [s.name for s in runtime.stages] == names
    # The runtime's backward stages recompute cheap residuals (the default).
    lean = pm.passes.recompute_residuals(split)
    assert [s.num_eqns for s in runtime.stages] == [s.num_eqns for s in lean.stages]
    argv = ["inspect", "tests._cli_targets:four_layers", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    assert main([*argv, "--grad", "--num-stages", "2"]) == 0
    out = capsys.readouterr().out
    for stage in split.stages:
        # The summary's line for each stage: its name and its equation count.
        assert any(
            stage.name in line.split() and str(stage.num_eqns) in line.split()
            for line in out.splitlines()
        )


def test_a_jitted_training_step_runs_as_a_pipeline():
    ex = examples.mlp(num_layers=2, width=4, batch=4)
    step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    jitted = jax.jit(step)
    state = init_state(ex.params)
    pipelined = pm.pipeline_train_step(
        jitted, num_microbatches=2, schedule="interleaved", devices=devices(1)
    )
    got = pipelined(ex.params, state, ex.batch)
    want = jitted(ex.params, state, ex.batch)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------- sums: a batch-free term once


def _decayed_sum_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"])
    pm.mark_pipeline_boundary()
    data = jnp.sum((h @ params["w2"] - y) ** 2)
    decay = 0.05 * (jnp.sum(params["w1"] ** 2) + jnp.sum(params["w2"] ** 2))
    return data + decay - 0.25


def _decay_example():
    key1, key2, key3 = jax.random.split(jax.random.PRNGKey(3), 3)
    params = {"w1": jax.random.normal(key1, (3, 4)), "w2": jax.random.normal(key2, (4, 2))}
    x = jax.random.normal(key3, (8, 3))
    return params, (x, jnp.cos(x[:, :2]))


@pytest.mark.parametrize("reduction", ["sum", "sum_over_count"])
def test_a_sum_counts_a_term_without_the_batch_once(reduction):
    params, batch = _decay_example()
    if reduction == "sum":
        loss_fn = _decayed_sum_loss
    else:

        def loss_fn(params, batch):
            return _decayed_sum_loss(params, batch), jnp.float32(batch[0].shape[0])

    pipe = pm.pipeline_value_and_grad(
        loss_fn,
        num_microbatches=4,
        loss_reduction=reduction,
        schedule="interleaved",
        devices=devices(1),
    )
    loss, grads = pipe(params, batch)
    want_loss, want_grads = jax.value_and_grad(_decayed_sum_loss)(params, batch)
    count = 1.0 if reduction == "sum" else 8.0
    np.testing.assert_allclose(loss, want_loss / count, rtol=1e-5)
    for key in params:
        np.testing.assert_allclose(grads[key], want_grads[key] / count, rtol=1e-5, atol=1e-6)


def test_a_summed_training_step_counts_weight_decay_once():
    params, batch = _decay_example()

    def step(params, batch):
        loss, grads = jax.value_and_grad(_decayed_sum_loss)(params, batch)
        grads = pm.mark_gradient(grads)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss

    pipelined = pm.pipeline_train_step(
        step,
        num_microbatches=4,
        loss_reduction="sum",
        schedule="interleaved",
        devices=devices(1),
    )
    got = pipelined(params, batch)
    want = jax.jit(step)(params, batch)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- state JAX cannot see (flax nnx)


def test_an_nnx_jit_step_that_updates_in_place_is_refused():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.l2 = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            h = jnp.tanh(self.l1(x))
            pm.mark_pipeline_boundary()
            return self.l2(h)

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = jnp.linspace(-1, 1, 24).reshape(8, 3), jnp.ones((8, 1))

    def loss(m, batch):
        return jnp.mean((m(batch[0]) - batch[1]) ** 2)

    @nnx.jit
    def step(model, optimizer, batch):
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value

    with pytest.raises(
        pm.errors.StateMutationError,
        match=r"step changed its arguments in place: args\[0\]\.l1.*nnx\.split",
    ):
        pm.split(step, model, optimizer, (x, y))
    with pytest.raises(pm.errors.StateMutationError, match=r"nnx\.merge"):
        pm.pipeline_train_step(step, num_microbatches=2)(model, optimizer, (x, y))

    # The way the error says: a function of the state that returns the new state.
    graphdef, state = nnx.split((model, optimizer))

    def functional(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value, nnx.state((model, optimizer))

    staged = pm.split(functional, state, (x, y))
    want = jax.tree_util.tree_leaves(jax.jit(functional)(state, (x, y)))
    got = staged(state, (x, y))
    assert len(got) == len(want) > 1
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_gradients_of_one_device_feed_a_jitted_update_as_jaxs_do():
    # Two stages interleaved on one device, one microbatch: on JAX 0.10 the program that
    # made its accumulators itself handed back gradients in layouts XLA chose, and a
    # jitted program mixing them with the parameters (an optimizer update) read them
    # wrong (relative error 1.4 in every matrix of the last stage), though np.asarray
    # read them right.
    sizes = dict(seq=128, batch=4, vocab=64, d_ff=128)
    ex = examples.gpt(2, 32, 2, **sizes)
    unmarked = examples.gpt(2, 32, 2, **sizes, markers=None)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=1, schedule="interleaved",
        devices=devices(1),
    )  # fmt: skip
    mixed = jax.jit(lambda p, g: jax.tree.map(lambda w, d: d + 0 * w, p, g))
    (_, grads), (_, want) = pipe(*ex.args), jax.value_and_grad(unmarked.loss_fn)(*unmarked.args)
    got, want = mixed(ex.params, grads), mixed(ex.params, want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # bfloat16 matmuls: the two programs part by about 1 % of a gradient's norm.
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 0.05 * np.linalg.norm(b)
