"""A memo of a pure function of a program, safe against programs edited in place.

A ``Jaxpr`` hashes by identity, but its equation list, its result list and its
equations' params dicts can be edited in place. A :class:`ProgramMemo` entry keeps what
an answer about the program's stage structure depends on (the equation list, the result
list, and each marker's name and mark type) and is used only while all three are
unchanged: list comparisons by identity and one look at each marker, far cheaper than
computing the answer again. Entries die with their program; :func:`pipemark.caches.clear_caches`
empties every memo.

>>> import jax, jax.numpy as jnp
>>> traced = jax.make_jaxpr(jnp.sin)(1.0).jaxpr
>>> jaxpr = traced.replace(eqns=list(traced.eqns))  # our own copy, to edit
>>> memo = ProgramMemo()
>>> memo.put(jaxpr, "answer")
>>> memo.get(jaxpr)
'answer'
>>> jaxpr.eqns.append(jaxpr.eqns[0])  # edited in place: the entry no longer holds
>>> memo.get(jaxpr) is None
True
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

from jax.extend.core import Jaxpr, JaxprEqn

from pipemark.caches import register_cache
from pipemark.primitive import pipeline_p

__all__ = ["ProgramMemo"]


def _marker_snapshot(eqns: list[JaxprEqn], indices: Iterable[int]) -> tuple:
    return tuple((i, eqns[i].params.get("name"), eqns[i].params.get("mark_type")) for i in indices)


class ProgramMemo:
    """Answers about programs, per program object and ``key`` (say, an option)."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[Jaxpr, dict] = weakref.WeakKeyDictionary()
        register_cache(self._entries.clear)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, jaxpr: Jaxpr) -> bool:
        return jaxpr in self._entries

    def get(self, jaxpr: Jaxpr, key: Hashable = None) -> Any:
        """The answer remembered for ``jaxpr`` and ``key``, or ``None`` when there is
        none or the program changed since."""
        try:
            entry = self._entries.get(jaxpr)
        except TypeError:  # not weak-referenceable
            return None
        if entry is None or entry["eqns"] != jaxpr.eqns or entry["outvars"] != jaxpr.outvars:
            return None
        markers = entry["markers"]
        if _marker_snapshot(jaxpr.eqns, (i for i, _, _ in markers)) != markers:
            return None
        return entry["answers"].get(key)

    def put(
        self, jaxpr: Jaxpr, answer: Any, key: Hashable = None, markers: Iterable[int] | None = None
    ) -> None:
        """Remember ``answer`` for ``jaxpr`` and ``key``. ``markers``: the indices of the
        program's marker equations, when the caller knows them (else found here)."""
        eqns = jaxpr.eqns
        if markers is None:
            markers = [i for i, eqn in enumerate(eqns) if eqn.primitive is pipeline_p]
        snapshot = _marker_snapshot(eqns, markers)
        with contextlib.suppress(TypeError):  # a jaxpr that is not weak-referenceable
            entry = self._entries.get(jaxpr)
            same = (
                entry is not None
                and entry["eqns"] == eqns
                and entry["outvars"] == jaxpr.outvars
                and entry["markers"] == snapshot
            )
            if not same:
                entry = self._entries[jaxpr] = {
                    "eqns": list(eqns),
                    "outvars": list(jaxpr.outvars),
                    "markers": snapshot,
                    "answers": {},
                }
            entry["answers"][key] = answer
