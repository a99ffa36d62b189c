"""Each stage's gradient reduction over its data-parallel replicas dispatched right after
the stage's last action (``reduce_gradients="after_stage"``, the default) against after
the call's last action (``"end_of_call"``), on host CPU devices: both measured side by
side in one run, and both as the layout planner's simulator predicts them.

    python benchmarks/reduction_overlap.py                   # 2 slots × 2 replicas
    python benchmarks/reduction_overlap.py --quick           # tiny, to check that it runs
    python benchmarks/reduction_overlap.py --record          # and write RECORD
    python benchmarks/reduction_overlap.py --report          # print RECORD's table

The model is ``_native_sleep.sleeping_split``: per stage one ``width × width`` float32
weight whose forward, input cotangent and weight gradient each wait ``--sleep-ms`` in C
besides their products (a part of each action that the machine's load does not
stretch), on a ``("stage", "data")`` mesh of ``--slots × --replicas`` host devices, ``--microbatches``
microbatches of ``2 × replicas`` rows. A row per schedule: 1F1B (one stage a slot) and
interleaved (two stages a slot, each slot's first stage finishing its backwards while
its second still runs). Per row:

* **measured**: the fastest of ``--repeat`` calls of each mode, the two called in turn
  (other work on a shared machine only slows a call; the record keeps the medians
  too), and the median over the rounds of the ratio of a round's two calls (which
  other work, coming and going, changes least);
* **simulated**: :func:`pipemark.planner.predict_layout` of a
  :class:`pipemark.planner.MeasuredPipeline` of the plan's action costs (``Pipeline.action_costs``: each action alone on its
  sub-mesh), ``width²`` parameters a stage, on a cluster of the mesh's devices whose
  all-reduce of a stage's gradients over the replicas takes what the runtime's
  reduction program takes alone (measured), each action costing the host a jitted
  call's dispatch (``planner_check.measure_dispatch``); with ``reduce_gradients`` of
  each mode and ``overlap=False`` (the runtime starts a reduction when its stage's
  last action ends, not layer by layer during it);
* **sum of programs**: every action's cost and every reduction's, added up: the step
  if no two programs ever overlap.

What to expect on one host: the two modes the same, within the machine's noise. A
reduction of these stages takes a millisecond or two against a step of a hundred or
more, and XLA's CPU client runs one program over several devices of a process at a
time (docs/scale.md, "CPU, one process, data parallelism"), so a reduction dispatched
early takes its turn among the other stages' programs rather than running beside
them. The simulator lets devices run side by side: its ratio is what dispatching the
reduction early buys where they do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORD = HERE / "results" / "reduction-overlap-cpu.json"
MODES = ("end_of_call", "after_stage")
#: The schedules measured, with their stages per slot.
SCHEDULES = {"1f1b": 1, "interleaved": 2}


def _step_times(pipes: dict, args: tuple, repeat: int) -> dict[str, list[float]]:
    """Each pipeline's calls, timed, the pipelines called in turn round after round
    (after two warm-up calls each), so that the machine's other work lands on all."""
    import jax

    for pipe in pipes.values():
        for _ in range(2):
            jax.block_until_ready(pipe(*args))
    times: dict[str, list[float]] = {mode: [] for mode in pipes}
    for _ in range(repeat):
        for mode, pipe in pipes.items():
            start = time.perf_counter()
            jax.block_until_ready(pipe(*args))
            times[mode].append(time.perf_counter() - start)
    return times


def _reduction_seconds(plan, repeat: int) -> list[float]:
    """Each reducing stage's reduction program timed alone (the median of ``repeat``
    after one), on zeros of its accumulators, in stage index order."""
    import jax

    seconds = []
    for _, unit in sorted(plan.units.items()):
        if unit.finish is None:
            continue
        accs = list(unit.zeros())
        jax.block_until_ready(unit.finish(accs))
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            jax.block_until_ready(unit.finish(accs))
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return seconds


def measure(options: argparse.Namespace) -> dict:
    """Both modes of each schedule measured: steps, action costs, reductions."""
    import _native_sleep as ns
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import pipemark as pm

    slots, replicas = options.slots, options.replicas
    mesh = Mesh(
        np.array(jax.devices()[: slots * replicas]).reshape(slots, replicas), ("stage", "data")
    )
    rows = 2 * replicas * options.microbatches
    measured = {}
    for schedule, per_slot in SCHEDULES.items():
        stages = slots * per_slot
        example = ns.sleeping_split(stages, options.sleep_ms / 1e3, batch=rows, width=options.width)
        pipes = {
            mode: pm.pipeline_value_and_grad(
                example.loss_fn,
                num_stages=stages,
                num_microbatches=options.microbatches,
                schedule=schedule,
                mesh=mesh,
                reduce_gradients=mode,
            )
            for mode in MODES
        }
        times = _step_times(pipes, example.args, options.repeat)
        # The fastest call: the machine's other work only slows a call.
        steps = {mode: min(t) for mode, t in times.items()}
        plan = pipes["after_stage"].plan(*example.args)
        measured[schedule] = {
            "stages": stages,
            "steps": steps,
            "medians": {mode: statistics.median(t) for mode, t in times.items()},
            # Each round's two calls one after another: the median of their ratios.
            "paired": statistics.median(
                a / b for a, b in zip(times["after_stage"], times["end_of_call"])
            ),
            "costs": pipes["after_stage"].action_costs(*example.args, repeat=options.cost_repeat),
            "reductions": _reduction_seconds(plan, options.repeat),
        }
        print(
            f"{schedule}: " + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in steps.items()),
            flush=True,
        )
    return measured


def cpu_cluster(devices: int, replicas: int, nbytes: float, seconds: float, dispatch: float):
    """The host devices as the planner sees them: one slice, no latency, ICI ports
    fast enough that a ring all-reduce of ``nbytes`` over ``replicas`` takes
    ``seconds`` (what the runtime's reduction took alone), each action costing the
    host ``dispatch``."""
    from pipemark.runtime.planning.cluster import Cluster, Group, collective_seconds

    def cluster(link: float) -> Cluster:
        return Cluster(
            f"CPU, {devices} host devices", devices, devices, devices, 2**40, 1e15, 1e15,
            link, 2, 0.0, 1e15, 0.0, dispatch_seconds=dispatch,
        )  # fmt: skip

    # Without latency a collective's time is inversely proportional to the bandwidth.
    unit = collective_seconds(cluster(1.0), "all_reduce", nbytes, Group(replicas, 1))
    return cluster(unit / max(seconds, 1e-9))


def predictions(record: dict) -> list[dict]:
    """Per schedule of ``record``: its measured steps, the planner's for each mode, and
    the sum of its programs."""
    from pipemark.runtime.planning.planner import predict_layout
    from pipemark.runtime.planning.workload import Layout, MeasuredPipeline

    config = record["config"]
    slots, replicas, width = config["slots"], config["replicas"], config["width"]
    microbatches = config["microbatches"]
    rows = []
    for schedule, measured in record["schedules"].items():
        reductions = measured["reductions"]
        cluster = cpu_cluster(
            slots * replicas, replicas, 4 * width**2, max(reductions), record["dispatch_s"]
        )
        layout = Layout(pp=slots, dp=replicas, schedule=schedule, microbatches=microbatches)
        batch = 2 * replicas * microbatches
        model = MeasuredPipeline(measured["costs"], layout, global_batch=batch, parameters=width**2)
        simulated = {
            mode: predict_layout(
                model, layout, cluster, global_batch=batch, overlap=False, update=False,
                reduce_gradients=mode,
            ).step_seconds
            for mode in MODES
        }  # fmt: skip
        actions = microbatches * sum(map(sum, measured["costs"].values()))
        rows.append({
            "schedule": schedule, "stages": measured["stages"], "measured": measured["steps"],
            "paired": measured["paired"],
            "simulated": simulated, "programs": actions + sum(reductions),
            "reduction": max(reductions),
        })  # fmt: skip
    return rows


def report(record: dict) -> str:
    """The record as a markdown table (times in ms; ratios after stage / end of call)."""
    config = record["config"]
    lines = [
        f"{config['slots']} slots × {config['replicas']} replicas of {config['width']}-wide "
        f"stages, {config['sleep_ms']} ms per F, B and W, {config['microbatches']} "
        f"microbatches; {record['cpus']} CPU cores, JAX {record['jax']}, recorded "
        f"{record['date']}",
        "",
        "| schedule | stages | reduction alone | measured, end of call | measured, after "
        "stage | after / end, median of rounds | simulated, end of call | simulated, after "
        "stage | after / end | sum of programs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in predictions(record):
        measured, simulated = r["measured"], r["simulated"]
        lines.append(
            f"| {r['schedule']} | {r['stages']} | {r['reduction'] * 1e3:.2f} | "
            f"{measured['end_of_call'] * 1e3:.1f} | {measured['after_stage'] * 1e3:.1f} | "
            f"{r['paired']:.3f} | "
            f"{simulated['end_of_call'] * 1e3:.1f} | {simulated['after_stage'] * 1e3:.1f} | "
            f"{simulated['after_stage'] / simulated['end_of_call']:.3f} | "
            f"{r['programs'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2, help="pipeline device slots")
    parser.add_argument("--replicas", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--sleep-ms", type=float, default=2.0)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=15, help="timed calls of each mode")
    parser.add_argument("--cost-repeat", type=int, default=3, help="action_costs' repeat")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--record", action="store_true", help=f"write {RECORD.name}")
    parser.add_argument("--report", action="store_true", help=f"print {RECORD.name}'s table")
    options = parser.parse_args(argv)
    if options.report:
        print(report(json.loads(RECORD.read_text())))
        return
    if options.quick:
        options.width, options.sleep_ms, options.repeat, options.cost_repeat = 64, 0.5, 2, 1
    from _host_devices import use_host_devices

    use_host_devices(options.slots * options.replicas)
    sys.path.insert(0, str(HERE))
    import jax
    import planner_check

    record = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "config": {
            name: getattr(options, name)
            for name in ("slots", "replicas", "width", "sleep_ms", "microbatches", "repeat")
        },
        "dispatch_s": planner_check.measure_dispatch(),
        "schedules": measure(options),
    }
    print()
    print(report(record))
    if options.record:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
