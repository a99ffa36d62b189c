"""Programs and staged programs as networkx graphs.

Two views:

* :func:`eqn_graph` — one node per equation of a closed jaxpr, plus a node per program
  input, constant and output; one edge per producer→consumer pair, carrying the
  variables that flow along it and their bytes.
* :func:`stage_graph` — one node per stage, one edge per pair of stages that a value
  crosses, weighted by the bytes that cross. A value that jumps over stages (a skip
  connection) gets its own edge from the stage that makes it to the stage that reads
  it. :class:`pipemark.staged.StagedJaxpr` builds its ``.graph`` with it.

:func:`topological_order` and :func:`critical_path` work on either. networkx stays
inside pipemark: a cycle is reported as :class:`~pipemark.errors.StageGraphError`.

>>> import jax, jax.numpy as jnp
>>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(jnp.ones(3))
>>> g = eqn_graph(cj)
>>> [g.nodes[n]["primitive"] for n in topological_order(g) if n[0] == "eqn"]
['sin', 'mul']
>>> g.edges[("eqn", 0), ("eqn", 1)]["bytes"]
12
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import networkx as nx
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from pipemark._text import type_text
from pipemark.cost import Cost, eqn_costs, nbytes
from pipemark.errors import PipemarkError, StageGraphError

__all__ = ["critical_path", "eqn_graph", "stage_graph", "topological_order"]

Node = Hashable


class _Edges:
    """Adds one use of a value to the edge from its producer to its reader: the edge's
    ``types`` and ``avals`` (a value read twice by one reader crosses once), with
    ``num_values`` and ``bytes``. The variables themselves stay here, out of the edge
    data, so that what a user reads off an edge prints without ``Var`` ids."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self.seen: dict[tuple[Node, Node], set[Var]] = {}

    def add(self, source: Node, target: Node, var: Var, **extra: Any) -> dict | None:
        """Record the use; the edge's data, or ``None`` when the value was there."""
        seen = self.seen.setdefault((source, target), set())
        if var in seen:
            return None
        seen.add(var)
        aval = var.aval
        data = self.graph.get_edge_data(source, target)
        if data is None:
            self.graph.add_edge(
                source, target, types=(), avals=(), bytes=0, num_values=0, **{k: () for k in extra}
            )
            data = self.graph.edges[source, target]
        data["types"] += (type_text(aval),)
        data["avals"] += (aval,)
        data["bytes"] += nbytes(aval)
        data["num_values"] += 1
        for key, value in extra.items():
            data[key] += (value,)
        return data


def eqn_graph(program: ClosedJaxpr | Jaxpr, *, with_cost: bool = True) -> nx.DiGraph:
    """The data-flow graph of a program's top-level equations.

    Nodes are tuples:

    ``("input", i)``, ``("const", i)``
        The ``i``-th argument / constant; attributes ``kind``, ``variable``, ``bytes``.
    ``("eqn", i)``
        The ``i``-th equation; attributes ``kind``, ``index``, ``primitive`` (its
        name), ``eqn`` and, with ``with_cost``, ``cost`` (a :class:`~pipemark.cost.Cost`).
    ``("output", i)``
        The ``i``-th result; attributes ``kind``, ``variable``, ``bytes``.

    Each edge joins the producer of a value to a consumer and carries, for the distinct
    values that flow along it in order of use: ``results`` (which result of the
    producer each is: the index into its equation's ``outvars``; 0 for an input or
    constant), ``types`` (``"f32[2,4]"``) and ``avals``; then ``num_values`` (how
    many) and ``bytes`` (the sum of their sizes). Literals are constants folded into
    their equation: they have no edge.
    Equations inside ``jit``, ``scan`` … bodies are not expanded: each is one node.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x: x + x)(jnp.ones((2, 4)))
    >>> g = eqn_graph(cj)
    >>> sorted(g.edges)
    [(('eqn', 0), ('output', 0)), (('input', 0), ('eqn', 0))]
    >>> g.edges[("input", 0), ("eqn", 0)]["bytes"]  # x is read twice, sent once
    32
    >>> g.edges[("eqn", 0), ("output", 0)]
    {'types': ('f32[2,4]',), 'avals': (ShapedArray(float32[2,4]),), 'bytes': 32, 'num_values': 1, 'results': (0,)}
    """
    if isinstance(program, ClosedJaxpr):
        jaxpr = program.jaxpr
    elif isinstance(program, Jaxpr):
        jaxpr = program
    else:
        raise PipemarkError(
            f"eqn_graph takes a ClosedJaxpr or a Jaxpr, got {type(program).__name__}. "
            "Trace a function first: jax.make_jaxpr(fn)(*args)."
        )
    graph = nx.DiGraph()
    edges = _Edges(graph)
    producer: dict[Var, tuple[Node, int]] = {}  # value -> (its node, which result)
    for kind, variables in (("const", jaxpr.constvars), ("input", jaxpr.invars)):
        for i, var in enumerate(variables):
            node = (kind, i)
            graph.add_node(node, kind=kind, variable=var, bytes=nbytes(var.aval))
            producer[var] = (node, 0)
    costs: list[Cost | None] = list(eqn_costs(jaxpr)) if with_cost else [None] * len(jaxpr.eqns)
    for i, eqn in enumerate(jaxpr.eqns):
        node = ("eqn", i)
        attrs: dict[str, Any] = {"kind": "eqn", "index": i, "primitive": eqn.primitive.name}
        attrs["eqn"] = eqn
        if with_cost:
            attrs["cost"] = costs[i]
        graph.add_node(node, **attrs)
        for var in eqn.invars:
            source = producer.get(var) if isinstance(var, Var) else None
            if source is not None:
                edges.add(source[0], node, var, results=source[1])
        for k, var in enumerate(eqn.outvars):
            producer[var] = (node, k)
    for i, var in enumerate(jaxpr.outvars):
        node = ("output", i)
        graph.add_node(node, kind="output", variable=var, bytes=nbytes(var.aval))
        source = producer.get(var) if isinstance(var, Var) else None
        if source is not None:
            edges.add(source[0], node, var, results=source[1])
    return graph


def stage_graph(
    stage_names: Sequence[str],
    crossings: Iterable[tuple[Node, Node, Var] | tuple[Node, Node, Var, Any]],
    *,
    costs: Sequence[Cost] | None = None,
) -> nx.DiGraph:
    """The graph of stages and the values that cross between them.

    Parameters
    ----------
    stage_names:
        The stages, in program order; they become the nodes (attributes ``index`` and,
        when ``costs`` is given, ``cost``).
    crossings:
        ``(producer, consumer, variable)`` triples: ``variable`` is made by stage
        ``producer`` and read by stage ``consumer``. Endpoints that are not stage names
        (e.g. ``"input"`` or ``"output"``) become extra nodes. A fourth item, if
        given, names the value (e.g. a :class:`~pipemark.staged.ValueRef`): the
        edges then carry those names as ``refs``.
    costs:
        A :class:`~pipemark.cost.Cost` per stage, stored as the node attribute ``cost``.

    Returns
    -------
    networkx.DiGraph
        Each edge carries ``types`` and ``avals`` of the distinct values crossing it
        (in order of use), ``num_values``, ``bytes`` and ``skip``: True when the value
        jumps over at least one stage in between (a skip connection, kept as its own
        edge rather than routed through the stages it passes).

    Raises
    ------
    StageGraphError
        When the stages depend on each other in a cycle; the message names them.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> from jax.extend.core import Var
    >>> x = Var(jax.typeof(jnp.zeros(4, jnp.float32)))
    >>> g = stage_graph(["a", "b", "c"], [("a", "b", x), ("a", "c", x)])
    >>> g.edges["a", "c"]["bytes"], g.edges["a", "c"]["skip"]
    (16, True)
    """
    names = list(stage_names)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        dupes = [n for n in names if n in seen or seen.add(n)]
        raise StageGraphError(
            f"Stage names must be unique, but {', '.join(map(repr, dupes))} appear more "
            "than once. Give each start/end marker pair its own name."
        )
    if costs is not None and len(costs) != len(names):
        raise PipemarkError(f"Got {len(costs)} costs for {len(names)} stages; give one each.")
    position = {name: i for i, name in enumerate(names)}
    graph = nx.DiGraph()
    for i, name in enumerate(names):
        graph.add_node(name, kind="stage", index=i)
        if costs is not None:
            graph.nodes[name]["cost"] = costs[i]
    edges = _Edges(graph)
    for source, target, var, *ref in crossings:
        for node in (source, target):
            if node not in graph:
                graph.add_node(node, kind=str(node))
        edges.add(source, target, var, **({"refs": ref[0]} if ref else {}))
        edge = graph.edges[source, target]
        if source in position and target in position:
            edge["skip"] = abs(position[target] - position[source]) > 1
        else:
            edge["skip"] = False
    _check_acyclic(graph)
    return graph


def _check_acyclic(graph: nx.DiGraph) -> None:
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    nodes = [edge[0] for edge in cycle] + [cycle[0][0]]
    raise StageGraphError(
        "The stages depend on each other in a cycle: "
        + " -> ".join(_node_label(n) for n in nodes)
        + ". A stage may only read values made by earlier stages: move the equations "
        "that create the cycle into one stage, or reorder the markers."
    )


def _node_label(node: Node) -> str:
    if isinstance(node, tuple) and len(node) == 2:
        return f"{node[0]} {node[1]}"
    return str(node)


def topological_order(graph: nx.DiGraph) -> list[Node]:
    """The nodes of ``graph`` so that every edge goes forward; ties keep insertion
    order, so the result is deterministic.

    Raises :class:`~pipemark.errors.StageGraphError` naming a cycle when there is one.

    >>> g = stage_graph(["a", "b"], [])
    >>> topological_order(g)
    ['a', 'b']
    """
    _check_acyclic(graph)
    order = {node: i for i, node in enumerate(graph)}
    return list(nx.lexicographical_topological_sort(graph, key=order.__getitem__))


def _node_weight(weight: str | Callable[[Node, dict], float]) -> Callable[[Node, dict], float]:
    if callable(weight):
        return weight

    def from_attribute(node: Node, data: dict) -> float:
        if weight in data:
            return data[weight]
        cost = data.get("cost")
        if cost is not None and hasattr(cost, weight):
            return getattr(cost, weight)
        return 0

    return from_attribute


def critical_path(
    graph: nx.DiGraph,
    weight: str | Callable[[Node, dict], float] = "total_flops",
    *,
    edge_weight: str | None = None,
) -> tuple[list[Node], float]:
    """The heaviest path through a DAG, by node weight (plus edge weight if asked).

    Parameters
    ----------
    weight:
        A node attribute, a field of the node's ``cost`` (``"flops"``,
        ``"total_flops"``, ``"bytes_accessed"`` …), or ``f(node, attrs) -> number``.
        Nodes without it weigh 0.
    edge_weight:
        An edge attribute (e.g. ``"bytes"``) added along the path, or None.

    Returns
    -------
    (path, length)
        The nodes on the path in order, and its total weight. With a time per node
        (and per byte) this is the shortest possible running time with unlimited
        parallelism.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     return jnp.sin(x) + (x @ x) @ x
    >>> g = eqn_graph(jax.make_jaxpr(f)(jnp.ones((4, 4))))
    >>> path, flops = critical_path(g, "flops")
    >>> [g.nodes[n].get("primitive") for n in path], flops
    ([None, 'dot_general', 'dot_general', 'add', None], 272)
    """
    node_weight = _node_weight(weight)
    best: dict[Node, float] = {}
    previous: dict[Node, Node | None] = {}
    for node in topological_order(graph):
        own = node_weight(node, graph.nodes[node])
        best_in, best_pred = 0, None
        for pred in graph.predecessors(node):
            length = best[pred]
            if edge_weight is not None:
                length += graph.edges[pred, node].get(edge_weight, 0)
            if best_pred is None or length > best_in:
                best_in, best_pred = length, pred
        best[node] = best_in + own
        previous[node] = best_pred
    if not best:
        return [], 0
    # Among equally heavy ends take the last in order, so a path runs on to the sink.
    end = max(reversed(best), key=best.__getitem__)
    path = [end]
    while previous[path[-1]] is not None:
        path.append(previous[path[-1]])
    return path[::-1], best[end]
