"""The devices a test runs its pipelines and meshes on: one function, :func:`devices`.

The suite runs on the CPU (``make test``, CI), where conftest.py gives the host platform
8 devices, and on an accelerator (``make test-tpu``), whose default backend may have
fewer (a TPU v5e machine has one chip). A test that needs ``k`` devices takes
``devices(k)``: the default backend's first ``k`` where it has that many (on the CPU:
what ``jax.devices()[:k]`` always gave), else the host CPU platform's, which the
pipeline must then use although JAX's default device is the accelerator's. A test that
compares such a pipeline with JAX's own evaluation computes the reference on the same
platform (:func:`computing_on`): a TPU's float32 arithmetic (``exp``, ``tanh``...)
differs from the CPU's beyond the tests' tolerances.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import pytest

__all__ = ["computing_on", "devices"]


def devices(count: int) -> list[Any]:
    """``count`` devices: the default backend's first ``count`` when it has that many,
    else the host CPU platform's; skips the test when neither has ``count``."""
    default = jax.devices()
    if len(default) >= count:
        return default[:count]
    cpu = jax.devices("cpu")
    if len(cpu) >= count:
        return cpu[:count]
    pytest.skip(
        f"needs {count} devices: the default backend ({jax.default_backend()}) has "
        f"{len(default)}, the host CPU platform {len(cpu)}"
    )


@contextlib.contextmanager
def computing_on(pipeline_devices: Any) -> Iterator[None]:
    """Make the block's new arrays (an example's parameters) and its computations on
    uncommitted arrays (a ``jax.jit`` reference) land on the first of
    ``pipeline_devices``: on the platform the pipeline runs on, which is the default
    backend's unless :func:`devices` fell back to the host CPU's."""
    with jax.default_device(next(iter(pipeline_devices))):
        yield
