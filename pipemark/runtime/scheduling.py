"""The planner's schedule: the :class:`~pipemark.runtime.ScheduleProblem` of a pipeline
(from its pipeline stages, its options and the device slots available) and the
schedule its options name, built for that problem
(:func:`~pipemark.runtime.schedules.registry.build_schedule`, which checks the devices).

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> from pipemark.runtime.pipeline_stages import pipeline_stages
>>> staged = pm.split(jax.grad(lambda x: jnp.sum(jnp.cos(jnp.sin(x)))), jnp.ones(4),
...                   num_stages=2)
>>> options = pm.runtime.PipelineOptions(num_microbatches=4, devices=jax.devices()[:2])
>>> problem, schedule = plan_schedule(pipeline_stages(staged, False), options)
>>> problem.num_devices, problem.activation_bytes, schedule.name
(2, (16, 16), '1f1b')
"""

from __future__ import annotations

from pipemark.runtime.devices.placement import available_slots
from pipemark.runtime.options import PipelineOptions
from pipemark.runtime.pipeline_stages import PipelineStages
from pipemark.runtime.schedules.core import Schedule
from pipemark.runtime.schedules.problem import ScheduleProblem
from pipemark.runtime.schedules.registry import build_schedule

__all__ = ["plan_schedule", "schedule_problem"]


def schedule_problem(stages: PipelineStages, options: PipelineOptions) -> ScheduleProblem:
    """What the pipeline's schedule is built for: its pipeline stages and stage graph,
    the microbatches, whether the backward is split, every available slot, unit times
    (so that a pipeline's schedule does not depend on measurements; measured ones reach
    a builder through :meth:`~pipemark.runtime.ScheduleProblem.with_costs`), the residual
    bytes of each stage, no memory limit (the planner knows none) and the microbatches
    in flight the options ask for."""
    return ScheduleProblem(
        num_stages=len(stages.forward),
        num_microbatches=options.num_microbatches,
        stage_graph=stages.edges,
        splits_backward=options.splits_backward,
        slots=tuple(available_slots(options)),
        activation_bytes=stages.activation_bytes,
        microbatches_in_flight=options.microbatches_in_flight,
    )


def plan_schedule(
    stages: PipelineStages, options: PipelineOptions
) -> tuple[ScheduleProblem, Schedule]:
    """The pipeline's problem and the schedule ``options.schedule`` (a registered name,
    or a :class:`~pipemark.runtime.Schedule`) for it, checked against the devices."""
    problem = schedule_problem(stages, options)
    return problem, build_schedule(options.schedule, problem)
