"""Signature: how a function's arguments map to a jaxpr's flat inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark.signature import Signature, SignatureError, is_traced_leaf, traced_mask


def test_array_leaves_are_traced_others_static():
    params = {"w": jnp.ones((2, 2)), "act": jnp.tanh, "name": "block", "n": 3}
    sig = Signature.of((params, np.zeros(2)), {})
    assert sig.traced == (False, True, False, True, True)  # keys sorted: act, n, name, w
    assert sig.names == ("args[0]['n']", "args[0]['w']", "args[1]")
    assert sig.static_leaves == (jnp.tanh, "block")


def test_names_use_the_functions_parameter_names():
    def loss(params, x, *, scale):
        return params["w"] * x * scale

    sig = Signature.of(({"w": 1.0}, 2.0), {"scale": 3.0}, fn=loss)
    assert sig.names == ("params['w']", "x", "scale")


def test_rebuild_puts_static_arguments_back():
    sig = Signature.of(
        (1.0, "mode", 2.0), {"k": 4, "flag": True}, static_argnums=1, static_argnames="flag"
    )
    assert sig.num_inputs == 3
    args, kwargs = sig.rebuild([10.0, 20.0, 40])
    assert args == (10.0, "mode", 20.0)
    assert kwargs == {"k": 40, "flag": True}


def test_negative_static_argnums_and_bad_ones():
    assert Signature.of((1.0, 2.0), static_argnums=-1).num_inputs == 1
    with pytest.raises(SignatureError, match="names argument 2"):
        Signature.of((1.0, 2.0), static_argnums=2)
    with pytest.raises(SignatureError, match="no keyword argument 'mode'"):
        Signature.of((1.0,), {}, static_argnames="mode")


def test_flatten_refuses_another_structure_naming_both():
    sig = Signature.of(({"a": jnp.ones(2), "b": jnp.ones(2)},))
    with pytest.raises(SignatureError) as info:
        sig.flatten(({"a": jnp.ones(2), "c": jnp.ones(2)},))
    message = str(info.value)
    assert "traced with: ({'a': *, 'b': *})" in message
    assert "called with: ({'a': *, 'c': *})" in message
    assert isinstance(info.value, pm.PipemarkError) and isinstance(info.value, TypeError)


def test_flatten_accepts_the_flat_inputs():
    sig = Signature.of(([jnp.ones(2), jnp.zeros(3)],))
    flat = sig.flatten((jnp.ones(2), jnp.zeros(3)))
    assert [x.shape for x in flat] == [(2,), (3,)]


def test_flatten_refuses_a_changed_static_value():
    sig = Signature.of(({"w": jnp.ones(2), "act": jnp.tanh}, 3), static_argnums=1)
    with pytest.raises(SignatureError, match=r"args\[0\]\['act'\] is a static"):
        sig.flatten(({"w": jnp.ones(2), "act": jnp.sin}, 3))
    with pytest.raises(SignatureError, match="static argument 1 was 3"):
        sig.flatten(({"w": jnp.ones(2), "act": jnp.tanh}, 4))


def test_trace_names_the_jaxpr_inputs():
    def f(params, x):
        return params["act"](params["w"] * x)

    args = ({"w": jnp.ones(2), "act": jnp.tanh}, jnp.ones(2))
    sig = Signature.of(args, fn=f)
    cj = sig.trace(f, args)
    assert len(cj.jaxpr.invars) == 2
    assert cj.jaxpr.debug_info.arg_names == ("params['w']", "x")
    assert [e.primitive.name for e in cj.eqns] == ["mul", "tanh"]


def test_bind_drops_non_array_results():
    sig = Signature.of((jnp.ones(2),))
    out = sig.bind(lambda x: {"y": x * 2, "act": jnp.tanh})(jnp.ones(2))
    assert len(out) == 1


@pytest.mark.parametrize(
    "leaf, traced",
    [
        (jnp.ones(2), True),
        (np.float32(1), True),
        (1, True),
        (True, True),
        (jax.ShapeDtypeStruct((2,), jnp.float32), True),
        ("relu", False),
        (jnp.tanh, False),
        (object(), False),
    ],
)
def test_is_traced_leaf(leaf, traced):
    assert is_traced_leaf(leaf) is traced


def test_python_numbers_inside_equinox_modules_are_static():
    eqx = pytest.importorskip("equinox")
    drop = eqx.nn.Dropout(0.5, inference=True)
    tree = {"drop": drop, "lr": 0.1, "w": jnp.ones(2)}
    # Dropout's rate and flag are static (eqx.filter_jit's rule); a bare number is traced.
    assert traced_mask(tree) == [False, False, True, True]
    sig = Signature.of((tree,))
    assert sig.names == ("args[0]['lr']", "args[0]['w']")

    def f(tree):
        return tree["drop"](tree["w"] * tree["lr"])  # `if self.inference:` needs a bool

    cj = sig.trace(f, (tree,))
    assert len(cj.jaxpr.invars) == 2


def test_64_bit_inputs_traced_as_32_bit_are_named_once():
    def f(params, x):
        pm.mark_pipeline_boundary()
        return jnp.sum(params["w"] * x)

    with pytest.warns(
        pm.PipemarkWarning, match=r"params\['w'\] \(float64\) will be traced as 32-bit"
    ):
        pm.split(f, {"w": np.ones(3)}, np.ones(3, np.float32))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.split(f, {"w": np.ones(3, np.float32)}, 1.0)  # 32-bit arrays, a Python float: silent
        pm.split(f, {"w": np.ones(3, np.complex64)}, 1.0)  # complex64 is 32-bit too
