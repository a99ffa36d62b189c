"""The runtime's scenario fuzzer (#56 item 2): training runs as users write them, drawn
by hypothesis (tests/runtime/_scenarios.py: a model, its parameters' pytree, an
optimizer, a schedule straight or through CSV, a layout, and a sequence of steps,
saves, restores onto other layouts and exports), each compared with ``jax.jit`` of the
same steps. The in-process scenarios run in one subprocess of 8 CPU devices, the
two-process ones in one launch of ``python -m pipemark.launch -n 2`` (2 CPU devices a
process), once per test session (tests/runtime/_scenario_runs.py); each scenario is
its own test here, its failure printing the scenario and the command that reruns it.

Profiles as the differential fuzzer's (tests/test_differential.py): ``PIPEMARK_FUZZ=ci``
(:data:`COUNTS`), ``half``, ``third`` (``make test``, seed 0, and ``make test-newest``,
seed 1: 4 scenarios in one process and 2 in two, about 30 s of CPU each, with
pytest's own start), ``long`` (ten times as many);
``PIPEMARK_FUZZ_SEED`` picks another seed; ``PIPEMARK_SCENARIOS=N`` draws N in-process
scenarios and N/3 two-process ones whatever the profile (``make fuzz-runtime N=...``).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("equinox")
pytest.importorskip("flax.nnx")

from tests._once import session_dir
from tests._xla import child_environ
from tests.runtime import _scenarios

SCRIPT = Path(__file__).with_name("_scenario_runs.py")
ROOT = Path(__file__).parents[2]

#: Scenarios of the ci profile: in one process, and in two (a scenario of two costs
#: about twice one of one: both processes run it).
COUNTS = {"in_process": 12, "processes": 6}
_SCALES = {"ci": 1.0, "half": 0.5, "third": 1 / 3, "long": 10.0}
PROFILE = os.environ.get("PIPEMARK_FUZZ", "ci")
if PROFILE not in _SCALES:
    raise ValueError(f"PIPEMARK_FUZZ must be one of {sorted(_SCALES)}, got {PROFILE!r}")
SEED = int(os.environ.get("PIPEMARK_FUZZ_SEED", "0"))


def _count(kind: str) -> int:
    wanted = os.environ.get("PIPEMARK_SCENARIOS")
    if wanted:
        return int(wanted) if kind == "in_process" else math.ceil(int(wanted) / 3)
    return max(1, round(COUNTS[kind] * _SCALES[PROFILE]))


_LAYOUT = {"place": "processes", "stages": 2, "gather": True}
#: Scenarios every session runs after the drawn ones: the smallest of each failure the
#: fuzzer found, a regression test once fixed.
PINNED = {
    "processes": [
        {  # a state restored under two processes, saved before a step (fixed: bfd52f0)
            "kind": "processes",
            "seed": 0,
            "model": dict.fromkeys(["tied", "skip", "scalar", "bf16", "unused"], False)
            | {"blocks": 2, "width": 4},
            "tree": "dict",
            "optimizer": "sgd",
            "microbatches": 2,
            "schedule": "gpipe",
            "csv": False,
            "layout": _LAYOUT,
            "checkpoint": {"with": "standard", "made": "save"},
            "acts": [
                {"do": "step"},
                {"do": "save"},
                {"do": "restore", "schedule": "gpipe", "csv": False, "layout": _LAYOUT},
                {"do": "save"},
            ],
        }
    ]
}


def _drawn() -> dict[str, list[dict]]:
    """The scenarios of this session, drawn and pinned. Those that hit a known failure
    (:func:`_scenarios.known_failure`) are strict xfails. A failure one process of two
    meets alone leaves the other waiting in its call: the launch then stops, and the
    scenarios after it fail as not run."""
    return {
        kind: _scenarios.draw_scenarios(kind, _count(kind), SEED) + PINNED.get(kind, [])
        for kind in _scenarios.PLACES
    }


DRAWN = _drawn()


def _start(kind: str, scenarios: list[dict], folder: Path) -> subprocess.Popen:
    """Start the run of ``scenarios`` (one launch for the two-process ones)."""
    listed = folder / f"{kind}.json"
    listed.write_text(json.dumps(scenarios))
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [str(SCRIPT), "batch", str(listed), str(folder / kind)]
    if kind == "processes":
        env["JAX_NUM_CPU_DEVICES"] = "2"
        command = ["-m", "pipemark.launch", "-n", "2", *command]
    return subprocess.Popen(
        [sys.executable, *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(folder / f"{kind}.err", "w"),  # the child writes it
        cwd=ROOT,
    )


def _finish(kind: str, run: subprocess.Popen, folder: Path, timeout: float) -> tuple[list, str]:
    """The outcomes of ``kind``'s run (each process compares what it holds: an outcome
    is process 0's, or the first other process's that failed) and what it printed."""
    try:
        run.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
    per_process = []
    for p in range(2 if kind == "processes" else 1):
        path = folder / f"{kind}-{p}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        per_process.append([json.loads(line) for line in lines])
    outcomes = []
    for number in range(max(len(lines) for lines in per_process)):
        seen = [lines[number] for lines in per_process if number < len(lines)]
        failed = [o for o in seen if o["error"] is not None]
        outcomes.append((failed or seen)[0])
    printed = (folder / f"{kind}.err").read_text()[-4000:]
    return outcomes, f"exit status {run.returncode}\n{printed}"


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """Each kind's outcomes and what its run printed, run once per session (the first
    worker to ask runs them, under a lock; the others read the results)."""
    shared = session_dir(tmp_path_factory) / f"pipemark-scenarios-{PROFILE}-{SEED}"
    shared.mkdir(exist_ok=True)
    results = shared / "outcomes.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results.exists():
            # Side by side: the launch's two processes mostly wait on each other.
            runs = {kind: _start(kind, DRAWN[kind], shared) for kind in DRAWN if DRAWN[kind]}
            timeout = 300 + 60 * sum(map(len, DRAWN.values()))
            ran = {kind: _finish(kind, run, shared, timeout) for kind, run in runs.items()}
            results.write_text(json.dumps(ran))
    return {kind: tuple(value) for kind, value in json.loads(results.read_text()).items()}


def _cases() -> list:
    """A case per drawn scenario, named ``kind-number``: one parameter, each value once
    (``PIPEMARK_CASES=cover`` keeps every case, conftest.py)."""
    cases = []
    for kind, drawn in DRAWN.items():
        for number, scenario in enumerate(drawn):
            known = _scenarios.known_failure(scenario)
            marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
            name = f"{kind}-{number}"
            cases.append(pytest.param(name, marks=marks, id=name))
    return cases


@pytest.mark.slow(first=True)
def test_the_scenarios_run_first_on_one_worker(outcomes):
    # Runs at the very start (conftest.py): one worker runs the scenarios while the
    # other runs other tests; the tests below find the results.
    for kind, (ran, printed) in outcomes.items():
        assert len(ran) == len(DRAWN[kind]), (
            f"{kind}: {len(ran)} of {len(DRAWN[kind])} ran\n{printed}"
        )


@pytest.mark.parametrize("case", _cases())
def test_scenario_matches_jax(outcomes, case):
    kind, number = case.rsplit("-", 1)
    ran, printed = outcomes[kind]
    scenario = DRAWN[kind][int(number)]
    if int(number) >= len(ran):
        pytest.fail(f"not run: the run stopped before it\n{printed}\n{json.dumps(scenario)}")
    outcome = _scenarios.Outcome(**{k: ran[int(number)][k] for k in _scenarios.Outcome._fields})
    assert outcome.scenario == scenario
    assert outcome.error is None, _scenarios.report(outcome)


def test_a_whole_equinox_module_trains():
    # Found by the scenario fuzzer (fixed on main in 9591641): pm.pipeline_train_step
    # refused an equinox module with a function field ("TypeError: Cannot determine
    # dtype of <PjitFunction of tanh>", in calls.shape_key), which
    # pm.pipeline_value_and_grad and eqx.filter_jit take.
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import pipemark as pm
    from tests._devices import computing_on, devices

    class Model(eqx.Module):
        w1: jax.Array
        w2: jax.Array
        act: object

    def loss_fn(model, batch):
        x, y = batch
        h = model.act(x @ model.w1)
        pm.mark_pipeline_boundary()
        return jnp.mean((h @ model.w2 - y) ** 2)

    tx = optax.sgd(0.1)

    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        arrays = eqx.filter(model, eqx.is_array)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, arrays)
        return eqx.apply_updates(model, updates), opt_state, loss

    used = devices(2)
    with computing_on(used[:1]):
        model = Model(jnp.full((3, 4), 0.1), jnp.full((4, 3), 0.1), jnp.tanh)
        state = (model, tx.init(eqx.filter(model, eqx.is_array)))
        batch = (jnp.ones((4, 3)), jnp.zeros((4, 3)))
        want = eqx.filter_jit(step)(*state, batch)
    pipe = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, devices=used)
    got = pipe(*state, batch)
    assert got[0].act is jnp.tanh
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(eqx.filter(got[0], eqx.is_array)), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
