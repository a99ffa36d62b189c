"""Compile each stage program of a pipeline once for its slot: :func:`compile_units`.

A :class:`Unit` runs one stage for one microbatch: ``run(accumulators, inputs, scale)``
returns the accumulators with this microbatch's share added (the loss, the gradients,
scaled by ``scale``: ``1/M`` for a mean, 1 for a sum, an argument so that one program
serves every number of microbatches) and the outputs other stages read. The
accumulators stay on the slot.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> from pipemark.runtime.placement import place_stages
>>> staged = pm.split(jax.value_and_grad(lambda w: jnp.sum(jnp.cos(jnp.sin(w)))), 1.0,
...                   num_stages=2)
>>> [stage.name for stage in staged.stages]
['layer0', 'layer1', 'layer1_backward', 'layer0_backward']
>>> placement = place_stages(jax.devices()[:2], (0, 1))
>>> units = compile_units(staged, {0: 0, 3: 0, 1: 1, 2: 1}, placement)
>>> units[0].passed, units[3].accumulated
((0, 1), ((1, 0),))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from pipemark.caches import register_cache
from pipemark.lowering import get_lowering
from pipemark.passes.rewrite import remove_markers
from pipemark.runtime.losses import microbatch_share
from pipemark.runtime.placement import Placement, Slot
from pipemark.runtime.sharding import compile_stage
from pipemark.staged import StagedJaxpr

__all__ = [
    "Unit",
    "compile_fused",
    "compile_units",
    "keeps_markers",
    "result_shardings",
    "runtime_program",
    "stage_readers",
]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One compiled stage program on its slot.

    Attributes
    ----------
    index:
        The stage's index in the staged program.
    worker:
        The placement's worker (slot) that runs it.
    run:
        ``run(accumulators, inputs, scale) -> (accumulators, passed outputs)``.
    zeros:
        Makes the accumulators' zeros on the slot (``None``: nothing accumulates).
    accumulated:
        ``(program result index, stage output index)`` of each accumulated output.
    passed:
        The stage outputs other stages read.
    finish:
        On a sub-mesh with data-parallel replicas, the one cross-replica reduction of
        the accumulators at the end of a call; else ``None``.
    donates:
        Whether ``run`` consumes the accumulators it is given.
    program:
        On a sub-mesh, the compiled stage and its shardings; else ``None``.
    """

    index: int
    worker: int
    run: Callable[[list[Any], list[Any], Any], tuple[list[Any], list[Any]]]
    zeros: Callable[[], list[Any]] | None
    accumulated: tuple[tuple[int, int], ...]
    passed: tuple[int, ...]
    #: On a sub-mesh with data-parallel replicas: sums the accumulators' replica axis,
    #: once per call (``None``: the accumulators are the results).
    finish: Callable[[list[Any]], list[Any]] | None = None
    #: Whether ``run`` donates (consumes) the accumulators it is given: each call then
    #: starts from zeros of its own.
    donates: bool = False
    #: On a sub-mesh, the compiled stage with its shardings
    #: (:class:`pipemark.runtime.sharding.CompiledStage`).
    program: Any = None
    #: Whether ``run`` ignores the accumulators it is given and returns this
    #: microbatch's shares alone: with one microbatch there is nothing to add to, so
    #: the program is ``jax.jit``'s step with no accumulators in memory.
    starts: bool = False


def result_shardings(unit: Unit, slot: Slot) -> tuple[Any, ...]:
    """Where each of ``unit``'s accumulated results lies at the end of a call, on its
    slot ``slot``: the slot's device, or on a sub-mesh the result's own layout (its
    replicas reduced)."""
    if unit.program is None:
        return (slot.sharding,) * len(unit.accumulated)
    return tuple(unit.program.accumulated_shardings)


def stage_readers(staged: StagedJaxpr) -> dict[tuple[int, int], int]:
    """How many stages read each ``(stage, output)``."""
    readers: dict[tuple[int, int], int] = {}
    for stage in staged.stages:
        for ref in stage.inputs:
            if ref.kind == "stage":
                readers[(ref.stage, ref.index)] = readers.get((ref.stage, ref.index), 0) + 1
    return readers


def compile_units(
    staged: StagedJaxpr,
    workers: Mapping[int, int],
    placement: Placement,
    *,
    num_params: int = 0,
    param_specs: Sequence[Any] | None = None,
    result_specs: Sequence[Any] | None = None,
    data_axis: str = "data",
    num_microbatches: int = 2,
) -> dict[int, Unit]:
    """A :class:`Unit` for each stage ``index`` of ``workers`` (stage index -> worker),
    compiled for that worker's slot (programs seen before come from a cache). On
    sub-meshes, the first ``num_params`` inputs of ``staged`` are parameters laid out by
    ``param_specs`` (one ``PartitionSpec`` each), and each result ``r`` of ``staged``
    is reduced into ``result_specs[r]`` (replicated where ``None``). With
    ``num_microbatches`` 1, single-device units keep no accumulators
    (:attr:`Unit.starts`)."""
    readers = stage_readers(staged)
    if not placement.meshes:
        starts = num_microbatches == 1
        return {
            index: _compile_unit(staged, index, w, placement.slots[w], readers, starts)
            for index, w in workers.items()
        }
    specs = _MeshSpecs(num_params, param_specs or (), result_specs, data_axis)
    return {
        index: _mesh_unit(staged, index, w, placement.slots[w], readers, specs)
        for index, w in workers.items()
    }


class _MeshSpecs(NamedTuple):
    num_params: int
    param_specs: Sequence[Any]
    result_specs: Sequence[Any] | None
    data_axis: str


def _outputs(
    staged: StagedJaxpr, index: int, readers: dict[tuple[int, int], int]
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """A stage's accumulated ``(result, output)`` pairs and its passed outputs."""
    accumulated = tuple(
        (r, ref.index)
        for r, ref in enumerate(staged.outputs)
        if ref.kind == "stage" and ref.stage == index
    )
    outs = len(staged.stages[index].out_avals)
    return accumulated, tuple(o for o in range(outs) if readers.get((index, o), 0))


def _mesh_unit(
    staged: StagedJaxpr,
    index: int,
    worker: int,
    slot: Slot,
    readers: dict[tuple[int, int], int],
    specs: _MeshSpecs,
) -> Unit:
    """A stage compiled over its slot's sub-mesh (:func:`pipemark.runtime.sharding.compile_stage`:
    the model's shardings retargeted, data-parallel replicas, delayed reduction)."""
    stage = staged.stages[index]
    accumulated, passed = _outputs(staged, index, readers)
    param_specs = {
        i: specs.param_specs[ref.index]
        for i, ref in enumerate(stage.inputs)
        if ref.kind == "input" and ref.index < specs.num_params
    }
    sums = specs.result_specs
    compiled = compile_stage(
        runtime_program(stage.closed_jaxpr),
        slot.mesh,
        param_specs=param_specs,
        accumulated=[o for _, o in accumulated],
        passed=list(passed),
        accumulated_specs=None if sums is None else [sums[r] or P() for r, _ in accumulated],
        data_axis=specs.data_axis,
    )
    finish = compiled.reduce if compiled.replicas > 1 and accumulated else None
    return Unit(
        index, worker, compiled.run, compiled.zeros, accumulated, passed, finish, True, compiled
    )


# Stage programs compiled in this process, keyed by the text of the program the runtime
# compiles (:func:`runtime_program`: without its markers, whose names differ from stage
# to stage), its types and slot: stages of identical blocks are one program, compiled
# once, and the same stage program reappears whenever a pipeline is rebuilt for the same
# microbatch shape (another schedule, another number of microbatches). XLA compilation
# dominates the cost of building a pipeline. Programs with constants are not cached (their text does not
# show the constants' values), nor programs whose text hides an object's identity: the
# printer writes ``<function f at 0xXXXXXXXXXXXX>`` for a callback (``jax.pure_callback``,
# custom derivative rules), so two programs calling different functions of one name print
# alike.
_HIDDEN_ADDRESS = re.compile(r"\bat 0xX+>")
_UNIT_CACHE: dict[Any, tuple[Callable, Callable | None]] = {}
_UNIT_CACHE_SIZE = 256
register_cache(_UNIT_CACHE.clear)


def keeps_markers() -> bool:
    """Whether the programs compiled now keep their marker equations: only under the
    ``"custom_call"`` lowering, whose calls name each marker in profiles and HLO."""
    return get_lowering() == "custom_call"


def runtime_program(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The program the runtime compiles for a stage: the stage's jaxpr without its
    marker equations, unless :func:`keeps_markers`.

    Inside one stage program a marker separates nothing: the stage boundary is the
    program boundary. Lowered as a barrier, it would stop XLA from fusing across it and
    from rematerialising what it fences; on a TPU v5e (JAX 0.10.2) the one-stage program
    of a 270M-parameter GPT needed 12.1 GiB of temporaries with barriers and 5.4 GiB,
    as ``jax.jit`` of the same step, without them (docs/performance.md).

    >>> import jax, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: pm.mark(x * 2, name="a", mark_type="end"))(1.0)
    >>> [e.primitive.name for e in runtime_program(cj).jaxpr.eqns]
    ['mul']
    """
    return closed if keeps_markers() else remove_markers(closed)


def _unit_key(program: ClosedJaxpr, accumulated: list[int], passed: list[int], slot: Slot) -> Any:
    """The cache key of a stage's ``program`` (:func:`runtime_program`), or ``None``."""
    if program.consts:
        return None
    jaxpr = program.jaxpr
    text = str(jaxpr)
    if _HIDDEN_ADDRESS.search(text):
        return None
    types = tuple(repr(v.aval) for v in (*jaxpr.invars, *jaxpr.outvars))
    where = tuple((d.platform, d.id) for d in slot.devices)
    return (
        text, types, tuple(accumulated), tuple(passed), where, repr(slot.sharding),
        keeps_markers(),
    )  # fmt: skip


def _compile_unit(
    staged: StagedJaxpr,
    index: int,
    worker: int,
    slot: Slot,
    readers: dict[tuple[int, int], int],
    starts: bool,
) -> Unit:
    stage = staged.stages[index]
    accumulated, passed = _outputs(staged, index, readers)
    outputs = [o for _, o in accumulated]
    program = runtime_program(stage.closed_jaxpr)
    key = _unit_key(program, outputs, list(passed), slot)
    key = key and (*key, starts)
    cached = _UNIT_CACHE.get(key) if key is not None else None
    if cached is None:
        cached = _jit_unit(program, outputs, list(passed), slot, starts)
        if key is not None:
            if len(_UNIT_CACHE) >= _UNIT_CACHE_SIZE:
                del _UNIT_CACHE[next(iter(_UNIT_CACHE))]
            _UNIT_CACHE[key] = cached
    run, zeros = cached
    # The accumulators are donated: each call starts from zeros of its own.
    return Unit(
        index, worker, run, zeros, accumulated, passed, donates=zeros is not None, starts=starts
    )


def _jit_unit(
    program: ClosedJaxpr, accumulated: list[int], passed: list[int], slot: Slot, starts: bool
) -> tuple[Callable, Callable | None]:
    fun = jaxpr_as_fun(program)
    avals = [v.aval for v in program.jaxpr.outvars]

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        outs = fun(*inputs)
        shares = [microbatch_share(outs[o], scale) for o in accumulated]
        new = shares if starts else [acc + v for acc, v in zip(accs, shares)]
        return new, [outs[o] for o in passed]

    sharding = slot.sharding
    zeros = None
    if accumulated and not starts:
        shapes = [(avals[o].shape, avals[o].dtype) for o in accumulated]

        def make_zeros() -> list[Any]:
            return [jnp.zeros(s, d) for s, d in shapes]

        zeros = jax.jit(make_zeros, out_shardings=sharding)
    # The accumulators are donated: XLA adds this microbatch's share in place, and a
    # step holds one copy of the gradients, not two (jax.jit's own step holds one).
    return jax.jit(run, out_shardings=sharding, donate_argnums=(0,) if zeros else ()), zeros


# ----------------------------------------------------------------- fused programs

#: Where a fused program's backward reads each input (:func:`fused_wiring`).
OUTPUT, INPUT, EXTRA = "output", "input", "extra"


def fused_wiring(
    forward_inputs: Sequence[Hashable],
    backward_inputs: Sequence[Hashable],
    forward_output: Callable[[Any], int | None],
    shared: Callable[[Any], bool],
) -> tuple[tuple[str, int], ...]:
    """Per input of a backward fused after its forward, where the fused program takes
    it: ``(OUTPUT, i)``, the forward's output ``i`` (``forward_output(entry)`` says which,
    or ``None``); ``(INPUT, j)``, the forward's input ``j``, for an entry both read that
    may be ``shared`` (a parameter or batch leaf: a value another stage hands over is
    counted once per reading stage, so each reads its own); else ``(EXTRA, k)``, the
    ``k``-th of the inputs the fused program takes after the forward's. The entries are
    stage input references, or a step's inputs: one rule for the program, its arguments
    and the steps that pass them.

    >>> fused_wiring(["p", "x"], ["out0", "p", "x"], lambda e: 0 if e == "out0" else None,
    ...              lambda e: e == "p")
    (('output', 0), ('input', 0), ('extra', 0))
    """
    position = {entry: j for j, entry in reversed(list(enumerate(forward_inputs)))}
    wiring = []
    extra = 0
    for entry in backward_inputs:
        i = forward_output(entry)
        if i is not None:
            wiring.append((OUTPUT, i))
        elif entry in position and shared(entry):
            wiring.append((INPUT, position[entry]))
        else:
            wiring.append((EXTRA, extra))
            extra += 1
    return tuple(wiring)


def stage_wiring(staged: StagedJaxpr, forward: int, backward: int) -> tuple[tuple[str, int], ...]:
    """:func:`fused_wiring` of stage ``backward`` fused after stage ``forward``."""
    return fused_wiring(
        staged.stages[forward].inputs,
        staged.stages[backward].inputs,
        lambda ref: ref.index if ref.kind == "stage" and ref.stage == forward else None,
        lambda ref: ref.kind == "input",
    )


def compile_fused(staged: StagedJaxpr, forward: Unit, backward: Unit, slot: Slot) -> Unit:
    """One program running stage ``forward.index`` and then stage ``backward.index``
    (on ``slot``) for one microbatch: a :class:`Unit` whose inputs are the forward's
    followed by the backward's inputs that are not the forward's outputs, whose
    accumulators are the forward's followed by the backward's, and whose passed outputs
    are the backward's. The forward's outputs stay inside the program, so XLA neither
    writes the residuals out nor reads them back, and fuses across the two stages.
    Only for a forward whose passed outputs no stage but the backward reads
    (:func:`pipemark.runtime.steps.fuse_steps` decides).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> from pipemark.runtime.placement import place_stages
    >>> staged = pm.split(jax.value_and_grad(lambda w: jnp.sum(jnp.sin(w) ** 2)), 1.0,
    ...                   num_stages=1)
    >>> placement = place_stages(jax.devices()[:1], (0,))
    >>> units = compile_units(staged, {0: 0, 1: 0}, placement)
    >>> fused = compile_fused(staged, units[0], units[1], placement.slots[0])
    >>> accs, passed = fused.run([jnp.zeros(()), jnp.zeros(())], [jnp.float32(1.0)],
    ...                          jnp.float32(1.0))
    >>> [round(float(a), 4) for a in accs], passed
    ([0.7081, 0.9093], [])
    """
    forward_stage, backward_stage = staged.stages[forward.index], staged.stages[backward.index]
    wiring = stage_wiring(staged, forward.index, backward.index)
    accumulated = (
        [o for _, o in forward.accumulated],
        [o for _, o in backward.accumulated],
    )
    programs = (
        runtime_program(forward_stage.closed_jaxpr),
        runtime_program(backward_stage.closed_jaxpr),
    )
    keys = (
        _unit_key(programs[0], accumulated[0], [], slot),
        _unit_key(programs[1], accumulated[1], list(backward.passed), slot),
    )
    starts = forward.starts
    key = None if None in keys else ("fused", *keys, wiring, starts)
    run = _FUSED_CACHE.get(key) if key is not None else None
    if run is None:
        run = _jit_fused(
            *programs,
            wiring,
            accumulated,
            list(backward.passed),
            slot,
            starts,
        )
        if key is not None:
            if len(_FUSED_CACHE) >= _UNIT_CACHE_SIZE:
                del _FUSED_CACHE[next(iter(_FUSED_CACHE))]
            _FUSED_CACHE[key] = run
    return Unit(
        backward.index,
        backward.worker,
        run,
        None,
        (*forward.accumulated, *backward.accumulated),
        backward.passed,
        donates=not starts,
        starts=starts,
    )


# Fused programs, cached like the stage programs (same keys, for the pair and its wiring).
_FUSED_CACHE: dict[Any, Callable] = {}
register_cache(_FUSED_CACHE.clear)


def _jit_fused(
    forward: ClosedJaxpr,
    backward: ClosedJaxpr,
    wiring: tuple[tuple[str, int], ...],
    accumulated: tuple[list[int], list[int]],
    passed: list[int],
    slot: Slot,
    starts: bool,
) -> Callable:
    forward_fun = jaxpr_as_fun(forward)
    backward_fun = jaxpr_as_fun(backward)
    num_forward_inputs = len(forward.jaxpr.invars)

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        forward_inputs, extra = inputs[:num_forward_inputs], inputs[num_forward_inputs:]
        forward_outs = forward_fun(*forward_inputs)
        where = {OUTPUT: forward_outs, INPUT: forward_inputs, EXTRA: extra}
        outs = backward_fun(*(where[kind][i] for kind, i in wiring))
        shares = [forward_outs[o] for o in accumulated[0]] + [outs[o] for o in accumulated[1]]
        shares = [microbatch_share(v, scale) for v in shares]
        new = shares if starts else [acc + v for acc, v in zip(accs, shares)]
        return new, [outs[o] for o in passed]

    return jax.jit(run, out_shardings=slot.sharding, donate_argnums=() if starts else (0,))
