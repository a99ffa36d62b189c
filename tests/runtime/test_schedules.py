"""Tests for pipemark.runtime.schedules and pipemark.runtime.schedules.plot: schedules as data."""

from __future__ import annotations

import textwrap

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipemark as pm
from pipemark.errors import PipemarkError, StageGraphError
from pipemark.runtime.schedules.core import (
    BACKWARD,
    FORWARD,
    Action,
    check_schedule_fits,
    normalize_stage_graph,
)

F, B = FORWARD, BACKWARD


def _independent_check(schedule: pm.Schedule) -> None:
    """Re-derive validity from the ticks alone, without the module's own checker."""
    when = {}
    for t, tick in enumerate(schedule.ticks):
        for d, action in enumerate(tick):
            if action is not None:
                assert action not in when
                assert schedule.stage_devices[action.stage] == d
                when[action] = t
    S, M = schedule.num_stages, schedule.num_microbatches
    assert len(when) == 2 * S * M
    succ = {j: [k for k in range(S) if j in schedule.predecessors[k]] for j in range(S)}
    for (j, m, kind), t in when.items():
        if kind == F:
            needs = [(p, m, F) for p in schedule.predecessors[j]]
        else:
            needs = [(j, m, F)] + [(s, m, B) for s in succ[j]]
        for need in needs:
            assert when[Action(*need)] < t, ((j, m, kind), need)


def test_gpipe_text_grid():
    expected = textwrap.dedent(
        """\
        gpipe: 3 stages, 2 microbatches, 3 devices, 8 ticks, bubble 50.0 %
        tick      0   1   2   3   4   5   6   7
        device 0  F0  F1  .   .   .   .   B0  B1
        device 1  .   F0  F1  .   .   B0  B1  .
        device 2  .   .   F0  F1  B0  B1  .   ."""
    )
    assert str(pm.runtime.gpipe_schedule(3, 2)) == expected


def test_one_f_one_b_text_grid_alternates_after_warmup():
    expected = textwrap.dedent(
        """\
        1f1b: 2 stages, 4 microbatches, 2 devices, 10 ticks, bubble 20.0 %
        tick      0   1   2   3   4   5   6   7   8   9
        device 0  F0  F1  .   B0  F2  B1  F3  B2  .   B3
        device 1  .   F0  B0  F1  B1  F2  B2  F3  B3  ."""
    )
    assert pm.runtime.one_f_one_b_schedule(2, 4).to_text() == expected


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 4, 8, 16])
def test_chain_bubble_is_the_ideal(kind, stages, micro):
    schedule = pm.make_schedule(kind, stages, micro)
    _independent_check(schedule)
    assert schedule.num_ticks == 2 * (micro + stages - 1)
    assert schedule.bubble_fraction == pytest.approx(
        pm.runtime.ideal_bubble_fraction(stages, micro)
    )


@pytest.mark.parametrize("stages", [2, 4, 6])
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_one_f_one_b_bounds_microbatches_in_flight(stages, micro):
    # On a chain, stage j holds the residuals of at most S - j microbatches at once
    # (GPipe: all M of them).
    for kind, bound in (("1f1b", lambda j: min(stages - j, micro)), ("gpipe", lambda j: micro)):
        schedule = pm.make_schedule(kind, stages, micro)
        for j, order in enumerate(schedule.device_orders()):
            alive = peak = 0
            for action in order:
                alive += 1 if action.kind == F else -1
                peak = max(peak, alive)
            assert peak == bound(j), (kind, j)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("extra", [1, 2])
def test_one_f_one_b_with_more_in_flight(stages, extra):
    # Each stage but the last starts extra more forwards before its first backward (and
    # holds that many more microbatches); the last alternates from the start.
    micro = 8
    schedule = pm.runtime.one_f_one_b_schedule(stages, micro, extra_in_flight=extra)
    plain = pm.runtime.one_f_one_b_schedule(stages, micro)
    for j, (order, before) in enumerate(zip(schedule.device_orders(), plain.device_orders())):
        first_backward = next(i for i, a in enumerate(order) if a.kind != F)
        plain_first = next(i for i, a in enumerate(before) if a.kind != F)
        assert first_backward == plain_first + (extra if j < stages - 1 else 0)
        assert sorted(order) == sorted(before)
    assert pm.runtime.one_f_one_b_schedule(2, 2, extra_in_flight=5).device_orders()[0][:2] == [
        pm.runtime.Action(0, 0, F),
        pm.runtime.Action(0, 1, F),
    ]  # no more than the microbatches there are


@pytest.mark.parametrize("extra", [-1, 1.5, True, "1"])
def test_one_f_one_b_names_a_bad_extra_in_flight(extra):
    with pytest.raises(pm.PipemarkError, match="extra_in_flight"):
        pm.runtime.one_f_one_b_schedule(2, 4, extra_in_flight=extra)


@st.composite
def _dags(draw):
    stages = draw(st.integers(1, 6))
    edges = [
        (i, j)
        for j in range(1, stages)
        for i in range(j)
        if draw(st.booleans()) or (i == j - 1 and draw(st.booleans()))
    ]
    return stages, edges


@settings(max_examples=60, deadline=None)
@given(_dags(), st.integers(1, 6), st.sampled_from(["gpipe", "1f1b"]))
def test_any_stage_graph_gets_a_valid_schedule(dag, micro, kind):
    stages, edges = dag
    schedule = pm.make_schedule(kind, stages, micro, stage_graph=edges)
    _independent_check(schedule)
    # The same graph given as a networkx graph or a mapping gives the same schedule.
    graph = nx.DiGraph(edges)
    graph.add_nodes_from(range(stages))
    assert pm.make_schedule(kind, stages, micro, stage_graph=graph).ticks == schedule.ticks


def test_skip_connection_waits_for_the_skipped_stage():
    # Stage 3 reads stage 0 directly; stage 1's backward needs nothing from stage 3, but
    # stage 0's backward needs stage 3's.
    edges = [(0, 1), (1, 2), (2, 3), (0, 3)]
    schedule = pm.runtime.one_f_one_b_schedule(4, 2, stage_graph=edges)
    _independent_check(schedule)
    assert schedule.predecessors == ((), (0,), (1,), (0, 2))
    when = {a: t for t, _, a in schedule.actions()}
    assert when[Action(0, 0, B)] > when[Action(3, 0, B)]


def test_parallel_branches_run_at_the_same_tick():
    # 0 feeds 1 and 2, which both feed 3: 1 and 2 run side by side.
    schedule = pm.runtime.gpipe_schedule(4, 1, stage_graph=[(0, 1), (0, 2), (1, 3), (2, 3)])
    when = {a: t for t, _, a in schedule.actions()}
    assert when[Action(1, 0, F)] == when[Action(2, 0, F)] == 1
    assert schedule.num_ticks == 6


@pytest.mark.parametrize("devices,chunks,micro", [(2, 2, 4), (2, 3, 8), (4, 2, 8), (3, 2, 3)])
def test_interleaved_schedule_is_valid_and_shrinks_the_bubble(devices, chunks, micro):
    schedule = pm.runtime.interleaved_schedule(devices * chunks, micro, num_devices=devices)
    _independent_check(schedule)
    assert schedule.num_devices == devices
    assert schedule.stage_devices == tuple(j % devices for j in range(devices * chunks))
    plain = pm.runtime.one_f_one_b_schedule(devices, micro)
    assert schedule.bubble_fraction < plain.bubble_fraction
    assert "F0s1" in schedule.to_text()


def test_schedule_from_custom_orders_and_dataclass_checks():
    orders = [
        [Action(0, 0, F), Action(0, 1, F), Action(0, 1, B), Action(0, 0, B)],
        [Action(1, 1, F), Action(1, 0, F), Action(1, 1, B), Action(1, 0, B)],
    ]
    schedule = pm.runtime.schedule_from_orders(orders, stage_devices=(0, 1), num_microbatches=2)
    _independent_check(schedule)
    assert schedule.device_orders() == orders
    rebuilt = pm.Schedule("again", 2, (0, 1), ((), (0,)), schedule.ticks)
    assert rebuilt.ticks == schedule.ticks


# ------------------------------------------------------------------------- errors


def _two_stage_ticks():
    return [
        [Action(0, 0, F), None],
        [None, Action(1, 0, F)],
        [None, Action(1, 0, B)],
        [Action(0, 0, B), None],
    ]


def _build(ticks, devices=(0, 1), preds=((), (0,)), micro=1):
    return pm.Schedule("bad", micro, devices, preds, ticks)


def test_valid_hand_built_schedule():
    assert _build(_two_stage_ticks()).bubble_fraction == 0.5


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t: [t[1], t[0], t[2], t[3]],
            r"Tick 0: the forward of stage 1 for microbatch 0 runs before the forward of "
            r"stage 0 for microbatch 0 \(tick 1\).*Move it to tick 2 or later",
        ),
        (
            lambda t: [t[0], t[1], t[3], t[2]],
            r"backward of stage 0 .* runs before the backward of stage 1",
        ),
        (lambda t: [*t, [Action(0, 0, F), None]], r"runs twice, at ticks 0 and 4"),
        (lambda t: t[:3], r"1 action\(s\) never run, e\.g\. the backward of stage 0"),
        (lambda t: [[None, Action(0, 0, F)], *t[1:]], r"runs on device 1, but stage 0 lives"),
        (lambda t: [t[0], [Action(1, 0, F)], *t[2:]], r"Tick 1 has 1 cells but tick 0 has 2"),
        (lambda t: [[Action(0, 5, F), None], *t[1:]], r"not an action of this pipeline"),
        (lambda t: [["F0", None], *t[1:]], r"a cell is an Action or None"),
        (lambda t: [], r"no ticks"),
    ],
)
def test_invalid_schedules_raise_stage_graph_error(mutate, message):
    with pytest.raises(StageGraphError, match=message):
        _build(mutate(_two_stage_ticks()))


def test_stage_on_missing_device():
    with pytest.raises(StageGraphError, match="placed on device 5"):
        _build(_two_stage_ticks(), devices=(0, 5))


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        ([(0, 1), (1, 2), (2, 0)], r"cycle: 0 -> 1 -> 2 -> 0.*merge the stages"),
        ([(1, 1)], r"self-loop"),
        ([(0, 7)], r"node 7 is not a stage index in 0\.\.2"),
        (nx.DiGraph([("a", "b")]), r"node 'a' is not a stage index"),
        ([(0, 1, 2)], r"not a \(source, target\) pair"),
        (42, r"Cannot read a stage graph from int"),
    ],
)
def test_bad_stage_graphs(graph, message):
    with pytest.raises(StageGraphError, match=message):
        normalize_stage_graph(graph, 3)


def test_deadlocking_orders_are_named():
    orders = [
        [Action(0, 0, B), Action(0, 0, F)],
        [Action(1, 0, F), Action(1, 0, B)],
    ]
    with pytest.raises(StageGraphError, match=r"deadlock at tick 0: device 0 waits to run the"):
        pm.runtime.schedule_from_orders(orders, stage_devices=(0, 1), num_microbatches=1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: pm.make_schedule("zigzag", 2, 2), PipemarkError, "Unknown schedule 'zigzag'"),
        (lambda: pm.make_schedule("interleaved", 4, 4), PipemarkError, "needs num_devices"),
        (
            lambda: pm.runtime.interleaved_schedule(3, 4, num_devices=2),
            PipemarkError,
            r"3 stages do not divide over 2 devices.*num_stages=4",
        ),
        (
            lambda: pm.runtime.interleaved_schedule(4, 3, num_devices=2),
            PipemarkError,
            r"num_microbatches=3 is not a multiple.*Use 4 microbatches",
        ),
        (
            lambda: pm.runtime.gpipe_schedule(0, 2),
            PipemarkError,
            "num_stages must be a positive int",
        ),
        (lambda: pm.runtime.gpipe_schedule(2, 1.5), PipemarkError, "num_microbatches must be"),
        (
            lambda: pm.make_schedule(pm.runtime.gpipe_schedule(2, 2), 2, 4),
            PipemarkError,
            r"for 2 stages and 2 microbatches, but the pipeline has 2 stages and 4",
        ),
        (
            lambda: pm.make_schedule(pm.runtime.gpipe_schedule(3, 2, stage_graph=[(0, 2)]), 3, 2),
            StageGraphError,
            r"runs F0s1 \(the forward of stage 1 for microbatch 0\) at tick 0, before F0s0 "
            r".*the edge 0->1.*built for the stage graph \{0->2\}, the pipeline's is "
            r"\{0->1, 1->2\}",
        ),
    ],
)
def test_builder_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


_TIED = {0: (), 1: (0,), 2: (1,), 3: (0, 2)}  # a chain whose last stage reads the first


@pytest.mark.parametrize(
    ("name", "devices"),
    [("gpipe", 4), ("1f1b", 4), ("zb-h1", 4), ("interleaved", 2), ("zb-v", 2), ("dualpipev", 2)],
)
def test_a_chain_schedule_fits_tied_embeddings_with_their_graph(name, devices):
    # The chain runs stage 0's forward before stage 3's and stage 3's backward before
    # stage 0's, so its order meets the edge 0->3: the same ticks run on the graph.
    chain = pm.make_schedule(name, 4, 8, num_devices=devices)
    fitted = pm.make_schedule(chain, 4, 8, stage_graph=_TIED, num_devices=devices)
    assert fitted.stage_graph == _TIED and chain.stage_graph[3] == (2,)
    assert fitted.ticks == chain.ticks and fitted.overlapped == chain.overlapped
    assert check_schedule_fits(chain, 4, 8) is chain


@pytest.mark.parametrize(
    ("orders", "built_for", "message"),
    [
        (  # stages 1 and 2 read only stage 0: the backwards of 1 and 2 in either order
            [[Action(0, 0, F), Action(1, 0, F), Action(2, 0, F), Action(1, 0, B),
              Action(2, 0, B), Action(0, 0, B)]],
            {1: (0,), 2: (0,)},
            r"runs B0s1 \(the backward of stage 1 for microbatch 0\) at tick 3, before B0s2 "
            r"\(the backward of stage 2 for microbatch 0, tick 4\) has finished, but the "
            r"pipeline's stage graph has the edge 1->2: the backward of stage 1 reads the "
            r"cotangents stage 2 sends back. The schedule was built for the stage graph "
            r"\{0->1, 0->2\}, the pipeline's is \{0->1, 0->2, 1->2\}. Order B0s2 before B0s1",
        ),
        (  # one stage per device: stage 2's forward beside stage 1's
            [[Action(0, 0, F), Action(0, 0, B)], [Action(1, 0, F), Action(1, 0, B)],
             [Action(2, 0, F), Action(2, 0, B)]],
            {1: (0,), 2: (0,)},
            r"runs F0s2 \(the forward of stage 2 for microbatch 0\) at tick 1, before F0s1 "
            r".*the edge 1->2: the forward of stage 2 reads the outputs of stage 1",
        ),
    ],
)  # fmt: skip
def test_an_order_that_misses_an_edge_names_it(orders, built_for, message):
    devices = [0, 0, 0] if len(orders) == 1 else [0, 1, 2]
    schedule = pm.runtime.schedule_from_orders(
        orders, stage_devices=devices, num_microbatches=1, stage_graph=built_for
    )
    with pytest.raises(StageGraphError, match=message):
        check_schedule_fits(schedule, 3, 1, {1: (0,), 2: (0, 1)})


def test_an_overlapped_pair_must_have_the_backwards_inputs_when_it_starts():
    # B0s1 runs at tick 5, after B0s2 (tick 4), but as the second of a pair it starts
    # with F1s1 at tick 4: on the graph with 1->2 it would read B0s2's cotangents early.
    schedule = pm.runtime.schedule_from_csv(
        "0F0,0F1,,,,,,,0B0,0B1\n,1F0,,,(1F1;1B0)OVERLAP_F_B,1B1\n,,2F0,,2B0,2F1,2B1",
        stage_graph={1: (0,), 2: (0,)},
    )
    with pytest.raises(StageGraphError, match=r"runs B0s1 .* at tick 4 in an overlapped pair"):
        check_schedule_fits(schedule, 3, 2, {1: (0,), 2: (0, 1)})


# --------------------------------------------------------------------------- plots


def test_plot_schedule_draws_one_box_per_action():
    matplotlib = pytest.importorskip("matplotlib")
    schedule = pm.make_schedule("1f1b", 3, 4)
    fig = pm.runtime.plot_schedule(schedule)
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 3 * 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["device 0", "device 1", "device 2"]
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels.count("F0") == 3 and labels.count("B3") == 3
    assert "bubble 33.3 %" in ax.get_title()
    # drawing onto given axes returns that figure
    fig2 = matplotlib.figure.Figure()
    ax2 = fig2.add_subplot(1, 1, 1)
    assert pm.runtime.plot_schedule(pm.make_schedule("gpipe", 2, 2), ax=ax2, title="x") is fig2
    assert ax2.get_title() == "x"


def test_plot_schedule_refuses_other_objects():
    with pytest.raises(PipemarkError, match="takes a Schedule, got str"):
        pm.runtime.plot_schedule("1f1b")


@pytest.mark.parametrize(
    "action, message",
    [
        (Action(0.0, 0, FORWARD), r"has stage 0\.0 \(float\); an Action's stage is an int"),
        (Action(True, 0, FORWARD), r"has stage True \(bool\)"),
        (Action(0, 0.5, FORWARD), r"has microbatch 0\.5 \(float\)"),
        (Action(0, 0, 1), "has kind 1; give 'forward'"),
        (Action(0, 0, "fwd"), "is not an action of this pipeline"),
        ((0, 0, FORWARD), r"holds \(0, 0, 'forward'\); give an Action"),
    ],
)
def test_malformed_actions_are_named_where_they_stand(action, message):
    orders = [[action, Action(0, 0, BACKWARD)]]
    with pytest.raises(StageGraphError, match=r"orders\[0\]\[0\]" + ".*" + message):
        pm.runtime.schedule_from_orders(orders, stage_devices=[0], num_microbatches=1)
    ticks = ((action,), (Action(0, 0, BACKWARD),))
    with pytest.raises(StageGraphError, match=r"Tick 0, device 0.*"):
        pm.Schedule("custom", 1, (0,), ((),), ticks)


# ------------------------------------------------------------------ waves, in flight


def _held_at_once(schedule: pm.Schedule) -> list[int]:
    """Per device, the most microbatches whose forward ran there and whose backward
    there has not: counted from the ticks, not with Schedule.in_flight."""
    most = []
    for d in range(schedule.num_devices):
        runs = [a for tick in schedule.ticks for a in [tick[d]] if a is not None]
        peak = 0
        for i in range(len(runs)):
            started = {a.microbatch for a in runs[: i + 1] if a.kind == F}
            done = {
                m for m in started
                if all(a in runs[: i + 1] for a in runs if a.microbatch == m and a.kind != F)
            }  # fmt: skip
            peak = max(peak, len(started - done))
        most.append(peak)
    return most


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(1, 9),
)
def test_waves_bound_the_microbatches_each_device_holds(kind, stages, count, wave):
    problem = pm.runtime.ScheduleProblem(stages, count, microbatches_in_flight=wave)
    schedule = pm.runtime.build_schedule(kind, problem)
    _independent_check(schedule)
    whole = pm.make_schedule(kind, stages, count)
    assert list(schedule.in_flight()) == _held_at_once(schedule)
    assert list(whole.in_flight()) == _held_at_once(whole)
    assert max(schedule.in_flight()) <= min(wave, max(whole.in_flight()))
    assert schedule.num_ticks >= whole.num_ticks
    if wave >= count:
        assert schedule == whole


def test_waves_of_an_interleaved_schedule_fill_every_device():
    problem = pm.runtime.ScheduleProblem(4, 8, num_devices=2, microbatches_in_flight=4)
    schedule = pm.runtime.build_schedule("interleaved", problem)
    assert schedule.name == "interleaved, waves of 4"
    assert max(schedule.in_flight()) == 4
    threes = pm.runtime.ScheduleProblem(4, 8, num_devices=2, microbatches_in_flight=3)
    with pytest.raises(
        PipemarkError,
        match=r"microbatches_in_flight=3: the schedule "
        r"'interleaved' cannot run microbatches 0\.\.2 as one wave of 3",
    ):
        pm.runtime.build_schedule("interleaved", threes)


def test_waves_need_a_schedule_the_pipeline_builds():
    made = pm.runtime.gpipe_schedule(2, 4)
    problem = pm.runtime.ScheduleProblem(2, 4, microbatches_in_flight=2)
    with pytest.raises(PipemarkError, match="the schedule 'gpipe' was given made"):
        pm.runtime.build_schedule(made, problem)
    with pytest.raises(PipemarkError, match="microbatches_in_flight must be an int >= 1"):
        pm.runtime.ScheduleProblem(2, 4, microbatches_in_flight=0)
    with pytest.raises(PipemarkError, match="for one pipeline"):
        pm.runtime.schedules.in_waves(
            [pm.runtime.gpipe_schedule(2, 2), pm.runtime.gpipe_schedule(3, 2)]
        )


# ------------------------------------------------- overlapped pairs and REDUCE_GRAD


def _pair_orders():
    """Two stages on one device (a V of one device), whose order puts microbatch 1's
    forward of stage 0 right before microbatch 0's backward of stage 1."""
    F, B = FORWARD, BACKWARD
    order = [
        Action(0, 0, F), Action(1, 0, F), Action(0, 1, F), Action(1, 0, B),
        Action(1, 1, F), Action(1, 1, B), Action(0, 0, B), Action(0, 1, B),
    ]  # fmt: skip
    return [order]


def test_an_overlapped_pair_starts_when_both_are_ready_and_runs_on_adjacent_ticks():
    pair = (Action(0, 1, FORWARD), Action(1, 0, BACKWARD))
    s = pm.runtime.schedule_from_orders(
        _pair_orders(), stage_devices=(0, 0), num_microbatches=2, overlapped=[pair]
    )
    ticks = {a: t for t, _, a in s.actions()}
    assert ticks[pair[1]] == ticks[pair[0]] + 1 and s.overlapped == (pair,)
    assert pm.runtime.schedule_from_csv(s.to_csv(), name="custom") == s
    assert "(0F1;1B0)OVERLAP_F_B" in s.to_csv()


@pytest.mark.parametrize(
    ("pair", "match"),
    [
        ((Action(0, 0, FORWARD), Action(1, 0, FORWARD)), "not a forward and then a backward"),
        ((Action(0, 0, FORWARD), Action(1, 0, BACKWARD)), "runs at ticks 0 and 3"),
        ((Action(0, 9, FORWARD), Action(1, 0, BACKWARD)), "not two actions of this schedule"),
    ],
)
def test_a_bad_overlapped_pair_is_refused(pair, match):
    plain = pm.runtime.schedule_from_orders(
        _pair_orders(), stage_devices=(0, 0), num_microbatches=2
    )
    with pytest.raises(StageGraphError, match=match):
        pm.Schedule(plain.name, 2, (0, 0), plain.predecessors, plain.ticks, (pair,))


def test_a_pair_whose_backward_reads_its_forward_is_refused():
    one = pm.make_schedule("1f1b", 1, 1)  # F0, B0 on adjacent ticks
    pair = (Action(0, 0, FORWARD), Action(0, 0, BACKWARD))
    with pytest.raises(StageGraphError, match=r"the backward reads the forward .*tick 0"):
        pm.Schedule(one.name, 1, (0,), one.predecessors, one.ticks, (pair,))


def test_reduce_grad_follows_the_stages_last_backward():
    s = pm.make_schedule("1f1b", 2, 2)
    ticks = {a: t for t, _, a in s.actions()}
    last0 = ticks[Action(0, 1, BACKWARD)]
    good = pm.Schedule(s.name, 2, (0, 1), s.predecessors, s.ticks, (), ((0, last0),))
    assert "0B1,0REDUCE_GRAD" in good.to_csv()
    early = ticks[Action(0, 0, BACKWARD)]
    with pytest.raises(StageGraphError, match="before its last backward or weight action"):
        pm.Schedule(s.name, 2, (0, 1), s.predecessors, s.ticks, (), ((0, early),))
    with pytest.raises(StageGraphError, match="runs no action that ends a unit"):
        pm.Schedule(s.name, 2, (0, 1), s.predecessors, s.ticks, (), ((0, 99),))
    with pytest.raises(StageGraphError, match="once per stage"):
        pm.Schedule(s.name, 2, (0, 1), s.predecessors, s.ticks, (), ((0, last0),) * 2)


def test_crosses_names_the_transfers_of_a_v():
    s = pm.make_schedule("zb-v", 4, 4, num_devices=2)  # stages on devices 0 1 1 0
    assert s.crosses(Action(1, 0, FORWARD)) == (True, False)  # 1 -> 2 on one device
    # Stage 2 (device 1) reads stage 3's cotangent (device 0), hands its own to stage 1
    # on its device; stage 3 reads none and sends to stage 2.
    assert s.crosses(Action(2, 0, BACKWARD)) == (True, False)
    assert s.crosses(Action(3, 0, BACKWARD)) == (False, True)
    assert s.crosses(Action(3, 0, "weight")) == (False, False)
