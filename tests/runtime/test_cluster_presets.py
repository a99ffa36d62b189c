"""The planner's cluster presets from vendors' specifications (issue 58, item 5): TPU
v5p and v6e, and an H100 cluster (NVLink through a switch within a node, InfiniBand
between nodes)."""

from __future__ import annotations

import dataclasses

import pytest

import pipemark as pm
from pipemark.runtime.planning.cluster import (
    Group,
    collective_seconds,
    h100,
    tpu_v5e,
    tpu_v5p,
    tpu_v6e,
    transfer_seconds,
)


def test_the_presets_carry_their_specifications():
    v5p, v6e, gpus = tpu_v5p(512), tpu_v6e(512), h100(64)
    assert (v5p.peak_flops, v5p.hbm_bandwidth, v5p.hbm_bytes) == (459e12, 2765e9, 95 * 2**30)
    assert v5p.ici_ports * v5p.ici_link_bandwidth * 2 == 1200e9  # bidirectional per chip
    assert v5p.dcn_bandwidth / v5p.chips_per_host == 50e9 / 8
    assert (v6e.peak_flops, v6e.hbm_bandwidth, v6e.num_slices) == (918e12, 1638e9, 2)
    assert v6e.ici_ports * v6e.ici_link_bandwidth * 2 == 800e9
    assert (gpus.peak_flops, gpus.hbm_bandwidth, gpus.num_slices) == (989e12, 3.35e12, 8)
    assert gpus.ici_ports * gpus.ici_link_bandwidth * 2 == 900e9  # NVLink 4
    assert gpus.dcn_bandwidth / gpus.chips_per_host == 400e9 / 8  # one NDR port a GPU
    assert pm.planner.h100 is h100 and pm.planner.tpu_v5p is tpu_v5p
    assert pm.planner.tpu_v6e is tpu_v6e


def test_a_switch_gives_every_group_all_links_and_a_torus_its_dimension():
    gpus = h100(8)
    # a ring of 2 or of 8 GPUs: 450 GB/s each way through NVSwitch
    two = collective_seconds(gpus, "all_reduce", 1e9, Group(2, 1))
    eight = collective_seconds(gpus, "all_reduce", 1e9, Group(8, 1))
    assert two == pytest.approx(2 * 0.5e9 / 450e9 + 2 * gpus.ici_latency)
    assert eight == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 14 * gpus.ici_latency)
    assert transfer_seconds(gpus, 450e6, across_slices=False) == pytest.approx(1e-3 + 2e-6)
    v5p = tpu_v5p(4096)  # a 16 × 16 × 16 torus: a ring of 16 along one dimension
    along = collective_seconds(v5p, "all_gather", 1e9, Group(16, 1))
    across = collective_seconds(v5p, "all_gather", 1e9, Group(32, 1))
    assert along == pytest.approx(15 / 16 * 1e9 / 200e9 + 15e-6)
    assert across == pytest.approx(31 / 32 * 1e9 / 600e9 + 31e-6)


def test_between_nodes_the_switched_network_is_the_dcn():
    gpus = h100(64)
    seconds = collective_seconds(gpus, "all_reduce", 8e9, Group(8, 8))
    inside = 2 * (7 / 8 * 8e9 / 450e9 + 7 * 2e-6)
    between = 2 * (7 / 8 * 1e9 / 50e9 + 7 * 5e-6)
    assert seconds == pytest.approx(inside + between)


def test_bad_presets_say_what_to_do():
    with pytest.raises(pm.PipemarkError, match="topology = 'ring'"):
        dataclasses.replace(tpu_v5e(8), topology="ring")
    with pytest.raises(pm.PipemarkError, match="largest is 6144"):
        tpu_v5p(8192, slice_chips=8192)


def test_a_faster_chip_plans_a_faster_step():
    model = pm.planner.Transformer.llama2_70b()
    layout = pm.planner.Layout(fsdp=256, remat=True, gather="microbatch", reduce="scatter")
    steps = {
        c.name: pm.planner.predict_layout(model, layout, c, global_batch=256).step_seconds
        for c in (tpu_v5e(256), tpu_v5p(256), tpu_v6e(256))
    }
    assert steps["TPU v5e, 256 chips"] > steps["TPU v5p, 256 chips"] > steps["TPU v6e, 256 chips"]
