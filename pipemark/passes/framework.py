"""What every pass shares: :func:`jaxpr_pass`, the decorator that checks a pass's
input, pauses the garbage collector while it runs and, under ``jax_enable_checks``,
checks every jaxpr it returns; and :func:`paused_collector` on its own.

Write a pass as a pure function of a ``ClosedJaxpr`` and decorate it::

    @jaxpr_pass
    def my_pass(cj: ClosedJaxpr, ...) -> ClosedJaxpr: ...

Why the collector is paused: a pass over a 200k-equation program allocates hundreds of
thousands of small objects (equations, variable lists, dicts) and no reference cycles.
While they are being made, the collector keeps rescanning the young ones, which costs
as much as the pass itself at that size and grows faster than linearly. Reference
counting frees everything a pass drops, so the collector has nothing to find there; it
runs again when the pass returns.

>>> import jax, jax.numpy as jnp
>>> @jaxpr_pass
... def identity(cj):
...     return cj
>>> identity(jax.make_jaxpr(jnp.sin)(1.0)).eqns[0].primitive.name
'sin'
>>> identity("not a jaxpr")
Traceback (most recent call last):
...
pipemark.errors.PipemarkError: identity takes a jax.extend.core.ClosedJaxpr, got str; trace your function with jax.make_jaxpr(fn)(*args) first.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, check_jaxpr

from pipemark.errors import PipemarkError, check_closed_jaxpr, describe_eqn
from pipemark.passes.memo import ProgramMemo
from pipemark.primitive import check_marker_vars, pipeline_p

__all__ = ["check_program", "check_result", "jaxpr_pass", "paused_collector"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Disable the cyclic collector inside the ``with`` block, if it is enabled (a
    nested block, or a caller that disabled it, is left alone)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# Programs found well formed (check_program), and the programs passes built from them.
_WELL_FORMED = ProgramMemo()


def check_program(jaxpr: Jaxpr, who: str) -> None:
    """Refuse a program no pass can work on, naming the equation: a variable read
    before anything defines it or defined twice (a :class:`~pipemark.errors.PipemarkError`),
    and a marker whose operands and results do not pair up, or whose result is its own
    operand (a :class:`~pipemark.errors.MarkerError`). One sweep; a program checked
    before (or built by a pass from a checked one) is not swept again."""
    if _WELL_FORMED.get(jaxpr):
        return
    defined = set(jaxpr.invars)
    defined.update(jaxpr.constvars)
    for index, eqn in enumerate(jaxpr.eqns):
        for a in eqn.invars:
            if type(a) is not Literal and a not in defined:
                raise PipemarkError(
                    f"{who}: {describe_eqn(eqn, index)} reads {a}, which no earlier "
                    "equation, input or constant defines. The program is malformed; build "
                    "it with jax.make_jaxpr, or check it with jax.extend.core.check_jaxpr."
                )
        if eqn.primitive is pipeline_p:
            check_marker_vars(eqn.invars, eqn.outvars, f"{who}: {describe_eqn(eqn, index)}")
        for v in eqn.outvars:
            if v in defined and type(v) is not DropVar:
                raise PipemarkError(
                    f"{who}: {describe_eqn(eqn, index)} defines {v} again. The program is "
                    "malformed; check it with jax.extend.core.check_jaxpr."
                )
            defined.add(v)
    for a in jaxpr.outvars:
        if type(a) is not Literal and a not in defined:
            raise PipemarkError(
                f"{who}: the program returns {a}, which nothing defines. The program is "
                "malformed; check it with jax.extend.core.check_jaxpr."
            )
    _WELL_FORMED.put(jaxpr, True, markers=())  # params do not change well-formedness


def _result_jaxprs(result: Any, stages: bool = True) -> Iterator[Jaxpr]:
    """The jaxprs of a pass's result: a ``ClosedJaxpr``, each stage of a staged
    program (unless ``stages`` is false), or those of the elements of a tuple."""
    if isinstance(result, ClosedJaxpr):
        yield result.jaxpr
    elif isinstance(result, tuple):
        for item in result:
            yield from _result_jaxprs(item, stages)
    elif stages and hasattr(result, "stages"):  # a StagedJaxpr (it imports passes)
        for stage in result.stages:
            yield stage.closed_jaxpr.jaxpr


def check_result(result: Any) -> None:
    """``check_jaxpr`` of every jaxpr in a pass's result (see :func:`jaxpr_pass`)."""
    for jaxpr in _result_jaxprs(result):
        check_jaxpr(jaxpr)


def jaxpr_pass(fn: F) -> F:
    """Make ``fn(cj, ...)`` a pass: its first argument must be a well-formed
    ``ClosedJaxpr`` (:func:`check_program`; a :class:`~pipemark.errors.PipemarkError`
    naming the pass otherwise), the collector is paused while it runs, and with
    ``jax.config.update("jax_enable_checks", True)`` (as the test suite runs) every
    jaxpr it returns goes through ``check_jaxpr``."""
    name = fn.__name__

    @functools.wraps(fn)
    def run(cj: Any, *args: Any, **kwargs: Any) -> Any:
        check_closed_jaxpr(cj, name)
        with paused_collector():
            check_program(cj.jaxpr, name)
            result = fn(cj, *args, **kwargs)
            if jax.config.jax_enable_checks:
                check_result(result)
            # A pass builds a well-formed program from a well-formed one (the suite
            # checks every result above): the next pass need not sweep it again. (Stage
            # programs are not passes' inputs: remembering each would only cost.)
            for jaxpr in _result_jaxprs(result, stages=False):
                _WELL_FORMED.put(jaxpr, True, markers=())
        return result

    return run  # type: ignore[return-value]
