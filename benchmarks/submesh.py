"""Benchmark of pipelines whose stages run on sub-meshes (``mesh=``) on 8 host CPU devices.

    python benchmarks/submesh.py           # width 512, 8 layers, batch 256, 8 microbatches
    python benchmarks/submesh.py --quick   # tiny sizes, to check that it runs

The model is ``pipemark.examples.tensor_parallel_mlp``, a residual tanh MLP in
Megatron's tensor-parallel layout: per layer a ``width × width`` matrix split by columns
over ``model`` and one split by rows, the hidden activations constrained
(``with_sharding_constraint``) to ``P("data", "model")``, or ``P("data", None)`` on a
mesh without a model axis; the loss is a mean square error.
Each layout of the 8 devices is a row group: 2 stages × 2 data × 2 model, 4 stages ×
2 data, 2 stages × 4 data; each schedule (GPipe, 1F1B, ZB-H1) a row. It prints one
markdown table, with per row:

* **jit, one stage's mesh**: ``jax.jit(jax.value_and_grad(loss_fn), in_shardings=...)``
  of the same model on a mesh shaped like one stage (``data × model``, 4 devices for
  2 × 2 × 2) — the reference of ``tests/runtime/test_pipeline_mesh.py``;
* **jit, 8 devices**: the same on all 8 devices, the stage axis folded into ``data``
  (equal device count);
* **pipeline**: ``pm.pipeline_value_and_grad(..., mesh=...)`` with ``S`` stages of
  ``layers / S`` layers, its parameters already on their stages' sub-meshes (where a
  training loop keeps them), the batch whole on one device (it is split each call);
  each jit gets its inputs already in its ``in_shardings``. All three are timed side
  by side in one loop, call by call in turn, and the median call counts;
* **simulated**: ``pm.simulate_schedule(plan.schedule, costs)`` with each action's cost
  measured alone (``Pipeline.action_costs``: every action run on its own sub-mesh and
  waited for), and **sum of actions**: the same costs added up, what the step takes if
  no two actions ever overlap. The final gradient reduction over the data axis and the
  placing of each call's batch are not actions, so neither is in either number;
* **bytes moved per step**: what the runtime copied between sub-meshes in the call
  (``timed_call``'s ``bytes_copied``, counted by the in-process transport), against the
  stage graph's **boundary bytes**: each value a stage reads from another sub-mesh's
  stage, once per microbatch and data-parallel replica.

The script sets ``--xla_force_host_platform_device_count=8`` before JAX starts and makes
XLA run each device's computation on one thread (``--xla_cpu_multi_thread_eigen=false``,
as ``benchmarks/runtime.py`` does), so that devices, not intra-op thread pools, share the
cores, the same way for jit and for the pipeline. On a machine with fewer cores than
devices (the development machine has 2) the stages take turns on the cores: an action
measured alone uses every core its sub-mesh can, so the simulation, which lets stages
run side by side, counts on cores the machine lacks; the sum of actions is the step with
no overlap at all, which a call can still exceed there (it also splits and places the
batch and reduces the gradients, and a collective waits until every device of its
sub-mesh gets a core). The comparison of jit and pipeline at equal device count holds
on any machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

LAYOUTS = {
    "2x2x2": ((2, 2, 2), ("stage", "data", "model")),
    "4x2": ((4, 2), ("stage", "data")),
    "2x4": ((2, 4), ("stage", "data")),
}
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _model(args, num_stages: int, hidden):
    """The residual MLP (``pipemark.examples.tensor_parallel_mlp``) cut into
    ``num_stages`` stages of equal layers, its hidden activations constrained to
    ``hidden`` (a ``NamedSharding``)."""
    from pipemark import examples

    return examples.tensor_parallel_mlp(
        args.layers, args.width, args.rows, num_stages=num_stages, hidden_sharding=hidden
    )


def _model_specs(names: tuple[str, ...], layers: int):
    """The hidden activations' spec and the parameter specs (``None``: replicated) on a
    mesh with these axis names."""
    from jax.sharding import PartitionSpec as P

    from pipemark import examples

    if "model" in names:
        return P("data", "model"), examples.tensor_parallel_mlp_specs(layers)
    return P("data", None), None


def _jitted(args, num_stages: int, mesh, params, batch):
    """``jax.jit(jax.value_and_grad(loss_fn))`` on ``mesh`` with the model's shardings,
    and its inputs placed in them."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    hidden, specs = _model_specs(mesh.axis_names, args.layers)
    loss_fn = _model(args, num_stages, NamedSharding(mesh, hidden)).loss_fn
    if specs is None:
        specs = jax.tree_util.tree_map(lambda _: P(), params)
    param_shardings = jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    batch_shardings = (NamedSharding(mesh, P("data")),) * 2
    step = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(param_shardings, batch_shardings))
    placed = jax.device_put((params, batch), (param_shardings, batch_shardings))
    return lambda: step(*placed)


def _boundary_bytes(plan) -> int:
    """The stage graph's boundary bytes per call: each value a stage reads from a stage
    on another slot, once per reading slot, microbatch and replica (the stage programs
    are traced for one replica's rows)."""
    crossing = set()
    for index, unit in plan.units.items():
        stage = plan.staged.stages[index]
        for ref, var in zip(stage.inputs, stage.jaxpr.invars):
            if ref.kind == "stage" and plan.units[ref.stage].worker != unit.worker:
                crossing.add((ref.stage, ref.index, unit.worker, var.aval))
    size = sum(aval.size * aval.dtype.itemsize for *_, aval in crossing)
    return size * plan.schedule.num_microbatches * plan.placement.slots[0].replicas


def _interleaved_medians(calls: dict, repeat: int) -> dict:
    """Each call's median time, the calls timed in turn round after round (after one
    warm-up call each), so that whatever else the machine does lands on all alike."""
    import jax
    import numpy as np

    for call in calls.values():
        jax.block_until_ready(call())
    times: dict = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def _pipeline(layout: str, schedule: str, args, params, batch):
    """The pipeline on ``layout`` and its parameters on their stages' sub-meshes."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import pipemark as pm

    shape, names = LAYOUTS[layout]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
    stage_mesh = Mesh(mesh.devices[0], names[1:])  # how the model itself is written
    hidden, specs = _model_specs(names, args.layers)
    loss_fn = _model(args, shape[0], NamedSharding(stage_mesh, hidden)).loss_fn
    pipe = pm.pipeline_value_and_grad(
        loss_fn,
        num_microbatches=args.microbatches,
        schedule=schedule,
        mesh=mesh,
        param_specs=specs,
    )
    # Gradients come back where the pipeline keeps each parameter.
    _, grads = pipe(params, batch)
    placed = jax.tree_util.tree_map(lambda p, g: jax.device_put(p, g.sharding), params, grads)
    return pipe, placed


def layout_rows(layout: str, args) -> list[str]:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import pipemark as pm

    shape, names = LAYOUTS[layout]
    devices = np.array(jax.devices()[:8])
    stages = shape[0]
    _, params, batch = _model(args, stages, None)
    one_stage = Mesh(devices[: devices.size // stages].reshape(shape[1:]), names[1:])
    folded = (shape[1] * stages, *shape[2:])  # the stage axis folded into data
    all_devices = Mesh(devices.reshape(folded), names[1:])
    calls = {
        "jit": _jitted(args, stages, one_stage, params, batch),
        "jit8": _jitted(args, stages, all_devices, params, batch),
    }
    pipes = {}
    for schedule in SCHEDULES:
        pipe, placed = _pipeline(layout, schedule, args, params, batch)
        pipes[schedule] = (pipe, placed)
        calls[schedule] = lambda pipe=pipe, placed=placed: pipe(placed, batch)
    median = _interleaved_medians(calls, args.repeat)
    rows = []
    for schedule, (pipe, placed) in pipes.items():
        plan = pipe.plan(placed, batch)
        costs = pipe.action_costs(placed, batch, repeat=args.cost_repeat)
        simulated = pm.simulate_schedule(plan.schedule, costs).makespan
        work = args.microbatches * sum(map(sum, costs.values()))
        (_, _), timings = pipe.timed_call(placed, batch)
        step, jit, jit8 = median[schedule], median["jit"], median["jit8"]
        rows.append(
            f"| {' × '.join(map(str, shape))} | {schedule} | {stages} | {args.microbatches} | "
            f"{1e3 * jit:.1f} | {1e3 * jit8:.1f} | {1e3 * step:.1f} | {step / jit:.2f} | "
            f"{step / jit8:.2f} | {1e3 * simulated:.1f} | {step / simulated:.2f} | "
            f"{1e3 * work:.1f} | {timings['bytes_copied']:,} | {_boundary_bytes(plan):,} |"
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=256, help="batch rows per step")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=20, help="timed calls of each")
    parser.add_argument("--cost-repeat", type=int, default=3, help="action_costs' repeat")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.rows, args.microbatches = 32, 4, 32, 2
        args.repeat, args.cost_repeat = 2, 1
    from _host_devices import use_host_devices

    use_host_devices(8)
    import jax

    print(
        f"Residual tanh MLP, Megatron layout: {args.layers} layers of two {args.width}×"
        f"{args.width} matrices, {args.rows} rows per step, {args.microbatches} microbatches; "
        f"8 host devices on {os.cpu_count()} CPU cores, JAX {jax.__version__}, median of "
        f"{args.repeat} calls each, timed in turn"
    )
    print()
    print(
        "| layout (stage × data [× model]) | schedule | S | M | jit, one stage's mesh (ms) "
        "| jit, 8 devices (ms) | pipeline (ms) | pipeline / jit | pipeline / jit 8 "
        "| simulated (ms) | measured / simulated | sum of actions (ms) "
        "| bytes moved per step | boundary bytes per step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for layout in args.layouts:
        for row in layout_rows(layout, args):
            rows.append(row)
            print(row, flush=True)
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    equal = sum(c[-2] == c[-1] for c in cells)
    print()
    print(f"- bytes moved = boundary bytes in {equal} of {len(rows)} rows")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
