"""One transformer decoder layer's compute and memory at the per-chip shapes a layout
gives it: forward time, forward+backward time under MaxText's
remat policies, the recomputation each policy costs, and the compiled program's memory.

    python benchmarks/layer_costs.py --grid v5e --budget-s 330 \\
        --out "$OUT/layer-costs-tpu-v5e.json"

The layer is MaxText's dense decoder block, in bf16 parameters and activations:
pre-norm RMSNorm; attention of ``n_heads × head_dim`` (which need not equal
``d_model``) with ``n_kv_heads`` grouped key/value heads and causal
``jax.nn.dot_product_attention``; an MLP of kind ``swiglu`` (``wi_0``, ``wi_1``, ``wo``)
or ``gelu`` (``wi``, ``wo``). Its matmuls' outputs carry MaxText's
``checkpoint_name`` tags (``query_proj``, ``key_proj``, ``value_proj``, ``out_proj``,
``mlpwi_0``, ``mlpwi_1``, ``mlpwo``) so that the remat policies below are MaxText's
(``get_remat_policy`` in its decoders.py):

* ``none``: no ``jax.checkpoint``; the backward pass reads every residual;
* ``full``: ``jax.checkpoint`` saving nothing: the forward pass runs again;
* ``save_dot_except_mlpwi``: ``save_only_these_names`` of the attention projections,
  ``out_proj`` and ``mlpwo``;
* ``minimal``: ``checkpoint_dots_with_no_batch_dims`` (every projection's output; not
  attention's scores, which are dots with batch dimensions).

With FSDP or data parallelism a chip computes the whole layer at its own rows, so the
per-chip layer is the full layer at ``rows`` rows a chip; tensor parallelism of ``t``
divides the heads and the MLP width by ``t`` (the ``v5e`` grid's 128B entry, FSDP 16 ×
TP 16). FLOPs are MaxText's count (``calculate_tflops_training_per_device``): ``2·m·n·k``
a matmul, attention's two matmuls ``4·B·S²·H·D`` halved for the causal mask, training =
3 × forward; achieved TFLOP/s is that training count over the forward+backward time (so
a remat policy's recomputation shows as lower TFLOP/s, as in MaxText's logs).

``--attention flash`` (or ``xla,flash``: both, a shape's two records side by side)
measures the layer with the Pallas TPU flash kernel in place of
``jax.nn.dot_product_attention`` (MaxText's v5e runs used flash attention; XLA's
attention keeps ``rows × heads × seq²`` scores, which at 16B's 6 rows do not fit).
``--only 16B,128B`` measures the shapes whose names hold one of the words, to split the
grid across calls.

Each record (one a shape and policy) goes to ``--out`` as JSON after every shape, so a
run stopped by ``--budget-s`` (checked before each measurement) or killed keeps what it
measured; a shape that fails (out of memory) is recorded with its error and the run goes
on. A table goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import io
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

#: The names MaxText's policies save, beside the policy-free ``none`` and ``full``.
SAVED_NAMES = {
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
}
POLICIES = ("none", "full", "save_dot_except_mlpwi", "minimal")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder layer's per-chip shape.

    >>> s = Shape("x", d_model=64, n_heads=4, n_kv_heads=2, head_dim=8, mlp=128, rows=2, seq=16)
    >>> s.n_heads * s.head_dim, s.mlp_kind
    (32, 'swiglu')
    """

    name: str
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp: int
    rows: int
    seq: int
    mlp_kind: str = "swiglu"


def forward_flops(s: Shape) -> dict[str, int]:
    """MaxText's forward FLOPs of one layer at shape ``s`` by part (its
    ``calculate_tflops_training_per_device``, one decoder layer, no embedding):
    ``qkv``, ``out_proj``, ``mlp`` (one matmul a matrix) and causal ``attention``
    (QKᵀ and AV, ``4·B·S²·H·D`` halved). Training is 3 × their sum.

    >>> f = forward_flops(Shape("x", 4, 2, 1, 3, 5, rows=1, seq=2, mlp_kind="gelu"))
    >>> f["qkv"], f["out_proj"], f["mlp"], f["attention"]
    (192, 96, 160, 48)
    """
    tokens = s.rows * s.seq
    matrices_in = 2 if s.mlp_kind == "swiglu" else 1
    return {
        "qkv": 2 * tokens * s.d_model * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim,
        "out_proj": 2 * tokens * s.d_model * s.n_heads * s.head_dim,
        "mlp": 2 * tokens * s.d_model * s.mlp * (matrices_in + 1),
        "attention": 4 * s.rows * s.seq**2 * s.n_heads * s.head_dim // 2,
    }


def init_params(s: Shape, key: jax.Array) -> dict[str, jax.Array]:
    """The layer's bf16 parameters, scaled so activations stay near unit size."""
    dims = {
        "wq": (s.d_model, s.n_heads, s.head_dim),
        "wk": (s.d_model, s.n_kv_heads, s.head_dim),
        "wv": (s.d_model, s.n_kv_heads, s.head_dim),
        "wo": (s.n_heads, s.head_dim, s.d_model),
        "mlp_wo": (s.mlp, s.d_model),
    }
    dims.update(
        {"wi_0": (s.d_model, s.mlp), "wi_1": (s.d_model, s.mlp)}
        if s.mlp_kind == "swiglu"
        else {"wi": (s.d_model, s.mlp)}
    )
    keys = jax.random.split(key, len(dims))
    params = {
        name: (jax.random.normal(k, shape, jnp.float32) / (shape[0] ** 0.5)).astype(jnp.bfloat16)
        for k, (name, shape) in zip(keys, sorted(dims.items()), strict=True)
    }
    params["norm_attn"] = jnp.ones((s.d_model,), jnp.bfloat16)
    params["norm_mlp"] = jnp.ones((s.d_model,), jnp.bfloat16)
    return params


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm in float32, cast back to the activations' dtype (as MaxText's)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention by the Pallas TPU flash kernel (MaxText's ``attention=flash``
    of 2023), key/value heads repeated to the query heads; ``[b, t, n, h]`` in and out.
    Off a TPU the kernel runs interpreted (slow: for tests of this script only)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    seq, heads = q.shape[1], q.shape[2]
    k, v = (jnp.repeat(a, heads // a.shape[2], axis=2) for a in (k, v))
    block = min(512, seq)
    sizes = fa.BlockSizes(block, block, block, 1, *([block] * 7))
    call = functools.partial(fa.flash_attention, causal=True, sm_scale=q.shape[-1] ** -0.5)
    if jax.default_backend() != "tpu" and not isinstance(fa.pl, _Namespace):
        # The kernel's module gets an interpreted pallas_call for the rest of this
        # process: its backward pass is traced after this call returns.
        fa.pl = _Namespace(pl, pallas_call=functools.partial(pl.pallas_call, interpret=True))
    out = call(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)), block_sizes=sizes)
    return out.transpose(0, 2, 1, 3)


class _Namespace:
    """A module's attributes with some replaced."""

    def __init__(self, module, **replaced):
        self.__dict__.update({k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
        self.__dict__.update(replaced)


def layer(params: dict[str, jax.Array], x: jax.Array, attention: str = "xla") -> jax.Array:
    """One pre-norm decoder layer on ``x`` of ``[rows, seq, d_model]`` (bf16);
    ``attention`` is ``xla`` (``jax.nn.dot_product_attention``) or ``flash``."""
    h = rms_norm(x, params["norm_attn"])
    q = checkpoint_name(jnp.einsum("btd,dnh->btnh", h, params["wq"]), "query_proj")
    k = checkpoint_name(jnp.einsum("btd,dnh->btnh", h, params["wk"]), "key_proj")
    v = checkpoint_name(jnp.einsum("btd,dnh->btnh", h, params["wv"]), "value_proj")
    if attention == "flash":
        a = flash(q, k, v)
    else:
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + checkpoint_name(jnp.einsum("btnh,nhd->btd", a, params["wo"]), "out_proj")
    h = rms_norm(x, params["norm_mlp"])
    if "wi_0" in params:
        gate = checkpoint_name(h @ params["wi_0"], "mlpwi_0")
        up = checkpoint_name(h @ params["wi_1"], "mlpwi_1")
        hidden = jax.nn.silu(gate) * up
    else:
        hidden = jax.nn.gelu(checkpoint_name(h @ params["wi"], "mlpwi"))
    return x + checkpoint_name(hidden @ params["mlp_wo"], "mlpwo")


def remat(policy: str, attention: str = "xla"):
    """``layer`` under a MaxText remat policy (see the module's docstring)."""
    fn = functools.partial(layer, attention=attention)
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    if policy == "minimal":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    names = SAVED_NAMES[policy]
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*names))


def train_step(policy: str, attention: str = "xla"):
    """The forward+backward program: a scalar loss's value and its gradients with
    respect to the parameters and the input (the cotangent a layer below would get)."""
    fn = remat(policy, attention)

    def loss(params, x):
        return jnp.mean(fn(params, x).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def median_time(compiled, args, warmup: int, repeats: int) -> float:
    """The median seconds of ``repeats`` calls after ``warmup`` calls, each call
    waited for (``block_until_ready``) before the clock stops."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


#: A line of ``print_saved_residuals``: ``bf16[1,64,4,16] named 'query_proj' from ...``.
RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")
#: Bytes an element of each dtype its lines name.
ITEMSIZE = {"bool": 1, "pred": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8}


def residual_bytes(policy: str, attention: str, params: dict, x: jax.Array) -> int:
    """The bytes a layer keeps from its forward pass for its backward pass under
    ``policy``, its parameters left out (a stack of layers keeps these once a layer):
    the residuals of ``jax.vjp`` as ``jax.ad_checkpoint.print_saved_residuals`` lists
    them, the layer's input included where a policy saves it. It counts the jaxpr's
    residuals, before XLA fuses any away (an upper bound for ``none``)."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(remat(policy, attention), params, x)
    total = 0
    for line in text.getvalue().splitlines():
        found = RESIDUAL.match(line.strip())
        if not found or found.group(3).startswith(("from the argument params", "from a literal")):
            continue
        dims = [int(d) for d in found.group(2).split(",") if d]
        total += math.prod(dims) * ITEMSIZE[found.group(1)]
    return total


def memory_of(compiled) -> dict[str, int | None]:
    """The compiled program's temporary, argument and output bytes (``None`` where the
    backend gives no analysis)."""
    stats = compiled.memory_analysis()
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    return {f.split("_size")[0] + "_bytes": getattr(stats, f, None) for f in fields}


def measure_shape(s: Shape, attention: str, policies, opts, deadline: float) -> list[dict]:
    """One record a policy for shape ``s``: its forward time (the same program for
    every policy), forward+backward time, recomputation (forward+backward less that of
    ``none``), FLOPs, TFLOP/s and compiled memory. A policy that fails (out of memory)
    gets a record with its error. Stops before a measurement that would start after
    ``deadline`` (``time.monotonic()``)."""
    params = init_params(s, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (s.rows, s.seq, s.d_model), jnp.bfloat16)
    flops = forward_flops(s)
    forward = sum(flops.values())
    head = {**dataclasses.asdict(s), "attention": attention}
    try:
        fwd = jax.jit(functools.partial(layer, attention=attention)).lower(params, x).compile()
        fwd_s = median_time(fwd, (params, x), opts.warmup, opts.repeats)
    except Exception as err:
        return [{**head, "policy": "forward", "error": f"{type(err).__name__}: {err}"}]
    records, base = [], None
    for policy in policies:
        if time.monotonic() > deadline:
            break
        try:
            step = train_step(policy, attention).lower(params, x).compile()
            fwdbwd_s = median_time(step, (params, x), opts.warmup, opts.repeats)
        except Exception as err:
            records.append({**head, "policy": policy, "error": f"{type(err).__name__}: {err}"})
            continue
        base = fwdbwd_s if policy == "none" else base
        records.append(
            {
                **head,
                "policy": policy,
                "fwd_s": fwd_s,
                "fwdbwd_s": fwdbwd_s,
                "recompute_s": None if base is None else fwdbwd_s - base,
                "forward_flops": forward,
                "forward_flops_by_part": flops,
                "training_flops": 3 * forward,
                "fwd_tflops": forward / fwd_s / 1e12,
                "training_tflops": 3 * forward / fwdbwd_s / 1e12,
                "fwd_memory": memory_of(fwd),
                "memory": memory_of(step),
                "residual_bytes": residual_bytes(policy, attention, params, x),
            }
        )
        del step
    return records


def _scaled(name: str, d_model: int, heads: int, mlp: int, tp: int, rows, **kw) -> list[Shape]:
    """A model's per-chip layers at several rows a chip; tensor parallelism ``tp``
    divides the heads and the MLP width."""
    return [
        Shape(f"{name} r{r}", d_model, heads // tp, heads // tp, 128, mlp // tp, r, 2048, **kw)
        for r in rows
    ]


def grid(name: str) -> list[Shape]:
    """The shapes measured, in the order measured (the most wanted first, so that a
    budget cut keeps them).

    ``v5e``: MaxText's v5e "largest_job" models (``global_parameter_scale`` 16..128 on
    its base config: d_model 2048 × 2^e, 16 × 2^h heads of 128, MLP 7168 × 2^h, SwiGLU,
    sequence 2048): 16B (d 4096, 64 heads, MLP 28672, 6 rows a chip), 32B and 64B (d
    8192, 64 heads, MLP 28672; 4 and 2 rows), 128B (d 8192, 128 heads, MLP 57344, TP 16:
    8 heads and MLP 3584 a chip, 1 row); their published rows first, then other rows a
    chip, then the base d_model 2048 and a GELU MLP.

    >>> [s.name for s in grid("tiny")]
    ['tiny-swiglu r2', 'tiny-gelu r1']
    """
    if name == "tiny":
        small = dict(seq=64, n_kv_heads=2, head_dim=16)
        return [
            # 8 heads × 16 ≠ d_model, 2 key/value heads
            Shape("tiny-swiglu r2", 64, 8, mlp=256, rows=2, **small),
            Shape("tiny-gelu r1", 64, 4, mlp=256, rows=1, mlp_kind="gelu", **small),
        ]
    published = [
        *_scaled("16B", 4096, 64, 28672, 1, [6]),
        *_scaled("32B", 8192, 64, 28672, 1, [4]),
        *_scaled("64B", 8192, 64, 28672, 1, [2]),
        *_scaled("128B tp16", 8192, 128, 57344, 16, [1]),
    ]
    others = [
        *_scaled("16B", 4096, 64, 28672, 1, [1, 2, 4, 8]),
        *_scaled("32B", 8192, 64, 28672, 1, [1]),
        *_scaled("128B tp16", 8192, 128, 57344, 16, [2, 4, 8]),
        *_scaled("base", 2048, 16, 7168, 1, [1, 4, 8]),
        *_scaled("16B-gelu", 4096, 64, 16384, 1, [4], mlp_kind="gelu"),
    ]
    return published + others


def table(records: list[dict]) -> list[str]:
    """The records as a markdown table (times in ms, memory in GiB)."""
    lines = [
        "| shape | attention | policy | fwd ms | fwd+bwd ms | recompute ms | TFLOP/s (train) | temp GiB |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['attention']} | {r['policy']} | {r['error'][:80]} |")
            continue
        temp = r["memory"]["temp_bytes"]
        recompute = "-" if r["recompute_s"] is None else f"{1e3 * r['recompute_s']:.2f}"
        lines.append(
            f"| {r['name']} | {r['attention']} | {r['policy']} | {1e3 * r['fwd_s']:.2f} | "
            f"{1e3 * r['fwdbwd_s']:.2f} | {recompute} | {r['training_tflops']:.3g} | "
            f"{'-' if temp is None else f'{temp / 2**30:.2f}'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    """Measure the grid, write the JSON after every shape, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=("tiny", "v5e"), default="tiny")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--attention", default="xla", help="xla, flash or both: xla,flash")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", help="comma list: measure the shapes whose names hold one")
    parser.add_argument("--budget-s", type=float, default=330.0)
    parser.add_argument("--out", help="write the results here as JSON")
    opts = parser.parse_args(argv)
    policies = tuple(opts.policies.split(","))
    unknown = set(policies) - set(POLICIES)
    if set(opts.attention.split(",")) - {"xla", "flash"}:
        parser.error(f"--attention {opts.attention}: xla, flash or xla,flash")
    if unknown or "none" not in policies:
        parser.error(f"--policies: {sorted(unknown)} unknown; 'none' needed (of {POLICIES})")
    start = time.monotonic()
    deadline = start + opts.budget_s
    result = {
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "grid": opts.grid,
        "complete": False,
        "records": [],
    }
    shapes = [
        s
        for s in grid(opts.grid)
        if not opts.only or any(w in s.name for w in opts.only.split(","))
    ]
    runs = [(s, a) for s in shapes for a in opts.attention.split(",")]
    for i, (s, attention) in enumerate(runs):
        if time.monotonic() > deadline:
            print(f"- budget of {opts.budget_s:.0f} s spent: {len(runs) - i} shapes left out")
            break
        result["records"] += measure_shape(s, attention, policies, opts, deadline)
        jax.clear_caches()  # the shape's programs, before the next shape's are compiled
        result["elapsed_s"] = time.monotonic() - start
        if opts.out:
            Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    else:
        result["complete"] = True
    result["elapsed_s"] = time.monotonic() - start
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['date']}; {result['device_kind']}; JAX {result['jax_version']}")
    print("\n".join(table(result["records"])))
    return result


if __name__ == "__main__":
    main()
