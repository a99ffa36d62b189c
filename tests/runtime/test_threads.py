"""Tests of the threaded dispatch of pipemark.runtime.execution (one worker thread per device).

The checks run in one subprocess with 4 host CPU devices (``_threads.py``), as the
multi-device equivalence cases do; each printed line is then asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).with_name("_threads.py")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(f"the threaded run failed:\n{proc.stdout}\n{proc.stderr}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {line["case"]: line for line in lines}


IDENTICAL = [
    "mlp-S4-M8-1f1b",
    "mlp-S4-M8-gpipe",
    "transformer-S2-M4-1f1b",
    "resnet_skip-S4-M4-1f1b",
    "mlp-S4-M4-interleaved",
]


@pytest.mark.parametrize("name", IDENTICAL)
def test_threaded_results_are_bit_identical_to_one_thread(results, name):
    result = results[f"identical/{name}"]
    assert result["devices"] == (
        2 if name.endswith("interleaved") else int(name[name.index("-S") + 2])
    )
    assert result["leaves"] > 2
    assert result["identical"]


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_worker_error_reaches_the_caller_without_hanging(results, stage, which):
    result = results[f"error/{which}-stage{stage}"]
    assert result["hung"] is False
    assert result["error"] == f"RuntimeError: stage {stage} failed on purpose"
    assert result["threads_left"] == []  # every worker stopped
    assert result["works_again"]


@pytest.mark.parametrize("stage", [0, 1])
def test_an_error_inside_a_running_program_reaches_the_caller(results, stage):
    result = results[f"program-error/stage{stage}"]
    assert result["hung"] is False
    assert f"stage {stage} callback failed on purpose" in result["error"]
    assert result["threads_left"] == []
    assert result["works_again"]


def test_values_are_freed_after_their_last_reader(results):
    for schedule in ("gpipe", "1f1b"):
        for mode in ("threaded", "serial"):
            assert results[f"freed/{schedule}-{mode}"]["left"] == 0
    # Serially, GPipe holds every forward's outputs for all 8 microbatches before the
    # first backward; 1F1B frees them as it goes.
    assert results["freed/1f1b-serial"]["peak"] < results["freed/gpipe-serial"]["peak"]
    assert results["freed/gpipe-serial"]["peak"] >= 8


def test_devices_overlap(results):
    assert results["devices"]["count"] == 4
    result = results["overlap"]
    # 4 stages, 4 microbatches, GPipe, 20 ms per action: ideal 280 ms, serial 640 ms;
    # measured about 296 ms threaded and 410 ms from one thread.
    # The bounds leave room for a loaded CI machine (the other test worker runs at the
    # same time): what they prove is overlap, which one device after another cannot
    # give. The benchmark (benchmarks/runtime.py) measures how close to ideal it gets.
    assert result["threaded_s"] >= 0.95 * result["ideal_s"]
    assert result["threaded_s"] < 0.75 * result["serial_s"], result
    assert result["threaded_s"] < result["single_thread_s"], result
