"""Counting XLA compilations in a test: :func:`compilations` lists the programs JAX
compiles while it is open, by the ``jax.monitoring`` event JAX records for each backend
compilation (JAX 0.10 to 0.12 name it alike; a persistent-cache hit records it too)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """A list that fills, while the block runs, with the name of each function JAX
    compiles (``"jit(run)"``)."""
    names: list[str] = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
