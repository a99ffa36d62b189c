"""Comparisons of pytrees for the tests: each failure names the leaf (its key path) and
how far it is off, as numpy's own assertions do for one array."""

from __future__ import annotations

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
