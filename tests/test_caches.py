"""pm.clear_caches: every registered cache emptied, and the freed heap returned."""

from __future__ import annotations

import gc
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark import examples


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, trims glibc")
def test_memory_of_dropped_pipelines_goes_back_to_the_system():
    ex = examples.mlp(num_layers=3, width=64, batch=8)

    def batch(rows):
        return jax.tree_util.tree_map(lambda a: jnp.ones((rows, *a.shape[1:]), a.dtype), ex.batch)

    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_stages=1, num_microbatches=2)
    pipe(ex.params, batch(8))
    gc.collect()
    before = _resident_mib()
    for rows in range(10, 40, 2):  # 15 input shapes: 15 plans compiled
        jax.block_until_ready(pipe(ex.params, batch(rows)))
    grown = _resident_mib() - before
    del pipe
    # JAX >= 0.12 keeps the compiled stage programs in its own caches until
    # jax.clear_caches() (0.10 frees them with the pipeline); pipemark leaves JAX's
    # caches, which serve the user's own functions too, to the user (docs/runtime.md).
    jax.clear_caches()
    pm.clear_caches()
    left = _resident_mib() - before
    assert grown > 20  # the plans really took memory (about 4 MB each here)
    assert left < 0.3 * grown, (grown, left)
