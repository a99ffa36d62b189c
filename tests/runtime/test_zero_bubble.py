"""The runtime runs zero-bubble schedules (ZB-H1, ZB-V): their gradients equal 1F1B's
(to float rounding: B and W compile as separate XLA programs) and jax.value_and_grad's
(a subprocess with 4 host devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("_zero_bubble.py")
ROOT = Path(__file__).parents[2]


def test_zero_bubble_pipelines_equal_1f1b():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for model in ("mlp", "lm"):
        for schedule in ("1f1b", "zb-h1", "zb-v"):
            assert f"{model} {schedule}: ok" in lines
