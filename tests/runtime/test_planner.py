"""The layout planner (pipemark/runtime/planning/planner.py, cluster.py, workload.py): its
formulas against hand-computed cases, and its predictions against measurements: a
pipeline of native-sleep stages run here (one process, one device a stage), and the
TPU v5e S-stage runs recorded in benchmarks/results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
import pytest

import pipemark as pm
from pipemark.runtime.planning.cluster import (
    Cluster,
    Group,
    axis_group,
    collective_seconds,
    tpu_v5e,
)
from pipemark.runtime.planning.planner import predict_layout, rank_layouts, search_layouts
from pipemark.runtime.planning.workload import Layout, MeasuredPipeline, Transformer
from tests._xla import child_environ
from tests.runtime._planner_processes import fastest

_REPO = Path(__file__).resolve().parents[2]
# A cluster whose transfers and collectives take no time: the measured pipelines run
# in one process, their values copied between devices of one host.
FREE = Cluster("free links", 8, 8, 8, 2**40, 1e12, 1e15, 1e15, 2, 0.0, 1e15, 0.0)


def _unit(kind_costs=(1.0, 1.0, 1.0), stages=2, microbatches=4, schedule="1f1b", **extra):
    forward, backward, weight = kind_costs
    layout = Layout(pp=stages, schedule=schedule, microbatches=microbatches)
    model = MeasuredPipeline(
        {"forward": forward, "backward": backward, "weight": weight},
        layout,
        global_batch=microbatches,
        **extra,
    )
    return model, layout


# ------------------------------------------------------------------- the cluster


def test_axis_groups_follow_the_mesh_order_across_slices():
    cluster = tpu_v5e(1024)
    sizes = {"tp": 4, "fsdp": 64, "pp": 2, "dp": 2}
    assert axis_group(cluster, sizes, "tp") == Group(4, 1)
    assert axis_group(cluster, sizes, "fsdp") == Group(64, 1)
    assert axis_group(cluster, sizes, "pp") == Group(1, 2)  # stride 256: one a slice
    assert axis_group(cluster, sizes, "dp") == Group(1, 2)
    with pytest.raises(pm.PipemarkError, match="needs 2048 chips"):
        axis_group(cluster, {**sizes, "dp": 4}, "dp")


def test_ring_collectives_by_hand():
    cluster = tpu_v5e(1024)
    gib = 2**30
    # 8 chips along one torus dimension: 2 ports of 50 GB/s, 7 steps of 1 µs.
    want = 7 / 8 * gib / 100e9 + 7e-6
    assert collective_seconds(cluster, "reduce_scatter", gib, Group(8, 1)) == pytest.approx(want)
    assert collective_seconds(cluster, "all_reduce", gib, Group(8, 1)) == pytest.approx(2 * want)
    # 64 chips use all four ports.
    assert collective_seconds(cluster, "all_gather", gib, Group(64, 1)) == pytest.approx(
        63 / 64 * gib / 200e9 + 63e-6
    )
    # Across 4 slices, one chip in each: the host's 25 GB/s shared by its 8 chips.
    assert collective_seconds(cluster, "all_reduce", gib, Group(1, 4)) == pytest.approx(
        2 * (3 / 4 * gib / (25e9 / 8) + 3 * 25e-6)
    )
    assert collective_seconds(cluster, "all_reduce", gib, Group(1, 1)) == 0.0
    with pytest.raises(pm.PipemarkError, match="Unknown collective 'broadcast'"):
        collective_seconds(cluster, "broadcast", gib, Group(8, 1))


def test_a_bad_cluster_is_refused():
    with pytest.raises(pm.PipemarkError, match="chips_per_host = 0"):
        Cluster("x", 8, 0, 8, 1, 1.0, 1.0, 1.0, 1, 0.0, 1.0, 0.0)
    with pytest.raises(pm.PipemarkError, match="whole slices"):
        Cluster("x", 12, 4, 8, 1, 1.0, 1.0, 1.0, 1, 0.0, 1.0, 0.0)
    assert tpu_v5e(256).with_chips(1024).num_slices == 4


# -------------------------------------------------------------------- the models


def test_llama_parameter_counts_are_the_published_ones():
    assert Transformer.llama2_7b().parameters == pytest.approx(6.74e9, rel=0.01)
    assert Transformer.llama2_70b().parameters == pytest.approx(68.98e9, rel=0.01)


def test_the_stages_flops_add_up_to_6n_plus_attention():
    model = dataclasses.replace(Transformer.llama2_7b(seq=2048), efficiency=0.5)
    layout = Layout(pp=4, dp=2, fsdp=2, microbatches=8)
    peak = 1e12
    work = model.stage_work(layout, global_batch=64, peak_flops=peak)
    seconds = sum(work.forward) + sum(work.backward) + sum(work.weight)
    flops = seconds * peak * model.efficiency * layout.microbatches * layout.dp * layout.fsdp
    # 6 N (the matrices: no norms, no embedding lookup) and causal attention, 6 L s h
    # (PaLM's 12 L s h halved for the mask, as MaxText counts).
    tokens = 64 * 2048
    matrices = model.parameters - 32000 * 4096 - 32 * 2 * 4096
    want = (6 * matrices + 6 * 32 * 4096 * 2048) * tokens
    assert flops == pytest.approx(want, rel=1e-3)
    assert work.flops == pytest.approx(want, rel=1e-9)  # MaxText counts the head, not the lookup


def test_bad_layouts_say_what_to_do():
    with pytest.raises(pm.PipemarkError, match="pp = 0"):
        Layout(pp=0)
    with pytest.raises(pm.PipemarkError, match="Unknown schedule 'zz'"):
        Layout(schedule="zz")
    with pytest.raises(pm.PipemarkError, match="runs one stage a device"):
        Layout(pp=2, schedule="1f1b", stages_per_device=2)
    with pytest.raises(pm.PipemarkError, match="reduce = 'never'"):
        Layout(reduce="never")
    with pytest.raises(pm.PipemarkError, match="does not split into DP 3"):
        Transformer.llama2_7b().stage_work(Layout(dp=3), global_batch=8, peak_flops=1.0)
    with pytest.raises(pm.PipemarkError, match="64 pipeline stages for 32 layers"):
        Transformer.llama2_7b().stage_work(Layout(pp=64), global_batch=64, peak_flops=1.0)
    assert Layout(pp=2, schedule="zb-v").num_stages == 4


def test_measured_costs_scale_with_rows_a_chip_and_regroup():
    model, _ = _unit((1.0, 2.0, 0.0), stages=4, microbatches=4)
    work = model.stage_work(Layout(pp=2, microbatches=2), global_batch=4)
    assert work.forward == (4.0, 4.0)  # two stages each, twice the rows
    # Each stage split in two; its whole backward split into B = W = half of it.
    split = model.stage_work(Layout(pp=8, schedule="zb-h1", microbatches=8), global_batch=8)
    assert split.forward == (0.5,) * 8 and split.backward == split.weight == (0.5,) * 8
    with pytest.raises(pm.PipemarkError, match="measured with 4 stages, asked for 3"):
        model.stage_work(Layout(pp=3, microbatches=3), global_batch=3)
    with pytest.raises(pm.PipemarkError, match="give 4 non-negative numbers"):
        MeasuredPipeline({"forward": (1.0, 2.0)}, Layout(pp=4, microbatches=4), global_batch=4)


# --------------------------------------------------------------- the predictions


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_stages_take_the_textbook_makespan(schedule):
    model, layout = _unit((1.0, 2.0, 0.0), stages=4, microbatches=8, schedule=schedule)
    p = predict_layout(model, layout, FREE, global_batch=8, update=False)
    assert p.step_seconds == pytest.approx((8 + 4 - 1) * 3.0)  # (M + S - 1)(F + B)
    assert p.bubble_fraction == pytest.approx(3 / 11)
    assert p.idle_seconds == pytest.approx(3 * 3.0)


@pytest.mark.parametrize(("ahead", "one_f_one_b"), [(1, 5), (2, 5), (None, 8)])
def test_activations_in_flight_follow_the_schedule_and_the_dispatch_bound(ahead, one_f_one_b):
    # GPipe holds every microbatch's activations on each stage, 1F1B at most S, and one
    # more forward's while a backward runs with the next forward dispatched after it
    # (the first stage's B0, then F4); without a bound every forward's at once.
    for schedule, held in (("gpipe", 8), ("1f1b", one_f_one_b)):
        model, layout = _unit(stages=4, microbatches=8, schedule=schedule, activation_bytes=100)
        p = predict_layout(model, layout, FREE, global_batch=8, dispatch_ahead=ahead)
        assert p.memory["activations"] == held * 100


def test_transfers_over_dcn_lengthen_the_pipeline():
    cluster = Cluster("two slices", 2, 1, 1, 2**40, 1e12, 1e15, 1e15, 2, 0.0, 1e3, 0.5)
    model, layout = _unit((1.0, 1.0, 0.0), stages=2, microbatches=1, boundary_bytes=1000)
    p = predict_layout(model, layout, cluster, global_batch=1, update=False)
    # F0, 0.5 s latency + 1 s for 1000 bytes, F1, B1, the cotangent back, B0.
    assert p.step_seconds == pytest.approx(4 + 2 * 1.5)


def _reducing(reduce: str, overlap: bool):
    # Two stages of 8 layers, 1 s per action; data parallelism across two slices whose
    # DCN all-reduces a stage's gradients in 4 s.
    cluster = Cluster("slow DCN", 4, 1, 2, 2**40, 1e12, 1e15, 1e15, 2, 0.0, 5e8, 0.0)
    layout = Layout(pp=2, dp=2, microbatches=4, reduce=reduce)
    model = MeasuredPipeline(
        {"forward": 1.0, "backward": 1.0}, layout, global_batch=8, parameters=5e8, layers=8
    )
    return predict_layout(model, layout, cluster, global_batch=8, overlap=overlap, update=False)


def test_delayed_and_overlapped_reduction_is_measured_by_the_simulator():
    compute = 4 * 2.0 + 1 * 2.0  # M (F + B) and the pipeline's fill and drain
    reduction = 2 * 0.5 * 4 * 5e8 / 5e8  # ring all-reduce over 2 of 2 GB at 0.5 GB/s
    once = _reducing("step", overlap=False)
    assert once.step_seconds == pytest.approx(compute + reduction)
    # Started layer by layer during the last backward (1 s), it hides 7/8 s of it.
    overlapped = _reducing("step", overlap=True)
    assert overlapped.step_seconds == pytest.approx(compute + reduction - 7 / 8)
    # Reduced every microbatch, four times the traffic queues on the network: on the
    # first stage from 1/8 s into its first backward (which starts at 3 s), 16 s of it.
    every = _reducing("microbatch", overlap=True)
    assert every.step_seconds == pytest.approx(3 + 1 / 8 + 4 * reduction)
    assert every.reduction_seconds > 2 * overlapped.reduction_seconds


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_runtimes_reduction_at_the_end_of_the_call_is_predicted_too(schedule):
    # The runtime's reduce_gradients: each stage's reduction (4 s) once its last
    # backward ends, or every one after the pipeline's last action.
    cluster = Cluster("slow DCN", 4, 1, 2, 2**40, 1e12, 1e15, 1e15, 2, 0.0, 5e8, 0.0)
    layout = Layout(pp=2, dp=2, microbatches=4, schedule=schedule)
    model = MeasuredPipeline(
        {"forward": 1.0, "backward": 1.0}, layout, global_batch=8, parameters=5e8
    )
    after, end = (
        predict_layout(
            model, layout, cluster, global_batch=8, overlap=False, update=False,
            reduce_gradients=mode,
        )
        for mode in ("after_stage", "end_of_call")
    )  # fmt: skip
    if schedule == "1f1b":  # the last device to finish has its own exposed either way
        assert after.step_seconds == end.step_seconds == pytest.approx(10 + 4)
    else:  # two stages a device: both of the busiest device's queue after its last action
        assert end.reduction_seconds == pytest.approx(2 * 4)
        # ... or the first from its last backward, 2 s before the device's end.
        assert after.step_seconds == pytest.approx(end.step_seconds - 2)
    with pytest.raises(pm.PipemarkError, match=r"reduce_gradients is 'early'; use one of"):
        predict_layout(model, layout, cluster, global_batch=8, reduce_gradients="early")


def test_layouts_that_do_not_fit_are_refused_and_the_winner_explained():
    model = Transformer.llama2_7b()
    layouts = [
        Layout(pp=4, fsdp=64, microbatches=16, remat=True),
        Layout(pp=4, fsdp=64, microbatches=16, remat=True, schedule="zb-h1"),
        Layout(pp=1, dp=256, microbatches=4),  # 16 bytes a parameter unsharded
    ]
    ranking = rank_layouts(model, tpu_v5e(256), global_batch=1024, layouts=layouts)
    assert [p.layout for p in ranking.ranked] == [layouts[1], layouts[0]]
    assert ranking.ranked[0].bubble_fraction < ranking.ranked[1].bubble_fraction
    assert [r.layout for r in ranking.refused] == [layouts[2]]
    assert ranking.refused[0].peak_bytes > 16 * model.parameters
    text = ranking.explain()
    assert "Best: PP 4 × DP 1 × FSDP 64 × TP 1, zb-h1, M 16, remat" in text
    assert "pipeline bubble and transfer waits" in text and "Refused for memory" in text
    assert "| 1 | PP 4 × DP 1 × FSDP 64 × TP 1, zb-h1" in ranking.table()


def test_a_host_slower_than_the_actions_sets_the_pace():
    # One device, 8 microbatches of F = 1 and B = 2: 24 s of device time, 8 programs
    # (each microbatch's forward and backward are one: the runtime's fuse_steps).
    model, layout = _unit((1.0, 2.0, 0.0), stages=1, microbatches=8)
    slow = predict_layout(
        model, layout, dataclasses.replace(FREE, dispatch_seconds=3.0), global_batch=8,
        update=False,
    )  # fmt: skip
    assert slow.step_seconds == 8 * 3.0 + 3.0  # every dispatch, then the last program
    assert slow.host_seconds == slow.step_seconds - 24.0 and slow.idle_seconds == 0.0
    # At 4 s a dispatch the host sets the pace of 8 programs (35 s), not of 4 (28 s).
    assert "waiting for the host's dispatch +" in rank_layouts(
        model, dataclasses.replace(FREE, dispatch_seconds=4.0), global_batch=8,
        layouts=[layout, Layout(pp=1, microbatches=4)],
    ).explain()  # fmt: skip
    fast = dataclasses.replace(FREE, dispatch_seconds=0.5, wake_seconds=3.0)
    # The host runs ahead: only the first dispatch shows. With dispatch_ahead=1 it
    # waits for each program but one and wakes 3 s after it, then takes 0.5 s to
    # dispatch the next, longer than the 3 s program running meanwhile: the device
    # waits too.
    ahead = [
        predict_layout(model, layout, fast, global_batch=8, update=False, dispatch_ahead=k)
        for k in (None, 2, 1)
    ]
    assert ahead[0].step_seconds == 24.5 and ahead[0].host_seconds == 0.5
    assert ahead[0].step_seconds <= ahead[1].step_seconds < ahead[2].step_seconds
    # A host that spends 3 s a program once bounded (bounded_dispatch_seconds) sets the
    # pace under any bound, as a slow one does; unbounded it costs 0.5 s a program.
    bounded = dataclasses.replace(fast, bounded_dispatch_seconds=3.0)
    steps = [
        predict_layout(model, layout, bounded, global_batch=8, update=False, dispatch_ahead=k)
        for k in (None, 2, 4)
    ]
    assert [p.step_seconds for p in steps] == [24.5, 8 * 3.0 + 3.0, 8 * 3.0 + 3.0]
    with pytest.raises(pm.PipemarkError, match="dispatch_seconds = -1"):
        dataclasses.replace(FREE, dispatch_seconds=-1)
    with pytest.raises(pm.PipemarkError, match=r"bounded_dispatch_seconds = nan.*or None"):
        dataclasses.replace(FREE, bounded_dispatch_seconds=float("nan"))


def test_a_layout_that_eats_into_the_hbm_margin_is_refused():
    # 1F1B over 2 stages holds 2 microbatches' activations on the first, and a third's
    # while a backward runs with the next forward dispatched (dispatch_ahead=2): 930 of
    # the chip's 1000 bytes. It fits without a margin, not with the default 10 % free.
    small = Cluster("small HBM", 2, 2, 2, 1000, 1e12, 1e15, 1e15, 2, 0.0, 1e15, 0.0)
    model, layout = _unit(stages=2, microbatches=4, activation_bytes=310)
    p = predict_layout(model, layout, small, global_batch=4)
    assert p.peak_bytes == 930 and p.usable_bytes == pytest.approx(900) and not p.fits
    assert predict_layout(model, layout, small, global_batch=4, hbm_margin=0.0).fits
    refused = rank_layouts(model, small, global_batch=4, layouts=[layout])
    assert not refused.ranked and [r.layout for r in refused.refused] == [layout]
    kept = rank_layouts(model, small, global_batch=4, layouts=[layout], hbm_margin=0.04)
    assert [p.layout for p in kept.ranked] == [layout]
    assert "headroom 0.0 GiB beyond the margin of 0.0 GiB kept free" in kept.explain()
    with pytest.raises(pm.PipemarkError, match=r"hbm_margin = 1\.0"):
        rank_layouts(model, small, global_batch=4, layouts=[layout], hbm_margin=1.0)


def test_the_search_space_uses_every_chip_and_splits_the_batch():
    model = Transformer.llama2_7b()
    layouts = search_layouts(model, tpu_v5e(256), global_batch=256)
    assert layouts and all(layout.chips == 256 for layout in layouts)
    assert all(256 % (l.dp * l.fsdp * l.microbatches) == 0 for l in layouts)  # noqa: E741
    assert {l.schedule for l in layouts if l.pp == 1} == {"1f1b"}  # noqa: E741
    ranking = rank_layouts(
        Transformer.llama2_70b(), tpu_v5e(256), global_batch=256, layouts=[Layout(pp=1, dp=256)]
    )
    with pytest.raises(pm.PipemarkError, match="No layout of Llama 2 70B fits"):
        _ = ranking.best


# ---------------------------------------------------- against measured pipelines

if str(_REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(_REPO / "benchmarks"))

import _native_sleep as ns  # noqa: E402
import planner_check  # noqa: E402


def _measured_sleeps():
    """Stages that wait 10 ms in C each for F, B and W (the machine's two cores stay
    free), two stages on two CPU devices, 4 microbatches; their costs measured with
    ZB-H1 (B and W apart)."""
    example = ns.sleeping_split(num_stages=2, seconds=0.01, batch=8)
    devices = jax.devices()[:2]
    measuring = pm.pipeline_value_and_grad(
        example.loss_fn, num_microbatches=4, schedule="zb-h1", devices=devices
    )
    costs = measuring.action_costs(*example.args, repeat=2)
    model = MeasuredPipeline(costs, Layout(pp=2, schedule="zb-h1", microbatches=4), global_batch=8)
    return example, devices, model


def _predicted(model, schedule: str) -> float:
    layout = Layout(pp=2, schedule=schedule, microbatches=4)
    return predict_layout(model, layout, FREE, global_batch=8, update=False).step_seconds


def _one_process_errors() -> dict[str, float]:
    # Every schedule's call predicted from the costs measured with ZB-H1.
    example, devices, model = _measured_sleeps()
    errors = {}
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = pm.pipeline_value_and_grad(
            example.loss_fn, num_microbatches=4, schedule=schedule, devices=devices
        )
        measured = fastest(pipe, *example.args, calls=5)  # other work only slows a call
        errors[schedule] = _predicted(model, schedule) / measured - 1
    return errors


@pytest.mark.skipif(not ns.available(), reason="no working C compiler for the native sleep")
def test_predictions_from_measured_action_costs_are_within_10_percent_of_the_runs():
    # Up to three tries, each measuring the costs and the runs again: a machine loaded
    # by other tests (pytest -n 2 on two cores) slowed a ZB-H1 run 13 % once. A wrong
    # prediction misses every try.
    tries = [_one_process_errors()]
    while len(tries) < 3 and not all(abs(e) <= 0.10 for e in tries[-1].values()):
        tries.append(_one_process_errors())
    assert all(abs(e) <= 0.10 for e in tries[-1].values()), tries


def _process_errors(processes: int) -> dict[tuple[str, str], float]:
    record = {
        "costs": planner_check.measure_cpu_costs(processes, full=False),
        "dispatch_s": planner_check.measure_dispatch(),
    }
    env = child_environ({k: v for k, v in os.environ.items() if not k.startswith("PIPEMARK_")})
    record["measured"] = planner_check.run_processes(processes, env, full=False)
    rows = planner_check.cpu_process_checks(record, processes)
    return {(r["case"], r["layout"].split(", ")[1]): r["error"] for r in rows}


@pytest.mark.slow
@pytest.mark.benchmark_script
@pytest.mark.skipif(not ns.available(), reason="no working C compiler for the native sleep")
def test_predictions_are_close_to_runs_in_four_processes():
    # python -m pipemark.launch -n 4 (benchmarks/planner_check.py, docs/scale.md): four
    # stages, one a process, and 2 stages x 2 data-parallel replicas whose sub-meshes
    # span processes (gradients reduced once a call, across processes), predicted from
    # costs measured here and the latency of a collective the launched processes
    # measured. The 10 % check is the recorded run in docs/scale.md (`planner_check.py
    # --record-cpu`, the machine otherwise idle; asserted below). Here four processes
    # share two cores with the other pytest worker, and in CI the runs came out 9-15 %
    # slower than predicted, twice in a row (JAX 0.12.1): the bound here is 20 %, which
    # a planner that forgot a transfer, a reduction or the schedule's bubble still
    # fails, and so does 1F1B's order of transfers before its fix (19-28 % slower:
    # docs/scale.md). Up to two tries, as above. The wide stages' reduction is not run
    # here, nor the 2-process check (14 s more on an idle machine: CI's time).
    tries = [_process_errors(4)]
    if not all(abs(e) <= 0.20 for e in tries[-1].values()):
        tries.append(_process_errors(4))
    assert set(tries[-1]) == {
        ("pp", "1f1b"),
        ("pp", "zb-h1"),
        ("pp-dp", "1f1b"),
        ("pp-dp", "zb-h1"),
    }
    assert all(abs(e) <= 0.20 for e in tries[-1].values()), tries


def test_recorded_runs_in_two_and_four_processes_match_the_predictions():
    # The record docs/scale.md shows (`planner_check.py --record-cpu`, the machine
    # otherwise idle), predicted by today's planner: in 2 processes, 2 stages one a
    # process, and one stage whose sub-mesh spans both (its gradients reduced across
    # them: 4 MB a call in `reduce`); in 4, as above, and the wide stages' reduction.
    # Every pipeline kept its results where computed (gather_results=False), as the
    # predicted training step does.
    record = json.loads(planner_check.CPU_RECORD.read_text())
    rows = planner_check.recorded_cpu_checks(record)
    measured = {(r["processes"], r["case"], r["layout"]): r for r in rows if r["measured"]}
    schedules = {"pp": ("1f1b", "zb-h1"), "pp-dp": ("1f1b", "zb-h1"), "reduce": ("1f1b",)}
    shapes = {2: {"pp": "PP 2 × DP 1", "pp-dp": "PP 1 × DP 2", "reduce": "PP 1 × DP 2"},
              4: {"pp": "PP 4 × DP 1", "pp-dp": "PP 2 × DP 2", "reduce": "PP 2 × DP 2"}}  # fmt: skip
    assert set(measured) == {
        (n, case, f"{shape} × FSDP 1 × TP 1, {schedule}, M 4")
        for n, cases in shapes.items()
        for case, shape in cases.items()
        for schedule in schedules[case]
    }
    # The wide stages' reduction is part of the prediction (a few ms), not negligible.
    assert all(r["reduction"] > 1e-3 for key, r in measured.items() if key[1] == "reduce")
    # Every row within 10 %, but the wide stages in 4 processes: within 15 %. Those were
    # 1-11 % slower than predicted in five records on the idle machine (docs/scale.md):
    # their 4 replicas' CPU work (40 ms a call in each process, 160 ms of a 190 ms
    # call) shares the two cores, where the costs were measured an action at a time.
    for key, r in measured.items():
        assert abs(r["error"]) <= (0.15 if key[:2] == (4, "reduce") else 0.10), measured


def test_tpu_s_stage_runs_are_predicted_from_the_recorded_scan_step():
    rows = {(r["file"], r["config"]): r for r in planner_check.tpu_s_stage_checks()}
    assert len(rows) == 47
    ahead = {key: r["dispatch_ahead"] for key, r in rows.items()}
    assert (
        ahead.items()
        >= {
            ("recompute", "s16"): None,
            ("dispatch-ahead", "s16"): 2,
            ("dispatch-bound", "s16"): 2,
            ("dispatch-bound", "s16-d4"): 4,
            ("dispatch-bound", "s16-d0"): None,
            ("llama16-d4-f2", "s16-d4-f2"): 4,
        }.items()
    )
    fuse = {key: r["fuse_actions"] for key, r in rows.items()}
    assert fuse.items() >= {
        ("gpt16-d4-f2", "s16"): 1, ("llama16-fuse", "s16-f4"): 4, ("gpt16-s4", "s4"): 2,
    }.items()  # fmt: skip
    # The GPT's 248 programs (256 actions, the last stage's F and B one program) of
    # 0.36 to 0.72 ms: unbounded, the 16 forwards that start a step are shorter than
    # their 0.46 ms dispatch, so the chip waits for the host there (2 ms); bounded, a
    # program costs the host 0.59 ms, more than the chip's mean (0.56 ms), and the host
    # sets the pace (13 ms of waiting). Fused runs of 2 leave 164 programs, and the chip
    # waits 4 ms. 56 programs of 2.2 ms and more (S = 4) leave it waiting for the first.
    for key, r in rows.items():
        if "s4" in key[1]:
            assert r["host"] < 0.7e-3, (key, r)
        elif key[0] not in ("recompute", "dispatch-ahead", "dispatch-bound", "gpt16-d4-f2"):
            continue
        elif r["dispatch_ahead"] is None:
            assert 1.5e-3 < r["host"] < 2.5e-3, (key, r)
        elif r["fuse_actions"] == 1:
            assert 10e-3 < r["host"] < 20e-3, (key, r)
        else:
            assert 2e-3 < r["host"] < 6e-3, (key, r)
    assert all(abs(r["error"]) <= 0.10 for r in rows.values()), rows
    # With the unbounded host's cost under a bound, run 2's 16 stages with
    # dispatch_ahead=2 (165.7 ms) were 15 % above the prediction (docs/scale.md).
    same = dataclasses.replace(tpu_v5e(1), bounded_dispatch_seconds=None)
    before = {(r["file"], r["config"]): r for r in planner_check.tpu_s_stage_checks(same)}
    assert -0.16 < before[("dispatch-ahead", "s16")]["error"] < -0.14


def test_the_tpu_check_takes_every_recorded_s_stage_run_or_says_why_not():
    recorded = set()
    for path in planner_check.RESULTS.glob("accelerator-tpu-v5e-*.json"):
        results = json.loads(path.read_text())
        staged = any(r["config"].startswith("s") and r["config"][1:2] != "1" for r in results)
        if staged and any(r["config"] == "scan" for r in results):
            recorded.add(path.stem.removeprefix("accelerator-tpu-v5e-"))
    checked = set(planner_check.TPU_RUNS)
    assert recorded <= checked | set(planner_check.LEFT_OUT)
    assert not checked & set(planner_check.LEFT_OUT)
    assert all(planner_check.LEFT_OUT.values())


def test_the_v5e_host_is_the_recorded_measurement():
    record = json.loads((planner_check.RESULTS / "dispatch-tpu-v5e.json").read_text())
    cluster = tpu_v5e(1)
    assert cluster.dispatch_seconds == pytest.approx(record["dispatch_s"], rel=0.01)
    wake = record["program_round_trip_s"] - record["program_device_s"]
    assert cluster.wake_seconds == pytest.approx(wake - record["program_dispatch_s"], rel=0.01)
    # Bounded, the host's wall time per program, which would hold its waits for the
    # chip; the walking thread's CPU time rose as much (within the 10 ms steps, 0.04
    # ms a program, in which that host's CPU clock counts), so they took no
    # measurable time and it is all the host's cost per program.
    host, cpu = record["host_s"], record["host_cpu_s"]
    assert cluster.bounded_dispatch_seconds == pytest.approx(host["2"], rel=0.01)
    assert cpu["2"] - cpu["None"] >= host["2"] - host["None"] - 0.04e-3
