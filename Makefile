# The commands of README.md and CONTRIBUTING.md. Each target makes its own virtual
# environment in .venv and installs what it needs into it, so a fresh clone needs only
# python3 (>= 3.10).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.pipemark-installed

# The newest end of the supported JAX range (CONTRIBUTING.md, "Supported JAX
# versions"): its own venv, made by Python 3.12, where pip resolves the newest JAX,
# flax, equinox and optax.
NEWEST_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(shell $(p) -c 'print("$(p)")' 2>/dev/null)))
NEWEST_VENV   ?= .venv-newest
NEWEST_BIN     = $(NEWEST_VENV)/bin
NEWEST_STAMP   = $(NEWEST_VENV)/.pipemark-installed

# MaxText (tests/test_maxtext.py, marked `maxtext`) in a venv of its own on the newest
# Python and JAX: maxtext 0.2.5 declares its ~220 dependencies only in the requirement
# files it ships; the decoupled set is the one without Google Cloud clients or
# accelerator wheels.
MAXTEXT_VENV   ?= .venv-maxtext
MAXTEXT_BIN     = $(MAXTEXT_VENV)/bin
MAXTEXT_STAMP   = $(MAXTEXT_VENV)/.pipemark-installed
MAXTEXT_REQS    = dependencies/requirements/generated_requirements/decoupled-requirements.txt

.PHONY: demo test test-newest test-maxtext test-tpu fuzz-runtime newest-env maxtext-env lint docs docs-assets bench clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,docs,viz]'
	touch $(STAMP)

$(NEWEST_STAMP): setup.py pyproject.toml
	@test -n "$(NEWEST_PYTHON)" || { echo "make test-newest needs python3.12 (set NEWEST_PYTHON)"; exit 1; }
	$(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_BIN)/python -m pip install --quiet --upgrade pip
	$(NEWEST_BIN)/python -m pip install --quiet -e '.[test,viz]'
	touch $(NEWEST_STAMP)

# pip does not compile its ~21,000 modules to bytecode (82 s of CPU, taken from `make
# test`, which .ci/run runs beside this build); importing what the MaxText tests import
# compiles the 3,600 of them they use (PYTHONDONTWRITEBYTECODE emptied: CI's machines
# set it, and then nothing would be written).
MAXTEXT_IMPORTS = maxtext.configs.pyconfig, maxtext.models.models, maxtext.utils.sharding, flax.nnx, pytest, xdist, pipemark

$(MAXTEXT_STAMP): setup.py pyproject.toml
	@test -n "$(NEWEST_PYTHON)" || { echo "make test-maxtext needs python3.12 (set NEWEST_PYTHON)"; exit 1; }
	$(NEWEST_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_BIN)/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_BIN)/python -m pip install --quiet --no-compile 'maxtext==0.2.5'
	$(MAXTEXT_BIN)/python -m pip install --quiet --no-compile -r "$$($(MAXTEXT_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/$(MAXTEXT_REQS)"
	$(MAXTEXT_BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	PYTHONDONTWRITEBYTECODE= $(MAXTEXT_BIN)/python -c 'import $(MAXTEXT_IMPORTS)'
	touch $(MAXTEXT_STAMP)

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

# XLA_ISA=AVX2 (or AVX...) pins XLA's CPU code to a lower instruction set than the
# machine has, for `make test` and `make test-newest` and the processes their tests
# start: no test may depend on how this CPU rounds (tests/_exact.py). .ci/run pins
# `make test-newest` to AVX2, so each CI run checks two instruction sets. Not SSE4_2:
# there XLA cannot compile a float16 conversion (JAX 0.10 and 0.12: "Failed to
# materialize symbols: wrapped_convert"), which the float16 tests need.
XLA_ISA ?=
ISA_FLAG = $(if $(XLA_ISA),--xla_cpu_max_isa=$(XLA_ISA))
# `make test` and `make test-newest` also set XLA's backend optimisation level, XLA_OPT
# (default 0): at 0 LLVM does not optimise the CPU code of the suite's thousands of
# small programs, and the suite runs about 15 % faster (three of its files with -n 2,
# side by side: 97 and 107 s against 115 and 127 s; the whole of make test-newest 570
# against 819 s). The last bits of a result can differ between levels (at 0 LLVM does
# not contract a multiply and an add into one FMA), as between instruction sets: tests
# compare two programs to float rounding, never bit for bit (tests/_exact.py).
# `XLA_OPT=` compiles as users' programs are compiled (the default level), which both
# targets passed at, last checked on 2026-12-06.
XLA_OPT ?= 0
TEST_FLAGS = $(strip $(ISA_FLAG) $(if $(XLA_OPT),--xla_backend_optimization_level=$(XLA_OPT)))
TEST_ENV   = $(if $(TEST_FLAGS),XLA_FLAGS="$(TEST_FLAGS)")

# Before the tests, pipemark's own modules (and the tests' and benchmarks') are compiled
# to bytecode once: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) Python
# reads cached bytecode but never writes it, and each of the hundreds of processes the
# tests start compiled the runtime from source (0.3 s of CPU each: 1.77 against 1.46 s
# to import it). pip compiles the installed packages the same way.
# pytest exits 5 when it collects no test, which fails this target like any failure.
# The fuzzer runs a third of its examples here and another third's worth, with another
# seed, in `make test-newest`: CI within its time.
test: lint docs
	$(BIN)/python -m compileall -q pipemark tests benchmarks > /dev/null
	$(TEST_ENV) PIPEMARK_FUZZ=$${PIPEMARK_FUZZ:-third} $(BIN)/python -m pytest -n 2 --durations=15

# The whole suite again on the newest JAX. Lint and the docs build do not depend on the
# JAX version; the generated docs (equation counts...) are made on the developer's JAX
# by `make docs-assets` and checked by `make test` (marker docs_assets). The benchmark
# scripts' own tests (marker benchmark_script: what a script prints) run in `make test`
# only; the runtime they measure is tested here too. The fuzzer runs a third of its
# examples here, with another seed than `make test`'s. Of a test function with 4 or
# more parametrized cases, the cases that run every parameter value once
# (PIPEMARK_CASES=cover, conftest.py), and of one run in 2 and in 4 processes, the 2;
# `make test` runs every combination.
test-newest: $(NEWEST_STAMP)
	$(NEWEST_BIN)/python -m compileall -q pipemark tests benchmarks > /dev/null
	$(NEWEST_BIN)/python -c 'import jax, sys; print("JAX", jax.__version__, "on Python", sys.version.split()[0])'
	$(TEST_ENV) PIPEMARK_FUZZ=third PIPEMARK_FUZZ_SEED=1 PIPEMARK_CASES=cover $(NEWEST_BIN)/python -m pytest -n 2 -m 'not docs_assets and not benchmark_script' --durations=15

# The runtime's scenario fuzzer alone (tests/runtime/test_scenarios.py), drawing more
# than make test's few: N training scenarios in one process and N/3 in two, with seed
# SEED (make test runs 6 and 3: ~35 s of CPU). Measured (2026-12-07, two shared cores,
# jax 0.10.2 CPU): N=200 SEED=9 ran 200 scenarios in one process (494 s of their own)
# beside 68 in two (5 minutes) in 10 minutes, every one matching jax.jit. Its
# folder is its own: pytest keeps the last three sessions' of the default folder, which
# other sessions on a shared machine would delete under a long run.
N    ?= 60
SEED ?= 0
fuzz-runtime: $(STAMP)
	$(TEST_ENV) PIPEMARK_SCENARIOS=$(N) PIPEMARK_FUZZ_SEED=$(SEED) $(BIN)/python -m pytest -p no:cacheprovider -q --basetemp=$${TMPDIR:-/tmp}/pipemark-fuzz-runtime tests/runtime/test_scenarios.py

# The two environments alone (.ci/run builds them while `make test` runs).
newest-env: $(NEWEST_STAMP)
maxtext-env: $(MAXTEXT_STAMP)

# Its two cases, each a subprocess, side by side (-n 2): 60 s against 109 s one after
# the other.
test-maxtext: $(MAXTEXT_STAMP)
	$(MAXTEXT_BIN)/python -m pytest -n 2 -m maxtext tests/test_maxtext.py

# The device-independent tests on an accelerator (CONTRIBUTING.md, "On a TPU"): with
# the Python that runs make and what it has installed (JAX with its accelerator plugin, numpy,
# pytest, hypothesis), no venv, no download, one pytest process. PIP_INDEX=URL first
# installs networkx and rich (and flax and optax, where the index has them) from that
# index. tests/_accelerator.py lists the tests and says why those; TPU_OUT gets
# junit.xml and pytest.log; pytest is interrupted after TPU_BUDGET_S seconds (it then
# reports what ran).
TPU_OUT      ?= tpu-results
TPU_BUDGET_S ?= 480
PIP_INDEX    ?=

test-tpu:
	$(PYTHON) tests/_accelerator.py --out $(TPU_OUT) --budget-s $(TPU_BUDGET_S) $(if $(PIP_INDEX),--pip-index $(PIP_INDEX))

clean:
	rm -rf $(VENV) $(NEWEST_VENV) $(MAXTEXT_VENV) site build *.egg-info
