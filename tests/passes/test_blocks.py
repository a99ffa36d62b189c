"""pipemark.passes.blocks: repeated blocks from name scopes and parameter paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr

from pipemark._compat import name_stack_scopes
from pipemark.passes.blocks import Blocks, find_blocks, path_components


@pytest.mark.parametrize(
    ("path", "components"),
    [
        ("x", ("x",)),
        ("params['blocks'][0]['w']", ("params", "blocks", 0, "w")),
        (
            "weights['transformer.h.11.ln_1.bias']",
            ("weights", "transformer", "h", "11", "ln_1", "bias"),
        ),
        ('p["a.b"].value.data_array', ("p", "a", "b", "value", "data_array")),
        ("params[3]", ("params", 3)),
        ("params<odd>", None),
    ],
)
def test_path_components(path, components):
    assert path_components(path) == components


def test_cut_allowed_excludes_only_block_interiors():
    allowed = Blocks(((2, 5), (5, 7)), "test").cut_allowed(8)
    assert np.nonzero(~allowed)[0].tolist() == [3, 4, 6]


def _reads(cj: ClosedJaxpr, path_prefix: str) -> set[int]:
    """Equations that read an input whose path starts with ``path_prefix``."""
    names = cj.jaxpr.debug_info.arg_names
    inputs = {v for v, n in zip(cj.jaxpr.invars, names) if n.startswith(path_prefix)}
    return {i for i, e in enumerate(cj.eqns) if inputs & set(e.invars)}


def _mlp_blocks(params, x):
    x = jnp.tanh(x @ params["embed"])
    for block in params["blocks"]:
        h = jnp.tanh(x @ block["w1"] + block["b1"])
        x = x + h @ block["w2"]
    return jnp.sum(x @ params["head"])


def _mlp_params(blocks=3, width=8):
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    return {
        "embed": w(4, width),
        "blocks": [
            {"w1": w(width, width), "b1": w(width), "w2": w(width, width)} for _ in range(blocks)
        ],
        "head": w(width, 2),
    }


def test_blocks_from_numbered_parameter_paths():
    cj = jax.make_jaxpr(_mlp_blocks)(_mlp_params(), jnp.ones((2, 4)))
    blocks = find_blocks(cj.jaxpr)
    assert blocks is not None and len(blocks.spans) == 3
    assert blocks.source == "parameters params['blocks'][0] … params['blocks'][2]"
    for k, (begin, end) in enumerate(blocks.spans):
        reads = _reads(cj, f"params['blocks'][{k}]")
        assert min(reads) == begin and max(reads) == end - 1
    # The embedding and the head are no block: every cut around them is allowed.
    allowed = blocks.cut_allowed(len(cj.eqns))
    assert allowed[: blocks.spans[0][0] + 1].all() and allowed[blocks.spans[-1][1] :].all()


def test_flat_dict_of_dotted_names_numbers_blocks():
    def gpt(weights, x):
        for i in range(2):
            h = x * weights[f"transformer.h.{i}.ln_1.weight"]
            x = x + jnp.tanh(h @ weights[f"transformer.h.{i}.mlp.c_fc.weight"])
        return jnp.sum(x @ weights["lm_head.weight"])

    weights = {f"transformer.h.{i}.ln_1.weight": jnp.ones(4) for i in range(2)}
    weights |= {f"transformer.h.{i}.mlp.c_fc.weight": jnp.ones((4, 4)) for i in range(2)}
    weights["lm_head.weight"] = jnp.ones((4, 3))
    cj = jax.make_jaxpr(gpt)(weights, jnp.ones((2, 4)))
    blocks = find_blocks(cj.jaxpr)
    assert blocks is not None and len(blocks.spans) == 2
    assert "'transformer']['h']['0']" in blocks.source
    # ln_1 (numbered too) is inside the numbered h.N blocks: the outer number wins.
    for k, (begin, end) in enumerate(blocks.spans):
        reads = _reads(cj, f"weights['transformer.h.{k}.")
        assert (min(reads), max(reads) + 1) == (begin, end)


def test_parameters_of_unequal_shapes_are_no_blocks():
    # A tuple of different parameters (penzai's unbound parameters are one) numbers
    # leaves, not blocks.
    def f(params, x):
        a, b, c = params
        return jnp.sum(jnp.tanh(x @ a) @ b * c)

    params = (jnp.ones((4, 8)), jnp.ones((8, 2)), jnp.ones(2))
    assert find_blocks(jax.make_jaxpr(f)(params, jnp.ones((2, 4))).jaxpr) is None


def test_blocks_from_name_scopes_skip_embedding_and_head():
    def f(x, w):
        with jax.named_scope("embed"):
            x = jnp.sin(x) * 2.0
        for i in range(3):
            with jax.named_scope(f"layer{i}"):
                x = x + jnp.tanh(x @ w)
        with jax.named_scope("head"):
            return jnp.sum(jnp.exp(x))

    cj = jax.make_jaxpr(f)(jnp.ones((2, 4)), jnp.ones((4, 4)))
    blocks = find_blocks(cj.jaxpr)
    assert blocks is not None and blocks.source == "name scopes 'layer0' … 'layer2'"
    scopes = [name_stack_scopes(e.source_info)[0] for e in cj.eqns]
    for k, (begin, end) in enumerate(blocks.spans):
        assert {i for i, s in enumerate(scopes) if s == (f"layer{k}",)} == set(range(begin, end))


def test_scopes_with_different_contents_are_no_blocks():
    def f(x):
        with jax.named_scope("a"):
            x = jnp.sin(x)
        with jax.named_scope("b"):
            x = jnp.cos(x) + 1.0
        return x

    assert find_blocks(jax.make_jaxpr(f)(jnp.ones(3)).jaxpr) is None


def test_stop_limits_the_search():
    cj = jax.make_jaxpr(_mlp_blocks)(_mlp_params(), jnp.ones((2, 4)))
    blocks = find_blocks(cj.jaxpr)
    assert find_blocks(cj.jaxpr, blocks.spans[1][0]) is None  # one block only before it


def test_single_leaves_are_no_blocks():
    # A batch (tokens, targets) numbers two equal arrays; a block has two leaves at least.
    def f(params, batch):
        tokens, targets = batch
        return jnp.sum(params["embed"][tokens] - targets[..., None])

    batch = (jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    cj = jax.make_jaxpr(f)({"embed": jnp.ones((5, 4))}, batch)
    assert find_blocks(cj.jaxpr) is None


@pytest.mark.filterwarnings("ignore:core.Jaxpr is missing a DebugInfo:DeprecationWarning")
def test_a_program_without_input_names_has_no_parameter_blocks():
    cj = jax.make_jaxpr(_mlp_blocks)(_mlp_params(), jnp.ones((2, 4)))
    bare = ClosedJaxpr(cj.jaxpr.replace(debug_info=None), cj.consts)
    assert find_blocks(bare.jaxpr) is None
