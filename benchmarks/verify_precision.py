"""One-command check of verify's tolerance from the program's precision, on any backend.

Made for a TPU (where a float32 matmul at DEFAULT precision runs in bfloat16 passes);
runs anywhere. A GPT (float32 parameters, gelu, float32 softmax, layer norm and loss,
boundary markers between blocks) is split with ``pm.split(jax.value_and_grad(loss))``
and verified with the default tolerances in four forms, and one table is printed:

(a) bfloat16 compute (parameters cast before each matmul): verifies; bfloat16 tolerance;
(b) the same, one block's weights scaled by 1.1 in the staged program only: fails, by
    many times the jit-eager spread;
(c) float32 compute at DEFAULT matmul precision: verifies; on TPU at bfloat16's
    tolerance (the matmuls), elsewhere at float32's;
(d) float32 compute under ``jax.default_matmul_precision("highest")``: verifies at
    float32's tolerance everywhere.

    python benchmarks/verify_precision.py          # d_model 256, 4 blocks, seq 128
    python benchmarks/verify_precision.py --tiny   # d_model 32, 2 blocks: a CPU check

Exit status 1 when any row is not as expected.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pipemark as pm

BF16, F32 = jnp.bfloat16, jnp.float32


def make_loss(dims: dict, dtype, scaled_block: int | None = None):
    """A GPT's next-token loss computing its matmuls in ``dtype``; ``scaled_block``'s
    weights multiplied by 1.1."""
    batch, seq, d_model, heads = dims["batch"], dims["seq"], dims["d_model"], dims["heads"]

    def matmul(x, w):
        return (x.astype(dtype) @ w.astype(dtype)).astype(F32)

    def norm(x, gain):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gain

    def attention(p, x, scale):
        q, k, v = jnp.split(matmul(norm(x, p["norm1"]), p["qkv"] * scale), 3, -1)
        split = lambda t: t.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("bhqd,bhkd->bhqk", q.astype(dtype), k.astype(dtype)).astype(F32)
        scores = scores / np.sqrt(d_model // heads)
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
        weights = jax.nn.softmax(scores, -1)
        out = jnp.einsum("bhqk,bhkd->bhqd", weights.astype(dtype), v.astype(dtype)).astype(F32)
        return matmul(out.transpose(0, 2, 1, 3).reshape(batch, seq, d_model), p["out"])

    def loss(params, tokens, targets):
        x = params["embed"][tokens]
        for i, p in enumerate(params["blocks"]):
            if i:
                pm.mark_pipeline_boundary()
            scale = 1.1 if i == scaled_block else 1.0
            x = x + attention(p, x, scale)
            hidden = jax.nn.gelu(matmul(norm(x, p["norm2"]), p["up"] * scale))
            x = x + matmul(hidden, p["down"] * scale)
        log_probs = jax.nn.log_softmax(matmul(x, params["head"]), -1)
        return -jnp.take_along_axis(log_probs, targets[..., None], -1).mean()

    return loss


def make_args(dims: dict):
    rng = np.random.default_rng(0)
    d, vocab = dims["d_model"], dims["vocab"]
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / shape[0] ** 0.5, F32)  # noqa: E731
    blocks = [
        {
            "norm1": jnp.ones(d),
            "norm2": jnp.ones(d),
            "qkv": normal(d, 3 * d),
            "out": normal(d, d),
            "up": normal(d, 4 * d),
            "down": normal(4 * d, d),
        }
        for _ in range(dims["blocks"])
    ]
    params = {"embed": normal(vocab, d), "blocks": blocks, "head": normal(d, vocab)}
    tokens = jnp.asarray(rng.integers(0, vocab, (dims["batch"], dims["seq"])), jnp.int32)
    return params, tokens, jnp.roll(tokens, -1, 1)


def check(dims: dict, case: str, dtype, *, scaled_block=None, highest=False) -> tuple:
    """Split and verify one form; ``(passed, report)``."""
    args = make_args(dims)
    reference = jax.value_and_grad(make_loss(dims, dtype))
    staged_fn = jax.value_and_grad(make_loss(dims, dtype, scaled_block))
    context = jax.default_matmul_precision("highest") if highest else contextlib.nullcontext()
    with context:
        staged = pm.split(staged_fn, *args)
        try:
            return True, staged.verify(reference, *args)
        except pm.VerificationError as err:
            return False, err.report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="d_model 32, 2 blocks")
    parser.add_argument("--reports", action="store_true", help="print every report")
    options = parser.parse_args(argv)
    dims = dict(batch=8, seq=128, d_model=256, heads=4, vocab=512, blocks=4)
    if options.tiny:
        dims = dict(batch=2, seq=8, d_model=32, heads=2, vocab=32, blocks=2)
    backend = jax.default_backend()
    matmul_type = "bfloat16" if backend == "tpu" else "float32"
    cases = [
        ("(a) bfloat16 compute", dict(dtype=BF16), True, "bfloat16"),
        ("(b) one block x1.1", dict(dtype=BF16, scaled_block=1), False, "bfloat16"),
        ("(c) float32, DEFAULT", dict(dtype=F32), True, matmul_type),
        ("(d) float32, highest", dict(dtype=F32, highest=True), True, "float32"),
    ]
    print(f"backend {backend}, JAX {jax.__version__}, {dims}")
    header = ("case", "verified", "expected", "tolerance from", "spread", "staged vs refs")
    rows, failed = [header], 0
    for name, kwargs, want_pass, want_type in cases:
        passed, report = check(dims, name, **kwargs)
        types = sorted({c.tolerance_from for c in report.checks if c.tolerance_from})
        worst = max(c.relative_difference for c in report.checks)
        ok = passed == want_pass and types == [want_type]
        failed += not ok
        rows.append(
            (
                name,
                str(passed),
                f"{want_pass}, {want_type}",
                ", ".join(types) + ("" if ok else "  <-- NOT AS EXPECTED"),
                f"{100 * (report.largest_relative_spread or 0):.3g} %",
                f"{100 * worst:.3g} %",
            )
        )
        if options.reports or not ok:
            print(f"\n{name}:\n{report}\n")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("spread: largest |jit - eager| / largest |jit| over results; staged vs refs: the same")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
