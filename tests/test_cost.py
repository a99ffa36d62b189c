"""Tests for pipemark.cost: exact FLOPs of known ops, recursion into bodies, XLA."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import pipemark as pm
from pipemark import examples
from pipemark.cost import Cost, cost_rules, eqn_costs, estimate_cost


def _only_eqn(fn, *args):
    cj = jax.make_jaxpr(fn)(*args)
    assert len(cj.eqns) == 1, cj
    return cj.eqns[0]


def test_dot_general_flops_are_exact():
    eqn = _only_eqn(jnp.matmul, jnp.ones((7, 3)), jnp.ones((3, 5)))
    assert estimate_cost(eqn).flops == 2 * 7 * 5 * 3


def test_batched_dot_general_counts_batch_and_contraction():
    a, b = jnp.ones((4, 6, 3, 2)), jnp.ones((4, 6, 2, 5))

    def f(a, b):
        return lax.dot_general(a, b, (((3,), (2,)), ((0, 1), (0, 1))))

    assert estimate_cost(_only_eqn(f, a, b)).flops == 2 * (4 * 6) * 3 * 5 * 2


def _conv_reference_macs(x_shape, k_shape, strides, padding, lhs_dil, rhs_dil):
    # Brute force: count (output, tap) pairs that read a real input element.
    n, c, *spatial = x_shape
    o, _, *kernel = k_shape
    out = lax.conv_general_dilated(
        jnp.ones(x_shape), jnp.ones(k_shape), strides, padding, lhs_dil, rhs_dil
    ).shape
    taps = 1
    for d in range(len(spatial)):
        count = 0
        dilated = (spatial[d] - 1) * lhs_dil[d] + 1
        for pos_out in range(out[2 + d]):
            for k in range(kernel[d]):
                pos = pos_out * strides[d] + k * rhs_dil[d] - padding[d][0]
                count += 0 <= pos < dilated and pos % lhs_dil[d] == 0
        taps *= count
    return n * o * c * taps


@pytest.mark.parametrize(
    "strides,padding,lhs_dil,rhs_dil",
    [
        ((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1)),
        ((2, 1), ((0, 0), (2, 1)), (1, 1), (2, 1)),
        ((1, 1), ((1, 2), (0, 1)), (2, 1), (1, 2)),
    ],
)
def test_conv_flops_are_exact_and_match_xla(strides, padding, lhs_dil, rhs_dil):
    x_shape, k_shape = (2, 3, 9, 8), (4, 3, 3, 2)

    def f(x, k):
        return lax.conv_general_dilated(x, k, strides, padding, lhs_dil, rhs_dil)

    eqn = _only_eqn(f, jnp.ones(x_shape), jnp.ones(k_shape))
    macs = _conv_reference_macs(x_shape, k_shape, strides, padding, lhs_dil, rhs_dil)
    assert estimate_cost(eqn).flops == 2 * macs
    assert estimate_cost(eqn, cost="xla").flops == 2 * macs


def test_grouped_conv_counts_input_features_per_group():
    x, k = jnp.ones((1, 6, 5, 5)), jnp.ones((4, 3, 3, 3))

    def f(x, k):
        return lax.conv_general_dilated(x, k, (1, 1), "VALID", feature_group_count=2)

    assert estimate_cost(_only_eqn(f, x, k)).flops == 2 * 1 * 4 * 3 * 9 * 9


def test_elementwise_and_transcendental_counts():
    x = jnp.ones((4, 8))
    add = estimate_cost(_only_eqn(lambda a: a + a, x))
    assert (add.flops, add.transcendentals) == (32, 0)
    tanh = estimate_cost(_only_eqn(jnp.tanh, x))
    assert (tanh.flops, tanh.transcendentals, tanh.total_flops) == (0, 32, 32)
    assert (tanh.bytes_read, tanh.bytes_written) == (128, 128)


def test_reduction_folds_n_minus_m_elements():
    cost = estimate_cost(_only_eqn(lambda a: jnp.sum(a, axis=1), jnp.ones((4, 8))))
    assert cost.flops == 32 - 4


@pytest.mark.parametrize("power,multiplies", [(2, 1), (3, 2), (4, 2), (7, 4), (-2, 2), (1, 0)])
def test_integer_pow_counts_square_and_multiply(power, multiplies):
    eqn = _only_eqn(lambda a: lax.integer_pow(a, power), jnp.ones(10))
    assert estimate_cost(eqn).flops == 10 * multiplies


def test_data_movement_costs_bytes_only():
    eqn = _only_eqn(lambda a: jnp.transpose(a), jnp.ones((4, 8), jnp.float16))
    cost = estimate_cost(eqn)
    assert (cost.flops, cost.bytes_read, cost.bytes_written) == (0, 64, 64)


def test_gather_and_scatter_add():
    x, idx = jnp.ones((10, 4)), jnp.array([1, 2, 3])
    cj = jax.make_jaxpr(lambda x, i: x[i])(x, idx)
    gather = next(e for e in cj.eqns if e.primitive.name == "gather")
    assert estimate_cost(gather).flops == 0
    assert estimate_cost(gather).bytes_written == 3 * 4 * 4
    cj = jax.make_jaxpr(lambda x, i: x.at[i].add(1.0))(x, idx)
    scatter = next(e for e in cj.eqns if e.primitive.name == "scatter-add")
    assert estimate_cost(scatter).flops == 3 * 4


def test_scan_is_body_times_length():
    def f(x):
        return lax.scan(lambda c, _: (jnp.sin(c) * 2.0, None), x, None, length=7)[0]

    cost = estimate_cost(_only_eqn(f, jnp.ones(5)))
    assert (cost.flops, cost.transcendentals) == (35, 35)


def test_cond_charges_the_most_expensive_branch():
    def f(p, x):
        return lax.cond(p, lambda x: x @ x, lambda x: x + 1.0, x)

    cj = jax.make_jaxpr(f)(True, jnp.ones((4, 4)))
    cond = next(e for e in cj.eqns if e.primitive.name == "cond")
    cost = estimate_cost(cond)
    assert cost.flops == 2 * 4 * 4 * 4
    assert not cost.approximate


def test_tanh_gradient_is_costed_exactly_on_every_jax():
    # JAX 0.11 stages tanh's derivative as one_minus_square (0.10: sub and mul): every
    # equation has a rule, and the derivative costs 2 FLOPs per element either way.
    cj = jax.make_jaxpr(jax.grad(lambda x: jnp.tanh(x).sum()))(jnp.ones(5))
    costs = [estimate_cost(e) for e in cj.eqns]
    assert not any(c.approximate for c in costs), [e.primitive.name for e in cj.eqns]
    names = [e.primitive.name for e in cj.eqns]
    derivative = [c.flops for e, c in zip(cj.eqns, costs) if e.primitive.name == "one_minus_square"]
    assert derivative == ([10] if "one_minus_square" in names else [])


def test_while_is_one_iteration_and_flagged():
    def f(x):
        return lax.while_loop(lambda c: c[0] < 10.0, lambda c: c * 2.0, x)

    cost = estimate_cost(jax.make_jaxpr(f)(jnp.ones(6)))
    assert cost.approximate
    assert any("while" in note for note in cost.notes)
    # body: 6 multiplies; condition: one comparison.
    assert cost.flops == 6 + 1


def test_recursion_into_jit_checkpoint_and_custom_rules():
    @jax.custom_vjp
    def twice_sin(x):
        return jnp.sin(x) * 2.0

    twice_sin.defvjp(lambda x: (twice_sin(x), x), lambda r, g: (2.0 * g * jnp.cos(r),))

    def f(x):
        x = jax.jit(lambda y: y @ y)(x)  # 2 * 4**3
        x = jax.checkpoint(lambda y: y * y)(x)  # 16
        x = jax.nn.relu(x)  # custom_jvp around max: 16
        return twice_sin(x)  # 16 transcendentals + 16 multiplies

    cj = jax.make_jaxpr(f)(jnp.ones((4, 4)))
    names = {e.primitive.name for e in cj.eqns}
    assert {"custom_jvp_call", "custom_vjp_call"} <= names
    assert names & {"jit", "pjit"} and names & {"remat2", "checkpoint"}
    cost = estimate_cost(cj)
    assert cost.flops == 128 + 16 + 16 + 16
    assert cost.transcendentals == 16
    assert not cost.approximate


def test_param_bytes_counts_consumed_inputs_only():
    def f(used, unused, also_used):
        del unused
        return used * 2.0 + also_used

    cj = jax.make_jaxpr(f)(jnp.ones(4), jnp.ones(100), jnp.ones(4, jnp.int8))
    assert estimate_cost(cj).param_bytes == 16 + 4
    assert estimate_cost(cj.eqns[0]).param_bytes == 0


def test_program_cost_is_sum_of_equation_costs():
    cj = examples.mlp(num_layers=3, markers=None).trace(grad=True)
    total = estimate_cost(cj)
    per_eqn = eqn_costs(cj)
    assert total.flops == sum(c.flops for c in per_eqn)
    assert total.bytes_read == sum(c.bytes_read for c in per_eqn)


def test_markers_are_free():
    cj = examples.mlp(num_layers=2).trace()
    markers = [e for e in cj.eqns if e.primitive is pm.pipeline_p]
    assert markers and all(estimate_cost(e) == Cost() for e in markers)


def test_unknown_primitive_uses_default_rule_and_is_flagged():
    prim = Primitive("pipemark_test_mystery")
    prim.def_abstract_eval(lambda x: x)
    prim.def_impl(lambda x: x)
    eqn = _only_eqn(prim.bind, jnp.ones((3, 3)))
    assert "pipemark_test_mystery" not in cost_rules
    cost = estimate_cost(eqn)
    assert cost.flops == 9 and cost.approximate
    assert "pipemark_test_mystery" in cost.notes[0]


def test_cost_arithmetic():
    a = Cost(flops=1, transcendentals=2, bytes_read=3, bytes_written=4, param_bytes=5)
    b = Cost(flops=10, approximate=True, notes=("x",))
    total = a + b + b
    assert (total.flops, total.approximate, total.notes) == (21, True, ("x",))
    assert a.scaled(3) == Cost(3, 6, 9, 12, 5)
    assert a.bytes_accessed == 7


@pytest.mark.parametrize("grad", [False, True])
def test_transformer_flops_within_ten_percent_of_xla(grad):
    ex = examples.transformer(num_layers=2, d_model=32, num_heads=4, seq=16, batch=2, markers=None)
    cj = ex.trace(grad=grad)
    analytic, xla = estimate_cost(cj), estimate_cost(cj, cost="xla")
    assert xla.flops > 0
    assert math.isclose(analytic.flops, xla.flops, rel_tol=0.10)
    assert math.isclose(analytic.transcendentals, xla.transcendentals, rel_tol=0.10)
    assert xla.param_bytes == analytic.param_bytes


def test_xla_cost_of_one_equation():
    eqn = _only_eqn(jnp.matmul, jnp.ones((8, 4)), jnp.ones((4, 2)))
    assert estimate_cost(eqn, cost="xla").flops == 2 * 8 * 2 * 4


def test_unknown_cost_model_raises():
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(pm.PipemarkError, match=r"Unknown cost model 'gpu'.*'analytic'"):
        estimate_cost(cj, cost="gpu")


def test_wrong_program_type_raises():
    with pytest.raises(pm.PipemarkError, match=r"ClosedJaxpr, a Jaxpr or a JaxprEqn.*make_jaxpr"):
        estimate_cost(np.ones(3))


# ------------------------------------------------------------ sizes past int64


HUGE = [
    jax.ShapeDtypeStruct((4_000_000_000, 4_000_000_000), jnp.float32),  # 6.4e19 bytes
    jax.ShapeDtypeStruct((99_999_999_999_999_999_999_999,), jnp.float32),
]


@pytest.mark.parametrize("spec", HUGE, ids=["4e9x4e9", "1e23"])
def test_abstract_arrays_past_int64_cost_exactly_and_split(spec):
    import warnings

    count = math.prod(spec.shape)
    assert pm.flatten_shape_byte_sizes(spec).tolist() == [4 * count]
    cj = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(spec)
    cost = estimate_cost(cj)
    assert (cost.flops, cost.transcendentals) == (count, count)  # Python ints: exact
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning either
        staged = pm.split(lambda x: jnp.cos(jnp.sin(x) * 2.0), spec, num_stages=2)
        assert [s.name for s in staged.stages] == ["layer0", "layer1"]
        assert "layer1" in staged.summary(style="plain")


def test_matmuls_whose_flops_overflow_int64_still_balance():
    spec = jax.ShapeDtypeStruct((1_200_000, 1_200_000), jnp.float32)

    def f(a):
        for _ in range(4):
            a = jnp.tanh(a @ a)
        return a

    staged = pm.split(f, spec, num_stages=2)
    # Four equal matmuls: two per stage.
    assert [
        sum(e.primitive.name == "dot_general" for e in s.jaxpr.eqns) for s in staged.stages
    ] == [2, 2]
