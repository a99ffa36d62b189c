"""The configurations a new user writes first (tests/runtime/_first_acts.py), in 2
processes of 2 CPU devices each: a first orbax save by a ``StandardCheckpointer`` made
before the pipeline's first call, with results kept where computed and gathered; a tied
embedding that stages of both processes read; a restored state saved again before a
step. Every loss, read in every process, within
float rounding of ``jax.jit``'s steps; resumed from each checkpoint onto the same layout,
the same bits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from tests._launched import launched
from tests.runtime import _first_acts as script

SCRIPT = Path(script.__file__)


def _jit_losses(tied: bool) -> list[float]:
    """JAX's own: jax.jit of the step, from the same state, on the same batches."""
    step, state, batches = script.model(tied)
    step = jax.jit(step)
    losses = []
    for batch in batches:
        *state, loss = step(*state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.slow
def test_first_saves_and_tied_weights_in_two_processes(tmp_path):
    # make test-newest (PIPEMARK_CASES=cover) runs the configurations of the failures:
    # results kept where computed.
    kept = ["kept"] if os.environ.get("PIPEMARK_CASES") == "cover" else []
    done = launched(SCRIPT, str(tmp_path), *kept, processes=2, devices=2)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = [json.loads((tmp_path / f"{p}.json").read_text()) for p in range(2)]
    assert seen[0] == seen[1]  # every process read every loss
    gathers = (False,) if kept else (False, True)
    assert set(seen[0]) == {f"{t}-{g}" for t in (False, True) for g in gathers}
    for name, run in seen[0].items():
        want = _jit_losses(tied=name.startswith("True"))
        # float32 AdamW over a few steps, microbatches' gradients summed in another
        # order than jit's one program: a few ulps, amplified by the steps.
        np.testing.assert_allclose(run["losses"], want, rtol=1e-5, err_msg=name)
        # Restored onto the layout it was saved from: the same programs, the same bits.
        resumed = [run[k] for k in ("resumed", "params_alone", "resaved")]
        assert resumed == [run["losses"][script.SAVE_AT :]] * 3, name
