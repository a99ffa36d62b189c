"""The differential fuzzer through the runtime (#24 item 3): random programs of
:mod:`tests._programs` run by ``pm.pipeline_value_and_grad`` with each schedule, their
loss and gradients compared with ``jax.value_and_grad`` of the original loss. The
programs run in one subprocess with 4 host CPU devices (``_differential.py``), once per
test session; each schedule is its own test here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests._once import run_script_once
from tests.runtime._differential import EXAMPLES

_SCRIPT = Path(__file__).with_name("_differential.py")


@pytest.fixture(scope="session")
def fuzzed(tmp_path_factory) -> dict[str, dict]:
    profile = os.environ.get("PIPEMARK_FUZZ", "ci")
    out = run_script_once(
        tmp_path_factory,
        _SCRIPT,
        f"pipemark-runtime-differential-{profile}",
        timeout=600 if profile == "ci" else 6000,
    )
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {line["schedule"]: line for line in lines}


@pytest.mark.slow(first=True)
def test_the_programs_run_first_on_one_worker(fuzzed):
    # Runs at the very start (conftest.py): one worker runs the fuzzed
    # programs while the other runs other tests; the tests below find the results.
    assert sorted(fuzzed) == sorted(EXAMPLES)


@pytest.mark.parametrize("schedule", sorted(EXAMPLES))
def test_schedule_matches_jax(fuzzed, schedule):
    line = fuzzed[schedule]
    assert line["error"] is None, line["error"]
    # Rejected examples (fewer equations than stages) do not count; most must run.
    assert line["examples"] >= EXAMPLES[schedule] // 2, line
