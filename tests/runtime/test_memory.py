"""Tests of pipemark.runtime.memory (Pipeline.memory): the bytes each slot holds,
counted from the user's arrays and from the schedule's order, not from the estimate's
own walk."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pipemark as pm
from pipemark import examples
from pipemark.cost import nbytes
from pipemark.runtime import BACKWARD, FORWARD, Action, train_step
from pipemark.runtime.devices.steps import STAGE, program_name
from pipemark.runtime.execution import run as execution
from pipemark.runtime.memory import estimate as memory
from pipemark.runtime.memory.estimate import (
    device_padding,
    estimate_memory,
    held_in_flight,
    held_while_running,
)
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests.runtime._fusion import mlp_pipeline
from tests.runtime._steps import mlp_train_step


def _mlp_pipeline(schedule, num_stages, num_microbatches, width=32):
    # A layer per stage, microbatches of 4 rows however many there are.
    return mlp_pipeline(
        num_stages,
        num_microbatches,
        schedule,
        batch=4 * num_microbatches,
        num_layers=num_stages,
        width=width,
    )


def _tree_bytes(tree):
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(tree))


def test_parameters_batch_and_accumulators_add_up_to_the_users_arrays():
    pipe, ex = _mlp_pipeline("1f1b", 4, 4)
    params, batch = ex.args
    slots = pipe.memory(params, batch).slots
    assert len(slots) == 4
    # Each layer's parameters on its own stage's slot; the inputs and the targets on
    # the first and the last; the loss and every gradient accumulated once.
    assert [s.parameters for s in slots] == [_tree_bytes(layer) for layer in params]
    assert sum(s.batch for s in slots) == _tree_bytes(batch)
    assert slots[1].batch == slots[2].batch == 0
    # + the loss, and each slot's microbatch scale (a float32 the plan keeps there)
    assert sum(s.accumulators for s in slots) == _tree_bytes(params) + 4 + 4 * len(slots)
    for s in slots:
        assert s.temporaries is not None and s.temporaries >= 0
        assert s.predicted_peak == (
            s.parameters + s.batch + s.accumulators + s.arguments + s.in_flight + s.temporaries
        )


def _value_bytes(plan, key):
    """The logical bytes of the value handed between actions that ``key`` names."""
    _, stage, output = key
    return nbytes(plan.staged.stages[stage].out_avals[output])


def _read_bytes(plan, producer, reader):
    """Bytes of stage ``producer``'s outputs that stage ``reader`` reads, per
    microbatch."""
    staged = plan.staged
    read = {
        ref.index
        for ref in staged.stages[reader].inputs
        if ref.kind == "stage" and ref.stage == producer
    }
    return sum(nbytes(staged.stages[producer].out_avals[o]) for o in read)


def test_the_schedule_sets_how_many_microbatches_are_in_flight():
    # GPipe runs every forward before any backward: the first stage holds the residuals
    # of all M microbatches (what its forward leaves for its own backward), and, its
    # threads dispatching as soon as their inputs are dispatched, the second stage may
    # have sent back every microbatch's cotangents before the first stage's last forward
    # runs. 1F1B starts backwards after S forwards: what it holds does not grow with M.
    held = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            pipe, ex = _mlp_pipeline(schedule, 2, m)
            plan = pipe.plan(*ex.args)
            held[schedule, m] = estimate_memory(plan).slots[0].in_flight
            residual = _read_bytes(plan, plan.forward_stages[0], plan.backward_stages[0])
            cotangent = _read_bytes(plan, plan.backward_stages[1], plan.backward_stages[0])
    assert residual > 0 and cotangent > 0
    assert held["gpipe", 8] - held["gpipe", 4] == 4 * (residual + cotangent)
    assert held["1f1b", 8] == held["1f1b", 4] < held["gpipe", 4]


def test_a_programs_temporaries_meet_what_is_held_while_it_runs():
    # GPipe, 2 stages, dispatch_ahead=1: slot 0 runs F0..F3 then B0..B3. While B_k runs,
    # B_(k-1) has run and its inputs are freed: B_k and the backwards after it hold the
    # residuals and cotangents of microbatches k..3; B_(k+1), perhaps dispatched, adds
    # nothing (a first stage's backward hands nothing on; its gradients accumulate).
    # While the host dispatches B_k, B_(k-1) may not have run: one microbatch more.
    pipe, ex = _mlp_pipeline("gpipe", 2, 4)
    plan = dataclasses.replace(pipe.plan(*ex.args), dispatch_ahead=1)
    residual = _read_bytes(plan, plan.forward_stages[0], plan.backward_stages[0])
    cotangent = _read_bytes(plan, plan.backward_stages[1], plan.backward_stages[0])
    running, dispatching = held_while_running(plan, 0), held_in_flight(plan, 0)
    for k in (1, 2, 3):
        assert running[4 + k] == (4 - k) * (residual + cotangent)
        assert dispatching[4 + k] == running[4 + k] + residual + cotangent
    # Temporaries (as compiled programs report them) go with the bytes held while
    # their program runs; the buffers alone with the most held while dispatching.
    names = [stage.name for stage in plan.staged.stages]
    column = plan.steps.columns[0]
    backward = program_name(column[5], names)
    temporaries = {backward: 10**6}
    slot = estimate_memory(plan, temporaries).slots[0]
    worst = max(h for h, step in zip(running, column) if program_name(step, names) == backward)
    assert (slot.in_flight, slot.temporaries) == (worst, 10**6)
    base = slot.parameters + slot.batch + slot.accumulators
    assert slot.predicted_peak == base + worst + 10**6
    assert slot.buffers == base + max(dispatching) <= slot.predicted_peak


def test_the_more_the_host_may_dispatch_ahead_the_more_is_held_while_an_action_runs():
    # Interleaved on one device: values are read by several of the slot's actions, and
    # an action's inputs are freed only after their last reader has run.
    pipe, ex = mlp_pipeline(4, 4, "interleaved", devices=1, batch=16)
    plan = pipe.plan(*ex.args)
    before = None
    for ahead in (1, 2, 4, None):
        window = dataclasses.replace(plan, dispatch_ahead=ahead)
        running, dispatching = held_while_running(window, 0), held_in_flight(window, 0)
        assert before is None or all(r >= b for r, b in zip(running, before)), ahead
        before = running
    # Unbounded, the host may dispatch the whole column before the device has run its
    # first action, which then meets the most the slot ever holds.
    assert running[0] == max(dispatching)


def test_one_stage_holds_nothing_in_flight_and_its_program_temporaries():
    pipe, ex = _mlp_pipeline("1f1b", 1, 1, width=64)
    (slot,) = pipe.memory(*ex.args).slots
    assert slot.in_flight == 0
    (program,) = pipe.compiled_programs(*ex.args).values()
    assert slot.temporaries == program.memory_analysis().temp_size_in_bytes
    assert "predicted_peak" in str(pipe.memory(*ex.args)) and "KiB" in str(pipe.memory(*ex.args))


def test_a_training_step_counts_each_slots_part_of_its_update():
    used, ex, step, state = mlp_train_step("adam", num_layers=2, width=16, batch=8)
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
    estimate = pipelined.memory(ex.params, state, ex.batch)
    first, last = estimate.slots
    params = _tree_bytes(ex.params)
    assert first.parameters + last.parameters == params
    # The update, each slot its own stage's part (pipemark.runtime.training.update): parameters,
    # Adam's two moments and the gradients in, new parameters and moments out (no
    # donation), whatever its temporaries.
    assert _tree_bytes(state) >= 2 * params
    assert first.update >= 4 * first.parameters and last.update >= 4 * last.parameters
    assert first.update + last.update >= 4 * params + _tree_bytes(state)
    assert first.predicted_peak >= first.update
    assert "update" in str(estimate)
    assert all(s.measured_peak is None or s.measured_peak > 0 for s in estimate.slots)


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
def test_every_schedule_has_an_estimate_per_slot(schedule):
    pipe, ex = _mlp_pipeline(schedule, 4 if schedule == "interleaved" else 2, 4)
    plan = pipe.plan(*ex.args)
    estimate = pipe.memory(*ex.args)
    assert len(estimate.slots) == len(plan.placement.slots)
    assert all(s.in_flight > 0 for s in estimate.slots)


def test_stages_on_sub_meshes_are_estimated_without_their_temporaries():
    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs 8 host CPU devices")
    mesh = Mesh(np.array(cpus[:8]).reshape(4, 2), ("stage", "data"))
    ex = examples.mlp(num_layers=4, width=16, batch=16)
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4, mesh=mesh)
    slots = pipe.memory(*ex.args).slots
    # A slot's values whole (each device of its data axis holds the parameters);
    # its programs are not lowered here, so no temporaries.
    assert [s.devices.count("cpu") for s in slots] == [2] * 4
    assert sum(s.parameters for s in slots) == _tree_bytes(ex.params)
    assert all(s.temporaries is None and s.in_flight > 0 for s in slots)


def test_each_action_dispatched_ahead_holds_its_results_too():
    # One slot, interleaved: the results of the next `dispatch_ahead` actions are
    # allocated when they are dispatched, before the device runs them.
    with computing_on(pick_devices(1)):
        ex = examples.mlp(num_layers=4, width=32, batch=16)
    in_flight = {}
    for ahead in (1, 3):
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn,
            num_stages=4,
            num_microbatches=4,
            schedule="interleaved",
            devices=pick_devices(1),
            dispatch_ahead=ahead,
        )
        plan = pipe.plan(*ex.args)
        (slot,) = estimate_memory(plan).slots
        in_flight[ahead] = slot.in_flight
        # Whatever the bound, the same results (donated accumulators included).
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
        got = pipe(*ex.args)
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    largest = max(sum(nbytes(v.aval) for v in s.jaxpr.outvars) for s in plan.staged.stages)
    assert in_flight[1] < in_flight[3] <= in_flight[1] + 2 * largest


@pytest.mark.parametrize(
    ("schedule", "num_devices"), [("gpipe", 2), ("1f1b", 4), ("interleaved", 2)]
)
def test_no_dispatch_bound_holds_at_least_what_any_bound_does(schedule, num_devices):
    # dispatch_ahead=None: the host may dispatch a slot's whole column before the
    # device runs any of it. Every bound holds no more, the one that covers the whole
    # column as much. (The calls' own arrays against it: the live-array tests below.)
    pipe, ex = _mlp_pipeline(schedule, 4, 8)
    unbounded = dataclasses.replace(pipe.plan(*ex.args), dispatch_ahead=None)
    for worker, column in enumerate(unbounded.steps.columns):
        most = held_in_flight(unbounded, worker)
        for ahead in (1, 2, 4, len(column) - 1):
            held = held_in_flight(dataclasses.replace(unbounded, dispatch_ahead=ahead), worker)
            assert all(h <= m for h, m in zip(held, most)), (ahead, held, most)
        assert held == most
        # The first action's results and inputs stay counted to the column's end.
        first = column[0]
        keys = {key for _, key, _ in first.sends} | {
            key for source, key in first.inputs if source == STAGE
        }
        assert most[-1] >= sum(_value_bytes(unbounded, key) for key in keys) > 0
    slots = estimate_memory(unbounded).slots
    for ahead in (1, 2, 4):
        bounded = estimate_memory(dataclasses.replace(unbounded, dispatch_ahead=ahead)).slots
        assert all(b.buffers <= s.buffers for b, s in zip(bounded, slots))
    assert any(b.buffers < s.buffers for b, s in zip(bounded, slots))


def _analysis(output, alias=0, temp=0):
    return SimpleNamespace(
        output_size_in_bytes=output, alias_size_in_bytes=alias, temp_size_in_bytes=temp
    )


def test_padding_is_what_the_passed_outputs_take_beyond_their_bytes():
    # Three outputs: 24 bytes of output table, an accumulator of 1000 bytes.
    table = 8 * 3
    doubled = _analysis(table + 1000 + 2 * 4096, alias=1000)
    assert device_padding(doubled, [1000], [1024, 3072]) == 2
    # Not donated: the accumulator still counted at its own bytes.
    assert device_padding(_analysis(table + 1000 + 6144), [1000], [1024, 3072]) == 1.5
    # A donated accumulator laid out larger (what it aliases) is not the passed ones'.
    assert device_padding(_analysis(table + 2000 + 4096, alias=2000), [1000], [4096, 0]) == 1
    # Never below the logical bytes; nothing passed, nothing to scale.
    assert device_padding(_analysis(100), [1000], [4096]) == 1
    assert device_padding(_analysis(table + 5000), [1000, 1000, 1000], []) == 1


class _Padded:
    """A compiled program whose memory analysis reports its passed outputs at ``factor``
    times their bytes, as a TPU's tiles can."""

    def __init__(self, program, factor):
        self.program, self.out_info, self.factor = program, program.out_info, factor

    def memory_analysis(self):
        real = self.program.memory_analysis()
        passed = sum(nbytes(x) for x in jax.tree_util.tree_leaves(self.out_info[1]))
        extra = (self.factor - 1) * passed
        return _analysis(
            real.output_size_in_bytes + extra, real.alias_size_in_bytes, real.temp_size_in_bytes
        )


def test_values_in_flight_count_as_the_compiled_programs_lay_them_out(monkeypatch):
    pipe, ex = _mlp_pipeline("interleaved", 4, 4)
    plan = pipe.plan(*ex.args)
    logical = memory.plan_memory(plan).slots
    compiled = memory.compiled_programs
    monkeypatch.setattr(
        memory, "compiled_programs", lambda p: {n: _Padded(c, 2) for n, c in compiled(p).items()}
    )
    padded = memory.plan_memory(plan).slots
    for was, now in zip(logical, padded):
        base = was.parameters + was.batch + was.accumulators + was.arguments
        assert (now.parameters, now.batch, now.accumulators) == (
            was.parameters, was.batch, was.accumulators,
        )  # fmt: skip
        # Every value in flight is some program's passed output: all of them twice.
        assert now.buffers - base == 2 * (was.buffers - base) > 0
        assert now.temporaries == was.temporaries


def test_on_the_cpu_values_count_their_logical_bytes():
    # The CPU lays arrays out as their bytes: its programs' output sizes are those and
    # the output table, the prediction unchanged by compiling them.
    pipe, ex = _mlp_pipeline("1f1b", 4, 4)
    plan = pipe.plan(*ex.args)
    if plan.placement.slots[0].devices[0].platform != "cpu":
        pytest.skip("an accelerator may lay its arrays out padded")
    programs = pipe.compiled_programs(*ex.args)
    assert any("+" in name for name in programs)  # a fused program among them
    for program in programs.values():
        accumulators, passed = (jax.tree_util.tree_leaves(x) for x in program.out_info)
        sizes = [[nbytes(x) for x in accumulators], [nbytes(x) for x in passed]]
        assert device_padding(program.memory_analysis(), *sizes) == 1
    temporaries = {n: p.memory_analysis().temp_size_in_bytes for n, p in programs.items()}
    assert memory.plan_memory(plan) == estimate_memory(plan, temporaries)


def test_dispatch_ahead_must_be_a_positive_count_or_none():
    ex = examples.mlp(num_layers=2, batch=4)
    with pytest.raises(pm.PipemarkError, match="dispatch_ahead"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, dispatch_ahead=0)
    with pytest.raises(pm.PipemarkError, match="recompute_residuals"):
        pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, recompute_residuals="yes")


# ------------------------------------------------- the estimate against live arrays


def _live_arrays():
    """The live arrays of the default backend and of the host CPU: ``jax.live_arrays()``
    lists the default backend's alone, and on an accelerator these tests' pipelines run
    on the host CPU's devices (``tests._devices``)."""
    return [a for platform in {jax.default_backend(), "cpu"} for a in jax.live_arrays(platform)]


def _live_bytes(devices, skip=frozenset()):
    """Per device of ``devices``, the bytes of the live ``jax.Array`` s there whose
    ``id`` is not in ``skip``, each buffer once (two arrays may share one: an array
    committed where it lay, ``device_put`` onto its own device)."""
    held = dict.fromkeys(devices, 0)
    seen = set()
    for array in _live_arrays():
        if array.is_deleted() or id(array) in skip:
            continue
        for shard in array.addressable_shards:
            buffer = (shard.device, shard.data.unsafe_buffer_pointer())
            if shard.device in held and buffer not in seen:
                seen.add(buffer)
                held[shard.device] += shard.data.nbytes
    return held


@contextlib.contextmanager
def _sampled(monkeypatch, devices, arguments):
    """Within the block, the most bytes of arrays each of ``devices`` holds right after
    an action of a pipeline call is dispatched (a list of per-device dicts, one a
    sample), less what other tests left alive there (the arrays live at the start that
    are not among ``arguments``, the call's own).

    The samples are taken with no other action being dispatched (a lock around each
    dispatch and its sample): inside a dispatch the accumulators it donates and the
    ones it returns are one buffer, which JAX's live arrays would count twice. Any
    interleaving of the worker threads can be sampled, and whatever they hold for
    values another slot has not read yet, or that a program dispatched ahead still
    reads, is counted. JAX's live arrays are arrays: the programs' temporaries are not
    among them (the CPU reports no device memory of its own)."""
    mine = {id(leaf) for leaf in jax.tree_util.tree_leaves(arguments)}
    before = {id(a) for a in _live_arrays()} - mine
    samples = []
    lock = threading.Lock()
    dispatch = execution._Call.dispatch

    def sampling(self, step, inputs, scale):
        with lock:
            out = dispatch(self, step, inputs, scale)
            samples.append(_live_bytes(devices, before))
        return out

    monkeypatch.setattr(execution._Call, "dispatch", sampling)
    yield samples
    monkeypatch.undo()


def _check_bound(estimate, samples, devices):
    """Each slot's measured peak within its predicted arrays; returns the ratios
    predicted / measured."""
    assert samples
    ratios = []
    for slot, device in zip(estimate.slots, devices):
        measured = max(sample[device] for sample in samples)
        assert 0 < measured <= slot.buffers, (slot, measured)
        assert slot.buffers <= slot.predicted_peak
        ratios.append(slot.buffers / measured)
    return ratios


@pytest.mark.parametrize(
    ("schedule", "num_stages", "num_devices", "num_microbatches", "fuse_actions"),
    [
        ("gpipe", 2, 2, 4, 1),
        ("1f1b", 4, 4, 8, 1),
        ("interleaved", 4, 2, 4, 1),
        ("zb-h1", 2, 2, 4, 1),
        ("interleaved", 4, 1, 4, 4),  # runs of actions fused: fewer, larger programs
    ],
)
@pytest.mark.parametrize("ahead", [2, None])
def test_a_call_holds_no_more_arrays_than_predicted(
    monkeypatch, schedule, num_stages, num_devices, num_microbatches, fuse_actions, ahead
):
    # The caller's parameters and batch on the first device (as a model made there
    # has them): the other slots' parameters and the whole batch count there too.
    used = pick_devices(num_devices)
    with computing_on(used):
        ex = examples.mlp(num_layers=num_stages, width=64, batch=4 * num_microbatches)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=used,
        dispatch_ahead=ahead,
        fuse_actions=fuse_actions,
        fuse_min_uses=1,
    )
    estimate = pipe.memory(*ex.args)
    with _sampled(monkeypatch, used, ex.args) as samples:
        got = pipe(*ex.args)
        jax.block_until_ready(got)
    ratios = _check_bound(estimate, samples, used)
    # An upper bound that is not far above: what the threads hold in the worst
    # interleaving, which a run need not reach (1.0 to 1.3 seen). Without a bound the
    # estimate counts what the whole column holds, dispatched before the device runs
    # any of it, which the host CPU's devices, keeping up with the host, do not reach
    # (up to 1.8 seen).
    if ahead is not None:
        assert max(ratios) < 1.5, ratios


@pytest.mark.parametrize(
    ("schedule", "num_stages", "optimizer", "donate"),
    [("1f1b", 2, "adam", False), ("1f1b", 2, "adam", True), ("gpipe", 4, "sgd", False)],
)
def test_a_training_step_holds_no_more_arrays_than_predicted(
    monkeypatch, schedule, num_stages, optimizer, donate
):
    # The step's first call: its parameters and optimizer state where they were made,
    # on the first device; its update's arrays are sampled once its parts ran. Donating,
    # the state's copies on other slots and the arrays at two places of the state
    # (the example's Adam starts both moments from the same zeros) live to the end.
    used = pick_devices(num_stages)
    with computing_on(used):
        ex = examples.mlp(num_layers=num_stages, width=64, batch=16)
        step, init = examples.train_step(ex.loss_fn, optimizer=optimizer)
        state = init(ex.params)
    pipe = pm.pipeline_train_step(
        step,
        num_stages=num_stages,
        num_microbatches=4,
        schedule=schedule,
        devices=used,
        donate=donate,
    )
    args = (ex.params, state, ex.batch)
    estimate = pipe.memory(*args)
    with _sampled(monkeypatch, used, args) as samples:
        run_update = train_step.run_update
        others = {id(a) for a in _live_arrays()} - {id(x) for x in jax.tree_util.tree_leaves(args)}

        def sampling(run):
            def sampled(*inputs):  # while the part's inputs and results are held
                outputs = run(*inputs)
                samples.append(_live_bytes(used, others))
                return outputs

            return sampled

        def sampled_update(plan, parts, *rest):
            parts = [part._replace(run=sampling(part.run)) for part in parts]
            return run_update(plan, parts, *rest)

        monkeypatch.setattr(train_step, "run_update", sampled_update)
        got = pipe(*args)
        jax.block_until_ready(got)
    ratios = _check_bound(estimate, samples, used)
    assert max(ratios) < 1.5, ratios
    assert all(s.update is not None and s.update <= s.predicted_peak for s in estimate.slots)


# ------------------------------------------------------------ running out of memory


def _cubic_loss(width):
    """An MLP layer, then every triple of the microbatch's rows with ``width`` features
    each handed to the next stage: ``rows**3 * width`` floats, which a larger batch
    makes too many for the device, a smaller one not."""

    def loss_fn(params, batch):
        x, y = batch
        w0, w1 = params
        h = jnp.tanh(x @ w0)
        c = h[:, 0]
        triples = c[:, None, None, None] * c[None, :, None, None] * c[None, None, :, None]
        wide = triples * jnp.ones(width, h.dtype)
        pm.mark_pipeline_boundary()
        return jnp.mean(wide * w1) + jnp.mean((h - y) ** 2)

    return loss_fn


def _runs_out_and_recovers(used, width, rows, small_rows, num_microbatches, schedule):
    """A training step of :func:`_cubic_loss` whose batch of ``rows`` rows does not fit
    on the devices ``used`` raises DeviceOutOfMemoryError and leaves the state it was
    given; the same step with ``small_rows`` rows then computes what JAX computes."""
    with computing_on(used):
        params = (jnp.full((4, 4), 0.25), jnp.float32(0.5))
        step, init = examples.train_step(_cubic_loss(width), optimizer="adam")
        state = init(params)
        params, state, _ = jax.jit(step)(params, state, _ones(8, 4))  # a state of its own
    pipe = pm.pipeline_train_step(
        step,
        num_stages=2,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=used,
    )
    leaves = jax.tree_util.tree_leaves((params, state))
    before = [np.asarray(leaf) for leaf in leaves]
    big = _ones(rows, 4)
    plan = pipe.plan(params, state, big)  # compiled: it fits, and keeps a few scalars
    live = _buffers()
    with pytest.raises(pm.DeviceOutOfMemoryError) as caught:
        jax.block_until_ready(pipe(params, state, big))
    error = caught.value
    assert isinstance(error, pm.PipemarkError) and isinstance(error, MemoryError)
    assert isinstance(
        error.__cause__, (jax.errors.JaxRuntimeError, ValueError)
    )  # a TPU's: a ValueError
    assert "RESOURCE_EXHAUSTED" in str(error.__cause__)
    message = str(error)
    names = [stage.name for stage in plan.staged.stages]
    assert re.search(r"running program '([\w+]+)' \(([FBW])\d+s\d", message), message
    assert re.search(r"running program '([\w+]+)'", message).group(1).split("+")[0] in names
    assert "Pipeline.memory predicts a peak of" in message
    assert "the device's limit is" in message and "memory_budget=" in message
    # Nothing of the call stays on the devices, though the error is kept.
    # (The caller's frames in its traceback may hold arrays committed where they lay:
    # the same buffers as the caller's.)
    assert _buffers() <= live
    for leaf, kept in zip(leaves, before):
        assert not leaf.is_deleted()
        np.testing.assert_array_equal(np.asarray(leaf), kept)
    # The next call, with a batch that fits, runs and computes what JAX computes.
    small = _ones(small_rows, 4)
    with computing_on(used):
        want = jax.jit(step)(params, state, small)
    got = pipe(params, state, small)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)
    return error


def _buffers():
    """The device buffers of the live arrays."""
    return {
        (shard.device, shard.data.unsafe_buffer_pointer())
        for array in _live_arrays()
        if not array.is_deleted()
        for shard in array.addressable_shards
    }


def _ones(rows, features):
    return (jnp.ones((rows, features)), jnp.full((rows, features), 0.5))


def test_a_device_out_of_memory_raises_and_leaves_the_state():
    """A genuine out-of-memory, nothing simulated: the first stage's output for a
    microbatch of 4096 rows is 4096**3 * 1024 float32s (256 TiB: more than an x86-64
    process can address, so the CPU's allocator refuses it whatever the system's
    overcommit policy; XLA's RESOURCE_EXHAUSTED, at run time: the program compiles);
    8 rows need 2 MiB."""
    used = pick_devices(2)
    if used[0].platform != "cpu":
        pytest.skip("the CPU's refusal; test_a_device_runs_out_of_memory is the accelerator's")
    error = _runs_out_and_recovers(used, 1024, 8192, 16, 2, "1f1b")
    assert "limit is unknown (cpu reports no bytes_limit)" in str(error)


def test_a_device_runs_out_of_memory_between_programs_that_each_fit():
    """On a device that reports its memory limit (a TPU's ``bytes_limit``): each
    microbatch's output of the first stage takes a quarter of the device, which every
    program fits (XLA compiles them), and GPipe's order on the one device (every
    forward, then every backward) holds eight of them at once (the second stage's
    backward reads them): the device runs out while the pipeline runs, as the estimate
    predicts."""
    (device,) = jax.devices()[:1]
    limit = (device.memory_stats() or {}).get("bytes_limit") if device.platform != "cpu" else None
    if not limit:
        pytest.skip("needs a device that reports memory_stats()['bytes_limit'] (a TPU)")
    rows = 32
    width = int(limit / 4 / 4 / rows**3)  # a quarter of the device per microbatch
    forwards = [Action(stage, m, FORWARD) for stage in (0, 1) for m in range(8)]
    backwards = [Action(stage, m, BACKWARD) for stage in (1, 0) for m in range(8)]
    gpipe = pm.runtime.schedule_from_orders(
        [forwards + backwards], stage_devices=(0, 0), num_microbatches=8
    )
    error = _runs_out_and_recovers([device], width, 8 * rows, 8, 8, gpipe)
    predicted = int(re.search(r"predicts a peak of [^(]+\((\d+) bytes\)", str(error)).group(1))
    assert predicted > limit, str(error)
    assert f"({limit} bytes)" in str(error)


@pytest.mark.parametrize("donate", [False, True])
def test_an_update_out_of_memory_raises_and_leaves_the_state(donate):
    """A genuine out-of-memory in the update after the pipeline: a metric the step
    returns, 2**23 x 2**23 float32s (256 TiB, beyond what an x86-64 process can
    address), which the CPU's allocator refuses whatever the overcommit policy (at
    4 TiB, a machine that overcommits memory grants it and fills its RAM). Donating,
    the failing part (the first slot's, which computes the metric no stage owns) may
    have taken its state over (whether XLA fails before or after it takes its
    arguments), and the error says so; what is left is as it was."""
    used = pick_devices(2)
    if used[0].platform != "cpu":
        pytest.skip("the CPU's refusal of 256 TiB")
    with computing_on(used):
        ex = examples.mlp(num_layers=2, width=8, batch=8)
        step, init = examples.train_step(ex.loss_fn, optimizer="sgd")
        state = init(ex.params)

    def huge_metric(params, opt_state, batch):
        params, opt_state, loss = step(params, opt_state, batch)
        return params, opt_state, loss, jnp.broadcast_to(loss, (2**23, 2**23)) + 1.0

    pipe = pm.pipeline_train_step(
        huge_metric, num_stages=2, num_microbatches=2, devices=used, donate=donate
    )
    before = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((ex.params, state))]
    with pytest.raises(
        pm.DeviceOutOfMemoryError, match=r"running the training step's update"
    ) as info:
        jax.block_until_ready(pipe(ex.params, state, ex.batch))
    told = "With donate=True the parameters and optimizer state" in str(info.value)
    assert told == donate and ("The arrays passed in are unchanged." in str(info.value)) != donate
    after = jax.tree_util.tree_leaves((ex.params, state))
    assert donate or not any(leaf.is_deleted() for leaf in after)
    for leaf, kept in zip(after, before):
        if not leaf.is_deleted():  # what a donating step's failing part may have taken
            np.testing.assert_array_equal(np.asarray(leaf), kept)
