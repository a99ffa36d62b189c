"""Checking a staged program against JAX's own evaluation of the user's function.

:meth:`pipemark.StagedJaxpr.verify` runs the staged program and compares each result
with the reference as JAX evaluates it: compiled (``jax.jit(fn)``) and eagerly (``fn``
called as it is, its jitted helpers compiled, the rest op by op). The reference is never
a program that a pipemark pass has rewritten, so a fault in the passes cannot hide in
the reference too.

**Tolerance.** A staged program runs equation by equation, while ``jax.jit`` lets XLA
fuse and reorder arithmetic, so floating-point results agree to rounding, not bit for
bit, and the rounding is that of the narrowest floating type a result's computation
passes through: a float32 gradient of a model that casts to bfloat16 before each matmul
carries bfloat16 rounding, and so does a float32 matmul on a TPU at ``DEFAULT``
precision (one bfloat16 pass). ``verify`` finds that type per result in the
reference's own trace (:func:`pipemark.precision.result_compute_types`). By default a
floating-point result passes when every element satisfies
``|got - want| <= rtol * |want| + atol`` with ``rtol`` from :data:`DEFAULT_RTOL` for
that type and ``atol = max(rtol * max|want|, floor)``, the floor from
:data:`DEFAULT_ATOL_FLOOR` (elements near zero are judged at the scale of the result's
largest magnitude, or of rounding noise, as rounding errors are). Integer and
boolean results must be equal. Pass ``rtol=0, atol=0`` to demand bit equality, or other
numbers to set the tolerance for every result.

**Spread.** Compared against both ``jax.jit`` and eager evaluation, the report also
measures how far those two differ from each other per result (largest difference over
largest magnitude): the rounding noise JAX itself shows. A correct staged program is
about as close to each reference as they are to each other; a wrong one differs by many
times that spread. Where the two references differ by more than a result's default
tolerance allows (rounding that moves values across a ReLU's kink, say), the result
is judged at :data:`SPREAD_FACTOR` times their difference. ``print(report)`` shows,
per result, the tolerance, which type set it and why, and the spread::

    passed: 30 comparisons against jit and eager, within rtol 1e-05, 0.03 (atol ...)
    jit-eager spread (largest difference / largest magnitude, per result): up to ...
    result  reference  type  largest diff  rtol  atol  mismatched  jit-eager spread  tolerance from
    ...
    tolerance from the narrowest floating type each result's computation passes through:
      results 0, 2-13: bfloat16: made by equation 27 (convert_element_type, model.py:31:12 (matmul))
      results 1, 14: float32: the result's own type; nothing narrower on its path

>>> import numpy as np
>>> report = compare_results(
...     [np.float32([1.0, 2.0])],
...     {"jit": [np.float32([1.0, 2.0000002])], "eager": [np.float32([1.0, 2.0])]},
...     ["result 0"],
... )
>>> report.passed, report.exact
(True, False)
>>> f"{report.largest_difference:.3g}", f"{report.checks[0].spread:.3g}"
('2.38e-07', '2.38e-07')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# VerificationError is defined with the other errors; it is imported from here too.
from pipemark.errors import PipemarkError, VerificationError

__all__ = [
    "DEFAULT_ATOL_FLOOR",
    "DEFAULT_RTOL",
    "REFERENCE_KINDS",
    "ResultCheck",
    "SPREAD_FACTOR",
    "VerifyReport",
    "compare_results",
    "evaluate_reference",
    "raise_on_mismatch",
]

#: The default relative tolerance per floating type (by name), the narrowest type a
#: result's computation passes through (TensorFloat-32: a GPU matmul's). float32: a few
#: hundred units in the last place, wide enough for reordered sums over a model's
#: reductions and narrow enough for any wrong value seen so far (those differ by > 1e-3).
#: bfloat16 (8 significand bits, eps 2^-7 = 7.8e-3): a model that rounds its matmul
#: operands to bfloat16 shows jit and eager results that differ by up to 0.8 % (two
#: blocks, CPU) and 1.4 % (TPU) of a result's largest magnitude, about two eps; 3e-2,
#: with ``atol`` that times the largest magnitude, leaves twice that, while one block's
#: weights wrong by 10 % move its gradients by 7-30 %. float16 and TensorFloat-32 (11
#: significand bits, eps 9.8e-4): the same margin over eight times less rounding.
DEFAULT_RTOL: dict[str, float] = {
    "float64": 1e-10,
    "complex128": 1e-10,
    "float32": 1e-5,
    "complex64": 1e-5,
    "tensorfloat32": 5e-3,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}
# The float8 types (3 or 4 significand bits, eps 2^-3 or 2^-2): two units of float8_e4m3.
_FALLBACK_RTOL = 2.5e-1

#: The least absolute tolerance per type: a value that is zero in exact arithmetic (a
#: gradient that cancels) comes out as rounding noise of the size of the terms it was
#: computed from, whatever the result's own magnitude. float64 and float32: JAX's own
#: test tolerances. bfloat16, float16: a tenth of JAX's (1e-2, 1e-3), which are meant
#: for values about 1: a model's gradients are often 1e-2 to 1e-1, where a floor of
#: 1e-2 would pass a wrong result outright. 1e-3 still covers cancellation noise: the
#: gradient of an attention layer's key bias, zero in exact arithmetic, comes out as
#: about 1e-4 in a bfloat16-compute model whose other gradients are about 0.1.
DEFAULT_ATOL_FLOOR: dict[str, float] = {
    "float64": 1e-15,
    "complex128": 1e-15,
    "float32": 1e-6,
    "complex64": 1e-6,
    "tensorfloat32": 1e-4,
    "float16": 1e-4,
    "bfloat16": 1e-3,
}
_FALLBACK_ATOL_FLOOR = 1e-2  # float8

#: With default tolerances and both references evaluated, a result whose references
#: differ from each other by more than its tolerance allows is judged at this many
#: times their difference instead: rounding is that large there (in a bfloat16 model
#: with ReLUs, rounding moves values across the kink, and jit and eager gradients differ
#: by up to 10 % of their largest magnitude), and a staged program cannot be held
#: closer to either reference than the two are to each other. A wrong program differs
#: by many times the spread (one block's weights off by 10 %: 3.5 to 90 times, on every
#: gradient it changes).
SPREAD_FACTOR: float = 2.0

#: How :func:`evaluate_reference` can evaluate a reference: ``"jit"`` compiles it with
#: ``jax.jit``; ``"eager"`` calls it as it is.
REFERENCE_KINDS: tuple[str, ...] = ("jit", "eager")


class ComputeTypeLike(Protocol):
    """What :func:`compare_results` reads of a result's compute type (a
    :class:`pipemark.precision.ComputeType`): the type's name and why."""

    dtype: str

    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class ResultCheck:
    """One result compared with one reference evaluation.

    ``tolerance_from`` names the type whose default tolerance was used (the narrowest
    floating type the result's computation passes through) and ``reason`` says why;
    both are empty where the caller gave the tolerance or the result is no float.
    ``scale`` is the reference's largest magnitude; ``spread`` the largest difference
    between the two references (``jax.jit`` and eager) for this result, None when only
    one was evaluated; ``widened`` whether the default ``atol`` was raised to
    :data:`SPREAD_FACTOR` times that spread.
    """

    index: int
    where: str
    reference: str
    dtype: str
    shape: tuple[int, ...]
    rtol: float
    atol: float
    largest_difference: float  # largest |got - want| (NaN in the same place counts 0)
    mismatched: int  # elements outside the tolerance
    size: int
    tolerance_from: str = ""
    reason: str = ""
    scale: float = 0.0
    spread: float | None = None
    widened: bool = False  # atol raised to SPREAD_FACTOR x spread

    @property
    def passed(self) -> bool:
        return self.mismatched == 0

    @property
    def relative_difference(self) -> float:
        """The largest difference over the reference's largest magnitude."""
        return _relative(self.largest_difference, self.scale)

    @property
    def relative_spread(self) -> float | None:
        """The jit-eager spread over the reference's largest magnitude."""
        return None if self.spread is None else _relative(self.spread, self.scale)


def _relative(difference: float, scale: float) -> float:
    if difference == 0:
        return 0.0
    return difference / scale if scale > 0 else float("inf")


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`pipemark.StagedJaxpr.verify` compared and how far apart it found
    the results. ``str(report)`` is a table of every result against every reference,
    the jit-eager spread and where each result's tolerance comes from.

    ``spread_between`` names the two references whose spread was measured (empty when
    only one was evaluated).
    """

    references: tuple[str, ...]
    exact: bool  # bit for bit (rtol = atol = 0) for every result
    checks: tuple[ResultCheck, ...]
    spread_between: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def largest_difference(self) -> float:
        return max((check.largest_difference for check in self.checks), default=0.0)

    @property
    def largest_relative_spread(self) -> float | None:
        """The largest jit-eager spread over a result's largest magnitude (None when
        not measured)."""
        spreads = [c.relative_spread for c in self.checks if c.relative_spread is not None]
        return max(spreads, default=None) if self.spread_between else None

    @property
    def comparison(self) -> str:
        """How results were compared, in words."""
        if self.exact:
            return "bit for bit"
        rtols = sorted({_number(c.rtol) for c in self.checks if c.rtol or c.atol}, key=float)
        return f"within rtol {', '.join(rtols) or '0'}"

    def spread_summary(self) -> str:
        """One line: how far the two references differ from each other and how far the
        staged program differs from them, each as the largest difference over a
        result's largest magnitude."""
        floats = [c for c in self.checks if _is_float_name(c.dtype)]
        if not self.spread_between:
            return (
                f"jit-eager spread: not measured (compared against {' and '.join(self.references)}"
                " only; against=('jit', 'eager') measures it)"
            )
        a, b = self.spread_between
        spread = max(floats, key=lambda c: c.relative_spread or 0.0, default=None)
        worst = max(floats, key=lambda c: c.relative_difference, default=None)
        if spread is None or worst is None:
            return f"{a}-{b} spread: no floating-point results"
        text = (
            f"{a}-{b} spread (largest difference / largest magnitude, per result): up to "
            f"{_percent(spread.relative_spread)} (result {spread.index}); staged program "
            f"vs the references: up to {_percent(worst.relative_difference)} (result "
            f"{worst.index}"
        )
        if worst.spread:
            text += f", {worst.largest_difference / worst.spread:.2g}x its spread"
        text += ")"
        return text

    def __str__(self) -> str:
        head = (
            f"{'passed' if self.passed else 'FAILED'}: {len(self.checks)} comparisons "
            f"against {' and '.join(self.references)}, {self.comparison}"
            f"{'' if self.exact else ' (atol per result below)'}; largest "
            f"difference {_number(self.largest_difference)}"
        )
        spread_column = f"{'-'.join(self.spread_between) or 'jit-eager'} spread"
        header = ("result", "reference", "type", "largest diff", "rtol", "atol", "mismatched")
        rows = [(*header, spread_column, "tolerance from")]
        for c in self.checks:
            shape = ",".join(map(str, c.shape))
            rows.append(
                (
                    f"{c.index} ({c.where})",
                    c.reference,
                    f"{c.dtype}[{shape}]",
                    _number(c.largest_difference),
                    _number(c.rtol),
                    _number(c.atol),
                    f"{c.mismatched} of {c.size}",
                    "-" if c.spread is None else _number(c.spread),
                    _tolerance_source(c, self.exact),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([head, self.spread_summary(), *lines, *self._reasons()])

    def _reasons(self) -> list[str]:
        """Why each result got its tolerance, results with the same reason together."""
        by_reason: dict[str, dict[int, None]] = {}  # reason -> result indices, in order
        for c in self.checks:
            if c.reason:
                by_reason.setdefault(c.reason, {})[c.index] = None
        if not by_reason:
            return []
        lines = [
            "tolerance from the narrowest floating type each result's computation passes through:"
        ]
        for reason, indices in by_reason.items():
            lines.append(f"  {_index_ranges(list(indices))}: {reason}")
        return lines


_INEXACT = ("float", "bfloat", "complex")


def _tolerance_source(check: ResultCheck, exact: bool) -> str:
    if not check.tolerance_from:
        return "given" if check.rtol or check.atol or exact else "-"
    return check.tolerance_from + (f", {SPREAD_FACTOR:g}x spread" if check.widened else "")


def _number(value: float) -> str:
    """A plain number (never ``np.float64(...)``)."""
    return f"{float(value):.6g}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100.0 * fraction:.3g} %"


def _index_ranges(indices: Sequence[int]) -> str:
    """``results 0-3, 7`` (``result 2`` for one)."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"result {text}" if len(indices) == 1 else f"results {text}"


def evaluate_reference(fn: Callable[..., Sequence[Any]], inputs: Sequence[Any], kind: str):
    """``fn(*inputs)`` as JAX evaluates it: compiled with ``jax.jit`` (``"jit"``) or
    called as it is (``"eager"``); a list of its flat results."""
    import jax  # here: the module's doctest and report need no JAX

    if kind == "jit":
        return list(jax.jit(fn)(*inputs))
    if kind == "eager":
        # As arrays: a Python number the function returns is what JAX would make of it.
        return [jax.numpy.asarray(value) for value in fn(*inputs)]
    raise PipemarkError(
        f"verify: unknown reference evaluation {kind!r}; choose from {REFERENCE_KINDS}."
    )


def _tolerance(
    want: np.ndarray, rtol: float | None, atol: float | None, type_name: str
) -> tuple[float, float]:
    if rtol is not None or atol is not None:
        return float(rtol or 0.0), float(atol or 0.0)
    if want.dtype.kind not in "fc" and not type_name:
        return 0.0, 0.0
    rtol = DEFAULT_RTOL.get(type_name, _FALLBACK_RTOL)
    floor = DEFAULT_ATOL_FLOOR.get(type_name, _FALLBACK_ATOL_FLOOR)
    return rtol, max(rtol * _scale(want), floor)


def _scale(want: np.ndarray) -> float:
    """The largest finite magnitude (0 for none)."""
    if not want.size or not (_is_float(want) or want.dtype.kind in "iu"):
        return 0.0
    values = want.astype(np.complex128 if want.dtype.kind == "c" else np.float64)
    finite = np.abs(values[np.isfinite(values)])
    return float(np.max(finite)) if finite.size else 0.0


def _is_float(array: np.ndarray) -> bool:
    """float and complex arrays, bfloat16 and the float8 types (numpy kind ``V``) too."""
    return array.dtype.kind in "fc" or array.dtype.name.startswith(_INEXACT)


def _difference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``|a - b|`` elementwise (float64) and where the two agree by kind: NaN in both,
    or the same infinity (those differences count 0)."""
    if not _is_float(b):
        if a.dtype.kind == "V":
            return np.zeros(a.shape), a == b
        return np.abs(a.astype(np.float64) - b.astype(np.float64)), a == b
    wide = np.complex128 if b.dtype.kind == "c" else np.float64
    a64, b64 = a.astype(wide), b.astype(wide)
    with np.errstate(invalid="ignore"):  # inf - inf
        diff = np.abs(a64 - b64)
    agree = (np.isnan(a64) & np.isnan(b64)) | (np.isinf(a64) & (a64 == b64))
    return np.where(agree, 0.0, diff), agree


def _check(index, where, reference, got, want, rtol, atol, compute_type, spread):
    a, b = np.asarray(got), np.asarray(want)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise VerificationError(
            f"Result {index} ({where}) is {a.dtype}{list(a.shape)}, the reference's "
            f"({reference}) is {b.dtype}{list(b.shape)}.",
            VerifyReport((reference,), False, ()),
        )
    defaults = rtol is None and atol is None and _is_float(b)
    type_name = ""
    if defaults:
        type_name = compute_type.dtype if compute_type is not None else _own_type(b)
    rtol, atol = _tolerance(b, rtol, atol, type_name)
    # Where JAX's own two evaluations differ by more, rounding does: the result is
    # judged at that scale (an activation's kink that rounding moves, say).
    widened = defaults and spread is not None and SPREAD_FACTOR * spread > atol
    if widened:
        atol = SPREAD_FACTOR * spread
    diff, agree = _difference(a, b)
    if _is_float(b):
        with np.errstate(invalid="ignore"):
            bad = ~((diff <= atol + rtol * np.abs(b.astype(diff.dtype))) | agree)
    else:
        bad = ~agree
    largest = float(np.nanmax(diff)) if np.size(diff) else 0.0
    reason = compute_type.reason if defaults and compute_type is not None else ""
    return ResultCheck(
        index, where, reference, a.dtype.name, a.shape, rtol, atol, largest,
        int(np.sum(bad)), int(a.size), type_name, reason, _scale(b), spread, widened,
    )  # fmt: skip


def _own_type(want: np.ndarray) -> str:
    return {"complex64": "float32", "complex128": "float64"}.get(want.dtype.name, want.dtype.name)


def _spreads(wants: Mapping[str, Sequence[Any]], count: int) -> list[float | None]:
    """Per result, the largest difference between the first two references."""
    if len(wants) < 2:
        return [None] * count
    first, second = list(wants.values())[:2]
    spreads: list[float | None] = []
    for a, b in zip(first, second):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            spreads.append(None)
            continue
        diff, _ = _difference(a, b)
        spreads.append(float(np.nanmax(diff)) if diff.size else 0.0)
    return spreads


def compare_results(
    got: Sequence[Any],
    wants: Mapping[str, Sequence[Any]],
    where: Sequence[str],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    compute_types: Sequence[ComputeTypeLike | None] | None = None,
) -> VerifyReport:
    """Compare the staged program's results ``got`` with each reference evaluation
    in ``wants`` (name -> results); ``where`` describes each result. ``rtol``/``atol``
    ``None``: the default tolerance of each result's ``compute_types`` entry (the
    narrowest floating type its computation passes through, from
    :func:`pipemark.precision.result_compute_types`; without one, the result's own
    dtype). With two references, each result's spread between them is measured."""
    for reference, want in wants.items():
        if len(got) != len(want):
            raise VerificationError(
                f"The staged program returns {len(got)} results, the reference "
                f"({reference}) {len(want)}.",
                VerifyReport(tuple(wants), False, ()),
            )
    if compute_types is None or len(compute_types) != len(got):
        compute_types = [None] * len(got)
    spreads = _spreads(wants, len(got))
    checks = [
        _check(i, where[i], reference, a, b, rtol, atol, compute_types[i], spreads[i])
        for reference, want in wants.items()
        for i, (a, b) in enumerate(zip(got, want))
    ]
    exact = all(c.rtol == 0 and c.atol == 0 for c in checks)
    return VerifyReport(
        tuple(wants), exact, tuple(checks), tuple(wants)[:2] if len(wants) > 1 else ()
    )


def raise_on_mismatch(report: VerifyReport) -> VerifyReport:
    """``report`` if it passed; else a :class:`VerificationError` naming the first
    result that differs, with plain numbers, where its tolerance comes from and how
    its difference compares with the jit-eager spread."""
    failed = [c for c in report.checks if not c.passed]
    if not failed:
        return report
    c = failed[0]
    tolerance = (
        "bit for bit"
        if c.rtol == 0 and c.atol == 0
        else f"rtol {_number(c.rtol)}, atol {_number(c.atol)}"
    )
    if c.reason:
        tolerance += f", from {c.reason}"
    others = f"; {len(failed) - 1} more comparisons failed" if len(failed) > 1 else ""
    raise VerificationError(
        f"Result {c.index} ({c.where}) differs from the reference ({c.reference}): largest "
        f"difference {_number(c.largest_difference)}, {c.mismatched} of {c.size} elements "
        f"outside the tolerance ({tolerance}){_against_spread(c)}{others}.\n{report}",
        report,
    )


def _against_spread(c: ResultCheck) -> str:
    """How the failing difference compares with the jit-eager spread of its result."""
    if c.spread is None or not _is_float_name(c.dtype):
        return ""
    if c.spread == 0:
        return "; jit and eager agree bit for bit on this result"
    times = c.largest_difference / c.spread
    text = f"; that is {times:.2g}x the jit-eager spread of this result ({_number(c.spread)})"
    if times <= 2:
        text += (
            ": a difference of the size of JAX's own rounding; if the program is right, "
            "pass a wider rtol/atol"
        )
    return text


def _is_float_name(dtype: str) -> bool:
    return dtype.startswith(_INEXACT)
