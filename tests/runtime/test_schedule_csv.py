"""Tests of pipemark.runtime.schedules.schedule_csv (and Schedule.to_csv): the schedules
torch.distributed.pipelining writes (tests/runtime/fixtures, written by torch 2.13 with
fixtures/torch_schedules.py) read, run as pipelines equal to jax.value_and_grad and
jax.jit of a training step (models whose stage graph is more than torch's chain: tied
embeddings, a skip connection), written back; every registered schedule round-trips;
malformed files, and orders that miss an edge of the pipeline, are refused naming the
row and the cell, or the action and the edge."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.errors import StageGraphError
from pipemark.runtime import BACKWARD, FORWARD, WEIGHT, Action
from pipemark.runtime.schedules.registry import SCHEDULES, make_schedule
from tests._devices import computing_on, devices
from tests._trees import assert_trees_close

FIXTURES = Path(__file__).parent / "fixtures"
# The runtime classes of torch write both formats; GPipe and 1F1B (one stage per rank)
# only their compute order.
RUNS = {
    # name: stage of each device, whether torch's schedule splits some backwards
    "gpipe": ((0, 1, 2, 3), False),
    "1f1b_runtime": ((0, 1, 2, 3), False),
    "interleaved1f1b": ((0, 1, 0, 1), False),
    "loopedbfs": ((0, 1, 0, 1), False),
    "interleavedzerobubble": ((0, 1, 0, 1), True),
    "zbvzerobubble": ((0, 1, 1, 0), True),
    "dualpipev": ((0, 1, 1, 0), True),
}


def _read(name: str, format: str = "compute_only") -> pm.Schedule:
    suffix = ".comms.csv" if format == "compute_comms" else ".csv"
    return pm.runtime.schedule_from_csv(FIXTURES / f"{name}{suffix}", format)


def test_dualpipev_runs_each_overlapped_pair_and_whole_backward_as_one_program():
    schedule = _read("dualpipev")
    ex = examples.mlp(num_layers=4, width=8, batch=8)
    step = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=4, num_microbatches=8, schedule=schedule
    )
    plan = step.plan(*ex.args)
    kinds = {FORWARD: plan.forward_stages, BACKWARD: plan.backward_stages}
    kinds[WEIGHT] = plan.weight_stages
    index = {
        i: (kind, k) for kind, per in kinds.items() for k, i in enumerate(per) if i is not None
    }
    # Each overlapped pair is one dispatched step, its parts the pair's forward and the
    # backward (with its W, where the stage's backward is split: a whole one).
    pairs = {frozenset(pair) for pair in schedule.overlapped}
    fused = [s for _, s in plan.steps.serial if s.fused is not None]
    overlapped = [s for s in fused if frozenset(p.action for p in s.parts[:2]) in pairs]
    assert len(overlapped) == len(schedule.overlapped) == 22
    # A whole backward on a stage split elsewhere runs its B and W as one program; the
    # first stage has no W program (its backward is all weight gradient), so its B
    # stays alone.
    whole = {(j, m) for j, m in schedule.whole_backwards if plan.weight_stages[j] is not None}
    with_both = {
        (p.action.stage, p.action.microbatch)
        for s in fused
        for p, q in zip(s.parts, s.parts[1:])
        if index[p.index] == (BACKWARD, p.action.stage) and index[q.index][0] == WEIGHT
    }
    assert with_both == whole and whole
    # Every action of the schedule runs once, in one program (a whole backward's W half
    # is no action of the schedule).
    ran = [p.action for _, s in plan.steps.serial for p in (s.parts or (s,))]
    synthetic = [Action(j, m, WEIGHT) for j, m in whole]
    assert sorted(ran) == sorted(
        [a for _, _, a in schedule.actions() if plan.roles()[a.kind][a.stage] is not None]
        + synthetic
    )
    # Only the stages that run whole backwards get the fused B + W program.
    b_and_w = {c.stages[-2:] for c in plan.fused if index[c.stages[-1]][0] == WEIGHT}
    assert b_and_w == {
        (plan.backward_stages[j], plan.weight_stages[j]) for j in {j for j, _ in whole}
    }


def test_torch_1f1b_order_is_refused_at_its_last_row():
    # torch 2.13's Schedule1F1B.pipeline_order numbers its last rank from microbatch 1
    # (3F1 .. 3F8) and runs 3B0 first: torch's own _validate_schedule refuses it too.
    with pytest.raises(pm.PipemarkError, match=r"Row 3, cell 1 \('3B0'\): the backward"):
        _read("1f1b")


@pytest.mark.parametrize(
    "name",
    [n for n in RUNS if (FIXTURES / f"{n}.comms.csv").exists()] + ["dualpipev_8stages"],
)
def test_compute_comms_files_read_to_the_same_orders(name):
    only, comms = _read(name), _read(name, "compute_comms")
    assert comms.device_orders() == only.device_orders()
    assert comms.overlapped == only.overlapped and not only.reduce_grad
    # REDUCE_GRAD, as torch lowers it, after each stage's last backward-like action.
    ticks = {a: t for t, _, a in comms.actions()}
    last = {
        j: max(t for a, t in ticks.items() if a.stage == j and a.kind != FORWARD)
        for j in range(comms.num_stages)
    }
    assert dict(comms.reduce_grad) == last
    # Written back (UNSHARD / RESHARD left out: pipemark does not shard), read the same.
    again = pm.runtime.schedule_from_csv(comms.to_csv("compute_comms"), "compute_comms")
    assert again.device_orders() == comms.device_orders()
    assert again.reduce_grad == comms.reduce_grad


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("format", ["compute_only", "compute_comms"])
def test_every_registered_schedule_round_trips(name, format):
    schedule = make_schedule(name, 4, 8, num_devices=4)
    assert pm.runtime.schedule_from_csv(schedule.to_csv(format), format, name=name) == schedule


def test_a_path_a_str_path_or_the_text(tmp_path):
    schedule = make_schedule("zb-v", 4, 4, num_devices=2)
    path = tmp_path / "zbv.csv"
    text = schedule.to_csv(path=path)
    assert path.read_text() == text
    for given in (path, str(path), text):
        assert pm.runtime.schedule_from_csv(given, name="zb-v") == schedule


def test_idle_cells_are_idle_ticks():
    # 1F1B's grid as pipemark writes it, one forward delayed by two idle cells more.
    s = pm.runtime.schedule_from_csv("0F0,0F1,,,,0B0,0B1\n,1F0,1B0,1F1,1B1")
    assert [a and a.label(True) for a in (t[0] for t in s.ticks)] == [
        "F0", "F1", None, None, None, "B0", "B1",
    ]  # fmt: skip
    # An action whose inputs are not ready at its cell runs when they are.
    s = pm.runtime.schedule_from_csv("0F0,0B0\n1F0,1B0")
    assert s.num_ticks == 4 and s.ticks[1][1] == Action(1, 0, FORWARD)


_GOOD = "0F0,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1"


@pytest.mark.parametrize(
    ("text", "format", "match"),
    [
        ("0F0,0X1\n1F0", "compute_only", r"Row 0, cell 1 \('0X1'\): '0X1' is not an action"),
        ("0F0,0B0\n1B0,1F0", "compute_only", r"Row 1, cell 0 \('1B0'\): the backward of "
         r"stage 1 for microbatch 0 comes before the forward"),
        ("0F0,1B0\n1F0,0B0", "compute_only", r"Row 1, cell 0 \('1F0'\): stage 1 is on row 1 "
         r"here but on row 0 at row 0, cell 1"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0", "compute_only",
         r"Microbatch 1 is missing: the file has no forward of stage 1 for microbatch 1"),
        ("0F0,0B0\n2F0,2B0", "compute_only", r"Stage\(s\) \[1\] have no action"),
        ("0F0,0B0,0F0\n1F0,1B0", "compute_only", r"Row 0, cell 2 \('0F0'\): the forward "
         r"of stage 0 for microbatch 0 runs a second time \(first at row 0, cell 0"),
        ("0F0,0I0\n1F0,1B0", "compute_only", r"Row 0, cell 1 \('0I0'\): an input-gradient"),
        ("0F0,0B0,0W0\n1F0,1B0", "compute_only", r"Row 0, cell 2 \('0W0'\): a W after a whole"),
        ("0F0,0W0,0I0\n1F0,1B0", "compute_only", r"Row 0, cell 1 \('0W0'\): the weight"),
        ("0F0,0SEND_F0,0B0\n1F0,1B0", "compute_only", r"Row 0, cell 1 .*format='compute_comms'"),
        ("0F0,0B0\n1F0,1B0,0UNSHARD", "compute_only", r"Row 1, cell 2 .*lives on row 0"),
        ("0F0,0REDUCE_GRAD,0B0\n1F0,1B0", "compute_only",
         r"Row 0, cell 1 \('0REDUCE_GRAD'\): reduces stage 0's gradients before its backward"),
        ("(0F0;1B0)OVERLAP_F_B,0B0\n1F0", "compute_only", r"Row 1, cell 0 \('1F0'\): stage 1 "
         r"is on row 1 here but on row 0 at row 0, cell 0 \('\(0F0;1B0\)OVERLAP_F_B'\)"),
        ("0F0,0SEND_F0,0B0\n1F0,1B0,1SEND_B0", "compute_comms", r"miss 2 that pipemark "
         r"infers.*RECV_F of stage 1 for microbatch 0 \(row 1\)"),
        ("0F0,0SEND_F0,0SEND_B0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0", "compute_comms",
         r"Row 0, cell 2 \('0SEND_B0'\): pipemark infers no such transfer"),
        ("0F0,0SEND_F0,0B0,0RECV_B0\n1RECV_F0,1F0,1B0,1SEND_B0", "compute_comms",
         r"Row 0, cell 3 \('0RECV_B0'\): a RECV_B comes before the action"),
        ("0F0,0B0", "compute_csv", r"Unknown CSV format 'compute_csv'"),
        ("", "compute_only", "holds no compute action"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_refused_naming_the_row_and_cell(text, format, match):
    with pytest.raises(pm.PipemarkError, match=match):
        pm.runtime.schedule_from_csv(text, format)
    pm.runtime.schedule_from_csv(_GOOD)  # the well-formed one reads


def test_a_deadlock_names_the_cells():
    # Device 1 waits for stage 0's forward of microbatch 1, queued behind the backward
    # of microbatch 0, which waits for device 1's.
    with pytest.raises(pm.PipemarkError, match=r"deadlock.*In the file: Row 0, cell 1"):
        pm.runtime.schedule_from_csv("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1")


# ------------------------------------------------------------- the files, run
# torch's pipelines are chains, and so are the schedules its files hold. The models here
# are more than a chain: a pipeline runs a file's order on its own graph where the order
# meets it, pipemark making the transfers of the extra edges.


def _params(rng, *shapes):
    return [jnp.asarray(rng.normal(size=shape), jnp.float32) / 2 for shape in shapes]


def _tied() -> examples.Example:
    """Tied embeddings (GPT-2's, Gemma's): the first stage multiplies by the embedding
    ``E``, the last by its transpose, so the last stage reads the first's weight (the
    edge 0->3 beside the chain's) and ``E``'s gradient sums the two stages'."""
    rng = np.random.default_rng(0)
    embed, *blocks = _params(rng, (6, 4), (4, 4), (4, 4))
    batch = tuple(_params(rng, (8, 6), (8, 6)))

    def loss_fn(params, batch):
        x, y = batch
        h = jnp.tanh(x @ params["embed"])
        for w in params["blocks"]:
            pm.mark_pipeline_boundary()
            h = jnp.tanh(h @ w)
        pm.mark_pipeline_boundary()
        return jnp.mean((h @ params["embed"].T - y) ** 2)

    return examples.Example(loss_fn, {"embed": embed, "blocks": blocks}, batch)


def _skip() -> examples.Example:
    """A skip connection: stage 2 adds stage 0's output to its own (the edge 0->2)."""
    rng = np.random.default_rng(1)
    params = _params(rng, (4, 4), (4, 4), (4, 4), (4, 4))
    batch = tuple(_params(rng, (8, 4), (8, 4)))

    def loss_fn(params, batch):
        x, y = batch
        first = h = jnp.tanh(x @ params[0])
        pm.mark_pipeline_boundary()
        h = jnp.tanh(h @ params[1])
        pm.mark_pipeline_boundary()
        h = jnp.tanh(h @ params[2]) + first
        pm.mark_pipeline_boundary()
        return jnp.mean((h @ params[3] - y) ** 2)

    return examples.Example(loss_fn, params, batch)


_MODELS = {
    # name: the model, its stage graph as the pipeline finds it
    "tied": (_tied, {0: (), 1: (0,), 2: (1,), 3: (0, 2)}),
    # (and 1->3: the add passes stage 3's cotangent on to stage 0's output unchanged,
    # where stage 1's backward sums it with its own)
    "skip": (_skip, {0: (), 1: (0,), 2: (0, 1), 3: (1, 2)}),
}


@functools.cache
def _reference(model: str, train: bool, used: tuple):
    """The model's function (an SGD step of its loss where ``train``, else the loss), its
    arguments on the first of ``used`` and what jax.jit of the function (of
    jax.value_and_grad of the loss) returns for them: once per model, not per file."""
    with computing_on(used):
        ex = _MODELS[model][0]()
        fn, args = ex.loss_fn, ex.args
        if train:
            fn, init_state = examples.train_step(ex.loss_fn)
            args = (ex.params, init_state(ex.params), ex.batch)
        return fn, args, jax.jit(fn if train else jax.value_and_grad(fn))(*args)


def _step(model: str, schedule: pm.Schedule, train: bool):
    """The model as a pipeline on ``schedule`` (pm.pipeline_train_step where ``train``,
    else pm.pipeline_value_and_grad), its arguments and jax.jit's result for them."""
    used = devices(schedule.num_devices)
    fn, args, want = _reference(model, train, tuple(used[:1]))
    wrap = pm.pipeline_train_step if train else pm.pipeline_value_and_grad
    step = wrap(fn, num_microbatches=schedule.num_microbatches, schedule=schedule, devices=used)
    return step, args, want


@pytest.mark.parametrize(
    ("name", "train"),
    [(name, False) for name in RUNS] + [(name, True) for name in RUNS if name != "1f1b_runtime"],
)
def test_torch_schedules_run_tied_embeddings_equal_to_jax(name, train):
    # The configuration torch users run: a file of torch's (a chain, {0->1, 1->2, 2->3})
    # for a model whose last stage reads the first stage's embedding.
    schedule = _read(name)
    placement, splits = RUNS[name]
    assert schedule.stage_devices == placement and schedule.num_microbatches == 8
    assert schedule.splits_backward == splits
    assert schedule.stage_graph == {0: (), 1: (0,), 2: (1,), 3: (2,)}
    step, args, want = _step("tied", schedule, train)
    assert_trees_close(step(*args), want, rtol=2e-5, atol=1e-6)
    # The file's order, run on the pipeline's graph: its ticks, each action once.
    plan = step.plan(*args)
    assert plan.schedule.stage_graph == _MODELS["tied"][1]
    assert plan.schedule.ticks == schedule.ticks
    assert plan.schedule.overlapped == schedule.overlapped
    assert plan.steps.num_actions == sum(
        1 for _, _, a in schedule.actions() if plan.roles()[a.kind][a.stage] is not None
    )


@pytest.mark.parametrize("name", ["gpipe", "zbvzerobubble"])
def test_torch_schedules_run_a_skip_connection_equal_to_jax(name):
    # Stage 2 reads stage 0's output, on another device in both placements.
    schedule = _read(name)
    step, args, want = _step("skip", schedule, train=False)
    assert_trees_close(step(*args), want, rtol=2e-5, atol=1e-6)
    assert step.plan(*args).schedule.stage_graph == _MODELS["skip"][1]


def test_a_compute_comms_file_reads_with_the_tied_graph():
    # torch writes the transfers of a chain; the edge 0->3 needs none it does not write
    # here (stage 3 reads stage 2 from the other row already), and pipemark makes its own.
    graph = _MODELS["tied"][1]
    comms = pm.runtime.schedule_from_csv(
        FIXTURES / "interleaved1f1b.comms.csv", "compute_comms", stage_graph=graph
    )
    assert comms.stage_graph == graph
    assert comms.device_orders() == _read("interleaved1f1b").device_orders()


def test_an_order_that_misses_an_edge_of_the_pipeline_is_refused():
    # Read for a diamond (stages 1 and 2 both read stage 0 alone), the file runs the
    # forwards of stages 1 and 2 at one tick; the skip model's stage 2 also reads stage 1.
    text = "0F0,0F1,,,,,0B0,0B1\n,1F0,1F1,,,1B0,1B1\n,2F0,2F1,,2B0,2B1\n,,,3F0,3F1,3B0,3B1"
    schedule = pm.runtime.schedule_from_csv(text, stage_graph={1: (0,), 2: (0,), 3: (1, 2)})
    step, args, _ = _step("skip", schedule, train=False)
    with pytest.raises(
        StageGraphError,
        match=r"runs F0s2 \(the forward of stage 2 for microbatch 0\) at tick 1, before "
        r"F0s1 .*the edge 1->2: the forward of stage 2 reads the outputs of stage 1",
    ):
        step(*args)
