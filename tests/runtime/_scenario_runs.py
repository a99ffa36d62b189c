"""Runs the drawn scenarios of tests/runtime/_scenarios.py, in one process of 8 CPU
devices or in two processes of 2 each (under ``python -m pipemark.launch -n 2`` with
``JAX_NUM_CPU_DEVICES=2``), and writes each one's outcome as a JSON line.

    python tests/runtime/_scenario_runs.py run 'SCENARIO'            # one, its error printed
    python -m pipemark.launch -n 2 tests/runtime/_scenario_runs.py run 'SCENARIO'
    python tests/runtime/_scenario_runs.py batch SCENARIOS.json OUT  # OUT-0.jsonl
    python -m pipemark.launch -n 2 tests/runtime/_scenario_runs.py batch SCENARIOS.json OUT

``SCENARIOS.json`` holds a list of scenarios; ``OUT-<process>.jsonl`` gets a line per
scenario (``scenario``, ``error``: ``None`` where it ran and matched ``jax.jit``,
``seconds``), written as each ends, so that a run cut short keeps what it did. The
scenarios of a launch run one after the other in both processes, the same list in
each. Importing this module does nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tests._xla import xla_flags

IN_PROCESS_DEVICES = 8


def _start() -> None:
    """Join jax.distributed (under the launcher) or give this process 8 CPU devices,
    before JAX starts its backend."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "PIPEMARK_COORDINATOR" in os.environ:
        from pipemark.launch import initialize

        initialize()
    else:
        flag = f"--xla_force_host_platform_device_count={IN_PROCESS_DEVICES}"
        os.environ["XLA_FLAGS"] = xla_flags(flag)


def _rows() -> list[list]:
    """The devices of each process, process 0's first."""
    import jax

    count = jax.process_count()
    return [[d for d in jax.devices() if d.process_index == p] for p in range(count)]


def _run_all(scenarios: list[dict], out: Path, work: Path) -> None:
    import jax

    from tests.runtime import _scenarios

    process = jax.process_index()
    rows = _rows()
    with open(f"{out}-{process}.jsonl", "w") as lines:
        for number, scenario in enumerate(scenarios):
            folder = work / f"scenario-{number}"
            outcome = _scenarios.run_scenario(scenario, rows, folder)
            line = {**outcome._asdict(), "seconds": round(outcome.seconds, 2)}
            lines.write(json.dumps({**line, "process": process}) + "\n")
            lines.flush()


def main(argv: list[str]) -> None:
    _start()
    if argv[0] == "run":
        # Both processes of a launch share the folder: named after the coordinator.
        name = os.environ.get("PIPEMARK_COORDINATOR", str(os.getpid())).replace(":", "-")
        work = Path(tempfile.gettempdir()) / f"pipemark-scenario-{name}"
        work.mkdir(parents=True, exist_ok=True)
        _run_all([json.loads(argv[1])], work / "outcome", work)
        (line,) = Path(f"{work / 'outcome'}-{_process()}.jsonl").read_text().splitlines()
        error = json.loads(line)["error"]
        print(f"process {_process()}: {error or 'ran, and matches jax.jit'}")
        sys.exit(1 if error else 0)
    out = Path(argv[2])
    # One folder for both processes: orbax writes one checkpoint of the processes' parts.
    work = out.parent / f"{out.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    _run_all(json.loads(Path(argv[1]).read_text()), out, work)


def _process() -> int:
    import jax

    return jax.process_index()


if __name__ == "__main__":
    main(sys.argv[1:])
