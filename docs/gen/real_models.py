"""Write docs/real-models.md: each example's code, run, with the stage table it gives.

    python docs/gen/real_models.py          # rewrite the page
    python docs/gen/real_models.py --check  # exit 1 if the page is out of date

The code shown on the page is the code that ran (each example is executed from the
same text), so the page cannot drift from what pipemark does; tests/test_docs_real_models.py
runs the check. Needs the test extras (flax, equinox, optax).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import textwrap
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "real-models.md"

INTRO = """\
# Real models

pipemark takes models the way people write them: flax linen and nnx modules, equinox
modules (which hold functions among their leaves), optax training steps, layers
scanned with `lax.scan`, and jitted steps. Each section below is code that ran, and the
stage table it printed.

This page is generated: `python docs/gen/real_models.py` rewrites it, and the test
suite fails when it is out of date. Every example ends with `staged.verify(...)`, which
runs the stages one after another and compares every result with JAX's own evaluation of
the function (`jax.jit` and eager), within float32 rounding.
"""

COMMON = """\
import jax
import jax.numpy as jnp
import optax

import pipemark as pm
"""

EXAMPLES: list[tuple[str, str, str]] = [
    (
        "flax linen: an optax training step",
        """\
Boundary markers between the blocks of a linen model; the step marks its gradients
with `pm.mark_gradient`, so the optimizer update gets its own `apply_grad` stage.
Stage inputs that are parameters are named by their pytree path
(`staged.input_names`).""",
        """\
import flax.linen as nn


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))) + x


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(name=f"Block_{i}")(x)
            if i < 2:
                pm.mark_pipeline_boundary()
        return nn.Dense(1)(x)


model = Model()
x = jnp.ones((16, 64))
params = model.init(jax.random.PRNGKey(0), x)
optimizer = optax.adam(1e-3)
opt_state = optimizer.init(params)


def step(params, opt_state, x):
    def loss(params):
        return jnp.mean(model.apply(params, x) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    grads = pm.mark_gradient(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


staged = pm.split(step, params, opt_state, x)
staged.verify(step, params, opt_state, x)
print(staged.summary(style="plain"))
print(staged.input_names[:2])
""",
    ),
    (
        "flax nnx: a module split automatically",
        """\
An nnx module has no markers; `num_stages=2` balances it. `nnx.split` gives the
parameter state as a pytree, and the loss takes a keyword argument.""",
        """\
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, width, depth, rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x, *, scale):
        for layer in self.layers:
            x = jax.nn.relu(layer(x)) * scale
        return x


graphdef, state = nnx.split(MLP(64, 4, nnx.Rngs(0)))


def loss(state, x, *, scale):
    return jnp.mean(nnx.merge(graphdef, state)(x, scale=scale) ** 2)


x = jnp.ones((16, 64))
train = jax.value_and_grad(loss)
staged = pm.split(train, state, x, scale=0.5, num_stages=2)
staged.verify(train, state, x, scale=0.5)
print(staged.summary(style="plain"))
""",
    ),
    (
        "equinox: a module with function leaves",
        """\
`eqx.nn.MLP` holds its activation functions; they are static, as `eqx.filter_jit` holds
them. Differentiate with `eqx.filter_value_and_grad` (plain `jax.value_and_grad` cannot
differentiate a function; pipemark says so).""",
        """\
import equinox as eqx

model = eqx.nn.MLP(64, 8, 64, 4, key=jax.random.PRNGKey(0))
x = jnp.ones((16, 64))
y = jnp.zeros((16, 8))


def loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


train = eqx.filter_value_and_grad(loss)
staged = pm.split(train, model, x, y, num_stages=2)
staged.verify(train, model, x, y)
print(staged.summary(style="plain"))
print(staged.input_names[:2])
""",
    ),
    (
        "Scan over layers",
        """\
Twelve blocks run by `lax.scan` over stacked parameters are one equation to a jaxpr.
`num_stages=4` cuts the forward scan and its backward mirror into four scans of three
blocks each (`pm.passes.split_scan`); each backward stage reads the residuals of its
own forward stage.""",
        """\
from jax import lax


def init(key, num_layers=12, width=64):
    keys = jax.random.split(key, num_layers)
    return {
        "w": jax.vmap(lambda k: jax.random.normal(k, (width, width)) / width**0.5)(keys),
        "b": jnp.zeros((num_layers, width)),
    }


def loss(params, x):
    def layer(h, p):
        return jax.nn.gelu(h @ p["w"] + p["b"]) + h, None

    h, _ = lax.scan(layer, x, params)
    return jnp.mean(h**2)


params, x = init(jax.random.PRNGKey(0)), jnp.ones((16, 64))
train = jax.value_and_grad(loss)
staged = pm.split(train, params, x, num_stages=4)
staged.verify(train, params, x)
print(staged.summary(style="plain"))
scans = [e for stage in staged.stages for e in stage.jaxpr.eqns if e.primitive.name == "scan"]
print([e.params["length"] for e in scans])
""",
    ),
    (
        "A jitted training step",
        """\
`@jax.jit` on the whole step is the usual way to write it. The program is then one
`jit` equation; `pm.split` inlines it (`pm.passes.inline_calls`) before cutting, so
the stages run its equations one by one where `jax.jit` runs one compiled program, and
`verify` compares the two to float rounding (its report names each result's
tolerance).""",
        """\
def mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


params = [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) / 8 for i in range(6)]
x = jnp.ones((16, 64))
optimizer = optax.sgd(1e-2)
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x):
    value, grads = jax.value_and_grad(mlp_loss)(params, x)
    grads = pm.mark_gradient(grads)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value


staged = pm.split(step, params, opt_state, x, num_stages=3)
staged.verify(step, params, opt_state, x)
print(staged.summary(style="plain"))
""",
    ),
]


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(COMMON + code, "<real-models example>", "exec"), {"__name__": "example"})
    return out.getvalue().rstrip()


PACKAGES = ("jax", "flax", "equinox", "optax")


def versions() -> str:
    """The versions the page was made with: equation counts depend on them."""
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in PACKAGES)


CLI = ["inspect", "mymodel.py:loss", "--args", "mymodel.py:make_args", "--grad",
       "--num-stages", "2"]  # fmt: skip

CLI_TEXT = """\
`pipemark inspect` takes a training loss over a parameter pytree: `--args` names a
function that returns the example arguments, `--grad` differentiates argument 0 (the
parameters; `--argnums` chooses others), and the stage inputs are named by their
pytree paths. `mymodel.py` (in `docs/gen/`):"""


def _run_cli() -> str:
    from pipemark.cli import main

    here = Path(__file__).resolve().parent
    argv = [arg.replace("mymodel.py", str(here / "mymodel.py")) for arg in CLI]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    if status:
        raise RuntimeError(f"pipemark {' '.join(CLI)} failed: {err.getvalue()}")
    return out.getvalue().rstrip()


def render() -> str:
    parts = [INTRO, f"Made with {versions()}.\n"]
    for title, text, code in EXAMPLES:
        parts.append(f"## {title}\n\n{textwrap.dedent(text)}\n")
        parts.append(f"```python\n{COMMON}\n\n{code.rstrip()}\n```\n")
        parts.append(f"It prints:\n\n```\n{_run(code)}\n```\n")
    source = (Path(__file__).resolve().parent / "mymodel.py").read_text(encoding="utf-8")
    parts.append(f"## The command line on a training loss\n\n{CLI_TEXT}\n")
    parts.append(f"```python\n{source.rstrip()}\n```\n")
    parts.append(f"```\n$ pipemark {' '.join(CLI)}\n{_run_cli()}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is out of date: run python docs/gen/real_models.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
