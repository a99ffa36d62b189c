"""Smoke runs of the benchmark scripts at tiny sizes, so that they keep working.

Their numbers are not checked here (timings on a shared CI machine mean nothing); the
scripts' tables and verdicts are.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_passes_benchmark_prints_its_table_and_verdict():
    script = str(REPO / "benchmarks" / "passes.py")
    run = subprocess.run(
        [sys.executable, script, "--sizes", "300", "--repeat", "1", "--kinds", "mlp"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| model |"))
    assert "bare sweep (µs/eqn)" in header and "passes / sweep" in header
    rows = [line for line in lines if line.startswith("| mlp |")]
    assert len(rows) == 1
    assert rows[0].count("|") == header.count("|")
    equations = int(rows[0].split("|")[2].replace(",", ""))
    assert abs(equations - 300) <= 20
    assert any(line.startswith("- mlp: ratio") and "bare def-use sweep" in line for line in lines)
