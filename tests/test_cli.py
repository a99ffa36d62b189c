"""The command line: ``pipemark demo``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipemark import _demo
from pipemark.cli import main


def test_demo_checks_every_transformation(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "pipeline_marker[mark_type=boundary name=boundary]" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    for name in ("eager", "jit", "grad", "jit(grad)", "vmap", "vmap(grad)", "hessian"):
        assert rows[name][2] == "yes", rows[name]
    assert "boundary markers kept in make_jaxpr(grad(f)): 3 of 3" in out


def test_demo_reports_a_mismatch(monkeypatch, capsys):
    # A demo that cannot fail proves nothing: break the marked loss and watch it say so.
    original = _demo._loss

    def broken(params, x, *, marked):
        return original(params, x, marked=marked) + (1.0 if marked else 0.0)

    monkeypatch.setattr(_demo, "_loss", broken)
    assert main(["demo"]) == 1
    assert " NO " in capsys.readouterr().out


def test_python_dash_m_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "pipemark", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    assert "demo" in proc.stdout


def test_unknown_command_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
