"""Run by tests/runtime/test_zero_bubble.py with 4 host CPU devices (XLA reads the flag
only when JAX starts): ZB-H1 and ZB-V pipelines against 1F1B and jax.value_and_grad."""

from __future__ import annotations

import os

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np

import pipemark as pm
from pipemark import examples


def models():
    mlp = examples.mlp(num_layers=4, width=8, batch=8)
    yield "mlp", mlp.loss_fn, mlp.params, mlp.batch
    lm = examples.language_model(
        num_layers=4, vocab=32, d_model=16, num_heads=2, seq=8, batch=8, markers="boundary"
    )
    yield "lm", lm.loss_fn, lm.params, lm.batch


def main() -> None:
    for name, loss_fn, params, batch in models():
        want = jax.tree_util.tree_leaves(jax.value_and_grad(loss_fn)(params, batch))
        reference = None
        for schedule in ("1f1b", "zb-h1", "zb-v"):
            step = pm.pipeline_value_and_grad(
                loss_fn, num_stages=4, num_microbatches=4, schedule=schedule
            )
            got = jax.tree_util.tree_leaves(step(params, batch))
            plan = step.plan(params, batch)
            assert plan.schedule.name == schedule
            assert all(np.allclose(a, b, rtol=2e-5, atol=1e-6) for a, b in zip(got, want))
            if reference is None:
                reference = got
            else:
                # The same equations, each stage accumulating microbatches in order; B and
                # W compile as two XLA programs where 1F1B compiles one, and XLA may fuse
                # a reduction differently in each: equal to the last bits or so.
                assert all(
                    np.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(got, reference)
                ), schedule
                weights = [s.name for s in plan.staged.stages if s.name.endswith("_weight")]
                assert len(weights) == 3, weights  # the first layer's backward is all W
            devices = {"zb-v": 2}.get(schedule, 4)
            assert plan.schedule.num_devices == devices
            # Measured costs, one per stage and kind: W apart only where the backward is
            # split, and none for the first layer (its backward is all W, kept whole).
            costs = step.action_costs(params, batch, repeat=1)
            assert all(len(v) == 4 for v in costs.values())
            assert all(c > 0 for c in costs["forward"] + costs["backward"])
            weights = costs["weight"]
            assert weights[0] == 0 and all(w > 0 for w in weights[1:]) == (schedule != "1f1b")
            assert pm.simulate_schedule(plan.schedule, costs).makespan > 0
            # Measuring leaves the pipeline as it was.
            again = jax.tree_util.tree_leaves(step(params, batch))
            assert all(np.array_equal(a, b) for a, b in zip(again, got))
            if schedule == "zb-h1":
                # A schedule built on the measured costs runs like the named one.
                graph = plan.schedule.stage_graph  # the MLP has a skip connection
                chain = pm.zero_bubble_schedule(4, 4, costs=costs)
                if chain.stage_graph != graph:  # built for another graph: refused
                    other = pm.pipeline_value_and_grad(
                        loss_fn, num_stages=4, num_microbatches=4, schedule=chain
                    )
                    try:
                        other(params, batch)
                        raise AssertionError("a schedule for another stage graph ran")
                    except pm.StageGraphError as error:
                        assert "schedule.stage_graph gives it" in str(error), error
                tuned = pm.zero_bubble_schedule(4, 4, costs=costs, stage_graph=graph)
                mine = pm.pipeline_value_and_grad(
                    loss_fn, num_stages=4, num_microbatches=4, schedule=tuned
                )
                tuned_got = jax.tree_util.tree_leaves(mine(params, batch))
                assert all(np.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(tuned_got, got))
            print(f"{name} {schedule}: ok", flush=True)


if __name__ == "__main__":
    main()
