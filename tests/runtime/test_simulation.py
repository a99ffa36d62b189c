"""The schedule simulator and the zero-bubble schedules (ZB-H1, ZB-V)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipemark as pm
from pipemark.runtime.schedules.core import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    gpipe_schedule,
    one_f_one_b_schedule,
    schedule_from_orders,
)
from pipemark.runtime.schedules.simulation import simulate_schedule
from pipemark.runtime.schedules.zero_bubble import zero_bubble_schedule

EQUAL = {"forward": 1.0, "backward": 1.0, "weight": 1.0}


def test_simulating_unit_actions_reproduces_the_tick_grid():
    # With F = 1 and an unsplit backward of B + W = 1, every action takes one tick.
    for schedule in (gpipe_schedule(4, 8), one_f_one_b_schedule(4, 8)):
        sim = simulate_schedule(schedule, {"forward": 1, "backward": 1, "weight": 0})
        assert sim.makespan == schedule.num_ticks
        assert sim.bubble_fraction == pytest.approx(schedule.bubble_fraction)
        assert sim.bubble_fraction == pytest.approx(pm.runtime.ideal_bubble_fraction(4, 8))


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zb_h1_has_a_third_of_1f1b_bubble(stages, factor):
    micro = factor * stages
    one_f_one_b = simulate_schedule(one_f_one_b_schedule(stages, micro), EQUAL)
    zb = zero_bubble_schedule(stages, micro, costs=EQUAL)
    assert zb.splits_backward and zb.name == "zb-h1"
    zb_sim = simulate_schedule(zb, EQUAL)
    # 1F1B idles (S - 1)(F + B + W) per device, ZB-H1 (S - 1)(F + B - W).
    assert one_f_one_b.bubble == pytest.approx(3 * (stages - 1))
    assert zb_sim.bubble <= one_f_one_b.bubble / 3 + 1e-9
    # The same work: F + B + W per stage and microbatch.
    assert sum(zb_sim.busy) == pytest.approx(3 * stages * micro)
    # No more microbatches in flight (forward run, backward not yet) than 1F1B, and a
    # bounded number of deferred weight actions, whatever the number of microbatches.
    for d, order in enumerate(zb.device_orders()):
        in_flight = peak = owed = most_owed = 0
        for action in order:
            in_flight += {FORWARD: 1, BACKWARD: -1}.get(action.kind, 0)
            owed += {BACKWARD: 1, WEIGHT: -1}.get(action.kind, 0)
            peak, most_owed = max(peak, in_flight), max(most_owed, owed)
        assert peak <= stages - d
        assert most_owed <= stages + 1


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_zb_v_puts_two_stages_per_device_in_a_v(devices):
    schedule = zero_bubble_schedule(2 * devices, 2 * devices, variant="zb-v", costs=EQUAL)
    assert schedule.num_devices == devices
    assert schedule.stage_devices[0] == schedule.stage_devices[-1] == 0
    assert schedule.stage_devices[devices - 1] == schedule.stage_devices[devices] == devices - 1
    sim = simulate_schedule(schedule, EQUAL)
    interleaved = simulate_schedule(
        pm.runtime.interleaved_schedule(2 * devices, 2 * devices, num_devices=devices), EQUAL
    )
    assert sim.bubble_fraction < interleaved.bubble_fraction


@pytest.mark.parametrize("devices", [2, 3, 4, 8])
@pytest.mark.parametrize("factor", [2, 3, 4])
def test_zb_v_reaches_the_makespan_bound(devices, factor):
    # Device D - 1 holds stages D - 1 and D, so it cannot start before D - 1 forwards
    # have run, and then has 6 M units of work: no order of these actions finishes
    # before 6 M + D - 1. The V reaches that bound once M >= 2 D.
    micro = factor * devices
    sim = simulate_schedule(
        zero_bubble_schedule(2 * devices, micro, variant="zb-v", costs=EQUAL), EQUAL
    )
    assert sim.makespan == sim.bound == 6 * micro + devices - 1
    # So its bubble is the fill no schedule avoids: (D - 1) / (6 M + D - 1), under 5 %
    # at M = 2 S for S = 2 D stages.
    assert sim.bubble_fraction == pytest.approx((devices - 1) / (6 * micro + devices - 1))
    if micro == 4 * devices:
        assert sim.bubble_fraction <= 0.05


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_zb_h1_reaches_the_makespan_bound(stages, factor):
    sim = simulate_schedule(zero_bubble_schedule(stages, factor * stages, costs=EQUAL), EQUAL)
    assert sim.makespan == sim.bound == 3 * factor * stages + stages - 1


@given(
    kind=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]),
    devices=st.integers(1, 4),
    micro=st.integers(1, 8),
    costs=st.lists(st.floats(0.0, 5.0), min_size=3, max_size=3),
    transfer=st.sampled_from([0.0, 0.5, 3.0]),
)
@settings(max_examples=60, deadline=None)
def test_no_schedule_beats_the_bound(kind, devices, micro, costs, transfer):
    # The bound is a lower bound: every schedule's simulated makespan is at least it,
    # whatever the costs and the latency of transfers.
    table = dict(zip(("forward", "backward", "weight"), costs, strict=True))
    if kind.startswith("zb"):
        stages = 2 * devices if kind == "zb-v" else devices
        schedule = zero_bubble_schedule(stages, micro, variant=kind, costs=table)
    elif kind == "interleaved":
        micro = devices * micro  # microbatches go in groups of num_devices
        schedule = pm.runtime.interleaved_schedule(2 * devices, micro, num_devices=devices)
    else:
        schedule = pm.make_schedule(kind, devices, micro)
    sim = simulate_schedule(schedule, table, transfer=transfer)
    assert sim.bound <= sim.makespan + 1e-9
    assert sim.bound >= max(sim.busy, default=0.0) - 1e-9
    assert sim.makespan >= simulate_schedule(schedule, table).makespan - 1e-9


def test_transfers_between_devices_delay_their_readers():
    # 2 stages, 4 microbatches, F = 1, B = 2, a transfer t each way. GPipe pays t on the
    # way in (stage 1's first forward) and on the way out (stage 0's first backward):
    # its makespan is the bound, 2 t above the transfer-free one. Plain 1F1B pays a
    # transfer each way per microbatch in its steady state (4 t in all). Each forward
    # more in flight gives the transfers F + B more time to arrive: one is enough while
    # 2 t <= F + B, two while 2 t <= 2 (F + B).
    costs = {"forward": 1.0, "backward": 2.0, "weight": 0.0}
    free = simulate_schedule(one_f_one_b_schedule(2, 4), costs).makespan
    assert free == 15.0
    for t in (0.5, 1.0, 1.5, 2.0, 3.0):
        gpipe = simulate_schedule(gpipe_schedule(2, 4), costs, transfer=t)
        plain, one, two = (
            simulate_schedule(one_f_one_b_schedule(2, 4, extra_in_flight=k), costs, transfer=t)
            for k in (0, 1, 2)
        )
        assert gpipe.makespan == gpipe.bound == plain.bound == free + 2 * t
        assert plain.makespan == free + 4 * t
        assert (one.makespan == one.bound) == (2 * t <= 3.0)
        assert two.makespan == two.bound == free + 2 * t
        # Stage 1's first forward starts when stage 0's has arrived.
        assert plain.start[Action(1, 0, FORWARD)] == 1.0 + t


def test_transfer_as_a_function_and_on_one_device():
    # A function of (producer, reader) actions; stages sharing a device (ZB-V's V) pass
    # values for free, so a function never sees such a pair.
    seen = []

    def latency(producer, reader):
        seen.append((producer, reader))
        return 1.0 if producer.kind == FORWARD else 0.0

    schedule = zero_bubble_schedule(4, 4, variant="zb-v", costs=EQUAL)
    sim = simulate_schedule(schedule, EQUAL, transfer=latency)
    devices = schedule.stage_devices
    assert seen and all(devices[p.stage] != devices[r.stage] for p, r in seen)
    assert sim.makespan > simulate_schedule(schedule, EQUAL).makespan
    # Backward values only: the forwards' transfers are free.
    forward_free = simulate_schedule(
        gpipe_schedule(2, 2), EQUAL, transfer=lambda p, r: 0.0 if p.kind == FORWARD else 3.0
    )
    assert forward_free.start[Action(1, 0, FORWARD)] == 1.0
    assert forward_free.start[Action(0, 1, BACKWARD)] > forward_free.finish[Action(1, 1, BACKWARD)]


UNSPLIT = {"forward": 1.0, "backward": 2.0, "weight": 0.0}


def test_actions_shorter_than_their_dispatch_leave_the_device_waiting_for_the_host():
    # One device, 8 microbatches: 16 actions, 24 of device time. Dispatching each takes
    # the host 3: longer than any action, so the host sets the pace: 16 dispatches,
    # then the last action (a backward, 2).
    one = one_f_one_b_schedule(1, 8)
    bound = simulate_schedule(one, UNSPLIT, dispatch=3.0)
    assert bound.makespan == 16 * 3.0 + 2.0
    assert bound.host_wait == (bound.makespan - 24.0,)
    assert bound.dispatched[Action(0, 0, FORWARD)] == 3.0 == bound.start[Action(0, 0, FORWARD)]
    # Dispatching takes 0.5: the host runs ahead and the device never waits after the
    # first dispatch; the makespan is the device's work and that first dispatch.
    free = simulate_schedule(one, UNSPLIT, dispatch=0.5)
    assert free.makespan == 24.5 and free.host_wait == (0.5,)
    assert free.bound == free.busy[0] == 24.0  # the bound is the devices' work alone


def test_a_bounded_dispatch_ahead_makes_the_host_wait_for_the_device():
    one = one_f_one_b_schedule(1, 8)
    # Without a wake-up the host keeps 2 programs queued while it dispatches: no wait.
    assert simulate_schedule(one, UNSPLIT, dispatch=0.5, dispatch_ahead=2).makespan == 24.5
    # Waking 1 after the awaited program ends, it dispatches the next 1.5 later, while
    # the device has 2 queued programs (2 to 4 of work) to run: still in time.
    ahead2 = simulate_schedule(one, UNSPLIT, dispatch=0.5, dispatch_ahead=2, wake=1.0)
    assert ahead2.makespan == 24.5
    # With one program queued, a forward (1) is shorter than the wake and the
    # dispatch: the device waits for the host each time it has run a forward only.
    ahead1 = simulate_schedule(one, UNSPLIT, dispatch=0.5, dispatch_ahead=1, wake=1.0)
    unbounded = simulate_schedule(one, UNSPLIT, dispatch=0.5, wake=1.0)
    assert unbounded.makespan == 24.5  # None: the host never waits, wake is moot
    assert ahead1.makespan > ahead2.makespan
    assert ahead1.host_wait[0] == pytest.approx(ahead1.makespan - 24.0)
    # Each action still starts after its dispatch and after the device is free.
    order = one.device_orders()[0]
    for before, after in itertools.pairwise(order):
        assert ahead1.start[after] >= max(ahead1.finish[before], ahead1.dispatched[after])


def test_a_reader_is_dispatched_after_its_producer_on_another_device():
    # Two devices: stage 1's first forward is dispatched (on its own host thread) only
    # once stage 0's is, as the runtime's worker waits for the value to be published.
    sim = simulate_schedule(gpipe_schedule(2, 2), UNSPLIT, dispatch=0.25)
    assert sim.dispatched[Action(1, 0, FORWARD)] == 0.5
    assert sim.start[Action(1, 0, FORWARD)] == 1.25  # after stage 0's forward ends
    assert sim.makespan == simulate_schedule(gpipe_schedule(2, 2), UNSPLIT).makespan + 0.25


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"dispatch": -1.0}, "dispatch = -1.0"),
        ({"dispatch": "1"}, "dispatch is str"),
        ({"wake": float("nan")}, "wake = nan"),
        ({"dispatch_ahead": 0}, "dispatch_ahead = 0"),
        ({"dispatch_ahead": True}, "dispatch_ahead = True"),
    ],
)
def test_bad_host_arguments_are_named(arguments, message):
    with pytest.raises(pm.PipemarkError, match=message):
        simulate_schedule(gpipe_schedule(2, 2), EQUAL, **arguments)


@pytest.mark.parametrize("transfer", [-1.0, float("nan"), float("inf"), "1", True])
def test_bad_transfers_are_named(transfer):
    with pytest.raises(pm.PipemarkError, match="transfer"):
        simulate_schedule(gpipe_schedule(2, 2), EQUAL, transfer=transfer)


def test_weight_actions_are_checked_like_the_others():
    F, B, W = FORWARD, BACKWARD, WEIGHT
    orders = [[Action(0, 0, F), Action(0, 0, B), Action(0, 0, W)]]
    schedule = schedule_from_orders(orders, stage_devices=(0,), num_microbatches=1)
    assert schedule.splits_backward and schedule.to_text().splitlines()[-1].split()[2:] == [
        "F0",
        "B0",
        "W0",
    ]
    with pytest.raises(
        pm.errors.StageGraphError, match="weight of stage 0 for microbatch 0 runs before"
    ):
        pm.Schedule(
            "bad", 1, (0,), ((),), ((Action(0, 0, F),), (Action(0, 0, W),), (Action(0, 0, B),))
        )
    # A backward without a weight action of its own is the whole backward, microbatch
    # by microbatch: microbatch 0's is split, microbatch 1's whole (and costs B + W).
    mixed = pm.Schedule(
        "half", 2, (0,), ((),),
        ((Action(0, 0, F),), (Action(0, 0, B),), (Action(0, 0, W),),
         (Action(0, 1, F),), (Action(0, 1, B),)),
    )  # fmt: skip
    assert mixed.splits_backward and mixed.whole_backwards == {(0, 1)}
    costs = {"forward": 1.0, "backward": 2.0, "weight": 4.0}
    assert simulate_schedule(mixed, costs).makespan == 1 + 2 + 4 + 1 + (2 + 4)
    with pytest.raises(
        pm.errors.StageGraphError, match=r"never run, e\.g\. the backward of stage 0"
    ):
        pm.Schedule("no backward", 1, (0,), ((),), ((Action(0, 0, F),), (Action(0, 0, W),)))


def test_costs_per_stage_and_bad_costs():
    schedule = one_f_one_b_schedule(2, 2)
    slow_last = simulate_schedule(schedule, {"forward": [1.0, 3.0], "backward": 1.0, "weight": 0.0})
    even = simulate_schedule(schedule, {"forward": 1.0, "backward": 1.0, "weight": 0.0})
    assert slow_last.makespan > even.makespan
    with pytest.raises(pm.PipemarkError, match="non-negative number"):
        simulate_schedule(schedule, {"forward": -1.0})
    with pytest.raises(pm.PipemarkError, match="num_stages must be even"):
        zero_bubble_schedule(3, 4, variant="zb-v")
    with pytest.raises(pm.PipemarkError, match="Unknown zero-bubble variant"):
        zero_bubble_schedule(2, 4, variant="zb-x")


def test_zero_bubble_schedules_plot():
    pytest.importorskip("matplotlib")
    fig = pm.runtime.plot_schedule(zero_bubble_schedule(4, 8))
    assert "zb-h1" in fig.axes[0].get_title()


@pytest.mark.parametrize(
    "costs, message",
    [
        ({"forward": (1.0, 2.0, 3.0)}, r"costs\['forward'\] has 3 entries but the schedule has 2"),
        ({"backward": [1.0]}, r"costs\['backward'\] has 1 entries but the schedule has 2"),
        ([1.0, 2.0], "costs is list; give a dict"),
    ],
)
def test_per_stage_costs_of_the_wrong_length_are_named(costs, message):
    schedule = one_f_one_b_schedule(2, 2)
    with pytest.raises(pm.PipemarkError, match=message):
        simulate_schedule(schedule, costs)
    with pytest.raises(pm.PipemarkError, match=message):
        zero_bubble_schedule(2, 4, costs=costs)
