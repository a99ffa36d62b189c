"""The device-independent tests on an accelerator (``make test-tpu``), with the Python
that runs this script: no virtual environment, nothing from the internet, one pytest
process (one program at a time can hold a TPU chip, so no ``-n``).

    python3 tests/_accelerator.py --out DIR [--pip-index URL] [--budget-s S]
                                  [--tests PATH ...] [PYTEST OPTIONS]

``--pip-index`` first installs what the tests import beyond JAX, numpy, pytest and
hypothesis (networkx and rich; flax and optax where the index has them, else the few
tests that need them skip) from that index into ``--deps-dir``, for a machine without
the internet but with a package index on its disk (a TPU machine's
``file:///opt/pypi/simple``). ``DIR`` receives ``junit.xml`` and ``pytest.log``; after
``--budget-s`` seconds pytest is interrupted, and reports and writes what ran so far.
``--tests`` runs other test files than :data:`TESTS`; other options go to pytest.

Which tests: :data:`TESTS`, an explicit list, rather than a marker on the tests. A
test file joins it once it is known to run there and to be cheap: the run is by hand,
on a machine lent for minutes, with only the packages its index holds. Left out are
what is CPU-only by nature (several processes, the XLA flags of a fresh process, the
CPU's custom-call targets and FFI, the browser, the docs, benchmarks), the model zoo's
extras (penzai, equinox) and the longest files. pytest runs the files in this order
(its ``slow`` tests first), so that an interrupted run has run the first ones. Tests in
the list that need several devices take the host CPU's (``tests._devices``);
conftest.py sets float32 matmul precision on an accelerator; the property tests
(hypothesis) set no deadline, which a first compilation on the chip would overrun.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = (
    # First what must run there: the primitive, its lowerings, slicing, staged programs
    # and pipelines (of one device on the accelerator, of several on the host CPU).
    "tests/test_primitive.py",
    "tests/test_lowering.py",
    "tests/test_pallas_identity.py",  # the TPU target: its `tpu` tests run only there
    "tests/test_staged.py",
    "tests/test_split.py",
    "tests/runtime/test_pipeline.py",
    # Then, as the budget allows: the runtime's calls, arguments and losses,
    "tests/runtime/test_execution.py",
    "tests/runtime/test_perfetto.py",
    "tests/runtime/test_memory.py",
    "tests/runtime/test_options.py",
    "tests/runtime/test_arguments.py",
    "tests/runtime/test_steps.py",
    "tests/runtime/test_losses.py",
    # the passes (not the model-zoo-heavy auto, scan, inline and backward files),
    "tests/passes/test_slice.py",
    "tests/passes/test_insert.py",
    "tests/passes/test_rewrite.py",
    "tests/passes/test_gradient.py",
    "tests/passes/test_stages.py",
    "tests/passes/test_markers_cache.py",
    "tests/passes/test_framework.py",
    "tests/passes/test_malformed.py",
    "tests/passes/test_fast_paths.py",
    "tests/passes/test_blocks.py",
    # markers, errors, graphs and signatures, and last the schedules (no device at all).
    "tests/test_marks.py",
    "tests/test_errors.py",
    "tests/test_graph.py",
    "tests/test_roles.py",
    "tests/test_walk.py",
    "tests/test_signature.py",
    "tests/runtime/test_schedules.py",
    "tests/runtime/test_simulation.py",
)

#: Installed with ``--pip-index``: needed (pipemark imports networkx), then wanted: the
#: versions `make test` runs with JAX 0.10 (a newer flax may need a newer JAX).
NEEDED = ("networkx", "rich")
WANTED = ("flax==0.12.8", "optax==0.2.8")


def install(index: str, target: Path) -> None:
    """Install :data:`NEEDED` and :data:`WANTED` from ``index`` into ``target`` (only
    :data:`NEEDED` when the index cannot give the others)."""

    def pip(names: tuple[str, ...]) -> int:
        command = [
            sys.executable, "-m", "pip", "install", "--isolated", "--quiet",
            "--disable-pip-version-check", "--only-binary=:all:", "--index-url", index,
            "--target", str(target), *names,
        ]  # fmt: skip
        print("$", " ".join(command), flush=True)
        # The machine's pip configuration may name an index that is out of reach.
        return subprocess.call(command, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})

    if pip(NEEDED + WANTED) != 0:
        print(f"installing {', '.join(WANTED)} failed: their tests skip", flush=True)
        if pip(NEEDED) != 0:
            raise SystemExit(f"installing {', '.join(NEEDED)} from {index} failed")


def run_pytest(out: Path, extra: list[str], paths: list[str], budget_s: float | None) -> int:
    """pytest on ``paths`` in one process, its output shown and kept in
    ``out/pytest.log``; interrupted (as by Ctrl-C: it then reports what ran) after
    ``budget_s`` seconds."""
    command = [
        sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
        f"--junitxml={out / 'junit.xml'}", "--durations=25", *extra, *paths,
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    with open(out / "pytest.log", "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        interrupted = threading.Event()

        def interrupt() -> None:
            interrupted.set()
            process.send_signal(signal.SIGINT)

        timer = threading.Timer(budget_s, interrupt) if budget_s is not None else None
        if timer is not None:
            timer.start()
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        status = process.wait()
        if timer is not None:
            timer.cancel()
        if interrupted.is_set():
            note = (
                f"pytest interrupted after {budget_s:g} s (--budget-s): the tests after "
                "those it reported did not run\n"
            )
            sys.stdout.write(note)
            log.write(note)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tpu-results")
    parser.add_argument("--pip-index", help="install the test dependencies from this index")
    parser.add_argument("--deps-dir", type=Path, default=Path("/tmp/pipemark-test-deps"))
    parser.add_argument("--budget-s", type=float, help="interrupt pytest after this long")
    parser.add_argument("--tests", nargs="+", default=list(TESTS), help="instead of TESTS")
    args, options = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.pip_index:
        install(args.pip_index, args.deps_dir)
    # After what PYTHONPATH names (the machine's JAX): a JAX that pip brought along
    # with flax must not hide it. The checkout last: pipemark without installing it.
    path = [os.environ.get("PYTHONPATH", ""), str(args.deps_dir), str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return run_pytest(args.out, options, args.tests, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
