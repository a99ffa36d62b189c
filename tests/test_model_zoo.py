"""Real models nobody here wrote (tests/_zoo.py: penzai Llama-like, Gemma-like and
GPT-NeoX with and without their layer stacks, flax linen ``nn.scan(nn.remat(Block))``
with an optax step, flax nnx, equinox), each cut into two stages by ``pm.split`` and
run as a two-device pipeline with the 1F1B and ZB-H1 schedules, against JAX's own
evaluation of the model: jitted ``jax.value_and_grad`` over the whole batch (equinox:
its filtered form), ``jax.jit`` of the optax step.

The checks run in one subprocess (``_zoo_checks.py``) with 2 host CPU devices, because
XLA reads ``--xla_force_host_platform_device_count`` only when JAX starts; it runs once
per test session, shared by pytest-xdist workers through a file lock, and prints one
JSON line per check, which each test here reads.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import _zoo
from tests._zoo_checks import SCHEDULES, STEP

_SCRIPT = Path(__file__).with_name("_zoo_checks.py")
_ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> dict[tuple[str, str], dict]:
    # Under pytest-xdist every worker has its own basetemp under one parent shared by
    # this session only; without it, the basetemp's parent holds every session's.
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    results = shared / "pipemark-model-zoo.json"
    with open(shared / "pipemark-model-zoo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results.exists():
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
            proc = subprocess.run(
                [sys.executable, str(_SCRIPT)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                cwd=_ROOT,
            )
            if proc.returncode != 0:
                pytest.fail(f"the zoo run failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
            results.write_text(proc.stdout)
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(line["case"], line.get("check")): line for line in lines}


def _result(zoo, case: str, check: str) -> dict:
    assert zoo[("devices", None)]["count"] == 2
    result = zoo.get((case, check))
    assert result is not None, f"{case}: {check} did not run"
    assert "error" not in result, result["error"]
    return result


# worst = max |got - want| / (1e-6 + 1e-5 |want|) over the leaves: below 1 is rtol 1e-5.


@pytest.mark.parametrize("name", list(_zoo.BUILDERS))
def test_split_into_two_stages_equals_jax_and_verifies(zoo, name):
    pytest.importorskip(_zoo.LIBRARIES[name])
    result = _result(zoo, name, "split")
    assert result["stages"] == ["layer0", "layer1"]
    assert result["value_worst"] < 1, result
    # Small random weights: a next-token loss of the order of log(VOCAB), so the checks
    # compare a real loss, not a constant.
    assert 0.5 * np.log(_zoo.VOCAB) < result["value"] < 2 * np.log(_zoo.VOCAB), result


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(_zoo.BUILDERS))
def test_pipeline_value_and_grad_equals_value_and_grad(zoo, name, schedule):
    pytest.importorskip(_zoo.LIBRARIES[name])
    result = _result(zoo, name, schedule)
    assert result["value_worst"] < 1, result
    assert result["grad_worst"] < 1, result
    assert result["num_grads"] > 10


def test_linen_optax_step_splits_with_the_update_after_the_gradients(zoo):
    pytest.importorskip("flax.linen")
    pytest.importorskip("optax")
    result = _result(zoo, STEP, "split")
    assert result["stages"] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward", "apply_grad"
    ]  # fmt: skip
    assert result["step_worst"] < 1, result


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_train_step_equals_the_linen_optax_step(zoo, schedule):
    pytest.importorskip("flax.linen")
    pytest.importorskip("optax")
    assert _result(zoo, STEP, schedule)["step_worst"] < 1
