"""A bfloat16 GPT trained two ways on one accelerator, side by side: the pipeline
runtime (S 4 stages, M 8 microbatches, the interleaved schedule putting every stage on
the one device) and ``jax.jit`` of the ``lax.scan`` gradient accumulation over the same
microbatches, what a user writes instead.

    python benchmarks/training_curve.py --markdown results/training-curve.md
    python benchmarks/training_curve.py --size tiny --steps 20    # a quick look on CPU

Both train ``benchmarks/accelerator.py``'s model (``pipemark.examples.gpt``: float32
parameters, matmuls in bfloat16; ``--size auto``, the default, takes the 270M GPT on an
accelerator and a tiny one on CPU) for ``--steps`` steps (100) from the same initial
parameters on the same batches, with the same optimizer: AdamW (weight decay 0.1)
after global-norm clipping at 1.0, its learning rate warming up linearly over
``--warmup`` steps to ``--lr`` and decaying as a cosine to zero at the last step. The
pipeline's step is the user's (``jax.value_and_grad``, ``pm.mark_gradient``, the
update) under ``pm.pipeline_train_step``; the scan's is one ``jax.jit`` program.

The batches are a made-up language a model learns a little of within 100 steps: in
each row, three tokens in four follow from the one before (``t -> 5 t + 3`` modulo the
vocabulary), the fourth is drawn at random.

A third run, ``jax.jit`` of the scan over ``--spread-microbatches`` microbatches (half
as many, by default), measures JAX's own spread: the same step in bfloat16 with its
gradients summed in another order, a curve as legitimate as the scan's. The pipeline's
curve is judged against it, not against zero.

Printed (and written to ``--markdown``): a header, the table of the losses and their
relative differences from the scan every ``--every`` steps, and summary lines: the
largest relative difference over all steps (the pipeline's, and JAX's own), each run's first call (tracing and compiling) and mean step
(the steps after the first, each waited for), and the compilations after the first
step (``jax.monitoring``'s, none expected). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

# benchmarks/accelerator.py (the model, its sizes, the scan), found beside this file
# also when the docs run this module by path to render recorded results (report).
sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerator

WEIGHT_DECAY, CLIP_NORM = 0.1, 1.0


def _log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def make_batches(sizes: dict, steps: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each step's ``(tokens, targets)``, ``int32`` of shape ``(batch, seq)``: rows in
    which three tokens in four follow from the one before (``t -> 5 t + 3`` modulo the
    vocabulary) and the fourth is random; ``targets`` are the tokens shifted by one.

    >>> (tokens, targets), = make_batches(dict(batch=2, seq=6, vocab=16), 1)
    >>> tokens.shape, tokens.dtype, bool((tokens[:, 1:] == targets[:, :-1]).all())
    ((2, 6), dtype('int32'), True)
    """
    rows, seq, vocab = sizes["batch"], sizes["seq"], sizes["vocab"]
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab, size=(steps, rows, seq + 1))
    follows = rng.random((steps, rows, seq)) < 0.75
    for t in range(1, seq + 1):
        successor = (5 * stream[:, :, t - 1] + 3) % vocab
        stream[:, :, t] = np.where(follows[:, :, t - 1], successor, stream[:, :, t])
    stream = stream.astype(np.int32)
    return [(s[:, :-1], s[:, 1:]) for s in stream]


def make_optimizer(steps: int, peak_lr: float, warmup: int):
    """AdamW after global-norm clipping, with a linear warmup and a cosine decay."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, steps)
    return optax.chain(
        optax.clip_by_global_norm(CLIP_NORM), optax.adamw(schedule, weight_decay=WEIGHT_DECAY)
    )


def scan_step(loss_fn, tx, microbatches: int):
    """``jax.jit`` of a training step whose gradients are the ``lax.scan``
    accumulation's, its parameters and optimizer state donated."""
    import jax
    import optax

    accumulate = accelerator.scan_accumulation(loss_fn, microbatches)

    def step(params, opt_state, batch):
        loss, grads = accumulate(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def pipeline_step(loss_fn, tx, stages: int, microbatches: int, device):
    """The step as a user writes it, pipelined: ``stages`` stages on ``device``."""
    import jax
    import optax

    import pipemark as pm

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return pm.pipeline_train_step(
        step,
        num_stages=stages,
        num_microbatches=microbatches,
        schedule="interleaved",
        devices=[device],
    )


def train(name: str, step, state, batches, counter) -> dict:
    """Run ``step`` over ``batches`` from ``state``: each step's loss and seconds
    (waited for), the first call's seconds and the compilations after it."""
    import jax

    losses, seconds = [], []
    counter.take()
    for k, batch in enumerate(batches):
        start = time.perf_counter()
        *state, loss = jax.block_until_ready(step(*state, batch))
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
        if k == 0:
            counter.take()  # the first call's compilations
            _log(f"{name}: first call {seconds[0]:.1f} s, loss {losses[0]:.4f}")
    _log(f"{name}: {len(batches)} steps, last loss {losses[-1]:.4f}")
    return {"losses": losses, "seconds": seconds, "late_compiles": len(counter.take())}


def run(args: argparse.Namespace) -> tuple[list[str], dict, dict, dict | None]:
    """The runs, each from a fresh initial state (the scan donates its own): the scan,
    the pipeline and, with ``--spread-microbatches``, the scan over that many
    microbatches (JAX's own spread: the same gradients summed in another order)."""
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")
    device = jax.devices()[0]
    sizes = accelerator.resolve_sizes(args, device.platform)
    counter = accelerator.CompileCounter()
    tx = make_optimizer(args.steps, args.lr, args.warmup)
    batches = jax.device_put(make_batches(sizes, args.steps, args.seed), device)
    results = {}
    runs = [("scan", None, args.microbatches), ("pipeline", "boundary", args.microbatches)]
    if args.spread_microbatches:
        runs.append(("spread", None, args.spread_microbatches))
    for name, markers, micro in runs:
        ex = accelerator.gpt_example(sizes, sizes["batch"], markers)
        # The whole state on the device (committed, as the steps return it): a step
        # given some leaves uncommitted (optax's step count) would compile again.
        state = jax.device_put((ex.params, tx.init(ex.params)), device)
        if name != "pipeline":
            step = scan_step(ex.loss_fn, tx, micro)
        else:
            step = pipeline_step(ex.loss_fn, tx, args.stages, args.microbatches, device)
        _log(f"{name}: first call")
        results[name] = dict(train(name, step, state, batches, counter), microbatches=micro)
        del ex, state, step
    header = [
        f"{datetime.date.today()}; {device.device_kind} ({device.platform}); JAX {jax.__version__}",
        f"model: examples.gpt ({sizes['preset']}: "
        + ", ".join(f"{k} {sizes[k]}" for k in ("layers", "d_model", "heads", "d_ff", "vocab"))
        + f", seq {sizes['seq']}; {_count(accelerator.param_count(sizes))} float32 "
        f"parameters, bfloat16 matmuls); {sizes['batch']} rows a step in {args.microbatches} "
        f"microbatches; AdamW (weight decay {WEIGHT_DECAY}) after clipping at global norm "
        f"{CLIP_NORM}, learning rate warming up over {args.warmup} steps to {args.lr:g}, "
        f"cosine decay to 0 at step {args.steps}",
    ]
    return header, results["scan"], results["pipeline"], results.get("spread")


def _count(number: int) -> str:
    return f"{number / 1e6:.1f}M" if number >= 10**6 else f"{number:,}"


def _relative(pipeline: float, scan: float) -> float:
    return abs(pipeline - scan) / abs(scan)


def table(
    scan: list[float],
    pipeline: list[float],
    every: int,
    stages: int,
    micro: int,
    spread: list[float] | None = None,
    spread_micro: int | None = None,
) -> str:
    """Both losses and their relative difference at step 1 and every ``every`` steps
    (steps counted from 1); with ``spread`` (the scan over ``spread_micro``
    microbatches), its loss and its relative difference from the scan too: how far
    JAX's own programs of the same step fall apart.

    >>> print(table([2.0, 1.5], [2.0, 1.503], 2, 4, 8))
    | step | loss, `lax.scan` accumulation | loss, pipeline S 4, M 8 | relative difference |
    |---:|---:|---:|---:|
    | 1 | 2.00000 | 2.00000 | 0 |
    | 2 | 1.50000 | 1.50300 | 2.0e-03 |
    """
    head = f"| step | loss, `lax.scan` accumulation | loss, pipeline S {stages}, M {micro} "
    head += "| relative difference |"
    if spread is not None:
        head += f" loss, `lax.scan` M {spread_micro} | JAX's own spread |"
    lines = [head, "|---:" * head.count(" | ") + "|---:|"]
    for k, (a, b) in enumerate(zip(scan, pipeline), start=1):
        if k == 1 or k % every == 0 or k == len(scan):
            line = f"| {k} | {a:.5f} | {b:.5f} | {_format(_relative(b, a))} |"
            if spread is not None:
                line += f" {spread[k - 1]:.5f} | {_format(_relative(spread[k - 1], a))} |"
            lines.append(line)
    return "\n".join(lines)


def _format(rel: float) -> str:
    return f"{rel:.1e}" if rel else "0"


def summary(scan: dict, pipeline: dict, spread: dict | None = None) -> list[str]:
    """The largest relative difference (and, with ``spread``, JAX's own: the scan over
    other microbatches against the scan), each run's first call and mean step, and the
    compilations after the first step."""
    rel = [_relative(b, a) for a, b in zip(scan["losses"], pipeline["losses"])]
    worst = int(np.argmax(rel))
    lines = [
        f"- largest relative difference: {rel[worst]:.1e} at step {worst + 1} "
        f"(bfloat16 rounds to 2^-8 = 3.9e-03 relative)"
    ]
    if spread is not None:
        own = [_relative(b, a) for a, b in zip(scan["losses"], spread["losses"])]
        top = int(np.argmax(own))
        lines.append(
            f"- JAX's own spread (`lax.scan` over {spread['microbatches']} microbatches "
            f"against the scan): largest {own[top]:.1e} at step {top + 1}; the pipeline's "
            f"largest difference is {rel[worst] / own[top]:.2f} times that"
        )
    means = {}
    for name, result in (("`lax.scan` accumulation", scan), ("pipeline", pipeline)):
        later = result["seconds"][1:] or result["seconds"]
        means[name] = sum(later) / len(later)
        lines.append(
            f"- {name}: first call {result['seconds'][0]:.1f} s, mean step "
            f"{1e3 * means[name]:.1f} ms over {len(later)} steps, "
            f"{result['late_compiles']} compilations after the first"
        )
    ratio = means["pipeline"] / means["`lax.scan` accumulation"]
    lines.append(f"- pipeline / scan, mean step: {ratio:.3f}")
    return lines


def report(results: dict) -> str:
    """The text the benchmark prints, from its results (what ``--json`` records): the
    header, the table of curves, the summary lines.

    >>> run = {"losses": [2.0, 1.5], "seconds": [5.0, 0.1], "late_compiles": 0}
    >>> results = dict(header=["a header"], scan=run, pipeline=run, spread=None, every=1,
    ...                stages=2, microbatches=4)
    >>> print(report(results).splitlines()[4])
    | 1 | 2.00000 | 2.00000 | 0 |
    """
    spread = results.get("spread")
    curves = table(
        results["scan"]["losses"],
        results["pipeline"]["losses"],
        results["every"],
        results["stages"],
        results["microbatches"],
        spread and spread["losses"],
        spread and spread["microbatches"],
    )
    summed = summary(results["scan"], results["pipeline"], spread)
    return "\n".join([*results["header"], "", curves, "", *summed])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    accelerator.add_size_arguments(parser)  # what accelerator.resolve_sizes reads
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="a table row every N steps")
    parser.add_argument("--lr", type=float, default=6e-4, help="the peak learning rate")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="of the batches")
    parser.add_argument(
        "--spread-microbatches",
        type=int,
        help="also run the scan over this many microbatches, JAX's own spread (default: "
        "half of --microbatches; 0: no such run)",
    )
    parser.add_argument("--markdown", help="write the table and summary here too")
    parser.add_argument("--json", help="write the results here (report renders them)")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(
            f"--warmup ({args.warmup}) must be at least 0 and below --steps ({args.steps})"
        )
    if args.spread_microbatches is None:
        args.spread_microbatches = args.microbatches // 2
    header, scan, pipeline, spread = run(args)
    results = dict(header=header, scan=scan, pipeline=pipeline, spread=spread)
    results.update(every=args.every, stages=args.stages, microbatches=args.microbatches)
    text = report(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
