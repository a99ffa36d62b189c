"""Checking a staged program against JAX's own evaluation of the user's function.

:meth:`pipemark.StagedJaxpr.verify` runs the staged program and compares each result
with the reference as JAX evaluates it: compiled (``jax.jit(fn)``) and eagerly (``fn``
called as it is, its jitted helpers compiled, the rest op by op). The reference is never
a program that a pipemark pass has rewritten, so a fault in the passes cannot hide in
the reference too.

**Tolerance.** A staged program runs equation by equation, while ``jax.jit`` lets XLA
fuse and reorder arithmetic, so floating-point results agree to rounding, not bit for
bit. By default a floating-point result passes when every element satisfies
``|got - want| <= rtol * |want| + atol`` with ``rtol`` from :data:`DEFAULT_RTOL` for
its dtype and ``atol = max(rtol * max|want|, floor)``, the floor from
:data:`DEFAULT_ATOL_FLOOR` (elements near zero are judged at the scale of the result's
largest magnitude, or of rounding noise, as rounding errors are). Integer and
boolean results must be equal. Pass ``rtol=0, atol=0`` to demand bit equality, or other
numbers to set the tolerance for every result.

>>> import numpy as np
>>> report = compare_results(
...     [np.float32([1.0, 2.0])], {"jit": [np.float32([1.0, 2.0000002])]}, ["result 0"]
... )
>>> report.passed, report.exact
(True, False)
>>> f"{report.largest_difference:.3g}"
'2.38e-07'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipemark.errors import PipemarkError

__all__ = [
    "DEFAULT_ATOL_FLOOR",
    "DEFAULT_RTOL",
    "REFERENCE_KINDS",
    "ResultCheck",
    "VerificationError",
    "VerifyReport",
    "compare_results",
    "evaluate_reference",
    "raise_on_mismatch",
]

#: The default relative tolerance per floating-point dtype (by name): a few hundred
#: units in the last place for float32, wide enough for reordered sums over a model's
#: reductions and narrow enough for any wrong value seen so far (those differ by > 1e-3).
DEFAULT_RTOL: dict[str, float] = {
    "float64": 1e-10,
    "complex128": 1e-10,
    "float32": 1e-5,
    "complex64": 1e-5,
    "float16": 5e-3,
    "bfloat16": 3e-2,
}
_FALLBACK_RTOL = 3e-2  # narrower float types (float8 and friends)

#: The least absolute tolerance per dtype (JAX's own test tolerances): a value that is
#: zero in exact arithmetic (a gradient that cancels) comes out as rounding noise of
#: the size of the values it was computed from, whatever the result's own magnitude.
DEFAULT_ATOL_FLOOR: dict[str, float] = {
    "float64": 1e-15,
    "complex128": 1e-15,
    "float32": 1e-6,
    "complex64": 1e-6,
    "float16": 1e-3,
    "bfloat16": 1e-2,
}

#: How :func:`evaluate_reference` can evaluate a reference: ``"jit"`` compiles it with
#: ``jax.jit``; ``"eager"`` calls it as it is.
REFERENCE_KINDS: tuple[str, ...] = ("jit", "eager")


class VerificationError(PipemarkError):
    """A staged program's results differ from the reference's; ``report`` holds the
    :class:`VerifyReport` with every comparison."""

    def __init__(self, message: str, report: VerifyReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ResultCheck:
    """One result compared with one reference evaluation."""

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

    @property
    def passed(self) -> bool:
        return self.mismatched == 0


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`pipemark.StagedJaxpr.verify` compared and how far apart it found
    the results. ``str(report)`` is a table of every result against every reference."""

    references: tuple[str, ...]
    exact: bool  # bit for bit (rtol = atol = 0) for every result
    checks: tuple[ResultCheck, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def largest_difference(self) -> float:
        return max((check.largest_difference for check in self.checks), default=0.0)

    @property
    def comparison(self) -> str:
        """How results were compared, in words."""
        if self.exact:
            return "bit for bit"
        rtols = sorted({_number(c.rtol) for c in self.checks if c.rtol or c.atol})
        return f"within rtol {', '.join(rtols) or '0'}"

    def __str__(self) -> str:
        head = (
            f"{'passed' if self.passed else 'FAILED'}: {len(self.checks)} comparisons "
            f"against {' and '.join(self.references)}, {self.comparison}"
            f"{'' if self.exact else ' (atol per result below)'}; largest "
            f"difference {_number(self.largest_difference)}"
        )
        rows = [("result", "reference", "type", "largest diff", "rtol", "atol", "mismatched")]
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
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join([head, *lines])


def _number(value: float) -> str:
    """A plain number (never ``np.float64(...)``)."""
    return f"{float(value):.6g}"


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


def _tolerance(want: np.ndarray, rtol: float | None, atol: float | None) -> tuple[float, float]:
    if rtol is not None or atol is not None:
        return float(rtol or 0.0), float(atol or 0.0)
    if want.dtype.kind not in "fc":
        return 0.0, 0.0
    rtol = DEFAULT_RTOL.get(want.dtype.name, _FALLBACK_RTOL)
    floor = DEFAULT_ATOL_FLOOR.get(want.dtype.name, _FALLBACK_RTOL)
    finite = np.abs(want[np.isfinite(want)]) if want.size else want
    scale = float(np.max(finite)) if finite.size else 0.0
    return rtol, max(rtol * scale, floor)


def _check(index: int, where: str, reference: str, got: Any, want: Any, rtol, atol):
    a, b = np.asarray(got), np.asarray(want)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise VerificationError(
            f"Result {index} ({where}) is {a.dtype}{list(a.shape)}, the reference's "
            f"({reference}) is {b.dtype}{list(b.shape)}.",
            VerifyReport((reference,), False, ()),
        )
    rtol, atol = _tolerance(b, rtol, atol)
    if a.dtype.kind in "fc":
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        a64, b64 = a.astype(wide), b.astype(wide)
        with np.errstate(invalid="ignore"):  # inf - inf
            diff = np.abs(a64 - b64)
        both_nan = np.isnan(a64) & np.isnan(b64)
        same_inf = np.isinf(a64) & (a64 == b64)
        diff = np.where(both_nan | same_inf, 0.0, diff)
        bad = ~((diff <= atol + rtol * np.abs(b64)) | both_nan | same_inf)
    else:
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)) if a.dtype.kind != "V" else 0
        bad = a != b
    largest = float(np.nanmax(diff)) if np.size(diff) else 0.0
    return ResultCheck(
        index, where, reference, a.dtype.name, a.shape, rtol, atol, largest,
        int(np.sum(bad)), int(a.size),
    )  # fmt: skip


def compare_results(
    got: Sequence[Any],
    wants: Mapping[str, Sequence[Any]],
    where: Sequence[str],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> VerifyReport:
    """Compare the staged program's results ``got`` with each reference evaluation
    in ``wants`` (name -> results); ``where`` describes each result. ``rtol``/``atol``
    ``None``: the default tolerance (the module docstring says which)."""
    checks = []
    for reference, want in wants.items():
        if len(got) != len(want):
            raise VerificationError(
                f"The staged program returns {len(got)} results, the reference "
                f"({reference}) {len(want)}.",
                VerifyReport(tuple(wants), False, ()),
            )
        checks += [
            _check(i, where[i], reference, a, b, rtol, atol)
            for i, (a, b) in enumerate(zip(got, want))
        ]
    exact = all(c.rtol == 0 and c.atol == 0 for c in checks)
    return VerifyReport(tuple(wants), exact, tuple(checks))


def raise_on_mismatch(report: VerifyReport) -> VerifyReport:
    """``report`` if it passed; else a :class:`VerificationError` naming the first
    result that differs, with plain numbers."""
    failed = [c for c in report.checks if not c.passed]
    if not failed:
        return report
    c = failed[0]
    tolerance = (
        "bit for bit"
        if c.rtol == 0 and c.atol == 0
        else f"rtol {_number(c.rtol)}, atol {_number(c.atol)}"
    )
    others = f"; {len(failed) - 1} more comparisons failed" if len(failed) > 1 else ""
    raise VerificationError(
        f"Result {c.index} ({c.where}) differs from the reference ({c.reference}): largest "
        f"difference {_number(c.largest_difference)}, {c.mismatched} of {c.size} elements "
        f"outside the tolerance ({tolerance}){others}.\n{report}",
        report,
    )
