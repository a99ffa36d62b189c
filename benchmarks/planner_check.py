"""The layout planner's predictions (``pipemark.planner.predict_layout``) against runs:
the TPU v5e runs recorded in ``benchmarks/results`` (each S-stage pipeline on one chip,
predicted from a microbatched one-program step of the same model), and native-sleep
pipelines on CPU in 2 and in 4 processes (``tests/runtime/_planner_processes.py``),
predicted from their action costs measured in one process.

    python benchmarks/planner_check.py               # prints the TPU table docs/scale.md shows
    python benchmarks/planner_check.py --record-cpu  # runs the CPU check, records it
    python benchmarks/planner_check.py --record-cpu /tmp/again.json  # a repeat, elsewhere

Imported by ``tests/runtime/test_planner.py`` (which asserts the errors of the recorded
runs, and of fresh ones) and ``docs/scale.md`` (which prints the recorded ones).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from pipemark.runtime.planning.cluster import Cluster, tpu_v5e
from pipemark.runtime.planning.planner import predict_layout
from pipemark.runtime.planning.workload import Layout, MeasuredPipeline

RESULTS = Path(__file__).resolve().parent / "results"
#: The CPU check as last recorded (``--record-cpu``).
CPU_RECORD = RESULTS / "planner-cpu-processes.json"
_REPO = Path(__file__).resolve().parents[1]
_LAUNCHED = _REPO / "tests" / "runtime" / "_planner_processes.py"
#: The process counts of the CPU check: in each, every stage spans processes or sends
#: to another process.
PROCESS_COUNTS = (2, 4)


#: The TPU runs checked (``benchmarks/results/accelerator-tpu-v5e-NAME.json``), in the
#: order they were made: every run with S-stage rows and a scan of the same model that
#: day, but those of :data:`LEFT_OUT`. The dispatch-bound run recorded no scan: the
#: budget run's, also of 2026-12-06, stands for it.
TPU_RUNS = (
    "recompute", "dispatch-ahead", "budget", "dispatch-bound", "layouts-gpt",
    "llama16-recompute", "llama-mask16-recompute", "nnx16-recompute",
    "llama16-m16-recompute", "llama16-dispatch", "llama-flash16", "llama-flash16-padded",
    "llama16-fuse", "llama16-shared", "llama16-d4-f2", "gpt16-d4-f2", "nnx16-d4-f2",
    "llama-flash16-d4-f2", "llama-einsum16", "llama-untied16", "llama-mask16-d4-f2",
    "gpt16-s4", "gpt16-m16", "nnx16-m16", "llama-mask16-m16", "llama-einsum16-m16",
    "llama-untied16-m16", "llama-flash16-m16", "llama-flash16-m16-fold", "llama-flash16-fold",
    "llama16-fold",
)  # fmt: skip
#: Recorded TPU runs with S-stage rows that the check leaves out, and why.
LEFT_OUT = {
    "llama16": "the Llama before run 9 recomputed its attention scores (a defect since fixed)",
    "layouts-llama": "the 12-block Llama before run 9's fix",
    "layouts-llama-mask": "the 12-block Llama before run 9's fix",
    "llama-m16": "the 12-block Llama before run 9's fix",
}
_SCAN_OF = {"dispatch-bound": "budget"}
#: The runs made before ``fuse_actions`` defaulted to 2 (run 13's first,
#: ``llama-einsum16``, is the first after): they ran unfused unless a row says ``-fK``;
#: a later run takes the default. Run 10 (``llama16-fuse``) predates ``fuse_min_uses``:
#: it fused every run, as ``fuse_min_uses=1`` does.
UNFUSED_BY_DEFAULT = frozenset(TPU_RUNS[: TPU_RUNS.index("llama-einsum16")])
_CONFIG = re.compile(r"s(\d+)(-d\d+|-w\d+|-mem[\d.]+)?(-f\d+)?(-u\d+)?$")


def dispatch_ahead_of(file: str, config: str) -> int | None:
    """The ``dispatch_ahead`` a recorded TPU row ran with: its ``-dK`` (``-d0``: no
    bound), else its run's: none in run 1 (``recompute``), which predates the option,
    else the default, 2."""
    match = re.search(r"-d(\d+)", config)
    if match:
        return int(match.group(1)) or None
    return None if file == "recompute" else 2


def fuse_of(file: str, config: str) -> tuple[int, int | None]:
    """The ``fuse_actions`` and ``fuse_min_uses`` a recorded TPU row ran with: its
    ``-fK`` and ``-uN``, else its run's (:data:`UNFUSED_BY_DEFAULT`)."""
    actions = re.search(r"-f(\d+)", config)
    uses = re.search(r"-u(\d+)", config)
    fuse = int(actions.group(1)) if actions else 1 if file in UNFUSED_BY_DEFAULT else 2
    if uses:
        return fuse, int(uses.group(1))
    return fuse, 1 if file == "llama16-fuse" else None


def tpu_s_stage_checks(cluster: Cluster | None = None) -> list[dict]:
    """Each recorded TPU v5e run of an S-stage pipeline on one chip (:data:`TPU_RUNS`),
    predicted from a microbatched one-program step of the same model in the same run
    (``scan``: the whole model's forward and backward per microbatch, ``M``
    microbatches in one program), taken as one measured stage (F : B = 1 : 2) split
    evenly into S: one chip runs every action, each dispatched by the host
    (``cluster``'s ``dispatch_seconds``, or ``bounded_dispatch_seconds`` under a bound,
    and ``wake_seconds``; ``tpu_v5e(1)``'s by default) with the row's
    ``dispatch_ahead``, and the programs its ``fuse_actions`` makes (:func:`fuse_of`).
    Rows with a memory budget that recomputes activations
    (``s4-mem2.9``) run other programs and are left out, as is S = 1 (one program: the
    jit step itself)."""
    cluster = tpu_v5e(1) if cluster is None else cluster
    rows = []
    for name in TPU_RUNS:
        runs = _tpu_run(name)
        scan = next(r for r in _tpu_run(_SCAN_OF.get(name, name)) if r["config"] == "scan")
        for run in runs:
            match = _CONFIG.match(run["config"])
            if not match or match.group(1) == "1" or "mem2.9" in run["config"]:
                continue
            if run.get("status", "ok") != "ok":
                continue
            # Run 1 (recompute) did not record it: 8, as docs/benchmarks/tpu-v5e.md says.
            count, micro = int(match.group(1)), scan.get("microbatches", 8)
            step = scan["step_s"]
            model = MeasuredPipeline(
                {"forward": step / 3 / micro, "backward": 2 * step / 3 / micro},
                Layout(microbatches=micro),
                global_batch=scan["rows"],
            )
            layout = Layout(schedule="interleaved", stages_per_device=count, microbatches=micro)
            ahead = dispatch_ahead_of(name, run["config"])
            fuse, uses = fuse_of(name, run["config"])
            predicted = predict_layout(
                model, layout, cluster, global_batch=run["rows"], update=False,
                dispatch_ahead=ahead, fuse_actions=fuse, fuse_min_uses=uses,
            )  # fmt: skip
            rows.append(
                {"file": name, "config": run["config"], "dispatch_ahead": ahead,
                 "fuse_actions": fuse,
                 "measured": run["step_s"], "predicted": predicted.step_seconds,
                 "host": predicted.host_seconds,
                 "error": predicted.step_seconds / run["step_s"] - 1}
            )  # fmt: skip
    return rows


def _tpu_run(name: str) -> list[dict]:
    return json.loads((RESULTS / f"accelerator-tpu-v5e-{name}.json").read_text())


def report(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| run (benchmarks/results) | config | dispatch_ahead | fuse_actions | measured (ms) "
        "| predicted (ms) | of it waiting for the host (ms) | error | within 10 % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        within = "yes" if abs(r["error"]) <= 0.10 else "no"
        lines.append(
            f"| accelerator-tpu-v5e-{r['file']} | {r['config']} | {r['dispatch_ahead']} | "
            f"{r['fuse_actions']} | "
            f"{r['measured'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | {r['host'] * 1e3:.1f} | "
            f"{r['error']:+.1%} | {within} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------- CPU, in 2 and in 4 processes


def _launched():
    """``tests/runtime/_planner_processes.py`` as a module: its sizes and mesh."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_planner_processes", _LAUNCHED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _costs(example, mesh=None, devices=None) -> dict:
    """The action costs of ``example``'s 4-microbatch ZB-H1 pipeline (B and W apart)."""
    import pipemark as pm

    pipe = pm.pipeline_value_and_grad(
        example.loss_fn, num_microbatches=4, schedule="zb-h1", mesh=mesh, devices=devices
    )
    return pipe.action_costs(*example.args, repeat=2)


def measure_cpu_costs(processes: int = 4, full: bool = True) -> dict:
    """The action costs of the pipelines launched in ``processes`` processes, measured
    here, in one process (it needs ``processes`` CPU devices): ``"pp"`` one stage a
    device, ``"pp-dp"`` and ``"reduce"`` on the data-parallel mesh of ``processes / 2``
    stages. Each action runs alone, so that the one-process CPU client's
    one-multi-device-program-at-a-time rule does not matter here (see docs/scale.md).
    Not ``full``: without ``"reduce"``."""
    import _native_sleep as ns
    import jax

    launched = _launched()
    devices = jax.devices()[:processes]
    mesh = launched.dp_mesh(devices)
    stages = mesh.devices.shape[0]
    narrow = ns.sleeping_split(stages, launched.SECONDS, batch=8, width=launched.NARROW)
    wide = ns.sleeping_split(stages, launched.SECONDS, batch=8, width=launched.WIDE)
    costs = {
        "pp": _costs(ns.sleeping_split(processes, launched.SECONDS, batch=8), devices=devices),
        "pp-dp": _costs(narrow, mesh=mesh),
    }
    if full:
        costs["reduce"] = _costs(wide, mesh=mesh)
    return costs


def measure_dispatch(calls: int = 200) -> float:
    """The host's time to dispatch a program here: the median return of a jitted
    program's call on a small array, after a first (its compilation). The action costs
    measured here (``pipe.action_costs``) hold each action's own dispatch already (an
    action is timed from before its dispatch to its results), so on CPU this is what
    the host's dispatching adds beyond them: the next action's call while the device
    still runs the last."""
    import time

    import jax
    import jax.numpy as jnp

    add = jax.jit(lambda x: x + 1)
    x = jax.block_until_ready(add(jnp.zeros(8)))
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        y = add(x)
        seconds.append(time.perf_counter() - start)
        jax.block_until_ready(y)
    return sorted(seconds)[len(seconds) // 2]


def run_processes(
    processes: int = 4, environ: dict | None = None, full: bool = True, timeout: float = 300
) -> dict:
    """Run ``tests/runtime/_planner_processes.py`` under ``python -m pipemark.launch -n
    processes`` (not ``full``: ``--check``); its timings."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "seconds.json"
        command = [sys.executable, "-m", "pipemark.launch", "-n", str(processes)]
        launched = subprocess.run(
            [*command, str(_LAUNCHED), str(out), *([] if full else ["--check"])],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if launched.returncode:
            raise RuntimeError(f"the launched check failed:\n{launched.stderr[-3000:]}")
        return json.loads(out.read_text())


def cpu_cluster(
    collectives: dict,
    nbytes: float,
    latency: str = "latency",
    dispatch: float = 0.0,
    processes: int = 4,
) -> Cluster:
    """``processes`` CPU devices as the launched check measured them
    (``collectives``): each collective step or transfer between processes costs the
    measured ``latency`` (``"latency"``: of a collective of a few bytes between two
    processes; ``"latency_all"``: between all), and a two-device ring all-reduce of
    ``nbytes`` (``nbytes / (2 × port bandwidth)`` and two steps) takes the measured
    ``"all_reduce"``; each action costs the host ``dispatch`` (:func:`measure_dispatch`)."""
    step = collectives["latency"]
    port = nbytes / (2 * max(collectives["all_reduce"] - 2 * step, 1e-6))
    latency = collectives[latency]
    n = processes
    return Cluster(
        f"CPU, {n} processes", n, n, n, 2**40, 1e15, 1e15, port, 2, latency, 1e15, 0.0,
        dispatch_seconds=dispatch,
    )  # fmt: skip


def cpu_process_checks(record: dict, processes: int = 4) -> list[dict]:
    """Predicted against measured for each pipeline launched in ``processes``
    processes of ``record`` (``{"costs": measure_cpu_costs(processes), "measured":
    run_processes(processes), "dispatch_s": measure_dispatch()}``; a record without
    ``"dispatch_s"``, made before it was measured, takes 0), on :func:`cpu_cluster`; a
    reduction every microbatch, which the runtime does not do, predicted only
    (``measured`` ``None``)."""
    launched = _launched()
    costs, measured = record["costs"], record["measured"]
    # As dp_mesh lays them out: 2 replicas a stage (one stage in 2 processes).
    sub_meshes = {"pp": processes // 2, "dp": 2}
    layouts = {"pp": {"pp": processes}, "pp-dp": sub_meshes, "reduce": sub_meshes}
    layouts = {case: shape for case, shape in layouts.items() if case in costs}
    widths = {"pp": launched.NARROW, "pp-dp": launched.NARROW, "reduce": launched.WIDE}
    rows = []
    for case, shape in layouts.items():
        # Between stages of sub-meshes a transfer is a collective over all the processes.
        where = "latency" if case == "pp" else "latency_all"
        cluster = cpu_cluster(
            measured["collectives"], 4 * launched.WIDE**2, where, record.get("dispatch_s", 0.0),
            processes,
        )  # fmt: skip
        # 8 rows in 4 microbatches: 2 a microbatch, over dp replicas; float32.
        width = widths[case]
        model = MeasuredPipeline(
            costs[case], Layout(**shape, schedule="zb-h1", microbatches=4), global_batch=8,
            parameters=width**2 if case == "reduce" else 0,
            boundary_bytes=2 // shape.get("dp", 1) * width * 4,
        )  # fmt: skip
        variants = [(s, "step", t) for s, t in measured[case].items()]
        if case == "reduce":
            variants.append(("1f1b", "microbatch", None))
        for schedule, reduce, seconds in variants:
            layout = Layout(**shape, schedule=schedule, microbatches=4, reduce=reduce)
            # The runtime reduces a stage's gradients after its last action (no overlap).
            predicted = predict_layout(
                model, layout, cluster, global_batch=8, overlap=False, update=False
            )
            rows.append({
                "processes": processes, "case": case, "layout": str(layout), "measured": seconds,
                "predicted": predicted.step_seconds, "reduction": predicted.reduction_seconds,
                "error": None if seconds is None else predicted.step_seconds / seconds - 1,
            })  # fmt: skip
    return rows


def recorded_cpu_checks(record: dict) -> list[dict]:
    """:func:`cpu_process_checks` of each process count of ``record`` (as
    :func:`record_cpu` writes it), fewest processes first."""
    counts = sorted(record["processes"], key=int)
    return [row for n in counts for row in cpu_process_checks(record["processes"][n], int(n))]


def report_cpu(rows: list[dict]) -> str:
    """The rows of :func:`cpu_process_checks` as a markdown table."""
    lines = [
        "| processes | case | layout | measured (ms) | predicted (ms) | exposed reduction (ms) "
        "| error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = "not run" if r["measured"] is None else f"{r['measured'] * 1e3:.1f}"
        error = "" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(
            f"| {r['processes']} | {r['case']} | {r['layout']} | {measured} | "
            f"{r['predicted'] * 1e3:.1f} | {r['reduction'] * 1e3:.1f} | {error} |"
        )
    return "\n".join(lines)


def record_cpu(path: Path = CPU_RECORD) -> dict:
    """Measure the CPU check in each of :data:`PROCESS_COUNTS` (the costs here, which
    needs as many CPU devices, then the runs in that many processes) and write it to
    ``path``."""
    import datetime

    record: dict = {"date": datetime.date.today().isoformat(), "processes": {}}
    for processes in PROCESS_COUNTS:
        record["processes"][str(processes)] = {
            "costs": measure_cpu_costs(processes),
            "dispatch_s": measure_dispatch(),
            "measured": run_processes(processes),
        }
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    # --record-cpu [PATH]: PATH instead of the record docs/scale.md shows (a repeat).
    if sys.argv[1:2] == ["--record-cpu"]:
        import jax

        jax.config.update("jax_num_cpu_devices", max(PROCESS_COUNTS))
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        path = Path(sys.argv[2]) if sys.argv[2:] else CPU_RECORD
        print(report_cpu(recorded_cpu_checks(record_cpu(path))))
    else:
        print(report(tpu_s_stage_checks()))
