"""The README's Python examples run as written (in one process, in order, with four host
devices for the pipeline example; the quickstart sets its own two), its headings come in
order and its extras table lists every extra setup.py declares. The quickstart's printed
output is generated (docs/gen/page_outputs.py) and checked in test_docs_page_outputs.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._xla import child_environ

ROOT = Path(__file__).parents[1]


def test_readme_python_blocks_run(tmp_path):
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    env = child_environ(dict(os.environ), "--xla_force_host_platform_device_count=4")
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
    # The quickstart (the first block) verified its stages and ran its pipeline.
    assert "staged == jax.jit: True" in proc.stdout
    assert "pipelined loss" in proc.stdout


def _extras() -> set[str]:
    """The extras setup.py declares (the keys of its ``extras_require`` dict)."""
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    return {
        k.value
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg == "extras_require"
        for k in node.value.keys
    }


def test_readme_first_screen_installs_and_heads_in_order():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # not the comments in code
    levels = [len(m) for m in re.findall(r"^(#+) ", prose, flags=re.M)]
    assert levels[0] == 1 and 2 in levels
    assert 3 not in levels[: levels.index(2)], "a ### heading before the first ##"
    # The first screen: what it is, a link for each reader, the install line and a
    # quickstart that splits, verifies and runs a pipeline, its output shown.
    screen = "\n".join(text.splitlines()[:45])
    for page in ("compilers", "passes", "inspect", "training", "concepts"):
        assert f"(docs/{page}.md)" in screen, page
    assert "pip install -e ." in screen
    for call in ("pm.mark(", "pm.split(", ".verify(", "pm.pipeline_value_and_grad("):
        assert call in screen, call
    assert "pipelined loss" in screen.split("```text", 1)[1]
    extras = text[text.index("## Extras") :]
    extras = extras[: extras.index("\n## ", 1)]
    listed = set(re.findall(r"^\| `([a-z]+)` \|", extras, flags=re.M))
    assert listed == _extras(), "the extras table lists every extra of setup.py"


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


def _summary_table(html: str) -> str:
    (table,) = re.findall(r'<table class="pm-summary">.*?</table>', html, flags=re.S)
    return table


@pytest.mark.docs_assets
def test_readme_demo_output_and_docs_demo_are_what_the_demo_makes_today(tmp_path):
    # docs/gen/assets.py (make docs-assets) writes both from one demo run.
    sys.path.insert(0, str(ROOT / "docs" / "gen"))
    try:
        import assets
    finally:
        sys.path.pop(0)
    fresh = assets.demo_output(tmp_path)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert assets.readme_block(readme) == fresh, "run: make docs-assets"
    assert "staged program == unsplit program: yes" in fresh
    assert max(map(len, fresh.splitlines()[5:-2])) <= 80  # the table fits 80 columns
    # The committed report shows the same stage table as a fresh one.
    committed = (ROOT / "docs" / "demo" / "report.html").read_text(encoding="utf-8")
    made = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert _summary_table(committed) == _summary_table(made), "run: make docs-assets"
    assert (ROOT / "docs" / "demo" / "stages.png").stat().st_size > 10_000
    assert (ROOT / "docs" / "demo" / "schedules.png").stat().st_size > 10_000
