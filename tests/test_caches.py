"""clear_caches: every registered cache emptied, and the freed heap returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# In a fresh interpreter: in the test process, heap freed by earlier tests would absorb
# the plans' memory, and the resident size would not grow to begin with.
SCRIPT = """
import gc, json, os
import jax, jax.numpy as jnp
import pipemark as pm
from pipemark.caches import clear_caches
from pipemark import examples

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

ex = examples.mlp(num_layers=3, width=64, batch=8)

def batch(rows):
    return jax.tree_util.tree_map(lambda a: jnp.ones((rows, *a.shape[1:]), a.dtype), ex.batch)

pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=2)
pipe(ex.params, batch(8))
gc.collect()
before = resident_mib()
for rows in range(10, 40, 2):  # 15 input shapes: 15 plans compiled
    jax.block_until_ready(pipe(ex.params, batch(rows)))
grown = resident_mib() - before
del pipe
# JAX >= 0.12 keeps the compiled stage programs in its own caches until
# jax.clear_caches() (0.10 frees them with the pipeline); pipemark leaves JAX's caches,
# which serve the user's own functions too, to the user (docs/memory.md).
jax.clear_caches()
clear_caches()
print(json.dumps({"grown": grown, "left": resident_mib() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, trims glibc")
def test_memory_of_dropped_pipelines_goes_back_to_the_system():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["grown"] > 20, measured  # the plans really took memory
    assert measured["left"] < 0.3 * measured["grown"], measured
