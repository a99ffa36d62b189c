"""Run by tests/test_model_zoo.py with 2 host CPU devices (XLA reads the flag only when
JAX starts): each zoo model (tests/_zoo.py) through pm.pipeline_value_and_grad with the
1F1B and ZB-H1 schedules, and the linen optax step through pm.pipeline_train_step,
against JAX's own value_and_grad (and step) over the whole batch. Prints one JSON line
per case; a case that raises prints its error instead."""

from __future__ import annotations

import os

if __name__ == "__main__":
    # Optimization level 0 halves XLA's compile time, most of this run's time; the
    # references are compiled with the same flags.
    os.environ["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import importlib.util
import json
import sys
import time
import traceback

import jax

import pipemark as pm
from tests import _zoo

SCHEDULES = ("1f1b", "zb-h1")


def _run_case(model: _zoo.ZooModel, schedule: str) -> dict:
    pipeline = pm.pipeline_value_and_grad(
        model.loss, num_stages=2, num_microbatches=2, schedule=schedule
    )
    value, grads = pipeline(model.params, *model.batch)
    want_value, want_grads = model.value_and_grad(model.params, *model.batch)
    return {
        "value_worst": _zoo.worst(value, want_value),
        "grad_worst": _zoo.worst(grads, want_grads),
        "num_grads": len(jax.tree_util.tree_leaves(want_grads)),
    }


def _run_train_step(model: _zoo.ZooModel, schedule: str) -> dict:
    step, state = _zoo.linen_train_step(model)
    pipeline = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, schedule=schedule)
    got = pipeline(model.params, state, model.batch)
    want = jax.jit(step)(model.params, state, model.batch)
    return {"step_worst": _zoo.worst(got, want)}


def _report(case: str, run, model: _zoo.ZooModel, schedule: str) -> None:
    start = time.perf_counter()
    try:
        line = {"case": case, "schedule": schedule, **run(model, schedule)}
    except Exception as error:  # reported to the test, which fails on it
        trace = traceback.format_exception(error)
        line = {"case": case, "schedule": schedule, "error": "".join(trace)[-3000:]}
    line["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(line), flush=True)


def main(names: list[str]) -> None:
    print(json.dumps({"case": "devices", "count": jax.device_count()}), flush=True)
    for name in names or list(_zoo.BUILDERS):
        if importlib.util.find_spec(_zoo.LIBRARIES[name].split(".")[0]) is None:
            continue  # the test skips it
        model = _zoo.BUILDERS[name]()
        for schedule in SCHEDULES:
            _report(name, _run_case, model, schedule)
            if name == "linen-scan-remat":
                _report("linen-optax-step", _run_train_step, model, schedule)


if __name__ == "__main__":
    main(sys.argv[1:])
