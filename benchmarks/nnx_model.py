"""A decoder language model written with flax nnx, the way a flax user writes one:
``nnx.Embed``, ``nnx.RMSNorm``, ``nnx.MultiHeadAttention`` (which calls
``flax.nnx.dot_product_attention``) with a causal mask from ``nnx.make_causal_mask``, a
SwiGLU MLP of ``nnx.Linear`` layers, tied embeddings (``Embed.attend``), bfloat16
compute over float32 parameters, and a :func:`pipemark.mark_pipeline_boundary` between
blocks. ``benchmarks/accelerator.py --model nnx`` measures it.

>>> ex = nnx_lm(layers=2, d_model=16, heads=2, d_ff=24, vocab=32, seq=8, rows=2)
>>> loss = ex.loss_fn(ex.params, ex.batch)
>>> bool(2.5 < float(loss) < 4.5)  # about log(32) = 3.47 at first
True
"""

from __future__ import annotations

from typing import Any


def _modules():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import pipemark as pm

    class Block(nnx.Module):
        def __init__(self, d_model: int, heads: int, d_ff: int, rngs: nnx.Rngs):
            bf16 = jnp.bfloat16
            self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                heads, d_model, use_bias=False, dtype=bf16, decode=False, rngs=rngs
            )
            self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
            self.gate, self.up = (
                nnx.Linear(d_model, d_ff, use_bias=False, dtype=bf16, rngs=rngs) for _ in "gu"
            )
            self.down = nnx.Linear(d_ff, d_model, use_bias=False, dtype=bf16, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attention(self.attn_norm(x), mask=mask).astype(x.dtype)
            h = self.mlp_norm(x)
            return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h)).astype(x.dtype)

    class LanguageModel(nnx.Module):
        def __init__(self, layers, d_model, heads, d_ff, vocab, markers, rngs: nnx.Rngs):
            self.markers = markers
            self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
            self.blocks = nnx.List([Block(d_model, heads, d_ff, rngs) for _ in range(layers)])
            self.norm = nnx.RMSNorm(d_model, rngs=rngs)

        def __call__(self, tokens):
            mask = nnx.make_causal_mask(tokens)
            x = self.embed(tokens).astype(jnp.float32)
            for i, block in enumerate(self.blocks):
                if i and self.markers:
                    pm.mark_pipeline_boundary()
                x = block(x, mask)
            return self.embed.attend(self.norm(x).astype(jnp.bfloat16))

    return LanguageModel


def nnx_lm(
    *,
    layers: int,
    d_model: int,
    heads: int,
    d_ff: int,
    vocab: int,
    seq: int,
    rows: int,
    markers: bool = True,
) -> Any:
    """The model as a :class:`pipemark.examples.Example`: ``loss_fn(params, batch)``
    over the ``nnx.Param`` state, ``batch = (tokens, targets)`` of shape ``(rows, seq)``;
    without ``markers``, the model a user runs without a pipeline."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from pipemark.examples import Example

    model = _modules()(layers, d_model, heads, d_ff, vocab, markers, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        tokens, targets = batch
        logits = nnx.merge(graphdef, params, rest)(tokens).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    stream = np.random.default_rng(0).integers(0, vocab, size=(rows, seq + 1))
    batch = tuple(jnp.asarray(t, jnp.int32) for t in (stream[:, :-1], stream[:, 1:]))
    return Example(loss_fn, params, batch)
