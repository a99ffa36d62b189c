"""When two results may be compared bit for bit, and how close they must be otherwise.

Two runs of the same program give the same bits: the same compiled executable, or the
same equations evaluated one by one (``jaxpr_as_fun``, each equation its own small XLA
program, the same one on both sides). Two different programs need not: XLA's CPU code
(which operations it fuses, how it vectorises a reduction, whether it contracts a
multiply and an add into one FMA) depends on the program and on the host's instruction
set, so a compiled ``jit`` call and the same equations inlined, a loop of 8 iterations
and two of 4, or an eager function and its jitted form may round the last bits apart
(issue #38: 1 ulp on a 2-core AMD EPYC without AVX-512, not on the machines before it).

So a test asserts bit equality between two programs only through
:func:`assert_same_equations_same_bits` (or :func:`assert_equations_from`, then
``assert_trees_equal``), which first checks that one program is made of the other's
equations (markers aside, which compute nothing) and only then compares bits.
Everything else compares with :func:`tests._trees.assert_trees_within_ulps` (a few
units in the last place of the result's scale, for two programs that compute the same
arithmetic in another order) or :func:`tests._trees.assert_trees_close` (a tolerance
for longer computations).

``make test`` runs on the machine's own instruction set; to check that no test depends
on it, run the suite with XLA's CPU code generation pinned lower, e.g.
``XLA_FLAGS=--xla_cpu_max_isa=AVX2`` or ``AVX`` (CONTRIBUTING.md, "Supported JAX versions"; not
``SSE4_2``, where XLA cannot compile a float16 conversion).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

import pipemark as pm
from tests._trees import assert_trees_equal


def _programs(program: Any) -> list[ClosedJaxpr]:
    """A closed jaxpr, a staged program's stages (run one after another), or a list
    of either (programs run one after another, as a split training step's two)."""
    if isinstance(program, ClosedJaxpr):
        return [program]
    if isinstance(program, (list, tuple)):
        return [closed for part in program for closed in _programs(part)]
    return [stage.closed_jaxpr for stage in program.stages]


def _equation_key(eqn: Any) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    # A body (jit, scan, remat...) is compiled as one XLA program when evaluated: it
    # is the same program only if it prints the same, markers (barriers) included.
    params = repr(sorted(eqn.params.items()))
    ins = tuple(str(getattr(v, "aval", v)) for v in eqn.invars)
    return eqn.primitive.name, params, ins, tuple(str(v.aval) for v in eqn.outvars)


def equations(program: Any) -> Counter:
    """The non-marker top-level equations of a program (a closed jaxpr, a staged
    program's stages, or a list of them), as a multiset of (primitive, params, input
    and output types)."""
    return Counter(
        _equation_key(eqn)
        for closed in _programs(program)
        for eqn in closed.jaxpr.eqns
        if eqn.primitive is not pm.pipeline_p
    )


def assert_equations_from(got: Any, want: Any) -> None:
    """Assert every equation of ``got`` (markers aside) is one of ``want``'s, as many
    times: ``got`` computes with ``want``'s equations (all of them, or fewer where a
    pass dropped dead code), so evaluating each by itself gives the same bits."""
    extra = equations(got) - equations(want)
    if extra:
        raise AssertionError(
            f"{sum(extra.values())} equations of the first program are not in the second "
            f"({[k[0] for k in extra.elements()][:8]}): the two are different programs "
            "and may round apart; compare them with a tolerance "
            "(tests._trees.assert_trees_within_ulps), not bit for bit"
        )


def assert_same_equations_same_bits(got: Any, want: Any, *args: Any) -> int:
    """Assert ``got``'s equations are ``want``'s (markers aside, dead code dropped:
    :func:`assert_equations_from`) and that, evaluated equation by equation on ``args``
    (flattened), they give the same bits: the same dtypes, shapes and values. A staged
    program runs stage after stage, as its ``__call__`` does. Returns the number of
    results compared."""
    assert_equations_from(got, want)
    flat = jax.tree_util.tree_leaves(args)
    results = []
    for program in (got, want):
        run = jaxpr_as_fun(program) if isinstance(program, ClosedJaxpr) else program
        # A literal result comes back as a Python scalar: typed as the program says.
        results.append([jnp.asarray(v) for v in run(*flat)])
    return assert_trees_equal(*results)
