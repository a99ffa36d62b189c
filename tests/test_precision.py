"""The narrowest floating type each result of a program is computed through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from pipemark.precision import matmul_type, reference_compute_types, result_compute_types

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
X = jnp.linspace(-1.0, 1.0, 4, dtype=F32)
M = jnp.ones((4, 4), F32)


def types(fn, *args, platform="cpu"):
    """The compute type names of ``fn``'s results, from its own trace."""
    found = result_compute_types(jax.make_jaxpr(fn)(*args), platform=platform)
    return [None if t is None else t.dtype for t in found]


def round_trip(x, dtype=BF16):
    return x.astype(dtype).astype(F32)


def test_a_result_takes_the_narrowest_type_on_its_path_only():
    def f(x, n):
        narrow = jnp.sin(round_trip(x)) * 2
        return narrow, jnp.cos(x), n + 1, narrow + round_trip(x, F16)

    assert types(f, X, 3) == ["bfloat16", "float32", None, "bfloat16"]
    found = result_compute_types(jax.make_jaxpr(f)(X, 3), platform="cpu")
    assert found[0].reason.startswith("bfloat16: made by equation 0 (convert_element_type, ")
    assert "test_precision.py" in found[0].reason  # the user's source line
    assert found[1].reason == "float32: the result's own type; nothing narrower on its path"


def test_narrow_inputs_constants_and_complex_results():
    def f(x, h, c):
        return x * 2, x + h.astype(F32), c * 2

    assert types(f, X, X.astype(F16), X.astype(jnp.complex64)) == [
        "float32",
        "float16",
        "float32",  # complex64 rounds like its float32 parts
    ]
    found = result_compute_types(jax.make_jaxpr(f)(X, X.astype(F16), X.astype(jnp.complex64)))
    assert found[1].reason == "float16: program input 1 (h)"


def test_a_jitted_helper_is_walked_with_its_operands():
    @jax.jit
    def helper(a, b):
        return round_trip(a), b * 2

    def f(x, y):
        a, b = helper(x, y)
        return a, b

    assert types(f, X, X) == ["bfloat16", "float32"]
    (narrow, _) = result_compute_types(jax.make_jaxpr(f)(X, X))
    assert narrow.reason.startswith("bfloat16: made by equation 0 (convert_element_type")
    assert " inside equation 0 (jit" in narrow.reason


def test_remat_custom_jvp_and_custom_vjp_bodies():
    @jax.custom_jvp
    def halve(x):
        return round_trip(x, F16) / 2

    halve.defjvp(lambda primals, tangents: (halve(primals[0]), tangents[0] / 2))

    @jax.custom_vjp
    def third(x):
        return round_trip(x) / 3

    third.defvjp(lambda x: (third(x), None), lambda _, g: (g / 3,))

    def f(x, y):
        remat = jax.checkpoint(lambda z: jnp.sin(round_trip(z)))(x)
        return remat, halve(y), jnp.sin(y), third(y)

    assert types(f, X, X) == ["bfloat16", "float16", "float32", "bfloat16"]
    # Differentiated: the custom rule's equations are the program's.
    assert types(jax.grad(lambda x: jnp.sum(f(x, x)[0])), X) == ["bfloat16"]


def test_scan_carries_narrow_until_they_stop_narrowing():
    def body(carry, x):
        a, b, c = carry
        # a turns bfloat16 in the body; b meets it one round later; c never does.
        return (round_trip(a), b + a, c * x), x * 2

    def f(a, b, c, xs):
        return lax.scan(body, (a, b, c), xs)

    assert types(f, X, X, X, jnp.ones((3, 4))) == ["bfloat16", "bfloat16", "float32", "float32"]


def test_while_and_cond():
    def f(x, y, k):
        def body(carry):
            i, a, b = carry
            return i + 1, round_trip(a), b * 2

        _, a, b = lax.while_loop(lambda c: c[0] < 3, body, (0, x, y))
        chosen = lax.cond(k > 0, lambda u, v: round_trip(u, F16), lambda u, v: v, x, y)
        return a, b, chosen, lax.cond(k > 0, jnp.sin, jnp.cos, y)

    assert types(f, X, X, 1) == ["bfloat16", "float32", "float16", "float32"]


def test_the_condition_of_a_while_loop_counts_for_its_results():
    def f(x, y):
        condition = lambda c: round_trip(c[0]).sum() < 3  # noqa: E731
        return lax.while_loop(condition, lambda c: (c[0] + 1, c[1] * 2), (x, y))

    assert types(f, X, X) == ["bfloat16", "bfloat16"]


def test_a_primitive_whose_body_this_module_cannot_map_is_read_cautiously():
    # reduce's body is the reducer: every result depends on everything inside.
    def f(x):
        return lax.reduce(x, 0.0, lambda a, b: round_trip(a) * b, (0,))

    (found,) = result_compute_types(jax.make_jaxpr(f)(X))
    assert found.dtype == "bfloat16"
    assert " inside equation 0 (reduce, " in found.reason


def test_float32_matmuls_by_platform_and_precision():
    def f(w, x):
        return x @ w, jnp.dot(x, w, precision="highest"), jnp.dot(x, w, precision="high")

    assert types(f, M, M, platform="cpu") == ["float32"] * 3
    assert types(f, M, M, platform="tpu") == ["bfloat16", "float32", "tensorfloat32"]
    assert types(f, M, M, platform="gpu") == ["tensorfloat32", "float32", "tensorfloat32"]
    found = result_compute_types(jax.make_jaxpr(f)(M, M), platform="tpu")
    assert found[0].reason.startswith("bfloat16: equation 0 (dot_general, ")
    assert found[0].reason.endswith(
        "with float32 operands, DEFAULT precision on TPU: one bfloat16 pass"
    )
    # Narrower operands are values already: the matmul adds nothing.
    assert types(lambda w, x: x.astype(BF16) @ w.astype(BF16), M, M, platform="tpu") == ["bfloat16"]


def test_the_default_matmul_precision_config_decides_unset_precisions():
    eqn = jax.make_jaxpr(lambda a: a @ a)(M).eqns[0]
    assert eqn.params["precision"] is None
    assert matmul_type(eqn, "tpu")[0] == "bfloat16"
    with jax.default_matmul_precision("highest"):
        assert matmul_type(eqn, "tpu") is None
        # Traced under the setting, the equation carries it.
        assert types(lambda a: a @ a, M, platform="tpu") == ["float32"]
    with jax.default_matmul_precision("bfloat16"):
        assert types(lambda a: a @ a, M, platform="tpu") == ["bfloat16"]


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("BF16_BF16_F32", "bfloat16"),
        ("BF16_BF16_F32_X3", "tensorfloat32"),
        ("BF16_BF16_F32_X6", "float32"),
        ("TF32_TF32_F32", "tensorfloat32"),
        ("F16_F16_F32", "float16"),
        ("F32_F32_F32", "float32"),
    ],
)
def test_dot_algorithm_presets_name_their_operand_type(preset, expected):
    # A preset names the computation exactly, on every platform.
    eqn = jax.make_jaxpr(lambda a: jnp.dot(a, a, precision=preset))(M).eqns[0]
    assert (matmul_type(eqn, "cpu") or ("float32",))[0] == expected


def test_convolutions_count_like_matmuls():
    def f(x, k):
        return lax.conv(x, k, (1, 1), "SAME")

    image, kernel = jnp.ones((1, 1, 4, 4)), jnp.ones((1, 1, 3, 3))
    assert types(f, image, kernel, platform="tpu") == ["bfloat16"]
    assert types(f, image, kernel, platform="cpu") == ["float32"]


def test_reference_compute_types_traces_the_callable_on_the_inputs_platform():
    fn = lambda w, x: [x @ w]  # noqa: E731
    cpu = jax.devices("cpu")[0]
    inputs = [jax.device_put(M, cpu), jax.device_put(M, cpu)]
    assert [t.dtype for t in reference_compute_types(fn, inputs)] == ["float32"]
    cj = jax.make_jaxpr(lambda x: [round_trip(x)])(X)
    assert [t.dtype for t in reference_compute_types(cj, [X])] == ["bfloat16"]
