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

import json
from pathlib import Path

import numpy as np
import pytest

from tests import _zoo
from tests._once import run_script_once
from tests._zoo_checks import SCHEDULES, STEP

_SCRIPT = Path(__file__).with_name("_zoo_checks.py")


def _check_of(item: pytest.Item) -> str | None:
    """The ``CASE:CHECK`` of ``_zoo_checks.py`` whose result a test of this module
    reads; None for one that reads none."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    case = params.get("name", STEP)
    check = params.get("schedule", "split")
    if item.originalname in _READS_A_CHECK:
        return f"{case}:{check}"
    return None


@pytest.fixture(scope="session")
def zoo(request, tmp_path_factory) -> dict[tuple[str, str | None], dict]:
    # Only the checks that the session's tests read: PIPEMARK_CASES=cover (conftest.py)
    # deselects some of the cases, whose checks would cost CI time for nothing. Every
    # pytest-xdist worker collects the same tests, so the first to ask asks for these.
    mine = [i for i in request.session.items if i.path == Path(__file__)]
    checks = sorted({c for c in map(_check_of, mine) if c is not None})
    out = run_script_once(tmp_path_factory, _SCRIPT, "pipemark-model-zoo", args=checks)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {(line["case"], line.get("check")): line for line in lines}


def _result(zoo, case: str, check: str) -> dict:
    assert zoo[("devices", None)]["count"] == 2
    result = zoo.get((case, check))
    assert result is not None, f"{case}: {check} did not run"
    assert "error" not in result, result["error"]
    return result


@pytest.mark.slow(first=True)
def test_the_zoo_runs_first_on_one_worker(zoo):
    # Runs at the very start (conftest.py): one worker runs the zoo's
    # checks (about two minutes) while the other runs other tests, and the tests below,
    # collected later, find the results there instead of a worker waiting for them.
    assert zoo[("devices", None)]["count"] == 2


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


_READS_A_CHECK = {
    test.__name__
    for test in (
        test_split_into_two_stages_equals_jax_and_verifies,
        test_pipeline_value_and_grad_equals_value_and_grad,
        test_linen_optax_step_splits_with_the_update_after_the_gradients,
        test_pipeline_train_step_equals_the_linen_optax_step,
    )
}
