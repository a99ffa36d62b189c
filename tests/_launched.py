"""A test's script run under ``python -m pipemark.launch`` from the repository root,
in a clean environment: the parent's ``PIPEMARK_*`` variables dropped, its XLA flags
kept (:func:`tests._xla.child_environ`), the checkout first on ``PYTHONPATH``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests._xla import child_environ

ROOT = Path(__file__).resolve().parents[1]


def launched(
    script: Path, *args: str, processes: int, devices: int = 1, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``script args...`` in ``processes`` processes of ``devices`` CPU devices each;
    its output captured."""
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    command = ["-m", "pipemark.launch", "-n", str(processes), str(script), *args]
    return subprocess.run(
        [sys.executable, *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
