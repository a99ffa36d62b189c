"""verify's tolerance from the program's precision, and the jit-eager spread.

The models here compute the way real ones train: float32 parameters cast to bfloat16
(or float16) before each matmul, float32 softmax, layer norm and loss (float32 islands
between bfloat16 matmuls), boundary markers between blocks. They are small (d_model 32,
two blocks) so that the tests stay fast.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pipemark as pm
from pipemark.verification import SPREAD_FACTOR, compare_results, raise_on_mismatch

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
VOCAB, D_MODEL, SEQ, BATCH, BLOCKS = 32, 32, 8, 2, 2


# ------------------------------------------------------------ a bfloat16 GPT


def matmul(x, w, dtype=BF16):
    """``x @ w`` computed in ``dtype`` (the operands cast), returned as float32."""
    return (x.astype(dtype) @ w.astype(dtype)).astype(F32)


def layer_norm(x, gain):
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * gain


def attention(p, x, scale):
    q, k, v = jnp.split(matmul(layer_norm(x, p["norm"]), p["qkv"] * scale), 3, -1)
    scores = jnp.einsum("bqd,bkd->bqk", q.astype(BF16), k.astype(BF16)).astype(F32)
    scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), scores / D_MODEL**0.5, -1e9)
    weights = jax.nn.softmax(scores, -1)  # float32, between bfloat16 matmuls
    out = jnp.einsum("bqk,bkd->bqd", weights.astype(BF16), v.astype(BF16)).astype(F32)
    return matmul(out, p["out"])


def gpt_loss(scaled_block=None):
    """A GPT's next-token loss, with a float32 prior on ``params["prior"]`` (the only
    value that meets it), and the mean square of the embeddings (float32 only) as an
    auxiliary result. ``scaled_block``'s weights are multiplied by 1.1: a wrong program,
    for the staged side."""

    def loss(params, tokens, targets):
        x = params["embed"][tokens]
        embedded = jnp.mean(x**2)
        for i, p in enumerate(params["blocks"]):
            if i:
                pm.mark_pipeline_boundary()
            scale = 1.1 if i == scaled_block else 1.0
            x = x + attention(p, x, scale)
            x = x + matmul(jax.nn.relu(matmul(x, p["up"] * scale)), p["down"] * scale)
        log_probs = jax.nn.log_softmax(matmul(x, params["head"]), -1)
        nll = -jnp.take_along_axis(log_probs, targets[..., None], -1).mean()
        return nll + 1e-2 * jnp.sum(params["prior"] ** 2), embedded

    return loss


def gpt_params(seed):
    rng = np.random.default_rng(seed)  # numpy: nothing to compile
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / shape[0] ** 0.5, F32)  # noqa: E731
    blocks = [
        {
            "norm": jnp.ones(D_MODEL),
            "qkv": normal(D_MODEL, 3 * D_MODEL),
            "out": normal(D_MODEL, D_MODEL),
            "up": normal(D_MODEL, 4 * D_MODEL),
            "down": normal(4 * D_MODEL, D_MODEL),
        }
        for _ in range(BLOCKS)
    ]
    head, prior = normal(D_MODEL, VOCAB), normal(4)
    return {"blocks": blocks, "embed": normal(VOCAB, D_MODEL), "head": head, "prior": prior}


@pytest.mark.slow  # about 10 s of CPU: every equation of the GPT's training step
def test_a_bfloat16_gpt_verifies_with_the_defaults_and_one_wrong_block_fails():
    # One test, not three: the eager runs compile each of the program's 400 equations
    # once, which a second pytest-xdist worker would do again.
    params = gpt_params(0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    args = (params, tokens, jnp.roll(tokens, -1, 1))
    train = jax.value_and_grad(gpt_loss(), has_aux=True)
    staged = pm.split(train, *args)
    check_the_correct_program(staged.verify(train, *args))
    wrong = pm.split(jax.value_and_grad(gpt_loss(scaled_block=1), has_aux=True), *args)
    check_the_wrong_program(wrong, train, args)
    # The caller's tolerance overrides the program's; against jit alone, no spread.
    # (The wrong program: the right one may equal jit within 1e-5, as it does compiled
    # at XLA's optimisation level 0, where the two round alike.)
    with pytest.raises(pm.VerificationError, match=r"rtol 1e-05, atol 0\)") as caught:
        wrong.verify(train, *args, rtol=1e-5, against="jit")
    report = caught.value.report
    assert {c.tolerance_from for c in report.checks} == {""}
    assert report.largest_relative_spread is None
    text = str(report)
    assert "jit-eager spread: not measured (compared against jit only" in text
    assert "tolerance from the narrowest" not in text


def check_the_correct_program(report):
    assert report.passed and report.spread_between == ("jit", "eager")
    # Results: the loss, the embeddings' mean square, the gradients (prior's last).
    tolerance_from = {c.index: c.tolerance_from for c in report.checks}
    last = len(tolerance_from) - 1
    assert [tolerance_from[i] for i in (0, 1, 2, last - 1, last)] == [
        "bfloat16",
        "float32",  # float32 only: never meets a bfloat16 value
        "bfloat16",
        "bfloat16",
        "float32",  # the prior's gradient: float32 only
    ]
    rtols = {c.index: c.rtol for c in report.checks}
    assert (rtols[0], rtols[1], rtols[last]) == (3e-2, 1e-5, 1e-5)
    assert report.comparison == "within rtol 1e-05, 0.03"
    # On JAX 0.10 its own two evaluations differ by bfloat16 rounding, which moves some
    # values across the ReLU's kink: where the spread is wider than bfloat16's tolerance,
    # it sets the tolerance. JAX 0.12's eager rounds as its jit does: nothing widens.
    widened = [c for c in report.checks if c.widened]
    assert all(c.atol == SPREAD_FACTOR * c.spread for c in widened)
    text = str(report)
    if report.largest_relative_spread > 3e-2:
        assert widened and "bfloat16, 2x spread" in text
    else:
        assert not widened and "2x spread" not in text
    assert "jit-eager spread (largest difference / largest magnitude, per result): up to" in text
    assert f"results 0, 2-{last - 1}: bfloat16: made by equation " in text
    assert f"results 1, {last}: float32: the result's own type; nothing narrower" in text


def check_the_wrong_program(wrong, train, args):
    """One block's weights scaled by 1.1 in the staged program: still caught."""
    with pytest.raises(pm.VerificationError, match=r"differs from the reference") as caught:
        wrong.verify(train, *args)
    report = caught.value.report
    # The seeded error is many times JAX's own rounding on every gradient it changes.
    assert len({c.index for c in report.checks if not c.passed}) >= 10
    # (Where JAX's jit and eager round alike, as at XLA's optimisation level 0 on JAX
    # 0.12, there is no spread, and the tolerances alone decide.)
    spread = [c.largest_difference / c.spread for c in report.checks if c.spread]
    assert not spread or max(spread) > 10
    message, text = str(caught.value), str(report)
    if report.largest_relative_spread > 3e-2:  # JAX 0.10: see check_the_correct_program
        assert "x the jit-eager spread of this result" in message
        assert re.search(r"staged program vs the references: up to .*x its spread\)", text)
    else:  # the bfloat16 tolerance decides, and the message says the references agree
        assert "from bfloat16: made by equation" in message
        assert re.search(r"staged program vs the references: up to [0-9.]+ %", text)


# ----------------------------------------------------------------- float16


def test_a_float16_compute_model_verifies_with_float16_tolerance():
    def loss(params, x, y):
        for i, w in enumerate(params):
            if i:
                pm.mark_pipeline_boundary()
            x = jnp.tanh(matmul(x, w, F16))
        return jnp.mean((x - y) ** 2)

    rng = np.random.default_rng(2)
    params = [jnp.asarray(rng.normal(size=(D_MODEL, D_MODEL)) / 6, F32) for _ in range(2)]
    x, y = jnp.asarray(rng.normal(size=(2, SEQ, D_MODEL)), F32)
    train = jax.value_and_grad(loss)
    report = pm.split(train, params, x, y).verify(train, params, x, y)
    assert report.passed and {c.tolerance_from for c in report.checks} == {"float16"}
    assert {c.rtol for c in report.checks} == {5e-3}


# ---------------------------------------------------- the comparison itself


class Narrow:
    """A compute type as :func:`pipemark.precision.result_compute_types` gives one."""

    def __init__(self, dtype, reason):
        self.dtype, self.reason = dtype, reason


def test_compare_results_takes_the_tolerance_of_the_compute_type():
    want = np.float32([1.0, -2.0, 0.5])
    got = want * np.float32(1.004)  # bfloat16 rounding, far outside float32's
    wants = {"jit": [want], "eager": [want * np.float32(1.0005)]}
    plain = compare_results([got], wants, ["r"])
    assert not plain.passed and plain.checks[0].tolerance_from == "float32"
    narrow = compare_results([got], wants, ["r"], compute_types=[Narrow("bfloat16", "why")])
    assert narrow.passed and narrow.checks[0].rtol == 3e-2
    assert narrow.checks[0].atol == pytest.approx(3e-2 * 2.0)
    assert narrow.checks[0].spread == pytest.approx(0.001, rel=1e-3)
    assert narrow.checks[0].relative_spread == pytest.approx(0.0005, rel=1e-3)
    assert "  result 0: why" in str(narrow)


def test_bfloat16_results_are_compared_within_a_tolerance():
    want = np.array([1.0, 2.0, 3.0], ml_dtypes.bfloat16)
    got = np.array([1.0, 2.0, 3.015625], ml_dtypes.bfloat16)  # one unit in the last place
    report = compare_results([got], {"jit": [want]}, ["r"])
    assert report.passed and report.checks[0].largest_difference == 0.015625
    assert not compare_results([got], {"jit": [want]}, ["r"], rtol=0, atol=0).passed


def test_a_result_whose_references_differ_widely_is_judged_at_their_spread():
    want = np.float32([1.0, -1.0, 0.0])
    wants = {"jit": [want], "eager": [want + np.float32([0.0, 0.0, 0.5])]}  # a kink
    got = [want + np.float32([0.0, 0.0, 0.9])]
    report = compare_results(got, wants, ["r"], compute_types=[Narrow("bfloat16", "why")])
    assert report.passed and [c.widened for c in report.checks] == [True, True]
    assert report.checks[0].atol == 1.0 and "bfloat16, 2x spread" in str(report)
    # One reference, or a tolerance given: no widening.
    assert not compare_results(got, {"jit": [want]}, ["r"]).passed
    assert not compare_results(got, wants, ["r"], rtol=3e-2).passed


def test_the_error_compares_the_difference_with_the_spread():
    want = np.float32([1.0, 2.0])
    wants = {"jit": [want], "eager": [want + np.float32(1e-4)]}
    with pytest.raises(pm.VerificationError) as caught:
        raise_on_mismatch(compare_results([want + np.float32(1e-2)], wants, ["r"]))
    assert "that is 1e+02x the jit-eager spread of this result (0.0001" in str(caught.value)
    # Within twice the spread, a default tolerance passes; a given one says so.
    near = [want + np.float32(1.5e-4)]
    assert compare_results(near, wants, ["r"]).passed
    with pytest.raises(pm.VerificationError, match="the size of JAX's own rounding"):
        raise_on_mismatch(compare_results(near, wants, ["r"], rtol=1e-5, atol=0))
