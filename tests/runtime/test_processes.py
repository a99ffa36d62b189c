"""pipemark.runtime.devices.processes: the stages' devices across processes, consecutive
stages in one process (the two-process runs of examples/train_minimal.py and
examples/train_lm.py use it for real: tests/test_train_minimal.py,
tests/test_train_lm.py)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import pytest

from pipemark.errors import PipemarkError
from pipemark.runtime import stage_devices


class _Device(NamedTuple):
    process_index: int
    id: int


def _processes(count: int, each: int) -> list[_Device]:
    return [_Device(p, p * each + d) for p in range(count) for d in range(each)]


@pytest.mark.parametrize(
    "stages, processes, each, want",
    [
        (2, 2, 2, [0, 2]),  # a stage a process
        (4, 2, 2, [0, 1, 2, 3]),  # two consecutive stages in each process
        (3, 2, 4, [0, 1, 4]),  # ceil(3 / 2) of the first process, the rest of the next
        (4, 2, 1, [0, 1]),  # fewer devices than stages: a schedule places several a device
    ],
)
def test_consecutive_stages_share_a_process(stages, processes, each, want):
    assert [d.id for d in stage_devices(stages, _processes(processes, each))] == want


def test_one_process_takes_its_first_devices():
    assert stage_devices(3) == jax.devices()[:3]


@pytest.mark.parametrize("stages, devices", [(0, None), (2.0, None), (2, [])])
def test_bad_arguments_are_refused(stages, devices):
    with pytest.raises(PipemarkError, match="stage_devices"):
        stage_devices(stages, devices)
