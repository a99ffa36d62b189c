"""Smoke runs of the benchmark scripts at tiny sizes, so that they keep working.

Their numbers are not checked here (timings on a shared CI machine mean nothing); the
scripts' tables and verdicts are.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.walk import iter_eqns
from tests._trees import assert_trees_close

REPO = Path(__file__).resolve().parents[1]


def _output_lines(script: str, *options: str) -> list[str]:
    """The lines a benchmark script prints (it must exit 0)."""
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *options],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return run.stdout.splitlines()


@pytest.mark.benchmark_script
def test_passes_benchmark_prints_its_table_and_verdict():
    lines = _output_lines("passes.py", "--sizes", "300", "--repeat", "1", "--kinds", "mlp")
    header = next(line for line in lines if line.startswith("| model |"))
    assert "bare sweep (µs/eqn)" in header and "passes / sweep" in header
    rows = [line for line in lines if line.startswith("| mlp |")]
    assert len(rows) == 1
    assert rows[0].count("|") == header.count("|")
    equations = int(rows[0].split("|")[2].replace(",", ""))
    assert abs(equations - 300) <= 20
    assert any(line.startswith("- mlp: ratio") and "bare def-use sweep" in line for line in lines)
    front = next(line for line in lines if line.startswith("- mlp, 300 equations: inline_calls"))
    assert "% of the pipeline" in front and "with the program in one jit" in front
    splits = [line for line in lines if "split_backward" in line and "ratio" in line]
    assert len(splits) == 3 and all("(target <= 0.05)" in line for line in splits)
    assert "a stage per layer" in splits[0] and "auto_layers into 8" in splits[1]


@pytest.mark.benchmark_script
def test_runtime_benchmark_prints_its_tables():
    # The benchmark's own check ($CC, cc or gcc, and the source compiles), not a twin.
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import _native_sleep

    kind = "native" if _native_sleep.available() else "callback"
    options = ["--quick", "--tables", "equal", "overhead", "--stage", kind, "--sleep-ms", "0.2"]
    lines = _output_lines("runtime.py", *options)
    header = next(line for line in lines if line.startswith("| stage |"))
    assert "overhead µs/tick" in header and "budget µs/tick" in header
    rows = [line for line in lines if line.startswith(f"| {kind} |")]
    assert len(rows) == 2 * 2 * 2  # S = 2, 4; M = 4, 8 (--quick); GPipe and 1F1B
    assert all(row.count("|") == header.count("|") for row in rows)
    # The benchmark says whether XLA runs the stage programs asynchronously: the native
    # stage must be (see benchmarks/_native_sleep.py), a callback stage never is.
    mode = next(line for line in lines if line.startswith(f"- {kind} stage program:"))
    assert mode.endswith("asynchronous" if kind == "native" else "dispatching thread"), mode
    assert any(line.startswith(f"- {kind}, S = 2: at the measured overhead") for line in lines)
    # One count of the rows within the target per stage kind and t, over all 8 rows.
    verdict = next(line for line in lines if line.startswith(f"- {kind}, t = 0.2 ms: "))
    within = int(verdict.split(": ")[1].split(" of ")[0])
    assert 0 <= within <= 8 and " of 8 rows within the target" in verdict, verdict
    overhead = [line for line in lines if line.startswith(("| gpipe |", "| 1f1b |"))]
    assert len(overhead) == 4


@pytest.mark.benchmark_script
def test_overhead_benchmark_prints_its_table_and_verdict():
    lines = _output_lines("overhead.py", "--quick")
    header = next(line for line in lines if line.startswith("| run |"))
    assert "/ jax.jit" in header and "host µs per action" in header
    table = lines[lines.index(header) : lines.index(header) + 7]
    rows = [line for line in table if line.startswith(("| `jax.jit", "| pipeline"))]
    assert len(rows) == 5 and all(row.count("|") == header.count("|") for row in rows)
    titles = [c.strip() for c in header.split("|")[1:-1]]
    cells = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[1:-1]] for row in rows}
    assert cells["`jax.jit(jax.value_and_grad(loss))`"][titles.index("/ jax.jit")] == "1.000"
    # Actions and programs per call: a fused forward and backward is one program.
    counts = {
        label: (c[titles.index("actions")], c[titles.index("programs")])
        for label, c in cells.items()
    }
    assert counts["pipeline, 1 stage × 1 microbatch"] == ("2", "1")
    assert counts["pipeline, 1 stage × 1 microbatch, unfused"] == ("2", "2")
    assert counts["pipeline, 1 stage × 4 microbatches"] == ("8", "4")
    assert counts["pipeline, 2 stages × 4 microbatches"] == ("16", "12")
    verdict = next(line for line in lines if line.startswith("- 1 stage × 1 microbatch: "))
    assert "(target ≤ 1.05: " in verdict and "(target ≤ 100: " in verdict
    after = lines[lines.index(verdict) + 1 :]
    parts = [line.split("|")[1].strip() for line in after if line.startswith("| ")]
    assert "placing the inputs" in parts and "dispatching the program(s)" in parts
    assert parts[-1] == "`jax.jit(jax.value_and_grad(loss))`, its call"


@pytest.mark.benchmark_script
def test_scan_benchmark_prints_balance_and_time():
    lines = _output_lines("scan.py", "--quick", "--repeat", "1")
    header = next(line for line in lines if line.startswith("| blocks |"))
    assert "forward balance" in header and "split / make_jaxpr" in header
    rows = [line for line in lines if line.startswith(("| 8 |", "| 7 |"))]
    assert len(rows) == 4 and all(row.count("|") == header.count("|") for row in rows)
    assert rows[0].split("|")[3].strip() == "2-2-2-2"  # 8 blocks into 4 stages
    assert any(line.startswith("- balance when the trip count divides") for line in lines)


@pytest.mark.benchmark_script
@pytest.mark.slow
def test_distributed_benchmark_prints_its_table():
    lines = _output_lines("distributed.py", "--processes", "2", "--quick")
    header = next(line for line in lines if line.startswith("| processes | schedule |"))
    titles = [c.strip() for c in header.split("|")[1:-1]]
    rows = [
        [c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| 2 |")
    ]
    steps = [row for row in rows if len(row) == len(titles)]
    assert [row[1] for row in steps] == ["1f1b", "1f1b +1 in flight", "1f1b, results kept"]
    for row in steps:  # the simulation with a transfer's latency is no faster than without
        assert float(row[titles.index("simulated / 1 process")]) >= 1.0
        assert float(row[titles.index("transfer latency (ms)")]) > 0
    header = next(line for line in lines if line.startswith("| processes | bytes moved"))
    assert "transport / raw" in header
    titles = [c.strip() for c in header.split("|")[1:-1]]
    transfers = [row for row in rows if len(row) == len(titles)]
    assert len(transfers) == 2  # 1 and 16 MiB transfers
    moved = transfers[0][titles.index("bytes moved per step")]
    assert moved == transfers[0][titles.index("boundary bytes per step")] and moved != "0"


@pytest.mark.benchmark_script
def test_zero_bubble_benchmark_prints_its_table():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import _native_sleep

    if not _native_sleep.available():
        import pytest

        pytest.skip("no C compiler for the native sleep stage")
    lines = _output_lines(
        "runtime.py", "--quick", "--tables", "zero-bubble", "--sleep-ms", "0.5", "--repeat", "1"
    )
    header = next(line for line in lines if line.startswith("| schedule | stages |"))
    assert "simulated bubble" in header and "measured / simulated" in header
    rows = [
        line
        for line in lines
        if line.startswith(("| 1f1b |", "| zb-h1 |", "| zb-v |", "| dualpipev |"))
    ]
    # --quick: 4 and 8 microbatches; DualPipeV's 8 stages need 8.
    assert [row.split("|")[1].strip() for row in rows] == [
        "1f1b", "zb-h1", "zb-v", "1f1b", "zb-h1", "zb-v", "dualpipev",
    ]  # fmt: skip
    assert all(row.count("|") == header.count("|") for row in rows)


@pytest.mark.benchmark_script
def test_reduction_overlap_benchmark_prints_both_modes_measured_and_simulated():
    # Both reduce_gradients modes side by side, measured and simulated, per schedule;
    # the simulator never predicts the reduction after each stage slower than at the
    # end of the call (its reductions can only start earlier).
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import _native_sleep

    if not _native_sleep.available():
        pytest.skip("no C compiler for the native sleep stage")
    for options in (["--quick"], ["--report"]):  # a fresh run; the recorded one
        lines = _output_lines("reduction_overlap.py", *options)
        header = next(line for line in lines if line.startswith("| schedule |"))
        titles = [c.strip() for c in header.split("|")[1:-1]]
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
        rows = [row for row in rows if row and row[0] in ("1f1b", "interleaved")]
        assert [row[0] for row in rows] == ["1f1b", "interleaved"]
        for row in rows:
            assert len(row) == len(titles)
            values = dict(zip(titles, row))
            end, after = (float(values[f"simulated, {m}"]) for m in ("end of call", "after stage"))
            assert 0 < after <= end
            measured = [float(values[f"measured, {m}"]) for m in ("end of call", "after stage")]
            assert min(measured) > 0 and float(values["sum of programs"]) > 0


@pytest.mark.benchmark_script
def test_blocks_benchmark_prints_what_cuts_between_blocks_cost():
    pytest.importorskip("penzai")
    lines = _output_lines("blocks.py", "--quick")
    header = next(line for line in lines if line.startswith("| model |"))
    rows = [line for line in lines if line.startswith("| llama |")]
    assert [row.split("|")[5].strip() for row in rows] == ["2", "4"]  # stages
    assert all(row.count("|") == header.count("|") for row in rows)
    assert all(row.rstrip(" |").endswith("between blocks") for row in rows)
    assert any(line.startswith("- cuts between blocks cost at most") for line in lines)


@pytest.mark.benchmark_script
@pytest.mark.slow
def test_submesh_benchmark_prints_its_table():
    lines = _output_lines("submesh.py", "--quick")
    header = next(line for line in lines if line.startswith("| layout"))
    titles = [c.strip() for c in header.split("|")[1:-1]]
    assert "pipeline / jit" in titles and "measured / simulated" in titles
    rows = [line for line in lines if line.startswith(("| 2 × 2 × 2 |", "| 4 × 2 |", "| 2 × 4 |"))]
    assert len(rows) == 3 * 3  # three layouts, GPipe, 1F1B and ZB-H1
    assert all(row.count("|") == header.count("|") for row in rows)
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        moved = cells[titles.index("bytes moved per step")]
        assert moved == cells[titles.index("boundary bytes per step")] and moved != "0", row
    assert "- bytes moved = boundary bytes in 9 of 9 rows" in lines


@pytest.mark.benchmark_script
@pytest.mark.slow
def test_tpu_marker_benchmark_prints_its_tables(tmp_path):
    # Slow (10-30 s): a process that imports JAX, runs the Pallas copies in interpret
    # mode and compiles a language-model step under two lowerings.
    out = tmp_path / "tpu_marker.md"
    lines = _output_lines("tpu_marker.py", "--quick", "--styles", "startend", "--out", str(out))
    assert out.read_text(encoding="utf-8").splitlines() == lines
    if not lines[0].endswith("(tpu)"):  # off a TPU the script says its numbers mean nothing
        assert lines[1].startswith("(no TPU: the Pallas kernels run in Pallas's interpreter")
    header = next(line for line in lines if line.startswith("| copy |"))
    rows = [line for line in lines if line.startswith(("| XLA:", "| marker kernel", "| a plain"))]
    assert rows[0].split("|")[4].strip() == "1.000"  # XLA's copy is the reference
    assert sum("copying by DMA" in row for row in rows) == 3 and len(rows) == 7
    assert all(row.count("|") == header.count("|") for row in rows)
    assert any(
        line.startswith("- the marker kernel's copy (`identity(alias=False)`") for line in lines
    )
    assert any(line.startswith("- by DMAs alone") for line in lines)
    header = next(line for line in lines if line.startswith("| markers | lowering |"))
    steps = [line for line in lines if line.startswith("| startend |")]
    assert [row.split("|")[2].strip() for row in steps] == ["barrier", "custom_call"]
    calls = steps[1].split("|")[5].split("/")
    assert int(calls[0].split()[0]) == int(calls[1]) > 0  # every marker is a call
    assert all(row.count("|") == header.count("|") for row in steps)
    assert any(line.startswith("- startend: custom_call ÷ barrier") for line in lines)
    assert not any("failed:" in line for line in lines)  # every kind ran


def _accelerator():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import accelerator

    return accelerator


@pytest.mark.benchmark_script
@pytest.mark.slow  # two processes, each compiling a bfloat16 GPT's step on CPU (~10 s)
def test_accelerator_benchmark_measures_each_row_in_its_own_process(tmp_path):
    out = tmp_path / "table.md"
    options = ["--size", "tiny", "--layers", "2", "--configs", "jit,s2", "--repeat", "1"]
    lines = _output_lines("accelerator.py", *options, "--microbatches", "2", "--out", str(out))
    assert out.read_text().splitlines() == lines[lines.index("") + 1 :]
    assert lines[lines.index("") + 1].endswith("; cpu (cpu); JAX " + jax.__version__)
    header = next(line for line in lines if line.startswith("| configuration |"))
    titles = [c.strip() for c in header.split("|")[1:-1]]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in lines
        if line.startswith(("| `jax.jit", "| pipeline"))
    }
    jit, piped = (
        rows["`jax.jit(value_and_grad)`, B 8"],
        rows["pipeline S 2, M 2, interleaved on 1 device, B 8"],
    )
    assert jit[titles.index("compilations")] == "1: loss_fn 1"
    assert piped[titles.index("temporaries (largest / sum)")].endswith("(3 programs)")
    assert all(row[titles.index("peak memory")].endswith("(RSS)") for row in (jit, piped))
    assert "- compilations in the timed calls after the first: none" in lines
    assert "- compilations while reading the compiled programs' memory: none" in lines
    results = json.loads(out.with_suffix(".json").read_text())
    assert [(r["config"], r["status"]) for r in results] == [("jit", "ok"), ("s2", "ok")]
    # One stage program per stage and kind, the last stage's forward and backward fused.
    assert results[1]["compiles"]["jit(run)"] == results[1]["memory"]["programs"] == 3
    # The pipeline's predicted peak at least holds its parameters (f32) and gradients.
    bench = _accelerator()
    count = bench.param_count(dict(bench.SIZES["tiny"], layers=2))
    assert results[1]["memory"]["predicted_peak"] > 2 * 4 * count
    assert any(line.startswith("- s2: predicted peak (`Pipeline.memory`) ") for line in lines)


@pytest.mark.benchmark_script
@pytest.mark.slow  # a process compiling a bfloat16 GPT's scan and pipeline on CPU (~15 s)
def test_training_curve_benchmark_prints_both_curves(tmp_path):
    out = tmp_path / "curve.md"
    options = ["--size", "tiny", "--layers", "2", "--stages", "2", "--microbatches", "2"]
    options += ["--steps", "10", "--every", "5", "--warmup", "2", "--markdown", str(out)]
    lines = _output_lines("training_curve.py", *options, "--json", str(tmp_path / "curve.json"))
    assert out.read_text().splitlines() == lines  # progress went to stderr
    # The docs render recorded results with report: the same text.
    recorded = json.loads((tmp_path / "curve.json").read_text())
    assert _training_curve().report(recorded).splitlines() == lines
    assert lines[0].endswith("; cpu (cpu); JAX " + jax.__version__)
    header = next(line for line in lines if line.startswith("| step |"))
    assert "`lax.scan` accumulation" in header and "pipeline S 2, M 2" in header
    assert header.endswith("| loss, `lax.scan` M 1 | JAX's own spread |")
    start = lines.index(header) + 2  # after the alignment row
    table = lines[start : lines.index("", start)]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table]
    assert [row[0] for row in rows] == ["1", "5", "10"]  # step 1, then every 5
    assert float(rows[-1][1]) < float(rows[0][1])  # the model learns
    # Both train the same model on the same microbatches in bfloat16 from the same
    # state: their losses stay within a bfloat16 rounding (2^-8 relative) of each other.
    for _, scan, piped, rel, other, spread in rows:
        assert float(rel) < 2**-8 and abs(float(piped) - float(scan)) < 2**-8 * float(scan)
        # The table rounds losses to 5 decimals: the recomputed spread is as rough.
        own = abs(float(other) - float(scan)) / float(scan)
        assert float(spread) == pytest.approx(own, rel=0.1, abs=2e-5)
    largest = next(line for line in lines if line.startswith("- largest relative difference: "))
    assert float(largest.split(": ")[1].split()[0]) < 2**-8, largest
    assert any(
        line.startswith("- JAX's own spread (`lax.scan` over 1 microbatches") for line in lines
    )
    for name in ("`lax.scan` accumulation", "pipeline"):
        line = next(line for line in lines if line.startswith(f"- {name}: first call "))
        assert line.endswith("over 9 steps, 0 compilations after the first"), line
    assert any(line.startswith("- pipeline / scan, mean step: ") for line in lines)


def _training_curve():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import training_curve

    return training_curve


def test_training_curve_batches_follow_their_rule_three_times_in_four():
    bench = _training_curve()
    (tokens, targets), *_ = bench.make_batches(dict(batch=64, seq=32, vocab=50), 2, seed=3)
    follows = targets == (5 * tokens + 3) % 50
    assert 0.7 < follows.mean() < 0.8  # 3 in 4, and a random token that happens to follow
    assert (tokens[:, 1:] == targets[:, :-1]).all()


def test_training_curve_table_and_summary_from_losses():
    bench = _training_curve()
    scan = {"losses": [4.0, 3.0, 2.5], "seconds": [9.0, 0.010, 0.030], "late_compiles": 0}
    piped = {"losses": [4.0, 3.003, 2.5], "seconds": [12.0, 0.022, 0.022], "late_compiles": 1}
    lines = bench.table(scan["losses"], piped["losses"], 2, 4, 8).splitlines()
    assert lines[0] == (
        "| step | loss, `lax.scan` accumulation | loss, pipeline S 4, M 8 | relative difference |"
    )
    assert lines[2:] == [  # step 1, every 2nd, and the last
        "| 1 | 4.00000 | 4.00000 | 0 |",
        "| 2 | 3.00000 | 3.00300 | 1.0e-03 |",
        "| 3 | 2.50000 | 2.50000 | 0 |",
    ]
    spread = dict(scan, losses=[4.0, 3.0015, 2.5], microbatches=4)
    assert bench.table(scan["losses"], piped["losses"], 2, 4, 8, spread["losses"], 4).splitlines()[
        3
    ] == ("| 2 | 3.00000 | 3.00300 | 1.0e-03 | 3.00150 | 5.0e-04 |")
    assert bench.summary(scan, piped, spread)[1] == (
        "- JAX's own spread (`lax.scan` over 4 microbatches against the scan): largest "
        "5.0e-04 at step 2; the pipeline's largest difference is 2.00 times that"
    )
    assert bench.summary(scan, piped) == [
        "- largest relative difference: 1.0e-03 at step 2 (bfloat16 rounds to 2^-8 = 3.9e-03 "
        "relative)",
        "- `lax.scan` accumulation: first call 9.0 s, mean step 20.0 ms over 2 steps, 0 "
        "compilations after the first",
        "- pipeline: first call 12.0 s, mean step 22.0 ms over 2 steps, 1 compilations after "
        "the first",
        "- pipeline / scan, mean step: 1.100",
    ]


def test_accelerator_table_and_verdicts_from_results():
    bench = _accelerator()
    sizes = dict(bench.SIZES["tiny"], preset="tiny")
    memory = {"programs": 1, "temp_max": 100, "temp_sum": 100, "args_sum": 10, "out_sum": 10}
    ok = {"status": "ok", "rows": 8, "compiles": {"jit(run)": 1}, "peak_kind": "device"}
    results = [
        dict(ok, config="jit", first_s=10.0, step_s=0.10, memory=memory, peak=1000),
        dict(ok, config="scan", first_s=20.0, step_s=0.08, memory=memory, peak=900),
        {"config": "s1", "status": "oom", "message": "HLO temporaries 2G exceeds available HBM 1G"},
        dict(ok, config="s4", first_s=40.0, step_s=0.085, memory=dict(memory, programs=8)),
        dict(ok, config="s16", first_s=31.0, step_s=0.2, memory=dict(memory, programs=32)),
        dict(ok, config="s16-d4", first_s=30.0, step_s=0.0836, memory=dict(memory, programs=32)),
    ]
    results[3]["peak"] = results[4]["peak"] = results[5]["peak"] = 1200
    lines = bench.table(results, sizes, 8).splitlines()
    assert len({line.count("|") for line in lines}) == 1
    assert "| out of memory: HLO temporaries 2G exceeds available HBM 1G |" in lines[4]
    assert "| 1.062 × scan, ≤ 1.05: not met |" in lines[5] and "(8 programs)" in lines[5]
    assert "| 31.0 (1.55 × scan, ≤ 1.5: not met) |" in lines[6]
    # A dispatch bound keeps the row's target (issue #40: S 4 and S 16 within 1.05 x).
    assert "| 30.0 (1.50 × scan, ≤ 1.5: met) |" in lines[7]
    assert "| 1.045 × scan, ≤ 1.05: met |" in lines[7]
    verdicts = bench.verdicts(results)
    assert verdicts[0].startswith("- s1 (S 1, M 1): step / jit: not measured (s1: oom; target")
    assert verdicts[1:6] == [
        "- s4 (S 4, M 8): step / scan 1.062 (target ≤ 1.05: not met)",
        "- s16 (S 16, M 8): step / scan 2.500 (target ≤ 1.05: not met)",
        "- s16: first call / the scan's 1.550 (target ≤ 1.5: not met)",
        "- s16-d4 (S 16, M 8): step / scan 1.045 (target ≤ 1.05: met)",
        "- s16-d4: first call / the scan's 1.500 (target ≤ 1.5: met)",
    ]
    # A run without a scan row (dispatch bounds alone) gives no verdict against one.
    assert not any("scan" in line for line in bench.verdicts(results[3:]))


def _targets():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import _targets

    return _targets


def _row(model: str, config: str, step: float, first: float = 10.0, **extra) -> dict:
    sizes = {"layers": 16}
    ok = {"status": "ok", "model": model, "microbatches": extra.pop("microbatches", 8)}
    return dict(ok, config=config, step_s=step, first_s=first, sizes=sizes, date="d", **extra)


def test_targets_table_takes_each_cell_from_the_newest_run_beside_its_scan():
    targets = _targets()
    ran = {
        "tries": [{"fraction": 1.0, "result": "ran"}, {"fraction": 0.95, "result": "out of memory"}]
    }
    loose = {"tries": [{"fraction": 1.0, "result": "ran"}, {"fraction": 0.9, "result": "ran"}]}
    memory = {"predicted_peak": 110}
    runs = [
        ("old", [_row("gpt", "scan", 1.0), _row("gpt", "s4", 1.2, ballast=ran)]),
        ("new", [_row("gpt", "scan", 1.0, first=20.0), _row("gpt", "s4", 1.04, memory=memory, peak=100)]),
        # No scan: its step says nothing, its ballast is of the newest measurement's code.
        ("ballast", [_row("gpt", "s4", 9.0, ballast=loose)]),
        ("other size", [_row("gpt", "scan", 1.0), dict(_row("gpt", "s4", 0.5), sizes={"layers": 4})]),
        ("m16", [_row("gpt", "scan", 1.0, microbatches=16), _row("gpt", "s4", 1.06, microbatches=16, ballast=ran)]),
    ]  # fmt: skip
    cells = {(r[0], r[1]): r for r in targets.rows(runs, ["gpt"])}
    assert cells["gpt", "S 4 × M 8"][3:] == [
        "1.040 (met)", "0.500 (met)", "1.10",
        "runs at 0.9, never out of memory (NOT met: loose)", "d: new; ballast",
    ]  # fmt: skip
    assert cells["gpt", "S 16 × M 8"][3] == "not measured"
    m16 = cells["gpt", "S 4 × M 16"]
    assert m16[3] == "1.060 (NOT met)" and m16[6] == "runs at 1.0, out of memory at 0.95 (met)"
    # A ballast check of an older run than the step's is of older code: not shown.
    without = targets.rows(runs[:2], ["gpt"])[0]
    assert without[6] == "not checked" and without[7] == "d: new"
    table = targets.table(runs, ["gpt"]).splitlines()
    assert len({line.count("|") for line in table[:-2]}) == 1 and table[-2] == ""
    assert (
        table[-1] == "3 cells: step met in 1, first call met in 2, ballast met in 1; 1 not measured"
    )
    # A current prediction other than the one the check tried: judged by its rooms.
    tried = {"limit": 1000 * 2**20, "predicted": 300 * 2**20, "tries": [
        {"fraction": 1.0, "ballast": 636 * 2**20, "result": "ran"},
        {"fraction": 0.97, "ballast": 709 * 2**20, "result": "out of memory"}]}  # fmt: skip
    rerun = [runs[0], ("check", [_row("gpt", "scan", 1.0), _row("gpt", "s4", 1.0, ballast=tried, peak=270 * 2**20)])]  # fmt: skip
    now = {("gpt", "s4", 8): {"predicted_peak": 310 * 2**20, "predicted_buffers": 1}}
    cell = targets.rows(rerun, ["gpt"], now)[0]
    assert cell[5:] == [
        "1.15",
        "needs 291–364 MiB, predicted 310 (met)",
        "d: check; predicted-tpu-v5e",
    ]
    assert targets.rows(rerun, ["gpt"])[0][6] == "runs at 1.0, out of memory at 0.97 (met)"
    under = {"tries": [{"fraction": 1.0, "result": "out of memory"}]}
    assert (
        targets.ballast_cell(under) == "never runs, out of memory at 1.0 (NOT met: under-predicted)"
    )


def test_ballast_breakdown_bounds_each_checked_cells_whole_peak():
    """Each cell's ballast check bounds the step's whole peak, and every check of the
    step bounds it together, more tightly; the bounds agree with the cell's verdict, for
    the prediction its newest check tried and for the current one: tight (met) where the
    prediction is within 1.07 x the lower bound."""
    targets = _targets()
    ballast = targets._ballast()
    runs, now = targets.recorded_runs(), targets.recorded_predictions()
    models = sorted({r.get("model", "gpt") for _, results in runs for r in results})
    rows = targets.checked_rows(runs, models, now)
    table = ballast.breakdown(rows).splitlines()
    assert len(rows) == 21 and len(table) == 2 + len(rows)
    assert sum(len(checks) > 1 for *_, checks in rows) >= 5
    for (label, row, prediction, checks), line in zip(rows, table[2:]):
        check = row["ballast"]
        assert checks[-1] is check and line.startswith(f"| {label} |")
        low, high = ballast.whole_peak(check)
        assert low < high <= check["predicted"] + ballast.MARGIN, label
        tight = "loose" not in ballast.cell(check)
        assert tight == (check["predicted"] <= ballast.TIGHT * low * (1 + 1e-9)), label
        together = ballast.whole_peak(*checks)
        assert low <= together[0] < together[1] <= high, label
        predicted = prediction["predicted_peak"]
        verdict = ballast.rejudged(predicted, *checks)
        covers = together[1] <= predicted + ballast.MARGIN
        met = covers and predicted <= ballast.TIGHT * together[0]
        assert verdict.endswith("(met)") == met, label


def test_the_recorded_predictions_are_those_the_latest_checks_tried():
    """``predicted-tpu-v5e.json`` (benchmarks/predicted_peaks.py) is of the code the
    ballast checks since run 16 ran: where both predict a cell they agree (a change of
    the prediction needs the file recorded again), and the older checks, of the
    prediction before, are judged by their rooms against it."""
    targets = _targets()
    runs, now = targets.recorded_runs(), targets.recorded_predictions()
    assert len(now) >= 18 and all(r["platform"] == "tpu" for r in now.values())
    # Run 16's checks, the first of the current prediction, and any later one.
    newest = set(targets.RUNS[targets.RUNS.index("nnx16-d4-f2-running") :])
    agreed = 0
    for name, results in runs:
        for r in results:
            key = (r.get("model", "gpt"), r["config"], r.get("microbatches"))
            if name in newest and r.get("ballast") and key in now:
                assert abs(now[key]["predicted_peak"] - r["ballast"]["predicted"]) < targets.SAME
                agreed += 1
    assert agreed >= 3
    models = sorted({r.get("model", "gpt") for _, results in runs for r in results})
    cells = targets.rows(runs, models, now)
    rejudged = [c for c in cells if c[7].endswith(targets.PREDICTED)]
    assert rejudged and all(c[6].startswith("needs ") for c in rejudged)


@pytest.mark.benchmark_script
def test_predicted_peaks_script_records_each_layouts_prediction(tmp_path):
    # The S 4 layouts of a 4-block tiny GPT (M 16 reuses M 8's programs).
    out = tmp_path / "predicted.json"
    options = ["--size", "tiny", "--layers", "4", "--models", "gpt", "--configs", "s4"]
    lines = _output_lines("predicted_peaks.py", *options, "--out", str(out))
    rows = [line for line in lines if line.startswith("| gpt |")]
    assert len(rows) == 2 and rows[0].startswith("| gpt | S 4 × M 8 | s4 |")
    recorded = json.loads(out.read_text())
    assert [(r["config"], r["microbatches"]) for r in recorded] == [("s4", 8), ("s4", 16)]
    assert all(r["predicted_peak"] > r["predicted_buffers"] > 0 for r in recorded)
    assert [r["sizes"]["batch"] for r in recorded] == [8, 16]
    assert all(r["sizes"]["layers"] == 4 and r["platform"] == "cpu" for r in recorded)


def test_targets_runs_name_every_recorded_tpu_run_of_a_layout_in_the_issues_size():
    targets = _targets()
    configs = {(config, microbatches) for _, config, microbatches in targets.LAYOUTS}
    recorded = set()
    for path in (REPO / "benchmarks" / "results").glob("accelerator-tpu-v5e-*.json"):
        results = json.loads(path.read_text())
        if any(
            (r["config"], r.get("microbatches")) in configs
            and (r.get("sizes") or {}).get("layers") == targets.LAYERS
            for r in results
        ):
            recorded.add(path.stem.removeprefix("accelerator-tpu-v5e-"))
    named = set(targets.RUNS) | set(targets.LEFT_OUT)
    assert named == recorded and len(targets.RUNS) + len(targets.LEFT_OUT) == len(recorded)
    assert not set(targets.RUNS) & set(targets.LEFT_OUT)


@pytest.mark.parametrize(
    ("message", "short"),
    [
        (
            "XlaRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
            "memory in memory space hbm. Used 26.81G of 15.75G hbm. Exceeded hbm capacity by "
            "11.06G.\n\nTotal hbm usage >= 27.06G:",
            "Used 26.81G of 15.75G hbm",
        ),
        (
            "RESOURCE_EXHAUSTED: HLO temporaries 26.81G exceeds available HBM 15.75G; more",
            "HLO temporaries 26.81G exceeds available HBM 15.75G",
        ),
        (
            "XlaRuntimeError: RESOURCE_EXHAUSTED: Error loading program: Attempting to reserve "
            "2.34G at the bottom of memory. That was not possible.",
            "Attempting to reserve 2.34G at the bottom of memory",
        ),
        ("ValueError: something else\nand more", "ValueError: something else"),
    ],
)
def test_accelerator_shortens_what_did_not_fit(message, short):
    bench = _accelerator()
    assert bench.short_error(message) == short
    assert bench.is_out_of_memory(message) == ("RESOURCE_EXHAUSTED" in message)


@pytest.mark.parametrize(
    ("config", "options", "target"),
    [
        ("s16", {}, "s16"),
        ("s16-d4", {"dispatch_ahead": 4}, "s16"),
        ("s16-d0-f4", {"dispatch_ahead": None, "fuse_actions": 4}, "s16"),
        ("s4-f2", {"fuse_actions": 2}, "s4"),
        ("s16-f2-u1", {"fuse_actions": 2, "fuse_min_uses": 1}, "s16"),
        ("s4-w2", {"microbatches_in_flight": 2}, "s4-w2"),
    ],
)
def test_accelerator_rows_options_from_their_names(config, options, target):
    bench = _accelerator()
    assert bench.pipeline_options(config) == options
    assert bench.stages_of(config) == int(config[1:].split("-")[0])
    assert bench._target_key(config) == target


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-mask", "nnx"])
def test_accelerator_models_pipelined_equal_jax_value_and_grad(model):
    """Issue #40: the benchmark's models as users write them (``jax.nn.dot_product_attention``
    with a mask; flax nnx ``MultiHeadAttention``), at a tiny size, split into two stages
    of two microbatches: JAX's own gradient within bfloat16 rounding."""
    bench = _accelerator()
    sizes = dict(bench.SIZES["tiny"], layers=2)
    ex = bench.model_example(model, sizes, 4, "boundary")
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]
    )
    plain = bench.model_example(model, sizes, 4, None)
    want = jax.jit(jax.value_and_grad(plain.loss_fn))(plain.params, plain.batch)
    # Two microbatches' means averaged against one mean; matmuls in bfloat16.
    assert_trees_close(pipe(*ex.args), want, rtol=2e-2, atol=2e-3)


@pytest.mark.slow  # the interpret mode's kernels compile slowly on CPU (~20 s)
def test_accelerator_flash_llama_pipelined_equals_jax_value_and_grad():
    """Issue #40: the Llama with Pallas's TPU flash attention kernel (on CPU in TPU
    interpret mode, at sequence 128, the kernel's block), split into two stages on one
    device as the benchmark runs it: each stage runs the kernel (the forward's
    ``pallas_call``, the backward's two), and the pipeline gives JAX's own gradient
    within bfloat16 rounding."""
    bench = _accelerator()
    sizes = dict(bench.SIZES["tiny"], layers=2, seq=bench.FLASH_BLOCK)
    device = jax.devices()[0]
    # jax_enable_checks (conftest.py) refuses the interpret mode's callbacks inside the
    # kernel's custom_vjp; the kernel's backward is traced with the gradient, so the
    # mode covers the whole test. One device: the pipeline walks on this thread.
    with bench.kernel_mode("llama-flash", device.platform), jax.enable_checks(False):
        ex = bench.model_example("llama-flash", sizes, 4, "boundary")
        pipe = pm.pipeline_value_and_grad(
            ex.loss_fn, num_stages=2, num_microbatches=2, schedule="interleaved",
            devices=[device],
        )  # fmt: skip
        got = pipe(*ex.args)
        stages = pipe.plan(*ex.args).staged.stages
        plain = bench.model_example("llama-flash", sizes, 4, None)
        want = jax.jit(jax.value_and_grad(plain.loss_fn))(plain.params, plain.batch)
    kernels = {
        s.name: sum(e.primitive.name == "pallas_call" for e in iter_eqns(s.closed_jaxpr))
        for s in stages
    }
    assert kernels == {"layer0": 1, "layer1": 1, "layer0_backward": 2, "layer1_backward": 2}
    # Two microbatches' means averaged against one mean; matmuls in bfloat16.
    assert_trees_close(got, want, rtol=2e-2, atol=2e-3)


def _capacity():
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import capacity

    return capacity


def test_capacity_search_finds_the_boundary_within_its_probes():
    largest = _capacity().largest
    calls = []

    def fits(n, need=lambda n: 1000 + 300 * n + n * n):  # bytes grow, a little faster
        calls.append(n)
        return {"fits": need(n) <= 20_000, "bytes": need(n)}

    found = largest(fits, 1, 1000, 20_000)
    boundary = max(n for n in range(1, 1000) if 1000 + 300 * n + n * n <= 20_000)
    assert (found["largest"], found["upper"], found["exact"]) == (boundary, boundary + 1, True)
    assert found["tried"] == calls and len(calls) <= 8 and len(set(calls)) == len(calls)
    # Without bytes the search doubles, then halves the gap.
    blind = largest(lambda n: {"fits": n <= 37, "bytes": None}, 1, 1000, 0, max_probes=20)
    assert (blind["largest"], blind["exact"]) == (37, True)
    assert blind["tried"][:7] == [1, 2, 4, 8, 16, 32, 64]
    # A cap that fits; a search stopped early; a start that does not fit.
    capped = largest(lambda n: {"fits": True, "bytes": 10 + n}, 1, 64, 10**6)
    assert (capped["largest"], capped["capped"], capped["tried"]) == (64, True, [1, 2, 64])
    cut = largest(lambda n: {"fits": n <= 37, "bytes": None}, 1, 1000, 0, max_probes=8)
    assert cut["largest"] < 37 < cut["upper"] and not cut["exact"]
    assert _capacity().cell(cut) == f"{cut['largest']}–{cut['upper'] - 1} (stopped)"
    # No probe starts that would end past the deadline, as long as the longest so far.
    slow = largest(lambda n: {"fits": True, "seconds": 60.0}, 1, 64, 0, 8, time.perf_counter() + 30)
    assert (slow["tried"], _capacity().cell(slow)) == ([1], "≥ 1 (stopped)")
    none = largest(lambda n: {"fits": False, "bytes": None}, 1, 64, 0)
    assert (none["largest"], none["exact"], none["tried"]) == (None, True, [1])


def test_capacity_search_goes_on_from_an_earlier_one():
    largest = _capacity().largest

    def fits(n):
        return {"fits": n <= 37, "bytes": None}

    cut = largest(fits, 1, 1000, 0, max_probes=7)  # 1, 2, ..., 64; then 48
    assert cut["tried"] == [1, 2, 4, 8, 16, 32, 64] and not cut["exact"]
    known = {int(n): probe for n, probe in cut["probes"].items()}
    again = largest(fits, 1, 1000, 0, max_probes=20, known=known)
    assert (again["largest"], again["exact"], again["recorded"]) == (37, True, 7)
    assert again["tried"][:7] == cut["tried"] and 37 in again["tried"]
    assert again["tried"] == largest(fits, 1, 1000, 0, max_probes=20)["tried"]
    # Nothing known fits: a search of its own; a known cap: no probe.
    fresh = largest(fits, 1, 1000, 0, max_probes=20, known={64: {"fits": False}})
    assert fresh["tried"][0] == 1 and fresh["recorded"] == 0 and fresh["largest"] == 37
    capped = largest(fits, 1, 16, 0, known={16: {"fits": True}})
    assert (capped["tried"], capped["capped"]) == ([16], True)


def _profile_ops():
    _accelerator()  # benchmarks/ on the path
    import profile_ops

    return profile_ops


def test_profile_groups_a_traces_device_operations_by_kind_and_shape():
    ops = _profile_ops()
    events = [
        ("XLA Modules", "jit_accumulate(12)", 9_000_000, {}),
        ("XLA Modules", "stage1_backward(3)", 3_000_000, {}),
        ("XLA Ops", "fusion.3", 2_000_000, {"long_name": "%fusion.3 = f32[1,16,1024,1024]{3,2,1,0} fusion(%a)"}),
        ("XLA Ops", "fusion.41", 4_000_000, {"long_name": "%fusion.41 = (f32[1,16,1024,1024]{3,2,1,0}, bf16[8]{0}) fusion()"}),
        ("XLA Ops", "copy.2", 1_000_000, {"hlo_category": "data formatting"}),
        ("XLA Ops", "%while.1 = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t)", 9_000_000, {}),
        ("Steps", "0", 20_000_000, {}),
    ]  # fmt: skip
    got = ops.summarise(events, steps=2, wall_s=0.014)
    assert (got["busy_ms"], got["wall_ms"]) == (6.0, 7.0)
    assert got["programs"] == {"jit_accumulate": [4.5, 0.5], "stage1_backward": [1.5, 0.5]}
    assert got["groups"] == {"fusion f32[1,16,1024,1024]": 3.0, "data formatting ?": 0.5}
    other = dict(got, config="s4", groups={"data formatting ?": 2.5})
    lines = ops.table([dict(got, config="scan"), other]).splitlines()
    assert lines[0] == "| | scan | s4 |" and lines[2] == "| wall ms a step | 7.00 | 7.00 |"
    # The groups that differ most first.
    assert lines[5:] == ["| `f32[1,16,1024,1024]` ms | 3.00 | 0.00 |", "| `?` ms | 0.50 | 2.50 |"]


@pytest.mark.benchmark_script
def test_profile_script_traces_each_configuration(tmp_path, capsys):
    out = tmp_path / "profile.json"
    options = ["--size", "tiny", "--layers", "2", "--configs", "scan,s2", "--steps", "1"]
    _profile_ops().main([*options, "--microbatches", "2", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["scan", "s2"]
    assert all(r["wall_ms"] > 0 and r["first_s"] > 0 for r in results)
    printed = capsys.readouterr().out
    if jax.default_backend() == "cpu":  # no device plane in a CPU's trace
        assert "no device operations in the trace" in printed
    else:
        assert all(r["busy_ms"] > 0 and r["groups"] for r in results)


def test_capacity_ratios_say_what_the_searches_bound():
    ratio = _capacity().ratio
    exact = {"largest": 4, "upper": 5}
    assert ratio({"largest": 12, "upper": 13}, exact) == "3.00 ×"
    assert ratio({"largest": 64, "upper": None}, exact) == "≥ 16.00 ×"  # the cap
    assert ratio({"largest": 12, "upper": 16}, exact) == "3.00–3.75 ×"  # stopped early
    assert ratio({"largest": 64, "upper": None}, {"largest": 64, "upper": None}) == "—"
    assert ratio({"largest": 8, "upper": 9}, {"largest": 64, "upper": None}) == "≤ 0.12 ×"


def _compiled_bytes(method: str, blocks: int, microbatches: int, rows: int = 8) -> int:
    """What ``jax.jit`` (or the scan over ``microbatches`` microbatches of ``rows`` rows)
    of the 16-wide MLP needs by its compiled ``memory_analysis()``, as the capacity
    script judges it."""
    loss_fn, params, batch = examples.mlp(blocks, 16, microbatches * rows, markers=None)
    if method == "jit":
        step = jax.value_and_grad(loss_fn)
    else:
        step = _accelerator().scan_accumulation(loss_fn, microbatches)
    analysis = jax.jit(step).lower(params, batch).compile().memory_analysis()
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


@pytest.mark.benchmark_script
@pytest.mark.slow  # a process making about 30 probes, each compiling an MLP step (~12 s)
def test_capacity_benchmark_finds_what_fits_a_pretend_limit(tmp_path):
    # The MLP (its programs compile in a tenth of the GPT's time) against 40,000 bytes:
    # all six searches in about 10 s.
    limit, out = 40_000, tmp_path / "capacity.json"
    options = ["--model", "mlp", "--layers", "2", "--d-model", "16", "--microbatch-rows", "8"]
    options += ["--microbatches", "4", "--max-microbatches", "16", "--max-blocks", "16"]
    options += ["--memory-bytes", str(limit)]
    # Three probes a search, then on from there (--resume) with up to 12 more (JAX 0.12:
    # the budget's plans take 10 in all): the searches end where one search ends.
    first = tmp_path / "first.json"
    _output_lines("capacity.py", *options, "--max-probes", "3", "--out", str(first))
    options += ["--max-probes", "12", "--resume", str(first)]
    lines = _output_lines("capacity.py", *options, "--out", str(out))
    results = json.loads(out.read_text())
    before = json.loads(first.read_text())
    assert results["runs"][0] == {"date": before["date"], "seconds": before["seconds"]}
    assert results["seconds"] == pytest.approx(sum(run["seconds"] for run in results["runs"]))
    assert f"s in all, in 2 runs ({before['date']}: {before['seconds']:.0f} s; " in lines[0]
    for search, earlier in zip(results["searches"], before["searches"]):
        assert search["tried"][: len(earlier["tried"])] == earlier["tried"]
        assert search["recorded"] == len(earlier["tried"]) == 3 or earlier["capped"]
    assert _capacity().report(results).splitlines() == lines  # the docs render the JSON
    assert lines[0].startswith(f"{results['date']}; cpu (cpu); JAX {jax.__version__}")
    assert "memory: a pretend limit of 39.06 KiB (`--memory-bytes`)" in lines
    header = lines.index("| method | largest batch (rows) | largest blocks | criterion |")
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in lines[header + 2 :][:3]}
    by = {(s["method"], s["axis"]): s for s in results["searches"]}
    for (method, axis), search in by.items():  # each search ended: exact, or at its cap
        assert search["exact"] or search["capped"], search
        for n, probe in search["probes"].items():  # each probe as its criterion says
            if method != "pipeline":
                assert probe["fits"] == (probe["bytes"] <= limit), (method, axis, n, probe)
    for method, name in _capacity().NAMES.items():
        cells = [c.strip() for c in rows[name]]
        wanted = "`memory_budget` accepts" if method == "pipeline" else "`memory_analysis()` within"
        assert cells[2].startswith(wanted)
        batch, blocks = by[(method, "batch")], by[(method, "blocks")]
        assert cells[:2] == [_capacity().cell(batch, 8), _capacity().cell(blocks)]
    # Measured at these sizes (microbatches of 8 rows; blocks at 4 microbatches): jax.jit
    # fits 13 microbatches and 7 blocks, the scan reaches the batch cap (its batch costs
    # only the inputs) and 11 blocks; the pipeline 15 microbatches and 10 blocks (the
    # MLP keeps little a rematerialisation saves).
    largest = {key: search["largest"] for key, search in by.items()}
    assert [largest[("jit", a)] for a in ("batch", "blocks")] == [13, 7]
    assert by[("scan", "batch")]["capped"] and largest[("scan", "blocks")] == 11
    assert [largest[("pipeline", a)] for a in ("batch", "blocks")] == [15, 10]
    assert "- pipeline ÷ jit: batch 1.15 ×, blocks 1.43 ×" in lines
    # Checked apart from the script: jax.jit's batch and the scan's blocks at the edge,
    # and memory_budget's verdict on the pipeline's.
    assert _compiled_bytes("jit", 2, 13) <= limit < _compiled_bytes("jit", 2, 14)
    assert _compiled_bytes("scan", 11, 4) <= limit < _compiled_bytes("scan", 12, 4)
    for blocks in (10, 11):
        loss_fn, params, batch = examples.mlp(blocks, 16, 32, markers="boundary")
        pipe = pm.pipeline_value_and_grad(
            loss_fn, num_stages=blocks, num_microbatches=4, schedule="interleaved",
            devices=jax.devices()[:1], memory_budget=limit,
        )  # fmt: skip
        if blocks == 10:
            pipe.plan(params, batch)
        else:
            with pytest.raises(pm.MemoryBudgetError):
                pipe.plan(params, batch)


@pytest.mark.benchmark_script
def test_dispatch_cost_takes_a_programs_device_time_and_dispatch_from_its_round_trip():
    # benchmarks/dispatch_cost.py's wake measurement (its pipeline part compiles a
    # GPT: run on a TPU, benchmarks/results/dispatch-tpu-v5e.json).
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import dispatch_cost

    cost = dispatch_cost.wake_cost(1)
    assert 0 < cost["program_dispatch_s"] < cost["program_round_trip_s"]
    assert cost["program_device_s"] > 0
    left = cost["program_round_trip_s"] - cost["program_device_s"] - cost["program_dispatch_s"]
    assert cost["wake_s"] == max(0.0, left)


_DOCTESTED = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if ">>>" in p.read_text())


@pytest.mark.benchmark_script
@pytest.mark.parametrize("name", _DOCTESTED)
def test_benchmark_modules_examples_hold(name):
    # The benchmarks are scripts, not in pytest's --doctest-modules paths: their
    # examples (the ballast's bounds and verdicts among them) are run here.
    import doctest
    import importlib

    _targets()  # puts benchmarks/ on sys.path
    failed, attempted = doctest.testmod(importlib.import_module(name))
    assert attempted and not failed, name


@pytest.mark.benchmark_script
def test_layer_costs_records_consistent_times_flops_and_memory(tmp_path):
    # benchmarks/layer_costs.py's tiny grid on CPU (~20-35 s: ten compilations); the
    # v5e grid runs on the TPU (issue #58, item 1).
    out = tmp_path / "layer-costs.json"
    options = ["--grid", "tiny", "--warmup", "1", "--repeats", "3", "--out", str(out)]
    lines = _output_lines("layer_costs.py", *options)
    result = json.loads(out.read_text())
    assert result["complete"] and result["jax_version"] == jax.__version__
    assert result["command"].startswith("layer_costs.py --grid tiny")
    records = result["records"]
    policies = ("none", "full", "save_dot_except_mlpwi", "minimal")
    by = {(r["name"], r["policy"]): r for r in records}
    assert sorted(by) == sorted(
        (s, p) for s in ("tiny-swiglu r2", "tiny-gelu r1") for p in policies
    )
    assert not any("error" in r for r in records)
    header = next(line for line in lines if line.startswith("| shape |"))
    rows = [line for line in lines if line.startswith("| tiny-")]
    assert len(rows) == 8 and all(row.count("|") == header.count("|") for row in rows)
    for name in ("tiny-swiglu r2", "tiny-gelu r1"):
        none, full = by[name, "none"], by[name, "full"]
        # Times measured, not ordered: on a shared CPU a millisecond program's
        # forward and backward can time below its forward alone (seen in a CI run).
        assert all(by[name, p]["fwdbwd_s"] > 0 and by[name, p]["fwd_s"] > 0 for p in policies)
        # (Whether full remat costs more is measured on the TPU, not asserted on a
        # shared CPU whose noise is larger than a millisecond program's recomputation.)
        assert none["recompute_s"] == 0.0
        # What a layer keeps for its backward pass: everything, the projections (minimal),
        # the attention's projections, only its input (full: rows × seq × d_model bf16).
        kept = [by[name, p]["residual_bytes"] for p in ("none", "minimal", "save_dot_except_mlpwi")]
        assert kept == sorted(kept, reverse=True) and kept[0] > kept[1]
        assert full["residual_bytes"] == 2 * full["rows"] * full["seq"] * full["d_model"]
        assert kept[2] > full["residual_bytes"]
        for r in (by[name, p] for p in policies):
            assert r["memory"]["temp_bytes"] > 0 and r["memory"]["output_bytes"] > 0
            assert r["training_flops"] == 3 * r["forward_flops"]
            assert r["training_tflops"] == pytest.approx(
                3 * r["forward_flops"] / r["fwdbwd_s"] / 1e12
            )
    # MaxText's count by hand for tiny-swiglu r2: d_model 64, 8 heads and 2 key/value heads
    # of 16, MLP 256 (SwiGLU: 3 matrices), 2 rows of 64 tokens = 128 tokens.
    tokens = 2 * 64
    qkv = 2 * tokens * 64 * (8 * 16 + 2 * 2 * 16)  # 3,145,728
    out_proj = 2 * tokens * (8 * 16) * 64  # 2,097,152
    mlp = 3 * 2 * tokens * 64 * 256  # 12,582,912
    attention = (2 * 2 * 64 * 64 * 16 * 8) * 2 // 2  # QKᵀ and AV, half for causal: 2,097,152
    swiglu = by["tiny-swiglu r2", "none"]
    assert swiglu["forward_flops_by_part"] == {
        "qkv": qkv,
        "out_proj": out_proj,
        "mlp": mlp,
        "attention": attention,
    }
    assert swiglu["forward_flops"] == 19_922_944


def test_the_readme_names_every_script_and_helper():
    # benchmarks/README.md says which scripts a user runs and which files are helpers.
    folder = Path(__file__).parents[1] / "benchmarks"
    readme = (folder / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(_?[a-z_]+\.py)`", readme))
    assert named == {p.name for p in folder.glob("*.py")}
