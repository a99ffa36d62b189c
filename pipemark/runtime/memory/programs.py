"""The XLA programs a pipeline runs, compiled: :func:`compiled_programs`.

A plan's stage programs are ``jax.jit`` functions that compile on their first call.
:func:`compiled_programs` lowers each program a call dispatches for the argument types
the call gives it (its accumulators, its inputs for one microbatch, the microbatch
scale, all on its device) and returns JAX's ``Compiled`` objects, whose
``memory_analysis()`` (temporaries, argument and output bytes), ``cost_analysis()`` and
``as_text()`` say what XLA made of each stage. JAX keeps one compilation per program and
argument types, so after a call nothing compiles again; before the first call, the
programs it will run are compiled here, and the call then reuses them.

>>> import jax, pipemark as pm
>>> from pipemark import examples
>>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
>>> pipe = pm.pipeline_value_and_grad(
...     loss_fn, num_stages=2, num_microbatches=2, devices=jax.devices()[:2])
>>> programs = compiled_programs(pipe.plan(params, batch))
>>> list(programs)
['layer0', 'layer1+layer1_backward', 'layer0_backward']
>>> programs["layer0"].memory_analysis().temp_size_in_bytes >= 0
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pipemark.errors import PipemarkError
from pipemark.runtime.devices.compilation import ARGUMENT, Combined, Unit
from pipemark.runtime.devices.placement import Slot
from pipemark.runtime.devices.steps import STAGE, Step, program_name
from pipemark.runtime.plan import PipelinePlan

__all__ = ["compiled_programs", "step_program"]


def compiled_programs(plan: PipelinePlan) -> dict[str, jax.stages.Compiled]:
    """Each program a call of ``plan`` dispatches in this process, compiled for the
    arguments the call passes it, in the order of their first dispatch: by stage name
    (``"layer0"``, ``"layer0_backward"``), and the parts' names joined by ``+`` for a
    fused program (:func:`pipemark.runtime.devices.compilation.compile_fused`: a forward and
    its backward, an overlapped pair, a whole backward as its B and W).

    Programs a call has compiled come back from JAX's caches (nothing compiles twice),
    provided the parameters and the batch were on their stage's device as committed
    arrays (``jax.device_put(x, device)``) or were placed there by the runtime; an array
    created on the default device without ``device_put`` is not committed, and JAX
    compiles its program apart for it.

    Raises
    ------
    PipemarkError
        For a plan on sub-meshes (``mesh=``), whose stage programs take a replica axis
        and layouts of their own: not covered yet.
    """
    if plan.placement.meshes:
        raise PipemarkError(
            "compiled_programs covers stages on single devices; this pipeline's stages "
            "run on sub-meshes (mesh=), whose programs it does not lower yet. Build the "
            "pipeline with devices= to read its stage programs."
        )
    names = [stage.name for stage in plan.staged.stages]
    programs: dict[str, jax.stages.Compiled] = {}
    # The layout each handed-over value leaves its program in: a value kept on its slot
    # may leave in XLA's choice (compilation._passed_shardings), and the program that
    # reads it is compiled for that layout, as a call compiles it.
    formats: dict[tuple[int, int, int], Any] = {}  # (stage, output, reading worker)
    for worker, step in plan.steps.serial:
        if not plan.placement.local[worker]:
            continue
        name = program_name(step, names)
        unit, (accs, inputs, scale) = step_program(plan, worker, step)
        if name not in programs:
            inputs = [_arriving(s, w, worker, formats) for s, w in zip(inputs, step.inputs)]
            # Under the mesh context a call walks its steps in (run_plan's), which is
            # part of what JAX keys its compiled programs on.
            with jax.set_mesh(None):
                programs[name] = unit.run.lower(accs, inputs, scale).compile()
        passed_formats = programs[name].output_formats[1]
        for position, (_, stage, output), readers in step.sends:
            # Only values kept on the slot leave in a layout of XLA's choice (JAX 0.10
            # misreports the others' layouts in output_formats; they are the default).
            if all(reader == worker for reader, _ in readers):
                formats[(stage, output, worker)] = passed_formats[position]
    return programs


def _arriving(struct: jax.ShapeDtypeStruct, where: tuple, worker: int, formats: Mapping) -> Any:
    """``struct`` in the layout its value arrives in, where a program on the same
    worker makes it."""
    source, key = where
    found = formats.get((*key[1:], worker)) if source == STAGE else None
    if found is None:
        return struct
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=found)


def step_program(plan: PipelinePlan, worker: int, step: Step) -> tuple[Unit, tuple]:
    """The program worker ``worker`` dispatches for ``step`` (a :class:`Unit`, fused
    where the step is) and the types of the arguments a call passes it:
    ``(accumulators, inputs, scale)``, as :class:`jax.ShapeDtypeStruct` on the
    worker's slot (single-device slots)."""
    slot = plan.placement.slots[worker]
    if step.fused is None:
        unit = plan.units[step.index]
        accs, inputs = _unit_arguments(plan, unit, slot)
    else:
        unit = plan.fused[step.fused]
        accs, inputs = _fused_arguments(plan, step.fused, slot)
    if unit.starts:  # one microbatch: the call passes no accumulators at all
        accs = []
    scale = _struct(jax.ShapeDtypeStruct((), np.float32), slot.replicated)
    return unit, (accs, inputs, scale)


def _struct(aval: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """The type of a value of ``aval`` committed to ``sharding``, as a call passes it."""
    weak = bool(getattr(aval, "weak_type", False))
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=weak)


def _unit_arguments(plan: PipelinePlan, unit: Unit, slot: Slot) -> tuple[list, list]:
    """A stage program's accumulators and inputs, as :class:`jax.ShapeDtypeStruct`."""
    stage = plan.staged.stages[unit.index]
    accs = [_struct(stage.out_avals[o], slot.sharding) for _, o in unit.accumulated]
    inputs = [_struct(v.aval, slot.sharding) for v in stage.jaxpr.invars]
    return accs, inputs


def _fused_arguments(plan: PipelinePlan, combined: Combined, slot: Slot) -> tuple[list, list]:
    """A fused program's accumulators (each part's, in order) and arguments (each the
    type of the first part input that reads it)."""
    accs: list = []
    inputs: dict[int, Any] = {}
    for index, reads in zip(combined.stages, combined.reads):
        part_accs, part_inputs = _unit_arguments(plan, plan.units[index], slot)
        accs += part_accs
        for (source, k), struct in zip(reads, part_inputs):
            if source == ARGUMENT:
                inputs.setdefault(k, struct)
    return accs, [inputs[k] for k in range(len(inputs))]
