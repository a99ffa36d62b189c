"""merge_stages, rename_stages, merge_consecutive, pair_stages, and the stage roles
they carry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.plot import stage_layout
from pipemark.primitive import is_marker
from pipemark.roles import BACKWARD, FORWARD, MIXED, WEIGHT, StageRole

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
    with pytest.raises(pm.errors.StageGraphError, match=r"cycle: .*'a\+c'.*'b'.*Merge only"):
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
    markers = [e.params["name"] for e in renamed["embed"].jaxpr.eqns if is_marker(e)]
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
    # Two programs round differently: 9 float32 ulps (1.02e-6) at XLA's backend
    # optimisation level 0 on JAX 0.12 with AVX2, so within 1e-5.
    np.testing.assert_allclose(merged(X)[0], jax.jit(jax.grad(_four_marked_layers))(X), rtol=1e-5)

    def step(x):
        return x - 0.1 * pm.mark_gradient(jax.grad(_four_marked_layers)(x))

    with_update = P.merge_consecutive(pm.split(step, X), 2)
    assert [s.name for s in with_update.stages][-1] == "apply_grad"
    np.testing.assert_allclose(with_update(X)[0], jax.jit(step)(X), rtol=1e-5)
    with pytest.raises(pm.PipemarkError, match="marks only 4 stages"):
        P.merge_consecutive(staged, 5)


# ------------------------------------------------------ roles held on the stages


def _roles(staged):
    return [(s.role.kind, s.role.owner) for s in staged.stages]


def test_merge_consecutive_and_split_backward_keep_the_roles():
    ex = examples.mlp(num_layers=4, width=4, batch=2)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    assert _roles(staged) == [(FORWARD, None)] * 4 + [(BACKWARD, f"layer{k}") for k in (3, 2, 1, 0)]
    merged = P.merge_consecutive(staged, 2)
    assert _roles(merged) == [
        (FORWARD, None),
        (FORWARD, None),
        (BACKWARD, "stage1"),
        (BACKWARD, "stage0"),
    ]
    split = P.split_backward(merged)
    assert _roles(split) == [
        (FORWARD, None),
        (FORWARD, None),
        (BACKWARD, "stage1"),
        (WEIGHT, "stage1"),
        (BACKWARD, "stage0"),  # nothing reads its input cotangent: all W, not split
    ]
    assert P.pair_stages(split) == ([0, 1], [4, 2], [None, 3])
    want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
    got = split(*ex.args)
    for a, b in zip(got, jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_merged_backward_belongs_to_the_merged_forward_whatever_its_name():
    staged = pm.split(jax.grad(_four_marked_layers), X)
    groups = {
        "front": ["layer0", "layer1"],
        "back": ["layer2", "layer3"],
        "back_grads": ["layer3_backward", "layer2_backward"],
        "front_grads": ["layer1_backward", "layer0_backward"],
    }
    merged = P.merge_stages(staged, groups)
    assert merged["front_grads"].role == StageRole(BACKWARD, "front")
    assert merged["back_grads"].role == StageRole(BACKWARD, "back")
    assert P.pair_stages(merged) == ([0, 1], [3, 2], [None, None])


def test_a_merge_across_roles_is_mixed_and_refused_by_the_pairing():
    staged = pm.split(jax.grad(_four_marked_layers), X)
    merged = P.merge_stages(staged, [["layer3", "layer3_backward"]])
    assert merged["layer3+layer3_backward"].role.kind == MIXED
    with pytest.raises(pm.errors.StageGraphError, match="merges stages of different roles"):
        P.pair_stages(merged)
    # The backward stages of forward stages merged apart belong to no one stage.
    apart = P.merge_stages(staged, [["layer1_backward", "layer0_backward"]])
    assert apart["layer1_backward+layer0_backward"].role.kind == MIXED


def test_a_forward_stage_renamed_with_a_backward_suffix_stays_forward():
    staged = pm.split(jax.grad(_four_marked_layers), X)
    renamed = P.rename_stages(staged, {"layer0": "embed_backward"})
    assert renamed["embed_backward"].role == StageRole(FORWARD)
    # Its backward stage keeps its name and follows its forward stage's new one.
    assert renamed["layer0_backward"].role == StageRole(BACKWARD, "embed_backward")
    assert P.pair_stages(renamed) == P.pair_stages(staged)
    assert pm.views.stage_colors(renamed)[0] == pm.views.stage_colors(renamed)[-1]
    layout = stage_layout(renamed)
    assert layout["embed_backward"] == (0.0, 1.0) and layout["layer0_backward"] == (0.0, 0.0)
    split = P.split_backward(renamed)
    np.testing.assert_allclose(split(X)[0], jax.jit(jax.grad(_four_marked_layers))(X), rtol=1e-5)
    assert all(
        s.role.owner in {t.name for t in split.stages if t.role.kind == FORWARD}
        for s in split.stages
        if s.role.owner is not None
    )
    # Sliced from names alone, the same name reads as a backward stage with no forward.
    with pytest.raises(pm.errors.StageGraphError, match="no forward stage named 'embed'"):
        P.pair_stages(P.slice_stages(renamed.as_closed_jaxpr()))
