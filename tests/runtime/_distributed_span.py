"""Run by tests/runtime/test_distributed.py: stages whose sub-meshes span processes.

Processes of 2 host CPU devices each; the mesh ``("stage", "data")`` is 2 x P for P
processes: with 2 processes each stage spans both (stage k has device k of each), with
4 each stage spans two (stage 0 processes 0 and 1, stage 1 processes 2 and 3). Or one
process of 2 x P devices, the same mesh (``reference``). An MLP's loss and gradients
under 1F1B (and, with 2 processes, interleaved: two stages per slot), saved per
process with ``jax.jit`` of ``jax.value_and_grad`` in the same process; each process
writes its process id first (``pid-MODE-P``), for a test to check none is left. With
2 processes, also the messages of what is refused while a stage spans processes.

    python -m pipemark.launch -n 2 tests/runtime/_distributed_span.py OUT_DIR run
    python tests/runtime/_distributed_span.py OUT_DIR reference 2   # 4 devices, one process
    python -m pipemark.launch -n 2 tests/runtime/_distributed_span.py OUT_DIR die
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    OUT, MODE = sys.argv[1], sys.argv[2]
    PROCESSES = int(
        os.environ.get("PIPEMARK_NUM_PROCESSES", sys.argv[3] if len(sys.argv) > 3 else 2)
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if MODE == "reference":
        jax.config.update("jax_num_cpu_devices", 2 * PROCESSES)
    else:
        jax.config.update("jax_num_cpu_devices", 2)
        from pipemark.launch import initialize

        initialize()

import jax
import numpy as np
from jax.sharding import Mesh

import pipemark as pm
from pipemark import examples

#: (schedule, stages): interleaved puts two stages on each slot; with 4 processes (a
#: longer run) 1F1B alone.
SCHEDULES = {2: (("1f1b", 2), ("interleaved", 4)), 4: (("1f1b", 2),)}


def span_mesh(processes: int) -> Mesh:
    """The 2 x ``processes`` mesh ``("stage", "data")`` over ``processes`` x 2 devices
    (process-major, as ``jax.devices()`` sorted by process): each stage spans
    ``processes / 2`` processes, or both of two."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(processes, 2)
    grid = grid.T if processes == 2 else grid.reshape(2, processes)
    return Mesh(grid, ("stage", "data"))


def refusals(mesh: Mesh, mlp) -> dict[str, str]:
    """What is refused while a stage spans processes, by name: each process's results
    kept where computed (``held``) and a training step (``train``); the messages."""

    def train_step(params, batch):
        loss, grads = jax.value_and_grad(mlp.loss_fn)(params, batch)
        grads = pm.mark_gradient(grads)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    options = dict(num_stages=2, num_microbatches=4, mesh=mesh, timeout_s=60)
    calls = {
        "held": pm.pipeline_value_and_grad(mlp.loss_fn, **options, gather_results=False),
        "train": pm.pipeline_train_step(train_step, **options),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call(mlp.params, mlp.batch)
        except pm.PipemarkError as error:
            messages[f"refused-{name}"] = str(error)
    return messages


def main() -> None:
    me = jax.process_index()
    with open(os.path.join(OUT, f"pid-{MODE}-{me}"), "w") as f:
        f.write(str(os.getpid()))
    if MODE == "die" and me == 1:
        # Die after the processes agreed on the call, before the first transfer.
        from pipemark.runtime import plan

        plan.Watchdog = lambda *args: os._exit(3)
    mesh = span_mesh(PROCESSES)
    mlp = examples.mlp(num_layers=4, width=16, batch=16)
    saved = {}
    want = jax.jit(jax.value_and_grad(mlp.loss_fn))(mlp.params, mlp.batch)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(want)):
        saved[f"want-{i}"] = np.asarray(leaf)
    for schedule, stages in SCHEDULES[PROCESSES]:
        step = pm.pipeline_value_and_grad(
            mlp.loss_fn,
            num_stages=stages,
            num_microbatches=4,
            schedule=schedule,
            mesh=mesh,
            timeout_s=60,
        )
        for i, leaf in enumerate(jax.tree_util.tree_leaves(step(mlp.params, mlp.batch))):
            assert leaf.is_fully_addressable, (schedule, i, leaf.sharding)  # whole here
            saved[f"{schedule}-{i}"] = np.asarray(leaf)
    if MODE == "run" and PROCESSES == 2:
        saved.update(refusals(mesh, mlp))
    np.savez(os.path.join(OUT, f"{MODE}-{me}.npz"), **saved)
    print(f"process {me}: done", flush=True)


if __name__ == "__main__":
    main()
