"""Small models in plain JAX, with and without pipeline markers.

Tests, benchmarks and documentation need the same few programs: an MLP, a residual
network whose skip connections jump over stages, a transformer, and an MLP in
Megatron's tensor-parallel layout for stages on sub-meshes. Each builder returns
an :class:`Example` ``(loss_fn, params, batch)``; the traced programs are::

    jax.make_jaxpr(loss_fn)(params, batch)
    jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, batch)

(:meth:`Example.trace` does this for a fresh function each call.) Parameters come from
``numpy.random.default_rng(seed)``, so the same arguments give the same arrays.

``markers`` chooses how the layers are marked:

``"startend"``
    Layer ``i`` is wrapped in a ``start``/``end`` pair named ``layer{i}`` (``block{i}``
    for the residual network and the transformer). *All* of the layer's inputs, its
    activation and its own parameters, go through the start marker, so the gradient
    with respect to the parameters gives complete mirrored ``_backward`` markers.
``"boundary"``
    A zero-operand boundary marker between consecutive layers.
``None``
    No markers: the reference program.

The loss is computed inside the last layer, so with ``"startend"`` every forward
equation lies between a start and an end marker.

Models are built with a Python loop over layers (never ``lax.scan``), so the number of
equations grows with the number of layers; :func:`sized` picks the number of layers for
a target equation count.

>>> import jax, pipemark as pm
>>> loss_fn, params, batch = mlp(num_layers=2, width=4, batch=3)
>>> cj = jax.make_jaxpr(loss_fn)(params, batch)
>>> [e.params["name"] for e in cj.eqns if e.primitive is pm.pipeline_p]
['layer0', 'layer0', 'layer1', 'layer1']
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec, Sharding

from pipemark.errors import PipemarkError
from pipemark.primitive import mark, mark_gradient, mark_pipeline_boundary

__all__ = [
    "MARKER_STYLES",
    "Example",
    "mlp",
    "tensor_parallel_mlp",
    "tensor_parallel_mlp_specs",
    "resnet",
    "transformer",
    "scanned_transformer",
    "gpt",
    "llama",
    "LLAMA_ATTENTIONS",
    "sized",
    "train_step",
]

MARKER_STYLES: tuple[str | None, ...] = ("startend", "boundary", None)


class Example(NamedTuple):
    """A model: ``loss_fn(params, batch)`` returns a scalar loss.

    It unpacks as ``loss_fn, params, batch = example``.
    """

    loss_fn: Callable[[Any, Any], jax.Array]
    params: Any
    batch: Any

    @property
    def args(self) -> tuple[Any, Any]:
        """``(params, batch)``, the arguments of ``loss_fn``."""
        return (self.params, self.batch)

    def trace(self, grad: bool = False) -> jax.extend.core.ClosedJaxpr:
        """Trace ``loss_fn`` (or ``jax.value_and_grad(loss_fn)`` when ``grad``).

        Each call traces a new function object, so ``jax.make_jaxpr``'s cache on the
        function never hides the tracing time.
        """
        loss_fn = self.loss_fn
        fn = jax.value_and_grad(loss_fn) if grad else loss_fn

        def fresh(params, batch):
            return fn(params, batch)

        return jax.make_jaxpr(fresh)(self.params, self.batch)


def _check_markers(markers: str | None) -> None:
    if markers not in MARKER_STYLES:
        raise PipemarkError(
            f"Unknown markers style {markers!r}; choose one of 'startend', 'boundary' or None."
        )


def _check_positive(**sizes: int) -> None:
    for key, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise PipemarkError(f"{key} must be a positive int, got {value!r}.")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jnp.asarray(rng.normal(0.0, scale, size=shape).astype(np.float32))


def _layer_begin(markers: str | None, name: str, index: int, values: Any) -> Any:
    if markers == "startend":
        return mark(values, name=name, mark_type="start")
    if markers == "boundary" and index > 0:
        mark_pipeline_boundary()
    return values


def _layer_finish(markers: str | None, name: str, value: jax.Array) -> jax.Array:
    if markers == "startend":
        return mark(value, name=name, mark_type="end")
    return value


def _mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((prediction - target) ** 2)


# ---------------------------------------------------------------------------------- MLP


def mlp(
    num_layers: int = 4,
    width: int = 8,
    batch: int = 4,
    *,
    markers: str | None = "startend",
    seed: int = 0,
) -> Example:
    """A ``tanh`` MLP of ``num_layers`` square layers with a mean-squared-error loss.

    ``params`` is a list of ``(w, b)`` pairs, ``batch`` is ``(x, y)`` with ``x`` and
    ``y`` of shape ``(batch, width)``. Layer ``i`` is marked ``layer{i}``.

    >>> loss_fn, params, batch = mlp(num_layers=3, markers=None)
    >>> len(params), batch[0].shape
    (3, (4, 8))
    """
    _check_markers(markers)
    _check_positive(num_layers=num_layers, width=width, batch=batch)
    rng = np.random.default_rng(seed)
    params = [
        (_normal(rng, (width, width), 1.0 / math.sqrt(width)), _normal(rng, (width,), 0.1))
        for _ in range(num_layers)
    ]
    data = (_normal(rng, (batch, width), 1.0), _normal(rng, (batch, width), 1.0))

    def loss_fn(params, batch):
        x, y = batch
        for i, (w, b) in enumerate(params):
            name = f"layer{i}"
            x, w, b = _layer_begin(markers, name, i, (x, w, b))
            x = jnp.tanh(x @ w + b)
            if i == len(params) - 1:
                x = _mse(x, y)
            x = _layer_finish(markers, name, x)
        return x

    return Example(loss_fn, params, data)


# -------------------------------------------------------------- tensor-parallel MLP


def tensor_parallel_mlp(
    num_layers: int = 4,
    width: int = 16,
    batch: int = 32,
    *,
    num_stages: int | None = None,
    hidden_sharding: Sharding | PartitionSpec | None = None,
    seed: int = 0,
) -> Example:
    """A residual ``tanh`` MLP in Megatron's tensor-parallel layout, cut into
    ``num_stages`` stages of equal layers by boundary markers.

    Layer ``i`` computes ``x + tanh(x @ w_in) @ w_out``; the loss is the mean squared
    error against ``y``. ``params`` is a list of ``(w_in, w_out)`` pairs of shape
    ``(width, width)``, to be split by columns and by rows over a ``model`` axis
    (:func:`tensor_parallel_mlp_specs`); ``batch`` is ``(x, y)`` of shape
    ``(batch, width)``. The hidden activations ``tanh(x @ w_in)`` are constrained
    (``jax.lax.with_sharding_constraint``) to ``hidden_sharding``: a ``NamedSharding``
    such as ``NamedSharding(mesh, P("data", "model"))``, a bare ``PartitionSpec`` (then
    the model is traced under ``jax.sharding.set_mesh``) or ``None`` (no constraint).
    ``num_stages`` (by default ``num_layers``: a boundary between every two layers)
    must divide ``num_layers``.

    >>> import jax, pipemark as pm
    >>> loss_fn, params, batch = tensor_parallel_mlp(num_layers=4, num_stages=2)
    >>> len(params), batch[0].shape
    (4, (32, 16))
    >>> cj = jax.make_jaxpr(loss_fn)(params, batch)
    >>> sum(e.primitive is pm.pipeline_p for e in cj.eqns)
    1
    """
    num_stages = num_layers if num_stages is None else num_stages
    _check_positive(num_layers=num_layers, width=width, batch=batch, num_stages=num_stages)
    if num_layers % num_stages:
        raise PipemarkError(f"num_stages ({num_stages}) must divide num_layers ({num_layers}).")
    per_stage = num_layers // num_stages
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(width)
    params = [
        (_normal(rng, (width, width), scale), _normal(rng, (width, width), scale))
        for _ in range(num_layers)
    ]
    data = (_normal(rng, (batch, width), 1.0), _normal(rng, (batch, width), 1.0))

    def loss_fn(params, batch):
        x, y = batch
        for i, (w_in, w_out) in enumerate(params):
            if i and i % per_stage == 0:
                mark_pipeline_boundary()
            hidden = jnp.tanh(x @ w_in)
            if hidden_sharding is not None:
                hidden = lax.with_sharding_constraint(hidden, hidden_sharding)
            x = x + hidden @ w_out
        return _mse(x, y)

    return Example(loss_fn, params, data)


def tensor_parallel_mlp_specs(
    num_layers: int, model_axis: str = "model"
) -> list[tuple[PartitionSpec, PartitionSpec]]:
    """The ``PartitionSpec`` of each parameter of :func:`tensor_parallel_mlp`: per layer
    ``w_in`` split by columns and ``w_out`` by rows over ``model_axis``, so that each
    shard computes its slice of the hidden activations and one reduction sums the
    layer's output.

    >>> specs = tensor_parallel_mlp_specs(2)
    >>> len(specs), specs[0]
    (2, (P(None, 'model'), P('model', None)))
    """
    return [(PartitionSpec(None, model_axis), PartitionSpec(model_axis, None))] * num_layers


# ------------------------------------------------------------------------------ ResNet


def resnet(
    num_blocks: int = 6,
    width: int = 8,
    batch: int = 4,
    *,
    skip: int = 3,
    markers: str | None = "startend",
    route_skips: bool = True,
    seed: int = 0,
) -> Example:
    """A residual network whose block ``i`` also reads the output of block ``i - skip``.

    Block ``i`` computes ``tanh(h @ w + b) + out[i - skip]`` (the second term only when
    ``i >= skip``), where ``h`` is the previous block's output; so stage 0 feeds stage
    ``skip`` directly, past the stages in between. Blocks are marked ``block{i}``.

    With ``route_skips=True`` the skipped value goes through block ``i``'s start marker
    like every other input. With ``route_skips=False`` it bypasses the marker: the
    program then needs :func:`pipemark.passes.mark_missing_vars` before its stages read
    other stages' values only through their start markers.

    >>> import jax
    >>> ex = resnet(num_blocks=4, skip=3)
    >>> float(ex.loss_fn(*ex.args)) > 0
    True
    """
    _check_markers(markers)
    _check_positive(num_blocks=num_blocks, width=width, batch=batch, skip=skip)
    rng = np.random.default_rng(seed)
    params = [
        (_normal(rng, (width, width), 1.0 / math.sqrt(width)), _normal(rng, (width,), 0.1))
        for _ in range(num_blocks)
    ]
    data = (_normal(rng, (batch, width), 1.0), _normal(rng, (batch, width), 1.0))

    def loss_fn(params, batch):
        h, y = batch
        outputs: list[jax.Array] = []
        for i, (w, b) in enumerate(params):
            name = f"block{i}"
            skipped = outputs[i - skip] if i >= skip else None
            if skipped is not None and route_skips:
                h, skipped, w, b = _layer_begin(markers, name, i, (h, skipped, w, b))
            else:
                h, w, b = _layer_begin(markers, name, i, (h, w, b))
            h = jnp.tanh(h @ w + b)
            if skipped is not None:
                h = h + skipped
            if i == len(params) - 1:
                h = _mse(h, y)
            h = _layer_finish(markers, name, h)
            outputs.append(h)
        return h

    return Example(loss_fn, params, data)


# ------------------------------------------------------------------------- Transformer


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return centered * lax.rsqrt(variance + 1e-5) * scale + bias


def _softmax(scores: jax.Array) -> jax.Array:
    # Written out rather than jax.nn.softmax so that no custom_jvp call hides the
    # equations from the top level of the jaxpr.
    shifted = scores - jnp.max(lax.stop_gradient(scores), axis=-1, keepdims=True)
    exp = jnp.exp(shifted)
    return exp / jnp.sum(exp, axis=-1, keepdims=True)


def _gelu(x: jax.Array) -> jax.Array:
    # The tanh approximation, written out: jax.nn.gelu is jitted and would appear as
    # one nested call equation.
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _attention(
    x: jax.Array, p: dict[str, jax.Array], num_heads: int, causal: bool = False
) -> jax.Array:
    batch, seq, d_model = x.shape
    head = d_model // num_heads

    def heads(t):
        return t.reshape(batch, seq, num_heads, head).transpose(0, 2, 1, 3)

    q, k, v = heads(x @ p["wq"]), heads(x @ p["wk"]), heads(x @ p["wv"])
    scores = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(head)
    if causal:
        # A token attends to itself and the tokens before it, never to later ones.
        allowed = lax.broadcasted_iota(jnp.int32, (seq, seq), 0) >= lax.broadcasted_iota(
            jnp.int32, (seq, seq), 1
        )
        scores = jnp.where(allowed, scores, jnp.float32(-1e9))
    mixed = jnp.matmul(_softmax(scores), v)
    return mixed.transpose(0, 2, 1, 3).reshape(batch, seq, d_model) @ p["wo"]


def _transformer_block(
    x: jax.Array, p: dict[str, jax.Array], num_heads: int, causal: bool = False
) -> jax.Array:
    x = x + _attention(_layer_norm(x, p["ln1_scale"], p["ln1_bias"]), p, num_heads, causal)
    hidden = _gelu(_layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w1"] + p["b1"])
    return x + hidden @ p["w2"] + p["b2"]


def _block_params(rng: np.random.Generator, d_model: int) -> dict[str, jax.Array]:
    """One transformer block's parameters (the MLP is ``4 * d_model`` wide)."""
    scale = 1.0 / math.sqrt(d_model)
    hidden = 4 * d_model
    return {
        "ln1_scale": jnp.ones((d_model,), jnp.float32),
        "ln1_bias": jnp.zeros((d_model,), jnp.float32),
        "wq": _normal(rng, (d_model, d_model), scale),
        "wk": _normal(rng, (d_model, d_model), scale),
        "wv": _normal(rng, (d_model, d_model), scale),
        "wo": _normal(rng, (d_model, d_model), scale),
        "ln2_scale": jnp.ones((d_model,), jnp.float32),
        "ln2_bias": jnp.zeros((d_model,), jnp.float32),
        "w1": _normal(rng, (d_model, hidden), scale),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": _normal(rng, (hidden, d_model), 1.0 / math.sqrt(hidden)),
        "b2": jnp.zeros((d_model,), jnp.float32),
    }


def transformer(
    num_layers: int = 2,
    d_model: int = 16,
    num_heads: int = 2,
    seq: int = 8,
    batch: int = 2,
    *,
    markers: str | None = "startend",
    seed: int = 0,
) -> Example:
    """A stack of ``num_layers`` pre-layer-norm transformer blocks (self-attention and a
    GELU MLP of width ``4 * d_model``, each with a residual connection).

    ``params`` is a list of dicts, one per block; ``batch`` is ``(x, y)`` with both of
    shape ``(batch, seq, d_model)``; the loss is the mean squared error. Block ``i`` is
    marked ``block{i}``. ``transformer(num_layers=1)`` is a single transformer block.

    >>> ex = transformer(num_layers=1)
    >>> sorted(ex.params[0])[:3]
    ['b1', 'b2', 'ln1_bias']
    """
    _check_markers(markers)
    _check_positive(num_layers=num_layers, d_model=d_model, num_heads=num_heads, seq=seq)
    _check_positive(batch=batch)
    if d_model % num_heads:
        raise PipemarkError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads}).")
    rng = np.random.default_rng(seed)
    params = [_block_params(rng, d_model) for _ in range(num_layers)]
    shape = (batch, seq, d_model)
    data = (_normal(rng, shape, 1.0), _normal(rng, shape, 1.0))

    def loss_fn(params, batch):
        x, y = batch
        for i, p in enumerate(params):
            name = f"block{i}"
            x, p = _layer_begin(markers, name, i, (x, p))
            x = _transformer_block(x, p, num_heads)
            if i == len(params) - 1:
                x = _mse(x, y)
            x = _layer_finish(markers, name, x)
        return x

    return Example(loss_fn, params, data)


def scanned_transformer(
    num_layers: int = 4,
    d_model: int = 16,
    num_heads: int = 2,
    seq: int = 8,
    batch: int = 2,
    *,
    seed: int = 0,
) -> Example:
    """The blocks of :func:`transformer` run by ``lax.scan`` over stacked parameters,
    as deep models are usually written (flax ``nn.scan``, ``nnx.scan``): ``params`` is
    one dict whose arrays have a leading axis of ``num_layers``. No markers: cut it with
    ``pm.split(..., num_stages=S)``, which splits the scan
    (:func:`pipemark.passes.split_scan`).

    >>> ex = scanned_transformer(num_layers=3)
    >>> ex.params["w1"].shape[0]
    3
    """
    _check_positive(num_layers=num_layers, d_model=d_model, num_heads=num_heads, seq=seq)
    _check_positive(batch=batch)
    if d_model % num_heads:
        raise PipemarkError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads}).")
    rng = np.random.default_rng(seed)
    blocks = [_block_params(rng, d_model) for _ in range(num_layers)]
    params = {key: jnp.stack([b[key] for b in blocks]) for key in blocks[0]}
    shape = (batch, seq, d_model)
    data = (_normal(rng, shape, 1.0), _normal(rng, shape, 1.0))

    def loss_fn(params, batch):
        x, y = batch

        def body(x, p):
            return _transformer_block(x, p, num_heads), None

        x, _ = jax.lax.scan(body, x, params)
        return _mse(x, y)

    return Example(loss_fn, params, data)


# ---------------------------------------------------------------------- Language model


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    # log-softmax and one-hot written out, like _softmax, so that every equation stays
    # at the top level of the jaxpr.
    shifted = logits - jnp.max(lax.stop_gradient(logits), axis=-1, keepdims=True)
    log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    vocab = logits.shape[-1]
    one_hot = (targets[..., None] == lax.broadcasted_iota(jnp.int32, (1, 1, vocab), 2)).astype(
        logits.dtype
    )
    return -jnp.sum(log_probs * one_hot) / targets.size


def language_model(
    num_layers: int = 4,
    vocab: int = 64,
    d_model: int = 32,
    num_heads: int = 4,
    seq: int = 16,
    batch: int = 4,
    *,
    markers: str | None = "startend",
    seed: int = 0,
) -> Example:
    """A small decoder-only transformer language model: token and position embeddings,
    ``num_layers`` pre-layer-norm blocks with causal self-attention and a GELU MLP, a
    final layer norm, an output projection to ``vocab`` logits and the next-token
    cross-entropy.

    ``params`` is a dict with ``"embed"`` ``(vocab, d_model)``, ``"position"``
    ``(seq, d_model)``, ``"blocks"`` (a list of dicts, one per block), ``"final_scale"``,
    ``"final_bias"`` and ``"unembed"`` ``(d_model, vocab)``. ``batch`` is ``(tokens,
    targets)``, both ``int32`` of shape ``(batch, seq)``; ``targets`` is ``tokens``
    shifted by one position. Block ``i`` is marked ``block{i}``; the embedding lookup
    lies in the first block and the output projection and loss in the last.

    >>> ex = language_model(num_layers=2, vocab=16, d_model=8, num_heads=2, seq=4, batch=2)
    >>> ex.batch[0].shape, ex.batch[0].dtype, len(ex.params["blocks"])
    ((2, 4), dtype('int32'), 2)
    >>> float(ex.loss_fn(*ex.args)) > 0
    True
    """
    _check_markers(markers)
    _check_positive(num_layers=num_layers, vocab=vocab, d_model=d_model, num_heads=num_heads)
    _check_positive(seq=seq, batch=batch)
    if d_model % num_heads:
        raise PipemarkError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads}).")
    rng = np.random.default_rng(seed)
    params = {
        "embed": _normal(rng, (vocab, d_model), 1.0),
        "position": _normal(rng, (seq, d_model), 0.1),
        "blocks": [_block_params(rng, d_model) for _ in range(num_layers)],
        "final_scale": jnp.ones((d_model,), jnp.float32),
        "final_bias": jnp.zeros((d_model,), jnp.float32),
        "unembed": _normal(rng, (d_model, vocab), 1.0 / math.sqrt(d_model)),
    }
    stream = rng.integers(0, vocab, size=(batch, seq + 1))
    tokens = jnp.asarray(stream[:, :-1], jnp.int32)
    targets = jnp.asarray(stream[:, 1:], jnp.int32)

    def block(x, p):
        return _transformer_block(x, p, num_heads, causal=True)

    def head(normed, unembed, targets):
        return _cross_entropy(normed @ unembed, targets)

    return Example(_decoder_loss(markers, block, head), params, (tokens, targets))


def _decoder_loss(
    markers: str | None,
    block: Callable[[jax.Array, Any], jax.Array],
    head: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> Callable[[Any, Any], jax.Array]:
    """The loss of a decoder-only language model (:func:`language_model`, :func:`gpt`):
    the embedding lookup in the first block, ``block(x, p)`` per block, and in the last
    the final layer norm and ``head(normed, unembed, targets)``, the loss."""

    def loss_fn(params, batch):
        tokens, targets = batch
        blocks = params["blocks"]
        last = len(blocks) - 1
        x = tokens
        for i, p in enumerate(blocks):
            name = f"block{i}"
            # Each block's start marker carries every parameter the block reads, so
            # the gradient gets complete mirrored backward markers.
            extra = {}
            if i == 0:
                extra["embed"], extra["position"] = params["embed"], params["position"]
            if i == last:
                for key in ("final_scale", "final_bias", "unembed"):
                    extra[key] = params[key]
            x, p, extra = _layer_begin(markers, name, i, (x, p, extra))
            if i == 0:
                x = jnp.take(extra["embed"], x, axis=0) + extra["position"]
            x = block(x, p)
            if i == last:
                normed = _layer_norm(x, extra["final_scale"], extra["final_bias"])
                x = head(normed, extra["unembed"], targets)
            x = _layer_finish(markers, name, x)
        return x

    return loss_fn


# -------------------------------------------------------------------- GPT in bfloat16


def _gpt_attention(h: jax.Array, p: dict[str, jax.Array], num_heads: int, dtype: Any) -> jax.Array:
    """Causal self-attention of ``h`` (already in ``dtype``): the projections and both
    attention matmuls in ``dtype``, the scaled scores and their softmax in float32
    (cast back to ``dtype`` for the matmul with the values)."""
    batch, seq, d_model = h.shape
    head = d_model // num_heads

    def heads(t):
        return t.reshape(batch, seq, num_heads, head).transpose(0, 2, 1, 3)

    q, k, v = (heads(h @ p[w].astype(dtype)) for w in ("wq", "wk", "wv"))
    scores = jnp.matmul(q, k.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(head)
    # A token attends to itself and the tokens before it, never to later ones.
    allowed = lax.broadcasted_iota(jnp.int32, (seq, seq), 0) >= lax.broadcasted_iota(
        jnp.int32, (seq, seq), 1
    )
    scores = jnp.where(allowed, scores, jnp.float32(-1e9))
    mixed = jnp.matmul(_softmax(scores).astype(dtype), v)
    return mixed.transpose(0, 2, 1, 3).reshape(batch, seq, d_model) @ p["wo"].astype(dtype)


def _gpt_block(x: jax.Array, p: dict[str, jax.Array], num_heads: int, dtype: Any) -> jax.Array:
    """A pre-layer-norm block over the float32 residual stream ``x``: layer norms in
    float32, every matmul's operands cast to ``dtype`` first (the parameters stay
    float32), each branch's result added back in float32."""
    h = _layer_norm(x, p["ln1_scale"], p["ln1_bias"]).astype(dtype)
    x = x + _gpt_attention(h, p, num_heads, dtype).astype(jnp.float32)
    h = _layer_norm(x, p["ln2_scale"], p["ln2_bias"]).astype(dtype)
    hidden = _gelu(h @ p["w1"].astype(dtype) + p["b1"].astype(dtype))
    return x + (hidden @ p["w2"].astype(dtype)).astype(jnp.float32) + p["b2"]


def _gpt_shapes(num_layers: int, vocab: int, d_model: int, d_ff: int, seq: int) -> dict[str, Any]:
    """:func:`gpt`'s parameters as ``(shape, scale)`` (scale 0: zeros, -1: ones)."""
    square = (d_model, d_model), 1.0 / math.sqrt(d_model)
    block = {
        "ln1_scale": ((d_model,), -1),
        "ln1_bias": ((d_model,), 0),
        **{w: square for w in ("wq", "wk", "wv", "wo")},
        "ln2_scale": ((d_model,), -1),
        "ln2_bias": ((d_model,), 0),
        "w1": ((d_model, d_ff), 1.0 / math.sqrt(d_model)),
        "b1": ((d_ff,), 0),
        "w2": ((d_ff, d_model), 1.0 / math.sqrt(d_ff)),
        "b2": ((d_model,), 0),
    }
    return {
        "embed": ((vocab, d_model), 1.0),
        "position": ((seq, d_model), 0.1),
        "blocks": [dict(block) for _ in range(num_layers)],
        "final_scale": ((d_model,), -1),
        "final_bias": ((d_model,), 0),
        "unembed": ((d_model, vocab), 1.0 / math.sqrt(d_model)),
    }


def _gpt_init(
    num_layers: int, vocab: int, d_model: int, d_ff: int, seq: int
) -> Callable[[jax.Array], Any]:
    """The function drawing :func:`gpt`'s parameters from a key, one array at a time:
    each from a key of its own, by a compiled program per array shape (a few, whatever
    the depth), so that drawing needs the parameters' memory and one array's random
    bits. (One draw for all of them needed XLA temporaries of five times the
    parameters: 16.5 GB for 14 blocks of width 2048, more than a TPU v5e holds, where
    the model itself trains.)"""
    tree = _gpt_shapes(num_layers, vocab, d_model, d_ff, seq)
    leaves, structure = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: isinstance(x, tuple))

    def init(key):
        keys = jax.random.split(key, len(leaves))
        arrays = [_gpt_leaf(shape, scale)(k) for k, (shape, scale) in zip(keys, leaves)]
        return jax.tree_util.tree_unflatten(structure, arrays)

    return init


@functools.lru_cache(maxsize=64)
def _gpt_leaf(shape: tuple[int, ...], scale: float) -> Callable[[jax.Array], jax.Array]:
    """The compiled draw of one :func:`gpt` parameter: ``scale`` times a standard normal
    (``scale`` 0: zeros, -1: ones)."""
    if scale <= 0:
        return jax.jit(lambda key: jnp.full(shape, 1.0 if scale < 0 else 0.0, jnp.float32))
    return jax.jit(lambda key: scale * jax.random.normal(key, shape, jnp.float32))


def _decoder_batch(markers, num_layers, d_model, num_heads, seq, batch, vocab, d_ff, seed):
    """A decoder's sizes checked (:func:`gpt`, :func:`llama`) and its batch: ``(tokens,
    targets)`` drawn from ``seed``, the targets the tokens shifted by one."""
    _check_markers(markers)
    _check_positive(num_layers=num_layers, d_model=d_model, num_heads=num_heads, seq=seq)
    _check_positive(batch=batch, vocab=vocab, d_ff=d_ff)
    if d_model % num_heads:
        raise PipemarkError(f"d_model ({d_model}) must be a multiple of num_heads ({num_heads}).")
    stream = np.random.default_rng(seed).integers(0, vocab, size=(batch, seq + 1))
    return tuple(jnp.asarray(t, jnp.int32) for t in (stream[:, :-1], stream[:, 1:]))


def gpt(
    num_layers: int = 4,
    d_model: int = 32,
    num_heads: int = 4,
    seq: int = 16,
    batch: int = 4,
    *,
    vocab: int = 64,
    d_ff: int | None = None,
    compute_dtype: Any = jnp.bfloat16,
    markers: str | None = "boundary",
    seed: int = 0,
) -> Example:
    """A GPT (decoder-only transformer language model) trained in mixed precision:
    float32 parameters, matmuls in ``compute_dtype``.

    The layout is :func:`language_model`'s (token and learned position embeddings,
    ``num_layers`` pre-layer-norm blocks with causal self-attention and a GELU MLP of
    width ``d_ff``, by default ``4 * d_model``, a final layer norm, an untied output
    projection to ``vocab`` logits, the next-token cross-entropy). The residual stream,
    the layer norms, the attention scores and their softmax, the logits' softmax and the
    loss are float32; every matmul casts its operands to ``compute_dtype`` first
    (``astype``, so the gradients come back float32 through the casts), as
    mixed-precision training does. ``compute_dtype=jnp.float32`` gives the same model
    all in float32.

    ``params`` is a dict like :func:`language_model`'s, drawn with ``jax.random`` from
    ``seed`` on the default device; ``batch`` is ``(tokens, targets)``, ``int32`` of
    shape ``(batch, seq)``, ``targets`` the tokens shifted by one. ``markers`` defaults
    to ``"boundary"``, a :func:`pipemark.mark_pipeline_boundary` between consecutive
    blocks (block ``i`` is ``block{i}`` with ``"startend"``). The model of
    ``benchmarks/accelerator.py``, about 270M parameters, is ``gpt(16, 1024, 16,
    seq=1024, batch=8, vocab=32768)``.

    >>> ex = gpt(num_layers=2, d_model=16, num_heads=2, seq=8, batch=2, vocab=32)
    >>> ex.params["blocks"][0]["w1"].dtype, ex.params["blocks"][0]["w1"].shape
    (dtype('float32'), (16, 64))
    >>> loss = ex.loss_fn(*ex.args)
    >>> loss.dtype, bool(3.0 < float(loss) < 5.0)  # about log(32) = 3.47 at first
    (dtype('float32'), True)
    """
    d_ff = 4 * d_model if d_ff is None else d_ff
    sizes = (num_layers, d_model, num_heads, seq, batch, vocab, d_ff, seed)
    tokens, targets = _decoder_batch(markers, *sizes)
    params = _gpt_init(num_layers, vocab, d_model, d_ff, seq)(jax.random.key(seed))
    dtype = jnp.dtype(compute_dtype)

    def block(x, p):
        return _gpt_block(x, p, num_heads, dtype)

    def head(normed, unembed, targets):
        logits = normed.astype(dtype) @ unembed.astype(dtype)
        return _cross_entropy(logits.astype(jnp.float32), targets)

    return Example(_decoder_loss(markers, block, head), params, (tokens, targets))


# ------------------------------------------------------------------- Llama-style

#: The attentions :func:`llama` can be built with, by name.
LLAMA_ATTENTIONS = ("dot_product", "dot_product_mask", "einsum")


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), half-split."""
    seq, half = x.shape[1], x.shape[-1] // 2
    frequencies = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
    cos, sin = (f(angles)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention over (batch, seq, heads, head_dim), written out: scores and
    softmax in float32."""
    seq, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _llama_attention(name: str | Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    if callable(name):
        return name
    if name == "dot_product":
        return functools.partial(jax.nn.dot_product_attention, is_causal=True)
    if name == "dot_product_mask":

        def masked(q, k, v):
            causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), dtype=bool))
            return jax.nn.dot_product_attention(q, k, v, mask=causal[None, None])

        return masked
    if name == "einsum":
        return _einsum_attention
    raise PipemarkError(
        f"llama: unknown attention {name!r}; choose one of {', '.join(LLAMA_ATTENTIONS)} "
        "or pass a function attention(q, k, v) over (batch, seq, heads, head_dim)."
    )


def _llama_block(x, p, num_heads: int, dtype: Any, attention: Callable[..., jax.Array]):
    """A Llama block over the float32 residual stream ``x``: RMSNorm, rotary causal
    attention, RMSNorm, a SwiGLU MLP; matmuls in ``dtype``."""
    batch, seq, d_model = x.shape
    h = _rms_norm(x, p["attn_norm"]).astype(dtype)
    q, k, v = (
        (h @ p[w].astype(dtype)).reshape(batch, seq, num_heads, d_model // num_heads)
        for w in ("wq", "wk", "wv")
    )
    mixed = attention(_rotary(q), _rotary(k), v).reshape(batch, seq, d_model)
    x = x + (mixed @ p["wo"].astype(dtype)).astype(jnp.float32)
    h = _rms_norm(x, p["mlp_norm"]).astype(dtype)
    gated = jax.nn.silu(h @ p["w_gate"].astype(dtype)) * (h @ p["w_up"].astype(dtype))
    return x + (gated @ p["w_down"].astype(dtype)).astype(jnp.float32)


def _llama_params(num_layers, vocab, d_model, d_ff, tied, seed) -> dict[str, Any]:
    key = jax.random.key(seed)
    keys = iter(jax.random.split(key, 2 + 7 * num_layers))

    def normal(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

    def block():
        square = {w: normal((d_model, d_model), d_model) for w in ("wq", "wk", "wv", "wo")}
        return {
            "attn_norm": jnp.ones((d_model,), jnp.float32),
            **square,
            "mlp_norm": jnp.ones((d_model,), jnp.float32),
            "w_gate": normal((d_model, d_ff), d_model),
            "w_up": normal((d_model, d_ff), d_model),
            "w_down": normal((d_ff, d_model), d_ff),
        }

    # std 1/sqrt(d_model): with tied embeddings the logits of a normed stream stay O(1)
    params = {"embed": normal((vocab, d_model), d_model)}
    params["blocks"] = [block() for _ in range(num_layers)]
    params["final_norm"] = jnp.ones((d_model,), jnp.float32)
    if not tied:
        params["unembed"] = normal((d_model, vocab), d_model)
    return params


def llama(
    num_layers: int = 4,
    d_model: int = 32,
    num_heads: int = 4,
    seq: int = 16,
    batch: int = 4,
    *,
    vocab: int = 64,
    d_ff: int | None = None,
    attention: str | Callable[..., jax.Array] = "dot_product",
    tied: bool = True,
    compute_dtype: Any = jnp.bfloat16,
    markers: str | None = "boundary",
    seed: int = 0,
) -> Example:
    """A Llama-style language model written the way JAX users write one: RMSNorm,
    rotary embeddings, a SwiGLU MLP (``jax.nn.silu``) of width ``d_ff`` (by default
    ``8 * d_model // 3``), embeddings tied to the output projection when ``tied``,
    float32 parameters and matmuls in ``compute_dtype``.

    ``attention`` is ``"dot_product"`` (``jax.nn.dot_product_attention(q, k, v,
    is_causal=True)``), ``"dot_product_mask"`` (the same with a boolean causal
    ``mask``), ``"einsum"`` (written out, softmax in float32) or a function
    ``attention(q, k, v)`` over ``(batch, seq, heads, head_dim)`` arrays, e.g. a Pallas
    kernel. ``markers`` places a :func:`pipemark.mark_pipeline_boundary` between
    blocks (``"boundary"``) or start/end pairs (``"startend"``). ``batch`` is
    ``(tokens, targets)`` of shape ``(batch, seq)``.

    >>> ex = llama(num_layers=2, d_model=16, num_heads=2, seq=8, batch=2, vocab=32)
    >>> sorted(ex.params)
    ['blocks', 'embed', 'final_norm']
    >>> bool(3.0 < float(ex.loss_fn(*ex.args)) < 4.5)  # about log(32) = 3.47 at first
    True
    """
    d_ff = 8 * d_model // 3 if d_ff is None else d_ff
    sizes = (num_layers, d_model, num_heads, seq, batch, vocab, d_ff, seed)
    tokens, targets = _decoder_batch(markers, *sizes)
    attend = _llama_attention(attention)
    dtype = jnp.dtype(compute_dtype)
    params = _llama_params(num_layers, vocab, d_model, d_ff, tied, seed)

    def loss_fn(params, batch):
        tokens, targets = batch
        blocks, last = params["blocks"], len(params["blocks"]) - 1
        x = tokens
        for i, p in enumerate(blocks):
            extra = {"embed": params["embed"]} if i in (0, last) else {}
            if i == last:
                extra["final_norm"] = params["final_norm"]
                if "unembed" in params:
                    extra["unembed"] = params["unembed"]
            x, p, extra = _layer_begin(markers, f"block{i}", i, (x, p, extra))
            if i == 0:
                x = jnp.take(extra["embed"], x, axis=0)
            x = _llama_block(x, p, num_heads, dtype, attend)
            if i == last:
                out = extra.get("unembed", extra["embed"].T)
                logits = _rms_norm(x, extra["final_norm"]).astype(dtype) @ out.astype(dtype)
                log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                x = -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
            x = _layer_finish(markers, f"block{i}", x)
        return x

    return Example(loss_fn, params, (tokens, targets))


# ------------------------------------------------------------ stages of fixed duration


def sleeping(num_stages: int = 2, seconds: float = 0.005, batch: int = 8) -> Example:
    """``num_stages`` tiny marked stages whose forward and backward each wait ``seconds``
    in a host callback: equal stages whose duration does not depend on how many cores
    the machine has, for measuring a pipeline runtime rather than the hardware.

    ``params`` is a list of ``(4, 4)`` weights, ``batch`` is ``ones((batch, 4))``; stage
    ``i`` is marked ``stage{i}``.

    >>> ex = sleeping(num_stages=2, seconds=0.0)
    >>> float(ex.loss_fn(*ex.args)) > 0
    True
    """
    _check_positive(num_stages=num_stages, batch=batch)

    def wait(x):
        time.sleep(seconds)
        return np.asarray(x)

    def call(x):
        return jax.pure_callback(wait, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    @jax.custom_vjp  # pure_callback has no derivative: give it one that waits too
    def sleep(x):
        return call(x)

    sleep.defvjp(lambda x: (call(x), None), lambda _, g: (call(g),))
    params = [jnp.eye(4, dtype=jnp.float32) * 0.5 for _ in range(num_stages)]

    def loss_fn(params, batch):
        x = batch
        for i, w in enumerate(params):
            x, w = mark((x, w), name=f"stage{i}", mark_type="start")
            x = sleep(jnp.tanh(x @ w))
            if i == len(params) - 1:
                x = jnp.mean(x * x)
            x = mark(x, name=f"stage{i}", mark_type="end")
        return x

    return Example(loss_fn, params, jnp.ones((batch, 4), jnp.float32))


# ------------------------------------------------------------------ sized for benchmarks

_SIZED_BUILDERS: dict[str, Callable[..., Example]] = {
    "mlp": lambda n, markers, seed: mlp(n, width=8, batch=4, markers=markers, seed=seed),
    "resnet": lambda n, markers, seed: resnet(n, width=8, batch=4, markers=markers, seed=seed),
    "transformer": lambda n, markers, seed: transformer(
        n, d_model=8, num_heads=2, seq=4, batch=2, markers=markers, seed=seed
    ),
}


def sized(
    kind: str,
    num_eqns: int,
    *,
    grad: bool = True,
    markers: str | None = "startend",
    seed: int = 0,
) -> Example:
    """A model of family ``kind`` (``"mlp"``, ``"resnet"`` or ``"transformer"``) whose
    traced program has about ``num_eqns`` top-level equations.

    With ``grad`` the count is that of ``jax.value_and_grad(loss_fn)``; otherwise that
    of ``loss_fn``. The layers are small (width 8), so tracing time is dominated by the
    number of equations, not by array sizes. The count is exact up to one layer's worth
    of equations.

    >>> ex = sized("mlp", 500, grad=False)
    >>> abs(len(ex.trace().eqns) - 500) <= 10
    True
    """
    builder = _SIZED_BUILDERS.get(kind)
    if builder is None:
        raise PipemarkError(
            f"Unknown model kind {kind!r}; choose one of {', '.join(_SIZED_BUILDERS)}."
        )
    _check_positive(num_eqns=num_eqns)
    # Equations grow linearly in the number of layers, apart from the first and last
    # layers (input handling, the loss): measure the slope between 3 and 4 layers.
    counts = [len(builder(n, markers, seed).trace(grad).eqns) for n in (3, 4)]
    per_layer = counts[1] - counts[0]
    base = counts[0] - 3 * per_layer
    num_layers = max(1, round((num_eqns - base) / per_layer))
    return builder(num_layers, markers, seed)


# --------------------------------------------------------------------------- training


def train_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    *,
    optimizer: str = "sgd",
    learning_rate: float = 1e-2,
) -> tuple[Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]], Callable[[Any], Any]]:
    """A training step with the gradients marked by :func:`pipemark.mark_gradient`.

    Returns ``(step, init_state)``: ``step(params, state, batch)`` returns
    ``(new_params, new_state, loss)``, and ``init_state(params)`` makes the optimizer
    state (``()`` for ``"sgd"``; first and second moments and a step count for
    ``"adam"``). :func:`pipemark.passes.split_at_gradient` cuts the traced step at the
    marker.

    >>> import jax
    >>> ex = mlp(num_layers=2)
    >>> step, init_state = train_step(ex.loss_fn, optimizer="adam")
    >>> params, state, loss = step(ex.params, init_state(ex.params), ex.batch)
    >>> int(state[2])
    1
    """
    if optimizer not in ("sgd", "adam"):
        raise PipemarkError(f"Unknown optimizer {optimizer!r}; choose 'sgd' or 'adam'.")
    tree_map = jax.tree_util.tree_map

    def gradients(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return loss, mark_gradient(grads)

    if optimizer == "sgd":

        def init_state(params):
            return ()

        def step(params, state, batch):
            loss, grads = gradients(params, batch)
            new_params = tree_map(lambda p, g: p - learning_rate * g, params, grads)
            return new_params, state, loss

        return step, init_state

    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def init_state(params):
        zeros = tree_map(jnp.zeros_like, params)
        return (zeros, zeros, jnp.zeros((), jnp.int32))

    def step(params, state, batch):
        loss, grads = gradients(params, batch)
        m, v, count = state
        count = count + 1
        m = tree_map(lambda m, g: beta1 * m + (1 - beta1) * g, m, grads)
        v = tree_map(lambda v, g: beta2 * v + (1 - beta2) * g * g, v, grads)
        t = count.astype(jnp.float32)
        correction = jnp.sqrt(1 - beta2**t) / (1 - beta1**t)
        new_params = tree_map(
            lambda p, m, v: p - learning_rate * correction * m / (jnp.sqrt(v) + eps),
            params,
            m,
            v,
        )
        return new_params, (m, v, count), loss

    return step, init_state
