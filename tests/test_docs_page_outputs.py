"""The output shown on docs pages is what the code above it prints today
(docs/gen/page_outputs.py; `make docs-assets` rewrites it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "docs" / "gen"))
try:
    import page_outputs
finally:
    sys.path.pop(0)


def test_the_marked_pages_exist():
    names = {p.name for p in page_outputs.pages()}
    assert {"howto-split.md", "inspect.md", "README.md"} <= names


@pytest.mark.docs_assets
@pytest.mark.slow
def test_page_outputs_are_up_to_date():
    for page in page_outputs.pages():
        text = page.read_text(encoding="utf-8")
        assert page_outputs.render(text, page.stem) == text, (
            f"{page.name} is stale: run make docs-assets"
        )


def test_a_changed_output_is_found_stale():
    page = ROOT / "docs" / "howto-split.md"
    text = page.read_text(encoding="utf-8")
    edited = text.replace("   total  ", "   TOTAL  ", 1)
    assert edited != text and page_outputs.render(edited, page.stem) == text
