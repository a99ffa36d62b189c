"""Run by tests/runtime/test_planner.py under ``python -m pipemark.launch -n N``: the
native-sleep pipeline of that test, one stage a process, each schedule's call timed
(the fastest of 5 after a first: other work on a shared machine only slows a call); process 0 writes the times as JSON.

    python -m pipemark.launch -n 2 tests/runtime/_planner_processes.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from pipemark.launch import initialize

    initialize()

    import _native_sleep as ns
    import jax

    import pipemark as pm

    example = ns.sleeping_split(num_stages=jax.process_count(), seconds=0.01, batch=8)
    seconds = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = pm.pipeline_value_and_grad(example.loss_fn, num_microbatches=4, schedule=schedule)
        jax.block_until_ready(pipe(*example.args))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(pipe(*example.args))
            times.append(time.perf_counter() - start)
        seconds[schedule] = min(times)
    if jax.process_index() == 0:
        Path(sys.argv[1]).write_text(json.dumps(seconds))
