"""Automatic layers: cut a program into contiguous layers of balanced cost.

:func:`auto_layers` puts start/end markers into an unmarked program so that its
equations, in program order, form ``num_layers`` contiguous layers whose largest cost is
as small as possible, and among such cuts, the bytes crossing them are as few as
possible.

How it works (linear in the number of equations up to a logarithm):

1. Cost per equation (:func:`equation_costs`) and the bytes live across each possible
   cut (:func:`crossing_bytes`), both in one pass over the program.
2. The optimal bottleneck ``B*`` by binary search over integers, each probe a greedy
   check that jumps over prefix sums with ``bisect`` (``O(K log n)`` a probe). The
   greedy partition at a feasible bound never exceeds the bound and is itself feasible,
   so the search snaps down to the exact optimum.
3. Among partitions whose largest layer is at most ``B* * (1 + tolerance)``, the one
   with the fewest bytes crossing its cuts (then, the cuts nearest the even split), by
   a dynamic program over cut positions whose sliding-window minima come from a sparse
   table: ``O(K n log n)`` NumPy work, no Python loop over pairs of equations.

A ``value_and_grad`` (or ``grad``) program is recognised by the equations JAX made by
transposition. Its forward part (the equations before the first transposed one) is
balanced as above, and its backward part is cut into mirrored stages
``<name>_backward`` in reverse order, the names :func:`jax.grad` gives the transposed
markers of a marked function. The backward cuts are chosen by a second dynamic program
that keeps every backward equation next to the forward values (residuals, parameters)
it reads: it minimises the bytes of forward values a backward stage would have to fetch
from another forward stage plus the bytes of cotangents crossing the backward cuts.
This works on the jaxpr alone; re-tracing ``value_and_grad`` of the marked forward
function would give the same stage structure through the marker's transpose rule, but
needs the Python function, which a jaxpr pass does not have.

Cuts between a model's repeated blocks (:mod:`pipemark.passes.blocks`) are preferred
when they cost little balance: the same search runs over the positions between blocks
alone, and its result is kept when its largest layer is within ``block_tolerance``
(:data:`BLOCK_TOLERANCE`) of the unconstrained optimum ``B*``. :func:`plan_layers`
also returns the balance (:class:`LayerBalance`). This module owns that split policy
(``block_cuts``); ``pm.split``, the runtime and the CLI pass it through.

Costs are per top-level equation. A heavy ``scan`` (a scan over layers) is first cut
into ``num_layers`` chunks (:func:`pipemark.passes.split_scan`); ``pm.split`` inlines
``jit`` calls (:func:`pipemark.passes.inline_calls`). What stays indivisible (a
``while`` loop, a ``cond``, a scan with fewer iterations than layers) lands in one layer
whole, with a :class:`~pipemark.errors.PipemarkWarning` when it is heavier than a layer
should be.
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from pipemark._compat import name_stack_scopes
from pipemark._text import plural
from pipemark.cost import Cost, eqn_costs, estimate_cost
from pipemark.errors import (
    MarkerError,
    PipemarkError,
    PipemarkWarning,
    describe_eqn,
)
from pipemark.marks import APPLY_STAGE, STAGE_MARK_TYPES, backward_name
from pipemark.passes._backward import crossing_bytes, forward_end, mirror_cuts
from pipemark.passes.blocks import Blocks, find_blocks
from pipemark.passes.framework import jaxpr_pass
from pipemark.passes.gradient import apply_start
from pipemark.passes.insert import insert_markers
from pipemark.passes.scan import SCAN_COST_FRACTION, scans_to_split, split_scan
from pipemark.primitive import is_marker, pipeline_p

__all__ = [
    "AUTO_COSTS",
    "BLOCK_CUTS",
    "BLOCK_TOLERANCE",
    "LayerBalance",
    "LayerPlan",
    "auto_layers",
    "balanced_cuts",
    "check_block_cuts",
    "crossing_bytes",
    "equation_costs",
    "plan_layers",
]

AUTO_COSTS: tuple[str, ...] = ("flops", "bytes", "equations", "xla")

# The split policy: where the cuts between balanced layers may fall.
#   "prefer":  between the model's repeated blocks (pipemark.passes.blocks) when the
#              largest layer then costs at most BLOCK_TOLERANCE more than the best cut
#              anywhere; anywhere otherwise.
#   "require": between blocks whatever the balance (an error when none are found).
#   "off":     anywhere; only cost and crossing bytes decide.
BLOCK_CUTS: tuple[str, ...] = ("prefer", "require", "off")
BLOCK_TOLERANCE: float = 0.15


# ----------------------------------------------------------------------- costs, bytes


def _xla_costs(eqns: Sequence[JaxprEqn]) -> list[int]:
    # Compiling one program per equation is slow; equations that differ only in their
    # variables (the same layer repeated) share one compilation.
    cache: dict[tuple, int] = {}
    out = []
    for eqn in eqns:
        key = (
            eqn.primitive.name,
            tuple(str(v.aval) for v in eqn.invars),
            tuple(sorted((k, repr(v)) for k, v in eqn.params.items())),
        )
        if key not in cache:
            if eqn.primitive is pipeline_p:
                cache[key] = 0
            else:
                cache[key] = estimate_cost(eqn, cost="xla").total_flops
        out.append(cache[key])
    return out


def equation_costs(
    program: ClosedJaxpr | Jaxpr, cost: str | Callable[[JaxprEqn], float] = "flops"
) -> np.ndarray:
    """The cost of each top-level equation as an ``int64`` array.

    ``cost`` is ``"flops"`` (FLOPs plus transcendentals, :mod:`pipemark.cost`),
    ``"bytes"`` (bytes read and written), ``"equations"`` (1 each), ``"xla"`` (XLA's
    cost analysis of each equation compiled alone; slow) or a function of one
    equation returning a non-negative number.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda a: jnp.sin(a @ a))(jnp.ones((4, 4)))
    >>> equation_costs(cj)
    array([128,  16])
    """
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    if callable(cost):
        values = np.asarray([float(cost(e)) for e in jaxpr.eqns], dtype=np.float64)
        if values.size and (not np.all(np.isfinite(values)) or values.min() < 0):
            raise PipemarkError(
                "The cost function returned a negative, infinite or NaN cost; it must "
                "return a finite number >= 0 for every equation."
            )
        # Integers keep the bottleneck search exact; scale fractional costs first.
        if values.size and np.any(values != np.round(values)):
            values = values * (2.0**40 / max(values.max(), 1e-300))
        return np.round(values).astype(np.int64)
    if cost not in AUTO_COSTS:
        raise PipemarkError(
            f"Unknown cost {cost!r}; auto_layers balances one of "
            f"{', '.join(map(repr, AUTO_COSTS))}, or a function eqn -> number."
        )
    if cost == "equations":
        return np.ones(len(jaxpr.eqns), dtype=np.int64)
    if cost == "xla":
        return np.asarray(_xla_costs(jaxpr.eqns), dtype=np.int64).reshape(-1)
    field: Callable[[Cost], int] = (
        (lambda c: c.total_flops) if cost == "flops" else (lambda c: c.bytes_accessed)
    )
    return _as_int64([field(c) for c in eqn_costs(jaxpr)])


# Costs are added along a program; below this total their sums stay exact in int64.
_EXACT_TOTAL = 2**62


def _as_int64(costs: list[int]) -> np.ndarray:
    """Exact costs (Python ints, of any size) as an int64 array whose sums cannot
    overflow: a program whose total exceeds 2**62 (a f32[4e9,4e9] array, a 1.2e6-wide
    matmul) has every cost scaled down alike, rounded up so none becomes 0, which
    keeps the balance (relative costs) to about one part in 2**40."""
    total = sum(costs)
    if total <= _EXACT_TOTAL:
        return np.asarray(costs, dtype=np.int64).reshape(-1)
    scale = total // 2**40 + 1
    return np.asarray([-(-c // scale) for c in costs], dtype=np.int64).reshape(-1)


# ------------------------------------------------------------------- the bottleneck


def _greedy(prefix: list[int], parts: int, bound: int) -> int | None:
    """The largest part of the greedy partition into at most ``parts`` parts of cost at
    most ``bound``, or None when there is none."""
    n = len(prefix) - 1
    begin, used, largest = 0, 0, 0
    while begin < n:
        end = bisect.bisect_right(prefix, prefix[begin] + bound, lo=begin) - 1
        if end == begin:  # a single equation costs more than the bound
            return None
        used += 1
        if used > parts:
            return None
        largest = max(largest, prefix[end] - prefix[begin])
        begin = end
    return largest


def _optimal_bottleneck(prefix: list[int], parts: int) -> int:
    n = len(prefix) - 1
    total = prefix[-1]
    heaviest = max(prefix[i + 1] - prefix[i] for i in range(n))
    low = max(heaviest, -(-total // parts)) - 1  # every bound <= low is infeasible
    high = total
    while high - low > 1:
        middle = (low + high) // 2
        largest = _greedy(prefix, parts, middle)
        if largest is None:
            low = middle
        else:
            high = largest  # a feasible bound no larger than middle
    return high


# --------------------------------------------------------------- min-bytes partition


class _RangeMin:
    """Range minima of the lexicographic order (primary, secondary, index).

    Each position is replaced by its rank in that order (one ``lexsort``), so the
    sparse table holds one integer array per level and a query is one ``minimum``."""

    def __init__(self, primary: np.ndarray, secondary: np.ndarray):
        self.primary, self.secondary = primary, secondary
        self.order = np.lexsort((np.arange(primary.size), secondary, primary))
        rank = np.empty(primary.size, dtype=np.int64)
        rank[self.order] = np.arange(primary.size)
        self.levels = [rank]
        width = 1
        while 2 * width <= primary.size:
            previous = self.levels[-1]
            self.levels.append(np.minimum(previous[:-width], previous[width:]))
            width *= 2

    def query(self, lo: np.ndarray, hi: np.ndarray):
        """Minima over the inclusive ranges ``[lo, hi]`` (each non-empty): their
        primary and secondary values and their index."""
        length = hi - lo + 1
        level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
        best = np.empty(lo.size, dtype=np.int64)
        for k in np.unique(level):
            rows = np.nonzero(level == k)[0]
            ranks = self.levels[k]
            best[rows] = np.minimum(ranks[lo[rows]], ranks[hi[rows] - (1 << int(k)) + 1])
        index = self.order[best]
        return self.primary[index], self.secondary[index], index


def _min_bytes_cuts(prefix: np.ndarray, parts: int, bound: int, cut_bytes: np.ndarray) -> list[int]:
    """Cuts into exactly ``parts`` non-empty parts of cost <= ``bound`` that minimise
    the crossing bytes, then the distance of the cuts from the even split."""
    n = prefix.size - 1
    total = int(prefix[-1])
    index = np.arange(n + 1)
    # The earliest begin j of a last part ending at i: prefix[i] - prefix[j] <= bound.
    earliest = np.searchsorted(prefix, prefix - bound, side="left")
    inf = np.inf
    cost = np.where((index >= 1) & (prefix <= bound), 0.0, inf)
    spread = np.zeros(n + 1)
    choices: list[np.ndarray] = []
    for k in range(2, parts + 1):
        # Extend a partition of [0, j) into k-1 parts by the part [j, i); the cut at j
        # is the (k-1)-th, whose even-split position is total * (k-1) / parts.
        ideal = total * (k - 1) / parts
        primary = cost + np.where((index >= 1) & (index < n), cut_bytes, inf)
        secondary = spread + np.abs(prefix - ideal)
        table = _RangeMin(primary, secondary)
        lo = np.maximum(earliest, k - 1)
        hi = index - 1
        ok = (index >= k) & (lo <= hi)
        new_cost = np.full(n + 1, inf)
        new_spread = np.zeros(n + 1)
        choice = np.full(n + 1, -1, dtype=np.int64)
        rows = np.nonzero(ok)[0]
        if rows.size:
            p, s, i = table.query(lo[rows], hi[rows])
            new_cost[rows], new_spread[rows], choice[rows] = p, s, i
        cost, spread = new_cost, new_spread
        choices.append(choice)
    if not np.isfinite(cost[n]):  # cannot happen for bound >= the optimum
        raise PipemarkError("auto_layers: no partition fits the bound; please report this.")
    cuts = []
    end = n
    for choice in reversed(choices):
        end = int(choice[end])
        cuts.append(end)
    return cuts[::-1]


def balanced_cuts(
    costs: Sequence[int] | np.ndarray,
    num_parts: int,
    *,
    cut_bytes: Sequence[int] | np.ndarray | None = None,
    tolerance: float = 0.0,
) -> list[int]:
    """Split ``costs`` into ``num_parts`` contiguous non-empty parts with the smallest
    largest-part sum; among those within ``(1 + tolerance)`` of it, the fewest bytes
    across the cuts.

    Parameters
    ----------
    costs:
        Non-negative integer cost per item.
    num_parts:
        Number of parts, at most ``len(costs)``.
    cut_bytes:
        ``len(costs) + 1`` entries: the price of a cut before item ``i`` (only entries
        ``1 .. len(costs) - 1`` are used). Default: all zero.
    tolerance:
        How far above the optimal bottleneck the largest part may go to find cheaper
        cuts. ``0`` keeps the bottleneck exactly optimal.

    Returns
    -------
    list of int
        The ``num_parts - 1`` indices where parts 2, 3, … begin, increasing.

    >>> balanced_cuts([5, 1, 1, 1, 5, 1, 1, 1], 2)
    [4]
    >>> balanced_cuts([1, 1, 1, 1], 2, cut_bytes=[0, 9, 9, 1, 0], tolerance=0.5)
    [3]
    """
    values = np.asarray(costs, dtype=np.int64).reshape(-1)
    n = values.size
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) or num_parts < 1:
        raise PipemarkError(f"The number of layers must be a positive int, got {num_parts!r}.")
    if n < num_parts:
        raise PipemarkError(
            f"Cannot cut {plural(n, 'equation')} into {num_parts} non-empty layers; ask for at "
            f"most {n} layers."
        )
    if n and values.min() < 0:
        raise PipemarkError("Costs must be >= 0.")
    if tolerance < 0 or not math.isfinite(tolerance):
        raise PipemarkError(f"tolerance must be a finite number >= 0, got {tolerance!r}.")
    if cut_bytes is None:
        cut_bytes = np.zeros(n + 1, dtype=np.int64)
    cut_bytes = np.asarray(cut_bytes, dtype=np.float64).reshape(-1)
    if cut_bytes.size != n + 1:
        raise PipemarkError(f"cut_bytes needs {n + 1} entries, got {cut_bytes.size}.")
    if num_parts == 1:
        return []
    prefix = np.concatenate(([0], np.cumsum(values)))
    best = _optimal_bottleneck(prefix.tolist(), int(num_parts))
    bound = math.floor(best * (1.0 + tolerance))
    return _min_bytes_cuts(prefix, int(num_parts), max(bound, best), cut_bytes)


# ------------------------------------------------------------ cuts between blocks


@dataclass(frozen=True)
class LayerBalance:
    """How balanced :func:`plan_layers` cut a program's forward part, and why there.

    Attributes
    ----------
    costs:
        The cost of each forward layer, in order (under the ``cost`` balanced).
    optimum:
        The smallest largest-layer cost of any cut into as many layers, cut anywhere.
    block_cuts:
        The policy asked for: ``"prefer"``, ``"require"`` or ``"off"``.
    blocks:
        The repeated blocks found (:class:`~pipemark.passes.blocks.Blocks`), or None.
    block_aligned:
        Whether every cut falls between blocks; None when no blocks were found.

    >>> LayerBalance((10, 12), 11, "prefer", None, None).imbalance
    1.0909090909090908
    """

    costs: tuple[int, ...]
    optimum: int
    block_cuts: str
    blocks: Blocks | None
    block_aligned: bool | None

    @property
    def imbalance(self) -> float:
        """The largest layer's cost over the mean layer's: 1.0 is perfect balance."""
        mean = sum(self.costs) / max(len(self.costs), 1)
        return max(self.costs, default=0) / mean if mean else 1.0

    @property
    def excess(self) -> float:
        """How much more the largest layer costs than the best cut anywhere could give:
        0.0 when the cuts are bottleneck-optimal."""
        return max(self.costs, default=0) / self.optimum - 1.0 if self.optimum else 0.0

    def __str__(self) -> str:
        text = (
            f"{plural(len(self.costs), 'forward layer')}, largest / mean cost "
            f"{self.imbalance:.3f} ({100 * self.excess:.1f} % above the best cut anywhere)"
        )
        if self.blocks is None:
            return f"{text}; no repeated blocks found"
        count = plural(len(self.blocks.spans), "block")
        if self.block_aligned:
            return f"{text}; cuts between {count} ({self.blocks.source})"
        why = (
            "block_cuts='off'"
            if self.block_cuts == "off"
            else "cutting between them would cost more than block_tolerance allows"
        )
        return f"{text}; cuts inside the {count} ({self.blocks.source}): {why}"


def _choose_cuts(
    costs: np.ndarray,
    num_layers: int,
    penalties: np.ndarray,
    tolerance: float,
    blocks: Blocks | None,
    policy: tuple[str, float],
) -> tuple[list[int], LayerBalance]:
    """The cuts of ``costs`` into ``num_layers`` layers under the split policy
    ``(block_cuts, block_tolerance)``, and their balance."""
    block_cuts, block_tolerance = policy
    prefix = np.concatenate(([0], np.cumsum(costs)))
    optimum = _optimal_bottleneck(prefix.tolist(), num_layers)
    cuts = None
    if blocks is not None and block_cuts != "off":
        # The cut positions between blocks (0 and the end included); the search runs
        # over the pieces between them as if each were one equation.
        positions = np.nonzero(blocks.cut_allowed(costs.size))[0]
        if positions.size - 1 >= num_layers:
            within = _optimal_bottleneck(prefix[positions].tolist(), num_layers)
            limit = optimum * (1.0 + block_tolerance)
            if block_cuts == "require" or within <= limit:
                if block_cuts == "prefer":  # fewer bytes, but never past the limit
                    tolerance = max(0.0, min(tolerance, limit / max(within, 1) - 1.0))
                atom_cuts = balanced_cuts(
                    np.diff(prefix[positions]),
                    num_layers,
                    cut_bytes=penalties[positions],
                    tolerance=tolerance,
                )
                cuts = [int(positions[c]) for c in atom_cuts]
        elif block_cuts == "require":
            raise PipemarkError(
                f"block_cuts='require': the {plural(len(blocks.spans), 'block')} found "
                f"({blocks.source}) leave {positions.size - 1} pieces between their "
                f"boundaries, too few for {num_layers} layers. Ask for at most "
                f"{positions.size - 1} layers, or pass block_cuts='prefer'."
            )
    if cuts is None:
        cuts = balanced_cuts(costs, num_layers, cut_bytes=penalties, tolerance=tolerance)
    ends = [0, *cuts, costs.size]
    aligned = None
    if blocks is not None:
        allowed = blocks.cut_allowed(costs.size)
        aligned = bool(all(allowed[c] for c in cuts))
    layer_costs = tuple(int(b - a) for a, b in itertools.pairwise(prefix[ends]))
    return cuts, LayerBalance(layer_costs, int(optimum), block_cuts, blocks, aligned)


def check_block_cuts(block_cuts: str, block_tolerance: float = BLOCK_TOLERANCE) -> None:
    """Raise :class:`~pipemark.errors.PipemarkError` for an unknown ``block_cuts`` or a
    ``block_tolerance`` that is not a finite number >= 0.

    >>> check_block_cuts("prefer")
    >>> check_block_cuts("always")
    Traceback (most recent call last):
    ...
    pipemark.errors.PipemarkError: Unknown block_cuts 'always'; choose one of 'prefer', 'require', 'off'.
    """
    if block_cuts not in BLOCK_CUTS:
        raise PipemarkError(
            f"Unknown block_cuts {block_cuts!r}; choose one of {', '.join(map(repr, BLOCK_CUTS))}."
        )
    if (
        isinstance(block_tolerance, bool)
        or not isinstance(block_tolerance, (int, float))
        or block_tolerance < 0
        or not math.isfinite(block_tolerance)
    ):
        raise PipemarkError(
            f"block_tolerance must be a finite number >= 0, got {block_tolerance!r}."
        )


# ------------------------------------------------------------------------- the pass


def _cut_penalties(eqns: Sequence[JaxprEqn], stop: int, crossing: np.ndarray) -> np.ndarray:
    """What a cut before each equation of ``eqns[:stop]`` costs the tie-break among
    balanced cuts: first how deep inside a module (a flax / nnx / equinox / named
    scope) it falls, then the bytes crossing it. A cut between two top-level modules
    (``Block_1`` | ``Block_2``) beats one inside a block, which beats one inside a
    ``Dense``, whatever the bytes; programs without scopes keep the bytes alone."""
    scopes = [name_stack_scopes(eqn.source_info)[0] for eqn in eqns[:stop]]
    if not any(scopes):
        return crossing
    depth = np.zeros(len(crossing), dtype=np.int64)
    for i in range(1, stop):
        before, after = scopes[i - 1], scopes[i]
        shared = 0
        for a, b in zip(before, after):
            if a != b:
                break
            shared += 1
        depth[i] = shared + (before == after)  # +1: both sides in the very same module
    unit = int(crossing.max()) + 1  # any shallower cut beats any number of bytes
    return crossing + depth * unit


def _regions(jaxpr: Jaxpr, mirror_backward: bool) -> tuple[int, int, int | None]:
    """``(split_at, stop, apply_at)``: the forward part is ``eqns[:split_at]``, the
    backward part ``eqns[split_at:stop]``, and a training step's update (after its grad
    marker; run once per step, not per micro-batch, so not balanced with the layers)
    begins at ``apply_at``."""
    apply_at = apply_start(jaxpr)
    stop = len(jaxpr.eqns) if apply_at is None else apply_at
    split_at = forward_end(jaxpr) if mirror_backward else None
    if split_at is None or split_at > stop:
        split_at = stop
    return split_at, stop, apply_at


def _prepare(
    cj: ClosedJaxpr,
    num_layers: int,
    cost: str | Callable[[JaxprEqn], float],
    mirror_backward: bool,
    split_scans: bool,
) -> tuple[ClosedJaxpr, np.ndarray, tuple[int, int, int | None]]:
    """The program with its heavy scans cut into ``num_layers`` chunks (when asked),
    its equation costs and its regions; warns about what stays too heavy to balance."""
    costs = equation_costs(cj.jaxpr, cost)
    regions = _regions(cj.jaxpr, mirror_backward)
    scans = (
        scans_to_split(cj, SCAN_COST_FRACTION, costs.tolist())
        if split_scans and num_layers > 1
        else []
    )
    divisible = {i for i in scans if cj.jaxpr.eqns[i].params["length"] >= num_layers}
    _warn_indivisible(cj.jaxpr.eqns, costs[: regions[0]], num_layers, divisible)
    if scans:
        known = dict(zip(map(id, cj.jaxpr.eqns), costs.tolist()))
        cj = split_scan(cj, num_layers, scans=scans)
        # Only the equations split_scan made need a cost; the rest are the same objects.
        eqns = cj.jaxpr.eqns
        made = [e for e in eqns if id(e) not in known]
        known.update(zip(map(id, made), equation_costs(cj.jaxpr.replace(eqns=made), cost).tolist()))
        costs = np.asarray([known[id(e)] for e in eqns], dtype=np.int64)
        regions = _regions(cj.jaxpr, mirror_backward)
    return cj, costs, regions


def _warn_indivisible(
    eqns: Sequence[JaxprEqn], costs: np.ndarray, num_layers: int, divisible: set[int]
) -> None:
    """Warn, naming it, about an equation that costs more than a stage should and
    cannot be cut (``divisible``: the scans that will be): no cut can balance the
    stages then."""
    if num_layers < 2 or num_layers > costs.size:
        return  # one layer, or too few equations (an error follows)
    total = int(costs.sum())
    order = np.argsort(costs)[::-1]
    heaviest = next((int(i) for i in order if int(i) not in divisible), None)
    if heaviest is None or costs[heaviest] * num_layers <= total:
        return
    warnings.warn(
        f"{describe_eqn(eqns[heaviest], heaviest)} holds "
        f"{100 * costs[heaviest] / total:.0f} % of the cost to balance, more than 1/"
        f"{num_layers} of it, and auto_layers cannot cut inside it, so the stages cannot "
        "be balanced. Split it yourself (a lax.scan with at least as many iterations as "
        "stages is split automatically; a while loop, cond or a scan with fewer "
        "iterations is not), or ask for fewer stages.",
        PipemarkWarning,
        stacklevel=3,
    )


def _check_unmarked(jaxpr: Jaxpr) -> None:
    for index, eqn in enumerate(jaxpr.eqns):
        if is_marker(eqn, STAGE_MARK_TYPES):
            raise MarkerError(
                f"{describe_eqn(eqn, index)}: auto_layers inserts its own markers, but "
                "the program already has stage markers. Remove them first with "
                "pm.passes.remove_markers(cj), or slice the program at its own markers "
                "with pm.passes.slice_stages(cj)."
            )


class LayerPlan(NamedTuple):
    """What :func:`plan_layers` returns: the marked program and its balance."""

    program: ClosedJaxpr
    balance: LayerBalance


@jaxpr_pass
def plan_layers(
    cj: ClosedJaxpr,
    num_layers: int,
    cost: str | Callable[[JaxprEqn], float] = "flops",
    *,
    tolerance: float = 0.01,
    names: Sequence[str] | None = None,
    mirror_backward: bool = True,
    split_scans: bool = True,
    block_cuts: str = "prefer",
    block_tolerance: float = BLOCK_TOLERANCE,
) -> LayerPlan:
    """:func:`auto_layers`, also returning how balanced the cut is
    (:class:`LayerBalance`); the parameters are :func:`auto_layers`'s.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(layers, x):
    ...     for layer in layers:
    ...         x = jnp.tanh(x @ layer["w"] + layer["b"])
    ...     return x
    >>> layers = [{"w": jnp.ones((8, 8)), "b": jnp.ones(8)}] * 4
    >>> plan = plan_layers(jax.make_jaxpr(f)(layers, jnp.ones((2, 8))), 2)
    >>> print(plan.balance)  # doctest: +NORMALIZE_WHITESPACE
    2 forward layers, largest / mean cost 1.000 (0.0 % above the best cut anywhere);
    cuts between 4 blocks (parameters layers[0] … layers[3])
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)):
        raise PipemarkError(f"num_layers must be a positive int, got {num_layers!r}.")
    if num_layers < 1:
        raise PipemarkError(f"num_layers must be a positive int, got {num_layers!r}.")
    if not isinstance(tolerance, (int, float)) or tolerance < 0 or not math.isfinite(tolerance):
        raise PipemarkError(f"tolerance must be a finite number >= 0, got {tolerance!r}.")
    check_block_cuts(block_cuts, block_tolerance)
    _check_unmarked(cj.jaxpr)
    cj, costs, (split_at, stop, apply_at) = _prepare(
        cj, int(num_layers), cost, mirror_backward, split_scans
    )
    jaxpr = cj.jaxpr
    backward = split_at < stop
    what = "forward equations" if backward else "equations"
    if split_at < num_layers:
        raise PipemarkError(
            f"auto_layers: the program has {split_at} {what}, too few for "
            f"{num_layers} non-empty layers. Ask for at most {split_at} layers."
        )
    if backward and stop - split_at < num_layers:
        raise PipemarkError(
            f"auto_layers: the backward part has {stop - split_at} "
            f"equations, too few for {num_layers} mirrored layers. Ask for fewer "
            "layers, or pass mirror_backward=False."
        )
    forward_costs = costs[:split_at]
    if not forward_costs.any():
        label = cost if isinstance(cost, str) else "the cost function"
        raise PipemarkError(
            f"auto_layers: every one of the {split_at} {what} costs 0 under "
            f"cost={label!r}, so any split is as good as another. Balance another "
            "measure, e.g. cost='equations' or cost='bytes'."
        )
    if names is None:
        names = [f"layer{i}" for i in range(num_layers)]
    names = list(names)
    if len(names) != num_layers:
        raise PipemarkError(
            f"names has {len(names)} entries for {num_layers} layers; give one per layer."
        )
    # Found under "off" too: the balance reports whether the cuts fell between blocks.
    blocks = find_blocks(jaxpr, split_at)
    if blocks is None and block_cuts == "require":
        raise PipemarkError(
            "block_cuts='require', but auto_layers found no repeated blocks (name scopes "
            "or numbered parameter paths, see pipemark.passes.blocks). Name each block "
            "with jax.named_scope(f'block{i}'), or pass block_cuts='prefer'."
        )
    cuts, balance = _choose_cuts(
        forward_costs,
        int(num_layers),
        _cut_penalties(jaxpr.eqns, split_at, crossing_bytes(jaxpr, 0, split_at)),
        float(tolerance),
        blocks,
        (block_cuts, float(block_tolerance)),
    )
    if backward:
        mirrored = mirror_cuts(jaxpr, split_at, cuts, int(num_layers), stop=stop)
        cuts = [*cuts, split_at, *mirrored]
        names += [backward_name(name) if isinstance(name, str) else name for name in names[::-1]]
    if apply_at is not None:
        cuts, names = [*cuts, apply_at], [*names, APPLY_STAGE]
    return LayerPlan(insert_markers(cj, cuts, names), balance)


@jaxpr_pass
def auto_layers(
    cj: ClosedJaxpr,
    num_layers: int,
    cost: str | Callable[[JaxprEqn], float] = "flops",
    *,
    tolerance: float = 0.01,
    names: Sequence[str] | None = None,
    mirror_backward: bool = True,
    split_scans: bool = True,
    block_cuts: str = "prefer",
    block_tolerance: float = BLOCK_TOLERANCE,
) -> ClosedJaxpr:
    """Insert start/end markers that cut ``cj`` into ``num_layers`` balanced layers.

    Parameters
    ----------
    cj:
        An unmarked program (``jax.make_jaxpr(f)(...)``), forward only or a
        ``value_and_grad``/``grad`` program.
    num_layers:
        How many forward layers to make.
    cost:
        What to balance: ``"flops"`` (default), ``"bytes"``, ``"equations"``, ``"xla"``
        or a function of one equation (see :func:`equation_costs`).
    tolerance:
        The largest layer may cost up to ``(1 + tolerance)`` times the smallest
        possible largest layer, if that lets the cuts move to where fewer bytes cross
        (on a transformer: between blocks rather than inside one). ``0`` gives a
        bottleneck-optimal split, ties broken by crossing bytes.
    names:
        ``num_layers`` names for the forward layers; default ``layer0``, ``layer1``, ….
    mirror_backward:
        For a program with a backward pass (equations JAX made by transposition): cut
        only the forward part into balanced layers and cut the backward part into
        mirrored stages ``<name>_backward`` (in reverse order). With ``False`` every
        equation is balanced as one forward sequence.
    split_scans:
        First cut every heavy top-level ``lax.scan`` (a scan over layers, and its
        mirror in the backward pass) into ``num_layers`` chunks with
        :func:`pipemark.passes.split_scan`, so the layers can cut between them.
    block_cuts:
        Where cuts may fall when the model has repeated blocks (found from name scopes
        and numbered parameter paths by :func:`pipemark.passes.blocks.find_blocks`):
        ``"prefer"`` (default): between blocks, if the largest layer then costs at
        most ``1 + block_tolerance`` times the best cut anywhere, else anywhere;
        ``"require"``: between blocks whatever the balance; ``"off"``: anywhere.
    block_tolerance:
        How much balance ``"prefer"`` gives up for cuts between blocks; default
        :data:`BLOCK_TOLERANCE` (0.15; why, in ``docs/auto.md``).

    Returns
    -------
    ClosedJaxpr
        The program with markers inserted by :func:`pipemark.passes.insert_markers`.

    Warns
    -----
    PipemarkWarning
        When one equation costs more than ``1/num_layers`` of what is balanced (a while
        loop, say): no cut can balance the layers then. The message names it.

    Raises
    ------
    PipemarkError
        For an unknown cost, more layers than equations, a program whose every
        equation costs 0 under ``cost`` (pick another ``cost``), an unknown
        ``block_cuts``, or ``block_cuts="require"`` without blocks to cut between.
    MarkerError
        If the program already has stage markers.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x, w):
    ...     for _ in range(4):
    ...         x = jnp.tanh(x @ w)
    ...     return x
    >>> cj = jax.make_jaxpr(f)(jnp.ones((2, 8)), jnp.ones((8, 8)))
    >>> [e.primitive.name for e in cj.eqns][:4]
    ['dot_general', 'tanh', 'dot_general', 'tanh']
    >>> marked = pm.passes.auto_layers(cj, 2)
    >>> [(e.params["name"], e.params["mark_type"]) for e in marked.eqns
    ...  if e.primitive is pm.pipeline_p]  # doctest: +NORMALIZE_WHITESPACE
    [('layer0', 'start'), ('layer0', 'end'), ('layer1', 'start'), ('layer1', 'end')]
    >>> [e.primitive.name for e in marked.eqns][:6]
    ['pipeline_marker', 'dot_general', 'tanh', 'dot_general', 'tanh', 'pipeline_marker']
    """
    return plan_layers(
        cj,
        num_layers,
        cost,
        tolerance=tolerance,
        names=names,
        mirror_backward=mirror_backward,
        split_scans=split_scans,
        block_cuts=block_cuts,
        block_tolerance=block_tolerance,
    ).program
