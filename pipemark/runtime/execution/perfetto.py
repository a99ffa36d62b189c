"""A traced pipeline call as a Chrome / Perfetto trace (the JSON trace event format):
one track per device slot, one slice per action, and the values handed between devices
as flow arrows (:func:`trace_events`, :func:`write_trace`).

The actions come from :func:`pipemark.runtime.execution.run_plan`'s ``records``: each
action is timed on the host from its inputs computed to its results computed, so a
slice is the action's own time on its device and the gaps are the schedule's bubbles
and the host's dispatching. :meth:`pipemark.Pipeline.trace` makes one; open the file
at https://ui.perfetto.dev or in ``chrome://tracing``. For the device's own view (its
kernels, copies and idle time) take a ``jax.profiler`` trace instead: there each
action's programs show under the action's name (:func:`pipemark.runtime.devices.steps.step_name`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from pipemark.runtime.devices.steps import STAGE, step_name
from pipemark.runtime.execution.run import ActionRecord
from pipemark.runtime.plan import PipelinePlan

__all__ = ["trace_events", "write_trace"]

_PID = 1  # one process in the trace: the pipeline's call


def _microseconds(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _tracks(plan: PipelinePlan) -> list[dict[str, Any]]:
    """A name for the trace and for each device slot's track, in slot order."""
    events = [{"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "pipemark"}}]
    for worker, slot in enumerate(plan.placement.slots):
        devices = ", ".join(str(d) for d in slot.devices)
        stages = [k for k, d in enumerate(plan.schedule.stage_devices) if d == worker]
        label = f"slot {worker}: {devices} (stages {', '.join(map(str, stages))})"
        events.append(
            {"ph": "M", "pid": _PID, "tid": worker, "name": "thread_name", "args": {"name": label}}
        )
        events.append(
            {"ph": "M", "pid": _PID, "tid": worker, "name": "thread_sort_index",
             "args": {"sort_index": worker}}
        )  # fmt: skip
    return events


def trace_events(plan: PipelinePlan, records: Sequence[ActionRecord]) -> dict[str, Any]:
    """The trace of one call of ``plan`` whose actions ``records`` holds: ``{"traceEvents":
    [...], "displayTimeUnit": "ms"}``, times in microseconds from the first action's
    start. A slice (``"ph": "X"``) per action, named by
    :func:`pipemark.runtime.devices.steps.step_name`, with its stage, microbatch and kind in
    ``args``; a flow (``"s"`` at the producer's end, ``"f"`` at the reader's start) per
    value one slot hands another.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> from pipemark.runtime.execution.run import run_plan
    >>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
    >>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2,
    ...                                   devices=jax.devices()[:2])
    >>> records = []
    >>> _ = run_plan(pipe.plan(params, batch), params, batch, None, records=records)
    >>> trace = trace_events(pipe.plan(params, batch), records)
    >>> sorted({e["name"] for e in trace["traceEvents"] if e["ph"] == "X"})[:2]
    ['layer0 mb0', 'layer0 mb1']
    """
    events = _tracks(plan)
    if not records:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = min(r.begin for r in records)
    names = [stage.name for stage in plan.staged.stages]
    producers: dict[Any, ActionRecord] = {}
    for record in records:
        producers.update((key, record) for _, key, _ in record.step.sends)
        step = record.step
        events.append(
            {
                "ph": "X", "pid": _PID, "tid": record.worker, "cat": step.action.kind,
                "name": step_name(step, names),
                "ts": _microseconds(record.begin - origin),
                "dur": _microseconds(record.end - record.begin),
                "args": {"stage": step.action.stage, "microbatch": step.microbatch,
                         "kind": step.action.kind, "fused": step.fused is not None},
            }
        )  # fmt: skip
    events.extend(_flows(records, producers, origin, names))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _flows(
    records: Sequence[ActionRecord], producers: dict, origin: float, names: Sequence[str]
) -> list[dict[str, Any]]:
    """An arrow per value a slot reads from another slot's action."""
    flows: list[dict[str, Any]] = []
    for record in records:
        for source, key in record.step.inputs:
            producer = producers.get(key) if source == STAGE else None
            if producer is None or producer.worker == record.worker:
                continue
            flow = len(flows) // 2
            name = f"{names[key[1]]} output {key[2]} mb{key[0]}"
            # The start lies inside the producer's slice, at its last microsecond or
            # at the reader's start if that is earlier (each thread reads the clock
            # when it wakes, so the reader may see the value first); the end binds to
            # the slice that starts at the reader's start.
            start = max(producer.begin, min(producer.end - 1e-6, record.begin))
            flows.append(
                {"ph": "s", "pid": _PID, "tid": producer.worker, "id": flow, "cat": "transfer",
                 "name": name, "ts": _microseconds(start - origin)}
            )  # fmt: skip
            flows.append(
                {"ph": "f", "bp": "e", "pid": _PID, "tid": record.worker, "id": flow,
                 "cat": "transfer", "name": name, "ts": _microseconds(record.begin - origin)}
            )  # fmt: skip
    return flows


def write_trace(path: str | os.PathLike, trace: dict[str, Any]) -> None:
    """Write ``trace`` (from :func:`trace_events`) to ``path`` as JSON, which Perfetto
    (https://ui.perfetto.dev) and ``chrome://tracing`` open."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(trace, file)
