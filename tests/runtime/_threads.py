"""Checks of the threaded dispatch on 4 host CPU devices, one JSON line each; run as its
own process (see ``test_threads.py``) because XLA reads
``--xla_force_host_platform_device_count`` only when JAX starts. Importing this module
does nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _bit_identical(jax, pm, run_plan) -> None:
    import numpy as np

    from pipemark import examples

    cases = [
        ("mlp-S4-M8-1f1b", examples.mlp(num_layers=4, width=8, batch=16), {}),
        ("mlp-S4-M8-gpipe", examples.mlp(num_layers=4, width=8, batch=16), {"schedule": "gpipe"}),
        (
            "transformer-S2-M4-1f1b",
            examples.transformer(num_layers=4, d_model=8, num_heads=2, seq=4, batch=4),
            {"num_stages": 2},
        ),
        ("resnet_skip-S4-M4-1f1b", examples.resnet(num_blocks=4, width=8, batch=8, skip=2), {}),
        (
            "mlp-S4-M4-interleaved",
            examples.mlp(num_layers=4, width=8, batch=8),
            {"schedule": "interleaved", "devices": jax.devices()[:2]},
        ),
    ]
    for name, ex, options in cases:
        micro = 8 if "-M8-" in name else 4
        pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=micro, **options)
        plan = pipeline.plan(*ex.args)
        threaded = jax.tree_util.tree_leaves(run_plan(plan, *ex.args, None))
        serial = jax.tree_util.tree_leaves(run_plan(plan, *ex.args, None, parallel=False))
        _emit(
            case=f"identical/{name}",
            devices=plan.schedule.num_devices,
            leaves=len(serial),
            identical=all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(threaded, serial)
            ),
        )


def _errors(jax, pm) -> None:
    """A stage that raises on its third call, on device 0 (the caller's thread) or on
    another device: the caller gets the error, nothing hangs, and the pipeline still
    works afterwards."""
    from pipemark import examples

    ex = examples.mlp(num_layers=4, width=8, batch=8)
    pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=4)
    plan = pipeline.plan(*ex.args)
    want = pipeline(*ex.args)
    for stage in (0, 2):
        for which in ("forward", "backward"):
            index = (plan.forward_stages if which == "forward" else plan.backward_stages)[stage]
            unit = plan.units[index]
            calls = []

            def failing(accs, inputs, scale, run=unit.run, calls=calls, stage=stage):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError(f"stage {stage} failed on purpose")
                return run(accs, inputs, scale)

            plan.units[index] = dataclasses.replace(unit, run=failing)
            outcome = {}

            def call(outcome=outcome):
                try:
                    pipeline(*ex.args)
                except BaseException as error:
                    outcome["error"] = f"{type(error).__name__}: {error}"

            caller = threading.Thread(target=call, daemon=True)
            caller.start()
            caller.join(timeout=60)
            plan.units[index] = unit
            again = pipeline(*ex.args)
            _emit(
                case=f"error/{which}-stage{stage}",
                hung=caller.is_alive(),
                error=outcome.get("error"),
                threads_left=sorted(
                    t.name for t in threading.enumerate() if t.name.startswith("pipemark")
                ),
                works_again=bool(jax.numpy.allclose(again[0], want[0])),
            )


def _errors_inside_programs(jax, pm) -> None:
    """A stage whose program fails while it runs (its host callback raises, on the third
    microbatch), on device 0 or on another device: results are published before they
    are computed, so the error can surface in a reader or only when the caller waits for
    the accumulators; either way it reaches the caller, nothing hangs, every worker
    stops, and the pipeline works again afterwards."""
    import jax.numpy as jnp
    import numpy as np

    for stage in (0, 1):
        calls = []

        def failing(x, calls=calls, stage=stage):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError(f"stage {stage} callback failed on purpose")
            return np.asarray(x)

        def loss_fn(params, batch, failing=failing, stage=stage):
            x = batch
            for i, w in enumerate(params):
                x, w = pm.mark((x, w), name=f"stage{i}", mark_type="start")
                x = jnp.tanh(x @ w)
                if i == stage:  # a callback has no derivative: keep tangents away from it
                    checked = jax.pure_callback(
                        failing, jax.ShapeDtypeStruct(x.shape, x.dtype), jax.lax.stop_gradient(x)
                    )
                    x = x + 0.0 * checked
                if i == len(params) - 1:
                    x = jnp.mean(x * x)
                x = pm.mark(x, name=f"stage{i}", mark_type="end")
            return x

        params = [jnp.eye(4) * 0.5 for _ in range(3)]
        batch = jnp.ones((8, 4))
        pipeline = pm.pipeline_value_and_grad(loss_fn, num_microbatches=4)
        outcome = {}

        def call(outcome=outcome, pipeline=pipeline, params=params, batch=batch):
            try:
                jax.block_until_ready(pipeline(params, batch))
            except BaseException as error:
                outcome["error"] = f"{type(error).__name__}: {error}"

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(timeout=60)
        calls.clear()
        calls.extend([1] * 10)  # past the failing call
        again = pipeline(params, batch)
        _emit(
            case=f"program-error/stage{stage}",
            hung=caller.is_alive(),
            error=outcome.get("error"),
            threads_left=sorted(
                t.name for t in threading.enumerate() if t.name.startswith("pipemark")
            ),
            works_again=bool(np.isfinite(np.asarray(again[0]))),
        )


def _values_freed(jax, pm) -> None:
    """Every value handed between stages is dropped once its last reader has it: none is
    left after a call, and 1F1B (which runs each backward soon after its forward) holds
    fewer at once than GPipe (which runs every forward first)."""
    from pipemark import examples

    ex = examples.mlp(num_layers=4, width=8, batch=16)
    for schedule in ("gpipe", "1f1b"):
        pipeline = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=8, schedule=schedule)
        for parallel in (True, False):
            timings = {}
            from pipemark.runtime.execution import run_plan

            jax.block_until_ready(
                run_plan(pipeline.plan(*ex.args), *ex.args, timings, parallel=parallel)
            )
            _emit(
                case=f"freed/{schedule}-{'threaded' if parallel else 'serial'}",
                left=timings["values_left"],
                peak=timings["peak_values"],
            )


def _overlap(jax, pm, run_plan) -> None:
    """Four stages that sleep 20 ms per action overlap: the pipeline takes near the ideal
    ``(M + S - 1) · 2t``; walked from one thread, XLA runs much of it one device after
    another."""
    import jax.numpy as jnp

    from pipemark import examples

    stages, micro, seconds = 4, 4, 0.02
    loss_fn, params, _ = examples.sleeping(stages, seconds)
    batch = jnp.ones((2 * micro, 4))
    pipeline = pm.pipeline_value_and_grad(loss_fn, num_microbatches=micro, schedule="gpipe")
    plan = pipeline.plan(params, batch)
    times = {}
    for parallel in (True, False):
        jax.block_until_ready(run_plan(plan, params, batch, None, parallel=parallel))
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(run_plan(plan, params, batch, None, parallel=parallel))
            runs.append(time.perf_counter() - start)
        times[parallel] = min(runs)
    _emit(
        case="overlap",
        threaded_s=times[True],
        single_thread_s=times[False],
        ideal_s=(micro + stages - 1) * 2 * seconds,
        serial_s=micro * stages * 2 * seconds,
    )


def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    import pipemark as pm
    from pipemark.runtime.execution import run_plan

    _emit(case="devices", count=len(jax.devices()))
    _bit_identical(jax, pm, run_plan)
    _errors(jax, pm)
    _errors_inside_programs(jax, pm)
    _values_freed(jax, pm)
    _overlap(jax, pm, run_plan)


if __name__ == "__main__":
    main()
