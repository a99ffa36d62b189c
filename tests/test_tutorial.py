"""docs/tutorial.ipynb executes top to bottom (nbclient, the venv's python3 kernel) and its
stored outputs, which the docs site shows, are what it prints today.

Execution and comparison are docs/gen/tutorial.py's, the script that stores the outputs
(``python docs/gen/tutorial.py``), so the test and the script cannot disagree.
"""

from __future__ import annotations

import pytest

from tests._docs import docs_generator

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _generator():
    return docs_generator("tutorial")


@pytest.mark.slow
def test_tutorial_executes_and_its_stored_outputs_are_current():
    # One test, so that the notebook runs once even when pytest-xdist spreads tests.
    gen = _generator()
    stored = nbformat.read(gen.NOTEBOOK, as_version=4)
    fresh = gen.execute(stored)  # raises CellExecutionError naming the failing cell
    outputs = [o for cell in fresh.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    # pm.show(cj) and a StagedJaxpr left at the end of a cell both show the HTML view.
    assert len(html) == 2 and all(h.startswith('<div class="pipemark-view">') for h in html)
    assert any("image/png" in o.get("data", {}) for o in outputs)  # pm.plot's figure
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "layer2_backward" in text and "all within rounding of jax.jit's" in text

    differences = gen.differences(stored, fresh)
    made_with = gen.stored_versions(stored)
    if differences and made_with != gen.versions():
        # Equation counts and jaxprs change with JAX: compare on the versions that made
        # the outputs only (as tests/test_docs_real_models.py does for its page).
        pytest.skip(f"outputs made with {made_with}, installed: {gen.versions()}")
    assert not differences, "run: python docs/gen/tutorial.py\n\n" + "\n\n".join(differences)


def test_check_notices_a_changed_output():
    gen = _generator()
    stored = nbformat.read(gen.NOTEBOOK, as_version=4)
    assert any(cell.get("outputs") for cell in stored.cells), "run: python docs/gen/tutorial.py"
    assert gen.differences(stored, stored) == []
    edited = nbformat.from_dict(stored)
    cell = next(c for c in edited.cells if c.cell_type == "code" and c.outputs)
    output = cell.outputs[0]
    if "text" in output:
        output.text = output.text.replace("layer", "stage", 1)
    else:
        output.data["text/plain"] = output.data["text/plain"].replace("layer", "stage", 1)
    assert gen.differences(edited, stored)
    # Volatile parts (addresses, timings, execution counts) are not differences.
    counted = nbformat.from_dict(stored)
    for cell in counted.cells:
        if cell.cell_type == "code":
            cell.execution_count = (cell.execution_count or 0) + 10
    assert gen.differences(counted, stored) == []
    assert gen.normalise("<Thing at 0x7f3a2b10> in 1.25 s, 3 ms") == gen.normalise(
        "<Thing at 0x7f99c0d8> in 0.98 s, 12 ms"
    )
    assert gen.normalise("3 stages, 12 B") == "3 stages, 12 B"
