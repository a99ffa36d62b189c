"""Tests for pipemark.graph: equation graphs, stage graphs, order and critical paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import networkx as nx
import pytest
from jax.extend.core import Var

import pipemark as pm
from pipemark import examples
from pipemark.cost import Cost, estimate_cost
from pipemark.graph import critical_path, eqn_graph, stage_graph, topological_order


def _kinds(graph):
    kinds: dict[str, int] = {}
    for _, data in graph.nodes(data=True):
        kinds[data["kind"]] = kinds.get(data["kind"], 0) + 1
    return kinds


def test_eqn_graph_has_a_node_per_equation_input_and_output():
    cj = examples.transformer(num_layers=2, markers=None).trace(grad=True)
    graph = eqn_graph(cj)
    assert _kinds(graph) == {
        "input": len(cj.jaxpr.invars),
        "eqn": len(cj.eqns),
        "output": len(cj.jaxpr.outvars),
        **({"const": len(cj.jaxpr.constvars)} if cj.jaxpr.constvars else {}),
    }
    for i, eqn in enumerate(cj.eqns):
        data = graph.nodes["eqn", i]
        assert data["primitive"] == eqn.primitive.name and data["eqn"] is eqn
        assert isinstance(data["cost"], Cost)
    assert nx.is_directed_acyclic_graph(graph)


def test_edge_bytes_equal_the_avals_byte_sizes():
    cj = examples.resnet(num_blocks=4, markers=None).trace(grad=True)
    graph = eqn_graph(cj)
    uses = 0
    for source, target, data in graph.edges(data=True):
        sizes = pm.flatten_shape_byte_sizes(list(data["avals"]))
        assert data["bytes"] == int(sizes.sum())
        assert data["num_values"] == len(data["avals"]) == len(data["types"])
        assert len(data["results"]) == len(set(data["results"])) == data["num_values"]
        # Every value on the edge is a result of the source that the target reads.
        for k, aval, text in zip(data["results"], data["avals"], data["types"]):
            if source[0] == "eqn":
                var = cj.eqns[source[1]].outvars[k]
                assert var.aval == aval and text == aval.str_short(short_dtypes=True)
                if target[0] == "eqn":
                    assert var in cj.eqns[target[1]].invars
        # What an edge holds prints without jaxpr variables (no "Var(id=...)").
        assert "Var" not in repr(data) and "id=" not in repr(data)
        uses += data["num_values"]
    # One (producer, consumer, variable) triple per distinct Var operand and per output.
    expected = sum(len({v for v in e.invars if isinstance(v, Var)}) for e in cj.eqns)
    expected += sum(isinstance(v, Var) for v in cj.jaxpr.outvars)
    assert uses == expected


def test_literals_make_no_edges_and_dropped_costs_are_absent():
    cj = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3))
    graph = eqn_graph(cj, with_cost=False)
    assert list(graph.predecessors(("eqn", 0))) == [("input", 0)]
    assert "cost" not in graph.nodes["eqn", 0]


def test_constants_become_const_nodes():
    table = jnp.arange(4.0)
    cj = jax.make_jaxpr(lambda i: table[i])(1)
    graph = eqn_graph(cj)
    consts = [n for n, d in graph.nodes(data=True) if d["kind"] == "const"]
    assert len(consts) == len(cj.jaxpr.constvars) >= 1
    assert all(graph.out_degree(n) >= 1 for n in consts)


def test_eqn_graph_rejects_other_types():
    with pytest.raises(pm.PipemarkError, match=r"eqn_graph takes a ClosedJaxpr.*make_jaxpr"):
        eqn_graph(lambda x: x)


def _var(n):
    return Var(jax.typeof(jnp.zeros(n, jnp.float32)))


def test_stage_graph_keeps_skip_connections_as_their_own_edges():
    x, y, z = _var(4), _var(8), _var(2)
    crossings = [("s0", "s1", x), ("s1", "s2", y), ("s0", "s2", z), ("s0", "s1", x)]
    graph = stage_graph(["s0", "s1", "s2"], crossings, costs=[Cost(flops=i) for i in range(3)])
    assert set(graph.edges) == {("s0", "s1"), ("s1", "s2"), ("s0", "s2")}
    assert graph.edges["s0", "s1"]["bytes"] == 16  # the same value twice crosses once
    assert graph.edges["s0", "s2"]["bytes"] == 8 and graph.edges["s0", "s2"]["skip"]
    assert not graph.edges["s1", "s2"]["skip"]
    assert graph.nodes["s2"]["cost"].flops == 2 and graph.nodes["s1"]["index"] == 1


def test_stage_graph_from_a_resnet_split_has_skip_edges():
    ex = examples.resnet(num_blocks=6, skip=3, markers=None)
    cj = pm.passes.auto_layers(ex.trace(), 6, cost="equations")
    staged = pm.passes.slice_stages(cj)
    crossings = []
    for stage in staged.stages:
        for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars):
            if ref.kind == "stage":
                crossings.append((staged.stages[ref.stage].name, stage.name, var))
    graph = stage_graph([s.name for s in staged.stages], crossings)
    assert any(data["skip"] for *_, data in graph.edges(data=True))
    assert topological_order(graph) == [s.name for s in staged.stages]


def test_cycle_raises_stage_graph_error_naming_the_stages():
    x = _var(1)
    with pytest.raises(pm.errors.StageGraphError, match=r"cycle: (b -> c -> b|c -> b -> c)"):
        stage_graph(["a", "b", "c"], [("a", "b", x), ("b", "c", x), ("c", "b", x)])


def test_duplicate_stage_names_raise():
    with pytest.raises(pm.errors.StageGraphError, match="'a' appear more than once"):
        stage_graph(["a", "b", "a"], [])


def test_topological_order_respects_edges_and_raises_on_cycles():
    cj = examples.mlp(num_layers=3, markers=None).trace(grad=True)
    graph = eqn_graph(cj)
    position = {n: i for i, n in enumerate(topological_order(graph))}
    assert all(position[a] < position[b] for a, b in graph.edges)
    cyclic = nx.DiGraph([("x", "y"), ("y", "x")])
    with pytest.raises(pm.errors.StageGraphError, match="cycle"):
        topological_order(cyclic)


def test_critical_path_of_a_diamond():
    graph = nx.DiGraph()
    for node, flops in {"a": 1, "b": 5, "c": 2, "d": 1}.items():
        graph.add_node(node, cost=Cost(flops=flops))
    graph.add_edges_from([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    graph.edges["a", "c"]["bytes"] = 10
    assert critical_path(graph, "flops") == (["a", "b", "d"], 7)
    assert critical_path(graph, "flops", edge_weight="bytes") == (["a", "c", "d"], 14)
    assert critical_path(graph, lambda node, data: 1) == (["a", "b", "d"], 3)
    assert critical_path(nx.DiGraph()) == ([], 0)


def test_critical_path_of_a_sequential_model_covers_every_matmul():
    cj = examples.mlp(num_layers=4, markers=None).trace()
    graph = eqn_graph(cj)
    path, flops = critical_path(graph, "flops")
    dots = [n for n in path if graph.nodes[n].get("primitive") == "dot_general"]
    assert len(dots) == 4
    assert flops <= estimate_cost(cj).flops
