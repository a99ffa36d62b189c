"""Run by tests/runtime/test_distributed.py in several processes (``python -m
pipemark.launch``) or in one (``reference``): an MLP and the demo's transformer
language model: the MLP with GPipe, 1F1B, interleaved (two stages per process) and
ZB-H1 (backward split into B and W), the
language model with GPipe and 1F1B; their losses and gradients saved per process; and
a training step clipped by the global norm, each process updating its own stages.

    python tests/runtime/_distributed.py OUT_DIR run        # under pipemark.launch
    python tests/runtime/_distributed.py OUT_DIR reference  # one process, N devices
    python tests/runtime/_distributed.py OUT_DIR die        # process 1 dies first
    python tests/runtime/_distributed.py OUT_DIR raise      # process 1 raises first
    python tests/runtime/_distributed.py OUT_DIR absent     # process 1 never calls
    python tests/runtime/_distributed.py OUT_DIR spare      # one stage fewer than processes
    python tests/runtime/_distributed.py OUT_DIR shape      # process 1's batch differs
    python tests/runtime/_distributed.py OUT_DIR schedule   # process 1's schedule differs
    python tests/runtime/_distributed.py OUT_DIR overlap    # process 1's first forward waits
    python tests/runtime/_distributed.py OUT_DIR bare       # CollectiveTransport alone
"""

from __future__ import annotations

import os
import sys
import threading
import time

from tests._xla import xla_flags


def _setup() -> tuple[str, str, int]:
    """Read the arguments; start jax.distributed (or ask for N CPU devices) before JAX
    starts its backend."""
    out, mode = sys.argv[1], sys.argv[2]
    stages = int(os.environ.get("PIPEMARK_NUM_PROCESSES", sys.argv[3] if len(sys.argv) > 3 else 2))
    os.environ["JAX_PLATFORMS"] = "cpu"
    if mode == "reference":
        os.environ["XLA_FLAGS"] = xla_flags(f"--xla_force_host_platform_device_count={stages}")
    else:
        from pipemark.launch import initialize

        initialize()
    return out, mode, stages


if __name__ == "__main__":
    OUT, MODE, STAGES = _setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pipemark as pm  # noqa: E402
from pipemark import examples  # noqa: E402

TIMEOUT = float(os.environ.get("PIPEMARK_TEST_TIMEOUT", "60"))
OVERLAP_WAIT_S = 3.0


#: The (model, schedule) pairs each process count runs (CI time: the two launches
#: share the work). Two processes: every schedule on the MLP. Four: the schedules with
#: two stages per device (interleaved, ZB-V) and 1F1B on the MLP, GPipe and 1F1B on the
#: language model.
PLANNED = {
    2: tuple(("mlp", s) for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")),
    4: (("mlp", "1f1b"), ("mlp", "interleaved"), ("mlp", "zb-v"), ("lm", "gpipe"), ("lm", "1f1b")),
}


def runs():
    """(name, loss, params, batch, schedule, stages) of :data:`PLANNED` for this process
    count: the MLP with two stages per device when interleaved or ZB-V."""
    models = {
        "mlp": examples.mlp(num_layers=2 * STAGES, width=16, batch=8),
        "lm": examples.language_model(
            num_layers=4, vocab=32, d_model=16, num_heads=2, seq=8, batch=8, markers="boundary"
        ),
    }
    for name, schedule in PLANNED[STAGES]:
        model = models[name]
        stages = 2 * STAGES if name == "mlp" and schedule in ("interleaved", "zb-v") else STAGES
        yield name, model.loss_fn, model.params, model.batch, schedule, stages


def _watchdog_threads() -> int:
    return sum(t.name == "pipemark-watchdog" for t in threading.enumerate())


def spare() -> None:
    """A pipeline of one stage fewer than there are processes: the last owns no stage
    and still returns the whole result. Saved next to JAX's own value_and_grad."""
    mlp = examples.mlp(num_layers=STAGES - 1, width=16, batch=8)
    step = pm.pipeline_value_and_grad(
        mlp.loss_fn, num_stages=STAGES - 1, num_microbatches=2, schedule="1f1b", timeout_s=TIMEOUT
    )
    got = jax.tree_util.tree_leaves(step(mlp.params, mlp.batch))
    want = jax.tree_util.tree_leaves(jax.jit(jax.value_and_grad(mlp.loss_fn))(*mlp.args))
    saved = {f"got-{i}": np.asarray(v) for i, v in enumerate(got)}
    saved.update({f"want-{i}": np.asarray(v) for i, v in enumerate(want)})
    np.savez(os.path.join(OUT, f"{MODE}-{jax.process_index()}.npz"), **saved)


def overlap(me: int) -> None:
    """Two stages under GPipe, one per process; in the second call (the first compiles)
    process 1's first forward waits ``OVERLAP_WAIT_S`` in a host callback. Saved: when
    each of process 0's forwards ran, and when process 1's wait ended (one clock: the
    processes share the machine)."""
    from jax import lax

    armed, times = [False], []

    def mark_time(h):
        if armed[0]:
            if me == 1 and not times:
                time.sleep(OVERLAP_WAIT_S)
            times.append(time.time())
        return np.zeros(h.shape, h.dtype)

    def loss_fn(params, x):
        for i, w in enumerate(params):
            x, w = pm.mark((x, w), name=f"s{i}", mark_type="start")
            h = jnp.tanh(x @ w)
            # pure_callback has no derivative: call it on a value without one.
            zero = jax.pure_callback(
                mark_time, jax.ShapeDtypeStruct(h.shape, h.dtype), lax.stop_gradient(h)
            )
            x = pm.mark(h + zero, name=f"s{i}", mark_type="end")
        return jnp.mean(x**2)

    params = [jnp.eye(16) * (0.5 + i) for i in range(2)]
    batch = jnp.ones((8, 16))
    step = pm.pipeline_value_and_grad(
        loss_fn, num_stages=2, num_microbatches=4, schedule="gpipe", timeout_s=TIMEOUT
    )
    jax.block_until_ready(step(params, batch))
    armed[0] = True
    jax.block_until_ready(step(params, batch))
    np.save(os.path.join(OUT, f"{MODE}-{me}.npy"), np.asarray(times))


def bare_values(call: int) -> list:
    """What process 0 sends process 1 in ``bare``'s transfer ``call``: a float block, an
    int32 scalar and a float16 matrix."""
    return [
        np.arange(16, dtype=np.float32) * (call + 1),
        np.int32(7 - call),
        (np.arange(6).reshape(2, 3) + call).astype(np.float16),
    ]


def bare(me: int) -> None:
    """``CollectiveTransport.send`` in process 0 and ``receive`` in process 1, outside
    any pipeline call and from different lines of this script (on JAX 0.12.1 that hung
    while the programs carried the caller's line), twice with the same types, once
    with others; process 1 saves what it received."""
    from pipemark.runtime.devices.transport import CollectiveTransport, Watchdog

    source, target = jax.devices()[:2]
    transport = CollectiveTransport(Watchdog(TIMEOUT, me), me)
    received = {}
    for call in range(3):
        values = bare_values(call)[: 3 if call < 2 else 2]
        if me == 0:
            placed = [jax.device_put(v, source) for v in values]
            transport.send(placed, source, target, "the values")
        else:
            types = [(np.shape(v), np.asarray(v).dtype) for v in values]
            got = transport.receive(types, source, target, "the values")
            received.update({f"{call}-{i}": np.asarray(v) for i, v in enumerate(got)})
    if me == 1:
        np.savez(os.path.join(OUT, "bare-1.npz"), **received)


def mismatched(me: int) -> None:
    """Process 1 calls with another batch size (``shape``) or schedule (``schedule``)."""
    rows = 8 if MODE == "schedule" or me == 0 else 12
    mlp = examples.mlp(num_layers=STAGES, width=16, batch=rows)
    schedule = "gpipe" if MODE == "schedule" and me == 1 else "1f1b"
    step = pm.pipeline_value_and_grad(
        mlp.loss_fn, num_stages=STAGES, num_microbatches=4, schedule=schedule, timeout_s=TIMEOUT
    )
    step(mlp.params, mlp.batch)


def save_call(saved: dict, key: str, result, timings: dict, plan) -> None:
    """Store a call's loss and gradients (``key-0``, ``key-1``…), the bytes this process
    received between stages (``key-received``) and those ``plan``'s stage graph says
    cross into its stages from other processes (``key-expected``)."""
    for i, leaf in enumerate(jax.tree_util.tree_leaves(result)):
        saved[f"{key}-{i}"] = np.asarray(jax.device_get(leaf))
    saved[f"{key}-received"] = np.asarray(timings.get("bytes_received", 0))
    saved[f"{key}-expected"] = np.asarray(plan.bytes_into_process(jax.process_index()))


def save_held(saved: dict, key: str, result, timings: dict) -> None:
    """Store a call made with ``gather_results=False``: each leaf this process holds
    (``key-i``), the shape of each it does not (``key-i-elsewhere``: an array of the
    global program held by another process), and the bytes gathered (``key-gathered``)."""
    for i, leaf in enumerate(jax.tree_util.tree_leaves(result)):
        if leaf.is_fully_addressable:
            saved[f"{key}-{i}"] = np.asarray(jax.device_get(leaf))
        else:
            assert not leaf.addressable_shards, leaf.sharding  # no data here
            saved[f"{key}-{i}-elsewhere"] = np.asarray((*leaf.shape, np.dtype(leaf.dtype).num))
    saved[f"{key}-gathered"] = np.asarray(timings.get("bytes_gathered", 0))


#: The global-norm threshold of the training step: below the gradients' norm, so it clips.
CLIP = 0.01


def clipped_step(loss_fn):
    """A training step with momentum, its gradients clipped by their global norm (written
    with jnp: every stage's sum of squares is needed by every stage's update), returning
    the new parameters and momentum, the loss and the norm."""
    tree_map = jax.tree_util.tree_map

    def step(params, momentum, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = pm.mark_gradient(grads)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        scale = jnp.minimum(1.0, CLIP / norm)
        momentum = tree_map(lambda m, g: 0.9 * m + scale * g, momentum, grads)
        params = tree_map(lambda p, m: p - 0.1 * m, params, momentum)
        return params, momentum, loss, norm

    return step


def train(saved: dict) -> None:
    """Two training steps with ``gather_results=False``, one stage per process, the
    second from the state the first returned, the state donated (each process donates
    its own stages' parameters and momentum to its part of the update): what this
    process holds of the second's results (``train-i``; ``train-i-elsewhere``, the
    shape of one it does not hold), ``jax.jit`` of the step in this process alone
    (``train-want-i``, computed first: the pipeline deletes what it donates), and the
    bytes the second step gathered and received for the update."""
    mlp = examples.mlp(num_layers=STAGES, width=16, batch=8)
    step = clipped_step(mlp.loss_fn)
    state = (mlp.params, jax.tree_util.tree_map(lambda p: 0.1 * p, mlp.params))
    reference = jax.jit(step)
    want = reference(*reference(*state, mlp.batch)[:2], mlp.batch)
    pipelined = pm.pipeline_train_step(
        step,
        num_stages=STAGES,
        num_microbatches=2,
        timeout_s=TIMEOUT,
        gather_results=False,
        donate=True,
    )
    first = pipelined(*state, mlp.batch)
    saved["train-deleted"] = np.asarray([x.is_deleted() for x in jax.tree_util.tree_leaves(state)])
    got, timings = pipelined.timed_call(*first[:2], mlp.batch)
    for i, w in enumerate(jax.tree_util.tree_leaves(want)):
        saved[f"train-want-{i}"] = np.asarray(w)
    save_held(saved, "train", got, timings)
    saved["train-update-bytes"] = np.asarray(timings["update_bytes_received"])


def main() -> None:
    me = jax.process_index()
    if MODE == "absent" and me == 1:
        os._exit(3)  # never calls the pipeline
    if MODE == "die" and me == 1:
        # Die after the processes agreed on the call (pipemark.runtime.devices.agreement), before
        # the first transfer: the pipeline makes its transfers' watchdog right then.
        from pipemark.runtime import plan

        plan.Watchdog = lambda *args: os._exit(3)
    if MODE == "raise" and me == 1:
        # Raise at the same point: pipemark.failures publishes the error for process 0.
        from pipemark.runtime import plan

        def boom(*args):
            raise ValueError("boom in process 1\nthe rest of the message")

        plan.Watchdog = boom
    if MODE == "spare":
        return spare()
    if MODE in ("shape", "schedule"):
        return mismatched(me)
    if MODE == "overlap":
        return overlap(me)
    if MODE == "bare":
        return bare(me)
    saved = {}
    for name, loss_fn, params, batch, schedule, stages in runs():
        options = dict(num_stages=stages, num_microbatches=4, schedule=schedule, timeout_s=TIMEOUT)
        step = pm.pipeline_value_and_grad(loss_fn, **options)
        (loss, grads), timings = step.timed_call(params, batch)
        # Later calls reuse the plan's watchdog: no thread is left behind per call.
        watchdogs = _watchdog_threads()
        jax.block_until_ready(step(params, batch))
        assert _watchdog_threads() == watchdogs, (watchdogs, _watchdog_threads())
        save_call(saved, f"{name}-{schedule}", (loss, grads), timings, step.plan(params, batch))
        if schedule in ("1f1b", "zb-v") and name == "mlp":
            # The same, each process keeping its own stages' results.
            held = pm.pipeline_value_and_grad(loss_fn, **options, gather_results=False)
            result, timings = held.timed_call(params, batch)
            save_held(saved, f"held-{schedule}", result, timings)
    if MODE == "run":  # the reference is jax.jit of the step, in each process
        train(saved)
    np.savez(os.path.join(OUT, f"{MODE}-{me}.npz"), **saved)
    print(f"process {me}: done", flush=True)


if __name__ == "__main__":
    main()
