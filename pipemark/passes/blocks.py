"""Repeated blocks of a program: where a cut would not split a transformer block.

:func:`find_blocks` finds the blocks of a model (its transformer blocks, its layers)
in a traced program from two hints that JAX keeps, and :class:`Blocks` says which cut
positions fall between them:

1. **Name scopes.** Flax, nnx, equinox and penzai modules and ``jax.named_scope`` put
   their names on each equation's name stack. At the shallowest scope depth where two
   or more consecutive scopes with different names (``Block_0``, ``Block_1``; penzai's
   ``1``, ``2``) hold the same equations (primitives and result types, one after the
   other), each such scope is a block. Asking for equal contents keeps an embedding
   and a head, scoped beside the blocks, from counting as blocks.
2. **Parameter paths.** The key path of each input (``params['blocks'][0]['w']``; in
   one flat dict of dotted names, as torchax gives, ``weights['transformer.h.0.ln_1.bias']``
   reads as ``transformer``, ``h``, ``0``, …). A numbered component (``0``, ``[0]``,
   ``Block_0``, ``layers_3``) whose numbers all hold the same two or more leaves (same
   sub-paths, shapes and dtypes) numbers blocks; the outermost such component counts. A block
   spans the equations from the first to the last that reads one of its parameters.

A cut is *between blocks* when it falls inside no block's span. Both hints are
debugging data JAX keeps by default; a program that has neither (a hand-built jaxpr,
blocks that are one ``jit`` function called again and again with no parameters of
their own) has no blocks found, and :func:`pipemark.passes.auto_layers` then balances
cost alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Var

from pipemark._compat import input_paths, name_stack_scopes

__all__ = ["Blocks", "find_blocks", "path_components"]


@dataclass(frozen=True)
class Blocks:
    """Blocks found in a program's equations ``0 .. stop - 1``.

    Attributes
    ----------
    spans:
        ``(begin, end)`` equation ranges, one per block, in program order and disjoint
        (blocks whose ranges overlap are merged into one).
    source:
        What found them, for messages: ``"name scopes 'Block_0' … 'Block_3'"`` or
        ``"parameters params['blocks'][0] … params['blocks'][3]"``.
    """

    spans: tuple[tuple[int, int], ...]
    source: str

    def cut_allowed(self, stop: int) -> np.ndarray:
        """``stop + 1`` booleans: whether a cut before equation ``i`` splits no block.

        >>> Blocks(((1, 3), (3, 5)), "example").cut_allowed(6).tolist()
        [True, True, False, True, False, True, True]
        """
        allowed = np.ones(stop + 1, dtype=bool)
        for begin, end in self.spans:
            allowed[begin + 1 : end] = False
        return allowed


def find_blocks(jaxpr: Jaxpr, stop: int | None = None) -> Blocks | None:
    """The repeated blocks among ``jaxpr.eqns[:stop]``, from name scopes and parameter
    paths (see the module docstring), or None when neither finds two blocks.

    >>> import jax, jax.numpy as jnp
    >>> def f(params, x):
    ...     for p in params["blocks"]:
    ...         x = jnp.tanh(x @ p["w"] + p["b"])
    ...     return x.sum()
    >>> params = {"blocks": [{"w": jnp.ones((4, 4)), "b": jnp.ones(4)}] * 3}
    >>> cj = jax.make_jaxpr(f)(params, jnp.ones(4))
    >>> blocks = find_blocks(cj.jaxpr)
    >>> blocks.spans, blocks.source
    (((0, 2), (3, 5), (6, 8)), "parameters params['blocks'][0] … params['blocks'][2]")
    """
    eqns = jaxpr.eqns[: len(jaxpr.eqns) if stop is None else stop]
    found = [b for b in (_scope_blocks(eqns), _parameter_blocks(jaxpr, eqns)) if b is not None]
    if not found:
        return None
    spans = _merge([span for spans, _ in found for span in spans])
    if len(spans) < 2:
        return None
    return Blocks(tuple(spans), "; ".join(source for _, source in found))


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


# ------------------------------------------------------------------------ name scopes


# Equations that only move or relabel data: one copy of a block may need a transpose
# that the next does not (penzai's named axes keep the layout they arrive in).
_LAYOUT = frozenset(
    {
        "transpose",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "convert_element_type",
    }
)


def _signature(eqns: Sequence[JaxprEqn]) -> tuple:
    # What two copies of one block share: the same computing primitives, in order, making
    # results of the same sizes and dtypes (a layout may differ).
    return tuple(
        (e.primitive.name, tuple(_size(v.aval) for v in e.outvars))
        for e in eqns
        if e.primitive.name not in _LAYOUT
    )


def _type(aval) -> tuple:
    # (shape, dtype): str(aval) says the same but costs ten times more.
    shape = getattr(aval, "shape", None)
    return (str(aval),) if shape is None else (tuple(shape), str(aval.dtype))


def _size(aval) -> tuple:
    size = getattr(aval, "size", None)
    return (str(aval),) if size is None else (getattr(aval, "dtype", None), size)


def _scope_blocks(eqns: Sequence[JaxprEqn]) -> tuple[list[tuple[int, int]], str] | None:
    scopes = [name_stack_scopes(e.source_info)[0] for e in eqns]
    deepest = max((len(s) for s in scopes), default=0)
    for depth in range(deepest):
        # Runs of consecutive equations under one scope at this depth.
        runs: list[tuple[tuple[str, ...], int, int]] = []
        for i, scope in enumerate(scopes):
            key = scope[: depth + 1] if len(scope) > depth else None
            if runs and key is not None and runs[-1][0] == key and runs[-1][2] == i:
                runs[-1] = (key, runs[-1][1], i + 1)
            elif key is not None:
                runs.append((key, i, i + 1))
        groups: dict[tuple, list[tuple[tuple[str, ...], int, int]]] = {}
        for key, begin, end in runs:
            groups.setdefault((key[:-1], _signature(eqns[begin:end])), []).append((key, begin, end))
        blocks = [
            run
            for group in groups.values()
            if len({key for key, _, _ in group}) >= 2
            for run in group
        ]
        if blocks:
            blocks.sort(key=lambda run: run[1])
            names = [key[-1] for key, _, _ in blocks]
            return [(b, e) for _, b, e in blocks], f"name scopes {names[0]!r} … {names[-1]!r}"
    return None


# -------------------------------------------------------------------- parameter paths

# One step of a key path as jax.tree_util.keystr writes it: [0], ['key'], ["key"], .attr
_STEP = re.compile(r"\[(\d+)\]|\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\.(\w+)")
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def path_components(path: str) -> tuple[str | int, ...] | None:
    """The components of a key path as ``jax.tree_util.keystr`` writes it, with the
    dots of string keys splitting them too (a flat dict of dotted names is a tree), or
    None when it does not parse.

    >>> path_components("weights['transformer.h.0.ln_1.bias']")
    ('weights', 'transformer', 'h', '0', 'ln_1', 'bias')
    >>> path_components("params['blocks'][2].w")
    ('params', 'blocks', 2, 'w')
    """
    head = re.match(r"\w*", path)
    components: list[str | int] = [head.group(0)] if head and head.group(0) else []
    position = head.end() if head else 0
    while position < len(path):
        step = _STEP.match(path, position)
        if step is None:
            return None
        index, single, double, attribute = step.groups()
        if index is not None:
            components.append(int(index))
        else:
            key = single if single is not None else double if double is not None else attribute
            components.extend(part for part in key.split(".") if part)
        position = step.end()
    return tuple(components)


def _number(component: str | int) -> tuple[str | None, int] | None:
    """``"Block_3"`` -> ``("Block_", 3)``, ``"3"`` -> ``("", 3)``, ``3`` (a sequence
    index) -> ``(None, 3)``; None for a component without a number at its end."""
    if isinstance(component, int):
        return None, component
    match = _NUMBERED.match(component)
    return (match.group(1), int(match.group(2))) if match else None


def _render(prefix: tuple, stem: str | None, number: int) -> str:
    head, *rest = prefix or ("",)
    steps = [*rest, number if stem is None else f"{stem}{number}"]
    return str(head) + "".join(f"[{c}]" if isinstance(c, int) else f"[{c!r}]" for c in steps)


def _parameter_blocks(
    jaxpr: Jaxpr, eqns: Sequence[JaxprEqn]
) -> tuple[list[tuple[int, int]], str] | None:
    # family (prefix, stem) -> number -> the leaves (sub-path, type) and their inputs
    families: dict[tuple, dict[int, list[tuple[tuple, str, Var]]]] = {}
    for var, path in zip(jaxpr.invars, input_paths(jaxpr)):
        components = path_components(path) if path else None
        for k, component in enumerate(components or ()):
            numbered = _number(component)
            if numbered is not None:
                stem, number = numbered
                members = families.setdefault((components[:k], stem), {})
                members.setdefault(number, []).append((components[k + 1 :], _type(var.aval), var))
    # A block holds parameters of its own: two leaves at least. One leaf a number is more
    # often a tuple of unrelated arrays, e.g. a batch (tokens, targets), than a layer.
    qualified = {
        family: members
        for family, members in families.items()
        if len(members) >= 2
        and all(len(leaves) >= 2 for leaves in members.values())
        and len({tuple(sorted(leaf[:2] for leaf in leaves)) for leaves in members.values()}) == 1
    }
    outermost = [f for f in qualified if not any(_inside(f, g) for g in qualified if g != f)]
    if not outermost:
        return None
    wanted = {v for f in outermost for leaves in qualified[f].values() for _, _, v in leaves}
    first_read: dict[Var, int] = {}
    last_read: dict[Var, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if isinstance(v, Var) and v in wanted:
                first_read.setdefault(v, i)
                last_read[v] = i
    spans = []
    for family in outermost:
        for leaves in qualified[family].values():
            reads = [v for _, _, v in leaves if v in first_read]
            if reads:
                spans.append(
                    (min(first_read[v] for v in reads), max(last_read[v] for v in reads) + 1)
                )
    if len(spans) < 2:
        return None
    (prefix, stem), *_ = outermost
    numbers = sorted(qualified[outermost[0]])
    first, last = (_render(prefix, stem, n) for n in (numbers[0], numbers[-1]))
    return spans, f"parameters {first} … {last}"


def _inside(family: tuple, other: tuple) -> bool:
    """Whether ``family``'s components are numbered inside a member of ``other``."""
    (prefix, _), (outer_prefix, outer_stem) = family, other
    depth = len(outer_prefix)
    if len(prefix) <= depth or prefix[:depth] != outer_prefix:
        return False
    numbered = _number(prefix[depth])
    return numbered is not None and numbered[0] == outer_stem
