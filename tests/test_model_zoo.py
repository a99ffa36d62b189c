"""Real models nobody here wrote (tests/_zoo.py: penzai Llama-like, Gemma-like and
GPT-NeoX with and without their layer stacks, flax linen ``nn.scan(nn.remat(Block))``
with an optax step, flax nnx, equinox), each cut into two stages by ``pm.split`` and
run as a two-device pipeline, against JAX's own evaluation of the model: ``jax.jit`` of
the loss, ``jax.value_and_grad`` over the whole batch (equinox: their filtered forms).

The pipelines run in one subprocess (``_zoo_pipeline.py``) with 2 host CPU devices,
because XLA reads ``--xla_force_host_platform_device_count`` only when JAX starts; it
runs once per test session, shared by pytest-xdist workers through a file lock, and
prints one JSON line per case.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import pipemark as pm
from tests import _zoo
from tests._zoo_pipeline import SCHEDULES

_SCRIPT = Path(__file__).with_name("_zoo_pipeline.py")
_ROOT = Path(__file__).parents[1]


def _build(name: str) -> _zoo.ZooModel:
    pytest.importorskip(_zoo.LIBRARIES[name])
    return _zoo.BUILDERS[name]()


@pytest.mark.parametrize("name", list(_zoo.BUILDERS))
def test_split_into_two_stages_equals_jit_and_verifies(name):
    model = _build(name)
    staged = pm.split(model.loss, model.params, *model.batch, num_stages=2)
    assert [s.name for s in staged.stages] == ["layer0", "layer1"]
    (got,) = staged(model.params, *model.batch)
    want = model.jit(model.params, *model.batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert 0.5 * np.log(_zoo.VOCAB) < float(want) < 2 * np.log(_zoo.VOCAB)  # a real loss
    staged.verify(model.loss, model.params, *model.batch)


def test_linen_optax_step_splits_with_the_update_after_the_gradients():
    pytest.importorskip("optax")
    model = _build("linen-scan-remat")
    step, state = _zoo.linen_train_step(model)
    staged = pm.split(step, model.params, state, model.batch, num_stages=2)
    assert [s.name for s in staged.stages] == [
        "layer0", "layer1", "layer1_backward", "layer0_backward", "apply_grad"
    ]  # fmt: skip
    got = staged(model.params, state, model.batch)
    want = jax.jit(step)(model.params, state, model.batch)
    assert _zoo.worst(list(got), jax.tree_util.tree_leaves(want)) < 1
    # The cut splits the scan over the blocks into one scan a stage; XLA rounds the
    # gradients accumulated over two scans differently from one (1e-9 apart here).
    staged.verify(step, model.params, state, model.batch, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory) -> dict[tuple[str, str], dict]:
    # Under pytest-xdist every worker has its own basetemp under one shared parent.
    shared = tmp_path_factory.getbasetemp().parent
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
                pytest.fail(f"the zoo pipelines failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
            results.write_text(proc.stdout)
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {(line["case"], line.get("schedule")): line for line in lines}


def _result(pipelines, case: str, schedule: str) -> dict:
    assert pipelines[("devices", None)]["count"] == 2
    result = pipelines.get((case, schedule))
    assert result is not None, f"{case} with {schedule} did not run"
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(_zoo.BUILDERS))
def test_pipeline_value_and_grad_equals_value_and_grad(pipelines, name, schedule):
    pytest.importorskip(_zoo.LIBRARIES[name])
    result = _result(pipelines, name, schedule)
    # worst = max |got - want| / (1e-6 + 1e-5 |want|) over the leaves: below 1 is rtol 1e-5.
    assert result["value_worst"] < 1, result
    assert result["grad_worst"] < 1, result
    assert result["num_grads"] > 10


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_train_step_equals_the_linen_optax_step(pipelines, schedule):
    pytest.importorskip("flax.linen")
    pytest.importorskip("optax")
    assert _result(pipelines, "linen-optax-step", schedule)["step_worst"] < 1
