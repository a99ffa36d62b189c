"""docs/real-models.md is what docs/gen/real_models.py makes today."""

import re

import pytest

from tests._docs import docs_generator

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("optax")


def _generator():
    return docs_generator("real_models")


@pytest.mark.slow
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
