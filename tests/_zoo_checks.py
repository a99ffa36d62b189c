"""Run by tests/test_model_zoo.py in a subprocess with 2 host CPU devices (XLA reads the
flag only when JAX starts). For each zoo model (tests/_zoo.py), against JAX's own
jitted ``value_and_grad`` over the whole batch:

- ``split``: ``pm.split`` into two stages (with ``jax_enable_checks``, as in the test
  process), the staged loss against JAX's, and ``staged.verify``;
- ``1f1b`` and ``zb-h1``: ``pm.pipeline_value_and_grad`` over 2 microbatches;
- for the linen model, its optax step: ``pm.split`` and verify, and
  ``pm.pipeline_train_step`` with each schedule, against ``jax.jit(step)``.

One process builds each model and compiles its reference once for all of these (the
zoo's time is mostly XLA compiling). Prints one JSON line per check; a check that
raises prints its traceback instead.

    python tests/_zoo_checks.py                     # every check of every model
    python tests/_zoo_checks.py nnx equinox:zb-h1   # nnx's checks, one of equinox's

tests/test_model_zoo.py asks for the checks its selected tests read: with
``PIPEMARK_CASES=cover`` (conftest.py) fewer than all.
"""

from __future__ import annotations

import os

from tests._xla import xla_flags

if __name__ == "__main__":
    # Optimization level 0 halves XLA's compile time, most of this run's time; the
    # references are compiled with the same flags.
    os.environ["XLA_FLAGS"] = xla_flags(
        "--xla_force_host_platform_device_count=2", "--xla_backend_optimization_level=0"
    )
    os.environ["JAX_PLATFORMS"] = "cpu"

import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable

import jax

import pipemark as pm
from tests import _zoo

SCHEDULES = ("1f1b", "zb-h1")
STEP = "linen-optax-step"


def _stage_names(staged: pm.StagedJaxpr) -> list[str]:
    return [stage.name for stage in staged.stages]


def _checked_split(fn: Callable, *args) -> pm.StagedJaxpr:
    # JAX checks every jaxpr it builds while pipemark traces and cuts, as in the test
    # process (conftest.py); running the stages with checks too took 4 times longer (8 s for
    # the first model, against 2 s).
    jax.config.update("jax_enable_checks", True)
    try:
        return pm.split(fn, *args, num_stages=2)
    finally:
        jax.config.update("jax_enable_checks", False)


def _split(model: _zoo.ZooModel, reference: tuple) -> dict:
    staged = _checked_split(model.loss, model.params, *model.batch)
    (value,) = staged(model.params, *model.batch)
    staged.verify(model.loss, model.params, *model.batch)
    return {
        "stages": _stage_names(staged),
        "value": float(reference[0]),
        "value_worst": _zoo.worst(value, reference[0]),
    }


def _pipeline(model: _zoo.ZooModel, reference: tuple, schedule: str) -> dict:
    pipeline = pm.pipeline_value_and_grad(
        model.loss, num_stages=2, num_microbatches=2, schedule=schedule
    )
    value, grads = pipeline(model.params, *model.batch)
    return {
        "value_worst": _zoo.worst(value, reference[0]),
        "grad_worst": _zoo.worst(grads, reference[1]),
        "num_grads": len(jax.tree_util.tree_leaves(reference[1])),
    }


def _split_step(step: Callable, args: tuple, reference: tuple) -> dict:
    staged = _checked_split(step, *args)
    got = staged(*args)
    # The cut splits the scan over the blocks into one scan a stage; XLA rounds the
    # gradients accumulated over two scans differently from one (1e-9 apart here):
    # verify's default float32 tolerance covers it.
    staged.verify(step, *args)
    return {
        "stages": _stage_names(staged),
        "step_worst": _zoo.worst(list(got), jax.tree_util.tree_leaves(reference)),
    }


def _pipeline_step(step: Callable, args: tuple, reference: tuple, schedule: str) -> dict:
    pipeline = pm.pipeline_train_step(step, num_stages=2, num_microbatches=2, schedule=schedule)
    return {"step_worst": _zoo.worst(pipeline(*args), reference)}


def _report(case: str, check: str, run: Callable[..., dict], *args) -> None:
    start = time.perf_counter()
    try:
        line = {"case": case, "check": check, **run(*args)}
    except Exception as error:  # reported to the test, which fails on it
        trace = "".join(traceback.format_exception(error))
        line = {"case": case, "check": check, "error": trace[-3000:]}
    line["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(line), flush=True)


def _check_model(name: str, checks: set[str]) -> None:
    model = _zoo.BUILDERS[name]()
    reference = model.value_and_grad(model.params, *model.batch)
    if "split" in checks:
        _report(name, "split", _split, model, reference)
    for schedule in SCHEDULES:
        if schedule in checks:
            _report(name, schedule, _pipeline, model, reference, schedule)


def _check_linen_step(checks: set[str]) -> None:
    model = _zoo.BUILDERS["linen-scan-remat"]()
    step, state = _zoo.linen_train_step(model)
    args = (model.params, state, model.batch)
    reference = jax.jit(step)(*args)
    if "split" in checks:
        _report(STEP, "split", _split_step, step, args, reference)
    for schedule in SCHEDULES:
        if schedule in checks:
            _report(STEP, schedule, _pipeline_step, step, args, reference, schedule)


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules)


def wanted(args: list[str]) -> dict[str, set[str]]:
    """The checks to run, by case, from the arguments ``CASE`` (all its checks) or
    ``CASE:CHECK``; none: every check of every case.

    >>> wanted(["nnx:zb-h1", "equinox"])["equinox"] == {"split", *SCHEDULES}
    True
    """
    checks: dict[str, set[str]] = {}
    for arg in args or [*_zoo.BUILDERS, STEP]:
        case, _, check = arg.partition(":")
        if case not in _zoo.BUILDERS and case != STEP:
            raise SystemExit(f"_zoo_checks.py: no case {case!r}: {[*_zoo.BUILDERS, STEP]}")
        checks.setdefault(case, set()).update([check] if check else ["split", *SCHEDULES])
    return checks


def main(args: list[str]) -> None:
    print(json.dumps({"case": "devices", "count": jax.device_count()}), flush=True)
    for case, checks in wanted(args).items():
        if case == STEP:
            if _installed("flax", "optax"):
                _check_linen_step(checks)
        elif _installed(_zoo.LIBRARIES[case]):  # else the test skips it
            _check_model(case, checks)


if __name__ == "__main__":
    main(sys.argv[1:])
