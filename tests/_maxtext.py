"""MaxText's decoder, split and pipelined by pipemark (run by tests/test_maxtext.py in a
subprocess with 4 host CPU devices: ``python tests/_maxtext.py scan|noscan``).

The smallest llama2-style MaxText config (4 decoder layers, width 16, 2 heads of 8,
vocabulary 64, sequence 8; RMSNorm, rotary attention, SwiGLU MLP) with its "full" remat
policy and ``scan_layers`` as given: ``pm.split`` into 2 and 4 stages verifies against
``jax.jit`` of the training step, and ``pm.pipeline_value_and_grad`` over 4 devices
equals ``jax.value_and_grad`` (rtol 1e-5).
"""

from __future__ import annotations

import os
import sys

# Nothing happens on import (pytest's --doctest-modules imports this file in the test
# process): the environment, JAX and MaxText are set up in main(), in the subprocess.

BATCH, LENGTH, VOCAB = 4, 8, 64


def config(scan_layers: bool):
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "decoupled_base_test.yml")
    return pyconfig.initialize(
        [sys.argv[0], base],
        run_name="pipemark",
        enable_checkpointing=False,
        hardware="cpu",
        skip_jax_distributed_system=True,
        decoder_block="llama2",
        base_emb_dim=16,
        base_num_query_heads=2,
        base_num_kv_heads=2,
        base_mlp_dim=32,
        base_num_decoder_layers=4,
        head_dim=8,
        vocab_size=VOCAB,
        max_target_length=LENGTH,
        per_device_batch_size=1,
        scan_layers=scan_layers,
        remat_policy="full",
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        attention="dot_product",
        enable_dropout=False,
        dropout_rate=0.0,
        logits_dot_in_fp32=True,
    )


def model_and_loss(scan_layers: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from maxtext.models import models

    cfg = config(scan_layers)
    axes = cfg.mesh_axes
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)
    model = models.Transformer(cfg, mesh, quant=None, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, tokens, positions, targets):
        # copy=True: the unscanned decoder updates its RNG counters in place.
        m = nnx.merge(graphdef, params, rest, copy=True)
        logits = m(
            tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False
        )
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return mesh, params, loss


def main(scan_layers: bool) -> None:
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText without Google Cloud clients
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pipemark as pm

    jax.config.update("jax_enable_checks", True)
    # MaxText pins activations with sharding constraints on its mesh (device 0 here); a
    # pipeline stage runs on its own device, where such a constraint is refused. On one
    # device the constraint changes no value, so the function (reference and pipeline
    # alike) runs without them.
    jax.lax.with_sharding_constraint = lambda x, shardings: x
    mesh, params, loss = model_and_loss(scan_layers)
    tokens = (jnp.arange(BATCH * LENGTH, dtype=jnp.int32).reshape(BATCH, LENGTH) * 7) % VOCAB
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (BATCH, LENGTH))
    batch = (tokens, positions, (tokens + 1) % VOCAB)
    step = jax.value_and_grad(loss)
    with jax.set_mesh(mesh):
        want_loss, want_grads = jax.jit(step)(params, *batch)
        for num_stages in (2, 4):
            staged = pm.split(step, params, *batch, num_stages=num_stages)
            assert len(staged.stages) == 2 * num_stages, [s.name for s in staged.stages]
            staged.verify(step, params, *batch)
    for num_stages in (2, 4):
        pipe = pm.pipeline_value_and_grad(loss, num_stages=num_stages, num_microbatches=2)
        got_loss, got_grads = pipe(params, *batch)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        got, want = jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        print(f"scan_layers={scan_layers} stages={num_stages} loss={float(got_loss):.6f}")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1] == "scan")
