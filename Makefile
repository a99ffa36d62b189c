# The README's commands. Each target makes its own virtual environment in .venv and
# installs what it needs into it, so a fresh clone needs only python3 (>= 3.10).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.pipemark-installed

.PHONY: demo test lint docs docs-assets bench clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,docs,viz]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipemark demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

# Regenerate everything generated in the docs from the current code: the README's demo
# output, docs/demo/ (report and picture), docs/real-models.md, the tutorial's outputs.
docs-assets: $(STAMP)
	$(BIN)/python docs/gen/assets.py

# pytest exits 5 when it collects no test, which fails this target like any failure.
test: lint docs
	$(BIN)/python -m pytest -n 2

clean:
	rm -rf $(VENV) site build *.egg-info
