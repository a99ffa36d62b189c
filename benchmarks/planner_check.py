"""The layout planner's predictions (``pipemark.predict_layout``) against the TPU v5e
runs recorded in ``benchmarks/results``: each S-stage pipeline on one chip, predicted
from a microbatched one-program step of the same model.

    python benchmarks/planner_check.py   # prints the table docs/scale.md shows

Imported by ``tests/runtime/test_planner.py`` (which asserts the errors) and
``docs/scale.md`` (which prints them).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipemark.runtime.cluster import tpu_v5e
from pipemark.runtime.planner import predict_layout
from pipemark.runtime.workload import Layout, MeasuredPipeline

RESULTS = Path(__file__).resolve().parent / "results"


def tpu_s_stage_checks() -> list[dict]:
    """Each recorded TPU v5e run of an S-stage pipeline on one chip, predicted from a
    microbatched one-program step of the same model on the same day (``scan``: the
    whole model's forward and backward per microbatch, 8 microbatches in one program;
    the dispatch-bound run recorded none, so the budget run's, also of 2026-12-06),
    taken as one measured stage (F : B = 1 : 2) split evenly into S: one chip runs
    every action, so the prediction is the sum of the actions. Rows with a memory
    budget that recomputes activations (``s4-mem2.9``) run other programs and are left
    out, as is S = 1 (one program: the jit step itself)."""
    scans = {}
    rows = []
    for name in ("recompute", "dispatch-ahead", "budget", "dispatch-bound"):
        runs = json.loads((RESULTS / f"accelerator-tpu-v5e-{name}.json").read_text())
        scan = next((r for r in runs if r["config"] == "scan"), None) or scans["budget"]
        scans[name] = scan
        for run in runs:
            stages = run["config"].split("-")[0]
            if stages in ("scan", "s1") or not stages.startswith("s") or "mem2.9" in run["config"]:
                continue
            # Run 1 (recompute) did not record it: 8, as docs/performance.md says.
            count, micro = int(stages[1:]), scan.get("microbatches", 8)
            step = scan["step_s"]
            model = MeasuredPipeline(
                {"forward": step / 3 / micro, "backward": 2 * step / 3 / micro},
                Layout(microbatches=micro),
                global_batch=scan["rows"],
            )
            layout = Layout(schedule="interleaved", stages_per_device=count, microbatches=micro)
            predicted = predict_layout(
                model, layout, tpu_v5e(1), global_batch=run["rows"], update=False
            ).step_seconds
            rows.append(
                {"file": name, "config": run["config"], "measured": run["step_s"],
                 "predicted": predicted, "error": predicted / run["step_s"] - 1}
            )  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| run (benchmarks/results) | config | measured (ms) | predicted (ms) | error | within 10 % |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| accelerator-tpu-v5e-{r['file']} | {r['config']} | {r['measured'] * 1e3:.1f} | "
            f"{r['predicted'] * 1e3:.1f} | {r['error']:+.1%} | "
            f"{'yes' if abs(r['error']) <= 0.10 else 'no'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(tpu_s_stage_checks()))
