"""Compile each stage program of a pipeline once for its slot: :func:`compile_units`.

A :class:`Unit` runs one stage for one microbatch: ``run(accumulators, inputs, scale)``
returns the accumulators with this microbatch's share added (the loss, the gradients,
scaled by ``scale``: ``1/M`` for a mean, 1 for a sum, an argument so that one program
serves every number of microbatches) and the outputs other stages read. The
accumulators stay on the slot.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> from pipemark.runtime.devices.placement import place_stages
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from pipemark._compat import ACCUMULATORS_MADE_IN_PROGRAM
from pipemark.caches import register_cache
from pipemark.lowering import get_lowering
from pipemark.passes.rewrite import remove_markers
from pipemark.roles import FORWARD
from pipemark.runtime.devices.accumulation import accumulate, fold_scatters
from pipemark.runtime.devices.placement import Placement, Slot
from pipemark.runtime.devices.sharding import compile_stage
from pipemark.staged import StagedJaxpr

__all__ = [
    "ARGUMENT",
    "Combined",
    "Unit",
    "compile_fused",
    "compile_units",
    "keeps_markers",
    "kept_on_slot",
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
        the accumulators a call, where the plan's steps place it (after the stage's
        last action, or at the end of the call: ``reduce_gradients``); else ``None``.
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
    #: (:class:`pipemark.runtime.devices.sharding.CompiledStage`).
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


def kept_on_slot(staged: StagedJaxpr, workers: Mapping[int, int]) -> dict[int, frozenset[int]]:
    """Per stage index of ``workers`` (stage index -> worker), the outputs that only
    stages on its own worker read: residuals a forward keeps for its backward, and on a
    slot that runs consecutive stages (the interleaved schedule on one device), the
    activations between them. These never leave the device, so their programs may hand
    them over in whatever memory layout XLA prefers (:func:`_passed_shardings`).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> staged = pm.split(jax.value_and_grad(lambda w: jnp.sum(jnp.cos(jnp.sin(w)))), 1.0,
    ...                   num_stages=2)
    >>> kept_on_slot(staged, {0: 0, 1: 1, 2: 1, 3: 0})[0]  # layer0's residual for its backward
    frozenset({1})
    """
    elsewhere: set[tuple[int, int]] = set()
    read: set[tuple[int, int]] = set()
    for j, stage in enumerate(staged.stages):
        for ref in stage.inputs:
            if ref.kind == "stage" and ref.stage in workers:
                read.add((ref.stage, ref.index))
                if workers.get(j) != workers[ref.stage]:
                    elsewhere.add((ref.stage, ref.index))
    return {index: frozenset(o for s, o in read - elsewhere if s == index) for index in workers}


def _passed_shardings(
    slot: Slot, passed: Sequence[int], kept: frozenset[int], programs: Sequence[ClosedJaxpr]
) -> list[Any]:
    """The ``out_shardings`` of a program's passed outputs on a single-device ``slot``:
    those ``kept`` on the slot in the layout XLA chooses (``Layout.AUTO``), the others
    in the default one. At a program boundary JAX otherwise writes every output in the
    default layout: on a TPU v5e a forward wrote the float32 attention probabilities
    it keeps (1 x 16 x 1024 x 1024) transposed into it and its backward transposed them
    back, two copies of 0.2 ms per block and microbatch, about the whole gap between
    the pipeline and the ``lax.scan`` accumulation (issue #40). The program that reads
    such a value compiles for the layout it arrives in (``jax.jit`` follows a committed
    argument's layout).

    A program with effects (``programs``: the jaxprs it runs) writes every output in
    the default layout. JAX 0.10.2 reports the outputs of a program with an ordered
    effect (an ``io_callback(ordered=True)``, Pallas's TPU interpret mode) as laid out
    by default whatever XLA chose (its token shifts them), so the program that reads
    one reads the bytes in the wrong order: a transposed array, silently (fixed by JAX
    0.12.1; ``tests/runtime/test_compilation.py``). Telling ordered effects from others
    takes JAX internals, and a stage with effects is rare: any effect keeps the default.
    """
    if any(program.effects for program in programs):
        return [slot.sharding] * len(passed)
    auto = Format(Layout.AUTO, slot.sharding)
    return [auto if o in kept else slot.sharding for o in passed]


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
    fsdp_gather: str = "once",
) -> dict[int, Unit]:
    """A :class:`Unit` for each stage ``index`` of ``workers`` (stage index -> worker),
    compiled for that worker's slot (programs seen before come from a cache). On
    sub-meshes, the first ``num_params`` inputs of ``staged`` are parameters laid out by
    ``param_specs`` (one ``PartitionSpec`` each), and each result ``r`` of ``staged``
    is reduced into ``result_specs[r]`` (replicated where ``None``); parameters sharded
    over ``data_axis`` are gathered as ``fsdp_gather`` says
    (:func:`pipemark.runtime.devices.sharding.compile_stage`). With
    ``num_microbatches`` 1, single-device units keep no accumulators
    (:attr:`Unit.starts`) where :func:`_may_start` allows it."""
    readers = stage_readers(staged)
    if not placement.meshes:
        starts = num_microbatches == 1 and _may_start(staged)
        kept = kept_on_slot(staged, workers)
        return {
            index: _compile_unit(staged, index, w, placement.slots[w], readers, starts, kept[index])
            for index, w in workers.items()
        }
    specs = _MeshSpecs(num_params, param_specs or (), result_specs, data_axis, fsdp_gather)
    return {
        index: _mesh_unit(staged, index, w, placement.slots[w], readers, specs)
        for index, w in workers.items()
    }


def _may_start(staged: StagedJaxpr) -> bool:
    """Whether stage programs run for the one microbatch of a call may make their
    accumulators themselves rather than add to zeros they are given: on a JAX that lays
    them out right (:data:`pipemark._compat.ACCUMULATORS_MADE_IN_PROGRAM`), or with one
    forward stage, whose forward and backward the runtime fuses into one program reading
    only the caller's arrays. On JAX 0.10 a program reading values in layouts XLA chose
    (:func:`kept_on_slot`) handed back accumulators in layouts of XLA's choosing, which
    a later program mixing them with default-layout arrays read wrong."""
    if ACCUMULATORS_MADE_IN_PROGRAM:
        return True
    return sum(stage.role.kind == FORWARD for stage in staged.stages) == 1


class _MeshSpecs(NamedTuple):
    num_params: int
    param_specs: Sequence[Any]
    result_specs: Sequence[Any] | None
    data_axis: str
    fsdp_gather: str


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
    """A stage compiled over its slot's sub-mesh
    (:func:`pipemark.runtime.devices.sharding.compile_stage`: the model's shardings
    retargeted, data-parallel replicas, delayed reduction)."""
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
        fsdp_gather=specs.fsdp_gather,
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
    as ``jax.jit`` of the same step, without them (docs/benchmarks/tpu-v5e-measurements.md).

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
    kept: frozenset[int] = frozenset(),
) -> Unit:
    stage = staged.stages[index]
    accumulated, passed = _outputs(staged, index, readers)
    outputs = [o for _, o in accumulated]
    program = runtime_program(stage.closed_jaxpr)
    key = _unit_key(program, outputs, list(passed), slot)
    kept = kept & frozenset(passed)
    key = key and (*key, starts, tuple(sorted(kept)))
    cached = _UNIT_CACHE.get(key) if key is not None else None
    if cached is None:
        cached = _jit_unit(program, outputs, list(passed), slot, starts, kept)
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
    program: ClosedJaxpr,
    accumulated: list[int],
    passed: list[int],
    slot: Slot,
    starts: bool,
    kept: frozenset[int],
) -> tuple[Callable, Callable | None]:
    avals = [v.aval for v in program.jaxpr.outvars]
    # A scattered gradient is scattered into its accumulator in place (accumulation.py).
    program, folds = fold_scatters(program, accumulated, passed, starts)
    fun = jaxpr_as_fun(program)

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        outs = fun(*inputs)
        new = accumulate(accs, outs, accumulated, folds, scale, starts)
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
    out_shardings = (sharding, _passed_shardings(slot, passed, kept, [program]))
    donate = (0,) if zeros else ()
    return jax.jit(run, out_shardings=out_shardings, donate_argnums=donate), zeros


# ----------------------------------------------------------------- fused programs

#: Where a part of a fused program reads one of its inputs: ``(ARGUMENT, k)``, the
#: fused program's argument ``k``; ``(p, o)`` with ``p >= 0``, output ``o`` of part ``p``.
ARGUMENT = -1


class Combined(NamedTuple):
    """Several stage programs of one slot run as one program (a fused step,
    :func:`pipemark.runtime.devices.steps.fuse_steps`): a forward and the backward after it, a
    whole backward as its B and W halves, an overlapped pair
    (:attr:`pipemark.runtime.Schedule.overlapped`). Hashable: the plan keys the
    compiled program on it.

    Attributes
    ----------
    stages:
        The stage index of each part, in the order the program runs them.
    reads:
        Per part, per input of its stage: ``(ARGUMENT, k)`` or ``(part, output)`` (an
        earlier part's output, which need not leave the program).
    passed:
        ``(part, output)`` of each value the program returns for other steps.
    """

    stages: tuple[int, ...]
    reads: tuple[tuple[tuple[int, int], ...], ...]
    passed: tuple[tuple[int, int], ...]

    @property
    def num_arguments(self) -> int:
        return 1 + max((k for reads in self.reads for p, k in reads if p == ARGUMENT), default=-1)


def compile_fused(
    staged: StagedJaxpr, combined: Combined, units: Mapping[int, Unit], slot: Slot
) -> Unit:
    """One program running the parts of ``combined`` one after another (on ``slot``),
    each stage for its own microbatch: a :class:`Unit` whose inputs are
    ``combined``'s arguments, whose accumulators are each part's (in part order) and
    whose passed outputs are ``combined.passed``. What one part hands the next stays
    inside the program, so XLA neither writes it out nor reads it back, and may fuse
    and overlap across the parts.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> from pipemark.runtime.devices.placement import place_stages
    >>> staged = pm.split(jax.value_and_grad(lambda w: jnp.sum(jnp.sin(w) ** 2)), 1.0,
    ...                   num_stages=1)
    >>> placement = place_stages(jax.devices()[:1], (0,))
    >>> units = compile_units(staged, {0: 0, 1: 0}, placement)
    >>> backward_reads = tuple((0, ref.index) for ref in staged.stages[1].inputs)
    >>> backward_reads  # the forward's residuals, handed over inside the program
    ((0, 0), (0, 1))
    >>> both = Combined((0, 1), (((ARGUMENT, 0),), backward_reads), ())
    >>> fused = compile_fused(staged, both, units, placement.slots[0])
    >>> accs, passed = fused.run([jnp.zeros(()), jnp.zeros(())], [jnp.float32(1.0)],
    ...                          jnp.float32(1.0))
    >>> [round(float(a), 4) for a in accs], passed
    ([0.7081, 0.9093], [])
    """
    parts = [units[index] for index in combined.stages]
    accumulated = tuple(tuple(o for _, o in unit.accumulated) for unit in parts)
    programs = tuple(runtime_program(staged.stages[i].closed_jaxpr) for i in combined.stages)
    keys = tuple(_unit_key(p, list(a), [], slot) for p, a in zip(programs, accumulated))
    starts = parts[0].starts
    kept_by_stage = kept_on_slot(staged, {i: unit.worker for i, unit in units.items()})
    kept = frozenset(
        k for k, (p, o) in enumerate(combined.passed) if o in kept_by_stage[combined.stages[p]]
    )
    key = None if None in keys else ("fused", keys, combined.reads, combined.passed, starts)
    key = key and (*key, tuple(sorted(kept)))
    run = _FUSED_CACHE.get(key) if key is not None else None
    if run is None:
        run = _jit_fused(programs, combined, accumulated, slot, starts, kept)
        if key is not None:
            if len(_FUSED_CACHE) >= _UNIT_CACHE_SIZE:
                del _FUSED_CACHE[next(iter(_FUSED_CACHE))]
            _FUSED_CACHE[key] = run
    return Unit(
        combined.stages[-1],
        parts[-1].worker,
        run,
        None,
        tuple(pair for unit in parts for pair in unit.accumulated),
        tuple(range(len(combined.passed))),
        donates=not starts,
        starts=starts,
    )


# Fused programs, cached like the stage programs (same keys, for the parts and wiring).
_FUSED_CACHE: dict[Any, Callable] = {}
register_cache(_FUSED_CACHE.clear)


def _jit_fused(
    programs: tuple[ClosedJaxpr, ...],
    combined: Combined,
    accumulated: tuple[tuple[int, ...], ...],
    slot: Slot,
    starts: bool,
    kept: frozenset[int],
) -> Callable:
    # What another part or step reads of a part's outputs is not folded (accumulation.py).
    read = {pair for reads in combined.reads for pair in reads} | set(combined.passed)
    folded = [
        fold_scatters(program, part, [o for q, o in read if q == p], starts)
        for p, (program, part) in enumerate(zip(programs, accumulated))
    ]
    funs = [jaxpr_as_fun(program) for program, _ in folded]

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        outs: list[list[Any]] = []
        for fun, reads in zip(funs, combined.reads):
            outs.append(fun(*(inputs[k] if p == ARGUMENT else outs[p][k] for p, k in reads)))
        new, at = [], 0
        for (_, folds), out, part in zip(folded, outs, accumulated):
            new += accumulate(accs[at : at + len(part)], out, part, folds, scale, starts)
            at += len(part)
        return new, [outs[p][o] for p, o in combined.passed]

    passed = range(len(combined.passed))
    out_shardings = (slot.sharding, _passed_shardings(slot, passed, kept, programs))
    return jax.jit(run, out_shardings=out_shardings, donate_argnums=() if starts else (0,))
