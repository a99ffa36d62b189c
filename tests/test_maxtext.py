"""MaxText (issue #25 item 4, issue #27 item 2): its smallest decoder, with
``scan_layers`` on and off and its remat policy, split by ``pm.split`` into 2 and 4
stages and run as a pipeline of 2 sub-meshes of 2 devices, with MaxText's own sharding
constraints and parameter specs: tensor parallelism (scanned layers) and data
parallelism (unscanned) inside each stage (tests/_maxtext.py, in a subprocess with 4
host devices).

Marked ``maxtext``: MaxText needs Python >= 3.12, jax >= 0.11.1 and about 220 packages,
so it runs in its own environment, ``make test-maxtext`` (.venv-maxtext), which
``.ci/run`` runs after ``make test-newest``. Elsewhere it is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("maxtext")

pytestmark = [pytest.mark.maxtext, pytest.mark.slow]

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(("layers", "parallel"), [("scan", "tensor"), ("noscan", "data")])
def test_maxtext_decoder_splits_verifies_and_pipelines_on_sub_meshes(layers, parallel):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_maxtext.py"), layers, parallel],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert proc.stdout.count("stages=") == 2
