"""The docs site: the API reference covers every public name, and the pages it is made of
(docstrings, the tutorial notebook) render as documentation, not as raw text.

The site is built once here (``mkdocs build --strict``, a few seconds); the names are
read from its ``objects.inv``, the inventory mkdocstrings writes of every object it
documented, so a name counts only if the reference really shows it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
import zlib
from pathlib import Path

import pytest

import pipemark
from tests._docs import build_site

pytest.importorskip("mkdocs")
pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parent.parent
EXTENSION = ROOT / "docs" / "hooks" / "griffe_docstrings.py"
# The modules whose public names the reference must cover (besides pipemark itself).
PUBLIC_MODULES = (
    "pipemark.passes",
    "pipemark.runtime",
    "pipemark.planner",
    "pipemark.views",
    "pipemark.lowering",
    "pipemark.plot",
    "pipemark.errors",
)
INVENTORY_LINE = re.compile(r"(.+?)\s+(\S+:\S+)\s+(-?\d+)\s+(\S*)\s+(.*)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))


def _inventory(site_dir: Path) -> list[str]:
    """The object names in a Sphinx inventory (version 2: four header lines, then
    zlib-compressed lines ``name domain:role priority uri display-name``)."""
    raw = (site_dir / "objects.inv").read_bytes().split(b"\n", 4)
    body = zlib.decompress(raw[4]).decode("utf-8")
    return [m.group(1) for m in map(INVENTORY_LINE.match, body.splitlines()) if m]


def _resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes
    (``pipemark.lowering`` is the module here, not the function the package exports)."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            value = getattr(value, part)
        return value
    raise ImportError(path)


def _public_names() -> dict[str, object]:
    """Every public name, as ``module.name`` -> object: ``__all__`` where a module has
    one, else what it re-exports (``from .slice import slice_stages as slice_stages``)."""
    names = {f"pipemark.{name}": getattr(pipemark, name) for name in pipemark.__all__}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, type(sys))
        ]
        names.update({f"{module_name}.{name}": getattr(module, name) for name in exported})
    return names


def test_api_reference_documents_every_public_name(site):
    documented: dict[str, list[object]] = {}
    for path in _inventory(site):
        if path.startswith("pipemark"):
            # Some names only the documentation knows (a dataclass field): skip them.
            with contextlib.suppress(ImportError, AttributeError):
                documented.setdefault(path.rsplit(".", 1)[-1], []).append(_resolve(path))
    # A public name is covered when an entry of the same name is the same object
    # (re-exports are documented once, under one of their names).
    missing = [
        public
        for public, value in _public_names().items()
        if not any(value is entry for entry in documented.get(public.rsplit(".", 1)[-1], []))
    ]
    assert not missing, f"not in docs/api.md: {missing}"


def test_api_reference_renders_docstrings_as_markdown(site):
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    outside_code = re.sub(r"<pre\b.*?</pre>", "", page, flags=re.S)
    # Doctest prompts are code, not nested Markdown blockquotes.
    assert "<blockquote" not in page
    assert "&gt;&gt;&gt;" not in outside_code and "&gt;&gt;&gt;" in page
    # Sphinx roles became (linked) code; section headings did not leak into the text.
    assert not re.search(r":(func|class|meth|mod|data|attr):`", page)
    assert 'class="autorefs autorefs-internal"' in page
    assert not re.search(r"^-{4,}$", outside_code, flags=re.M)


def test_tutorial_is_a_page_with_its_outputs(site):
    page = (site / "tutorial" / "index.html").read_text(encoding="utf-8")
    assert '"cell_type"' not in page  # rendered, not the notebook's JSON
    assert 'class="pipemark-view"' in page  # the stage views the notebook displayed
    assert 'src="data:image/png;base64,' in page  # the figure, inside the page
    assert "all within rounding of jax.jit" in page
    assert (site / "tutorial" / "tutorial.ipynb").is_file()  # the download link's target
    index = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="tutorial/"' in index  # links to tutorial.ipynb lead to the page


# ----------------------------------------------------------------- the Griffe extension


def _extension():
    spec = importlib.util.spec_from_file_location("griffe_docstrings", EXTENSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctest_after_list_section_starts_examples():
    text = "Summary.\n\nParameters\n----------\nx:\n    A value.\n\n>>> f(1)\n2"
    assert (
        _extension()
        .normalise_docstring(text)
        .endswith("    A value.\n\nExamples\n--------\n>>> f(1)\n2")
    )


def test_prose_after_list_section_starts_notes():
    text = "Summary.\n\nRaises\n------\nPipemarkError\n    Why.\n\nEach edge carries bytes: yes."
    assert "\n\nNotes\n-----\nEach edge carries bytes: yes." in (
        _extension().normalise_docstring(text)
    )


def test_doctest_in_prose_is_fenced_and_examples_are_left_alone():
    extension = _extension()
    text = "Module.\n\n>>> 1 + 1\n2\n\nMore."
    assert extension.normalise_docstring(text) == "Module.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nMore."
    examples = "Summary.\n\nExamples\n--------\n>>> 1 + 1\n2"
    assert extension.normalise_docstring(examples) == examples


def test_rst_table_is_kept_as_text_and_literal_marker_dropped():
    text = "A table:\n\n===  ===\na    b\n===  ===\n1    2\n===  ===\n\nBefore::\n\n    code"
    assert _extension().normalise_docstring(text) == (
        "A table:\n\n```text\n===  ===\na    b\n===  ===\n1    2\n===  ===\n```\n\n"
        "Before:\n\n    code"
    )
