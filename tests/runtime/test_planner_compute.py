"""The layout planner's compute and architectures (issue 58, items 1 and 2): the
measured TPU v5e layer costs it reads, their interpolation and scaling to other chips,
the transformer's architectures and remat policies, and its FLOPs against MaxText's
formula (``calculate_tflops_training_per_device``, transcribed below)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import pipemark as pm
from pipemark.runtime.planning.cluster import tpu_v5e
from pipemark.runtime.planning.measured import PACKAGED, LayerCosts, LayerRates, LayerShape
from pipemark.runtime.planning.planner import predict_layout
from pipemark.runtime.planning.workload import Layout, Transformer

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "layer-costs-tpu-v5e.json"
RECORDS = json.loads(RESULTS.read_text())["records"]


def test_the_package_ships_the_measured_records():
    assert PACKAGED.read_bytes() == RESULTS.read_bytes()  # copy after a new measurement
    setup = (ROOT / "setup.py").read_text()
    assert '"pipemark.runtime.planning": ["*.json"]' in setup


def _shape(r: dict) -> LayerShape:
    return LayerShape(
        r["d_model"], r["n_heads"] * r["head_dim"], r["n_kv_heads"] * r["head_dim"],
        r["mlp"], r["mlp_kind"] == "swiglu", r["rows"] * r["seq"],
    )  # fmt: skip


@pytest.mark.parametrize("record", [r for r in RECORDS if r["policy"] == "none"], ids=str)
def test_measured_shapes_get_their_own_rates(record):
    rates = LayerCosts.load().rates(_shape(record))
    assert rates.forward == pytest.approx(record["forward_flops"] / record["fwd_s"])
    backward = record["fwdbwd_s"] - record["fwd_s"]
    assert rates.backward == pytest.approx(2 * record["forward_flops"] / backward)
    full = next(r for r in RECORDS if r["name"] == record["name"] and r["policy"] == "full")
    assert rates.recompute["full"] == pytest.approx(full["recompute_s"] / record["fwd_s"])
    assert rates.recompute["none"] == 0


def test_rates_interpolate_in_tokens_and_hold_outside_the_measured_range():
    costs = LayerCosts.load()
    at = {r: costs.rates(LayerShape(4096, 8192, 8192, 28672, True, r * 2048)) for r in (1, 4, 6, 8)}
    between = costs.rates(LayerShape(4096, 8192, 8192, 28672, True, 5 * 2048))
    low, high = sorted((at[4].forward, at[6].forward))
    assert low <= between.forward <= high
    assert costs.rates(LayerShape(4096, 8192, 8192, 28672, True, 100)).forward == at[1].forward
    assert costs.rates(LayerShape(4096, 8192, 8192, 28672, True, 10**6)).forward == at[8].forward
    # the nearest family: a GELU MLP goes to the measured GELU shape
    assert costs.rates(LayerShape(4096, 8192, 8192, 16384, False, 8192)).family == "16B-gelu"


def test_another_chip_scales_by_peak_and_bandwidth():
    rates = LayerRates(150e12, 140e12, {"full": 0.5}, "x", "measured")
    assert rates.on_chip(197e12, 819e9) is rates
    faster = rates.on_chip(4 * 197e12, 4 * 819e9)
    assert faster.forward == pytest.approx(4 * 150e12)
    assert "scaled" in faster.note and faster.recompute == {"full": 0.5}
    # more FLOP/s, the same bandwidth: less than 4 times faster
    assert rates.forward < rates.on_chip(4 * 197e12, 819e9).forward < 4 * rates.forward


def test_predictions_say_where_their_compute_comes_from():
    layout = Layout(fsdp=8, remat=True)
    model = Transformer.maxtext(16)
    here = predict_layout(model, layout, tpu_v5e(8), global_batch=8, update=False)
    assert here.compute.startswith("measured:") and "scaled" not in here.compute
    other = dataclasses.replace(tpu_v5e(8), peak_flops=459e12, hbm_bandwidth=2765e9)
    there = predict_layout(model, layout, other, global_batch=8, update=False)
    assert "scaled to a chip of 459 TFLOP/s" in there.compute
    assert there.compute_seconds < here.compute_seconds
    assumed = dataclasses.replace(model, efficiency=0.5)
    p = predict_layout(assumed, layout, tpu_v5e(8), global_batch=8, update=False)
    assert p.compute == "efficiency 0.5 of peak"


def test_bad_compute_inputs_say_what_to_do(tmp_path):
    with pytest.raises(pm.PipemarkError, match="efficiency = 2"):
        Transformer("x", 1, 8, 8, 2, 2, 8, 8, efficiency=2)
    with pytest.raises(pm.PipemarkError, match="cannot read"):
        LayerCosts.load(tmp_path / "missing.json")
    with pytest.raises(pm.PipemarkError, match="mlp = 'swish'"):
        Transformer("x", 1, 8, 8, 2, 2, 8, 8, mlp="swish")
    with pytest.raises(pm.PipemarkError, match="kv_heads that divides"):
        Transformer("x", 1, 8, 8, 4, 3, 8, 8)
    with pytest.raises(pm.PipemarkError, match="remat = 'some'"):
        Layout(remat="some")
    with pytest.raises(pm.PipemarkError, match="power of two"):
        Transformer.maxtext(24)


# ---------------------------------------------------------------- architectures, remat


def test_remat_policies_by_name():
    assert Layout(remat="full") == Layout(remat=True)
    assert Layout(remat="none") == Layout()
    assert str(Layout(remat="minimal")).endswith("M 1, remat minimal")
    assert Layout(remat="save_dot_except_mlpwi").remat_policy == "save_dot_except_mlpwi"


def test_architectures_change_parameters_as_written():
    base = Transformer("x", 2, 64, 256, 4, 4, 100, 16)
    assert base.head_dim == 16 and base.attention_width == 64
    wide = dataclasses.replace(base, head_dim=32)  # attention width 128 ≠ d_model
    assert wide.layer_parameters - base.layer_parameters == 64 * (2 * 64 + 2 * 64)
    gqa = dataclasses.replace(base, kv_heads=1)
    assert base.layer_parameters - gqa.layer_parameters == 2 * 64 * (64 - 16)
    gelu = dataclasses.replace(base, mlp="gelu")
    assert base.layer_parameters - gelu.layer_parameters == 64 * 256
    tied = dataclasses.replace(base, tied_embeddings=True)
    assert base.parameters - tied.parameters == 100 * 64
    assert base.layer_parameters - dataclasses.replace(base, parallel=True).layer_parameters == 64
    one = tied.stage_work(Layout(), global_batch=1, peak_flops=1e12)
    two = tied.stage_work(Layout(pp=2, microbatches=1), global_batch=1, peak_flops=1e12)
    assert sum(one.parameters) == tied.parameters  # one table on one stage
    assert sum(two.parameters) == tied.parameters + 100 * 64  # a copy at each end


@pytest.mark.parametrize(
    "record",
    [r for r in RECORDS if r["policy"] != "none"],
    ids=lambda r: f"{r['name']}-{r['policy']}",
)
def test_saved_activations_are_what_the_benchmark_counted(record):
    """Each remat policy's saved bytes: the residuals ``jax.vjp`` keeps
    (``print_saved_residuals``, recorded by benchmarks/layer_costs.py)."""
    model = Transformer(
        "m", 1, record["d_model"], record["mlp"], record["n_heads"], record["n_kv_heads"],
        32000, record["seq"], head_dim=record["head_dim"],
        mlp="swiglu" if record["mlp_kind"] == "swiglu" else "gelu",
    )  # fmt: skip
    tokens = record["rows"] * record["seq"]
    assert tokens * model.saved_per_token(record["policy"]) * 2 == record["residual_bytes"]


def test_none_keeps_at_most_what_the_benchmark_counted_before_fusion():
    for r in (r for r in RECORDS if r["policy"] == "none"):
        model = Transformer("m", 1, r["d_model"], r["mlp"], r["n_heads"], r["n_kv_heads"],
                            32000, r["seq"], head_dim=r["head_dim"])  # fmt: skip
        assert r["rows"] * r["seq"] * model.saved_per_token("none") * 2 < r["residual_bytes"]


def test_remat_policies_cost_recomputation_in_time():
    model = dataclasses.replace(Transformer.maxtext(16), efficiency=0.5)
    flops = [model.recompute_flops(p) for p in ("none", "minimal", "save_dot_except_mlpwi", "full")]
    assert flops == sorted(flops) and flops[0] == 0
    for m in (model, Transformer.maxtext(16)):  # assumed and measured
        backward = [
            sum(m.stage_work(Layout(remat=p), global_batch=6, peak_flops=197e12).backward)
            for p in ("none", "save_dot_except_mlpwi", "full")
        ]
        assert backward == sorted(backward) and backward[0] < backward[-1]


# ------------------------------------------------------------- MaxText's FLOP count


def maxtext_training_flops(cfg: dict) -> float:
    """MaxText's ``calculate_tflops_training_per_device`` for a dense model (its
    maxtext_utils.py, the default branch; no MoE, no MLA), in FLOPs per device."""
    b, s = cfg["per_device_batch_size"], cfg["max_target_length"]
    ffn1 = 2 * b * s * cfg["mlp_dim"] * cfg["emb_dim"] * len(cfg["mlp_activations"])
    ffn2 = 2 * b * s * cfg["mlp_dim"] * cfg["emb_dim"]
    qkv = (
        2
        * b
        * s
        * cfg["emb_dim"]
        * (cfg["num_query_heads"] + 2 * cfg["num_kv_heads"])
        * cfg["head_dim"]
    )
    noncausal = 4 * b * s**2 * cfg["num_query_heads"] * cfg["head_dim"]
    projection = 2 * b * s * cfg["emb_dim"] * cfg["num_query_heads"] * cfg["head_dim"]
    embedding = 2 * b * s * cfg["emb_dim"] * cfg["vocab_size"]
    layers = cfg["num_decoder_layers"]
    weights = ((ffn1 + ffn2) * layers + (qkv + projection) * layers + embedding) * 3
    return weights + noncausal / 2 * layers * 3


def _scaled(scale: int, batch: int) -> dict:
    """MaxText's base.yml at ``global_parameter_scale`` (its get_individual_scales)."""
    emb, heads, mlp, layers = {
        16: (1, 2, 2, 1),
        32: (2, 2, 2, 1),
        64: (2, 2, 2, 2),
        128: (2, 3, 3, 2),
    }[scale]
    return {
        "emb_dim": 2048 << emb, "num_query_heads": 16 << heads, "num_kv_heads": 16 << heads,
        "mlp_dim": 7168 << mlp, "num_decoder_layers": 16 << layers, "head_dim": 128,
        "mlp_activations": ["silu", "linear"], "vocab_size": 32000,
        "per_device_batch_size": batch, "max_target_length": 2048,
    }  # fmt: skip


@pytest.mark.parametrize("scale, batch", [(16, 6), (32, 4), (64, 2), (128, 1)])
def test_flops_equal_maxtexts_formula_on_its_v5e_models(scale, batch):
    model = Transformer.maxtext(scale)
    assert model.training_flops(batch * 2048) == maxtext_training_flops(_scaled(scale, batch))


def test_flops_equal_maxtexts_formula_on_llama2_70b():
    # MaxText's configs/models/llama2-70b.yml, at sequence 4096 as its v5p row ran
    cfg = {
        "emb_dim": 8192, "num_query_heads": 64, "num_kv_heads": 8, "mlp_dim": 28672,
        "num_decoder_layers": 80, "head_dim": 128, "mlp_activations": ["silu", "linear"],
        "vocab_size": 32000, "per_device_batch_size": 2, "max_target_length": 4096,
    }  # fmt: skip
    model = Transformer.llama2_70b(seq=4096)
    assert model.training_flops(2 * 4096) == maxtext_training_flops(cfg)
    gelu = dataclasses.replace(model, mlp="gelu")
    assert gelu.training_flops(4096) == maxtext_training_flops(
        {**cfg, "mlp_activations": ["gelu"], "per_device_batch_size": 1}
    )
