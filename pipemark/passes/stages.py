"""Passes over staged programs: :func:`merge_stages`, :func:`merge_consecutive` (with
:func:`pair_stages`) and :func:`rename_stages`."""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Mapping, Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from pipemark.errors import PipemarkError, StageGraphError
from pipemark.marks import BACKWARD_SUFFIX, PAIRED_MARK_TYPES, WEIGHT_SUFFIX, backward_name
from pipemark.primitive import pipeline_p
from pipemark.roles import BACKWARD, FORWARD, MIXED, WEIGHT, StageRole
from pipemark.staged import Stage, StagedJaxpr, ValueRef, stage_debug_info, substitute_operands

__all__ = [
    "consecutive_layers",
    "merge_consecutive",
    "merge_stages",
    "pair_stages",
    "rename_stages",
]


def _stage_index(staged: StagedJaxpr, key: object, where: str) -> int:
    if isinstance(key, str):
        for k, stage in enumerate(staged.stages):
            if stage.name == key:
                return k
    elif isinstance(key, int) and not isinstance(key, bool) and 0 <= key < len(staged.stages):
        return key
    names = ", ".join(repr(s.name) for s in staged.stages)
    raise PipemarkError(f"{where}: no stage {key!r}; the stages are {names}.")


def _find_cycle(deps: list[set[int]], nodes: list[int]) -> list[int]:
    """A cycle among ``nodes`` (each with ``deps[n]`` its predecessors), as a list."""
    inside = set(nodes)
    color: dict[int, int] = {}
    parent: dict[int, int] = {}
    for root in nodes:
        if root in color:
            continue
        stack = [(root, iter(sorted(deps[root] & inside)))]
        color[root] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = 2
                stack.pop()
            elif color.get(child) == 1:
                cycle = [child, node]
                while node != child:
                    node = parent[node]
                    cycle.append(node)
                return cycle[-2::-1]
            elif child not in color:
                color[child] = 1
                parent[child] = node
                stack.append((child, iter(sorted(deps[child] & inside))))
    return []


def merge_stages(
    staged: StagedJaxpr,
    groups: Sequence[Sequence[str | int]] | Mapping[str, Sequence[str | int]],
) -> StagedJaxpr:
    """Merge groups of stages into single stages.

    Parameters
    ----------
    staged:
        A staged program.
    groups:
        Either a sequence of groups, each a sequence of stage names or indices (the
        merged stage is named by joining its members' names with ``+``), or a mapping
        from the merged stage's name to its group. Stages in no group stay as they are.

    The merged stage holds its members' equations in stage order (markers included, so
    :meth:`~pipemark.StagedJaxpr.as_closed_jaxpr` still gives the same program). Its
    inputs are the values its members read from outside the group; its outputs are the
    values other stages or the result read. Stages run in the original order, a merged
    stage at the place of its first member, unless a dependency needs another order.

    Raises
    ------
    PipemarkError
        For an unknown stage, or a stage in two groups.
    StageGraphError
        If the merge makes stages depend on each other in a cycle (merging stage 0 with
        stage 2 while stage 1 reads 0 and 2 reads 1); the message names the cycle.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.tan(jnp.cos(jnp.sin(x))))(1.0)
    >>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1, 2]))
    >>> merged = merge_stages(staged, [["stage0", "stage1"]])
    >>> [s.name for s in merged.stages], [s.num_eqns for s in merged.stages]
    (['stage0+stage1', 'stage2'], [6, 3])
    """
    if not isinstance(staged, StagedJaxpr):
        raise PipemarkError(f"merge_stages takes a StagedJaxpr, got {type(staged).__name__}.")
    node_members, node_names, node_of = _nodes(staged, groups)
    roles = _node_roles(staged, node_members, node_names, node_of)
    order = _merged_order(staged, node_of, node_names)
    old_stages = staged.stages
    produced: dict[tuple[int, int], tuple[int, int]] = {}  # (old stage, out) -> (new, out)
    read_outside: set[tuple[int, int]] = set()  # old outputs read by another node
    for k, stage in enumerate(old_stages):
        for ref in stage.inputs:
            if ref.kind == "stage" and node_of[ref.stage] != node_of[k]:
                read_outside.add((ref.stage, ref.index))
    for ref in staged.outputs:
        if ref.kind == "stage":
            read_outside.add((ref.stage, ref.index))
    new_stages: list[Stage] = []
    for node in order:
        members = node_members[node]
        if len(members) == 1:
            old = old_stages[members[0]]
            inputs = tuple(_remap(ref, produced) for ref in old.inputs)
            for i in range(len(old.closed_jaxpr.jaxpr.outvars)):
                produced[(members[0], i)] = (len(new_stages), i)
            # A group of one given a name in a mapping takes that name.
            new_stages.append(
                Stage(node_names[node], old.closed_jaxpr, inputs, old.eqn_indices, roles[node])
            )
        else:
            node_stage = (node_names[node], roles[node])
            merged = _merge_group(
                staged, members, node_stage, len(new_stages), produced, read_outside
            )
            new_stages.append(merged)
    outputs = [_remap(ref, produced) for ref in staged.outputs]
    return StagedJaxpr(
        new_stages, staged.invars, outputs, staged.debug_info, signature=staged.signature
    )


def _nodes(
    staged: StagedJaxpr, groups: Mapping[str, Sequence[int | str]] | Sequence[Sequence[int | str]]
) -> tuple[list[list[int]], list[str], list[int]]:
    """The stages of the merged program (each group, and each stage in no group, keyed
    by its first member): their members, their names, and each old stage's node."""
    if isinstance(groups, Mapping):
        named = [(name, list(members)) for name, members in groups.items()]
    else:
        named = [(None, list(members)) for members in groups]
    old_stages = staged.stages
    group_of: dict[int, int] = {}
    group_members: list[list[int]] = []
    group_names: list[str] = []
    for g, (name, members) in enumerate(named):
        if not members:
            raise PipemarkError(f"merge_stages: group {g} is empty.")
        indices = sorted({_stage_index(staged, m, "merge_stages") for m in members})
        for k in indices:
            if k in group_of:
                raise PipemarkError(
                    f"merge_stages: stage {old_stages[k].name!r} is in two groups; put each "
                    "stage in at most one group."
                )
            group_of[k] = g
        group_members.append(indices)
        if name is not None and not isinstance(name, str):
            raise PipemarkError(f"merge_stages: stage name {name!r} is not a str.")
        group_names.append(name or "+".join(old_stages[k].name for k in indices))
    node_of: list[int] = []
    node_members: list[list[int]] = []
    node_names: list[str] = []
    group_node: dict[int, int] = {}
    for k, stage in enumerate(old_stages):
        g = group_of.get(k)
        if g is None:
            node_of.append(len(node_members))
            node_members.append([k])
            node_names.append(stage.name)
        elif g in group_node:
            node_of.append(group_node[g])
        else:
            group_node[g] = len(node_members)
            node_of.append(group_node[g])
            node_members.append(group_members[g])
            node_names.append(group_names[g])
    duplicates = sorted(n for n, count in collections.Counter(node_names).items() if count > 1)
    if duplicates:
        raise PipemarkError(f"merge_stages: two stages would be named {duplicates[0]!r}.")
    return node_members, node_names, node_of


def _node_roles(
    staged: StagedJaxpr, node_members: list[list[int]], node_names: list[str], node_of: list[int]
) -> list[StageRole]:
    """The role of each merged stage: its members' kind when they share it, a backward
    or weight stage owned by the merged stage that holds its members' owners; a merge
    of kinds, or of the backward stages of forward stages merged apart, is ``mixed``."""
    old = staged.stages
    position = {stage.name: k for k, stage in enumerate(old)}
    roles = []
    for members in node_members:
        kinds = {old[k].role.kind for k in members}
        kind = kinds.pop() if len(kinds) == 1 else MIXED
        if kind not in (BACKWARD, WEIGHT):
            roles.append(StageRole(kind))
            continue
        # An owner that is no stage of this program (a hand-made one) keeps its name.
        owners = {
            node_names[node_of[position[o]]] if o in position else o
            for o in (old[k].role.owner for k in members)
        }
        roles.append(StageRole(kind, owners.pop()) if len(owners) == 1 else StageRole(MIXED))
    return roles


def _merged_order(staged: StagedJaxpr, node_of: list[int], node_names: list[str]) -> list[int]:
    """A topological order of the merged stages, earliest first member first (Kahn with
    a heap: deterministic); a :class:`StageGraphError` naming a cycle if merging makes
    one."""
    num_nodes = len(node_names)
    deps: list[set[int]] = [set() for _ in range(num_nodes)]
    for k, stage in enumerate(staged.stages):
        for ref in stage.inputs:
            if ref.kind == "stage" and node_of[ref.stage] != node_of[k]:
                deps[node_of[k]].add(node_of[ref.stage])
    waiting = [len(d) for d in deps]
    readers: list[list[int]] = [[] for _ in range(num_nodes)]
    for node, d in enumerate(deps):
        for p in d:
            readers[p].append(node)
    heap = [n for n in range(num_nodes) if waiting[n] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        node = heapq.heappop(heap)
        order.append(node)
        for reader in readers[node]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(heap, reader)
    if len(order) != num_nodes:
        stuck = [n for n in range(num_nodes) if waiting[n] > 0]
        cycle = _find_cycle(deps, stuck)
        path = " -> ".join(repr(node_names[n]) for n in [*cycle, cycle[0]]) if cycle else ""
        raise StageGraphError(
            f"merge_stages: the merged stages depend on each other in a cycle: {path}. "
            "Merge only stages with no other stage between them in the data flow."
        )
    return order


def _merge_group(
    staged: StagedJaxpr,
    members: list[int],
    node_stage: tuple[str, StageRole],
    position: int,
    produced: dict[tuple[int, int], tuple[int, int]],
    read_outside: set[tuple[int, int]],
) -> Stage:
    """One stage (``node_stage``: its name and role) running ``members`` in order: a
    value one member hands another stays inside; what another stage or the program
    reads is a result. Records in ``produced`` where each of those results now lives
    (new stage ``position``)."""
    name, role = node_stage
    old_stages = staged.stages
    invars: dict[Var, ValueRef] = {}
    outside_key: dict[tuple, Var] = {}  # one invar per outside value
    local: dict[tuple[int, int], object] = {}  # member output -> atom in merged body
    constvars: dict[Var, object] = {}
    eqns = []
    outvars: list[object] = []
    indices: list[int] = []
    for k in members:
        jaxpr = old_stages[k].closed_jaxpr.jaxpr
        sub: dict[Var, object] = {}
        for var, ref in zip(jaxpr.invars, old_stages[k].inputs):
            if ref.kind == "stage" and (ref.stage, ref.index) in local:
                atom = local[(ref.stage, ref.index)]
            else:
                new_ref = _remap(ref, produced)
                key = (new_ref.kind, new_ref.stage, new_ref.index)
                if key not in outside_key:
                    outside_key[key] = var
                    invars[var] = new_ref
                atom = outside_key[key]
            if atom is not var:
                sub[var] = atom
        for var, value in zip(jaxpr.constvars, old_stages[k].closed_jaxpr.consts):
            constvars.setdefault(var, value)
        eqns.extend(substitute_operands(jaxpr.eqns, sub))
        for i, v in enumerate(jaxpr.outvars):
            atom = sub.get(v, v) if isinstance(v, Var) else v
            local[(k, i)] = atom
            if (k, i) in read_outside:
                produced[(k, i)] = (position, len(outvars))
                outvars.append(atom)
        indices.extend(old_stages[k].eqn_indices)
    effects = set()
    for eqn in eqns:
        effects |= set(eqn.effects)
    info = stage_debug_info(name, list(invars.values()), len(outvars))
    merged = Jaxpr(list(constvars), list(invars), outvars, eqns, effects, info)
    closed = ClosedJaxpr(merged, list(constvars.values()))
    return Stage(name, closed, tuple(invars.values()), tuple(indices), role)


def _remap(ref: ValueRef, produced: dict[tuple[int, int], tuple[int, int]]) -> ValueRef:
    if ref.kind != "stage":
        return ref
    return ValueRef.stage_output(*produced[(ref.stage, ref.index)])


def rename_stages(staged: StagedJaxpr, mapping: Mapping[str, str]) -> StagedJaxpr:
    """Rename stages, and the start/end (and ``jvp_*``) markers that carry their names.

    ``mapping`` maps old stage names to new ones; stages not in it keep their names.
    Only the markers whose name is the stage's own name change, so renaming ``layer0``
    leaves ``layer0_backward``'s name alone unless it is in ``mapping`` too; its
    :attr:`~pipemark.staged.Stage.role` still names the renamed forward stage as its owner, so
    the two stay paired (:func:`pair_stages`).

    Raises :class:`PipemarkError` for an unknown stage name, a new name that is not a
    non-empty str, or two stages ending up with the same name.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)
    >>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
    >>> [s.name for s in rename_stages(staged, {"stage0": "embed"}).stages]
    ['embed', 'stage1']
    """
    if not isinstance(staged, StagedJaxpr):
        raise PipemarkError(f"rename_stages takes a StagedJaxpr, got {type(staged).__name__}.")
    if not isinstance(mapping, Mapping):
        raise PipemarkError(
            f"rename_stages: mapping must map old stage names to new ones, got {mapping!r}."
        )
    names = {stage.name for stage in staged.stages}
    for old, new in mapping.items():
        if old not in names:
            known = ", ".join(repr(s.name) for s in staged.stages)
            raise PipemarkError(f"rename_stages: no stage named {old!r}; the stages are {known}.")
        if not isinstance(new, str) or not new:
            raise PipemarkError(f"rename_stages: new name {new!r} is not a non-empty str.")
    final = [mapping.get(stage.name, stage.name) for stage in staged.stages]
    seen: set[str] = set()
    for name in final:
        if name in seen:
            raise PipemarkError(
                f"rename_stages: two stages would be named {name!r}; stage names are unique."
            )
        seen.add(name)
    stages = []
    for stage, name in zip(staged.stages, final):
        # A backward or weight stage keeps belonging to its forward stage, renamed.
        role = stage.role.renamed(dict(mapping))
        if name == stage.name:
            same = role == stage.role
            stages.append(
                stage
                if same
                else Stage(name, stage.closed_jaxpr, stage.inputs, stage.eqn_indices, role)
            )
            continue
        jaxpr = stage.closed_jaxpr.jaxpr
        eqns = [
            eqn.replace(params={**eqn.params, "name": name})
            if eqn.primitive is pipeline_p
            and eqn.params.get("mark_type") in PAIRED_MARK_TYPES
            and eqn.params.get("name") == stage.name
            else eqn
            for eqn in jaxpr.eqns
        ]
        new_jaxpr = jaxpr.replace(
            eqns=eqns, debug_info=stage_debug_info(name, stage.inputs, len(jaxpr.outvars))
        )
        closed = ClosedJaxpr(new_jaxpr, stage.closed_jaxpr.consts)
        stages.append(Stage(name, closed, stage.inputs, stage.eqn_indices, role))
    return StagedJaxpr(
        stages, staged.invars, staged.outputs, staged.debug_info, signature=staged.signature
    )


def pair_stages(
    staged: StagedJaxpr,
) -> tuple[list[int], list[int | None], list[int | None]]:
    """Indices in ``staged.stages`` of each forward stage, of its mirrored backward stage
    and of its weight-gradient stage (:func:`pipemark.passes.split_backward`), ``None``
    where it has none, by the stages' :attr:`~pipemark.staged.Stage.role`. A training step's
    update (``apply_grad``) is no forward stage.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> staged = pm.split(jax.grad(lambda x: jnp.cos(jnp.sin(x))), 1.0, num_stages=2)
    >>> pair_stages(staged)
    ([0, 1], [3, 2], [None, None])

    Raises
    ------
    StageGraphError
        When a backward or weight stage's forward stage is missing (a forward stage
        named with a ``_backward`` suffix is sliced as a backward stage), when a forward
        stage has two, or for a stage of ``mixed`` role.
    """
    stages = staged.stages
    forward = [k for k, stage in enumerate(stages) if stage.role.kind == FORWARD]
    slot_of = {stages[k].name: i for i, k in enumerate(forward)}
    backward: list[int | None] = [None] * len(forward)
    weight: list[int | None] = [None] * len(forward)
    for k, stage in enumerate(stages):
        role = stage.role
        if role.kind == MIXED:
            raise StageGraphError(
                f"Stage {stage.name!r} merges stages of different roles (forward, backward, "
                "weight, update), or the backward stages of forward stages merged apart; a "
                "pipeline runs each backward stage where its forward stage runs. Merge "
                "backward stages as their forward stages are merged "
                "(pm.passes.merge_consecutive does)."
            )
        if role.kind not in (BACKWARD, WEIGHT):
            continue
        slot = slot_of.get(role.owner)
        if slot is None:
            raise StageGraphError(
                f"Stage {stage.name!r} has no forward stage named {role.owner!r} to pair "
                "with; a backward stage runs where its forward stage runs. Do not name a "
                f"forward stage with a {BACKWARD_SUFFIX!r} or {WEIGHT_SUFFIX!r} suffix."
            )
        found = backward if role.kind == BACKWARD else weight
        if found[slot] is not None:
            raise StageGraphError(
                f"Stages {stages[found[slot]].name!r} and {stage.name!r} are both the "
                f"{role.kind} stage of {role.owner!r}; merge them into one."
            )
        found[slot] = k
    return forward, backward, weight


def consecutive_layers(staged: StagedJaxpr, num_stages: int) -> tuple[int, ...]:
    """How many consecutive forward stages (marked layers, each with its mirrored
    backward stage) :func:`merge_consecutive` puts in each of ``num_stages`` stages by
    default: about equal equation counts, at least one each.

    >>> import jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     for _ in range(5):
    ...         pm.mark_pipeline_boundary()
    ...         x = jnp.sin(x)
    ...     return x
    >>> consecutive_layers(pm.split(f, 1.0), 2)
    (3, 2)
    """
    forward, backward, _ = pair_stages(staged)
    _check_layer_count(num_stages, len(forward))
    weights = [
        staged.stages[f].num_eqns + (staged.stages[b].num_eqns if b is not None else 0)
        for f, b in zip(forward, backward)
    ]
    prefix = np.cumsum([0, *weights])
    cuts = [0]
    for g in range(1, num_stages):
        # The first cut after the g-th share of the work, leaving a layer per group.
        cut = int(np.searchsorted(prefix, prefix[-1] * g / num_stages))
        cuts.append(min(max(cut, cuts[-1] + 1), len(forward) - (num_stages - g)))
    cuts.append(len(forward))
    return tuple(int(b - a) for a, b in itertools.pairwise(cuts))


def _check_layer_count(num_stages: int, count: int) -> None:
    if not 1 <= num_stages <= count:
        raise PipemarkError(
            f"num_stages={num_stages}, but the program marks only {count} stages. Mark "
            f"more layers, or pass 1 <= num_stages <= {count}."
        )


def merge_consecutive(
    staged: StagedJaxpr, num_stages: int, layers: Sequence[int] | None = None
) -> StagedJaxpr:
    """Merge consecutive forward stages (each with its mirrored backward stage) into
    ``num_stages`` stages ``stage0``, ``stage1``, ... (and ``stage0_backward``, ...):
    ``layers[g]`` of them in stage ``g``, or by default of about equal equation counts
    (:func:`consecutive_layers`). A program with ``num_stages`` forward stages is
    returned as it is; an ``apply_grad`` stage stays as it is.

    This is what :func:`pipemark.split`, the ``pipemark inspect`` command and the
    pipeline runtime do with a marked program and ``num_stages`` (the runtime's
    ``stage_layers=`` gives ``layers``).

    >>> import jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     for _ in range(3):
    ...         pm.mark_pipeline_boundary()
    ...         x = jnp.sin(x)
    ...     return x
    >>> [s.name for s in merge_consecutive(pm.split(f, 1.0), 2).stages]
    ['stage0', 'stage1']
    >>> merged = merge_consecutive(pm.split(f, 1.0), 2, layers=(1, 2))
    >>> [s.num_eqns for s in merged.stages]  # a sin between two markers per layer
    [3, 6]

    Raises
    ------
    PipemarkError
        When the program has fewer forward stages than ``num_stages``, or ``layers``
        does not give each of the ``num_stages`` stages at least one of them, all of
        them in all.
    """
    forward, backward, _ = pair_stages(staged)
    if layers is None:
        layers = consecutive_layers(staged, num_stages)
    _check_layers(layers, num_stages, len(forward))
    if num_stages == len(forward):
        return staged
    cuts = np.cumsum([0, *layers])
    groups: dict[str, list[int]] = {}
    for g in range(num_stages):
        members = range(int(cuts[g]), int(cuts[g + 1]))
        groups[f"stage{g}"] = [forward[i] for i in members]
        back = [backward[i] for i in members if backward[i] is not None]
        if back:
            groups[backward_name(f"stage{g}")] = back
    return merge_stages(staged, groups)


def _check_layers(layers: Sequence[int], num_stages: int, count: int) -> None:
    _check_layer_count(num_stages, count)
    given = tuple(layers)
    if (
        len(given) != num_stages
        or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in given)
        or sum(given) != count
    ):
        raise PipemarkError(
            f"stage_layers={given!r} does not share the program's {count} marked layers "
            f"among {num_stages} stages: give {num_stages} positive ints that add up to "
            f"{count}, each stage's count of consecutive layers."
        )
