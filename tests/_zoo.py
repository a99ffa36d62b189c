"""Tiny real models nobody here wrote, for tests/test_model_zoo.py and the checks it
runs in tests/_zoo_checks.py: penzai's Llama-like, Gemma-like and GPT-NeoX transformers
(each with and without its layer stack), a flax linen ``nn.scan(nn.remat(Block))``
language model with an optax step, a flax nnx and an equinox transformer.

Every model is a next-token loss ``loss(params, tokens, targets)`` over ``BATCH``
sequences of ``SEQ`` tokens from a ``VOCAB``-word vocabulary. A builder imports its
library when called (``pytest.importorskip`` in the tests), so this module imports
without the test extras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pipemark as pm

VOCAB, SEQ, BATCH, WIDTH, BLOCKS = 32, 8, 4, 16, 2

# Each builder's library, so a test can skip a model whose extra is missing.
LIBRARIES = {
    "penzai-llama": "penzai",
    "penzai-llama-stacked": "penzai",
    "penzai-gemma": "penzai",
    "penzai-gemma-stacked": "penzai",
    "penzai-gpt-neox": "penzai",
    "penzai-gpt-neox-stacked": "penzai",
    "linen-scan-remat": "flax.linen",
    "nnx": "flax.nnx",
    "equinox": "equinox",
}


class ZooModel(NamedTuple):
    """``loss(params, *batch)``; ``value_and_grad`` is JAX's own, jitted (equinox's
    filtered one for a module with non-array leaves): the reference of the tests."""

    loss: Callable[..., jax.Array]
    params: Any
    batch: tuple[jax.Array, jax.Array]
    value_and_grad: Callable[..., Any]


def _tokens() -> tuple[jax.Array, jax.Array]:
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _model(loss: Callable[..., jax.Array], params: Any) -> ZooModel:
    return ZooModel(loss, params, _tokens(), jax.jit(jax.value_and_grad(loss)))


# ------------------------------------------------------------------ penzai


def _penzai_config(family: str, stacked: bool, blocks: int) -> Any:
    from penzai.models.transformer.variants import gpt_neox, llamalike_common

    if family == "gpt-neox":
        return gpt_neox.GPTNeoXTransformerConfig(
            num_attention_heads=2,
            embedding_dim=WIDTH,
            projection_dim=WIDTH // 2,
            mlp_hidden_dim=2 * WIDTH,
            num_decoder_blocks=blocks,
            vocab_size=VOCAB,
            activation_fn="gelu_exact",
            rope_subset_size=4,
            rope_wavelength=10_000.0,
            layernorm_epsilon=1e-5,
            parameter_dtype=jnp.float32,
            activation_dtype=jnp.float32,
            use_layer_stack=stacked,
        )
    if family == "llama":  # SwiGLU, separate lm head
        variant = {"mlp_variant": "swiglu", "tie_embedder_and_logits": False}
    else:  # Gemma 2: GeGLU, tied embedding, soft caps, post-norms
        variant = {
            "mlp_variant": "geglu_approx",
            "tie_embedder_and_logits": True,
            "final_logit_softcap": 30.0,
            "attn_logits_soft_cap": 50.0,
            "use_post_attn_norm": True,
            "use_post_ffw_norm": True,
        }
    return llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=1,
        embedding_dim=WIDTH,
        projection_dim=WIDTH // 2,
        mlp_hidden_dim=2 * WIDTH,
        num_decoder_blocks=blocks,
        vocab_size=VOCAB,
        use_layer_stack=stacked,
        **variant,
    )


def penzai_model(family: str, stacked: bool, blocks: int = BLOCKS) -> ZooModel:
    """A penzai transformer (``family``: llama, gemma, gpt-neox) of ``blocks`` decoder
    blocks built from its config; the parameters are the frozen ``pz.unbind_params``
    values."""
    from penzai import pz
    from penzai.models.transformer.variants import gpt_neox, llamalike_common

    config = _penzai_config(family, stacked, blocks)
    build = (
        gpt_neox.build_gpt_neox_transformer
        if family == "gpt-neox"
        else llamalike_common.build_llamalike_transformer
    )
    unbound, params = pz.unbind_params(build(config, init_base_rng=jax.random.key(0)), freeze=True)

    def loss(params, tokens, targets):
        model = pz.bind_variables(unbound, params)
        logits = model(pz.nx.wrap(tokens).tag("batch", "seq"))
        return _cross_entropy(logits.unwrap("batch", "seq", "vocabulary"), targets)

    return _model(loss, params)


# ------------------------------------------------------------------ flax linen


def _linen_module() -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            causal = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=WIDTH)(h, mask=causal)
            h = nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))
            return x + nn.Dense(WIDTH)(nn.gelu(h)), None

    class LanguageModel(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(VOCAB, WIDTH)(tokens)
            blocks = nn.scan(
                nn.remat(Block),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=BLOCKS,
            )
            x, _ = blocks(name="blocks")(x, None)
            return nn.Dense(VOCAB)(nn.LayerNorm()(x))

    return LanguageModel()


def linen_model() -> ZooModel:
    """A flax linen language model whose blocks are ``nn.scan(nn.remat(Block))``."""
    module = _linen_module()
    tokens, _ = _tokens()
    params = module.init(jax.random.PRNGKey(0), tokens)

    def loss(params, tokens, targets):
        return _cross_entropy(module.apply(params, tokens), targets)

    return _model(loss, params)


def linen_train_step(model: ZooModel) -> tuple[Callable[..., Any], Any]:
    """An optax step over the linen model's loss, its gradients marked; returns
    ``(step, optimizer_state)`` for ``step(params, state, batch)``, ``batch`` the
    ``(tokens, targets)`` pair (pm.pipeline_train_step splits its last argument)."""
    import optax

    # SGD with momentum, not Adam: Adam's first update is lr * sign(g), which turns a
    # float32 rounding difference in a near-zero gradient into a difference of lr.
    optimizer = optax.sgd(0.1, momentum=0.9)

    def step(params, state, batch):
        value, grads = jax.value_and_grad(model.loss)(params, *batch)
        grads = pm.mark_gradient(grads)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, optimizer.init(model.params)


# ------------------------------------------------------------------ flax nnx


def nnx_model() -> ZooModel:
    """A flax nnx transformer; the parameters are the ``nnx.split`` state."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=2, in_features=WIDTH, decode=False, rngs=rngs
            )
            self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
            self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            causal = nnx.make_causal_mask(x[..., 0])
            x = x + self.attention(self.norm1(x), mask=causal)
            return x + self.down(jax.nn.silu(self.up(self.norm2(x))))

    class LanguageModel(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
            self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    graphdef, state = nnx.split(LanguageModel(nnx.Rngs(0)))

    def loss(state, tokens, targets):
        return _cross_entropy(nnx.merge(graphdef, state)(tokens), targets)

    return _model(loss, state)


# ------------------------------------------------------------------ equinox


def equinox_model() -> ZooModel:
    """An equinox transformer (a module with non-array leaves: activations, ints)."""
    import equinox as eqx

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm1 = eqx.nn.LayerNorm(WIDTH)
            self.attention = eqx.nn.MultiheadAttention(2, WIDTH, key=k1)
            self.norm2 = eqx.nn.LayerNorm(WIDTH)
            self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 2 * WIDTH, 1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):
            causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            h = jax.vmap(self.norm1)(x)
            x = x + self.attention(h, h, h, mask=causal)
            return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

    class LanguageModel(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, BLOCKS + 2)
            self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:-1]]
            self.norm = eqx.nn.LayerNorm(WIDTH)
            self.head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    def loss(model, tokens, targets):
        return _cross_entropy(jax.vmap(model)(tokens), targets)

    model = LanguageModel(jax.random.PRNGKey(0))
    return ZooModel(loss, model, _tokens(), eqx.filter_jit(eqx.filter_value_and_grad(loss)))


BUILDERS: dict[str, Callable[[], ZooModel]] = {
    "penzai-llama": lambda: penzai_model("llama", stacked=False),
    "penzai-llama-stacked": lambda: penzai_model("llama", stacked=True),
    "penzai-gemma": lambda: penzai_model("gemma", stacked=False),
    "penzai-gemma-stacked": lambda: penzai_model("gemma", stacked=True),
    "penzai-gpt-neox": lambda: penzai_model("gpt-neox", stacked=False),
    "penzai-gpt-neox-stacked": lambda: penzai_model("gpt-neox", stacked=True),
    "linen-scan-remat": linen_model,
    "nnx": nnx_model,
    "equinox": equinox_model,
}


def worst(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """``max |got - want| / (atol + rtol |want|)`` over the leaves of two pytrees of
    the same structure: below 1 means equal to ``rtol`` (``atol`` near zero)."""
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten(want)
    if got_tree != want_tree:
        raise AssertionError(f"structures differ:\n{got_tree}\n{want_tree}")
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (atol + rtol * np.abs(b))))
        for a, b in zip(got_leaves, want_leaves)
    )
