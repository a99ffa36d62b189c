"""MaxText's decoder, split and pipelined by pipemark with its own sharding annotations
(run by tests/test_maxtext.py in a subprocess with 4 host CPU devices:
``python tests/_maxtext.py scan|noscan tensor|data``).

The smallest llama2-style MaxText config (4 decoder layers, width 16, 2 heads of 8,
vocabulary 64, sequence 8; RMSNorm, rotary attention, SwiGLU MLP) with its "full" remat
policy and ``scan_layers`` as given, on a mesh over MaxText's own ``mesh_axes`` with
``stage=2`` and ``tensor=2`` (tensor parallelism: MaxText's logical axis rules shard the
heads, MLP, vocabulary and norm weights over ``tensor``) or ``data=2`` (data
parallelism: MaxText constrains its activations' batch to ``data``, which the pipeline
owns). The model is built on one stage's shape of that mesh (``stage=1``, on the first
stage's devices), its parameters laid out by MaxText's own partition specs (its nnx
logical annotations through its logical axis rules), and every
``with_sharding_constraint`` MaxText writes is kept:

- ``pm.split`` into 2 and 4 stages verifies against ``jax.jit`` of the training step;
- ``pm.pipeline_value_and_grad`` over the 4-device mesh (2 sub-meshes of 2 devices; 2
  stages with 1F1B, 4 interleaved) equals ``jax.value_and_grad`` under ``jax.jit`` on
  one stage's mesh with the same shardings (rtol 1e-5), each gradient on its stage's
  sub-mesh with its parameter's spec.
"""

from __future__ import annotations

import os
import sys
import time

from tests._xla import xla_flags

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


def meshes(cfg, parallel: str):
    """The pipeline's mesh over MaxText's ``mesh_axes`` (``stage`` and ``parallel`` of
    size 2, every other axis 1) and one stage's shape of it (``stage`` of size 1, the
    first stage's devices), on which the model is built and the reference runs."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    axes = tuple(cfg.mesh_axes)
    shape = [1] * len(axes)
    shape[axes.index("stage")] = shape[axes.index(parallel)] = 2
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), axes)
    return mesh, Mesh(np.take(mesh.devices, [0], axis=axes.index("stage")), axes)


def model_and_loss(cfg, mesh):
    """MaxText's Transformer on ``mesh``: its parameters, their ``PartitionSpec``s on
    ``mesh`` (MaxText's logical annotations through its logical axis rules) and the
    loss."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from maxtext.models import models
    from maxtext.utils import sharding

    model = models.Transformer(cfg, mesh, quant=None, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    logical = nnx.get_partition_spec(params)
    specs = sharding.logical_to_mesh(logical, mesh, rules=cfg.logical_axis_rules)

    def loss(params, tokens, positions, targets):
        # copy=True: the unscanned decoder updates its RNG counters in place.
        m = nnx.merge(graphdef, params, rest, copy=True)
        logits = m(
            tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False
        )
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return params, specs, loss


def check_gradients(got, want, specs, stage_devices) -> None:
    """``got`` equals ``want``; each gradient lies on one stage's sub-mesh with its
    parameter's spec."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(got_leaves) == len(want_leaves) == len(spec_leaves) > 0
    for g, w, spec in zip(got_leaves, want_leaves, spec_leaves, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert g.sharding.device_set in stage_devices, g.sharding
        assert g.sharding.is_equivalent_to(NamedSharding(g.sharding.mesh, spec), g.ndim), (
            g.sharding,
            spec,
        )


def constraint_axes(plan) -> list[set[str]]:
    """For each stage program of ``plan``: the mesh axes its ``sharding_constraint``
    equations (in nested bodies too) name, ``None`` for a stage without one."""
    from pipemark.walk import iter_eqns

    found = []
    for stage in plan.staged.stages:
        specs = [
            eqn.params["sharding"].spec
            for eqn in iter_eqns(stage.closed_jaxpr)
            if eqn.primitive.name == "sharding_constraint"
        ]
        names = {
            n for spec in specs for e in spec if e for n in (e if isinstance(e, tuple) else (e,))
        }
        found.append(names if specs else None)
    return found


def check_pipelines(loss, params, specs, batch, mesh, want, parallel: str) -> None:
    """2 stages (1F1B) and 4 (interleaved) on ``mesh``'s 2 sub-meshes equal ``want``."""
    import numpy as np

    import pipemark as pm

    stage = mesh.axis_names.index("stage")
    sub_meshes = [frozenset(np.take(mesh.devices, k, axis=stage).flat) for k in range(2)]
    for num_stages, schedule in ((2, "1f1b"), (4, "interleaved")):
        pipe = pm.pipeline_value_and_grad(
            loss,
            num_stages=num_stages,
            num_microbatches=2,
            schedule=schedule,
            mesh=mesh,
            param_specs=specs,
        )
        got_loss, got_grads = pipe(params, *batch)
        np.testing.assert_allclose(got_loss, want[0], rtol=1e-5)
        check_gradients(got_grads, want[1], specs, sub_meshes)
        # MaxText's own constraints are in every forward stage program the pipeline
        # compiled (a backward stage of the loss alone may have none).
        plan = pipe.plan(params, *batch)
        axes = constraint_axes(plan)
        assert all(parallel in (axes[i] or ()) for i in plan.forward_stages), axes
        print(f"{parallel}=2 stages={num_stages} {schedule} loss={got_loss:.6f} axes={axes}")


def main(scan_layers: bool, parallel: str) -> None:
    start = time.perf_counter()
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText without Google Cloud clients
    os.environ["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=4")
    import jax
    import jax.numpy as jnp
    from flax.core.spmd import logical_axis_rules
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pipemark as pm

    jax.config.update("jax_enable_checks", True)
    cfg = config(scan_layers)
    mesh, stage_mesh = meshes(cfg, parallel)
    params, specs, loss = model_and_loss(cfg, stage_mesh)
    tokens = (jnp.arange(BATCH * LENGTH, dtype=jnp.int32).reshape(BATCH, LENGTH) * 7) % VOCAB
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (BATCH, LENGTH))
    batch = (tokens, positions, (tokens + 1) % VOCAB)
    step = jax.value_and_grad(loss)

    def shard(spec):
        return NamedSharding(stage_mesh, spec)

    param_shardings = jax.tree.map(shard, specs, is_leaf=lambda x: isinstance(x, P))
    rows = (shard(P("data")),) * len(batch)
    # As MaxText's train loop: without its logical axis rules in context, its activation
    # constraints map every logical axis to None (replicated).
    seconds = {"model": time.perf_counter() - start}
    with jax.set_mesh(stage_mesh), logical_axis_rules(cfg.logical_axis_rules):
        want = jax.jit(step, in_shardings=(param_shardings, *rows))(params, *batch)
        seconds["reference"] = time.perf_counter() - start - sum(seconds.values())
        for num_stages in (2, 4):
            staged = pm.split(step, params, *batch, num_stages=num_stages)
            assert len(staged.stages) == 2 * num_stages, [s.name for s in staged.stages]
            staged.verify(step, params, *batch)
        seconds["split"] = time.perf_counter() - start - sum(seconds.values())
        check_pipelines(loss, params, specs, batch, mesh, want, parallel)
        seconds["pipelines"] = time.perf_counter() - start - sum(seconds.values())
    print(", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()))
    print(f"scan_layers={scan_layers}: ok")


if __name__ == "__main__":
    main(sys.argv[1] == "scan", sys.argv[2])
