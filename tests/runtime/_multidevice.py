"""Run pipelines on 4 host CPU devices and print one JSON line per case.

XLA reads ``--xla_force_host_platform_device_count`` only when JAX starts its backend, so
this runs as its own process (see ``test_pipeline.py``): ``python _multidevice.py``.
Importing this module does nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys


def cases():
    """``(name, build, options)`` for every case; ``build()`` makes the example. Cheap:
    nothing is built until ``build`` is called."""
    from pipemark import examples

    # One example per model and batch size, shared by the cases that differ only in
    # stages and schedule, so that its reference is compiled once.
    @functools.cache
    def mlp_example(rows, markers):
        return examples.mlp(num_layers=4, width=8, batch=rows, markers=markers)

    @functools.cache
    def transformer_example(rows):
        return examples.transformer(num_layers=4, d_model=8, num_heads=2, seq=4, batch=rows)

    def mlp(rows, markers="startend"):
        return lambda: mlp_example(rows, markers)

    def transformer(rows):
        return lambda: transformer_example(rows)

    def resnet(rows, route_skips=True):
        return lambda: examples.resnet(
            num_blocks=4, width=8, batch=rows, skip=2, route_skips=route_skips
        )

    def summed(rows):
        def build():
            ex = examples.mlp(num_layers=2, width=8, batch=rows)

            def loss_fn(params, batch):  # a sum over the batch rather than a mean
                return ex.loss_fn(params, batch) * batch[0].shape[0]

            return examples.Example(loss_fn, ex.params, ex.batch)

        return build

    out = []
    for model, build, rows in (("mlp", mlp, 2), ("transformer", transformer, 1)):
        for stages in (2, 4):
            for micro in (1, 4, 8):
                for schedule in ("gpipe", "1f1b"):
                    out.append(
                        (
                            f"{model}-S{stages}-M{micro}-{schedule}",
                            build(rows * micro),
                            dict(num_stages=stages, num_microbatches=micro, schedule=schedule),
                        )
                    )
    for schedule in ("gpipe", "1f1b"):
        out.append(
            (
                f"resnet_skip-S4-M4-{schedule}",
                resnet(8),
                dict(num_microbatches=4, schedule=schedule),
            )
        )
    out += [
        ("resnet_bypass-S4-M4-1f1b", resnet(8, route_skips=False), dict(num_microbatches=4)),
        ("mlp_boundary-S4-M2-1f1b", mlp(4, markers="boundary"), dict(num_microbatches=2)),
        ("mlp_auto-S2-M4-1f1b", mlp(8, markers=None), dict(num_stages=2, num_microbatches=4)),
        (
            "mlp-S4-M4-interleaved2",
            mlp(8),
            dict(num_microbatches=4, schedule="interleaved", devices=2),
        ),
        ("mlp_sum-S2-M4-1f1b", summed(8), dict(num_microbatches=4, loss_reduction="sum")),
    ]
    # Wide enough for XLA's CPU client to run the stage programs asynchronously (it runs
    # programs estimated under 1000 flops inline, on the dispatching thread): the
    # workers then dispatch ahead of the devices and readers get values still being
    # computed, as on an accelerator.
    for schedule in ("gpipe", "1f1b"):
        out += [
            (
                f"mlp_wide-S4-M8-{schedule}",
                lambda: examples.mlp(num_layers=4, width=48, batch=32),
                dict(num_microbatches=8, schedule=schedule),
            ),
            (
                f"resnet_skip_wide-S4-M4-{schedule}",
                lambda: examples.resnet(num_blocks=4, width=48, batch=16, skip=2),
                dict(num_microbatches=4, schedule=schedule),
            ),
        ]
    return out


def train_cases():
    """``(name, optimizer, options)`` for the pipelined training steps."""
    return [
        ("train_sgd-S2-M4-1f1b", "sgd", dict(num_stages=2, num_microbatches=4)),
        ("train_adam-S4-M4-gpipe", "adam", dict(num_microbatches=4, schedule="gpipe")),
    ]


def _run_train_cases(jax, pm) -> None:
    from pipemark import examples

    for name, optimizer, options in train_cases():
        ex = examples.mlp(num_layers=4, width=8, batch=8)
        step, init_state = examples.train_step(ex.loss_fn, optimizer=optimizer)
        state = init_state(ex.params)
        pipelined = pm.pipeline_train_step(step, **options)
        got = pipelined(ex.params, state, ex.batch)
        want = jax.jit(step)(ex.params, state, ex.batch)
        plan = pipelined.plan(ex.params, state, ex.batch)
        print(
            json.dumps(
                {
                    "case": name,
                    "same_structure": jax.tree_util.tree_structure(got)
                    == jax.tree_util.tree_structure(want),
                    "worst": [
                        _worst(g, w)
                        for g, w in zip(
                            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
                        )
                    ],
                    "num_stages": plan.num_stages,
                    "schedule": plan.schedule.name,
                }
            ),
            flush=True,
        )


def _worst(got, want, rtol=1e-5, atol=1e-6):
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got - want) / (atol + rtol * np.abs(want)), initial=0.0))


def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import pipemark as pm

    print(json.dumps({"case": "import", "matplotlib": "matplotlib" in sys.modules}), flush=True)
    import jax

    print(json.dumps({"case": "devices", "count": len(jax.devices())}), flush=True)
    references = {}
    for name, build, options in cases():
        ex = build()
        if "devices" in options:
            options["devices"] = jax.devices()[: options["devices"]]
        pipeline = pm.pipeline_value_and_grad(ex.loss_fn, **options)
        loss, grads = pipeline(*ex.args)
        again, _ = pipeline(*ex.args)  # the compiled plan is reused
        # Keyed by id, so the example is kept alive with its reference: a freed
        # example's id could be reused by the next one.
        _, want = references.get(id(ex), (None, None))
        if want is None:
            want = jax.jit(jax.value_and_grad(ex.loss_fn))(*ex.args)
            references[id(ex)] = (ex, want)
        got_leaves = jax.tree_util.tree_leaves((loss, grads))
        want_leaves = jax.tree_util.tree_leaves(want)
        plan = pipeline.plan(*ex.args)
        grad_devices = sorted({d.id for g in jax.tree_util.tree_leaves(grads) for d in g.devices()})
        print(
            json.dumps(
                {
                    "case": name,
                    "same_structure": jax.tree_util.tree_structure((loss, grads))
                    == jax.tree_util.tree_structure(want),
                    "worst": [_worst(g, w) for g, w in zip(got_leaves, want_leaves)],
                    "repeat_worst": _worst(again, want[0]),
                    "num_stages": plan.num_stages,
                    "schedule": plan.schedule.name,
                    "predecessors": [list(p) for p in plan.schedule.predecessors],
                    "stage_devices": [d.id for d in plan.devices],
                    "grad_devices": grad_devices,
                }
            ),
            flush=True,
        )

    _run_train_cases(jax, pm)


if __name__ == "__main__":
    main()
