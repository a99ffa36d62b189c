"""The programs the runtime compiles (pipemark/runtime/devices/compilation.py): without marker
barriers, with their accumulators donated, and as lean as ``jax.jit`` of the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import io_callback

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.runtime.devices.compilation import keeps_markers, runtime_program
from pipemark.runtime.devices.steps import PARAM, STAGE
from pipemark.runtime.memory.programs import compiled_programs
from tests._trees import assert_trees_close
from tests.runtime._compiles import compilations


def _example():
    return examples.language_model(num_layers=3, vocab=64, d_model=32, seq=16, batch=4)


def _fused_program(plan):
    """The one-stage pipeline's one program (forward and backward fused), compiled."""
    (program,) = compiled_programs(plan).values()
    return program


def _one_stage_plan(num_microbatches=1):
    ex = _example()
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=1, num_microbatches=num_microbatches, devices=jax.devices()[:1]
    )
    return ex, pipe, pipe.plan(ex.params, ex.batch)


def test_runtime_programs_have_no_marker_barriers():
    _, _, plan = _one_stage_plan()
    assert any(
        e.primitive is pm.pipeline_p for s in plan.staged.stages for e in s.closed_jaxpr.jaxpr.eqns
    )
    text = _fused_program(plan).as_text()
    assert "optimization_barrier" not in text
    assert not keeps_markers()


def test_custom_call_lowering_keeps_the_markers():
    cj = jax.make_jaxpr(lambda x: pm.mark(x * 2, name="a", mark_type="end"))(1.0)
    assert [e.primitive.name for e in runtime_program(cj).jaxpr.eqns] == ["mul"]
    with pm.lowering("custom_call"):
        assert keeps_markers()
        assert runtime_program(cj) is cj


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_accumulators_are_donated_and_each_call_starts_from_zero(num_microbatches):
    """With several microbatches the accumulators are donated (added to in place);
    with one the program keeps none (its results are this microbatch's shares)."""
    ex, pipe, plan = _one_stage_plan(num_microbatches)
    (unit,) = plan.fused.values()
    assert unit.donates == (num_microbatches > 1) and unit.starts == (num_microbatches == 1)
    assert not plan.zeros  # no zeros shared between calls: each call makes its own
    # Committed to the stage's device, as compiled_programs lowers them: the program
    # the calls run is the one read below, compiled once (uncommitted, a call compiles
    # its own apart, as compiled_programs says: 5 s more of this test's 10).
    params, batch = jax.device_put((ex.params, ex.batch), jax.devices()[0])
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(params, batch)
    for _ in range(2):  # the second call must not add to the first's results
        loss, grads = pipe(params, batch)
        assert jnp.allclose(loss, want[0], rtol=1e-5)
        for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want[1])):
            assert jnp.allclose(g, w, rtol=1e-4, atol=1e-6)
    stats = _fused_program(plan).memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    grads_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(ex.params))
    if num_microbatches > 1:
        assert stats.alias_size_in_bytes >= grads_bytes
    else:  # no accumulators: the arguments are the parameters and the batch
        batch_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(ex.batch))
        assert stats.argument_size_in_bytes <= grads_bytes + batch_bytes + 64


def test_one_stage_program_needs_no_more_memory_than_jax_jit():
    """Issue #33: within 5 % of jax.jit(value_and_grad) of the same step (arguments,
    outputs and temporaries; donated accumulators counted once)."""
    ex, _, plan = _one_stage_plan()
    ours = _fused_program(plan).memory_analysis()
    theirs = jax.jit(jax.value_and_grad(ex.loss_fn)).lower(ex.params, ex.batch)
    theirs = theirs.compile().memory_analysis()
    if ours is None or theirs is None:
        pytest.skip("this backend reports no memory analysis")

    def total(m):
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )

    assert total(ours) <= 1.05 * total(theirs), (ours, theirs)


def _gpt_pipeline(num_stages):
    ex = examples.gpt(4, 16, 2, seq=8, batch=4, vocab=32, d_ff=32, compute_dtype=jnp.float32)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn,
        num_stages=num_stages,
        num_microbatches=2,
        schedule="interleaved",
        devices=jax.devices()[:1],
    )
    return ex, pipe


def _runs(plan):
    return {
        id(plan.units[s.index].run if s.fused is None else plan.fused[s.fused].run)
        for _, s in plan.steps.serial
    }


@pytest.mark.slow
def test_stages_of_identical_blocks_share_one_compiled_program():
    """Issue #33: stages 1 and 2 of a 4-stage GPT hold one identical block each; their
    markers have other names, which the compiled program leaves out, so they are one
    program, compiled once (forward, middle forward, last fused, middle backward,
    first backward: 5)."""
    clear_caches()
    ex, pipe = _gpt_pipeline(4)
    with compilations() as compiled:
        loss, grads = jax.block_until_ready(pipe(*ex.args))
    plan = pipe.plan(*ex.args)
    assert plan.units[1].run is plan.units[2].run
    assert len(_runs(plan)) == 5
    assert compiled.count("jit(run)") == 5
    want_loss, want_grads = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    assert jnp.allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)):
        assert jnp.allclose(g, w, rtol=1e-4, atol=1e-6)


def test_custom_call_programs_of_identical_blocks_stay_apart():
    # Under the custom-call lowering each program keeps its markers, which name their
    # stage: the programs differ, and each compiles on its own.
    clear_caches()
    ex, pipe = _gpt_pipeline(4)
    with pm.lowering("custom_call"):
        plan = pipe.plan(*ex.args)
        assert plan.units[1].run is not plan.units[2].run
        assert len(_runs(plan)) == 7


def _transposing_loss(params, x):
    w1, w2 = params
    h = jnp.sin(x @ w1).T  # XLA computes the transpose for free in a column-major layout
    pm.mark_pipeline_boundary()
    return jnp.mean(jnp.tanh(h.T @ w2) ** 2)


def _transposing_args():
    """Parameters and a batch for the transposing losses, committed to the first device
    as a call places them."""
    params = (jnp.linspace(-1, 1, 8 * 16).reshape(8, 16), jnp.linspace(-1, 1, 64).reshape(16, 4))
    x = jnp.linspace(-2, 2, 8 * 8).reshape(8, 8)
    return jax.device_put((params, x), jax.devices()[0])


def _handed_transposed(plan, params, x):
    """``h.T``, the value layer0 hands on, as the plan's first program returns it for
    the first microbatch."""
    shapes = [a.shape for a in plan.staged.stages[0].out_avals]
    (_, step), *_ = plan.steps.serial
    sends = {key[2]: position for position, key, _ in step.sends}
    leaves = jax.tree.leaves(params)
    inputs = [leaves[k] if source == PARAM else x[:4] for source, k in step.inputs]
    return plan.units[0].run([], inputs, jnp.float32(0.5))[1][sends[shapes.index((16, 4))]]


def test_values_kept_on_a_slot_are_handed_over_in_the_layout_xla_chooses():
    """Issue #40: a value that stays on its slot leaves its program in XLA's layout and
    the program that reads it is compiled for that layout, by a call as by
    compiled_programs (one compilation each); elsewhere outputs keep the default one.
    On CPU, XLA writes ``sin(x @ w1).T`` column-major, the default being row-major."""
    clear_caches()
    params, x = _transposing_args()
    pipe = pm.pipeline_value_and_grad(
        _transposing_loss, num_stages=2, num_microbatches=2, schedule="interleaved",
        devices=jax.devices()[:1],
    )  # fmt: skip
    plan = pipe.plan(params, x)
    programs = compiled_programs(plan)
    shapes = [a.shape for a in plan.staged.stages[0].out_avals]
    transposed = shapes.index((16, 4))  # h.T, which layer1 reads on the same device
    sends = {key[2]: position for position, key, _ in plan.steps.serial[0][1].sends}
    handed = programs["layer0"].output_formats[1][sends[transposed]]
    assert handed.layout.major_to_minor == (1, 0)
    step = next(s for _, s in plan.steps.serial if s.index != 0)
    position = step.inputs.index((STAGE, (0, 0, transposed)))
    reader = programs[next(n for n in programs if n.startswith("layer1"))]
    assert reader.input_formats[0][1][position].layout == handed.layout
    with compilations() as compiled:
        loss, grads = jax.block_until_ready(pipe(params, x))
    assert "jit(run)" not in compiled  # the call runs the programs compiled_programs made
    want_loss, want_grads = jax.jit(jax.value_and_grad(_transposing_loss))(params, x)
    # Two microbatches summed against one batch: rounding apart, not bits.
    assert_trees_close((loss, grads), (want_loss, want_grads), rtol=1e-5, atol=1e-7)
    # Across devices the value is sent in the default layout.
    apart = pm.pipeline_value_and_grad(
        _transposing_loss, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]
    )
    array = _handed_transposed(apart.plan(params, x), params, x)
    assert array.format.layout.major_to_minor == (0, 1)


def _transposing_loss_with_an_effect(params, x):
    w1, w2 = params
    # An ordered effect: the program takes a token (as Pallas's TPU interpret mode's do).
    io_callback(lambda: None, None, ordered=True)
    h = jnp.sin(x @ w1).T
    pm.mark_pipeline_boundary()
    return jnp.mean(jnp.tanh(h.T @ w2) ** 2)


def test_a_program_with_an_effect_hands_over_its_values_in_the_default_layout():
    """JAX 0.10.2 reports the outputs of a program with an ordered effect as laid out by
    default whatever XLA chose, so a reader compiled for the reported layout read
    ``sin(x @ w1).T`` (column-major on CPU) as row-major: wrong gradients, silently.
    Such a program writes the default layout, and the pipeline equals JAX's own."""
    clear_caches()
    params, x = _transposing_args()
    pipe = pm.pipeline_value_and_grad(
        _transposing_loss_with_an_effect, num_stages=2, num_microbatches=2,
        schedule="interleaved", devices=jax.devices()[:1],
    )  # fmt: skip
    plan = pipe.plan(params, x)
    assert plan.staged.stages[0].closed_jaxpr.effects
    array = _handed_transposed(plan, params, x)
    assert array.format.layout.major_to_minor == (0, 1)
    got = pipe(params, x)
    want = jax.jit(jax.value_and_grad(_transposing_loss_with_an_effect))(params, x)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-7)
