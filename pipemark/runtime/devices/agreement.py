"""Before processes exchange anything for a pipeline call, they agree on the call.

Under ``jax.distributed`` every process runs the same pipeline call and the transfers
between them are collectives that must match. A process called with another batch
shape, another ``num_microbatches`` or another schedule would build other transfers:
gloo then aborts the job after seconds, or both sides wait on each other until
``timeout_s``. So the first call of each plan first publishes a short summary of the
call on the coordinator's key-value store and reads every other process's; a
difference is a :class:`~pipemark.errors.ProcessError` in every process that names the other
process and what differs. It costs one round trip to the coordinator per process, on
the first call of each input shape only. A process that fails instead of publishing
its summary is named with its error as soon as it has published that
(:mod:`pipemark.failures`), without waiting out the timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import jax

from pipemark._compat import coordination_client
from pipemark.errors import ProcessError
from pipemark.failures import name_failures, peer_failures

__all__ = ["call_summary", "check_agreement", "from_every_process"]

# The n-th plan this process runs across processes; processes call the pipeline in the
# same order, so their n-th plans must describe the same call.
_sequence = itertools.count()
# The n-th exchange of :func:`from_every_process`, counted apart: every process makes
# the same exchanges in the same order (a budget's planning, before any call).
_exchanges = itertools.count()


def call_summary(plan: Any) -> dict[str, str]:
    """What every process must agree on for one call of ``plan``, in words."""
    schedule = plan.schedule
    ticks = json.dumps([[None if a is None else list(a) for a in tick] for tick in schedule.ticks])
    return {
        "the input shapes (parameters, then one microbatch)": ", ".join(
            aval.str_short() for aval in plan.staged.in_avals
        ),
        "num_microbatches": str(schedule.num_microbatches),
        # A digest, not hash(): str hashes differ between processes.
        "the schedule": f"{schedule.name} ({schedule.num_ticks} ticks, "
        f"{hashlib.sha256(ticks.encode()).hexdigest()[:12]})",
        "the stage devices": ", ".join(str(d) for d in plan.devices),
        "loss_reduction": plan.loss_reduction,
        # Gathering results adds transfers at the end of a call.
        "gather_results": str(plan.gather_results),
        # Where a stage spans processes, its reduction is a collective between them
        # at a place in the global order that this option decides.
        "reduce_gradients": plan.reduce_gradients,
    }


def check_agreement(plan: Any, timeout_s: float | None) -> None:
    """Publish ``plan``'s :func:`call_summary` and compare it with every other
    process's; raise :class:`ProcessError` naming the first difference, or the process
    that did not publish within ``timeout_s``. Nothing outside ``jax.distributed``."""
    client = coordination_client()
    if client is None or jax.process_count() == 1:
        return
    number, me = next(_sequence), jax.process_index()
    mine = call_summary(plan)

    def missing(other: int) -> tuple[str, str]:
        return (
            f"process {me}: process {other} did not start pipeline call {number}",
            "it died, hangs, or reused an earlier input shape where this process has a "
            "new one (the processes' calls differ)",
        )

    everyone = _every_process(client, f"pipemark/agree/{number}", mine, timeout_s, missing)
    for other, theirs in enumerate(everyone):
        if other == me:
            continue
        for what, value in mine.items():
            if theirs.get(what) != value:
                raise ProcessError(
                    f"process {me} and process {other} called the pipeline differently: "
                    f"{what} is {value} here but {theirs.get(what)} in process {other}. "
                    "Every process must make the same pipeline calls, with the same "
                    "shapes and options."
                )


def from_every_process(what: str, value: Any, timeout_s: float | None) -> list[Any]:
    """``value`` (anything ``json`` writes) as every process passed it, in process
    order: one round trip to the coordinator. Every process must make the same calls
    in the same order (``what`` says what is exchanged, for the error naming a process
    that did not). Outside ``jax.distributed``: ``[value]``.

    A pipeline whose plan depends on what only this process sees (a
    ``memory_budget``, which counts the arrays lying on this process's devices) makes
    the same plan in every process from what all of them saw.

    >>> from_every_process("the answer", 42, timeout_s=1)
    [42]
    """
    client = coordination_client()
    if client is None or jax.process_count() == 1:
        return [value]
    number, me = next(_exchanges), jax.process_index()

    def missing(other: int) -> tuple[str, str]:
        return (
            f"process {me}: process {other} did not send {what} (exchange {number})",
            "it died, hangs, or plans another pipeline (every process must plan and call "
            "the same pipelines in the same order)",
        )

    return _every_process(client, f"pipemark/exchange/{number}", value, timeout_s, missing)


def _every_process(
    client: Any,
    prefix: str,
    value: Any,
    timeout_s: float | None,
    missing: Callable[[int], tuple[str, str]],
) -> list[Any]:
    """Publish ``value`` under ``prefix`` and read every process's, in process order
    (this process's as the others read it). A process that did not publish raises
    :class:`ProcessError`: ``missing(process)`` gives the message's start and what may
    have happened (:func:`_published`)."""
    me = jax.process_index()
    client.key_value_set(f"{prefix}/{me}", json.dumps(value))
    values = []
    for other in range(jax.process_count()):
        if other == me:
            values.append(json.loads(json.dumps(value)))
            continue
        text = _published(client, f"{prefix}/{other}", me, timeout_s, *missing(other))
        values.append(json.loads(text))
    return values


#: How long one wait for another process's value lasts before looking for a failure.
_SLICE_S = 1.0


def _published(
    client: Any, key: str, me: int, timeout_s: float | None, head: str, guess: str
) -> str:
    """The value another process published under ``key``, waited for up to
    ``timeout_s`` (``None``: an hour) in slices of :data:`_SLICE_S`; between slices, a
    failure another process published (:func:`~pipemark.failures.peer_failures`) ends
    the wait with a :class:`ProcessError` naming it after ``head``. At the end of the
    wait, or at once where the store cannot be reached, the error says ``guess``."""
    wait_s = timeout_s if timeout_s is not None else 3600.0
    deadline = time.monotonic() + wait_s
    while True:
        slice_s = max(0.001, min(_SLICE_S, deadline - time.monotonic()))
        start = time.monotonic()
        try:
            return client.blocking_key_value_get(key, int(1000 * slice_s) or 1)
        except Exception as error:  # the client's own error type differs by jaxlib
            # An error well before the slice's end is no timeout: the store is gone.
            gone = time.monotonic() - start < slice_s / 2
            failed = [] if gone else peer_failures(me, wait_s=0)
            if failed:
                raise ProcessError(f"{head}: {name_failures(failed)}.") from None
            if gone or time.monotonic() >= deadline:
                raise ProcessError(
                    f"{head} within {wait_s:g} s: {guess} ({type(error).__name__})."
                ) from None
