"""Training runs saved and resumed with orbax (tests/runtime/_checkpoint.py): saved in 2
and 4 processes under ``python -m pipemark.launch``, with results gathered and kept, on
devices and on sub-meshes, onto the same layout (bit for bit: the same programs) and
onto others (within float rounding of ``jax.jit``'s steps); the loss read in every
process; a process killed mid-save loses nothing. In one process: save, restore and
resume too, and a step that raises leaves the state it was given as it was."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

import pipemark as pm
from pipemark import examples
from tests._devices import computing_on
from tests._devices import devices as pick_devices
from tests._faults import checked_finite
from tests._launched import launched
from tests.runtime import _checkpoint as script

SCRIPT = Path(script.__file__)


def _launch(out: Path, processes: int, mode: str, *args: str, devices: int = 1):
    return launched(SCRIPT, str(out), mode, *args, processes=processes, devices=devices)


def _seen(out: Path, mode: str, processes: int) -> list[dict]:
    return [json.loads((out / f"{mode}-{p}.json").read_text()) for p in range(processes)]


def _jit_losses() -> list[float]:
    """JAX's own: jax.jit of the step, from the same state, on the same batches."""
    step, state, batches = script.model()
    step = jax.jit(step)
    losses = []
    for batch in batches:
        *state, loss = step(*state, batch)
        losses.append(float(loss))
    return losses


def _assert_close(got: list[float], want: list[float]) -> None:
    # float32 Adam over a few steps: the pipeline adds microbatches' gradients in
    # another order than jit's one program; a few ulps of the loss, amplified by the
    # steps, stay far below 1e-5 relative.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_saved_in_two_processes_resumes_in_two_four_and_one(tmp_path):
    launched = _launch(tmp_path, 2, "train", devices=2)
    assert launched.returncode == 0, launched.stderr[-4000:]
    want = _jit_losses()
    train = _seen(tmp_path, "train", 2)
    for seen in train:  # every process read every loss, whatever gather_results says
        assert seen["devices"] == [4, 2]
        assert set(seen) >= {"gathered", "held", "meshes"}
        for name in ("gathered", "held", "meshes"):
            run = seen[name]
            assert run == train[0][name]
            _assert_close(run["losses"], want)
            # Restored onto the same layout: the same programs, the same bits.
            assert run["resumed"] == run["standard"] == run["losses"][script.SAVE_AT :]
        assert seen["gradients"]["loss"] == train[0]["gradients"]["loss"]
    # Each process held (and checked) its own stages' gradients, none twice.
    assert sum(seen["gradients"]["held"] for seen in train) == 2 * script.LAYERS
    # Four processes of one device each: another layout, from each checkpoint.
    names = ["manager-held", "manager-gathered", "manager-meshes"]
    launched = _launch(tmp_path, 4, "resume", *(str(tmp_path / n) for n in names))
    assert launched.returncode == 0, launched.stderr[-4000:]
    resumed = _seen(tmp_path, "resume", 4)
    for seen in resumed:
        assert seen["devices"] == [4, 1]
        for name in names:
            _assert_close(seen[name]["resumed"], want[script.SAVE_AT :])
    # Saved and restored by the four processes: with results kept each leaf is held by
    # one process at least (the scalars by all); gathered, every process holds every one.
    leaves = len(jax.tree_util.tree_leaves(script.saved(script.model()[1])))
    assert leaves <= sum(seen["resaved-held"] for seen in resumed) < 4 * leaves
    assert [seen["resaved-gathered"] for seen in resumed] == [leaves] * 4
    _resume_in_this_process(tmp_path / "manager-held", want)


def _resume_in_this_process(directory: Path, want: list[float]) -> None:
    """The 2-process checkpoint onto this process: 2 stages on 2 devices, and 2 stages
    on sub-meshes of 2 devices each."""
    step, _state, batches = script.model()
    used = pick_devices(4)
    with computing_on(used):
        meshes = Mesh(np.array(used).reshape(2, 2), ("stage", "data"))
        for options in (dict(devices=used[:2]), dict(mesh=meshes)):
            pipe = script.pipelined(step, dict(num_stages=2, **options))
            at, restored = script.restore(pipe, str(directory), batches[0])
            assert at == script.SAVE_AT
            _assert_close(script.run(pipe, restored, batches, at, script.STEPS)[0], want[at:])


@pytest.mark.slow
def test_a_process_killed_mid_save_resumes_from_the_last_whole_checkpoint(tmp_path):
    killed = _launch(tmp_path, 2, "killed", devices=2)
    assert killed.returncode != 0
    assert "process 1 was killed by signal 9" in killed.stderr, killed.stderr[-3000:]
    # The step being saved when the process died was never committed.
    steps = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert [s for s in steps if s.isdigit()] == [str(k) for k in range(1, script.KILL_AT)]
    resumed = _launch(tmp_path, 2, "after-kill", devices=2)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for seen in _seen(tmp_path, "after-kill", 2):
        assert seen["first"] == script.KILL_AT - 1
        # The same layout and programs as the uninterrupted run: the same losses.
        assert seen["losses"] == seen["uninterrupted"][seen["first"] :]


def test_in_one_process_a_checkpoint_resumes_bit_for_bit(tmp_path):
    step, state, batches = script.model()
    used = pick_devices(2)
    with computing_on(used):
        pipe = script.pipelined(step, dict(num_stages=2, devices=used))
        losses, middle = script.run(pipe, state, batches, 0, script.SAVE_AT)
        target = pipe.abstract_state(*state, batches[0])
        for leaf, kept in zip(jax.tree_util.tree_leaves(middle), jax.tree_util.tree_leaves(target)):
            assert leaf.sharding.device_set == kept.sharding.device_set  # where it stays
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp_path / "state", script.saved(middle))
        checkpointer.wait_until_finished()
        back = checkpointer.restore(tmp_path / "state", script.saved(target))
        rest = script.run(pipe, middle, batches, script.SAVE_AT, script.STEPS)[0]
        resumed = script.run(pipe, (back["params"], back["opt_state"]), batches, 3, 5)[0]
    assert resumed == rest
    _assert_close(losses + rest, _jit_losses())


def test_a_step_that_raises_leaves_the_state_it_was_given(tmp_path):
    step, state, batches = script.model()
    used = pick_devices(2)
    with computing_on(used):
        pipe = script.pipelined(step, dict(num_stages=2, devices=used))
        params, opt_state, _ = pipe(*state, batches[0])
        before = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, opt_state))]
        x, y = batches[1]
        with pytest.raises(pm.PipemarkError):  # a bad batch: rows that do not split
            pipe(params, opt_state, (x[:3], y[:3]))
        with pytest.raises((TypeError, pm.PipemarkError)):  # one JAX refuses to trace
            pipe(params, opt_state, (x.astype(np.int32)[:, :3], y))
        after = jax.tree_util.tree_leaves((params, opt_state))
        assert all(not leaf.is_deleted() for leaf in after)  # nothing donated away
        for a, b in zip(after, before):
            np.testing.assert_array_equal(np.asarray(a), b)
        pipe(params, opt_state, batches[1])  # and the next good step runs


def test_a_stage_that_fails_while_it_runs_leaves_the_state_it_was_given():
    # The error happens inside a stage program on its device (a host callback that
    # raises, as a data check or a NaN guard does), after the pipeline started.
    ex = examples.mlp(num_layers=script.LAYERS, width=script.WIDTH, batch=script.ROWS)
    tx = optax.adamw(1e-2)

    def loss_fn(params, batch):
        x, y = batch
        for k, (w, b) in enumerate(params):
            if k == 2:  # in the second stage
                x = checked_finite(x)
            x = jnp.tanh(x @ w + b)
            if k < len(params) - 1:
                pm.mark_pipeline_boundary()
        return jnp.mean((x - y) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    used = pick_devices(2)
    with computing_on(used):
        pipe = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
        params, opt_state, _ = pipe(ex.params, tx.init(ex.params), ex.batch)
        before = [np.asarray(x) for x in jax.tree_util.tree_leaves((params, opt_state))]
        x, y = ex.batch
        bad = (np.asarray(x).copy(), y)
        bad[0][0, 0] = np.nan
        with pytest.raises(Exception, match="non-finite activation"):
            jax.block_until_ready(pipe(params, opt_state, bad))
        after = jax.tree_util.tree_leaves((params, opt_state))
        assert all(not leaf.is_deleted() for leaf in after)
        for a, b in zip(after, before):
            np.testing.assert_array_equal(np.asarray(a), b)
        jax.block_until_ready(pipe(params, opt_state, ex.batch))  # the next step runs
