"""The runtime's part of the differential fuzzer (#24 item 3): random programs of
:mod:`tests._programs` run by ``pm.pipeline_value_and_grad`` with each schedule on 4
host CPU devices, compared with ``jax.value_and_grad`` of the original loss.

XLA reads ``--xla_force_host_platform_device_count`` only when JAX starts, so this runs
as its own process (``python _differential.py``, from ``test_differential.py``) and
prints one JSON line per schedule: the examples run and the first failure, if any (the
shrunk program and the difference). ``PIPEMARK_FUZZ=long`` runs ten times as many.
Importing this module does nothing.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from tests._xla import xla_flags

#: Examples per schedule in the ci profile (each compiles its stages).
EXAMPLES = {"gpipe": 6, "1f1b": 6, "interleaved": 6, "zb-h1": 6, "zb-v": 6}
DEVICES = 4


def _test(schedule: str, examples: int, seen: list):
    import jax
    from hypothesis import HealthCheck, given, reject, seed, settings
    from hypothesis import strategies as st

    import pipemark as pm
    from tests._programs import BATCH, assert_close, inputs, loss_of, recipes

    @seed(int(os.environ.get("PIPEMARK_FUZZ_SEED", "0")))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        recipe=recipes(markers=True, differentiable=True) | recipes(differentiable=True),
        devices=st.integers(1, DEVICES),
        per_device=st.integers(1, 2),
        microbatches=st.sampled_from([m for m in (1, 2, 4) if BATCH % m == 0]),
        fuse_actions=st.sampled_from([1, 2, 4]),
    )
    def test(recipe, devices, per_device, microbatches, fuse_actions):
        params, x = inputs(2)
        if schedule in ("zb-v", "interleaved"):
            devices = min(devices, 2)  # at most 4 stages: tiny programs have few equations
        if schedule == "zb-v":
            num_stages = 2 * devices  # two stages a device, in a V
        elif schedule == "interleaved":
            num_stages = per_device * devices
        else:
            num_stages = devices
        if recipe.marked:
            # a marked program has at least two marked stages; fewer merge them
            num_stages = min(num_stages, 2)
            devices = 1 if schedule in ("zb-v", "interleaved") else num_stages
        pipeline = pm.pipeline_value_and_grad(
            loss_of(recipe),
            num_stages=num_stages,
            num_microbatches=microbatches,
            schedule=schedule,
            devices=jax.devices()[:devices],
            fuse_actions=fuse_actions,
            fuse_min_uses=1,  # every run (random stages are rarely alike)
        )
        try:
            loss, grads = pipeline(params, x)
        except pm.PipemarkError as error:
            if "too few for" not in str(error):
                raise
            reject()  # fewer equations than stages: refused, rightly
        want = jax.value_and_grad(loss_of(recipe))(params, x)
        what = f"pipeline_value_and_grad(schedule={schedule!r}, num_stages={num_stages}, "
        what += f"num_microbatches={microbatches}, fuse_actions={fuse_actions}, fuse_min_uses=1, "
        what += f"{devices} devices)"
        assert_close(jax.tree_util.tree_leaves((loss, grads)), want, what, recipe)
        seen.append(recipe)

    return test


def main() -> None:
    os.environ["XLA_FLAGS"] = xla_flags(f"--xla_force_host_platform_device_count={DEVICES}")
    import warnings

    import pipemark as pm

    # Tiny random programs cannot be balanced; the warning says so, rightly.
    warnings.filterwarnings("ignore", ".*cannot be balanced", pm.PipemarkWarning)
    scale = 10 if os.environ.get("PIPEMARK_FUZZ", "ci") == "long" else 1
    for schedule, examples in EXAMPLES.items():
        seen: list = []
        start = time.perf_counter()
        error = None
        try:
            _test(schedule, examples * scale, seen)()
        except Exception as exc:  # reported to the test, which fails on it
            error = "".join(traceback.format_exception_only(exc))[-6000:]
            if not isinstance(exc, AssertionError):
                error = "".join(traceback.format_exception(exc))[-6000:]
        line = {
            "schedule": schedule,
            "examples": len(seen),
            "seconds": round(time.perf_counter() - start, 1),
            "error": error,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
