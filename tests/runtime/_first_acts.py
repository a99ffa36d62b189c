"""The training configurations a new user writes first, run by
tests/runtime/test_first_acts.py under ``python -m pipemark.launch -n 2`` with 2 CPU
devices per process (one pipeline stage per device, ``num_stages`` left to its default):

    python -m pipemark.launch -n 2 tests/runtime/_first_acts.py OUT [kept]

A 4-block LayerNorm residual MLP whose parameters are a list of ``{"w", "b", "g"}``
dicts, untied (the list alone) and tied (``{"blocks": [...], "embed": E}``: the first
stage multiplies by ``E``, the last by its transpose, so stages of both processes read
it); an AdamW step with global-norm clipping and a cosine schedule, 4 microbatches,
1F1B; results kept where computed and gathered (``kept``: kept only). In each run an orbax
``StandardCheckpointer`` made before the first pipeline call saves, as its first act
after :data:`SAVE_AT` steps, ``{"p": params, "s": opt_state}`` and ``{"p": params}``;
both are restored through ``abstract_state`` and the last steps run again from them,
and the restored state is saved again before any step, restored and resumed.
Each process writes its losses (read with ``float`` in every process) to
``OUT/<process>.json``.
"""

from __future__ import annotations

import json
import os
import sys

STEPS, SAVE_AT = 6, 3
BLOCKS, WIDTH, ROWS, MICRO = 4, 8, 8, 4

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    from pipemark.launch import initialize

    initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pipemark as pm  # noqa: E402


def _block(p, x):
    h = x * p["g"] / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
    return x + jnp.tanh(h @ p["w"] + p["b"])


def model(tied: bool):
    """The step (gradients marked), the initial ``(params, opt_state)`` and the batches."""
    keys = jax.random.split(jax.random.PRNGKey(0), BLOCKS + 3)
    blocks = [
        {
            "w": jax.random.normal(keys[k], (WIDTH, WIDTH)) / np.sqrt(WIDTH),
            "b": jnp.zeros(WIDTH),
            "g": jnp.ones(WIDTH),
        }
        for k in range(BLOCKS)
    ]
    params = (
        {"blocks": blocks, "embed": jax.random.normal(keys[-1], (WIDTH, WIDTH)) / np.sqrt(WIDTH)}
        if tied
        else blocks
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.cosine_decay_schedule(1e-2, STEPS), weight_decay=0.1),
    )

    def loss_fn(params, batch):
        x, y = batch
        blocks = params["blocks"] if tied else params
        if tied:
            x = x @ params["embed"]
        for k, p in enumerate(blocks):
            x = _block(p, x)
            if k < len(blocks) - 1:
                pm.mark_pipeline_boundary()
        if tied:
            x = x @ params["embed"].T
        return jnp.mean((x - y) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.random.normal(keys[-2], (ROWS, WIDTH))
    y = jax.random.normal(keys[-3], (ROWS, WIDTH))
    batches = [(x * (1 + 0.1 * k), y) for k in range(STEPS)]
    return step, (params, tx.init(params)), batches


def run(pipe, state, batches, first: int, last: int) -> tuple[list[float], tuple]:
    losses = []
    for k in range(first, last):
        *state, loss = pipe(*state, batches[k])
        losses.append(float(loss))
    return losses, tuple(state)


def first_save(out: str, tied: bool, gather: bool) -> dict:
    import orbax.checkpoint as ocp

    # Made before the pipeline's first call: orbax's handlers then exist before
    # pipemark's are installed.
    checkpointer = ocp.StandardCheckpointer()
    step, state, batches = model(tied)
    pipe = pm.pipeline_train_step(
        step, num_microbatches=MICRO, schedule="1f1b", gather_results=gather, timeout_s=120
    )
    first, middle = run(pipe, state, batches, 0, SAVE_AT)
    name = f"{'tied' if tied else 'untied'}-{'gathered' if gather else 'kept'}"
    both, alone = os.path.join(out, name + "-ps"), os.path.join(out, name + "-p")
    checkpointer.save(both, {"p": middle[0], "s": middle[1]})
    checkpointer.save(alone, {"p": middle[0]})
    checkpointer.wait_until_finished()
    rest, _ = run(pipe, middle, batches, SAVE_AT, STEPS)
    params, opt_state = pipe.abstract_state(*state, batches[0])
    back = checkpointer.restore(both, {"p": params, "s": opt_state})
    resumed, _ = run(pipe, (back["p"], back["s"]), batches, SAVE_AT, STEPS)
    params_back = checkpointer.restore(alone, {"p": params})["p"]
    again, _ = run(pipe, (params_back, back["s"]), batches, SAVE_AT, STEPS)
    # A restored state saved again before any step, then restored and resumed.
    resaved = os.path.join(out, name + "-resaved")
    checkpointer.save(resaved, {"p": params_back, "s": back["s"]})
    checkpointer.wait_until_finished()
    back = checkpointer.restore(resaved, {"p": params, "s": opt_state})
    resaved_run, _ = run(pipe, (back["p"], back["s"]), batches, SAVE_AT, STEPS)
    checkpointer.close()
    return dict(losses=first + rest, resumed=resumed, params_alone=again, resaved=resaved_run)


def main() -> None:
    out, gathers = sys.argv[1], (False, True)
    if sys.argv[2:] == ["kept"]:  # the configurations of the failures alone
        gathers = (False,)
    seen = {
        f"{tied}-{gather}": first_save(out, tied, gather)
        for tied in (False, True)
        for gather in gathers
    }
    with open(os.path.join(out, f"{jax.process_index()}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
