"""pipemark.launch: its arguments, signals sent to it, and a process that raises (named
with its error, pipemark.failures).

The multi-process pipeline itself is tested in tests/runtime/test_distributed.py."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipemark import failures, launch
from pipemark.errors import ProcessError
from tests._xla import child_environ

ROOT = Path(__file__).parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")}
    env = child_environ(env)  # the script sets its devices; the ISA pin is kept
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2", "--port", "0", "x.py"], "--port must be between 1 and 65535, got 0"),
        (["-n", "2", "--port", "70000", "x.py"], "--port must be between 1 and 65535, got 70000"),
        (["-n", "2", "--port", "-5", "x.py"], "--port must be between 1 and 65535, got -5"),
        (["-n", "2", "--timeout", "0", "x.py"], "--timeout must be greater than 0, got 0"),
        (["-n", "2", "--timeout", "-1", "x.py"], "--timeout must be greater than 0, got -1"),
        (["-n", "2", "--timeout", "nan", "x.py"], "--timeout must be greater than 0, got nan"),
        (["-n", "0", "x.py"], "-n must be greater than 0, got 0"),
        (["-n", "two", "x.py"], "-n must be a number, got 'two'"),
        (["-n", "2"], "give a script to run, or -m and a module"),
        (["-n", "2", "-m"], "give a script to run, or -m and a module"),
    ],
)
def test_bad_arguments_are_one_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_the_command_starts_at_the_script_or_at_dash_m():
    split = launch._split_command
    assert split(["-n", "2", "-m", "pkg.mod", "--steps", "3"]) == (
        ["-n", "2"],
        ["-m", "pkg.mod", "--steps", "3"],
    )
    assert split(["-n=2", "--port", "99", "train.py", "-n", "5"]) == (
        ["-n=2", "--port", "99"],
        ["train.py", "-n", "5"],
    )
    assert split(["-n", "2", "--", "-m", "x"]) == (["-n", "2"], ["-m", "x"])


def test_a_module_runs_in_every_process(tmp_path):
    # Each process writes its own file: lines the processes print to one pipe interleave.
    (tmp_path / "hello_launch.py").write_text(
        "import os, sys\n"
        "from pipemark.launch import launched\n"
        "me = os.environ['PIPEMARK_PROCESS_ID']\n"
        "with open(os.path.join(os.environ['HELLO_OUT'], me), 'w') as f:\n"
        "    f.write(repr([launched(), *sys.argv[1:]]))\n"
    )
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env["HELLO_OUT"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "pipemark.launch", "-n", "2", "-m", "hello_launch", "--steps", "3"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for process in ("0", "1"):
        assert (tmp_path / process).read_text() == "[True, '--steps', '3']"
    assert not launch.launched()  # this process was not launched


STUBBORN = """\
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as JAX's runtime does, in effect
signal.signal(signal.SIGINT, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], os.environ["PIPEMARK_PROCESS_ID"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_stops_every_process(tmp_path, number):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pipemark.launch", "-n", "2", str(script), str(tmp_path)],
        env=_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not all((tmp_path / str(i)).exists() for i in range(2)):
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.05)
    time.sleep(0.2)  # both have written their pid
    pids = [int((tmp_path / str(i)).read_text()) for i in range(2)]
    start = time.monotonic()
    launcher.send_signal(number)
    _, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + number
    assert f"received {signal.Signals(number).name}; passing it on" in stderr
    assert time.monotonic() - start < launch._GRACE_S + 5
    assert not any(_alive(pid) for pid in pids)


RAISES = """\
import os
os.environ["JAX_PLATFORMS"] = "cpu"
from pipemark.launch import initialize
initialize()
import jax
jax.devices()  # both processes have started JAX's backend
if os.environ["PIPEMARK_PROCESS_ID"] == "1":
    raise ValueError("bad batch\\nof shape (3, 5)")
from pipemark.runtime.devices.agreement import from_every_process
from_every_process("its plan", 0, 60)  # process 0 waits for process 1, as a pipeline does
"""


@pytest.mark.slow
def test_a_process_that_raises_is_named_with_its_error_and_everything_stops_quickly(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pipemark.launch", "-n", "2", str(script)],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert "ValueError: bad batch" in done.stderr
    # The launcher and process 0 (within the 5 s the launcher gives it) name the error.
    assert (
        "pipemark.launch: process 1 exited with status 1 (ValueError: bad batch); stopping the "
        "1 still running."
    ) in done.stderr, done.stderr[-2000:]
    assert (
        "ProcessError: process 0: process 1 did not send its plan (exchange 0): process 1 "
        "raised ValueError: bad batch."
    ) in done.stderr, done.stderr[-2000:]
    assert done.returncode == 1
    # Starting JAX twice, then at once: no 30 s at the shutdown barrier.
    assert elapsed < 20


class _Ended:
    """A process that has ended with ``code`` (negative: killed by that signal), or is
    running (``None``) until a signal stops it."""

    def __init__(self, code):
        self.code, self.signals = code, []

    def poll(self):
        return self.code

    def send_signal(self, number):
        self.signals.append(number)

    def wait(self, timeout=None):
        self.code = -self.signals[-1]
        return self.code


def test_a_process_killed_by_a_signal_is_named_before_the_peers_that_failed_after_it():
    # Process 1 killed; process 0, waiting for it in a collective, errs: by the next
    # look both have ended, and the cause is the signal.
    stream = io.StringIO()
    processes = [_Ended(1), _Ended(-9), _Ended(None)]
    code = launch._watch(processes, None, stream, [])
    assert code == 128 + 9 and processes[2].signals == [signal.SIGTERM]
    assert stream.getvalue() == (
        "pipemark.launch: process 1 was killed by signal 9, and process 0 exited with status "
        "1; stopping the 1 still running.\n"
    )


def _failed(directory: Path, process: int, error: Exception) -> None:
    """Write ``error`` as process ``process`` publishes it under the launcher."""
    failure = failures.failure_of(error, process)
    (directory / str(process)).write_text(json.dumps(dataclasses.asdict(failure)))


def test_the_process_whose_error_caused_the_others_is_named_with_it(tmp_path):
    # Process 1 raised; process 0, waiting for it, raised a ProcessError after it.
    _failed(tmp_path, 1, ValueError("bad batch"))
    _failed(tmp_path, 0, ProcessError("process 0: the transfer ... failed"))
    stream = io.StringIO()
    assert launch._watch([_Ended(1), _Ended(1)], None, stream, [], str(tmp_path)) == 1
    assert stream.getvalue() == (
        "pipemark.launch: process 1 exited with status 1 (ValueError: bad batch), and process "
        "0 exited with status 1; stopping the 0 still running.\n"
    )
    # Process 0, the coordinator, raised: JAX aborts the others (a signal), after it.
    (tmp_path / "1").unlink()
    _failed(tmp_path, 0, KeyError("tokens"))
    stream = io.StringIO()
    assert launch._watch([_Ended(1), _Ended(-6)], None, stream, [], str(tmp_path)) == 1
    assert stream.getvalue().startswith(
        "pipemark.launch: process 0 exited with status 1 (KeyError: 'tokens'), and process 1 "
        "was killed by signal 6;"
    )


def test_start_jax_after_jax_started_says_to_call_it_first(monkeypatch):
    import jax

    from pipemark.errors import PipemarkError

    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.devices()  # this test process started JAX long ago
    with pytest.raises(PipemarkError, match=r"start_jax\(cpu_devices=2\) came after JAX started"):
        launch.start_jax(cpu_devices=2)
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")  # the environment said: nothing to set
    launch.start_jax(cpu_devices=2)


def test_start_jax_gives_a_cpu_process_its_devices():
    code = "from pipemark import launch; launch.start_jax(cpu_devices=3); import jax; print(jax.device_count())"
    env = {k: v for k, v in _env().items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3"]
