"""Checkpoints of pipelined training runs with orbax, run by tests/runtime/test_checkpoint.py
under ``python -m pipemark.launch`` (several processes) or alone (one).

    python -m pipemark.launch -n 2 tests/runtime/_checkpoint.py OUT train
    python -m pipemark.launch -n 4 tests/runtime/_checkpoint.py OUT resume CHECKPOINTS...
    python -m pipemark.launch -n 2 tests/runtime/_checkpoint.py OUT killed
    python -m pipemark.launch -n 2 tests/runtime/_checkpoint.py OUT after-kill

``train`` runs :data:`STEPS` steps of an AdamW step with clipping and a cosine schedule,
one pipeline stage per device, with results gathered and not, and on sub-meshes: each
saves its state after step :data:`SAVE_AT` with orbax (``CheckpointManager`` with
``StandardSave``, and ``StandardCheckpointer``), restores it onto the same layout with
``PipelinedStep.abstract_state`` and runs the last steps again. ``resume`` restores
each checkpoint named onto this launch's layout and runs the last steps, then saves the
state it reached and restores it, with results kept and gathered. ``killed`` saves
after every step and SIGKILLs process 1 as the job saves step :data:`KILL_AT` (process
0 mid-save, process 1 before writing its part); ``after-kill`` resumes from the last
whole checkpoint, then runs the same steps uninterrupted. ``train`` also saves and restores the gradients of a
``pipeline_value_and_grad`` whose results stay where they were computed.
Each process writes what it saw to ``OUT/<mode>-<process>.json``: the losses (read with
``float`` in every process, results gathered or not) and the devices it had.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from tests._xla import xla_flags

STEPS, SAVE_AT, KILL_AT = 5, 3, 3
LAYERS, WIDTH, ROWS, MICRO = 4, 16, 8, 2


def _setup() -> tuple[str, str, list[str]]:
    """Read the arguments; join jax.distributed (under the launcher) or give this one
    process 4 CPU devices, before JAX starts."""
    out, mode, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "PIPEMARK_COORDINATOR" in os.environ:
        from pipemark.launch import initialize

        initialize()
    else:
        os.environ["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=4")
    return out, mode, rest


if __name__ == "__main__":
    OUT, MODE, REST = _setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pipemark as pm  # noqa: E402
from pipemark import examples  # noqa: E402


def model():
    """The model, its AdamW step (global-norm clipping, warmup and cosine decay, weight
    decay) with the gradients marked, the initial state and the batch of each step."""
    ex = examples.mlp(num_layers=LAYERS, width=WIDTH, batch=ROWS)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, STEPS)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(ex.loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y = ex.batch
    batches = [(x * (1 + 0.1 * k), y) for k in range(STEPS)]
    return step, (ex.params, tx.init(ex.params)), batches


def layouts() -> dict[str, dict]:
    """The pipeline options of each layout this process count and device count allow:
    a stage per device, results gathered or kept; two stages per process's devices on
    sub-meshes (``("stage", "data")``) where there are two per process."""
    devices = jax.devices()
    found = {
        "gathered": dict(num_stages=len(devices), gather_results=True),
        "held": dict(num_stages=len(devices), gather_results=False),
    }
    per_process = len(jax.local_devices())
    if per_process == 2 and jax.process_count() > 1:
        grid = np.array(devices).reshape(jax.process_count(), per_process)
        mesh = Mesh(grid, ("stage", "data"))
        found["meshes"] = dict(num_stages=jax.process_count(), mesh=mesh, gather_results=False)
    return found


def pipelined(step, options: dict):
    return pm.pipeline_train_step(step, num_microbatches=MICRO, timeout_s=60, **options)


def run(pipe, state, batches, first: int, last: int) -> tuple[list[float], tuple]:
    """Steps ``first .. last - 1``: the losses, read in every process, and the state."""
    losses = []
    for k in range(first, last):
        params, opt_state, loss = pipe(*state, batches[k])
        state = (params, opt_state)
        losses.append(float(loss))
    return losses, state


def saved(state) -> dict:
    return {"params": state[0], "opt_state": state[1]}


def restore(pipe, directory: str, batch) -> tuple:
    """The state saved in ``directory`` (a CheckpointManager's, its latest step) onto
    this pipeline's layout."""
    params, opt_state = pipe.abstract_state(*model()[1], batch)
    target = {"params": params, "opt_state": opt_state}
    with ocp.CheckpointManager(directory) as manager:
        step = manager.latest_step()
        got = manager.restore(step, args=ocp.args.StandardRestore(target))
    return step, (got["params"], got["opt_state"])


def train(out: str) -> dict:
    """Every layout: the uninterrupted losses; the state saved after SAVE_AT steps by
    a CheckpointManager and a StandardCheckpointer; the losses resumed from it."""
    step, state, batches = model()
    seen = {}
    for name, options in layouts().items():
        pipe = pipelined(step, options)
        first, middle = run(pipe, state, batches, 0, SAVE_AT)
        with ocp.CheckpointManager(os.path.join(out, f"manager-{name}")) as manager:
            manager.save(SAVE_AT, args=ocp.args.StandardSave(saved(middle)))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(out, f"standard-{name}"), saved(middle))
        checkpointer.wait_until_finished()
        rest, _ = run(pipe, middle, batches, SAVE_AT, STEPS)
        at, resumed_state = restore(pipe, os.path.join(out, f"manager-{name}"), batches[0])
        target = pipe.abstract_state(*state, batches[0])
        plain = checkpointer.restore(os.path.join(out, f"standard-{name}"), saved(target))
        resumed, _ = run(pipe, resumed_state, batches, at, STEPS)
        plain_resumed, _ = run(pipe, (plain["params"], plain["opt_state"]), batches, at, STEPS)
        seen[name] = dict(losses=first + rest, resumed=resumed, standard=plain_resumed)
    return seen


def gradients(out: str) -> dict:
    """pipeline_value_and_grad with results kept: the loss in every process, the
    gradients saved with a StandardCheckpointer and restored where the pipeline keeps
    them (the parameters' layout), equal to what was saved."""
    x, y = model()[2][0]
    ex = examples.mlp(num_layers=LAYERS, width=WIDTH, batch=ROWS)
    options = layouts()["held"]
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=MICRO, timeout_s=60, **options)
    loss, grads = pipe(ex.params, (x, y))
    target = pipe.abstract_params(ex.params, (x, y))
    held = save_and_restore(grads, target, os.path.join(out, "gradients"))
    return dict(loss=float(loss), held=held)


def resume(out: str, directories: list[str]) -> dict:
    """Each checkpoint restored onto this launch's first layout (a stage per device,
    results kept): the losses of the last steps. Then, in this launch's layouts with
    results kept and gathered, the state after the last step saved by these processes
    and restored (``resaved``: the leaves this process holds, each equal to what was
    saved)."""
    step, _, batches = model()
    pipe = pipelined(step, layouts()["held"])
    seen = {}
    for directory in directories:
        at, state = restore(pipe, directory, batches[0])
        seen[os.path.basename(directory)] = dict(resumed=run(pipe, state, batches, at, STEPS)[0])
    for name in ("held", "gathered"):
        pipe = pipelined(step, layouts()[name])
        at, state = restore(pipe, directories[0], batches[0])
        _, state = run(pipe, state, batches, at, STEPS)
        seen[f"resaved-{name}"] = resave(pipe, state, batches[0], os.path.join(out, name))
    return seen


def resave(pipe, state, batch, directory: str) -> int:
    """``state`` saved and restored onto ``pipe``'s layout (:func:`save_and_restore`)."""
    target = saved(pipe.abstract_state(*model()[1], batch))
    return save_and_restore(saved(state), target, directory)


def save_and_restore(tree, target, directory: str) -> int:
    """``tree`` saved with a StandardCheckpointer and restored onto ``target``: each
    restored leaf laid out as the one saved and, where this process holds it, equal to
    it. The number of leaves this process held."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, tree)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(directory, target)
    held = 0
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        if b.addressable_shards:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            held += 1
    return held


def killed(out: str, resuming: bool) -> dict:
    """Save after every step; process 1 is killed as the job saves step KILL_AT. Resuming:
    from the last whole checkpoint to the end."""
    step, state, batches = model()
    pipe = pipelined(step, layouts()["held"])
    directory = os.path.join(out, "killed")
    first = 0
    if resuming:
        first, state = restore(pipe, directory, batches[0])
    losses = []
    with ocp.CheckpointManager(directory) as manager:
        for k in range(first, STEPS):
            loss_k, state = run(pipe, state, batches, k, k + 1)
            losses += loss_k
            if not resuming and k + 1 == KILL_AT and jax.process_index() == 1:
                # Killed as the job saves this step, before its own part is written:
                # never committed, however fast the save goes (killed right after
                # asking to save, the step was committed once, on JAX 0.12).
                os.kill(os.getpid(), signal.SIGKILL)
            manager.save(k + 1, args=ocp.args.StandardSave(saved(state)))
            if k + 1 < KILL_AT:
                manager.wait_until_finished()  # the steps before are whole
    seen = dict(first=first, losses=losses)
    if resuming:  # the same run uninterrupted, on the same layout
        seen["uninterrupted"] = run(pipe, model()[1], batches, 0, STEPS)[0]
    return seen


def main() -> None:
    if MODE == "train":
        seen = train(OUT)
        seen["gradients"] = gradients(OUT)
    elif MODE == "resume":
        seen = resume(OUT, REST)
    else:
        seen = killed(OUT, MODE == "after-kill")
    seen["devices"] = [len(jax.devices()), len(jax.local_devices())]
    with open(os.path.join(OUT, f"{MODE}-{jax.process_index()}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
