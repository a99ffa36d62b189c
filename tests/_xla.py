"""XLA flags for the processes the tests start.

Scripts run by the tests set their own ``XLA_FLAGS`` (a number of host devices, an
optimisation level). The flags that say how to generate code for this machine's CPU
(``--xla_cpu_max_isa=AVX2``: ``make test XLA_ISA=AVX2``, CONTRIBUTING.md "Supported JAX
versions") must reach them too, or a run pinned to a lower instruction set would check
only the test process itself (tests/_exact.py says why it is pinned); so must the
backend optimisation level ``make test`` sets for time (Makefile, ``XLA_OPT``), or the
processes the tests start would compile at the default level.
"""

from __future__ import annotations

import os

#: Flags a started process inherits from this one's ``XLA_FLAGS``.
INHERITED = ("--xla_cpu_max_isa", "--xla_backend_optimization_level")


def inherited_flags(environ: dict[str, str] | None = None) -> list[str]:
    """The inherited flags set in ``environ`` (``os.environ`` by default)."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "").split()
    return [f for f in flags if f.split("=", 1)[0] in INHERITED]


def xla_flags(*flags: str, environ: dict[str, str] | None = None) -> str:
    """``flags`` followed by the inherited ones: the ``XLA_FLAGS`` of a started
    process, or of a script that sets its own."""
    return " ".join([*flags, *inherited_flags(environ)])


def child_environ(environ: dict[str, str], *flags: str) -> dict[str, str]:
    """``environ`` with ``XLA_FLAGS`` made of ``flags`` and the inherited ones (no
    ``XLA_FLAGS`` when both are empty: the child then sets its own)."""
    env = {k: v for k, v in environ.items() if k != "XLA_FLAGS"}
    value = xla_flags(*flags, environ=environ)
    if value:
        env["XLA_FLAGS"] = value
    return env
