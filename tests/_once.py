"""Run a test script in a subprocess once per test session and keep what it printed:
the multi-device checks (XLA reads ``--xla_force_host_platform_device_count`` only
when JAX starts, so they need a fresh process)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._xla import child_environ

ROOT = Path(__file__).parents[1]


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test session shared by its pytest-xdist workers: each worker
    has its own basetemp under one parent of the session; without xdist the basetemp's
    parent holds every session's, so a file kept there would outlive the session."""
    basetemp = tmp_path_factory.getbasetemp()
    return basetemp.parent if "PYTEST_XDIST_WORKER" in os.environ else basetemp


def run_script_once(
    tmp_path_factory: pytest.TempPathFactory,
    script: Path,
    name: str,
    *,
    xla_flags: str | None = None,
    timeout: float = 600,
    args: list[str] | None = None,
) -> str:
    """The standard output of ``python script *args``, run once per session (the first
    worker to ask runs it, under a file lock, and the others read its output) with this
    checkout on ``PYTHONPATH`` and ``XLA_FLAGS=xla_flags`` (none for ``None``: the
    script sets its own), with the inherited flags of tests/_xla.py. Fails the asking
    test if the script fails."""
    shared = session_dir(tmp_path_factory)
    results = shared / f"{name}.out"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results.exists():
            env = child_environ(dict(os.environ), *([] if xla_flags is None else [xla_flags]))
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
            proc = subprocess.run(
                [sys.executable, str(script), *(args or [])],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
            )
            if proc.returncode != 0:
                pytest.fail(f"{script.name} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
            results.write_text(proc.stdout)
    return results.read_text()
