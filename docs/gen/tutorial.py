"""Run docs/tutorial.ipynb and store it with its outputs, or check the stored outputs.

    python docs/gen/tutorial.py          # execute the notebook, write it back with outputs
    python docs/gen/tutorial.py --check  # exit 1 if a fresh run gives other outputs

The site shows the stored outputs (docs/hooks/notebook_page.py renders them), so they
must be what the code prints today; tests/test_tutorial.py runs the same comparison.
The notebook runs in the `python3` kernel (ipykernel, a test extra) on the CPU, so a
machine with a GPU stores the same numbers. Needs the test and viz extras.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "tutorial.ipynb"
# The outputs (equation counts, FLOPs, jaxprs, printed arrays) depend on these.
PACKAGES = ("jax", "jaxlib", "numpy")
TIMEOUT_S = 300

# Parts of a text output that change from run to run or machine to machine while the
# output means the same: object addresses, timings, temporary directories.
VOLATILE = [
    (re.compile(r"\b0x[0-9a-fA-F]{4,}\b"), "0x…"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|µs|us|ms)\b|\b\d+\.\d+\s?s\b"), "<time>"),
    (re.compile(r"(?:/tmp|/var/folders/[\w/]+)/tmp\w+"), "<tmpdir>"),
]
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")


def versions() -> str:
    """The versions that made the stored outputs; the check compares like with like."""
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in PACKAGES)


def stored_versions(notebook: nbformat.NotebookNode) -> str | None:
    return notebook.metadata.get("pipemark", {}).get("made_with")


def execute(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``notebook`` run top to bottom in a fresh kernel, cleaned for storing.

    Raises nbclient's CellExecutionError, naming the cell, if a cell fails.
    """
    fresh = copy.deepcopy(notebook)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # JAX on the CPU everywhere: the printed numbers must not depend on the machine.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as workdir:
        client = NotebookClient(
            fresh,
            timeout=TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": workdir}},
        )
        client.execute(env=env)
    fresh.metadata.setdefault("pipemark", {})["made_with"] = versions()
    return clean(fresh)


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop what changes on every run without meaning anything (execution timestamps,
    the Python patch version), so that rerunning the notebook gives a small diff."""
    notebook.metadata.get("language_info", {}).pop("version", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
    return notebook


def normalise(text: str) -> str:
    """``text`` with its volatile parts (see VOLATILE) replaced by placeholders."""
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def _comparable_outputs(outputs: list[Any]) -> list[tuple[str, str]]:
    """Each output as (kind, text): streams merged per name (a print may arrive in
    several chunks), text normalised, images by their type only."""
    result: list[tuple[str, str]] = []
    for output in outputs:
        kind = output.output_type
        if kind == "stream":
            if result and result[-1][0] == f"stream:{output.name}":
                result[-1] = (result[-1][0], result[-1][1] + output.text)
            else:
                result.append((f"stream:{output.name}", output.text))
        elif kind == "error":
            result.append(("error", f"{output.ename}: {output.evalue}"))
        else:  # execute_result, display_data
            for mime, data in sorted(output.get("data", {}).items()):
                shown = f"<{mime}>" if mime in IMAGE_TYPES else data
                result.append((f"{kind}:{mime}", shown if isinstance(shown, str) else repr(data)))
    return [(kind, normalise(text)) for kind, text in result]


def comparable(notebook: nbformat.NotebookNode) -> list[tuple[str, list[tuple[str, str]]]]:
    """What the check compares: each code cell's source with its outputs (execution
    counts and metadata left out)."""
    return [
        (cell.source, _comparable_outputs(cell.get("outputs", [])))
        for cell in notebook.cells
        if cell.cell_type == "code"
    ]


def _diff(label: str, stored: str, fresh: str, max_lines: int = 24) -> str:
    """A short unified diff; HTML (one long line) is compared a tag a line."""
    if label.endswith("text/html"):
        stored, fresh = stored.replace("><", ">\n<"), fresh.replace("><", ">\n<")
    lines = difflib.unified_diff(
        stored.splitlines(), fresh.splitlines(), "stored", "fresh", lineterm="", n=1
    )
    shown = [line if len(line) <= 200 else line[:200] + " …" for line in lines]
    if len(shown) > max_lines:
        shown = [*shown[:max_lines], f"… {len(shown) - max_lines} more diff lines"]
    return f"{label}:\n" + "\n".join(shown)


def differences(stored: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """How the stored notebook differs from a fresh run, one message per code cell
    (empty when they agree)."""
    old, new = comparable(stored), comparable(fresh)
    if [source for source, _ in old] != [source for source, _ in new]:
        return ["the code cells differ (the fresh run is not of this notebook)"]
    messages = []
    for number, ((source, before), (_, after)) in enumerate(zip(old, new), start=1):
        if before == after:
            continue
        first_line = source.strip().splitlines()[0] if source.strip() else "(empty)"
        label = f"code cell {number} ({first_line!r})"
        kinds_before, kinds_after = [k for k, _ in before], [k for k, _ in after]
        if kinds_before != kinds_after:
            messages.append(f"{label}: outputs {kinds_before} stored, {kinds_after} fresh")
            continue
        for (kind, text_before), (_, text_after) in zip(before, after):
            if text_before != text_after:
                messages.append(_diff(f"{label}, {kind}", text_before, text_after))
    return messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the outputs are stale")
    args = parser.parse_args(argv)
    stored = nbformat.read(NOTEBOOK, as_version=4)
    fresh = execute(stored)
    if not args.check:
        nbformat.write(fresh, NOTEBOOK)
        print(f"wrote {NOTEBOOK} ({versions()})")
        return 0
    found = differences(stored, fresh)
    if not found:
        return 0
    print(f"{NOTEBOOK} is out of date: run python docs/gen/tutorial.py", file=sys.stderr)
    print("\n\n".join(found), file=sys.stderr)
    if stored_versions(stored) != versions():
        print(
            f"(stored outputs made with {stored_versions(stored)}; installed: {versions()})",
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
