"""Comparisons of pytrees for the tests: each failure names the leaf (its key path) and
how far it is off, as numpy's own assertions do for one array."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _leaves(got, want) -> list[tuple[str, object, object]]:
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    assert got_tree == want_tree, f"tree structures differ:\n  got  {got_tree}\n  want {want_tree}"
    return [(jax.tree_util.keystr(path), a, b) for (path, a), b in zip(got_leaves, want_leaves)]


def assert_trees_close(got, want, *, rtol: float = 1e-5, atol: float = 1e-6) -> int:
    """Assert ``got`` has ``want``'s tree structure and every leaf equals its ``want``
    leaf to ``|got - want| <= atol + rtol |want|``; returns the number of leaves."""
    leaves = _leaves(got, want)
    for path, a, b in leaves:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"leaf {path}: {a.dtype}{list(a.shape)}, want {b.dtype}{list(b.shape)}"
        )
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"leaf {path}")
    return len(leaves)


def assert_trees_equal(got, want) -> int:
    """Assert ``got`` and ``want`` are the same tree of bit-identical arrays (same
    dtypes, shapes and values); returns the number of leaves."""
    leaves = _leaves(got, want)
    for path, a, b in leaves:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"leaf {path}: {a.dtype}, want {b.dtype}"
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {path}", strict=True)
    return len(leaves)


def assert_trees_within_ulps(got: Any, want: Any, *, ulps: int = 4) -> int:
    """Assert ``got`` has ``want``'s tree structure, dtypes and shapes, and every
    floating leaf is within ``ulps`` units in the last place of its scale: ``|got -
    want| <= ulps * eps(dtype) * max|want|`` (integers and booleans equal).

    For two different programs that compute the same arithmetic, in another order or
    another fusion: a sum reordered, an FMA contracted, a vectorised and a scalar
    ``sin``. Each moves a result by an ulp or two of the values it adds up; a few ulps
    of the leaf's largest magnitude bound that for the short computations the tests
    compare this way. Returns the number of leaves."""
    leaves = _leaves(got, want)
    for path, a, b in leaves:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (
            f"leaf {path}: {a.dtype}{list(a.shape)}, want {b.dtype}{list(b.shape)}"
        )
        if not np.issubdtype(a.dtype, np.inexact):
            np.testing.assert_array_equal(a, b, err_msg=f"leaf {path}", strict=True)
            continue
        scale = float(np.max(np.abs(b.astype(np.float64)))) if b.size else 0.0
        tolerance = ulps * float(np.finfo(a.dtype).eps) * max(scale, float(np.finfo(a.dtype).tiny))
        np.testing.assert_allclose(
            a.astype(np.float64),
            b.astype(np.float64),
            rtol=0,
            atol=tolerance,
            err_msg=f"leaf {path}: more than {ulps} ulps of {scale:g} apart",
        )
    return len(leaves)
