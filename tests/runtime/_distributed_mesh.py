"""Run by tests/runtime/test_distributed.py: stages on sub-meshes across processes.

Two processes of 4 host CPU devices each (``python -m pipemark.launch -n 2``), one
stage's 2 x 2 (data x model) sub-mesh per process, or one process of 8 devices
(``reference``); every schedule on a tensor-parallel MLP, losses and gradients saved
per process.

    python tests/runtime/_distributed_mesh.py OUT_DIR run        # under pipemark.launch
    python tests/runtime/_distributed_mesh.py OUT_DIR reference  # one process, 8 devices
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    OUT, MODE = sys.argv[1], sys.argv[2]
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if MODE == "reference":
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        jax.config.update("jax_num_cpu_devices", 4)
        from pipemark.launch import initialize

        initialize()

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark import examples
from tests.runtime._distributed import save_call, save_held

SCHEDULES = (("gpipe", 2), ("1f1b", 2), ("interleaved", 4), ("zb-h1", 2), ("zb-v", 4))


def main() -> None:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(2, 2, 2), ("stage", "data", "model"))
    model_mesh = Mesh(mesh.devices[0], ("data", "model"))
    hidden = NamedSharding(model_mesh, P("data", "model"))
    loss_fn, params, batch = examples.tensor_parallel_mlp(4, 16, 16, hidden_sharding=hidden)
    specs = examples.tensor_parallel_mlp_specs(4)
    saved = {}
    options = dict(num_microbatches=4, mesh=mesh, param_specs=specs, timeout_s=60)
    for schedule, stages in SCHEDULES:
        step = pm.pipeline_value_and_grad(loss_fn, num_stages=stages, schedule=schedule, **options)
        result, timings = step.timed_call(params, batch)
        save_call(saved, schedule, result, timings, step.plan(params, batch))
    # 1F1B again, each process keeping its own stage's results (on its sub-mesh).
    held = pm.pipeline_value_and_grad(loss_fn, num_stages=2, **options, gather_results=False)
    result, timings = held.timed_call(params, batch)
    save_held(saved, "held-1f1b", result, timings)
    np.savez(os.path.join(OUT, f"{MODE}-{jax.process_index()}.npz"), **saved)
    print(f"process {jax.process_index()}: done", flush=True)


if __name__ == "__main__":
    main()
