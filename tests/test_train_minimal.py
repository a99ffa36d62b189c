"""examples/train_minimal.py, the shortest training script, run as a user runs it: in
one process (it gives itself a CPU device per stage) and under ``python -m
pipemark.launch -n 2``; its losses are ``jax.jit``'s of the same step on the same
batches, to float rounding."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("optax")

from tests._xla import child_environ

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_minimal.py"


def _example():
    """examples/train_minimal.py as a module (its training runs only as a script)."""
    spec = importlib.util.spec_from_file_location("train_minimal", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(processes: int = 1) -> list[float]:
    """The losses the script prints, run alone or under the launcher (one CPU device a
    process)."""
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    command = [str(SCRIPT)]
    if processes > 1:
        env["JAX_NUM_CPU_DEVICES"] = "1"
        command = ["-m", "pipemark.launch", "-n", str(processes), *command]
    done = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [float(x) for x in re.findall(r"^step \d+: loss (\S+)$", done.stdout, re.M)]


def _jit_losses() -> list[float]:
    """JAX's own: ``jax.jit`` of the script's step from its initial state on its
    batches."""
    example = _example()
    params = example.init_params(jax.random.key(0))
    state, step, losses = (params, example.tx.init(params)), jax.jit(example.step), []
    for k in range(example.STEPS):
        *state, loss = step(*state, example.batch_at(k))
        losses.append(float(loss))
    return losses


def _assert_close(got: list[float], want: list[float]) -> None:
    # The pipeline adds the microbatches' gradients in another order than jit's one
    # program (a few float32 ulps, amplified by Adam's steps); the script prints 6
    # decimals.
    assert len(got) == len(want) == _example().STEPS
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_one_process_trains_as_jax_jit_does():
    losses = _run()
    _assert_close(losses, _jit_losses())
    assert min(losses[-5:]) < losses[0] / 2  # it learns


@pytest.mark.slow
def test_two_processes_under_the_launcher():
    _assert_close(_run(processes=2), _jit_losses())


def test_the_script_is_short():
    code = [line for line in SCRIPT.read_text().splitlines() if line.strip()]
    assert len(code) <= 45
