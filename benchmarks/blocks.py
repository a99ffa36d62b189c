"""What cutting between a model's blocks costs in balance.

penzai's Llama-like, Gemma-like and GPT-NeoX transformers (their blocks found by name
scope, :mod:`pipemark.passes.blocks`), ``value_and_grad`` of a next-token loss, are cut
into S forward stages by ``pm.passes.auto.plan_layers`` twice: anywhere
(``block_cuts="off"``) and between blocks only (``block_cuts="require"``). For each,
print the largest forward stage's FLOPs over the mean and how far it lies above the
best cut anywhere (``B*``); the last column is what the default, ``"prefer"`` with
``BLOCK_TOLERANCE``, keeps.

    python benchmarks/blocks.py            # tiny models and a 16-block Llama-like
    python benchmarks/blocks.py --quick    # the tiny Llama-like only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pipemark.passes import inline_calls
from pipemark.passes.auto import BLOCK_TOLERANCE, plan_layers


def _config(family, width, vocab, blocks):
    from penzai.models.transformer.variants import gpt_neox, llamalike_common

    if family == "gpt-neox":
        config = gpt_neox.GPTNeoXTransformerConfig(
            num_attention_heads=2, embedding_dim=width, projection_dim=width // 2,
            mlp_hidden_dim=4 * width, num_decoder_blocks=blocks, vocab_size=vocab,
            activation_fn="gelu_exact", rope_subset_size=4, rope_wavelength=1e4,
            layernorm_epsilon=1e-5, parameter_dtype=jnp.float32, activation_dtype=jnp.float32,
        )  # fmt: skip
        return config, gpt_neox.build_gpt_neox_transformer
    variant = (
        {"mlp_variant": "swiglu", "tie_embedder_and_logits": False}
        if family == "llama"
        else {
            "mlp_variant": "geglu_approx",
            "tie_embedder_and_logits": True,
            "final_logit_softcap": 30.0,
            "attn_logits_soft_cap": 50.0,
            "use_post_attn_norm": True,
            "use_post_ffw_norm": True,
        }
    )
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=1, embedding_dim=width,
        projection_dim=width // 2, mlp_hidden_dim=8 * width // 3 // 2 * 2,
        num_decoder_blocks=blocks, vocab_size=vocab, **variant,
    )  # fmt: skip
    return config, llamalike_common.build_llamalike_transformer


def trace(family, width, vocab, blocks, seq, batch=4):
    """``value_and_grad`` of the model's loss, traced and inlined."""
    from penzai import pz

    config, build = _config(family, width, vocab, blocks)
    unbound, params = pz.unbind_params(build(config, init_base_rng=jax.random.key(0)), freeze=True)

    def loss(params, tokens, targets):
        logits = pz.bind_variables(unbound, params)(pz.nx.wrap(tokens).tag("batch", "seq"))
        logp = jax.nn.log_softmax(logits.unwrap("batch", "seq", "vocabulary"))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return inline_calls(jax.make_jaxpr(jax.value_and_grad(loss))(params, tokens, tokens))


def rows(models, stages):
    for family, width, vocab, blocks, seq in models:
        cj = trace(family, width, vocab, blocks, seq)
        for num_stages in (s for s in stages if s <= blocks):
            anywhere = plan_layers(cj, num_stages, block_cuts="off").balance
            between = plan_layers(cj, num_stages, block_cuts="require").balance
            keeps = "between blocks" if between.excess <= BLOCK_TOLERANCE else "anywhere"
            yield (
                (
                    f"| {family} | {width} | {vocab} | {blocks} | {num_stages} | "
                    f"{anywhere.imbalance:.3f} | {100 * anywhere.excess:.1f} % | "
                    f"{between.imbalance:.3f} | {100 * between.excess:.1f} % | {keeps} |"
                ),
                between.excess,
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny Llama-like only")
    args = parser.parse_args(argv)
    tiny = [(family, 16, 32, 4, 8) for family in ("llama", "gemma", "gpt-neox")]
    models = tiny[:1] if args.quick else [*tiny, ("llama", 512, 32000, 16, 256)]
    print(
        "| model | d_model | vocabulary | blocks | stages | anywhere: largest / mean "
        "| above B* | between blocks: largest / mean | above B* | prefer keeps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    worst = 0.0
    for line, excess in rows(models, (2, 4, 8)):
        print(line, flush=True)
        worst = max(worst, excess)
    print()
    print(
        f"- cuts between blocks cost at most {100 * worst:.1f} % above B* here; "
        f"BLOCK_TOLERANCE is {100 * BLOCK_TOLERANCE:.0f} %."
    )


if __name__ == "__main__":
    main()
