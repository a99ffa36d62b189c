"""MaxText (issue #25 item 4): its smallest decoder, with ``scan_layers`` on and off and
its remat policy, split by ``pm.split`` into 2 and 4 stages and run as a pipeline
(tests/_maxtext.py, in a subprocess with 4 host devices).

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


@pytest.mark.parametrize("layers", ["scan", "noscan"])
def test_maxtext_decoder_splits_verifies_and_pipelines(layers):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_maxtext.py"), layers],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert proc.stdout.count("stages=") == 2
