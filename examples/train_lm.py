"""Train a small character-level language model, pipelined with pipemark.

    python examples/train_lm.py                                  # one process
    python examples/train_lm.py --checkpoint-dir /tmp/lm         # checkpoints
    python examples/train_lm.py --checkpoint-dir /tmp/lm --resume
    python -m pipemark.launch -n 2 examples/train_lm.py          # two processes

A decoder-only transformer (learned positions, pre-layer-norm blocks of causal
self-attention and a GELU MLP) written as plain JAX functions, a
``pm.mark_pipeline_boundary()`` between its blocks, learns to continue the opening of
Shakespeare's *Coriolanus* (examples/data/coriolanus.txt, public domain: the first
31 KB of the tinyshakespeare text of karpathy/char-rnn). The training step is the usual
``jax.value_and_grad`` and optax AdamW (global-norm clipping, warmup and cosine decay,
weight decay), with the gradients marked by ``pm.mark_gradient``;
``pm.pipeline_train_step`` runs it as a pipeline of ``--stages`` stages over
``--microbatches`` microbatches. ``--checkpoint-dir`` saves the state with orbax every
``--checkpoint-every`` steps, and ``--resume`` continues from the latest one. Under
``python -m pipemark.launch -n N`` the stages are spread over the N processes; only
process 0 draws the progress bar, prints, and writes the plot (``--plot``) and the
losses (``--losses``). On a CPU each process gets ``--stages`` host devices unless
``JAX_NUM_CPU_DEVICES`` (or ``XLA_FLAGS``) says otherwise. docs/training.md explains
each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from matplotlib.figure import Figure
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import pipemark as pm
from pipemark import launch

TEXT = Path(__file__).resolve().parent / "data" / "coriolanus.txt"


# ------------------------------------------------------------------------------ model


def init_params(key: jax.Array, vocab: int, d_model: int, num_layers: int, seq: int) -> dict:
    """The parameters: embeddings, ``num_layers`` blocks, the final norm and the output
    projection (float32, small normal weights, ones and zeros for the norms).

    >>> import functools
    >>> sizes = functools.partial(init_params, vocab=10, d_model=8, num_layers=2, seq=4)
    >>> params = jax.eval_shape(sizes, jax.random.key(0))  # the shapes, nothing computed
    >>> len(params["blocks"]), params["blocks"][0]["w_qkv"].shape, params["unembed"].shape
    (2, (8, 24), (8, 10))
    """
    keys = iter(jax.random.split(key, 3 + 4 * num_layers))

    def normal(*shape: int, scale: float = 0.02) -> jax.Array:
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    # The projections back into the residual stream start smaller, as in GPT-2, so
    # the stream does not grow with depth.
    residual_scale = 0.02 / math.sqrt(2 * num_layers)
    blocks = [
        {
            "ln1_scale": jnp.ones(d_model),
            "ln1_bias": jnp.zeros(d_model),
            "w_qkv": normal(d_model, 3 * d_model),
            "w_out": normal(d_model, d_model, scale=residual_scale),
            "ln2_scale": jnp.ones(d_model),
            "ln2_bias": jnp.zeros(d_model),
            "w_up": normal(d_model, 4 * d_model),
            "b_up": jnp.zeros(4 * d_model),
            "w_down": normal(4 * d_model, d_model, scale=residual_scale),
            "b_down": jnp.zeros(d_model),
        }
        for _ in range(num_layers)
    ]
    return {
        "embed": normal(vocab, d_model),
        "position": normal(seq, d_model),
        "blocks": blocks,
        "final_scale": jnp.ones(d_model),
        "final_bias": jnp.zeros(d_model),
        "unembed": normal(d_model, vocab),
    }


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + 1e-5) * scale + bias


def attention(x: jax.Array, p: dict, num_heads: int) -> jax.Array:
    """Causal multi-head self-attention: a position sees itself and those before it."""
    batch, seq, d_model = x.shape
    q, k, v = jnp.split(x @ p["w_qkv"], 3, axis=-1)
    q, k, v = (t.reshape(batch, seq, num_heads, -1) for t in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d_model // num_heads)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
    return mixed @ p["w_out"]


def block(x: jax.Array, p: dict, num_heads: int) -> jax.Array:
    x = x + attention(layer_norm(x, p["ln1_scale"], p["ln1_bias"]), p, num_heads)
    hidden = jax.nn.gelu(layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w_up"] + p["b_up"])
    return x + hidden @ p["w_down"] + p["b_down"]


def forward(params: dict, tokens: jax.Array, num_heads: int) -> jax.Array:
    """The logits of the next character at every position of ``tokens`` (batch, seq).

    A pipeline boundary between consecutive blocks: ``pm.pipeline_train_step`` merges
    consecutive blocks into ``num_stages`` balanced stages. The embeddings go with the
    first block, the final norm and the output projection with the last.
    """
    x = params["embed"][tokens] + params["position"][: tokens.shape[1]]
    for i, p in enumerate(params["blocks"]):
        if i:
            pm.mark_pipeline_boundary()
        x = block(x, p, num_heads)
    return layer_norm(x, params["final_scale"], params["final_bias"]) @ params["unembed"]


def make_train_step(num_heads: int, tx: optax.GradientTransformation):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``, written as for
    ``jax.jit``; the gradients are marked so that the pipeline runs the update once per
    step, each stage's part where that stage's parameters live."""

    def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        tokens, targets = batch
        logits = forward(params, tokens, num_heads)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(pm.mark_gradient(grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with global-norm clipping, a linear warmup then cosine decay to a tenth of
    the peak, and weight decay on the weight matrices and embeddings (every array of two
    or more dimensions), not on the norms' scales and the biases."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.learning_rate,
        warmup_steps=max(1, args.steps // 10),
        decay_steps=max(2, args.steps),
        end_value=args.learning_rate / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            schedule, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
        ),
    )


# ------------------------------------------------------------------------------- data


class Text:
    """The characters of a text as token ids, and the batch of each step: ``batch``
    windows of ``seq + 1`` characters at offsets drawn from the step number, so a
    resumed run sees the batches the uninterrupted one saw.

    >>> text = Text(TEXT, seq=8, batch=2, seed=0)
    >>> tokens, targets = text.batch_at(0)
    >>> tokens.shape, bool((tokens[:, 1:] == targets[:, :-1]).all())
    ((2, 8), True)
    >>> text.decode(text.encode("All:"))
    'All:'
    """

    def __init__(self, path: Path, seq: int, batch: int, seed: int) -> None:
        self.text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(self.text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.ids = self.encode(self.text)
        self.seq, self.batch, self.seed = seq, batch, seed

    def encode(self, text: str) -> np.ndarray:
        return np.array([self.index[c] for c in text], np.int32)

    def batch_at(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.ids) - self.seq - 1, size=self.batch)
        windows = self.ids[starts[:, None] + np.arange(self.seq + 1)]
        return windows[:, :-1], windows[:, 1:]

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# ---------------------------------------------------------------------- the training run


def build(args: argparse.Namespace) -> tuple[Text, Any, tuple]:
    """The text, the training step (for ``jax.jit`` as much as for the pipeline) and
    the initial state ``(params, opt_state)``, the same in every process."""
    text = Text(TEXT, args.seq, args.batch, args.seed)
    tx = make_optimizer(args)
    # One compiled program each, rather than an operation at a time.
    init = jax.jit(init_params, static_argnums=(1, 2, 3, 4))
    params = init(jax.random.key(args.seed), len(text.chars), args.d_model, args.layers, args.seq)
    # On this process's first device, where the one-device jax.jit of the same step runs
    # too (the pipeline puts each leaf on its own stage's device either way).
    state = jax.device_put((params, jax.jit(tx.init)(params)), jax.local_devices()[0])
    return text, make_train_step(args.heads, tx), state


def open_checkpoints(args: argparse.Namespace, stack: contextlib.ExitStack):
    """orbax's CheckpointManager on ``--checkpoint-dir`` (closed, after its last save
    is written, when ``stack`` closes), or None without one."""
    if args.checkpoint_dir is None:
        return None
    directory = os.path.abspath(args.checkpoint_dir)
    options = ocp.CheckpointManagerOptions(max_to_keep=3)
    manager = stack.enter_context(ocp.CheckpointManager(directory, options=options))
    latest = manager.latest_step()
    if latest is not None and not args.resume:
        raise SystemExit(
            f"{directory} holds checkpoints already (the latest after step {latest}): pass "
            "--resume to continue from it, or give another --checkpoint-dir."
        )
    return manager


def restore_latest(manager, pipelined, state: tuple, batch: tuple) -> tuple[int, tuple]:
    """The latest checkpoint's step and state, restored where this run's pipeline keeps
    each leaf: ``abstract_state`` gives the target, whatever layout saved it."""
    params, opt_state = pipelined.abstract_state(*state, batch)
    target = {"params": params, "opt_state": opt_state}
    step = manager.latest_step()
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    return step, (restored["params"], restored["opt_state"])


def train(
    args: argparse.Namespace, text: Text, pipelined, state: tuple, first: int, manager
) -> tuple[list[float], tuple, list[float]]:
    """Steps ``first .. args.steps - 1``, with a checkpoint after every
    ``args.checkpoint_every`` steps and after the last: the losses, read in every
    process (a scalar result reaches each, whatever ``gather_results`` says), the last
    state, and the seconds each step took. Process 0 draws the progress bar."""
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} tokens/s"),
        TimeRemainingColumn(),
        disable=jax.process_index() != 0,
    )
    task = progress.add_task("train", total=args.steps, completed=first, loss="-", rate="-")
    losses, times = [], []
    with progress:
        for step in range(first, args.steps):
            start = time.perf_counter()
            params, opt_state, loss = pipelined(*state, text.batch_at(step))
            state = (params, opt_state)
            losses.append(float(loss))  # waits for the step's loss
            times.append(time.perf_counter() - start)
            recent = times[1:][-20:]  # the first step compiles the stages
            rate = f"{args.batch * args.seq * len(recent) / sum(recent):,.0f}" if recent else "-"
            progress.update(task, advance=1, loss=f"{losses[-1]:.3f}", rate=rate)
            done = step + 1
            if manager is not None and (done % args.checkpoint_every == 0 or done == args.steps):
                saved = {"params": params, "opt_state": opt_state}
                manager.save(done, args=ocp.args.StandardSave(saved))  # written in the background
                if jax.process_count() > 1:
                    # In several processes, one save at a time: with orbax's background
                    # saves, two processes once stopped at different orbax barriers (one
                    # in a save's commit, the other in a save's finalize) and never went on.
                    manager.wait_until_finished()
                if jax.process_index() == 0:
                    progress.console.print(
                        f"step {done}: loss {losses[-1]:.3f}, saving a checkpoint"
                    )
    return losses, state, times


def sample(params: dict, text: Text, num_heads: int, length: int, seed: int) -> str:
    """The text's first line and ``length`` characters the model writes after it,
    drawn one at a time (temperature 0.8), with ``jax.jit`` of the model on one
    device."""
    params = jax.device_put(params, jax.local_devices()[0])
    next_logits = jax.jit(lambda p, t: forward(p, t, num_heads)[0])
    rng = np.random.default_rng(seed)
    context = list(text.encode(text.text[: text.text.index("\n") + 1]))
    for _ in range(length):
        window = context[-text.seq :]
        # One program for every length: the window is padded at the end, and a
        # position never attends to the positions after it.
        padded = np.array([window + [0] * (text.seq - len(window))], np.int32)
        logits = np.asarray(next_logits(params, padded)[len(window) - 1], np.float64) / 0.8
        probabilities = np.exp(logits - logits.max())
        context.append(rng.choice(len(text.chars), p=probabilities / probabilities.sum()))
    return text.decode(context)


def plot_losses(path: str, first: int, losses: list[float], title: str) -> None:
    """The loss curve of this run's steps, written as a PNG by matplotlib's Agg canvas
    (a ``Figure`` without pyplot: no display, no GUI backend)."""
    figure = Figure(figsize=(7, 4), layout="tight")
    axes = figure.subplots()
    axes.plot(np.arange(first + 1, first + 1 + len(losses)), losses, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per character)")
    axes.set_title(title + (f", resumed after step {first}" if first else ""))
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)


# ------------------------------------------------------------------------ the command


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def positive(value: str) -> int:
        number = int(value)
        if number < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
        return number

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--steps", type=positive, default=500, help="training steps in all (default 500)")
    add("--stages", type=positive, default=2, help="pipeline stages (default 2)")
    add("--microbatches", type=positive, default=4, help="microbatches per step (default 4)")
    add("--schedule", default="1f1b", choices=pm.runtime.SCHEDULES, help="(default 1f1b)")
    add("--layers", type=positive, default=4, help="transformer blocks (default 4)")
    add("--d-model", type=positive, default=64, help="width of the model (default 64)")
    add("--heads", type=positive, default=4, help="attention heads (default 4)")
    add("--seq", type=positive, default=64, help="characters per sequence (default 64)")
    add("--batch", type=positive, default=32, help="sequences per step (default 32)")
    add("--learning-rate", type=float, default=3e-3, help="peak learning rate (3e-3)")
    add("--seed", type=int, default=0)
    add(
        "--gather-results",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every process gets the whole new state (default); --no-gather-results: "
        "each process keeps its own stages' state",
    )
    add("--checkpoint-dir", help="save checkpoints here with orbax (default: none)")
    add("--checkpoint-every", type=positive, default=100, help="steps between checkpoints")
    add("--resume", action="store_true", help="continue from the latest checkpoint")
    add("--plot", default="train_lm.png", help="the loss curve (default train_lm.png)")
    add("--losses", help="also write the losses to this JSON file")
    add("--sample", type=int, default=200, help="characters to write at the end (200)")
    args = parser.parse_args(argv)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Before anything else touches JAX: join the other processes under the launcher; on
    # a CPU, a host device per stage unless the environment says how many.
    launch.start_jax(cpu_devices=args.stages)
    say = print if jax.process_index() == 0 else lambda *_: None
    text, step, state = build(args)
    devices = pm.runtime.stage_devices(args.stages)  # consecutive stages in one process
    pipelined = pm.pipeline_train_step(
        step,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        devices=devices,
        gather_results=args.gather_results,
    )
    size = sum(x.size for x in jax.tree.leaves(state[0]))
    title = f"{args.layers} blocks in {args.stages} stages ({args.schedule})"
    say(
        f"{size:,} parameters, {title} on {len(devices)} {devices[0].platform} devices of "
        f"{jax.process_count()} process(es); {args.microbatches} microbatches of "
        f"{args.batch // args.microbatches} x {args.seq} characters"
    )
    first = 0
    with contextlib.ExitStack() as stack:
        manager = open_checkpoints(args, stack)
        if manager is not None and manager.latest_step() is not None:
            first, state = restore_latest(manager, pipelined, state, text.batch_at(0))
            say(f"resumed from the checkpoint after step {first}")
        elif args.resume:
            say(f"no checkpoint in {args.checkpoint_dir} yet: starting at step 0")
        losses, state, times = train(args, text, pipelined, state, first, manager)
    if not losses:
        say(f"nothing to train: the checkpoint is after step {first}, --steps is {args.steps}")
        return
    rate = ""
    if len(times) > 1:
        per_s = args.batch * args.seq * (len(times) - 1) / sum(times[1:])
        rate = f", {per_s:,.0f} tokens/s after the first step (which compiles)"
    say(
        f"steps {first + 1}-{args.steps}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in "
        f"{sum(times):.1f} s{rate}"
    )
    if jax.process_index() != 0:
        return
    plot_losses(args.plot, first, losses, title)
    say(f"loss curve: {args.plot}")
    if args.losses:
        Path(args.losses).write_text(json.dumps({"first_step": first, "losses": losses}))
    if args.sample and all(x.is_fully_addressable for x in jax.tree.leaves(state[0])):
        say("the model writes:\n" + sample(state[0], text, args.heads, args.sample, args.seed))
    elif args.sample:
        say("no sample: this process holds only its own stages' parameters (--gather-results)")


if __name__ == "__main__":
    main()
