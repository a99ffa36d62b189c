"""A pipeline written as an export (:mod:`pipemark.exported`): :func:`export_plan` for
:meth:`pipemark.Pipeline.export`, :func:`export_train_step` for
:meth:`pipemark.PipelinedStep.export`.

The programs are the ones a call dispatches: each step's ``jax.jit`` function
(:func:`pipemark.runtime.memory.programs.step_program`), exported for the arguments the call
passes it on its slot (accumulators, inputs for one microbatch, the microbatch scale),
and the zeros its accumulators start from. The steps are the plan's own, in the order a
serial call walks them (:attr:`~pipemark.runtime.devices.steps.Steps.serial`: the same
programs in the same order on each device as the threaded walk, hence the same
results). They read and write these values:

- ``param/<i>``, ``batch/<j>``: the inputs, parameter leaves then whole batch leaves;
- ``batch/<j>/mb<m>``: microbatch ``m`` of batch leaf ``j`` (its ``split`` program cuts
  the leaf into equal parts along its leading axis);
- ``mb<m>/stage/<s>/<o>``: output ``o`` of stage ``s`` for microbatch ``m``;
- ``result/<r>``: the accumulator of result ``r``: its stage's zeros program writes it,
  then each step that adds a microbatch's share writes it anew;
- ``scale/<w>``: what each share is multiplied by on slot ``w`` (a constant);
- for a training step, ``update/<p>``: values its update computes (position ``p`` of
  its table, :class:`~pipemark.runtime.training.update.StageUpdates`).

>>> import tempfile, jax, pipemark as pm
>>> from pipemark import examples
>>> loss_fn, params, batch = examples.mlp(num_layers=2, batch=4)
>>> pipe = pm.pipeline_value_and_grad(loss_fn, num_stages=2, num_microbatches=2,
...                                   devices=jax.devices()[:2])
>>> exported = pipe.export(tempfile.mkdtemp(), params, batch)
>>> list(exported.programs)  # doctest: +NORMALIZE_WHITESPACE
['split0', 'zeros/layer1', 'zeros/layer1_backward', 'zeros/layer0_backward', 'layer0',
 'layer1+layer1_backward', 'layer0_backward']
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipemark.errors import ExportError
from pipemark.exported import (
    ExportedStages,
    ProgramGraph,
    aval_entry,
    constant_entry,
    export_program,
    stage_markers,
    write_export,
)
from pipemark.runtime.devices.compilation import Unit
from pipemark.runtime.devices.steps import BATCH, PARAM, program_name
from pipemark.runtime.memory.programs import step_program
from pipemark.runtime.plan import PipelinePlan
from pipemark.runtime.schedules.core import Schedule

__all__ = ["export_plan", "export_train_step", "leaf_names", "plan_graph", "schedule_entry"]


def leaf_names(prefix: str, tree: Any) -> list[str]:
    """A name per leaf of ``tree``: ``prefix`` and the leaf's key path.

    >>> leaf_names("params", {"w": 1, "b": [2, 3]})
    ["params['b'][0]", "params['b'][1]", "params['w']"]
    """
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [prefix + jax.tree_util.keystr(path) for path, _ in paths]


def schedule_entry(schedule: Schedule) -> dict[str, Any]:
    """The schedule as the manifest holds it: its name, sizes, stage devices and stage
    graph, and its table as ``csv`` in ``torch.distributed.pipelining``'s grammar
    (:meth:`~pipemark.runtime.Schedule.to_csv`, compute only), which
    :func:`pipemark.runtime.schedule_from_csv` and torch's ``_load_csv`` read back.

    >>> import pipemark as pm
    >>> entry = schedule_entry(pm.runtime.one_f_one_b_schedule(2, 4))
    >>> entry["name"], entry["stage_devices"], entry["predecessors"]
    ('1f1b', [0, 1], [[], [0]])
    """
    entry: dict[str, Any] = {
        "name": schedule.name,
        "num_microbatches": schedule.num_microbatches,
        "stage_devices": list(schedule.stage_devices),
        "predecessors": [list(p) for p in schedule.predecessors],
    }
    entry["csv"] = schedule.to_csv()
    return entry


def export_plan(
    plan: PipelinePlan,
    directory: str | Path,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> ExportedStages:
    """Write ``plan`` (a :class:`~pipemark.runtime.PipelinePlan` on single devices, in
    one process) to ``directory``: a callable of the parameter leaves and the whole
    batch's leaves that returns the accumulated results (the loss, the gradients) as a
    call of the pipeline does, from the same programs in the same order."""
    graph = plan_graph(plan, "pipeline", input_names, output_names)
    return write_export(graph, directory)


def plan_graph(
    plan: PipelinePlan,
    kind: str,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> ProgramGraph:
    """The :class:`~pipemark.exported.ProgramGraph` of ``plan``'s call (see the module
    docstring for its values)."""
    _check_exportable(plan)
    staged, micro = plan.staged, plan.schedule.num_microbatches
    num_params = plan.num_param_leaves
    names = input_names or [
        f"params[{i}]" if i < num_params else f"batch[{i - num_params}]"
        for i in range(len(staged.invars))
    ]
    graph = ProgramGraph(kind=kind, inputs=[], outputs=[], programs={}, steps=[])
    for i, var in enumerate(staged.invars):
        aval = var.aval
        if i >= num_params:  # the whole batch: the program sees one microbatch of it
            aval = aval.update(shape=(aval.shape[0] * micro, *aval.shape[1:]))
        value = f"param/{i}" if i < num_params else f"batch/{i - num_params}"
        graph.inputs.append({"value": value, "name": names[i], "aval": aval_entry(aval)})
    slots = plan.placement.slots
    graph.slots = [{"platform": s.device.platform, "id": s.device.id} for s in slots]
    for w, slot in enumerate(slots):
        scale = np.float32(plan.device_scale(slot))
        graph.constants.append(constant_entry(f"scale/{w}", scale, jax.typeof(scale)))
    _add_splits(plan, graph)
    _add_zeros(plan, graph)
    _add_steps(plan, graph)
    results = output_names or [f"result[{r}]" for r in range(len(staged.outputs))]
    graph.outputs = [{"value": f"result/{r}", "name": results[r]} for r in range(len(results))]
    graph.about = _about(plan)
    return graph


def _check_exportable(plan: PipelinePlan) -> None:
    if plan.placement.meshes or plan.placement.distributed:
        raise ExportError(
            "Export covers pipelines of single devices in one process; this one runs on "
            "sub-meshes (mesh=) or several processes (jax.distributed). Build it with "
            "devices= in one process to export its programs."
        )
    for r, ref in enumerate(plan.staged.outputs):
        if ref.kind != "stage":
            raise ExportError(
                f"Result {r} of this pipeline is {ref}, not a stage's output: the call "
                "adds it up on the host, which an export has no step for."
            )


def _add_splits(plan: PipelinePlan, graph: ProgramGraph) -> None:
    """A step cutting each batch leaf into its microbatches (none for one microbatch,
    where the leaf is its own microbatch). Slicing copies values exactly: any program
    that cuts equal parts gives the runtime's microbatches bit for bit."""
    micro = plan.schedule.num_microbatches
    if micro == 1:
        return
    programs: dict[Any, str] = {}  # one program per leaf type
    for j, entry in enumerate(graph.inputs[plan.num_param_leaves :]):
        aval = entry["aval"]
        key = (tuple(aval["shape"]), aval["dtype"])
        if key not in programs:
            name = programs[key] = f"split{len(programs)}"
            struct = jax.ShapeDtypeStruct(key[0], jnp.dtype(key[1]))
            split = jax.jit(lambda x: tuple(jnp.split(x, micro)))
            graph.programs[name] = export_program(name, split, struct)
        graph.steps.append(
            {
                "program": programs[key],
                "reads": [f"batch/{j}"],
                "writes": [f"batch/{j}/mb{m}" for m in range(micro)],
                "slot": None,
            }
        )


def _accumulators(unit: Unit) -> list[str]:
    return [f"result/{r}" for r, _ in unit.accumulated]


def _add_zeros(plan: PipelinePlan, graph: ProgramGraph) -> None:
    """A step per accumulating stage writing the zeros its accumulators start from."""
    for index, unit in sorted(plan.units.items()):
        if unit.zeros is None:
            continue
        name = f"zeros/{plan.staged.stages[index].name}"
        with jax.set_mesh(None):  # as the plan made them
            graph.programs[name] = export_program(name, unit.zeros)
        graph.steps.append(
            {"program": name, "reads": [], "writes": _accumulators(unit), "slot": unit.worker}
        )


def _add_steps(plan: PipelinePlan, graph: ProgramGraph) -> None:
    """The schedule's steps, each running the program the runtime dispatches for it."""
    names = [stage.name for stage in plan.staged.stages]
    whole = plan.schedule.num_microbatches == 1
    for worker, step in plan.steps.serial:
        unit, arguments = step_program(plan, worker, step)
        name = program_name(step, names)
        if name not in graph.programs:
            # Under the mesh context a call walks its steps in (see run_plan).
            with jax.set_mesh(None):
                graph.programs[name] = export_program(name, unit.run, *arguments)
        inputs = []
        for source, where in step.inputs:
            if source == PARAM:
                inputs.append(f"param/{where}")
            elif source == BATCH:  # (leaf, microbatch): a fused step's parts may differ
                leaf, m = where
                inputs.append(f"batch/{leaf}" if whole else f"batch/{leaf}/mb{m}")
            else:
                inputs.append("mb{}/stage/{}/{}".format(*where))
        accumulators = _accumulators(unit)
        # The values the program returns, in order: one per send (a fused program returns
        # only what leaves it).
        passed = ["mb{}/stage/{}/{}".format(*key) for _, key, _ in sorted(step.sends)]
        graph.steps.append(
            {
                "program": name,
                "reads": [*([] if unit.starts else accumulators), *inputs, f"scale/{worker}"],
                "writes": [*accumulators, *passed],
                "slot": worker,
            }
        )


def _about(plan: PipelinePlan) -> dict[str, Any]:
    """What the manifest says about the pipeline around its programs."""
    stages = []
    for index, stage in enumerate(plan.staged.stages):
        unit = plan.units.get(index)
        stages.append(
            {
                "name": stage.name,
                "role": {"kind": stage.role.kind, "owner": stage.role.owner},
                "slot": None if unit is None else unit.worker,
                "inputs": [
                    {"kind": ref.kind, "index": ref.index}
                    if ref.kind == "input"
                    else {"kind": "stage", "stage": ref.stage, "index": ref.index}
                    for ref in stage.inputs
                ],
                "markers": stage_markers(stage.closed_jaxpr),
            }
        )
    pipeline = {
        "num_microbatches": plan.schedule.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "num_param_leaves": plan.num_param_leaves,
        "loss_reduction": plan.loss_reduction,
        "forward_stages": list(plan.forward_stages),
        "backward_stages": list(plan.backward_stages),
        "weight_stages": list(plan.weight_stages),
        "rematerialized": sorted(plan.rematerialized),
    }
    return {"stages": stages, "pipeline": pipeline, "schedule": schedule_entry(plan.schedule)}


def export_train_step(
    plan: PipelinePlan,
    parts: Sequence[Any],
    directory: str | Path,
    *,
    num_outputs: int,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> ExportedStages:
    """Write a training step to ``directory``: its gradient part ``plan`` as
    :func:`export_plan` does, then its update ``parts`` (each with the ``worker`` it
    runs on, its ``program``, its jitted ``run``, the table ``inputs`` it reads laid out
    by ``shardings``, and the ``outputs`` it computes: see
    :class:`~pipemark.runtime.training.update.StageUpdates`), whose first ``num_outputs`` results
    are the step's."""
    graph = plan_graph(plan, "train_step", input_names)
    num_args = len(plan.staged.invars)  # the step's argument leaves: the plan's inputs
    num_inputs = num_args + len(plan.staged.outputs)

    def value(position: int) -> str:
        if position < num_args:
            return graph.inputs[position]["value"]
        if position < num_inputs:
            return f"result/{position - num_args}"
        return f"update/{position}"

    for n, part in enumerate(parts):
        name = f"update/{n}"
        structs = [
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)
            for aval, sharding in zip(part.program.in_avals, part.shardings)
        ]
        with jax.set_mesh(None):  # as the step runs it
            graph.programs[name] = export_program(name, part.run, *structs)
        graph.steps.append(
            {
                "program": name,
                "reads": [value(p) for p in part.inputs],
                "writes": [value(p) for p in part.outputs],
                "slot": part.worker,
            }
        )
    names = output_names or [f"result[{k}]" for k in range(num_outputs)]
    graph.outputs = [{"value": value(num_inputs + k), "name": names[k]} for k in range(num_outputs)]
    return write_export(graph, directory)
