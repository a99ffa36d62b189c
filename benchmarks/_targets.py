"""The accelerator targets, every model and layout in one table, from the recorded runs of
``benchmarks/accelerator.py`` (its JSON results).

For each model and layout the table takes one configuration (:data:`LAYOUTS`: the
defaults at S 4; at S 16 ``dispatch_ahead=4`` and ``fuse_actions=2``) and the newest
run that measured it beside a scan of the same run (a step's ratio means something
only against the scan measured in the same run); the ballast check comes from the
newest run of that configuration that made one, the same run or a later. A cell no run
measured says so: the table is also the list of what is left to measure.

When the prediction changes and the step does not (run 16 paired the programs'
temporaries with fewer values in flight, ``pipemark.runtime.memory.held_while_running``),
an older check still bounds the step's whole peak by the rooms it tried: a cell whose
check tried another prediction than the current one (:data:`PREDICTED`, recorded by
``benchmarks/predicted_peaks.py``) is judged by those rooms against the current one
(``_ballast.rejudged``), the rooms of every check of the step since the run that timed
it, which bound its whole peak together (``_ballast.whole_peak``).

The targets: the step within 1.05 x the scan's, the first call within
1.5 x the scan's, and a predicted peak that is an upper bound and at most 1.07 x what
the step needs. The ballast settles the last: the step runs with the predicted peak
free (less a 64 MiB margin), and runs out of memory with ``1/1.07`` of it free.
"""

from __future__ import annotations

import functools

#: The layouts the issue names: a label, the configuration measured, the microbatches.
LAYOUTS = (
    ("S 4 × M 8", "s4", 8),
    ("S 16 × M 8", "s16-d4-f2", 8),
    ("S 4 × M 16", "s4", 16),
)
#: The issue's size: 16 blocks of the ``gpt`` preset (other runs chose other sizes).
LAYERS = 16
#: The TPU runs (``benchmarks/results/accelerator-tpu-v5e-NAME.json``) that measured a
#: layout's configuration at 16 blocks, in the order they were made: a later run's cell
#: replaces an earlier one's (the files record the day, not the hour).
RUNS = (
    "dispatch-ahead", "layouts-gpt", "budget", "ballast-gpt", "llama16",
    "llama16-recompute", "llama-mask16-recompute", "nnx16-recompute",
    "llama16-m16-recompute", "llama-flash16", "llama-flash16-padded", "llama16-d4-f2",
    "llama16-d4-f2-ballast", "gpt16-d4-f2", "nnx16-d4-f2", "llama-flash16-d4-f2",
    "llama-einsum16", "llama-untied16", "llama-mask16-d4-f2", "gpt16-s4", "gpt16-m16",
    "nnx16-m16", "llama-mask16-m16", "llama-einsum16-m16", "llama-untied16-m16",
    "gpt16-d4-f2-ballast", "nnx16-d4-f2-ballast", "llama-flash16-d4-f2-ballast",
    "llama-flash16-m16", "llama-flash16-m16-fold", "nnx16-d4-f2-ballast2", "llama-flash16-fold",
    "nnx16-d4-f2-running", "llama-flash16-running", "llama-flash16-m16-running",
    "llama-flash16-d4-f2-running", "llama16-running", "llama16-m16-running",
    "gpt16-d4-f2-running",
)  # fmt: skip


#: Recorded runs of a layout at 16 blocks that the table leaves out, and why.
LEFT_OUT = {
    "llama16-fold": "timed the tied Llama at S 4 without the ballast check, and a cell "
    "keeps no check older than its timing (_cell): its cell keeps run 9's timing and check",
}


#: The current predicted peaks of the cells on the TPU
#: (``benchmarks/results/PREDICTED.json``, by ``benchmarks/predicted_peaks.py``).
PREDICTED = "predicted-tpu-v5e"
#: Two predictions of a cell closer than this are the same (its batch's bytes move it).
SAME = 2**20


def recorded_predictions(name: str = PREDICTED) -> dict[tuple[str, str, int], dict]:
    """Per ``(model, configuration, microbatches)`` at :data:`LAYERS` blocks, the current
    predicted peak and buffers recorded in ``benchmarks/results/NAME.json``."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent / "results" / f"{name}.json"
    return {
        (r["model"], r["config"], r["microbatches"]): r
        for r in json.loads(path.read_text())
        if r["sizes"]["layers"] == LAYERS
    }


def recorded_runs(names: tuple[str, ...] = RUNS) -> list[tuple[str, list[dict]]]:
    """``(name, results)`` of each run in ``names``, in their order, read from
    ``benchmarks/results/accelerator-tpu-v5e-NAME.json`` beside this file."""
    import json
    from pathlib import Path

    results = Path(__file__).resolve().parent / "results"
    return [
        (name, json.loads((results / f"accelerator-tpu-v5e-{name}.json").read_text()))
        for name in names
    ]


def _cell(runs: list[tuple[str, list[dict]]], model: str, config: str, microbatches: int):
    """The newest run's (name, pipeline row, scan row) for this cell, and the newest
    (name, pipeline row, checks) with a ballast check of the configuration, ``checks``
    being ``(name, check)`` of every check since that run, oldest first; ``None`` where
    no run has one."""
    measured, ballast, checks = None, None, ()
    for name, results in runs:
        rows = {
            r["config"]: r
            for r in results
            if r.get("model", "gpt") == model
            and r.get("microbatches") == microbatches
            and (r.get("sizes") or {}).get("layers") == LAYERS
        }
        row, scan = rows.get(config), rows.get("scan")
        if row is None or row.get("status") != "ok":
            continue
        if scan is not None and scan.get("status") == "ok":
            # An older check is of older code; the later ones are of this step.
            measured, ballast, checks = (name, row, scan), None, ()
        if row.get("ballast") and measured is not None:
            checks += ((name, row["ballast"]),)
            ballast = (name, row, checks)
    return measured, ballast


def _met(value: float, target: float) -> str:
    return f"{value:.3f} ({'met' if value <= target else 'NOT met'})"


def ballast_cell(check: dict) -> str:
    """The ballast check as a cell (``benchmarks/_ballast.py``, which runs it)."""
    return _ballast().cell(check)


@functools.cache
def _beside(name: str):
    """``benchmarks/{name}.py``, however this file was loaded (a script, ``runpy``)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ballast():
    return _beside("_ballast")


def targets() -> tuple[float, float]:
    """The step's and the first call's targets, as ``accelerator.py`` judges its rows."""
    judged = _beside("accelerator").TARGETS
    return judged["s4"], judged["first"]


def _judged(ballast: tuple[str, dict, tuple], now: dict | None) -> tuple[str, dict, bool]:
    """A cell's newest ballast check judged against the current prediction ``now`` (a
    row of :func:`recorded_predictions`, or ``None``: the check's own): the cell, the
    prediction judged (``predicted_peak``, ``predicted_buffers``), and whether it is
    another than the check tried (then judged by the rooms of every check of the step)."""
    _, row, checks = ballast
    check = row["ballast"]
    tried = check.get("predicted")
    if now is None or tried is None or abs(now["predicted_peak"] - tried) < SAME:
        buffers = (row.get("memory") or {}).get("predicted_buffers")
        return ballast_cell(check), {"predicted_peak": tried, "predicted_buffers": buffers}, False
    return _ballast().rejudged(now["predicted_peak"], *(c for _, c in checks)), now, True


def rows(
    runs: list[tuple[str, list[dict]]], models: list[str], predictions: dict | None = None
) -> list[list[str]]:
    """One row a model and layout: the cells of :func:`table`."""
    lines, (step, first) = [], targets()
    for model in models:
        for layout, config, microbatches in LAYOUTS:
            measured, ballast = _cell(runs, model, config, microbatches)
            if measured is None:
                lines.append([model, layout, config, "not measured", "—", "—", "—", "—"])
                continue
            name, row, scan = measured
            now = (predictions or {}).get((model, config, microbatches))
            checked, source, judged = "not checked", name, {}
            if ballast is not None:
                checked, judged, other = _judged(ballast, now)
                # The checks the cell is judged by: the newest, or all for another prediction.
                used = [n for n, _ in ballast[2]] if other else [ballast[0]]
                source += "".join(f"; {n}" for n in used if n != name)
                source += f"; {PREDICTED}" if other else ""
            # The newest prediction: the current one, a later check's, the step's run's.
            predicted = next(
                (p for p in (now, judged, row.get("memory")) if p and p.get("predicted_peak")), {}
            ).get("predicted_peak")
            memory = f"{predicted / row['peak']:.2f}" if predicted and row.get("peak") else "—"
            lines.append([
                model, layout, config,
                _met(row["step_s"] / scan["step_s"], step),
                _met(row["first_s"] / scan["first_s"], first),
                memory, checked, f"{row.get('date', '?')}: {source}",
            ])  # fmt: skip
    return lines


def checked_rows(
    runs: list[tuple[str, list[dict]]], models: list[str], predictions: dict | None = None
) -> list[tuple[str, dict, dict, tuple[dict, ...]]]:
    """Each cell's newest ballast-checked pipeline row, as ``("model, layout: runs",
    row, prediction, checks)``: the prediction its check is judged against
    (:func:`_judged`), and every check of the step, which bound its peak together."""
    found = []
    for model in models:
        for layout, config, microbatches in LAYOUTS:
            _, ballast = _cell(runs, model, config, microbatches)
            if ballast is not None:
                now = (predictions or {}).get((model, config, microbatches))
                _, judged, _ = _judged(ballast, now)
                names, checks = zip(*ballast[2])
                label = f"{model}, {layout}: {' + '.join(names)}"
                found.append((label, ballast[1], judged, checks))
    return found


def table(
    runs: list[tuple[str, list[dict]]], models: list[str], predictions: dict | None = None
) -> str:
    """The markdown table of :func:`rows`, with a line counting what is met.

    ``runs`` are ``(name, results)`` pairs, oldest first: a later run's cell replaces an
    earlier one's; ``predictions``: :func:`recorded_predictions`, or ``None`` (each
    check judged against the prediction it tried)."""
    step, first = targets()
    header = [
        f"| model | layout | configuration | step ÷ scan (≤ {step}) | first call ÷ scan's "
        f"(≤ {first}) | predicted ÷ device peak | ballast: the step in the predicted room, "
        f"and out of memory in 1/{_ballast().TIGHT} of it | run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    body = rows(runs, models, predictions)
    counts = {
        "step": sum("(met)" in r[3] for r in body),
        "first call": sum("(met)" in r[4] for r in body),
        "ballast": sum(r[6].endswith("(met)") for r in body),
    }
    summary = ", ".join(f"{what} met in {n}" for what, n in counts.items())
    missing = sum(r[3] == "not measured" for r in body)
    lines = header + ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(
        [*lines, "", f"{len(body)} cells: {summary}; {missing} not measured"]
    )  # fmt: skip
