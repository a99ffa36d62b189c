"""The README's Python examples run as written (in one process, in order, with four host
devices for the pipeline example)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_readme_python_blocks_run(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer2" in proc.stdout  # print(staged) showed the stage table


def test_readme_inspect_command_runs_as_written():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (command,) = re.findall(r"`cd (docs/gen) && pipemark (inspect [^`]*)`", text)
    folder, rest = command
    proc = subprocess.run(
        [sys.executable, "-m", "pipemark", *rest.split()],
        cwd=ROOT / folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layer3_backward" in proc.stdout
