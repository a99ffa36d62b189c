"""TPU custom-call markers: the Pallas identity kernel's copy bandwidth, and a training
step with custom-call markers ÷ the same step with barrier markers.

(i) **Copy of 1 GiB** (float32), every kind side by side in alternating rounds: XLA's
    own copy (``jax.jit(jnp.copy)``; the table says whether its compiled HLO copies),
    ``pipemark.pallas_identity.identity(x, alias=False)`` (its default: 2 MiB blocks
    through VMEM; and 8 MiB blocks), the same by DMA alone (``block_bytes=None``, HBM to
    HBM) with 1, 4 and 8 concurrent DMAs, and a plain blocked ``pallas_call`` copy
    through VMEM (2 MiB blocks), for reference. GB/s counts what moves: 2 × bytes ÷ time (read and write). Target: the
    marker kernel's copy ≥ 0.95 × XLA's. Also the aliased marker kernel's cost a call
    on a donated 1 GiB array (it copies nothing).
(ii) **Training step**: a bf16 decoder-only language model
    (``pipemark.examples.language_model``, start/end markers around every block, the
    gradients marked by ``mark_gradient``; one SGD step, parameters donated), jitted
    with ``pm.lowering("custom_call")`` ÷ ``pm.lowering("barrier")``, the fastest step
    of alternating rounds; the marker kernels and XLA's copies in each compiled program,
    and whether the two steps' losses agree. Target ≤ 1.02.

    python benchmarks/tpu_marker.py --out tpu_marker.md   # on a TPU: under 2 minutes
    python benchmarks/tpu_marker.py --quick               # anywhere, tiny sizes

Off a TPU the Pallas kernels run in Pallas's interpreter and the step's custom-call
markers are the CPU typed-FFI target: the numbers then say nothing about a TPU (the
script says so), which is how tests/test_benchmarks.py keeps it working.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pipemark as pm
from pipemark import examples
from pipemark import pallas_identity as pi
from pipemark.primitive import is_marker

MiB = 1 << 20
MARKER_KIND = "Pallas marker kernel, aliased, input donated"
COPY_KIND = "marker kernel copying through VMEM, 2 MiB blocks (its default)"
DMA_KIND = "marker kernel copying by DMA, HBM → HBM"
ON_TPU = jax.default_backend() == "tpu"
REPORT: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    REPORT.append(line)


def fastest(
    fns: dict[str, Callable], make_arg: Callable, rounds: int, calls: int, donated=()
) -> dict:
    """Fastest seconds a call of each of ``fns`` (name → compiled one-argument function),
    timed side by side: each round times ``calls`` consecutive calls of every function,
    in an order that rotates from round to round. The functions share one argument
    from ``make_arg()``, except those named in ``donated``: each of them donates its own
    and gets its last result back as the next one."""
    shared = make_arg()
    args = {name: make_arg() if name in donated else shared for name in fns}
    for name, fn in fns.items():  # warm up
        for _ in range(2):
            out = fn(args[name])
            if name in donated:
                args[name] = out
        jax.block_until_ready(out)
        del out
    names, best = list(fns), dict.fromkeys(fns, float("inf"))
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            fn, donated_here = fns[name], name in donated
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(args[name])
                if donated_here:
                    args[name] = out
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
            del out
    return best


def first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def compile_checked(build: Callable, arg: Any, failures: dict, name: str) -> Callable | None:
    """``build()`` (a jitted function) compiled for ``arg``, after checking that it
    returns ``arg``; ``None``, with the error in ``failures[name]``, where it fails (one
    kind that a TPU refuses must not end the run)."""
    try:
        compiled = build().lower(arg).compile()
        if not bool(jnp.array_equal(compiled(jnp.copy(arg)), arg)):
            raise ValueError("the copy differs from its input")
    except Exception as error:  # reported in the table
        failures[name] = first_line(error)
        return None
    return compiled


def entry_copies(compiled_text: str) -> tuple[int, int]:
    """(count, bytes) of the buffer copies in the entry computation of compiled HLO."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    itemsize = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
    count = total = 0
    for match in re.finditer(r"= \(?(\w+)\[([\d,]*)\][^=]*? copy(?:-start)?\(", entry):
        dims = [int(d) for d in match.group(2).split(",") if d]
        count += 1
        total += itemsize.get(match.group(1), 4) * int(np.prod(dims))
    return count, total


# ------------------------------------------------------------------------ (i) copy


def blocked_copy(block_bytes: int, interpret: bool) -> Callable:
    """A ``pallas_call`` copy that streams row blocks of ``block_bytes`` through VMEM
    (double-buffered in and out: 4 blocks of VMEM)."""

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def copy(x):
        rows = max(8, min(x.shape[0], block_bytes // (x.shape[1] * x.dtype.itemsize)))
        spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
        # Above the default scoped VMEM (16 MiB on v5e) the kernel must ask for more.
        limit = 4 * block_bytes + 8 * MiB if 4 * block_bytes > 12 * MiB else None
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid=(x.shape[0] // rows,),
            in_specs=[spec],
            out_specs=spec,
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel",), vmem_limit_bytes=limit
            ),
            interpret=interpret,
        )(x)

    return jax.jit(copy)


def copy_kinds(rows: int, cols: int) -> dict[str, Callable]:
    """Name → a function making the jitted copy of that kind."""
    interpret = not ON_TPU
    kinds: dict[str, Callable] = {"XLA: jax.jit(jnp.copy)": lambda: jax.jit(jnp.copy)}
    kinds[COPY_KIND] = lambda: jax.jit(functools.partial(_marker_copy, interpret=interpret))
    kinds["marker kernel copying through VMEM, 8 MiB blocks"] = lambda: jax.jit(
        functools.partial(_marker_copy, block_bytes=8 * MiB, interpret=interpret)
    )
    for dmas in (1, 4, 8):
        slices = len(pi.dma_slices((rows, cols), 4, dmas))
        kinds[f"{DMA_KIND}, dmas={dmas}: {slices} concurrent DMA(s)"] = lambda dmas=dmas: jax.jit(
            functools.partial(_marker_copy, block_bytes=None, dmas=dmas, interpret=interpret)
        )
    kinds["a plain blocked pallas_call through VMEM, 2 MiB blocks"] = lambda: blocked_copy(
        2 * MiB, interpret
    )
    kinds[MARKER_KIND] = lambda: jax.jit(
        lambda x: pi.identity(x, interpret=interpret)[0], donate_argnums=0
    )
    return kinds


def copy_table(copy_mib: int, rounds: int, calls: int) -> None:
    cols = 8192
    rows = copy_mib * MiB // (4 * cols)
    nbytes = rows * cols * 4

    def make_arg():
        return jnp.arange(rows * cols, dtype=jnp.float32).reshape(rows, cols)

    fns, failures, arg = {}, {}, make_arg()
    for name, build in copy_kinds(rows, cols).items():
        compiled = compile_checked(build, arg, failures, name)
        if compiled is not None:
            fns[name] = compiled
    xla_name = next(iter(copy_kinds(rows, cols)))
    copies, _ = entry_copies(fns[xla_name].as_text())
    del arg
    best = fastest(fns, make_arg, rounds, calls, donated=(MARKER_KIND,))
    base = best[xla_name]
    say(f"### Copy of {copy_mib} MiB (float32 {rows} × {cols})")
    say()
    say(f"Fastest call of {rounds} rounds × {calls} calls, all kinds alternating.")
    say()
    say("| copy | time | GB/s (read + write) | ÷ XLA's copy |")
    say("|---|---:|---:|---:|")
    for name in copy_kinds(rows, cols):
        label = f"{name} ({copies} copy op in its HLO)" if name == xla_name else name
        if name in failures:
            say(f"| {label} | failed: {failures[name]} | | |")
        elif name != MARKER_KIND:
            rate = 2 * nbytes / best[name] / 1e9
            say(f"| {label} | {best[name] * 1e3:.3f} ms | {rate:.0f} | {base / best[name]:.3f} |")
    say()
    copy_verdicts(best, base, copy_mib)


def copy_verdicts(best: dict, base: float, copy_mib: int) -> None:
    if COPY_KIND in best:
        ratio = base / best[COPY_KIND]
        say(
            f"- the marker kernel's copy (`identity(alias=False)`, its defaults) ÷ XLA's: "
            f"{ratio:.3f} (target ≥ 0.95: {'met' if ratio >= 0.95 else 'not met'})"
        )
    dma = [s for n, s in best.items() if n.startswith(DMA_KIND)]
    if dma:
        say(f"- by DMAs alone (`block_bytes=None`, best DMA count) ÷ XLA's: {base / min(dma):.3f}")
    if MARKER_KIND in best:
        say(
            f"- the aliased marker kernel on a donated {copy_mib} MiB array: "
            f"{best[MARKER_KIND] * 1e6:.1f} µs a call (it copies nothing)"
        )
    say()


def _marker_copy(x, interpret, **options):
    return pi.identity(x, alias=False, interpret=interpret, **options)[0]


# ------------------------------------------------------------------- (ii) the step


STYLES = {
    "startend": "start/end markers around every block (its activation and parameters go "
    "through the start marker) and the gradients marked",
    "boundary": "a zero-operand boundary marker between blocks and the gradients marked",
}
MODES = ("barrier", "custom_call")


def make_step(args, style: str) -> tuple[Callable, tuple]:
    """An SGD step of a bf16 language model marked in ``style``, and its
    (params, state, batch)."""
    ex = examples.language_model(
        num_layers=args.layers, vocab=args.vocab, d_model=args.d_model,
        num_heads=args.heads, seq=args.seq, batch=args.batch, markers=style,
    )  # fmt: skip
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), ex.params)
    step, init_state = examples.train_step(ex.loss_fn, optimizer="sgd")
    return step, (params, init_state(params), ex.batch)


def marker_kernels(compiled_text: str) -> tuple[int, int]:
    """(marker calls, those whose HLO names the marker) in compiled HLO."""
    target = "tpu_custom_call" if ON_TPU else "pipeline_marker"
    calls = [
        line for line in compiled_text.splitlines() if f'custom_call_target="{target}"' in line
    ]
    return len(calls), sum("pipeline_marker." in c or "mark_type" in c for c in calls)


def time_style(args, style: str) -> tuple[int, dict, dict]:
    """(markers in the step, fastest step per mode, (kernels, copies, loss) per mode)."""
    step, (params, state, batch) = make_step(args, style)
    traced = jax.make_jaxpr(step)(params, state, batch)
    wanted = sum(is_marker(e) and e.params["mark_type"] != "hook" for e in traced.eqns)
    fns, facts = {}, {}

    def fresh_carry():
        return jax.tree_util.tree_map(jnp.copy, (params, state))

    for mode in MODES:
        # The mode acts when the step is lowered; the compiled program is called as is.
        with pm.lowering(mode):
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
        text = compiled.as_text()
        loss = float(compiled(*fresh_carry(), batch)[2])
        facts[mode] = (marker_kernels(text), entry_copies(text), loss)
        fns[mode] = functools.partial(_step_once, compiled, batch)
    best = fastest(fns, fresh_carry, args.rounds, args.calls, donated=MODES)
    return wanted, best, facts


def step_table(args) -> None:
    say(
        f"### Training step: bf16 language model, {args.layers} blocks, d_model "
        f"{args.d_model}, {args.heads} heads, sequence {args.seq}, batch {args.batch}, "
        f"vocabulary {args.vocab}; one SGD step, parameters donated"
    )
    say()
    say(f"Fastest step of {args.rounds} rounds × {args.calls} steps, both lowerings alternating.")
    for style in args.styles:
        say(f"Markers `{style}`: {STYLES[style]}.")
    say()
    say(
        "| markers | lowering | step | ÷ barrier | marker calls in compiled HLO (naming "
        "the marker) / markers | XLA copies (bytes) | loss |"
    )
    say("|---|---|---:|---:|---:|---:|---:|")
    verdicts = []
    for style in args.styles:
        try:
            wanted, best, facts = time_style(args, style)
        except Exception as error:  # one style a TPU refuses must not end the run
            say(f"| {style} | custom_call | failed: {first_line(error)} | | | | |")
            continue
        for mode in MODES:
            (calls, named), (copies, copied), loss = facts[mode]
            say(
                f"| {style} | {mode} | {best[mode] * 1e3:.2f} ms "
                f"| {best[mode] / best['barrier']:.3f} | {calls} ({named}) / {wanted} "
                f"| {copies} ({copied / MiB:.1f} MiB) | {loss:.6g} |"
            )
        ratio = best["custom_call"] / best["barrier"]
        verdicts.append(
            f"- {style}: custom_call ÷ barrier {ratio:.3f} (target ≤ 1.02: "
            f"{'met' if ratio <= 1.02 else 'not met'}); the losses differ by "
            f"{abs(facts['custom_call'][2] - facts['barrier'][2]):.3g}"
        )
    say()
    for line in verdicts:
        say(line)
    say()


def _step_once(compiled: Callable, batch, carry: tuple) -> tuple:
    params, state, _ = compiled(*carry, batch)
    return params, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument("--parts", nargs="+", choices=("copy", "step"), default=["copy", "step"])
    parser.add_argument("--styles", nargs="+", choices=tuple(STYLES), default=list(STYLES))
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two rounds")
    args = parser.parse_args()
    if args.quick:
        args.copy_mib, args.rounds, args.calls = 1, 2, 2
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab = (
            2,
            32,
            4,
            16,
            4,
            64,
        )
    device = jax.devices()[0]
    say(f"jax {jax.__version__}, backend {jax.default_backend()} ({device.device_kind})")
    if not ON_TPU:
        say(
            "(no TPU: the Pallas kernels run in Pallas's interpreter and the step's "
            "custom_call markers are the CPU typed-FFI target; the numbers say nothing "
            "about a TPU)"
        )
    say()
    start = time.perf_counter()
    if "copy" in args.parts:
        copy_table(args.copy_mib, args.rounds, args.calls)
    if "step" in args.parts:
        step_table(args)
    say(f"({time.perf_counter() - start:.0f} s)")
    if args.out is not None:
        args.out.write_text("\n".join(REPORT) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
