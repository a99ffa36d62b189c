"""Exceptions pipemark raises on bad input, all in this module.

Every error caused by what a user passed in is a :class:`PipemarkError`, so a caller can
catch all of them with one ``except`` clause. The subclasses say which part went wrong.
The few a program catches are also top-level names (``pm.PipemarkError``,
``pm.VerificationError``, ``pm.MemoryBudgetError``, ``pm.DeviceOutOfMemoryError``);
the others are here (``pm.errors.MarkerError``).

>>> import pipemark as pm
>>> issubclass(pm.errors.SignatureError, (pm.PipemarkError, TypeError))
True
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PipemarkError",
    "PipemarkWarning",
    "MarkerError",
    "StageGraphError",
    "ProcessError",
    "MemoryBudgetError",
    "DeviceOutOfMemoryError",
    "ExportError",
    "SignatureError",
    "StateMutationError",
    "VerificationError",
    "HostMemoryError",
    "check_closed_jaxpr",
    "describe_eqn",
]


class PipemarkError(Exception):
    """Base class of every error pipemark raises because of its input."""


class MarkerError(PipemarkError, ValueError):
    """A marker is malformed: unknown mark type, unpaired or misnamed start/end markers,
    a marker where it cannot be sliced, or a value that cannot be marked.

    It is also a :class:`ValueError`, which is what the original Alpa functions raised,
    so code written against them keeps working.
    """


class PipemarkWarning(UserWarning):
    """Something pipemark did works but is probably not what was wanted (for example
    an automatic split that cannot balance because one equation is too heavy)."""


class StageGraphError(PipemarkError):
    """The stages cannot form a valid program (for example, they depend on each other
    in a cycle)."""


class ProcessError(PipemarkError):
    """A pipeline running on several processes (``jax.distributed``) lost one: a
    transfer to or from another process failed. The message names the stage, the
    microbatch and the other process."""


class MemoryBudgetError(PipemarkError):
    """No plan the runtime can make keeps every device within the ``memory_budget`` a
    pipeline was given. The message names the device slot, its predicted peak and what
    makes it up, and by how much it is over."""


class DeviceOutOfMemoryError(PipemarkError, MemoryError):
    """A device ran out of memory while a pipeline ran: XLA could not allocate what an
    action's program needs (``RESOURCE_EXHAUSTED``). The message names the stage
    program, the action (stage, microbatch), the device, the bytes
    :meth:`pipemark.Pipeline.memory` predicts there and the device's limit, and what
    to change (a smaller batch, more microbatches, ``memory_budget=``). The caller's
    arrays are left as they were; the XLA error is its ``__cause__``.

    It is also a :class:`MemoryError`, so code that catches running out of memory
    catches it. (Its name was ``DeviceOutOfMemory``, which stays as an alias.)"""


# The class's first name, before every error was named ...Error; kept so that code
# catching it keeps working (not in __all__: new code uses the new name).
DeviceOutOfMemory = DeviceOutOfMemoryError


class HostMemoryError(PipemarkError):
    """State offloaded to host memory (``pipeline_train_step(..., offload=...)``) on a
    backend whose devices have no host memory kind (``pinned_host`` or
    ``unpinned_host`` among ``device.addressable_memories()``), or in a setting where
    offload is not supported yet. The message says what to do instead."""


class ExportError(PipemarkError):
    """A program that cannot be exported, or a directory that is not an export
    :func:`pipemark.load_staged` can read. The message names the program, the step or
    the file."""


class SignatureError(PipemarkError, TypeError):
    """Arguments do not match what a program was traced with (another pytree
    structure, a changed static argument), or static arguments were named wrongly.

    It is also a :class:`TypeError`, what ``jax.jit`` raises for a wrong call."""


class StateMutationError(PipemarkError):
    """The traced function changed its arguments in place; the traced program would
    lose those changes (:func:`pipemark.mutation.call_watching_arguments`)."""


class VerificationError(PipemarkError):
    """A staged program's results differ from the reference's; ``report`` holds the
    :class:`~pipemark.verification.VerifyReport` with every comparison."""

    def __init__(self, message: str, report: Any) -> None:
        super().__init__(message)
        self.report = report


def check_closed_jaxpr(value: Any, who: str) -> Any:
    """``value`` if it is a ``jax.extend.core.ClosedJaxpr``; else a
    :class:`PipemarkError` that says ``who`` takes one and how to get one.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(jnp.sin)(1.0)
    >>> check_closed_jaxpr(cj, "dce") is cj
    True
    >>> check_closed_jaxpr(cj.eqns, "dce")
    Traceback (most recent call last):
    ...
    pipemark.errors.PipemarkError: dce takes a jax.extend.core.ClosedJaxpr, got list; trace your function with jax.make_jaxpr(fn)(*args) first.
    """
    from jax.extend.core import ClosedJaxpr  # here: importing the errors imports no JAX

    if not isinstance(value, ClosedJaxpr):
        raise PipemarkError(
            f"{who} takes a jax.extend.core.ClosedJaxpr, got {type(value).__name__}; "
            "trace your function with jax.make_jaxpr(fn)(*args) first."
        )
    return value


def describe_eqn(eqn, index: int | None = None) -> str:
    """A one-line description of a jaxpr equation for error messages: its index, its
    primitive, its marker name when it has one, and the user's source line when JAX
    recorded one.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(jnp.sin)(1.0)
    >>> describe_eqn(cj.jaxpr.eqns[0], 0).startswith("equation 0 (sin")
    True
    """
    where = f"equation {index}" if index is not None else "equation"
    what = eqn.primitive.name
    params = eqn.params
    if "mark_type" in params and "name" in params:
        what += f" {params['mark_type']} {params['name']!r}"
    line = _source_line(eqn)
    return f"{where} ({what}{', ' + line if line else ''})"


def _source_line(eqn) -> str:
    # JAX keeps a filtered traceback on every traced equation and summarises its first
    # user frame as "file:line:column (function)"; hand-built equations have none.
    from jax.extend import source_info_util

    try:
        line = source_info_util.summarize(eqn.source_info)
    except Exception:  # hand-built equations may carry no traceback at all
        return ""
    return "" if line in ("", "unknown") else line
