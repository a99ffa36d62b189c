"""``make test-tpu``'s runner (tests/_accelerator.py), checked on the CPU: it runs by hand
on a machine lent for minutes, so a stale list or a broken runner must fail here first."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests import _accelerator

ROOT = Path(__file__).parents[1]


def test_the_list_names_test_files_once_and_none_that_needs_processes():
    assert len(set(_accelerator.TESTS)) == len(_accelerator.TESTS)
    for name in _accelerator.TESTS:
        path = ROOT / name
        assert path.is_file() and path.name.startswith("test_"), name
        text = path.read_text(encoding="utf-8")
        # Sockets are refused on the TPU machine, and one program holds the chip.
        assert "subprocess" not in text and "jax.distributed" not in text, name


def test_the_runner_writes_junit_and_the_log(tmp_path):
    chosen = "tests/test_roles.py::test_a_role_is_immutable_and_checked"
    done = subprocess.run(
        [sys.executable, "tests/_accelerator.py", "--out", str(tmp_path), "--tests", chosen],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("1", "0", "0")
    log = (tmp_path / "pytest.log").read_text(encoding="utf-8")
    assert "-p no:xdist" in done.stdout and "1 passed" in log
    assert log in done.stdout  # shown as it ran, and kept
