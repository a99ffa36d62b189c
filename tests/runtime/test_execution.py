"""Tests of pipemark.runtime.execution: calls of plans whose forward and backward steps
are fused match JAX, and what a call costs the host, counted (programs dispatched,
transfers, batch splits) rather than timed, so that a noisy machine cannot make them
pass or fail."""

from __future__ import annotations

import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.runtime.devices import placement
from pipemark.runtime.execution import run as execution
from pipemark.runtime.execution.run import run_plan
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests._trees import assert_trees_close, assert_trees_equal
from tests.runtime._compiles import compilations
from tests.runtime._fusion import mlp_pipeline, unfused_steps


def _unfused(plan):
    return dataclasses.replace(plan, steps=unfused_steps(plan), fused={})


@pytest.mark.parametrize(
    ("num_stages", "num_microbatches", "schedule", "devices", "num_fused"),
    [
        (1, 1, "1f1b", 1, 1),
        (1, 4, "1f1b", 1, 4),
        (2, 4, "1f1b", 2, 4),
        (4, 4, "1f1b", 4, 4),
        (1, 1, "gpipe", 1, 1),
        (2, 4, "gpipe", 2, 0),
        (4, 4, "interleaved", 2, 4),
        (1, 4, "zb-h1", 1, 4),
        (2, 4, "zb-h1", 2, 4),
        (4, 4, "zb-v", 2, 4),
    ],
)
def test_every_schedule_with_fusion_matches_jax(
    num_stages, num_microbatches, schedule, devices, num_fused
):
    pipe, ex = mlp_pipeline(num_stages, num_microbatches, schedule, devices)
    plan = pipe.plan(*ex.args)
    fused = sum(s.fused is not None for _, s in plan.steps.serial)
    assert fused == num_fused
    with computing_on(plan.devices):
        want = jax.value_and_grad(ex.loss_fn)(*ex.args)
    assert assert_trees_close(pipe(*ex.args), want, rtol=1e-5) > 2
    # Fused or not, the same values up to float rounding (XLA may fuse differently).
    assert_trees_close(run_plan(_unfused(plan), *ex.args, None), want, rtol=1e-5)


def test_fused_steps_give_the_same_bits_threaded_and_serial():
    pipe, ex = mlp_pipeline(4, 8, batch=16)
    plan = pipe.plan(*ex.args)
    assert plan.fused
    threaded = run_plan(plan, *ex.args, None)
    serial = run_plan(plan, *ex.args, None, parallel=False)
    assert assert_trees_equal(threaded, serial) > 2


class _Counts:
    """What calls of a plan did on the host: programs dispatched, transfers and batch
    splits."""

    def __init__(self, monkeypatch, plan):
        self.programs = self.transfers = self.splits = 0

        def counted(unit):
            def run(*args):
                self.programs += 1
                return unit.run(*args)

            return dataclasses.replace(unit, run=run)

        self.plan = dataclasses.replace(
            plan,
            units={i: counted(u) for i, u in plan.units.items()},
            fused={i: counted(u) for i, u in plan.fused.items()},
        )
        copy, put, splitter = placement.copy_to_device, jax.device_put, execution._splitter

        def counting(fn, what):
            def wrapped(*args, **kwargs):
                setattr(self, what, getattr(self, what) + 1)
                return fn(*args, **kwargs)

            return wrapped

        monkeypatch.setattr(placement, "copy_to_device", counting(copy, "transfers"))
        monkeypatch.setattr(jax, "device_put", counting(put, "transfers"))
        monkeypatch.setattr(execution, "_splitter", lambda *key: counting(splitter(*key), "splits"))


@pytest.mark.parametrize(
    ("num_stages", "num_microbatches", "programs", "transfers", "splits"),
    [
        # One program; the parameters and the batch are on the stage's device already,
        # and one microbatch is the batch itself: nothing is copied.
        (1, 1, 1, 0, 0),
        # One program per microbatch; the two batch arrays split once each.
        (1, 4, 4, 0, 2),
        # Stage 0 forward, backward (4 each); stage 1 fused (4). Stage 1's device gets
        # its parameters and batch in one transfer; each microbatch hands an activation
        # forward and a cotangent back (8).
        (2, 4, 12, 9, 2),
    ],
)
def test_what_a_call_costs_the_host(
    monkeypatch, num_stages, num_microbatches, programs, transfers, splits
):
    pipe, ex = mlp_pipeline(num_stages, num_microbatches)
    plan = pipe.plan(*ex.args)
    counts = _Counts(monkeypatch, plan)
    for parallel in (True, False):
        counts.programs = counts.transfers = counts.splits = 0
        timings: dict = {}
        jax.block_until_ready(run_plan(counts.plan, *ex.args, timings, parallel=parallel))
        assert (counts.programs, counts.transfers, counts.splits) == (
            programs,
            transfers,
            splits,
        )
        assert timings["num_programs"] == programs
        assert timings["num_actions"] == 4 * num_stages * num_microbatches // 2
        # Measured, not derived: the thread's CPU clock (coarse on some hosts: 0.0 seen
        # on a TPU VM for these short walks).
        assert 0 <= timings["host_cpu_s"] < 60


def test_an_uncommitted_batch_is_split_where_it_lies(monkeypatch):
    # On a device that is not JAX's default one (on an accelerator machine, the host
    # CPU's: not even the default platform), the example's arrays made there: the
    # batch is split on that device, so neither it nor the parameters are copied.
    used = [d for d in jax.devices("cpu") if d != jax.devices()[0]][-1:]
    with computing_on(used):
        ex = examples.mlp(num_layers=2, width=8, batch=8)
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=4, devices=used)
    counts = _Counts(monkeypatch, pipe.plan(*ex.args))
    jax.block_until_ready(run_plan(counts.plan, *ex.args, {}))
    assert (counts.transfers, counts.splits) == (0, 2)


def test_each_stage_program_compiles_once():
    # The accumulators a call starts from and those a program returns must have one
    # pytree type: a tuple at the first microbatch and a list at the next compiled every
    # accumulating stage program twice.
    # Identical stages on one device (layer0 and layer2 here) share one program; their
    # inputs are committed arrays (an uncommitted batch would compile it apart).
    clear_caches()  # fresh stage programs: none compiled by an earlier test
    used = pick_devices(2)  # on an accelerator with one device, the host CPU's two
    ex = examples.mlp(num_layers=4, width=3, batch=8)
    args = jax.device_put(ex.args, used[0])
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_stages=4,
        num_microbatches=4,
        schedule="interleaved",
        devices=used,
    )
    with compilations() as compiled:
        jax.block_until_ready(pipe(*args))
    plan = pipe.plan(*args)
    runs = {
        id(plan.units[s.index].run if s.fused is None else plan.fused[s.fused].run)
        for _, s in plan.steps.serial
    }
    assert len(runs) >= 5  # forwards, backwards and a fused program
    assert compiled.count("jit(run)") == len(runs)
    with compilations() as compiled:
        jax.block_until_ready(pipe(*args))
    assert compiled == []


def test_threaded_and_serial_walks_run_the_same_compiled_programs():
    # The walk on a worker thread runs under the caller's mesh context (jax.set_mesh is
    # per thread, and JAX compiles a program apart for each context).
    clear_caches()
    used = pick_devices(2)
    with computing_on(used):
        ex = examples.mlp(num_layers=4, width=3, batch=4)
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=2, num_microbatches=2, devices=used)
    jax.block_until_ready(pipe(*ex.args))  # threaded: stage 1 on a worker thread
    plan = pipe.plan(*ex.args)
    with compilations() as compiled:
        jax.block_until_ready(run_plan(plan, *ex.args, None, parallel=False))
    assert compiled == []


def test_uncommitted_state_compiles_nothing_at_the_second_step():
    # Parameters made on the default device (jnp, jax.random) are uncommitted; a step's
    # results, the next step's arguments, are committed, and jit compiles a program for
    # each kind apart. The runtime commits what it is given: the first step compiles
    # every program, the second none.
    clear_caches()
    used = pick_devices(2)
    ex = examples.mlp(num_layers=4, width=3, batch=8)
    step, init_state = examples.train_step(ex.loss_fn, optimizer="adam")
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(np.asarray(p)), ex.params)
    state = init_state(params)
    assert not any(leaf.committed for leaf in jax.tree_util.tree_leaves(params))
    pipelined = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
    first = jax.block_until_ready(pipelined(params, state, ex.batch))
    with compilations() as compiled:
        jax.block_until_ready(pipelined(*first[:2], ex.batch))
    assert compiled == []
    # What the caller gave is as it was: nothing donated or moved in place.
    assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves((params, state)))


class _Result:
    """A stand-in for one result array of a dispatched program: records the waits."""

    def __init__(self, name: str, waits: list[str], deleted: bool = False) -> None:
        self.name, self.waits, self.deleted = name, waits, deleted

    def is_deleted(self) -> bool:
        return self.deleted

    def block_until_ready(self) -> _Result:
        self.waits.append(self.name)
        return self


def test_the_dispatch_bound_waits_once_for_the_oldest_action_past_it():
    """With ``dispatch_ahead=2``, dispatching action ``n`` waits for action ``n - 2``:
    for one of its results not donated since (one program's results are computed
    together), and not at all where each was donated to a later action."""
    waits: list[str] = []
    plan = types.SimpleNamespace(dispatch_ahead=2)
    pending = collections.deque()
    donated = {1}  # action 1's accumulators went to a later action, as its output did
    for n in range(6):
        accs = [_Result(f"acc{n}", waits, deleted=n in donated)]
        outs = [_Result(f"out{n}", waits, deleted=n in donated), _Result(f"x{n}", waits)]
        if n in donated:
            outs.pop()
        execution._bound_dispatch(plan, 0, pending, None, (accs, outs))
        assert len(pending) == min(n + 1, 2)
    assert waits == ["acc0", "acc2", "acc3"]
