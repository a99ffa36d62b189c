"""The demo behind ``pipemark demo``.

1. A small transformer language model in plain JAX (:func:`pipemark.examples.language_model`,
   no markers), its training step ``jax.value_and_grad(loss)`` traced to a jaxpr.
2. :func:`pipemark.passes.auto_layers` cuts it into 4 balanced forward stages and their
   4 mirrored backward stages; the stage table is printed.
3. The staged program runs stage after stage and is compared with JAX's own evaluation
   of the training step (``jax.jit`` and eager), within float32 rounding.
4. ``report.html`` (the HTML view, with the plot) and ``stages.png`` are written.
5. A marked MLP is checked under every JAX transformation against the unmarked one.
"""

from __future__ import annotations

import io
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

import pipemark as pm
from pipemark import examples
from pipemark._text import plural
from pipemark.primitive import is_marker
from pipemark.progress import Progress

NUM_STAGES = 4
#: The language model's sizes: 8 blocks, so each of the 4 stages holds about two.
MODEL = {"num_layers": 8, "vocab": 256, "d_model": 64, "num_heads": 4, "seq": 32, "batch": 8}

WIDTH = 16
LAYERS = 3


# ------------------------------------------------- markers under JAX transformations


def _init(seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), LAYERS)
    return [(jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.zeros(WIDTH)) for k in keys]


def _loss(params, x, *, marked: bool):
    for w, b in params:
        if marked:
            pm.mark_pipeline_boundary()
        x = jnp.tanh(x @ w + b)
    return jnp.mean(x**2)


def _checks(params, x) -> list[tuple[str, Callable[[Callable], object]]]:
    xs = jnp.stack([x, 2 * x])
    return [
        ("eager", lambda f: f(params, x)),
        ("jit", lambda f: jax.jit(f)(params, x)),
        ("grad", lambda f: jax.grad(f)(params, x)),
        ("jit(grad)", lambda f: jax.jit(jax.grad(f))(params, x)),
        ("vmap", lambda f: jax.vmap(f, in_axes=(None, 0))(params, xs)),
        ("vmap(grad)", lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0))(params, xs)),
        ("hessian", lambda f: jax.hessian(lambda x: f(params, x))(x)),
    ]


def _max_difference(a, b) -> float:
    diffs = jax.tree_util.tree_map(
        lambda u, v: float(np.max(np.abs(np.asarray(u) - np.asarray(v)), initial=0.0)), a, b
    )
    return max(jax.tree_util.tree_leaves(diffs), default=0.0)


def transform_checks() -> tuple[list[tuple[str, float, bool, float]], int]:
    """Each transformation of a marked MLP against the unmarked one, a row each (name,
    largest difference, whether equal, seconds), and how many of its boundary markers
    ``grad`` keeps."""
    params = _init()
    x = jnp.linspace(-1.0, 1.0, 4 * WIDTH).reshape(4, WIDTH)

    def marked(p, x):
        return _loss(p, x, marked=True)

    def plain(p, x):
        return _loss(p, x, marked=False)

    rows = []
    for name, apply in _checks(params, x):
        start = time.perf_counter()
        difference = _max_difference(apply(marked), apply(plain))
        seconds = time.perf_counter() - start
        rows.append((name, difference, difference <= 1e-5, seconds))
    boundaries = sum(
        is_marker(e, "boundary") for e in jax.make_jaxpr(jax.grad(marked))(params, x).eqns
    )
    return rows, boundaries


def checks_text(
    rows: list[tuple[str, float, bool, float]], boundaries: int, *, seconds: bool
) -> str:
    """The table of :func:`transform_checks`; with ``seconds``, how long each check took
    (the report leaves them out: docs/demo/report.html is committed, and timings
    change from run to run)."""
    lines = [
        f"A {LAYERS}-layer MLP with a boundary marker before each layer, each "
        "transformation of it vs. the unmarked MLP:",
        "",
        f"{'transform':<12} {'max |difference|':>17}  {'equal':<5}"
        + (f" {'seconds':>8}" if seconds else ""),
    ]
    for name, difference, ok, took in rows:
        line = f"{name:<12} {difference:>17.2e}  {'yes' if ok else 'NO':<5}"
        lines.append(line + f" {took:>8.2f}" if seconds else line.rstrip())
    lines += ["", f"boundary markers kept in make_jaxpr(grad(f)): {boundaries} of {LAYERS}"]
    return "\n".join(lines)


# ------------------------------------------------------------------------- the demo


def run(
    out: TextIO,
    out_dir: Path | str = "pipemark-demo",
    *,
    progress: TextIO | None = None,
    model: dict[str, int] | None = None,
    num_stages: int = NUM_STAGES,
) -> bool:
    """Run the demo: print to ``out``, write ``report.html`` and ``stages.png`` into
    ``out_dir`` (made if missing), report steps on ``progress``. Returns whether the
    staged program matched the unsplit one and every transformation check passed.

    ``model`` overrides :data:`MODEL` (tests use a smaller model).
    """
    from pipemark.plot import plot
    from pipemark.views.html_view import write_report
    from pipemark.views.text import print_summary

    sizes = {**MODEL, **(model or {})}
    out_dir = Path(out_dir)
    steps = Progress(6, progress)
    with steps.step("building a transformer language model"):
        ex = examples.language_model(markers=None, **sizes)
        train_step = jax.value_and_grad(ex.loss_fn)
    with steps.step("tracing jax.value_and_grad(loss)"):
        cj = jax.make_jaxpr(train_step)(*ex.args)
    with steps.step(f"auto-slicing into {num_stages} stages"):
        staged = pm.passes.slice_stages(pm.passes.auto_layers(cj, num_stages))

    markers = sum(s.num_eqns for s in staged.stages) - len(cj.jaxpr.eqns)
    description = (
        f"A transformer language model ({sizes['num_layers']} blocks, d_model "
        f"{sizes['d_model']}, {sizes['num_heads']} heads, vocabulary {sizes['vocab']}, "
        f"sequence {sizes['seq']}, batch {sizes['batch']}). Its training step "
        f"jax.value_and_grad(loss) has {plural(len(cj.jaxpr.eqns), 'equation')}; "
        f"pm.passes.auto_layers marks {num_stages} balanced forward layers ({markers} marker "
        f"equations) and the program is cut into {num_stages} forward stages and "
        f"{num_stages} mirrored backward stages."
    )
    print(textwrap.fill(description, width=88), file=out)
    print(file=out)
    print_summary(staged, out)

    with steps.step("running the stages and the unsplit program"):
        try:
            report = staged.verify(train_step, *ex.args)
            verified = None
        except pm.PipemarkError as err:
            verified = str(err)
    if verified is None:
        verdict = (
            f"staged program == unsplit program: yes, all {len(staged.outputs)} results "
            "(the loss and every gradient) agree with jax.jit and eager evaluation, "
            + report.comparison
        )
    else:
        verdict = f"staged program == unsplit program: NO: {verified}"
    print(f"\n{verdict}\n", file=out)

    with steps.step("checking markers under jit, grad, vmap, hessian"):
        rows, boundaries = transform_checks()
    checks_ok = all(ok for _, _, ok, _ in rows) and boundaries == LAYERS
    print(checks_text(rows, boundaries, seconds=True), file=out)

    with steps.step(f"writing {out_dir / 'report.html'} and stages.png"):
        out_dir.mkdir(parents=True, exist_ok=True)
        figure = plot(staged, title=f"{num_stages}-stage split of a transformer LM training step")
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=110)
        (out_dir / "stages.png").write_bytes(png.getvalue())
        write_report(
            staged,
            out_dir / "report.html",
            title=f"pipemark demo: a transformer language model in {len(staged)} stages",
            description=description,
            png=png.getvalue(),
            sections=[
                ("Check against the unsplit program", verdict),
                ("Markers under JAX transformations", checks_text(rows, boundaries, seconds=False)),
            ],
        )
    print(f"\nwrote {out_dir / 'report.html'} and {out_dir / 'stages.png'}", file=out)
    return verified is None and checks_ok
