"""Run by tests/runtime/test_planner.py (and ``benchmarks/planner_check.py --record-cpu``)
under ``python -m pipemark.launch -n N`` (N even, one CPU device a process): native-sleep
pipelines whose calls are timed (the fastest of 3 after a first: other work on a shared
machine only slows a call); process 0 writes the times as JSON.

* ``"pp"``: one stage a process, 1F1B and ZB-H1;
* ``"pp-dp"``: 2 stages on a ``("stage", "data")`` mesh of 2 × N/2, each stage's
  sub-mesh spanning N/2 processes (data-parallel replicas whose gradients are reduced
  once a call, across processes), 1F1B and ZB-H1;
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


def dp_mesh(devices):
    """2 stages × ``len(devices) / 2`` data-parallel replicas, a stage's replicas on
    consecutive devices."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(devices).reshape(2, -1), ("stage", "data"))


class _Rows:
    """Stands for a mesh in :func:`all_reduce_seconds`: its rows of devices."""

    def __init__(self, devices):
        self.devices = devices


def all_reduce_seconds(mesh, width: int) -> float:
    """The runtime's one reduction of a stage's gradient replicas (``width × width``
    float32, a sum over the replica axis into one replicated array, as
    :func:`pipemark.runtime.sharding.compile_stage` reduces them), timed alone on each
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
    example = ns.sleeping_split(num_stages=jax.process_count(), seconds=SECONDS, batch=8)
    for schedule in ("1f1b", "zb-h1"):
        pipe = pm.pipeline_value_and_grad(example.loss_fn, num_microbatches=4, schedule=schedule)
        seconds["pp"][schedule] = fastest(pipe, *example.args)
    mesh = dp_mesh(devices)
    cases = [("pp-dp", NARROW, ("1f1b", "zb-h1")), ("reduce", WIDE, ("1f1b",))]
    for case, width, schedules in cases if full else cases[:1]:
        example = ns.sleeping_split(num_stages=2, seconds=SECONDS, batch=8, width=width)
        for schedule in schedules:
            pipe = pm.pipeline_value_and_grad(
                example.loss_fn, num_microbatches=4, schedule=schedule, mesh=mesh
            )
            seconds[case][schedule] = fastest(pipe, *example.args)
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
