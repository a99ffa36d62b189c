"""What the docs tests share: loading a docs/gen script as a module, and building the
site into a folder."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def docs_generator(name: str) -> ModuleType:
    """``docs/gen/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"docs_gen_{name}", ROOT / "docs/gen" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_site(site_dir: Path) -> Path:
    """``mkdocs build --strict`` into ``site_dir``; fails the test on any warning."""
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", site_dir]
    result = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return site_dir
