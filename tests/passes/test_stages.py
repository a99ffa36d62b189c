"""merge_stages and rename_stages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import check_jaxpr

import pipemark as pm
from pipemark import examples

P = pm.passes
X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)


def chain4(x):
    return jnp.exp(jnp.tanh(jnp.cos(jnp.sin(x))))


def staged_chain():
    cj = jax.make_jaxpr(chain4)(X)
    return cj, P.slice_stages(P.insert_markers(cj, [1, 2, 3], names=["a", "b", "c", "d"]))


def check(staged):
    for stage in staged.stages:
        check_jaxpr(stage.closed_jaxpr.jaxpr)
    check_jaxpr(staged.as_closed_jaxpr().jaxpr)


def test_merge_consecutive_stages():
    cj, staged = staged_chain()
    merged = P.merge_stages(staged, [["b", "c"]])
    check(merged)
    assert [s.name for s in merged.stages] == ["a", "b+c", "d"]
    assert [s.num_eqns for s in merged.stages] == [3, 6, 3]
    assert merged["b+c"].eqn_indices == staged["b"].eqn_indices + staged["c"].eqn_indices
    # The value from b to c stays inside; b+c reads a and feeds d.
    assert [str(r) for r in merged["b+c"].inputs] == ["stage0[0]"]
    assert len(merged["b+c"].out_avals) == 1
    merged.verify(cj, X)
    # Stitching gives the same equations as before the merge.
    assert all(x is y for x, y in zip(merged.as_closed_jaxpr().eqns, staged.as_closed_jaxpr().eqns))
    # The input is untouched.
    assert [s.name for s in staged.stages] == ["a", "b", "c", "d"]


def test_merge_with_names_and_indices():
    cj, staged = staged_chain()
    merged = P.merge_stages(staged, {"front": [0, "b"], "back": ["c", 3]})
    assert [s.name for s in merged.stages] == ["front", "back"]
    merged.verify(cj, X)
    assert len(merged.graph.edges) == 1


def test_group_of_one_in_a_mapping_takes_its_name():
    cj, staged = staged_chain()
    merged = P.merge_stages(staged, {"front": [0, 1], "middle": [2]})
    assert [s.name for s in merged.stages] == ["front", "middle", "d"]
    merged.verify(cj, X)


def test_merge_everything_is_one_stage():
    ex = examples.resnet(num_blocks=4, skip=2)
    cj = ex.trace(grad=True)
    staged = P.slice_stages(cj)
    merged = P.merge_stages(staged, {"all": [s.name for s in staged.stages]})
    check(merged)
    (stage,) = merged.stages
    assert sorted(r.index for r in stage.inputs) == list(range(len(cj.jaxpr.invars)))
    assert stage.num_eqns == len(cj.eqns)
    merged.verify(cj, *ex.args)


def test_merge_forward_with_backward_pairs_in_a_resnet():
    ex = examples.resnet(num_blocks=4, skip=2)
    cj = ex.trace(grad=True)
    staged = P.slice_stages(cj)
    # Pipeline-style grouping: each forward block with its neighbour.
    groups = [["block0", "block1"], ["block2", "block3"]]
    groups += [["block3_backward", "block2_backward"], ["block1_backward", "block0_backward"]]
    merged = P.merge_stages(staged, groups)
    check(merged)
    assert len(merged.stages) == 4
    merged.verify(cj, *ex.args)


def test_merge_non_adjacent_independent_stages_reorders():
    def f(x):
        a = pm.mark(x, name="a", mark_type="start")
        a = pm.mark(jnp.sin(a), name="a", mark_type="end")
        b = pm.mark(x, name="b", mark_type="start")
        b = pm.mark(jnp.cos(b), name="b", mark_type="end")
        c = pm.mark(a, name="c", mark_type="start")  # reads a only
        c = pm.mark(jnp.tanh(c), name="c", mark_type="end")
        return b, c

    cj = jax.make_jaxpr(f)(X)
    staged = P.slice_stages(cj)
    merged = P.merge_stages(staged, [["a", "c"]])
    check(merged)
    assert [s.name for s in merged.stages] == ["a+c", "b"]
    merged.verify(f, X)


def test_merge_that_makes_a_cycle_is_refused():
    _, staged = staged_chain()
    with pytest.raises(pm.StageGraphError, match=r"cycle: .*'a\+c'.*'b'.*Merge only"):
        P.merge_stages(staged, [["a", "c"]])


@pytest.mark.parametrize(
    ("groups", "pattern"),
    [
        ([["a", "zz"]], r"no stage 'zz'; the stages are 'a', 'b', 'c', 'd'"),
        ([[0, 9]], r"no stage 9"),
        ([["a", "b"], ["b", "c"]], r"stage 'b' is in two groups"),
        ([[]], r"group 0 is empty"),
        ({"d": ["a", "b"]}, r"two stages would be named 'd'"),
        ({3: ["a", "b"]}, r"stage name 3 is not a str"),
    ],
)
def test_merge_rejects_bad_groups(groups, pattern):
    _, staged = staged_chain()
    with pytest.raises(pm.PipemarkError, match=pattern):
        P.merge_stages(staged, groups)


def test_merge_rejects_non_staged():
    with pytest.raises(pm.PipemarkError, match="takes a StagedJaxpr"):
        P.merge_stages(jax.make_jaxpr(chain4)(X), [[0, 1]])


# -------------------------------------------------------------------------- rename


def test_rename_stages_renames_stage_and_markers():
    cj, staged = staged_chain()
    renamed = P.rename_stages(staged, {"a": "embed", "d": "head"})
    check(renamed)
    assert [s.name for s in renamed.stages] == ["embed", "b", "c", "head"]
    markers = [e.params["name"] for e in renamed["embed"].jaxpr.eqns if pm.is_marker(e)]
    assert markers == ["embed", "embed"]
    renamed.verify(cj, X)
    # Re-slicing the stitched program finds the new names.
    again = P.slice_stages(renamed.as_closed_jaxpr())
    assert [s.name for s in again.stages] == ["embed", "b", "c", "head"]
    # The input is untouched, and unrenamed stages are shared.
    assert staged["a"].jaxpr.eqns[0].params["name"] == "a"
    assert renamed["b"] is staged["b"]


def test_rename_only_touches_the_stage_own_markers():
    ex = examples.mlp(num_layers=2)
    staged = P.slice_stages(ex.trace(grad=True))
    renamed = P.rename_stages(staged, {"layer0": "first"})
    names = [s.name for s in renamed.stages]
    assert names == ["first", "layer1", "layer1_backward", "layer0_backward"]
    renamed.verify(ex.trace(grad=True), *ex.args)


@pytest.mark.parametrize(
    ("mapping", "pattern"),
    [
        ({"zz": "x"}, r"no stage named 'zz'"),
        ({"a": "b"}, r"two stages would be named 'b'"),
        ({"a": ""}, r"new name '' is not a non-empty str"),
        ({"a": 1}, r"new name 1 is not a non-empty str"),
        ([("a", "b")], r"mapping must map old stage names to new ones"),
    ],
)
def test_rename_rejects_bad_mappings(mapping, pattern):
    _, staged = staged_chain()
    with pytest.raises(pm.PipemarkError, match=pattern):
        P.rename_stages(staged, mapping)


def test_rename_swap_is_allowed():
    cj, staged = staged_chain()
    swapped = P.rename_stages(staged, {"a": "b", "b": "a"})
    assert [s.name for s in swapped.stages] == ["b", "a", "c", "d"]
    swapped.verify(cj, X)


def _four_marked_layers(x):
    for _ in range(4):
        pm.mark_pipeline_boundary()
        x = jnp.tanh(jnp.sin(x) * 1.5)
    return jnp.sum(x)


def test_merge_consecutive_pairs_backward_stages_and_keeps_the_update():
    staged = pm.split(jax.grad(_four_marked_layers), X)
    assert P.pair_stages(staged) == ([0, 1, 2, 3], [7, 6, 5, 4], [None] * 4)
    merged = P.merge_consecutive(staged, 2)
    check(merged)
    assert [s.name for s in merged.stages] == [
        "stage0",
        "stage1",
        "stage1_backward",
        "stage0_backward",
    ]
    assert P.merge_consecutive(staged, 4) is staged
    np.testing.assert_allclose(merged(X)[0], jax.jit(jax.grad(_four_marked_layers))(X), rtol=1e-6)

    def step(x):
        return x - 0.1 * pm.mark_gradient(jax.grad(_four_marked_layers)(x))

    with_update = P.merge_consecutive(pm.split(step, X), 2)
    assert [s.name for s in with_update.stages][-1] == "apply_grad"
    np.testing.assert_allclose(with_update(X)[0], jax.jit(step)(X), rtol=1e-6)
    with pytest.raises(pm.PipemarkError, match="marks only 4 stages"):
        P.merge_consecutive(staged, 5)
