"""insert_markers, layers_from_boundaries, insert_markers_by_scope."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Literal, check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.passes._markers import find_stage_spans
from pipemark.primitive import is_marker
from tests._exact import assert_same_equations_same_bits

P = pm.passes


def marker_names(cj, mark_type=None):
    return [
        e.params["name"]
        for e in cj.eqns
        if e.primitive is pm.pipeline_p and mark_type in (None, e.params["mark_type"])
    ]


def assert_values_cross_through_markers(cj):
    """Inside every stage, a non-marker equation reads only values defined in the same
    stage (start-marker results included) or literals; the program's results come from
    end markers or straight from inputs/constants."""
    spans = find_stage_spans(cj)
    stage_of_var = {}
    for k, span in enumerate(spans):
        for eqn in cj.eqns[span.first : span.last + 1]:
            for v in eqn.outvars:
                stage_of_var[v] = k
    covered = sum(span.last - span.first + 1 for span in spans)
    assert covered == len(cj.eqns), "every equation is inside a stage"
    for k, span in enumerate(spans):
        for eqn in cj.eqns[span.first + 1 : span.last + 1]:
            for a in eqn.invars:
                if isinstance(a, Literal):
                    continue
                assert stage_of_var.get(a) == k, (eqn, a)
    end_results = {v for e in cj.eqns if is_marker(e, "end") for v in e.outvars}
    outer = set(cj.jaxpr.invars) | set(cj.jaxpr.constvars)
    for a in cj.jaxpr.outvars:
        assert isinstance(a, Literal) or a in end_results or a in outer


def assert_pure(cj, run):
    before_text = str(cj)
    before_eqns = list(cj.eqns)
    before_params = [dict(e.params) for e in cj.eqns]
    before_invars = [list(e.invars) for e in cj.eqns]
    out = run(cj)
    assert str(cj) == before_text
    assert all(a is b for a, b in zip(cj.eqns, before_eqns)) and len(cj.eqns) == len(before_eqns)
    assert [dict(e.params) for e in cj.eqns] == before_params
    assert all(all(x is y for x, y in zip(e.invars, inv)) for e, inv in zip(cj.eqns, before_invars))
    return out


def chain(x):
    a = jnp.sin(x)
    b = jnp.cos(a)
    c = jnp.tanh(b)
    d = jnp.exp(c) * 2.0
    return d + a  # a skips ahead


X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32)

# ------------------------------------------------------------------ insert_markers


def test_insert_markers_structure_and_values():
    cj = jax.make_jaxpr(chain)(X)
    marked = assert_pure(cj, lambda c: P.insert_markers(c, [2, 4], names=["a", "b", "c"]))
    check_jaxpr(marked.jaxpr)
    assert marker_names(marked, "start") == ["a", "b", "c"]
    assert marker_names(marked, "end") == ["a", "b", "c"]
    assert len(marked.eqns) == len(cj.eqns) + 6
    assert_values_cross_through_markers(marked)
    assert_same_equations_same_bits(marked, cj, X)
    # Non-marker equations keep primitive and order.
    plain = [e.primitive for e in marked.eqns if e.primitive is not pm.pipeline_p]
    assert plain == [e.primitive for e in cj.eqns]


def test_skip_value_flows_only_through_its_own_stages():
    cj = jax.make_jaxpr(chain)(X)  # sin cos tanh exp mul add
    marked = P.insert_markers(cj, [1, 2, 3, 5])  # a=sin is read by the last stage only
    staged = P.slice_stages(marked)
    last = staged.stages[-1]
    assert {r.stage for r in last.inputs} == {0, 3}
    assert staged.graph.has_edge("stage0", "stage4")
    # stage1..3 never see the skipped value: each reads only its predecessor.
    for k in (1, 2, 3):
        assert [r.stage for r in staged.stages[k].inputs] == [k - 1]


def test_default_names_and_cut_at_zero_changes_nothing():
    cj = jax.make_jaxpr(chain)(X)
    a = P.insert_markers(cj, [3])
    b = P.insert_markers(cj, [0, 3])
    assert marker_names(a, "start") == ["stage0", "stage1"]
    assert str(a) == str(b)
    assert marker_names(P.insert_markers(cj, []), "start") == ["stage0"]


def test_inputs_constants_and_literals():
    const = np.arange(6, dtype=np.float32)

    def f(x, y):
        u = x * 3.0 + const  # literal and constant in stage 0
        v = jnp.sin(y) * const  # constant again, input y in stage 1
        return u + v + x  # x read by stage 0 and stage 2

    cj = jax.make_jaxpr(f)(X, X)
    assert len(cj.jaxpr.constvars) == 1
    n = len(cj.eqns)
    marked = P.insert_markers(cj, [2, n - 2])
    check_jaxpr(marked.jaxpr)
    assert_values_cross_through_markers(marked)
    (constvar,) = marked.jaxpr.constvars
    starts = [e for e in marked.eqns if is_marker(e, "start")]
    # The constant enters both stages that read it; x enters stage 0 and stage 2.
    assert [constvar in e.invars for e in starts] == [True, True, False]
    x = marked.jaxpr.invars[0]
    assert [x in e.invars for e in starts] == [True, False, True]
    # Literals stay inline.
    assert not any(isinstance(a, Literal) for e in starts for a in e.invars)
    assert any(isinstance(a, Literal) for e in marked.eqns for a in e.invars)
    assert_same_equations_same_bits(marked, cj, X, X)


def test_results_that_are_inputs_or_literals_pass_untouched():
    cj = jax.make_jaxpr(lambda x, y: (jnp.sin(x), y, 2.0, jnp.cos(x)))(X, X)
    marked = P.insert_markers(cj, [1])
    check_jaxpr(marked.jaxpr)
    outs = marked.jaxpr.outvars
    assert outs[1] is marked.jaxpr.invars[1]
    staged = P.slice_stages(marked)
    staged.verify(cj, X, X)


@pytest.mark.parametrize(
    ("cuts", "names", "pattern"),
    [
        ([3, 1], None, r"cuts must be sorted: 1 comes after 3"),
        ([1, 1], None, r"cuts has equation index 1 twice"),
        ([99], None, r"Cut 99 is out of range: the program has 6 equations"),
        ([-1], None, r"Cut -1 is out of range"),
        ([1.5], None, r"cuts must be a sequence of equation indices"),
        ("ab", None, r"cuts must be a sequence of equation indices"),
        ([True], None, r"cuts must be a sequence of equation indices"),
        ([2], ["only"], r"names has 1 entries but the cuts make 2 stages"),
        ([2], ["a", "a"], r"Stage name 'a' appears twice"),
        ([2], ["a", 7], r"Stage name 7 is not a non-empty str"),
        ([2], "ab", r"names must be a sequence of str"),
    ],
)
def test_insert_markers_rejects_bad_arguments(cuts, names, pattern):
    cj = jax.make_jaxpr(chain)(X)
    with pytest.raises(pm.PipemarkError, match=pattern):
        P.insert_markers(cj, cuts, names)


def test_insert_markers_rejects_empty_program_and_non_jaxpr():
    with pytest.raises(pm.PipemarkError, match="no equations"):
        P.insert_markers(jax.make_jaxpr(lambda x: x)(X), [])
    with pytest.raises(pm.PipemarkError, match=r"takes a jax\.extend\.core\.ClosedJaxpr"):
        P.insert_markers(chain, [1])


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
@pytest.mark.parametrize("grad", [False, True])
def test_insert_markers_on_model_zoo(kind, grad):
    ex = getattr(examples, kind)(markers=None)
    cj = ex.trace(grad)
    n = len(cj.eqns)
    cuts = [0, n // 4, n // 2, 3 * n // 4]
    marked = assert_pure(cj, lambda c: P.insert_markers(c, cuts))
    check_jaxpr(marked.jaxpr)
    assert_values_cross_through_markers(marked)
    staged = P.slice_stages(marked, unmarked="error")
    assert len(staged.stages) == 4
    staged.verify(cj, *ex.args)


# ---------------------------------------------------------- layers_from_boundaries


@pytest.mark.parametrize("kind", ["mlp", "resnet", "transformer"])
def test_layers_from_boundaries_model_zoo(kind):
    ex = getattr(examples, kind)(markers="boundary")
    cj = ex.trace()
    num_boundaries = sum(is_marker(e, "boundary") for e in cj.eqns)
    layers = assert_pure(cj, P.layers_from_boundaries)
    check_jaxpr(layers.jaxpr)
    assert not any(is_marker(e, "boundary") for e in layers.eqns)
    assert marker_names(layers, "start") == [f"layer{i}" for i in range(num_boundaries + 1)]
    assert_values_cross_through_markers(layers)
    P.slice_stages(layers, unmarked="error").verify(ex.loss_fn, *ex.args)
    # Same layers as the start/end-marked model.
    reference = getattr(examples, kind)(markers="startend").trace()
    assert len(find_stage_spans(layers)) == len(find_stage_spans(reference))


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_layers_from_boundaries_value_and_grad_mirrors_backward(kind):
    ex = getattr(examples, kind)(markers="boundary")
    cj = ex.trace(grad=True)
    layers = assert_pure(cj, P.layers_from_boundaries)
    check_jaxpr(layers.jaxpr)
    forward = [n for n in marker_names(layers, "start") if not n.endswith("_backward")]
    backward = [n for n in marker_names(layers, "start") if n.endswith("_backward")]
    assert len(forward) > 1
    # The same stage names, in the same order, as jax.grad of a start/end-marked model.
    assert backward == [f"{n}_backward" for n in reversed(forward)]
    assert_values_cross_through_markers(layers)
    staged = P.slice_stages(layers, unmarked="error")
    staged.verify(cj, *ex.args)
    # Each backward stage reads forward values only from its own mirror (and program
    # inputs): nothing is fetched across the pipeline from another forward layer.
    index = {s.name: k for k, s in enumerate(staged.stages)}
    for name in backward:
        mirror = index[name[: -len("_backward")]]
        stage = staged.stages[index[name]]
        forward_sources = {
            ref.stage for ref in stage.inputs if ref.kind == "stage" and ref.stage < len(forward)
        }
        assert forward_sources <= {mirror}, (name, forward_sources)


def test_layers_from_boundaries_skips_empty_layers_and_handles_shared_inputs():
    def f(x, y):
        pm.mark_pipeline_boundary()  # nothing before: no empty layer
        a = jnp.sin(x) + y
        pm.mark_pipeline_boundary()
        pm.mark_pipeline_boundary()  # nothing between: no empty layer
        b = jnp.cos(a) * y * 2.0  # y used again, literal 2.0
        pm.mark_pipeline_boundary()  # nothing after
        return b, a

    cj = jax.make_jaxpr(f)(X, X)
    layers = P.layers_from_boundaries(cj)
    check_jaxpr(layers.jaxpr)
    assert marker_names(layers, "start") == ["layer0", "layer1"]
    starts = [e for e in layers.eqns if is_marker(e, "start")]
    y = layers.jaxpr.invars[1]
    assert all(y in e.invars for e in starts)
    assert_values_cross_through_markers(layers)
    P.slice_stages(layers).verify(f, X, X)


def test_layers_from_boundaries_without_boundaries_is_one_layer():
    cj = jax.make_jaxpr(chain)(X)
    layers = P.layers_from_boundaries(cj)
    assert marker_names(layers) == ["layer0", "layer0"]


def test_backward_joins_the_last_layer_across_a_closing_boundary():
    # The boundary is the forward part's last equation, so the program has one layer;
    # the backward part joins it, and the dropped boundary sits inside that layer.
    def f(x):
        y = jnp.sin(x).sum()
        pm.mark_pipeline_boundary()
        return y

    cj = jax.make_jaxpr(jax.value_and_grad(f))(X)
    layers = assert_pure(cj, P.layers_from_boundaries)
    check_jaxpr(layers.jaxpr)
    assert marker_names(layers) == ["layer0", "layer0"]
    assert not any(is_marker(e, "boundary") for e in layers.eqns)
    assert len(layers.eqns) == len(cj.eqns) - 1 + 2
    assert_values_cross_through_markers(layers)
    P.slice_stages(layers).verify(cj, X)


def test_boundary_marker_with_operands_is_replaced_by_them():
    def f(x):
        (y,) = pm.mark((jnp.sin(x),), name="boundary", mark_type="boundary")
        return jnp.cos(y)

    cj = jax.make_jaxpr(f)(X)
    layers = P.layers_from_boundaries(cj)
    check_jaxpr(layers.jaxpr)
    assert marker_names(layers, "start") == ["layer0", "layer1"]
    P.slice_stages(layers).verify(f, X)


# --------------------------------------------------------- insert_markers_by_scope


def scoped(x, w):
    with jax.named_scope("embed"):
        x = jnp.tanh(x @ w)
    for i in range(2):
        with jax.named_scope(f"block{i}"):
            with jax.named_scope("attn"):
                x = jnp.sin(x @ w)
            with jax.named_scope("mlp"):
                x = jnp.cos(x) * 2.0
    return jnp.sum(x)  # unscoped: joins the block before it


W = jnp.eye(6, dtype=jnp.float32) * 0.5
XS = jnp.ones((2, 6), jnp.float32)


def test_insert_markers_by_scope_depth_one():
    cj = jax.make_jaxpr(scoped)(XS, W)
    marked = assert_pure(cj, P.insert_markers_by_scope)
    check_jaxpr(marked.jaxpr)
    assert marker_names(marked, "start") == ["embed", "block0", "block1"]
    staged = P.slice_stages(marked, unmarked="error")
    assert staged.stages[-1].jaxpr.eqns[-2].primitive.name == "reduce_sum"
    staged.verify(scoped, XS, W)


def test_insert_markers_by_scope_depth_two():
    marked = P.insert_markers_by_scope(jax.make_jaxpr(scoped)(XS, W), depth=2)
    assert marker_names(marked, "start") == [
        "embed",
        "block0/attn",
        "block0/mlp",
        "block1/attn",
        "block1/mlp",
    ]


def test_insert_markers_by_scope_value_and_grad_mirrors_stages():
    cj = jax.make_jaxpr(jax.value_and_grad(scoped, argnums=1))(XS, W)
    marked = P.insert_markers_by_scope(cj)
    check_jaxpr(marked.jaxpr)
    assert marker_names(marked, "start") == [
        "embed",
        "block0",
        "block1",
        "block1_backward",
        "block0_backward",
        "embed_backward",
    ]
    P.slice_stages(marked).verify(cj, XS, W)


def test_insert_markers_by_scope_named_call_and_repeated_scope():
    def f(x):
        x = jax.named_call(jnp.sin, name="enc")(x)
        with jax.named_scope("dec"):
            x = jnp.cos(x)
        with jax.named_scope("enc"):  # comes back: a numbered name
            x = jnp.tan(x)
        return x

    marked = P.insert_markers_by_scope(jax.make_jaxpr(f)(X))
    assert marker_names(marked, "start") == ["enc", "dec", "enc_2"]


def test_insert_markers_by_scope_unscoped_prefix_joins_first_scope():
    def f(x):
        x = x * 3.0
        with jax.named_scope("a"):
            return jnp.sin(x)

    marked = P.insert_markers_by_scope(jax.make_jaxpr(f)(X))
    assert marker_names(marked) == ["a", "a"]


@pytest.mark.parametrize("depth", [0, -1, 1.0, True, "1"])
def test_insert_markers_by_scope_rejects_bad_depth(depth):
    with pytest.raises(pm.PipemarkError, match="depth must be a positive int"):
        P.insert_markers_by_scope(jax.make_jaxpr(scoped)(XS, W), depth=depth)
