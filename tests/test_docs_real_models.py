"""docs/real-models.md is what docs/gen/real_models.py makes today."""

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("optax")

GENERATOR = Path(__file__).resolve().parent.parent / "docs" / "gen" / "real_models.py"


def _generator():
    spec = importlib.util.spec_from_file_location("real_models", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_models_page_is_up_to_date():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    made_with = re.search(r"^Made with (.*)\.$", page, re.MULTILINE)
    assert made_with, "the page says which versions made it"
    fresh = gen.render()  # runs every example, each ending in staged.verify(...)
    if made_with.group(1) != gen.versions():
        # Equation counts change with JAX and flax versions: compare on the versions
        # that made the page only.
        pytest.skip(f"page made with {made_with.group(1)}, installed: {gen.versions()}")
    assert fresh == page, "run: python docs/gen/real_models.py"
