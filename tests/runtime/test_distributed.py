"""Stages in separate processes (jax.distributed, gloo on CPU), started by
``python -m pipemark.launch``: results equal the single-process pipeline's bit for bit,
the bytes moved are the stage graph's boundary bytes, and a process that dies stops
the others with a clear error within the timeout."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests._trees import assert_trees_within_ulps
from tests._xla import child_environ
from tests.runtime._distributed import PLANNED, bare_values
from tests.runtime._distributed_span import BUDGET, TOO_SMALL

SCRIPT = Path(__file__).with_name("_distributed.py")
ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")}
    env = child_environ(env)  # the script sets its devices; the ISA pin is kept
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _launch_and_reference(script: Path, tmp_path, num_processes: int, *reference_args: str):
    """Run ``script`` in ``num_processes`` processes (mode ``run``) and in one
    (``reference``, with ``reference_args``); each must succeed. Returns the reference's
    saved results and each process's."""
    n = str(num_processes)
    launched = _run(["-m", "pipemark.launch", "-n", n, str(script), str(tmp_path), "run"])
    assert launched.returncode == 0, launched.stderr[-3000:]
    reference = _run([str(script), str(tmp_path), "reference", *reference_args])
    assert reference.returncode == 0, reference.stderr[-3000:]
    runs = [np.load(tmp_path / f"run-{p}.npz") for p in range(num_processes)]
    return np.load(tmp_path / "reference-0.npz"), runs


def _check_held(want, runs: list, schedules: tuple[str, ...], reference: str = "mlp-") -> None:
    """The calls made with ``gather_results=False``: each result leaf is held by exactly
    one process, equal bit for bit to one process's result; the others have an array
    of the global program of the same shape and dtype, with no data. Nothing is
    gathered but the scalars (the loss), which reach every process (#39: the process
    that logs reads the loss of its own run)."""
    for schedule in schedules:
        key = f"held-{schedule}"
        leaves = [k for k in want.files if k.startswith(f"{reference}{schedule}-")]
        leaves = [k for k in leaves if not k.endswith(("received", "expected"))]
        scalars = [want[name].ndim == 0 for name in leaves]
        assert any(scalars) and not all(scalars), leaves
        scalar_bytes = sum(want[n].nbytes for n, s in zip(leaves, scalars) if s)
        held = [0] * len(leaves)
        for got in runs:
            # A process that holds no stage's loss receives it; the one that has it, none.
            assert int(got[f"{key}-gathered"]) in (0, scalar_bytes), schedule
            for i, name in enumerate(leaves):
                if f"{key}-{i}" in got.files:
                    np.testing.assert_array_equal(got[f"{key}-{i}"], want[name], err_msg=name)
                    held[i] += 1
                else:
                    shape = tuple(got[f"{key}-{i}-elsewhere"])
                    assert shape == (*want[name].shape, want[name].dtype.num), name
        assert sum(int(got[f"{key}-gathered"]) > 0 for got in runs) == len(runs) - 1
        assert held == [len(runs) if s else 1 for s in scalars], (schedule, held)


@pytest.mark.parametrize("num_processes", [2, 4])
def test_stages_in_processes_equal_the_single_process_pipeline(tmp_path, num_processes):
    want, runs = _launch_and_reference(SCRIPT, tmp_path, num_processes, str(num_processes))
    results = [k for k in want.files if not k.endswith(("received", "expected"))]
    results = [k for k in results if not k.startswith("held-")]
    ran = {(k.split("-")[0], k.split("-", 1)[1].rsplit("-", 1)[0]) for k in results}
    assert ran == set(PLANNED[num_processes])
    for got in runs:
        # Every process gets the whole result, equal bit for bit to one process's.
        for key in results:
            assert got[key].dtype == want[key].dtype
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        # What a process received between stages is what the stage graph says
        # crosses into its stages from other processes: no extra copies.
        for key in got.files:
            if key.endswith("received"):
                expected = key.replace("received", "expected")
                assert int(got[key]) == int(got[expected]) > 0, key
    _check_held(want, runs, ("1f1b", "zb-v"))
    _check_training_step(runs)


def _check_training_step(runs: list) -> None:
    """Two training steps clipped by the global norm, with ``gather_results=False`` and
    stage ``k`` in process ``k``: after the second, process ``k`` holds its stage's new
    parameters and momentum (leaves ``2k`` and ``2k + 1`` of each), equal to ``jax.jit``
    of the step in one process (within 1e-6 of each leaf's largest value), and nothing
    of the other stages; every process holds the loss (a scalar: #39) and the norm (a
    result no stage owns); the state the first step was given is deleted where this
    process's part of the update took it over. Only small values crossed processes (the loss, the partial
    sums, the norm): no gradient was gathered or received."""
    want = runs[0]
    count = sum(k.startswith("train-want-") for k in want.files)
    num = len(runs)
    assert count == 4 * num + 2
    assert float(want[f"train-want-{count - 1}"]) > 0.01  # the norm: the step clips
    holder = [i % (2 * num) // 2 for i in range(4 * num)] + [None, None]
    # The pipeline's loss (one float32) goes from the last stage's process to the others.
    assert [int(got["train-gathered"]) for got in runs] == [4] * (num - 1) + [0]
    for process, got in enumerate(runs):
        # Donated: the first step's state of this process's own stage, which its part
        # of the update took over; another process's stages' state is left here.
        deleted = [h == process for h in holder[: 4 * num]]
        assert got["train-deleted"].tolist() == deleted, process
        received = int(got["train-update-bytes"])
        # A few float32 partial sums (each process sends its stage's share of the norm):
        # less than the smallest gradient (a bias of 16 floats, 64 bytes).
        assert 0 < received < 64, (process, received)
        for i in range(count):
            if holder[i] not in (None, process):
                assert f"train-{i}" not in got.files, (process, i)
                assert f"train-{i}-elsewhere" in got.files, (process, i)
                continue
            expected = want[f"train-want-{i}"]
            # Within 1e-6 of the leaf's scale: the microbatches' gradients are added in
            # another order than the whole batch's.
            atol = 1e-6 * float(np.max(np.abs(expected)))
            np.testing.assert_allclose(
                got[f"train-{i}"], expected, rtol=1e-6, atol=atol, err_msg=f"train-{i}"
            )


def test_sub_mesh_stages_in_two_processes_equal_one_process(tmp_path):
    # Two processes of 4 devices, each holding one stage's 2 x 2 (data x model)
    # sub-mesh: values cross as one collective over both sub-meshes.
    want, runs = _launch_and_reference(
        Path(__file__).with_name("_distributed_mesh.py"), tmp_path, 2
    )
    results = [k for k in want.files if not k.endswith(("received", "expected"))]
    results = [k for k in results if not k.startswith("held-")]
    assert {k.rsplit("-", 1)[0] for k in results} == {
        "gpipe",
        "1f1b",
        "interleaved",
        "zb-h1",
        "zb-v",
    }
    for got in runs:
        for key in results:  # the whole result in every process, bit for bit
            assert got[key].dtype == want[key].dtype
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        for key in got.files:  # bytes moved between stages = the stage graph's
            if key.endswith("received"):
                assert int(got[key]) == int(got[key.replace("received", "expected")]) > 0, key
    _check_held(want, runs, ("1f1b",), reference="")


def test_a_bare_send_and_receive_between_two_processes_complete(tmp_path):
    # The transport alone, outside a pipeline, the two ends called from different
    # lines of the script: each value arrives as sent, bit for bit (JAX 0.12.1 hung
    # here while the transfer's program carried its caller's line).
    launched = _run(
        ["-m", "pipemark.launch", "-n", "2", str(SCRIPT), str(tmp_path), "bare"],
        timeout=120,
        PIPEMARK_TEST_TIMEOUT="20",
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    got = np.load(tmp_path / "bare-1.npz")
    want = {f"{c}-{i}": v for c in range(3) for i, v in enumerate(bare_values(c)[: 3 - c // 2])}
    assert sorted(got.files) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == np.asarray(value).dtype and got[key].shape == np.shape(value)
        np.testing.assert_array_equal(got[key], value, err_msg=key)


SPAN = Path(__file__).with_name("_distributed_span.py")


@pytest.mark.parametrize("num_processes", [2, 4])
def test_stages_spanning_processes_equal_jax_and_one_process(tmp_path, num_processes):
    # Mesh ("stage", "data") of 2 x P over P processes of 2 devices: with 2 processes
    # each stage spans both, with 4 each spans two. Every process gets every result
    # whole, within float rounding of jax.jit(jax.value_and_grad) and of the same
    # pipeline in one process (the data-parallel sums add in another order there).
    one, runs = _launch_and_reference(SPAN, tmp_path, num_processes, str(num_processes))
    schedules = {k.rsplit("-", 1)[0] for k in one.files} - {"want"}
    if num_processes == 2:  # an optax.adamw step, and what is refused, in every process
        _check_trained(runs, "train", alone=False)
        for got in runs:
            assert "spans processes needs gather_results=False" in str(got["refused-gathered"])
            message = str(got["refused-clip"])
            assert "reads value" in message and "optax.clip_by_global_norm" in message
    assert schedules == ({"1f1b", "interleaved"} if num_processes == 2 else {"1f1b"})
    for got in runs:
        count = sum(k.startswith("want-") for k in got.files)
        want = [got[f"want-{i}"] for i in range(count)]
        assert count > 2
        for schedule in schedules:
            leaves = [got[f"{schedule}-{i}"] for i in range(count)]
            assert_trees_within_ulps(leaves, want)
            assert_trees_within_ulps(leaves, [one[f"{schedule}-{i}"] for i in range(count)])
    _check_fsdp(runs)


def _check_fsdp(runs: list) -> None:
    """FSDP in those stages (``_distributed_span.fsdp_checks``): the tensor-parallel
    MLP's parameters sharded over each stage's data axis of ``D`` devices (``D`` the
    number of processes), ``fsdp_gather="once"``. Every device holds ``1/D`` of its
    stage's parameters and gradients (4 KiB each stage: 2 layers of two 16 x 16
    float32 matrices); each gradient element is held by one process alone, and the
    shards together, and the loss that every process holds, are within a few ulps of
    ``jax.jit(jax.value_and_grad)``; so are the results gathered whole (2 processes).
    So with ``"per_microbatch"`` (each stage program gathers and reduce-scatters between
    the processes; they dispatch their programs in one global order). Two ``optax.adamw``
    steps keep the parameters and Adam's moments sharded so (``1/D`` on each device),
    each element in one process, and equal ``jax.jit`` of the step within a few ulps."""
    data = len(runs)
    want = [runs[0][f"fsdp-want-{i}"] for i in range(9)]  # the loss, 8 matrices
    for got in runs:
        assert list(got["fsdp-param-bytes"]) == list(got["fsdp-grad-bytes"]) == [4096 // data] * 2
        assert list(got["fsdp-train-param-bytes"]) == [4096 // data] * 2
        assert list(got["fsdp-train-mu-bytes"]) == [4096 // data] * 2
        assert list(got["fsdp-ordered"]) == [False, True]  # "once", "per_microbatch"
        assert got["fsdp-order-walks"].all()
        if data == 2:
            assert_trees_within_ulps([got[f"fsdp-once-{i}"] for i in range(9)], want, ulps=8)
    _check_trained(runs, "fsdp-train", alone=True)
    assert_trees_within_ulps(_merged_held(runs, "fsdp-held", 9), want, ulps=8)
    # Gathered and reduce-scattered in each stage program, between the processes.
    assert_trees_within_ulps(_merged_held(runs, "fsdp-per-microbatch", 9), want, ulps=8)
    # Reduce-scattered after the call's last action rather than each stage's.
    assert_trees_within_ulps(_merged_held(runs, "fsdp-end-of-call", 9), want, ulps=8)
    for got in runs:  # each between the processes in the one global order
        assert got["fsdp-reduces-placed"].all()
    _check_memory(runs, want)
    _check_checkpoint(runs)


def _merged_held(runs: list, prefix: str, count: int) -> list:
    """The loss and gradients kept where computed (``PREFIX-I``: each process's shards,
    NaN elsewhere) put together: the loss the same in every process, each gradient
    element held by one process alone."""
    held = [np.stack([got[f"{prefix}-{i}"] for got in runs]) for i in range(count)]
    assert (held[0] == held[0][0]).all()  # the loss, the same in every process
    merged = [held[0][0]]
    for leaf in held[1:]:
        holders = np.isfinite(leaf).sum(axis=0)
        assert (holders == 1).all(), holders  # each element in one process alone
        merged.append(np.nansum(leaf, axis=0, dtype=leaf.dtype))
    return merged


def _check_memory(runs: list, want: list) -> None:
    """``Pipeline.memory`` and ``memory_budget`` while stages span processes
    (``_distributed_span.memory_checks``, ``budget_checks``). Each slot's
    ``parameters`` are the bytes of the shards JAX's arrays hold on this process's
    device of it (``1/D`` of the stage's 4 KiB); ``arguments`` count at least the batch
    lying there (its microbatches split there count too), 0 on a slot where this
    process has no device; what the plan decides (parameters, batch, accumulators, in
    flight) is the same in every process. A budget that only the processes holding
    the batch on a slot would see exceeded makes the same plan in every process (a
    forward stage rematerialised), each slot's predicted peak within it, and its
    gradients equal ``jax.jit``'s within a few ulps; a budget no change meets is
    refused in every process with the same message."""
    data = len(runs)
    for got in runs:
        slots, held = got["memory-slots"], got["memory-held"]
        here = held[:, 0] >= 0
        assert here.any()
        assert list(slots[here, 0]) == list(held[here, 0]) == [4096 // data] * int(here.sum())
        assert (slots[here, 3] >= held[here, 1]).all() and (slots[~here, 3] == 0).all()
        assert (slots[:, [0, 1, 2, 4]] == runs[0]["memory-slots"][:, [0, 1, 2, 4]]).all()
        assert str(got["budget-plan"]) == str(runs[0]["budget-plan"])
        assert "'layer0'" in str(got["budget-plan"]), str(got["budget-plan"])
        assert max(got["budget-peaks"]) <= BUDGET[data]
        assert str(got["refused-budget"]) == str(runs[0]["refused-budget"])
        assert f"over memory_budget={TOO_SMALL}" in str(got["refused-budget"])
    assert any(got["memory-held"][:, 1].max() > 0 for got in runs)  # a batch was seen
    assert_trees_within_ulps(_merged_held(runs, "budget-held", 9), want, ulps=8)


def _check_checkpoint(runs: list) -> None:
    """orbax while stages span processes (``_distributed_span.checkpoint_checks``):
    the FSDP step's new parameters and optimizer state and the gradients kept where
    computed, saved by every process and restored onto ``abstract_state`` /
    ``abstract_params``, lie where the target says and hold in every process the same
    bits as it saved; export is refused, naming sub-meshes and saying what to do."""
    for got in runs:
        for key in ("refused-export", "refused-export-step"):
            message = str(got[key])
            assert "sub-meshes (mesh=)" in message and "devices= in one process" in message
    if importlib.util.find_spec("orbax.checkpoint") is None:
        return
    count = sum(k.startswith("orbax-saved-") for k in runs[0].files)
    assert count == 8 + 17 + 8  # parameters; Adam's count, mu, nu; gradients
    for i in range(count):
        saved = np.stack([got[f"orbax-saved-{i}"] for got in runs])
        back = np.stack([got[f"orbax-restored-{i}"] for got in runs])
        assert saved.dtype == back.dtype and saved.shape == back.shape, i
        assert saved.tobytes() == back.tobytes(), i  # bit for bit, NaN where not held
        if saved.dtype.kind == "f":  # every element held by some process
            assert np.isfinite(saved).any(axis=0).all(), i
    for got in runs:
        assert int(got["orbax-as-target"]) == count


def _check_trained(runs: list, prefix: str, *, alone: bool) -> None:
    """Two ``optax.adamw`` steps of ``pipeline_train_step`` while stages span processes
    (``_distributed_span.train_twice``): every leaf of the new parameters and optimizer
    state stays an array of the global program on its stage's sub-mesh, each element
    held by some process (by exactly one where ``alone``: sharded over the processes),
    every holder agreeing bit for bit; Adam's count and the loss are every process's own.
    Together they equal ``jax.jit`` of the step within a few ulps."""
    count = sum(k.startswith(f"{prefix}-want-") for k in runs[0].files)
    assert count > 4
    merged, want = [], []
    for i in range(count):
        want.append(runs[0][f"{prefix}-want-{i}"])
        views = np.stack([got[f"{prefix}-held-{i}"] for got in runs])
        if want[-1].ndim == 0:  # Adam's count, the loss: a whole copy in every process
            assert (views == views[0]).all(), (prefix, i)
            merged.append(views[0])
            continue
        held = np.isfinite(views)
        holders = held.sum(axis=0)
        assert (holders == 1).all() if alone else (holders >= 1).all(), (prefix, i, holders)
        first = np.nanmax(views, axis=0)
        assert (np.where(held, views, first) == first).all(), (prefix, i)
        merged.append(first)
    for got in runs:  # all but Adam's count and the loss
        assert int(got[f"{prefix}-global"]) == count - 2
    assert_trees_within_ulps(merged, want, ulps=8)


def test_a_process_that_dies_stops_the_others_when_stages_span_processes(tmp_path):
    start = time.monotonic()
    launched = _run(["-m", "pipemark.launch", "-n", "2", str(SPAN), str(tmp_path), "die"])
    assert launched.returncode == 3, launched.stderr[-3000:]
    assert "pipemark.launch: process 1 exited with status 3; stopping the 1 still running." in (
        launched.stderr
    )
    assert time.monotonic() - start < 30
    pids = [int((tmp_path / f"pid-die-{p}").read_text()) for p in range(2)]
    for pid in pids:  # nothing left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_process_dispatches_its_next_action_while_its_transfer_waits(tmp_path):
    # Process 1's first forward waits 3 s. Process 0's forwards under GPipe need nothing
    # from process 1, and its transfers wait on a thread of their own: all four run
    # during that wait. Were each transfer waited for before the next action, process
    # 0's third forward would come after process 1's wait, since its second transfer
    # meets process 1 only once that process's first forward is done.
    launched = _run(["-m", "pipemark.launch", "-n", "2", str(SCRIPT), str(tmp_path), "overlap"])
    assert launched.returncode == 0, launched.stderr[-3000:]
    forwards, waited = (np.load(tmp_path / f"overlap-{p}.npy") for p in range(2))
    assert len(forwards) == len(waited) == 4
    assert forwards[-1] < waited[0], (forwards - waited[0]).tolist()


def test_a_process_that_dies_stops_the_others_through_the_launcher(tmp_path):
    start = time.monotonic()
    launched = _run(
        ["-m", "pipemark.launch", "-n", "2", str(SCRIPT), str(tmp_path), "die"], timeout=120
    )
    assert launched.returncode == 3
    assert "pipemark.launch: process 1 exited with status 3; stopping the 1 still running." in (
        launched.stderr
    )
    assert time.monotonic() - start < 60
    assert not list(tmp_path.glob("die-*.npz"))


def test_a_process_that_owns_no_stage_returns_the_whole_result(tmp_path):
    launched = _run(["-m", "pipemark.launch", "-n", "3", str(SCRIPT), str(tmp_path), "spare"])
    assert launched.returncode == 0, launched.stderr[-3000:]
    for process in range(3):
        saved = np.load(tmp_path / f"spare-{process}.npz")
        count = len(saved.files) // 2
        assert count > 2
        for i in range(count):
            want = saved[f"want-{i}"]
            scale = float(np.max(np.abs(want)))
            np.testing.assert_allclose(saved[f"got-{i}"], want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "mode, what",
    [
        ("shape", "the input shapes (parameters, then one microbatch) is"),
        ("schedule", "the schedule is"),
    ],
)
def test_processes_called_differently_are_told_what_differs(tmp_path, mode, what):
    start = time.monotonic()
    launched = _run(
        ["-m", "pipemark.launch", "-n", "2", str(SCRIPT), str(tmp_path), mode], timeout=120
    )
    assert launched.returncode == 1, launched.stderr[-3000:]
    assert "called the pipeline differently: " + what in launched.stderr, launched.stderr[-3000:]
    assert "Every process must make the same pipeline calls" in launched.stderr
    assert time.monotonic() - start < 30  # no gloo abort, no wait for the timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _without_the_launcher(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    """Process 1 in ``mode`` (it raises, or never calls), process 0 waiting for it with a
    5 s timeout, no launcher: process 0's run and how long it took."""
    env = {
        "PIPEMARK_COORDINATOR": f"127.0.0.1:{_free_port()}",
        "PIPEMARK_NUM_PROCESSES": "2",
        "PIPEMARK_TEST_TIMEOUT": "5",
    }
    command = [sys.executable, str(SCRIPT), str(tmp_path), mode]
    other = subprocess.Popen(command, env=_env(PIPEMARK_PROCESS_ID="1", **env))
    start = time.monotonic()
    waiting = _run(command[1:], timeout=120, PIPEMARK_PROCESS_ID="0", **env)
    elapsed = time.monotonic() - start
    other.wait(60)
    return waiting, elapsed


def test_without_the_launcher_the_timeout_stops_a_process_waiting_for_one_that_raised(tmp_path):
    # Process 1 raises where it would make its first transfer; process 0 waits there. Its
    # watchdog names process 1's error, published on the coordinator (pipemark.failures).
    waiting, elapsed = _without_the_launcher(tmp_path, "raise")
    from pipemark.runtime.devices.transport import Watchdog

    assert waiting.returncode == Watchdog.EXIT_STATUS, waiting.stderr[-3000:]
    assert (
        "pipemark: process 0 waited more than 5 s sending the outputs of stage 'stage0' "
        "(microbatch 0) to process 1; process 1 raised ValueError: boom in process 1. "
        "Stopping this process (PipelineOptions.timeout_s)."
    ) in waiting.stderr, waiting.stderr[-3000:]
    assert elapsed < 45  # the 5 s timeout, plus starting JAX and tracing


def test_without_the_launcher_a_peer_that_never_calls_ends_this_process_soon(tmp_path):
    waiting, elapsed = _without_the_launcher(tmp_path, "absent")
    # The error, then exit status 1 at once: no 30 s at JAX's shutdown barrier, no abort.
    assert waiting.returncode == 1, waiting.stderr[-3000:]
    assert "ProcessError: process 0: process 1 did not start pipeline call 0 within 5 s" in (
        waiting.stderr
    )
    assert elapsed < 30


def test_launcher_startup_errors_are_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = _run(["-m", "pipemark.launch", "-n", "2", "--port", str(port), str(SCRIPT)])
    assert taken.returncode == 2
    assert taken.stderr.strip() == (
        f"pipemark.launch: port {port} is in use; pick another with --port."
    )
    missing = _run(["-m", "pipemark.launch", "-n", "2", str(tmp_path / "nope.py")])
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"pipemark.launch: no such script: {tmp_path / 'nope.py'}"


def test_the_docs_example_prints_what_the_page_shows():
    page = (ROOT / "docs" / "processes.md").read_text(encoding="utf-8")
    marker = "`python -m pipemark.launch -n 4 docs/gen/multiprocess.py` prints"
    block = page[page.index(marker) :]
    shown = block[block.index("```text\n") + 8 : block.index("```", block.index("```text\n") + 8)]
    launched = _run(["-m", "pipemark.launch", "-n", "4", str(ROOT / "docs/gen/multiprocess.py")])
    assert launched.returncode == 0, launched.stderr[-3000:]
    # gloo writes its connection messages to standard output too, from every process,
    # in pieces that interleave; Python writes each printed line whole. So: the page's
    # lines, in order, each printed once, are what the example printed.
    expected = shown.splitlines()
    printed = [line for line in launched.stdout.splitlines() if line in expected]
    assert printed == expected
