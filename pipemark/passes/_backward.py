"""The backward part of a gradient program, and how to cut it in mirror of the forward.

``jax.grad`` makes the backward pass by transposing the forward one, and JAX records
that in each equation's name stack. :func:`forward_end` finds where the backward pass
begins; :func:`mirror_cuts` cuts it into stages that mirror given forward layers (the
last forward layer's mirror first), keeping each backward equation next to the forward
values it reads. :func:`pipemark.passes.auto_layers` and
:func:`pipemark.passes.layers_from_boundaries` both use it, so a program cut either way
gets the ``<name>_backward`` stages that ``jax.grad`` gives a hand-marked function.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from pipemark._compat import name_stack_scopes
from pipemark.cost import nbytes

__all__ = ["crossing_bytes", "forward_end", "mirror_cuts"]

# Largest (equations x stages) gap that mirror_cuts places by a dynamic program.
_DENSE_LIMIT = 4_000_000


def crossing_bytes(
    program: ClosedJaxpr | Jaxpr, start: int = 0, stop: int | None = None
) -> np.ndarray:
    """Bytes that a cut before each equation of ``eqns[start:stop]`` would move.

    Entry ``i`` (for ``0 <= i <= stop - start``) is the total size of the values made
    by equations ``start .. start+i-1`` and read by equations ``start+i .. stop-1``.
    Program inputs and constants are not counted (every stage can read them), nor are
    reads after ``stop``. Linear in the number of equations.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)) + x)(jnp.ones(8))
    >>> crossing_bytes(cj)
    array([ 0, 32, 32,  0])
    """
    jaxpr = program.jaxpr if isinstance(program, ClosedJaxpr) else program
    eqns = jaxpr.eqns
    stop = len(eqns) if stop is None else stop
    count = stop - start
    defined: dict[Var, int] = {}
    last_use: dict[Var, int] = {}
    for i in range(count):
        eqn = eqns[start + i]
        for v in eqn.invars:
            if isinstance(v, Var) and v in defined:
                last_use[v] = i
        for v in eqn.outvars:
            defined[v] = i
    return _cumulative_crossing(defined, last_use, count)


def _cumulative_crossing(
    defined: dict[Var, int], last_use: dict[Var, int], count: int
) -> np.ndarray:
    """crossing_bytes from the equation defining each value and its last reader (both
    relative to the first equation counted)."""
    delta = [0] * (count + 2)
    for v, use in last_use.items():
        size = nbytes(v.aval)
        delta[defined[v] + 1] += size
        delta[use + 1] -= size
    totals = list(itertools.accumulate(delta[: count + 1]))  # exact Python ints
    if max(map(abs, totals), default=0) > _INT64_MAX:
        # Arrays of more than 2**63 bytes (abstract, never allocated): compared
        # approximately, which is all a cut's position needs.
        return np.array(totals, dtype=np.float64)
    return np.array(totals, dtype=np.int64)


_INT64_MAX = int(np.iinfo(np.int64).max)


def mirror_cuts(
    jaxpr: Jaxpr,
    forward_end: int,
    forward_cuts: list[int],
    layers: int,
    stop: int | None = None,
) -> list[int]:
    """Cut the backward part ``eqns[forward_end:stop]`` into ``layers`` stages,
    mirroring forward layers ``layers-1 .. 0``; returns absolute equation indices where
    backward stages 2, 3, … begin. ``stop`` (default: the end of the program) leaves
    out a tail that is not part of the backward pass, such as the optimizer update
    after a ``grad`` marker.

    Every stage gets at least one equation (the caller makes sure the backward part has
    ``layers`` of them). Each backward equation stays with the forward layer holding the
    values it reads where possible, and the cuts move few bytes.

    Each backward equation that reads forward values has an *anchor*: the forward layer
    holding the most bytes of what it reads (none when several layers tie). In a gradient
    program the anchors descend layer by layer almost everywhere, so the heaviest
    non-increasing subsequence of them (leaving out, say, an equation that reads a
    program input of layer 0 in the middle of layer 5's backward) gives each layer a
    run of equations that goes to its mirror. Each cut is then placed in the gap
    between two such runs where it costs least: the bytes crossing the cut plus the
    bytes the equations of the gap read from a forward layer other than their mirror.
    Time ``O(n log layers)`` for ``n`` equations when the anchors descend (as
    ``jax.grad`` makes them), memory ``O(n)``.
    """
    eqns = jaxpr.eqns if stop is None else jaxpr.eqns[:stop]
    count = len(eqns) - forward_end
    holders = _holders(eqns, [0, *forward_cuts, forward_end], layers)
    reads = _BackwardReads(eqns, forward_end, holders)
    # runs[s]: first and last position of the chosen anchors of backward stage s, which
    # mirrors forward layer layers-1-s; None when no anchor was chosen for it.
    runs: list[tuple[int, int] | None] = [None] * layers
    for i in _heaviest_descent(reads.anchors, reads.weights):
        s = layers - 1 - reads.anchors[i]
        run = runs[s]
        b = reads.positions[i]
        runs[s] = (b, b) if run is None else (min(run[0], b), max(run[1], b))
    cut_bytes = _cumulative_crossing(reads.defined, reads.last_use, count)
    starts = _stage_starts(runs, reads.gains, cut_bytes, count)
    return [forward_end + c for c in starts[1:layers]]


def _holders(eqns: list, bounds: list[int], layers: int) -> dict[Var, list[int]]:
    """Which forward layers hold each value, in increasing order: the layer that makes
    it and every layer that reads it. Program inputs belong to the layers reading them."""
    holders: dict[Var, list[int]] = {}
    holders_get = holders.get
    for layer in range(layers):
        for eqn in eqns[bounds[layer] : bounds[layer + 1]]:
            for v in eqn.invars:
                if type(v) is Literal:
                    continue
                held = holders_get(v)
                if held is None:
                    holders[v] = [layer]
                elif held[-1] != layer:
                    held.append(layer)
            for v in eqn.outvars:
                holders[v] = [layer]
    return holders


class _BackwardReads:
    """One sweep over the backward equations. ``gains[b]``: the bytes backward
    equation ``b`` reads from each forward layer (``None`` when it reads no forward
    value); ``positions``, ``anchors``, ``weights``: each equation with a single
    heaviest layer, that layer and its bytes; ``defined``, ``last_use``: what
    :func:`crossing_bytes` counts over the backward part (the backward equation
    defining each backward value, and its last backward reader)."""

    def __init__(self, eqns: list, forward_end: int, holders: dict[Var, list[int]]) -> None:
        count = len(eqns) - forward_end
        self.gains: list[dict[int, int] | None] = [None] * count
        self.positions: list[int] = []
        self.anchors: list[int] = []
        self.weights: list[int] = []
        self.defined: dict[Var, int] = {}
        self.last_use: dict[Var, int] = {}
        holders_get, defined, defined_get = holders.get, self.defined, self.defined.get
        last_use = self.last_use
        size_of: dict[Var, int] = {}
        for b, eqn in enumerate(eqns[forward_end:]):
            gain: dict[int, int] | None = None
            counted: set[Var] | None = None
            for v in eqn.invars:
                if type(v) is Literal:
                    continue
                held = holders_get(v)
                if held is None:
                    if defined_get(v) is not None:
                        last_use[v] = b
                    continue
                if gain is None:
                    gain = {}
                    counted = {v}
                elif v in counted:  # type: ignore[operator]
                    continue  # a value read twice counts once
                else:
                    counted.add(v)  # type: ignore[union-attr]
                size = size_of.get(v)
                if size is None:
                    size = size_of[v] = nbytes(v.aval)
                for layer in held:
                    gain[layer] = gain.get(layer, 0) + size
            for v in eqn.outvars:
                defined[v] = b
            if gain is not None:
                self.gains[b] = gain
                self.anchor(b, gain)

    def anchor(self, b: int, gain: dict[int, int]) -> None:
        best_layer = best_bytes = -1
        tied = False
        for layer, size_read in gain.items():
            if size_read > best_bytes:
                best_layer, best_bytes, tied = layer, size_read, False
            elif size_read == best_bytes:
                tied = True
        if tied:
            # Equally at home in several layers (say, it reads an activation that one
            # layer makes and the next reads): the cut placement decides.
            return
        self.positions.append(b)
        self.anchors.append(best_layer)
        self.weights.append(best_bytes + 1)  # + 1: a read of a token still counts a little


def _stage_starts(
    runs: list[tuple[int, int] | None], gains: list, cut_bytes: np.ndarray, count: int
) -> list[int]:
    """Where each backward stage begins (relative to the backward part; one more entry,
    ``count``): the cuts placed in the gaps between the stages' runs."""
    layers = len(runs)
    starts = [0] * (layers + 1)
    starts[layers] = count
    previous, previous_last = 0, -1
    if runs[0] is None:
        # Stage 0 has no anchor; it still needs an equation.
        present = [s for s in range(layers) if runs[s] is not None]
        first_present = present[0] if present else layers
        high = count if first_present == layers else runs[first_present][0]  # type: ignore[index]
        _place_cuts(
            starts,
            0,
            min(first_present, layers - 1),
            0,
            high,
            True,
            first_present == layers,
            gains,
            cut_bytes,
            layers,
        )
        previous = first_present
        previous_last = -1 if first_present == layers else runs[first_present][1]  # type: ignore[index]
    else:
        previous_last = runs[0][1]
    for s in range(previous + 1, layers):
        run = runs[s]
        if run is None and s < layers - 1:
            continue
        last_stage = s
        if run is None:
            high, last_nonempty = count, True
        else:
            high, last_nonempty = run[0], False
        _place_cuts(
            starts,
            previous,
            last_stage,
            previous_last + 1,
            high,
            False,
            last_nonempty,
            gains,
            cut_bytes,
            layers,
        )
        if run is not None:
            previous, previous_last = s, run[1]
    # Every stage non-empty, should a gap have been too short for the stages in it.
    for s in range(1, layers):
        starts[s] = max(starts[s], starts[s - 1] + 1)
    for s in range(layers - 1, 0, -1):
        starts[s] = min(starts[s], starts[s + 1] - 1)
    return starts


def _heaviest_descent(layers: list[int], weights: list[int]) -> list[int]:
    """Indices of a heaviest subsequence of ``layers`` that never increases.

    A frontier of the best subsequences found so far, one per last layer, keeps only
    those that no other beats (ends at a later layer with at least the weight): sorted
    by decreasing last layer, their weights increase. Each element looks up the best
    subsequence it can extend by bisection; when layers descend, the frontier changes
    at its end only.
    """
    keys: list[int] = []  # minus the last layer, increasing
    totals: list[int] = []  # increasing
    ends: list[int] = []  # index of the subsequence's last element
    previous = [-1] * len(layers)
    for i, (layer, weight) in enumerate(zip(layers, weights)):
        key = -layer
        # The best subsequence ending at a layer >= this one.
        at = bisect.bisect_right(keys, key) - 1
        total = weight
        if at >= 0:
            total += totals[at]
            previous[i] = ends[at]
        # Drop what the new subsequence beats: ends at this layer or an earlier one,
        # with no more weight.
        start = at + 1
        while start > 0 and keys[start - 1] == key:
            start -= 1
        stop = at + 1
        while stop < len(keys) and totals[stop] <= total:
            stop += 1
        keys[start:stop] = [key]
        totals[start:stop] = [total]
        ends[start:stop] = [i]
    chosen = []
    i = ends[-1] if ends else -1
    while i >= 0:
        chosen.append(i)
        i = previous[i]
    return chosen[::-1]


def _place_cuts(
    starts: list[int],
    first_stage: int,
    last_stage: int,
    low: int,
    high: int,
    first_nonempty: bool,
    last_nonempty: bool,
    gains: list[dict[int, int] | None],
    cut_bytes: np.ndarray,
    layers: int,
) -> None:
    """Set ``starts[first_stage+1 .. last_stage]``, the cuts between stages
    ``first_stage .. last_stage`` that share backward equations ``low .. high-1``,
    minimising the bytes crossing the cuts minus the bytes each equation reads from its
    stage's mirror. ``first_nonempty``/``last_nonempty``: the first/last stage needs an
    equation in this gap (it has no anchor elsewhere). Ties go to later cuts."""
    cuts = last_stage - first_stage
    if cuts <= 0:
        return
    lowest = low + first_nonempty
    highest = high - last_nonempty
    if highest - lowest + 1 < cuts:
        # Too short: the caller's final sweep makes the stages non-empty.
        for j in range(1, cuts + 1):
            starts[first_stage + j] = lowest + j - 1
        return
    n = high - low
    if n * cuts > _DENSE_LIMIT:
        # Many stages without anchors share a long gap (a backward part that reads
        # hardly any forward value): the dynamic program below would be O(n * stages),
        # so split the gap evenly instead.
        span = highest - lowest + 1
        for j in range(1, cuts + 1):
            starts[first_stage + j] = lowest + (j - 1) * span // cuts
        return
    if cuts == 1:
        starts[first_stage + 1] = _one_cut(
            low, lowest, highest, high, layers - 1 - first_stage, gains, cut_bytes
        )
        return
    # Several stages share the gap: a dynamic program over it, O(n * stages).
    ends = _cuts_by_dynamic_program(
        low, high, first_stage, cuts, (first_nonempty, last_nonempty), gains, cut_bytes, layers
    )
    for j, end in enumerate(ends, start=1):
        starts[first_stage + j] = low + end


def _one_cut(
    low: int,
    lowest: int,
    highest: int,
    high: int,
    layer_a: int,
    gains: list[dict[int, int] | None],
    cut_bytes: np.ndarray,
) -> int:
    """The one cut between the stages mirroring layers ``layer_a`` and ``layer_a - 1``
    in ``lowest .. highest`` (the gap runs from ``low`` to ``high``); ties go later."""
    layer_b = layer_a - 1
    # cost(x) = cut_bytes[x] - sum_{e<x} gain_a[e] - sum_{e>=x} gain_b[e]
    #         = cut_bytes[x] - total_b - sum_{e<x} (gain_a[e] - gain_b[e])
    running = 0
    best_cost = None
    best_cut = lowest
    for x in range(low, highest + 1):
        if x >= lowest:
            cost = int(cut_bytes[x]) - running
            if best_cost is None or cost <= best_cost:
                best_cost, best_cut = cost, x
        if x < high:
            gain = gains[x]
            if gain is not None:
                running += gain.get(layer_a, 0) - gain.get(layer_b, 0)
    return best_cut


def _cuts_by_dynamic_program(
    low: int,
    high: int,
    first_stage: int,
    cuts: int,
    nonempty: tuple[bool, bool],
    gains: list[dict[int, int] | None],
    cut_bytes: np.ndarray,
    layers: int,
) -> list[int]:
    """The ``cuts`` cuts (relative to ``low``) between stages ``first_stage ..
    first_stage + cuts`` sharing the gap ``low .. high-1``, by a dynamic program."""
    first_nonempty, last_nonempty = nonempty
    n = high - low
    index = np.arange(n + 1)
    crossing = cut_bytes[low : high + 1].astype(np.float64)

    def prefix(stage: int) -> np.ndarray:
        layer = layers - 1 - stage
        column = np.fromiter(
            ((g.get(layer, 0) if g is not None else 0) for g in gains[low:high]),
            dtype=np.float64,
            count=n,
        )
        return np.concatenate(([0.0], np.cumsum(column)))

    inf = np.inf
    # best[x]: least cost of the equations before x, with the current stage starting at x.
    gained = prefix(first_stage)
    best = np.full(n + 1, inf)
    best[0] = 0.0
    choices = []
    for j in range(1, cuts + 1):
        # Cost of the equations before x when stage j-1 starts at y and runs to x - 1.
        candidate = best + gained
        running = np.minimum.accumulate(candidate)
        argmin = np.maximum.accumulate(np.where(candidate == running, index, 0))
        new_best = np.full(n + 1, inf)
        shift = 1 if (j > 1 or first_nonempty) else 0
        new_best[shift:] = running[: n + 1 - shift]
        choice = np.full(n + 1, -1)
        choice[shift:] = argmin[: n + 1 - shift]
        new_best = new_best + crossing - gained
        if j == cuts and last_nonempty:
            new_best[n] = inf
        choices.append(choice)
        best = new_best
        gained = prefix(first_stage + j)
    # The last stage runs from its start to the end of the gap and gains what it reads.
    final = best + gained - gained[n]
    end = int(np.flatnonzero(final == final.min())[-1])
    ends = [0] * cuts
    for j in range(cuts, 0, -1):
        ends[j - 1] = end
        end = int(choices[j - 1][end])
    return ends


def forward_end(jaxpr: Jaxpr) -> int | None:
    """Index of the first equation JAX made by transposition (the backward pass)."""
    # Consecutive equations often share one name stack object: look at each once.
    previous = None
    for index, eqn in enumerate(jaxpr.eqns):
        source_info = eqn.source_info
        stack = getattr(source_info, "name_stack", None)
        if stack is previous and stack is not None:
            continue
        previous = stack
        _, transforms = name_stack_scopes(source_info)
        if "transpose" in transforms:
            return index
    return None
