"""mirror_cuts: cutting the backward part of a gradient program in mirror of the forward
layers, its dynamic program and its fallbacks."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import Var, check_jaxpr

import pipemark as pm
from pipemark import examples
from pipemark.passes import _backward
from pipemark.passes._backward import (
    _heaviest_descent,
    _place_cuts,
    crossing_bytes,
    forward_end,
    mirror_cuts,
)
from pipemark.passes._markers import find_stage_spans


def _assert_contract(cuts, begin, total, layers):
    """``layers`` non-empty backward stages in ``[begin, total)``: cuts strictly
    increasing, inside the backward part."""
    assert len(cuts) == layers - 1
    assert all(isinstance(c, int) for c in cuts)
    bounds = [begin, *cuts, total]
    assert all(a < b for a, b in itertools.pairwise(bounds)), bounds


# ------------------------------------------------------------ hand-made anchor patterns


def _program(layer_sizes, reads):
    """A forward part of ``len(layer_sizes)`` layers (``sin`` chains of the given
    lengths), then a backward part: ``cos`` of the last forward value, then one ``mul``
    per entry of ``reads``: ``(layer, k)`` multiplies by the ``k``-th value of that
    layer, ``None`` by a literal, ``"input"`` by an input no forward layer reads."""

    def f(x, unused):
        values, v = [], x
        for size in layer_sizes:
            layer = []
            for _ in range(size):
                v = jnp.sin(v)
                layer.append(v)
            values.append(layer)
        g = jnp.cos(v)
        for read in reads:
            if read is None:
                g = g * 2.0
            elif read == "input":
                g = g * unused
            else:
                layer, k = read
                g = g * values[layer][k % len(values[layer])]
        return g

    cj = jax.make_jaxpr(f)(np.ones(4, np.float32), np.ones(4, np.float32))
    bounds = list(itertools.accumulate(layer_sizes))
    return cj.jaxpr, bounds[-1], [0, *bounds[:-1]]


@st.composite
def _patterns(draw):
    layers = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 4), min_size=layers, max_size=layers))
    read = st.one_of(
        st.none(),
        st.just("input"),
        st.tuples(st.integers(0, layers - 1), st.integers(0, 3)),
    )
    # Mostly descending, like jax.grad makes them, with arbitrary reads mixed in.
    descending = [
        (layer, k) for layer in reversed(range(layers)) for k in range(draw(st.integers(0, 3)))
    ]
    noise = draw(st.lists(st.tuples(st.integers(0, 40), read), max_size=8))
    reads = list(descending)
    for at, r in noise:
        reads.insert(at % (len(reads) + 1), r)
    reads += [None] * max(0, layers - 1 - len(reads))  # the backward part needs `layers`
    return sizes, reads


@settings(max_examples=40, deadline=None)
@given(_patterns())
def test_contract_on_random_anchor_patterns(pattern):
    sizes, reads = pattern
    jaxpr, end, starts = _program(sizes, reads)
    layers = len(sizes)
    cuts = mirror_cuts(jaxpr, end, starts[1:], layers)
    _assert_contract(cuts, end, len(jaxpr.eqns), layers)
    # Deterministic, and the input is left alone.
    assert mirror_cuts(jaxpr, end, starts[1:], layers) == cuts


def test_descending_reads_go_to_their_mirror():
    layers, per_layer = 4, 3
    reads = [(layer, 0) for layer in reversed(range(layers)) for _ in range(per_layer)]
    jaxpr, end, starts = _program([3] * layers, reads)
    cuts = mirror_cuts(jaxpr, end, starts[1:], layers)
    # eqns[end] is the cos (it reads the last layer); the muls follow in groups of 3.
    assert cuts == [end + 1 + per_layer * s for s in range(1, layers)]


def test_an_odd_read_does_not_move_the_cuts():
    """A read of layer 0 in the middle of layer 3's backward is left out of the anchors."""
    reads = [(3, 0), (3, 0), (0, 0), (3, 0), (2, 0), (2, 0), (1, 0), (1, 0), (0, 0), (0, 0)]
    jaxpr, end, starts = _program([3] * 4, reads)
    assert mirror_cuts(jaxpr, end, starts[1:], 4) == [end + 5, end + 7, end + 9]


def test_stages_without_anchors_share_a_gap():
    """Layers 1 and 2 are never read: their backward stages get equations from the gap
    between the mirrors of layers 3 and 0 (a dynamic program over the gap)."""
    reads = [(3, 0), (3, 0), None, None, None, None, (0, 0), (0, 0)]
    jaxpr, end, starts = _program([3] * 4, reads)
    cuts = mirror_cuts(jaxpr, end, starts[1:], 4)
    _assert_contract(cuts, end, len(jaxpr.eqns), 4)
    # Layer 3's reads stay in the first backward stage, layer 0's in the last.
    assert cuts[0] >= end + 3
    assert cuts[-1] <= end + 7


def test_no_anchor_at_all():
    """A backward part that reads no forward value: every stage shares one gap."""
    jaxpr, end, starts = _program([2] * 4, ["input"] * 8)
    # Count the cos (the only reader of a forward value) as forward: layer 3's.
    cuts = mirror_cuts(jaxpr, end + 1, starts[1:], 4)
    _assert_contract(cuts, end + 1, len(jaxpr.eqns), 4)


@pytest.mark.parametrize("layers", [2, 3, 5])
def test_as_many_backward_equations_as_layers(layers):
    jaxpr, end, starts = _program([2] * layers, [None] * (layers - 1))
    cuts = mirror_cuts(jaxpr, end, starts[1:], layers)
    assert cuts == list(range(end + 1, end + layers))


def test_a_gap_too_short_for_its_stages_is_swept():
    """Layers 2 and 1 get no anchor and no gap (layer 3's reads are followed by layer
    0's at once): the final sweep gives them equations from the neighbouring runs."""
    reads = [(3, 0), (3, 0), (0, 0), (0, 0)]
    jaxpr, end, starts = _program([3] * 4, reads)
    cuts = mirror_cuts(jaxpr, end, starts[1:], 4)
    _assert_contract(cuts, end, len(jaxpr.eqns), 4)


def test_the_even_split_above_the_dense_limit(monkeypatch):
    reads = [(3, 0), *(["input"] * 9), (0, 0)]
    jaxpr, end, starts = _program([3] * 4, reads)
    dense = mirror_cuts(jaxpr, end, starts[1:], 4)
    monkeypatch.setattr(_backward, "_DENSE_LIMIT", 0)
    even = mirror_cuts(jaxpr, end, starts[1:], 4)
    _assert_contract(even, end, len(jaxpr.eqns), 4)
    # The gap between the runs of layers 3 (the cos and the first mul, 0..1) and 0 (the
    # last mul, 11) holds the 9 muls by `unused` (2..10): 10 places for 3 cuts.
    assert even == [end + 2, end + 5, end + 8]
    _assert_contract(dense, end, len(jaxpr.eqns), 4)


# ------------------------------------------------------------ the private helpers


def _place_cuts_cost(cuts, low, high, first_stage, gains, cut_bytes, layers):
    bounds = [low, *cuts, high]
    cost = sum(int(cut_bytes[x]) for x in cuts)
    for k in range(len(bounds) - 1):
        layer = layers - 1 - (first_stage + k)
        for e in range(bounds[k], bounds[k + 1]):
            if gains[e] is not None:
                cost -= gains[e].get(layer, 0)
    return cost


@st.composite
def _gaps(draw):
    layers = draw(st.integers(2, 5))
    first = draw(st.integers(0, layers - 2))
    last = draw(st.integers(first + 1, layers - 1))
    count = draw(st.integers(1, 10))
    low = draw(st.integers(0, count))
    high = draw(st.integers(low, count))
    first_nonempty, last_nonempty = draw(st.booleans()), draw(st.booleans())
    gain = st.one_of(
        st.none(), st.dictionaries(st.integers(0, layers - 1), st.integers(0, 20), min_size=1)
    )
    gains = draw(st.lists(gain, min_size=count, max_size=count))
    cut_bytes = np.array(draw(st.lists(st.integers(0, 30), min_size=count + 1, max_size=count + 1)))
    return layers, first, last, low, high, first_nonempty, last_nonempty, gains, cut_bytes


def _run_place_cuts(gap):
    layers, first, last, low, high, first_ne, last_ne, gains, cut_bytes = gap
    starts = [None] * (layers + 1)
    _place_cuts(starts, first, last, low, high, first_ne, last_ne, gains, cut_bytes, layers)
    assert starts[: first + 1] == [None] * (first + 1)
    assert starts[last + 1 :] == [None] * (layers - last)
    placed = starts[first + 1 : last + 1]
    lowest, highest, cuts = low + first_ne, high - last_ne, last - first
    if highest - lowest + 1 < cuts:
        # Too short: consecutive cuts from `lowest`, for the final sweep to fix.
        assert placed == list(range(lowest, lowest + cuts))
        return None
    assert all(lowest <= c <= highest for c in placed)
    assert all(a < b for a, b in itertools.pairwise(placed))
    return placed


@settings(max_examples=300, deadline=None)
@given(_gaps())
def test_place_cuts_is_optimal(gap):
    layers, first, last, low, high, first_ne, last_ne, gains, cut_bytes = gap
    placed = _run_place_cuts(gap)
    if placed is None:
        return
    best = min(
        _place_cuts_cost(list(c), low, high, first, gains, cut_bytes, layers)
        for c in itertools.combinations(range(low + first_ne, high - last_ne + 1), last - first)
    )
    assert _place_cuts_cost(placed, low, high, first, gains, cut_bytes, layers) == best


@settings(max_examples=50, deadline=None)
@given(_gaps())
def test_place_cuts_splits_evenly_above_the_dense_limit(gap):
    _, first, last, low, high, first_ne, last_ne, _, _ = gap
    original, _backward._DENSE_LIMIT = _backward._DENSE_LIMIT, 0
    try:
        placed = _run_place_cuts(gap)
    finally:
        _backward._DENSE_LIMIT = original
    if placed is None or high == low:
        return
    lowest, cuts = low + first_ne, last - first
    span = high - last_ne - lowest + 1
    assert placed == [lowest + (j - 1) * span // cuts for j in range(1, cuts + 1)]


def test_place_cuts_last_stage_gains_count():
    """Three stages share a gap of four equations, each reading its own mirror: the
    cuts fall between the readers (a wrong sign on the last stage's gains put the last
    cut at the end of the gap)."""
    layers = 3
    # Equations 0,1 read layer 2 (stage 0's mirror), 2 reads layer 1, 3 reads layer 0.
    gains = [{2: 10}, {2: 10}, {1: 10}, {0: 10}]
    starts = [0, None, None, 4]
    _place_cuts(starts, 0, 2, 0, 4, False, False, gains, np.zeros(5, np.int64), layers)
    assert starts == [0, 2, 3, 4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 9)), max_size=9))
def test_heaviest_descent_matches_brute_force(pairs):
    layers = [layer for layer, _ in pairs]
    weights = [weight for _, weight in pairs]
    chosen = _heaviest_descent(layers, weights)
    assert chosen == sorted(set(chosen))
    assert all(layers[a] >= layers[b] for a, b in itertools.pairwise(chosen))
    best = 0
    for size in range(len(pairs) + 1):
        for subset in itertools.combinations(range(len(pairs)), size):
            if all(layers[a] >= layers[b] for a, b in itertools.pairwise(subset)):
                best = max(best, sum(weights[i] for i in subset))
    assert sum(weights[i] for i in chosen) == best


# ------------------------------------------------ boundary-marked value_and_grad models


def _model(kind, layers):
    if kind == "mlp":
        return examples.mlp(num_layers=layers, width=4, batch=2, markers="boundary")
    if kind == "resnet":
        return examples.resnet(num_blocks=layers, width=4, batch=2, markers="boundary")
    return examples.transformer(
        num_layers=layers, d_model=8, num_heads=2, seq=4, markers="boundary"
    )


def _layer_starts(jaxpr, end):
    starts, fresh = [], True
    for index, eqn in enumerate(jaxpr.eqns[:end]):
        if eqn.primitive is pm.pipeline_p and eqn.params["mark_type"] == "boundary":
            fresh = True
        elif fresh:
            starts.append(index)
            fresh = False
    return starts


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["mlp", "resnet", "transformer"]), st.integers(1, 12))
def test_boundary_marked_gradient_programs(kind, layers):
    cj = _model(kind, layers).trace(grad=True)
    end = forward_end(cj.jaxpr)
    assert end is not None
    starts = _layer_starts(cj.jaxpr, end)
    assert len(starts) == layers
    cuts = mirror_cuts(cj.jaxpr, end, starts[1:], layers)
    _assert_contract(cuts, end, len(cj.eqns), layers)
    marked = pm.passes.layers_from_boundaries(cj)
    check_jaxpr(marked.jaxpr)
    names = [span.name for span in find_stage_spans(marked)]
    expected = [f"layer{i}" for i in range(layers)]
    if layers > 1:
        expected += [f"layer{i}_backward" for i in reversed(range(layers))]
    assert names == expected


def _stage_sources(marked):
    """For each stage: the stages whose values its start marker reads."""
    made_by, current, reads = {}, None, {}
    for eqn in marked.eqns:
        if eqn.primitive is pm.pipeline_p and eqn.params["mark_type"] == "start":
            current = eqn.params["name"]
            reads[current] = {made_by[v] for v in eqn.invars if isinstance(v, Var) and v in made_by}
        for v in eqn.outvars:
            made_by[v] = current
    return reads


@pytest.mark.parametrize(("kind", "layers"), [("mlp", 5), ("transformer", 3)])
def test_backward_stages_read_their_own_forward_layer(kind, layers):
    marked = pm.passes.layers_from_boundaries(_model(kind, layers).trace(grad=True))
    sources = _stage_sources(marked)
    last = layers - 1
    assert sources[f"layer{last}_backward"] == {f"layer{last}"}
    for i in range(last):
        assert sources[f"layer{i}_backward"] == {f"layer{i}", f"layer{i + 1}_backward"}


def test_crossing_bytes_of_the_backward_part():
    jaxpr, end, _ = _program([2, 2], [(1, 0), (0, 0)])
    cut_bytes = crossing_bytes(jaxpr, end)
    # cos -> mul -> mul: one f32[4] value crosses each inner cut, none the ends.
    assert cut_bytes.tolist() == [0, 16, 16, 0]
