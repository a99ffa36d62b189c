"""Which devices a pipeline's stages run on when several processes run it:
:func:`stage_devices` keeps consecutive stages in one process, so that the values
between them cross processes as seldom as the layout allows.

>>> import jax
>>> from pipemark.runtime.devices.processes import stage_devices
>>> stage_devices(2) == jax.devices()[:2]  # one process: its first devices
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from pipemark.errors import PipemarkError

__all__ = ["stage_devices"]


def stage_devices(num_stages: int, devices: Sequence[Any] | None = None) -> list[Any]:
    """The devices for ``num_stages`` stages, one a stage, consecutive stages in one
    process: the first ``ceil(num_stages / processes)`` of each process's ``devices``
    (default ``jax.devices()``, every process's), in process order. Pass the list as
    ``devices=`` of :func:`pipemark.pipeline_train_step` (or
    :func:`pipemark.pipeline_value_and_grad`); every process computes the same list.

    Where the processes have fewer devices than that, the list is shorter than
    ``num_stages``: a schedule with several stages a device (``"interleaved"``,
    ``"zb-v"``) then places the stages on them.

    >>> import jax
    >>> from pipemark.runtime import stage_devices
    >>> [d.id for d in stage_devices(3, jax.devices()[:4])]  # one process, 4 devices
    [0, 1, 2]
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise PipemarkError(
            f"stage_devices: num_stages must be a positive int, got {num_stages!r}."
        )
    by_process: dict[int, list[Any]] = {}
    for device in jax.devices() if devices is None else devices:
        by_process.setdefault(device.process_index, []).append(device)
    if not by_process:
        raise PipemarkError("stage_devices: devices is empty; give at least one jax device.")
    per_process = -(-num_stages // len(by_process))
    chosen = [d for p in sorted(by_process) for d in by_process[p][:per_process]]
    return chosen[:num_stages]
