"""Run by tests/runtime/test_planner.py (and ``benchmarks/planner_check.py --record-cpu``)
under ``python -m pipemark.launch -n N`` (N even, one CPU device a process): native-sleep
pipelines whose calls are timed (the fastest of 3 after a first: other work on a shared
machine only slows a call; each call from a barrier to the slowest process's results);
process 0 writes the times as JSON. Every pipeline keeps its results where they were
computed (``gather_results=False``), as a training step does, which the planner
predicts: no stage's gradients cross to another process after its last action.

* ``"pp"``: N stages, one a process, 1F1B and ZB-H1;
* ``"pp-dp"``: N/2 stages on a ``("stage", "data")`` mesh of N/2 × 2, each stage's
  sub-mesh spanning 2 processes (data-parallel replicas whose gradients are reduced
  once a call, across processes), 1F1B and ZB-H1; with N = 2, one stage over both;
* ``"reduce"``: the same with stages of :data:`WIDE` (their gradients, 4 MB a stage,
  take milliseconds to reduce), 1F1B;
* ``"collectives"``: the runtime's reduction of one wide stage's gradient replicas
  timed alone (:func:`all_reduce_seconds`), and of a 4 × 4 one: the latency of one
  collective between two processes (``"latency"``) and between all
  (``"latency_all"``): what a transfer between stages pays beyond its bytes (a
  collective over the sender's and the receiver's devices).

    python -m pipemark.launch -n 4 tests/runtime/_planner_processes.py OUT.json [--check]

``--check`` (the test's) runs only what the test asserts: ``"pp"``, ``"pp-dp"`` and
the latencies.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

#: Sleep of each of F, B and W; the width of the narrow and the wide stages.
SECONDS, NARROW, WIDE = 0.01, 32, 1024


def fastest(fn, *args, calls: int = 3) -> float:
    """The fastest of ``calls`` timed calls of ``fn(*args)`` after a first."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def fastest_step(fn, *args, calls: int = 3) -> float:
    """The fastest of ``calls`` calls of ``fn(*args)`` after a first, each timed in
    every process from a barrier to its results and taken as the slowest process's.
    With results kept where computed a process returns once its own are ready: the
    first stage's process after the last backward, the last stage's well before, and
    this one would start its next call early and wait there for the first stage."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    jax.block_until_ready(fn(*args))
    times = []
    for call in range(calls):
        multihost_utils.sync_global_devices(f"planner call {call}")
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    every = multihost_utils.process_allgather(np.array(times))
    return float(np.asarray(every).reshape(-1, calls).max(axis=0).min())


def dp_mesh(devices):
    """``len(devices) / 2`` stages × 2 data-parallel replicas, a stage's replicas on
    consecutive devices."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices).reshape(-1, 2), ("stage", "data"))


class _Rows:
    """Stands for a mesh in :func:`all_reduce_seconds`: its rows of devices."""

    def __init__(self, devices):
        self.devices = devices


def all_reduce_seconds(mesh, width: int) -> float:
    """The runtime's one reduction of a stage's gradient replicas (``width × width``
    float32, a sum over the replica axis into one replicated array, as
    :func:`pipemark.runtime.devices.sharding.compile_stage` reduces them), timed alone on each
    row of ``mesh``; the slower. Every process dispatches each; each runs its part."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    times = []
    for row in mesh.devices:
        sub = Mesh(row, ("data",))
        replicas = len(row)
        per_replica = NamedSharding(sub, P("data"))
        make = functools.partial(jnp.ones, (replicas, width, width), jnp.float32)
        value = jax.jit(make, out_shardings=per_replica)()
        reduce = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(sub, P()))
        # The fastest of 20: on the shared 2-core machine the fastest of 3 calls of a
        # few-byte collective between two processes ranged from 0.26 ms to 4.3 ms.
        times.append(fastest(reduce, value, calls=20))
    return max(times)


def main(out: str, full: bool) -> None:
    import _native_sleep as ns
    import jax

    import pipemark as pm

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    seconds: dict[str, dict[str, float]] = {"pp": {}, "pp-dp": {}, "reduce": {}}
    # Results kept where computed, as pipeline_train_step needs on stages that span
    # processes, and as the planner predicts a step.
    options = {"num_microbatches": 4, "gather_results": False}
    example = ns.sleeping_split(num_stages=jax.process_count(), seconds=SECONDS, batch=8)
    for schedule in ("1f1b", "zb-h1"):
        pipe = pm.pipeline_value_and_grad(example.loss_fn, schedule=schedule, **options)
        seconds["pp"][schedule] = fastest_step(pipe, *example.args)
    mesh = dp_mesh(devices)
    cases = [("pp-dp", NARROW, ("1f1b", "zb-h1")), ("reduce", WIDE, ("1f1b",))]
    for case, width, schedules in cases if full else cases[:1]:
        stages = mesh.devices.shape[0]
        example = ns.sleeping_split(num_stages=stages, seconds=SECONDS, batch=8, width=width)
        for schedule in schedules:
            pipe = pm.pipeline_value_and_grad(
                example.loss_fn, schedule=schedule, mesh=mesh, **options
            )
            seconds[case][schedule] = fastest_step(pipe, *example.args)
    # A wide stage's reduction, and a collective of a few bytes: what a transfer
    # between processes costs beyond its bytes.
    # A transfer between two stages of sub-meshes is a collective over both.
    every = dp_mesh(devices).devices.reshape(1, -1)
    seconds["collectives"] = {
        "all_reduce": all_reduce_seconds(mesh, WIDE),
        "latency": all_reduce_seconds(mesh, 4),
        "latency_all": all_reduce_seconds(_Rows(every), 4),
    }
    if jax.process_index() == 0:
        Path(out).write_text(json.dumps(seconds))


if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    from pipemark.launch import initialize

    initialize()
    main(sys.argv[1], full="--check" not in sys.argv[2:])
