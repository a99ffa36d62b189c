"""examples/train_lm.py, the training example a user copies, run as a user runs it for a
few steps of a smaller model: in one process (the losses fall and agree with
``jax.jit`` of the same step to float rounding; checkpoints every few steps; a run
resumed from an earlier checkpoint repeats the uninterrupted losses bit for bit; the
loss curve is a PNG), and under ``python -m pipemark.launch -n 2`` with each process
keeping its own stages' state, its checkpoint restored here onto one device and
trained on with ``jax.jit``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import orbax.checkpoint as ocp

from tests._xla import child_environ

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"
PAGE = ROOT / "docs" / "training.md"
# A smaller model than the example's default, for a few seconds of compiling.
SMALL = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "32", "--batch", "8"]
SMALL += ["--microbatches", "2", "--sample", "40"]
PNG = b"\x89PNG\r\n\x1a\n"


def _example():
    """examples/train_lm.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("train_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A compilation cache the example's runs share: a resumed run, or a later test's,
    loads the programs an earlier run compiled (the same programs)."""
    return tmp_path_factory.mktemp("xla-cache")


def _run(cwd: Path, cache: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    """The example with ``SMALL`` and ``args``, in ``processes`` processes (the
    launcher's, one CPU device each) or alone (it makes a CPU device per stage)."""
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    command = [str(SCRIPT), *SMALL, *args]
    if processes > 1:
        env["JAX_NUM_CPU_DEVICES"] = "1"
        command = ["-m", "pipemark.launch", "-n", str(processes), *command]
    done = subprocess.run(
        [sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _jit_losses(steps: int) -> list[float]:
    """JAX's own: ``jax.jit`` of the example's step, from its initial state, on its
    batches (the learning-rate schedule spans ``steps``)."""
    example = _example()
    text, step, state = example.build(example.parse_args([*SMALL, "--steps", str(steps)]))
    step = jax.jit(step)
    losses = []
    for k in range(steps):
        *state, loss = step(*state, text.batch_at(k))
        losses.append(float(loss))
    return losses


def _assert_close(got: list[float], want: list[float]) -> None:
    # float32 AdamW over a few steps: the pipeline adds the microbatches' gradients in
    # another order than jit's one program; a few ulps of difference, amplified by the
    # steps, stay far below 1e-5 relative.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _losses(path: Path) -> tuple[int, list[float]]:
    seen = json.loads(path.read_text())
    return seen["first_step"], seen["losses"]


@pytest.mark.slow
def test_trains_saves_and_resumes_bit_for_bit_in_one_process(tmp_path, compiled):
    saving = ["--steps", "6", "--checkpoint-every", "3"]
    first = _run(tmp_path, compiled, *saving, "--checkpoint-dir", "run", "--losses", "run.json")
    start, losses = _losses(tmp_path / "run.json")
    assert start == 0 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1
    _assert_close(losses, _jit_losses(6))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["3", "6"]
    assert (tmp_path / "train_lm.png").read_bytes().startswith(PNG)
    assert "step 3: loss" in first.stdout and "the model writes:\nFirst Citizen:\n" in first.stdout
    # Stopped after the checkpoint of step 3: resumed, the same programs on the same
    # layout repeat the uninterrupted run's last losses to the bit.
    shutil.copytree(tmp_path / "run", tmp_path / "stopped", ignore=shutil.ignore_patterns("6"))
    resuming = ["--checkpoint-dir", "stopped", "--resume", "--losses", "r.json", "--sample", "0"]
    again = _run(tmp_path, compiled, *saving, *resuming)
    assert "resumed from the checkpoint after step 3" in again.stdout
    assert _losses(tmp_path / "r.json") == (3, losses[3:])
    # Without --resume, a directory with checkpoints is refused, not overwritten.
    example = _example()
    args = example.parse_args([*SMALL, "--checkpoint-dir", str(tmp_path / "run")])
    with pytest.raises(SystemExit, match="pass --resume"), contextlib.ExitStack() as stack:
        example.open_checkpoints(args, stack)


@pytest.mark.slow
def test_two_processes_under_the_launcher_each_keeping_its_stages_state(tmp_path, compiled):
    done = _run(
        tmp_path, compiled, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir", "run",
        "--losses", "run.json", "--no-gather-results", processes=2,
    )  # fmt: skip
    want = _jit_losses(4)
    start, losses = _losses(tmp_path / "run.json")  # process 0 read every loss
    assert start == 0
    _assert_close(losses, want)
    # Process 0 alone prints; it holds only its own stage's parameters.
    assert done.stdout.count(" parameters, ") == 1 and "of 2 process(es)" in done.stdout
    assert "no sample: this process holds only its own stages' parameters" in done.stdout
    # The checkpoint after step 2, each process's part written by that process, read
    # onto another layout, every leaf on one device, and trained on by jax.jit: the
    # same run goes on, within float rounding.
    example = _example()
    text, step, state = example.build(example.parse_args([*SMALL, "--steps", "4"]))
    target = jax.tree.map(  # where build() put the initial state: one device
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": state[0], "opt_state": state[1]},
    )
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        assert manager.all_steps() == [2, 4]
        restored = manager.restore(2, args=ocp.args.StandardRestore(target))
    state = (restored["params"], restored["opt_state"])
    step, resumed = jax.jit(step), []
    for k in (2, 3):
        *state, loss = step(*state, text.batch_at(k))
        resumed.append(float(loss))
    _assert_close(resumed, want[2:])


def test_the_code_on_the_docs_page_is_cut_from_the_example():
    source = SCRIPT.read_text(encoding="utf-8")
    page = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- from examples/train_lm.py -->\n```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 5
    for block in blocks:  # as it stands in the example, at some indentation
        found = any(textwrap.indent(block, " " * k) in source for k in range(0, 17, 4))
        assert found, f"docs/training.md shows code that examples/train_lm.py lacks:\n{block}"


def test_the_docs_page_lists_every_option_with_its_default():
    defaults = vars(_example().parse_args([]))
    page = PAGE.read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(--[a-z-]+)`[^|]*\| `([^`]*)` \|", page, re.M)
    listed = {option[2:].replace("-", "_"): default for option, default in rows}
    assert listed == {name: repr(value) for name, value in defaults.items()}
