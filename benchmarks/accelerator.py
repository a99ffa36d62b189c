"""A bfloat16 GPT's training step on one accelerator: plain ``jax.jit``, a ``lax.scan``
gradient accumulation and the pipeline runtime, side by side.

    python benchmarks/accelerator.py --out results/tpu.md      # the GPT on an accelerator
    python benchmarks/accelerator.py --configs jit,s1 --size tiny   # a quick look on CPU

The model is ``pipemark.examples.gpt``: float32 parameters, matmuls in bfloat16,
boundary markers between its blocks. ``--size auto`` (the default) takes the 270M
GPT (16 blocks, d_model 1024, 16 heads, MLP 4096, vocabulary 32768, sequence 1024,
batch 8 rows, 8 microbatches) on an accelerator and a tiny one on CPU; ``--size tiny``,
``medium`` or ``gpt`` choose, and ``--layers``, ``--d-model``, ... override one size.

Rows (``--configs``, in this order by default), each measured in a process of its own
(only one process may hold a TPU, and a device's peak memory is per process), one after
another:

* ``jit``: ``jax.jit(jax.value_and_grad(loss))`` of the unmarked model on the batch;
* ``jit-markers``: the same, the model with its boundary markers (barrier lowering);
* ``scan``: ``jax.jit`` of a ``lax.scan`` accumulating ``value_and_grad`` over the
  ``M`` microbatches, what a user writes instead of a pipeline;
* ``s1``, ``s1-half``: ``pm.pipeline_value_and_grad`` with 1 stage and 1 microbatch on
  the batch and on half of it (1F1B: its forward and backward are one program);
* ``jit-half``: ``jax.jit`` on half of the batch, ``s1-half``'s reference;
* ``sN`` (``s4``, ``s16``): the pipeline with ``N`` stages and ``M`` microbatches on the
  one device (the interleaved schedule puts every stage there).
* ``sN-wK``: the same with at most ``K`` microbatches in flight
  (``microbatches_in_flight``); ``sN-memG``: with ``memory_budget`` ``G`` GiB, the row
  naming how many microbatches in flight the budget chose; ``sN-dK``: with
  ``dispatch_ahead=K`` (``sN-d0``: ``None``, no bound).

Columns: the first call (tracing, compiling, one step) in seconds and how many XLA
compilations it made (``jax.monitoring``'s backend-compile events; later calls must
make none); the step, the median of ``--repeat`` calls after one warm-up, each waited
for with ``block_until_ready``; its ratio to the row's baseline (``jax.jit`` for S 1, the
scan for more stages); model TFLOP/s (6 x the matmul parameters x the tokens, plus the
attention's 12 x layers x rows x seq² x d_model: counted, not measured; XLA's own count
of the ``jit`` program is in the header); the compiled programs' ``memory_analysis()``
(temporaries; arguments and outputs; for the pipeline, its largest stage program's and
the sum over its programs, from ``Pipeline.compiled_programs``), and the device's
``memory_stats()["peak_bytes_in_use"]`` (on CPU, which has none, the process's peak
resident memory). A configuration that does not fit shows "out of memory" with XLA's
message shortened. Verdict lines give the targets: S 1 / M 1 within 1.05 x
``jax.jit`` and its memory within 5 %; S 4 and S 16 (with any dispatch bound) within
1.05 x the scan; the first call of S 16 within 1.5 x the scan's; and for each pipeline row, the peak
``Pipeline.memory`` predicts for its device next to the measured one (target within
10 % on an accelerator).

The table goes to stdout and to ``--out`` (with the results as JSON beside it). Each
row runs under ``--timeout-s``, and no row starts once ``--budget-s`` is spent (it is
marked skipped): the S 16 compilation alone took 104 s on a TPU v5e.

``--ballast`` (a device that reports ``bytes_limit``) checks each pipeline row's
predicted peak, temporaries included, the way it matters: it fills the device with a
ballast leaving the predicted peak free and runs the step, then leaves less room until
the step runs out of memory (``benchmarks/_ballast.py``); a verdict line gives both.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's
GIB = 1024**3
REPO = Path(__file__).resolve().parents[1]

#: Model sizes by name; ``auto`` is ``gpt`` on an accelerator and ``tiny`` on CPU.
SIZES = {
    "gpt": dict(layers=16, d_model=1024, heads=16, d_ff=4096, vocab=32768, seq=1024, batch=8),
    "medium": dict(layers=4, d_model=256, heads=4, d_ff=1024, vocab=2048, seq=128, batch=8),
    "tiny": dict(layers=4, d_model=32, heads=2, d_ff=128, vocab=64, seq=16, batch=8),
}
DEFAULT_CONFIGS = "jit,jit-markers,scan,s1,s1-half,jit-half,s4,s16"
CONFIG = re.compile(
    r"(jit|jit-markers|scan|jit-half|s(\d+)(-half|-w(\d+)|-mem([\d.]+)|-d(\d+))?(-f(\d+))?(-u(\d+))?)$"
)


def _log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


# ------------------------------------------------------------------ configurations


def stages_of(config: str) -> int | None:
    """The pipeline's stage count of a configuration (``None``: not a pipeline)."""
    match = CONFIG.match(config)
    return int(match.group(2)) if match and match.group(2) else None


def pipeline_options(config: str) -> dict:
    """A pipeline row's own options: ``sN-wK`` runs at most ``K`` microbatches in
    flight, ``sN-memG`` asks for a ``memory_budget`` of ``G`` GiB, ``sN-dK`` dispatches
    at most ``K`` actions ahead (``sN-d0``: no bound); then ``-fK`` runs up to ``K``
    consecutive actions as one program (``fuse_actions``), and a last ``-uN`` fuses a
    run only where its program runs at least ``N`` times a call (``fuse_min_uses``)."""
    match = CONFIG.match(config)
    own: dict = {}
    if match and match.group(4):
        own["microbatches_in_flight"] = int(match.group(4))
    if match and match.group(5):
        own["memory_budget"] = int(float(match.group(5)) * 2**30)
    if match and match.group(6):
        own["dispatch_ahead"] = int(match.group(6)) or None
    if match and match.group(8):
        own["fuse_actions"] = int(match.group(8))
    if match and match.group(10):
        own["fuse_min_uses"] = int(match.group(10))
    return own


def baseline_of(config: str) -> str | None:
    """The configuration a row's step is compared with."""
    stages = stages_of(config)
    if stages is None:
        return {"jit-markers": "jit", "scan": "jit"}.get(config)
    if stages == 1:
        return "jit-half" if config.endswith("-half") else "jit"
    return "scan"


def rows_of(config: str, sizes: dict) -> int:
    return sizes["batch"] // 2 if config.endswith("-half") else sizes["batch"]


def label(config: str, sizes: dict, microbatches: int) -> str:
    """What a row is, in words."""
    rows = rows_of(config, sizes)
    stages = stages_of(config)
    if stages is None:
        return {
            "jit": f"`jax.jit(value_and_grad)`, B {rows}",
            "jit-half": f"`jax.jit(value_and_grad)`, B {rows}",
            "jit-markers": f"the same with boundary markers (barrier), B {rows}",
            "scan": f"`jax.jit` of a `lax.scan` accumulation, B {rows}, M {microbatches}",
        }[config]
    if stages == 1:
        return f"pipeline S 1, M 1, B {rows}"
    own = pipeline_options(config)
    more = ""
    if "microbatches_in_flight" in own:
        more = f", {own['microbatches_in_flight']} in flight"
    elif "memory_budget" in own:
        more = f", memory_budget {_bytes(own['memory_budget'])}"
    elif "dispatch_ahead" in own:
        more = f", dispatch_ahead={own['dispatch_ahead']}"
    if "fuse_actions" in own:
        more += f", fuse_actions={own['fuse_actions']}"
    if "fuse_min_uses" in own:
        more += f", fuse_min_uses={own['fuse_min_uses']}"
    return f"pipeline S {stages}, M {microbatches}, interleaved on 1 device{more}, B {rows}"


def model_flops(sizes: dict, rows: int) -> float:
    """A step's model FLOPs: 6 x matmul parameters x tokens (forward 2, backward 4),
    plus attention's two (seq x seq) matmuls per layer, 3 x 2 x 2 x rows x seq² x d."""
    layers, d, d_ff, vocab, seq = (sizes[k] for k in ("layers", "d_model", "d_ff", "vocab", "seq"))
    matmul_params = layers * (4 * d * d + 2 * d * d_ff) + d * vocab
    return 6.0 * matmul_params * rows * seq + 12.0 * layers * rows * seq * seq * d


#: The sizes a flag each (``--d-model``...) sets over the preset.
SIZE_KEYS = ("layers", "d_model", "heads", "d_ff", "vocab", "seq", "batch")


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags :func:`resolve_sizes` reads: ``--size`` and one a size of
    :data:`SIZE_KEYS`."""
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto")
    for key in SIZE_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the model and its microbatches: :func:`add_size_arguments`'s,
    ``--model`` and ``--microbatches``."""
    add_size_arguments(parser)
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--microbatches", type=int, default=8)


def resolve_sizes(args: argparse.Namespace, platform: str) -> dict:
    """The model sizes: the preset (``auto`` by the backend) with the flags over it."""
    name = args.size if args.size != "auto" else ("tiny" if platform == "cpu" else "gpt")
    sizes = dict(SIZES[name], preset=name)
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    return sizes


# ------------------------------------------------------------- the model and the scan


#: The models ``--model`` chooses: the GPT, and a Llama-style model
#: (``pipemark.examples.llama``: RMSNorm, rotary, SwiGLU) with each attention it offers,
#: tied or untied embeddings, or Pallas's TPU flash attention kernel (issue #40).
MODELS = ("gpt", "llama", "llama-mask", "llama-einsum", "llama-untied", "nnx", "llama-flash")

#: The sequence lengths the flash attention kernel takes: a multiple of its 128-long
#: blocks (at 16 its block specs do not tile the arrays).
FLASH_BLOCK = 128


def flash_attention(q, k, v):
    """Causal attention by Pallas's TPU flash attention kernel
    (``jax.experimental.pallas.ops.tpu.flash_attention``), as a user hands it to
    ``examples.llama``: over ``(batch, seq, heads, head_dim)``, transposed to the
    kernel's ``(batch, heads, seq, head_dim)`` and back. Every block is 512 long, or
    256 or 128 where the sequence is no multiple of 512. Off a TPU the kernel runs only
    in Pallas's TPU interpret mode (:func:`kernel_mode`).

    >>> import jax, jax.numpy as jnp
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 128, 2, 8), jnp.bfloat16)
    >>> # jax_enable_checks refuses the interpret mode's callbacks in a custom_vjp
    >>> with kernel_mode("llama-flash", "cpu"), jax.enable_checks(False):
    ...     out = flash_attention(q, k, v)
    >>> want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, want, atol=2e-2))
    ((1, 128, 2, 8), True)
    """
    import math

    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    seq, head_dim = q.shape[1], q.shape[3]
    if seq % FLASH_BLOCK:
        raise ValueError(
            f"llama-flash: the flash attention kernel needs a sequence that is a multiple "
            f"of {FLASH_BLOCK}, got {seq}; pass --seq {FLASH_BLOCK} (or a multiple of it)."
        )
    block = math.gcd(seq, 512)
    names = ("block_q", "block_k_major", "block_k", "block_q_major_dkv", "block_k_major_dkv")
    names += ("block_k_dkv", "block_q_dkv", "block_k_major_dq", "block_k_dq", "block_q_dq")
    sizes = pallas_flash.BlockSizes(block_b=1, **dict.fromkeys(names, block))
    out = pallas_flash.flash_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
        causal=True, sm_scale=1.0 / math.sqrt(head_dim), block_sizes=sizes,
    )  # fmt: skip
    return jnp.swapaxes(out, 1, 2)


def kernel_mode(model: str, platform: str) -> contextlib.AbstractContextManager:
    """The context to trace ``model`` on ``platform`` in: on CPU, ``llama-flash``'s TPU
    kernel in Pallas's TPU interpret mode. The mode is read when a ``pallas_call`` is
    traced, and the kernel's backward is traced when the gradient is, outside the
    attention function, so the whole step (the first call of ``jax.jit`` or the
    pipeline, and reading its compiled programs) is traced in it.

    >>> with kernel_mode("llama", "cpu"):  # nothing to change
    ...     pass
    """
    if model != "llama-flash" or platform != "cpu":
        return contextlib.nullcontext()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode()


def model_example(model: str, sizes: dict, rows: int, markers: str | None):
    """The ``model`` of :data:`MODELS` at ``sizes`` on ``rows`` rows. A Llama's SwiGLU
    MLP is ``d_ff * 2 // 3`` wide, so that its three matrices hold what the GPT's two do.

    >>> ex = model_example("llama-mask", SIZES["tiny"], 2, "boundary")
    >>> ex.batch[0].shape, sorted(ex.params)
    ((2, 16), ['blocks', 'embed', 'final_norm'])
    """
    if model == "gpt":
        return gpt_example(sizes, rows, markers)
    if model == "nnx":  # benchmarks/nnx_model.py, beside this script
        module = _beside("nnx_model")
        names = ("layers", "d_model", "heads", "vocab", "seq")
        return module.nnx_lm(
            **{k: sizes[k] for k in names}, d_ff=sizes["d_ff"] * 2 // 3, rows=rows,
            markers=markers is not None,
        )  # fmt: skip
    import jax.numpy as jnp

    from pipemark import examples

    attention = {"llama-mask": "dot_product_mask", "llama-einsum": "einsum"}
    attention["llama-flash"] = flash_attention
    return examples.llama(
        sizes["layers"], sizes["d_model"], sizes["heads"], seq=sizes["seq"], batch=rows,
        vocab=sizes["vocab"], d_ff=sizes["d_ff"] * 2 // 3, compute_dtype=jnp.bfloat16,
        attention=attention.get(model, "dot_product"), tied=model != "llama-untied",
        markers=markers,
    )  # fmt: skip


def _beside(name: str):
    """The module ``benchmarks/{name}.py`` beside this script, however it was imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt_example(sizes: dict, rows: int, markers: str | None):
    """``pipemark.examples.gpt`` at ``sizes`` (one of :data:`SIZES`) on ``rows`` rows:
    float32 parameters, bfloat16 matmuls, ``markers`` between its blocks (``None``:
    the unmarked model a user runs without a pipeline).

    >>> ex = gpt_example(SIZES["tiny"], 2, None)
    >>> ex.batch[0].shape, ex.params["blocks"][0]["w1"].dtype
    ((2, 16), dtype('float32'))
    """
    import jax.numpy as jnp

    from pipemark import examples

    return examples.gpt(
        sizes["layers"], sizes["d_model"], sizes["heads"], seq=sizes["seq"], batch=rows,
        vocab=sizes["vocab"], d_ff=sizes["d_ff"], compute_dtype=jnp.bfloat16,
        markers=markers,
    )  # fmt: skip


def scan_accumulation(loss_fn, microbatches: int):
    """``accumulate(params, batch) -> (loss, grads)``: ``jax.value_and_grad(loss_fn)``
    added up over the ``microbatches`` microbatches of ``batch`` (its leading axis
    cut) in a ``lax.scan``, then averaged: what a user writes instead of a pipeline.

    >>> import jax.numpy as jnp
    >>> accumulate = scan_accumulation(lambda w, x: jnp.mean(x * w), 2)
    >>> loss, grad = accumulate(2.0, jnp.arange(4.0))
    >>> float(loss), float(grad)
    (3.0, 1.5)
    """
    import jax
    import jax.numpy as jnp

    def accumulate(params, batch):
        micro = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        value_and_grad = jax.value_and_grad(loss_fn)

        def body(total, one):
            return jax.tree.map(jnp.add, total, value_and_grad(params, one)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), params))
        total, _ = jax.lax.scan(body, zeros, micro)
        return jax.tree.map(lambda t: t / microbatches, total)

    return accumulate


# ----------------------------------------------------------------- one configuration


def short_error(message: str) -> str:
    """XLA's message shortened to the sentence that says what did not fit (or its
    first line): ``"HLO temporaries 26.81G exceeds available HBM 15.75G"``."""
    text = re.sub(r"\s+", " ", message)
    rest = r"(?:[^.;:]|\.(?=\d))*"  # to the sentence's end (a decimal point is not one)
    for pattern in (
        r"[\w ]*temporaries [\d.]+\w* exceeds " + rest,
        r"Used [\d.]+\w* of [\d.]+\w* \w+",
        r"Ran out of memory in memory space \w+",
        r"(?:Out of memory|out of memory|Attempting to (?:allocate|reserve))" + rest,
    ):
        found = re.search(pattern, text)
        if found:
            return found.group(0).strip()
    first = next((line.strip() for line in message.splitlines() if line.strip()), "")
    first = re.sub(r"^(XlaRuntimeError: )?(RESOURCE_EXHAUSTED: |INTERNAL: )?", "", first)
    return first if len(first) <= 120 else first[:117] + "..."


def is_out_of_memory(message: str) -> bool:
    return bool(
        re.search(
            r"RESOURCE_EXHAUSTED|[Oo]ut of memory|exceeds available|Ran out of memory", message
        )
    )


class CompileCounter:
    """Counts the XLA compilations JAX makes (its backend-compile monitoring event, the
    same name on JAX 0.10 to 0.12), by function name."""

    def __init__(self) -> None:
        import jax

        self.names: list[str] = []
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs: object) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.names.append(str(kwargs.get("fun_name")))

    def take(self) -> list[str]:
        """The compilations since the last take."""
        names, self.names = self.names, []
        return names


def _by_name(names: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts


def prepare(config: str, sizes: dict, microbatches: int, device, model: str = "gpt"):
    """``(step, pipeline, params, batch)`` of a row: the model (marked between its blocks
    where the row is a pipeline), its arguments on ``device``, and :func:`make_step`'s."""
    import jax

    markers = None if config in ("jit", "jit-half", "scan") else "boundary"
    ex = model_example(model, sizes, rows_of(config, sizes), markers)
    params, batch = jax.block_until_ready(jax.device_put(ex.args, device))
    return (*make_step(config, ex.loss_fn, device, microbatches), params, batch)


def make_step(config: str, loss_fn, device, microbatches: int):
    """``(step, pipeline)``: the function a row calls with ``(params, batch)``, and the
    pipeline when it is one (for its compiled programs)."""
    import jax

    import pipemark as pm

    stages = stages_of(config)
    if stages is not None:
        pipe = pm.pipeline_value_and_grad(
            loss_fn,
            num_stages=stages,
            num_microbatches=1 if stages == 1 else microbatches,
            schedule="1f1b" if stages == 1 else "interleaved",
            devices=[device],
            **pipeline_options(config),
        )
        return pipe, pipe
    if config != "scan":
        return jax.jit(jax.value_and_grad(loss_fn)), None
    return jax.jit(scan_accumulation(loss_fn, microbatches)), None


def predicted_memory(pipe, params, batch) -> dict:
    """``Pipeline.memory``'s figures for the slot with the largest predicted peak: that
    peak, and its buffers (without the programs' temporaries: what a TPU's
    ``peak_bytes_in_use`` counts)."""
    worst = max(pipe.memory(params, batch).slots, key=lambda s: s.predicted_peak)
    return {"predicted_peak": worst.predicted_peak, "predicted_buffers": worst.buffers}


def _memory(step, pipe, params, batch) -> dict:
    """The compiled programs' memory analysis (and XLA's FLOPs for a single program)."""
    if pipe is not None:
        programs = pipe.compiled_programs(params, batch)
    else:
        programs = {"step": step.lower(params, batch).compile()}
    analyses = {name: program.memory_analysis() for name, program in programs.items()}
    out = {
        "programs": len(programs),
        "temp_max": max(a.temp_size_in_bytes for a in analyses.values()),
        "temp_sum": sum(a.temp_size_in_bytes for a in analyses.values()),
        "args_max": max(a.argument_size_in_bytes for a in analyses.values()),
        "args_sum": sum(a.argument_size_in_bytes for a in analyses.values()),
        "out_max": max(a.output_size_in_bytes for a in analyses.values()),
        "out_sum": sum(a.output_size_in_bytes for a in analyses.values()),
    }
    if pipe is not None:  # pipemark's prediction, next to the measured peak
        plan = pipe.plan(params, batch)
        out["schedule"] = plan.schedule.name  # e.g. the waves a memory budget chose
        out["in_flight"] = max(plan.schedule.in_flight())
        out["rematerialized"] = len(plan.rematerialized)
        out.update(predicted_memory(pipe, params, batch))
    if pipe is None:
        cost = programs["step"].cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # JAX < 0.4.30: a list
        out["xla_flops"] = float(cost.get("flops", 0.0)) if cost else None
    return out


def _peak(device) -> dict:
    """The device's peak memory, or on a device without statistics (CPU) the process's
    peak resident memory."""
    stats = device.memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {
            "peak": stats["peak_bytes_in_use"],
            "peak_kind": "device",
            "limit": stats.get("bytes_limit"),
        }
    import resource

    return {
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_kind": "host RSS",
    }


def measure(
    config: str,
    sizes: dict,
    microbatches: int,
    repeat: int,
    device,
    counter,
    model: str = "gpt",
    ballast: bool = False,
) -> dict:
    """Time one configuration's first call and steps, count its compilations, read its
    compiled programs' memory; with ``ballast``, check a pipeline's predicted peak
    against a ballast that fills the device (``benchmarks/_ballast.py``)."""
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")
    step, pipe, params, batch = prepare(config, sizes, microbatches, device, model)
    counter.take()
    _log(f"{config}: first call")
    start = time.perf_counter()
    jax.block_until_ready(step(params, batch))
    result = {"first_s": time.perf_counter() - start, "compiles": _by_name(counter.take())}
    _log(f"{config}: first call {result['first_s']:.1f} s; timing {repeat} steps")
    jax.block_until_ready(step(params, batch))
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(step(params, batch))
        seconds.append(time.perf_counter() - start)
    result["step_s"] = sorted(seconds)[len(seconds) // 2]
    result["steps_s"] = seconds
    result["steady_compiles"] = len(counter.take())
    result["memory"] = _memory(step, pipe, params, batch)
    result["memory_compiles"] = len(counter.take())  # 0: the programs the calls compiled
    if ballast and pipe is not None:
        result.update(_peak(device))  # the step's own peak, before the ballast's
        predicted = result["memory"]["predicted_peak"]
        check = _beside("_ballast").ballast_check
        result["ballast"] = check(step, params, batch, device, predicted, is_out_of_memory)
    return result


def child(args: argparse.Namespace) -> None:
    """Run one configuration in this process and write its results as JSON."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # every first call compiles
    counter = CompileCounter()
    device = jax.devices()[0]
    sizes = resolve_sizes(args, device.platform)
    result = {
        "config": args.child,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "sizes": sizes,
        "model": args.model,
        "rows": rows_of(args.child, sizes),
        "microbatches": args.microbatches,
        "repeat": args.repeat,
        "date": f"{datetime.date.today()}",
    }
    stages = stages_of(args.child)
    try:
        if stages is not None and stages > sizes["layers"]:
            result["status"] = "skipped"
            result["message"] = f"{stages} stages > {sizes['layers']} blocks"
        else:
            options = (args.microbatches, args.repeat, device, counter, args.model, args.ballast)
            with kernel_mode(args.model, device.platform):
                result.update(measure(args.child, sizes, *options))
            result["status"] = "ok"
    except Exception as error:  # reported in the table, not raised
        message = f"{type(error).__name__}: {error}"
        result["status"] = "oom" if is_out_of_memory(message) else "error"
        result["message"] = short_error(message)
        _log(f"{args.child}: {result['status']}: {result['message']}")
    for key, value in _peak(device).items():  # unless measured before a ballast
        result.setdefault(key, value)
    Path(args.result).write_text(json.dumps(result))


# ----------------------------------------------------------------------- the parent


def _child_command(args: argparse.Namespace, config: str, result: str) -> list[str]:
    command = [sys.executable, "-u", __file__, "--child", config, "--result", result]
    command += ["--size", args.size, "--repeat", str(args.repeat), "--model", args.model]
    command += ["--microbatches", str(args.microbatches)]
    command += ["--ballast"] if args.ballast else []
    for key in SIZE_KEYS:
        if getattr(args, key) is not None:
            command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return command


def run_one(args: argparse.Namespace, config: str, timeout: float) -> dict:
    """One configuration in a process of its own: its results, or why there are none."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        # The child imports the pipemark of this checkout (the script's repository).
        path_list = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(path_list))
        try:
            run = subprocess.run(
                _child_command(args, config, path),
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {
                "config": config,
                "status": "error",
                "message": f"timed out after {timeout:.0f} s",
            }
        if os.path.exists(path):
            return json.loads(Path(path).read_text())
        stderr = run.stderr or ""
        tail = stderr.strip().splitlines()[-20:]
        status = "oom" if is_out_of_memory(stderr) else "error"
        reason = short_error("\n".join(tail[-3:])) if tail else f"exit status {run.returncode}"
        return {"config": config, "status": status, "message": f"process died: {reason}"}


def run_all(args: argparse.Namespace, configs: list[str]) -> list[dict]:
    begin = time.perf_counter()
    results = []
    for config in configs:
        left = args.budget_s - (time.perf_counter() - begin)
        if left < 20:
            _log(f"{config}: skipped, {args.budget_s:.0f} s budget spent")
            results.append({"config": config, "status": "skipped", "message": "time budget spent"})
            continue
        timeout = min(args.timeout_s, left)
        _log(f"{config}: starting its process (at most {timeout:.0f} s)")
        result = run_one(args, config, timeout)
        summary = result.get("message") or (
            f"first call {result['first_s']:.1f} s, step {1e3 * result['step_s']:.1f} ms"
        )
        _log(f"{config}: {result['status']}: {summary}")
        results.append(result)
    return results


# -------------------------------------------------------------------------- the table


def param_count(sizes: dict, model: str = "gpt") -> int:
    """The parameters of ``model`` (:data:`MODELS`) at ``sizes``: a Llama's SwiGLU has
    three ``d_ff * 2 // 3``-wide matrices, its embedding is its output projection unless
    untied."""
    d, d_ff, vocab, seq = (sizes[k] for k in ("d_model", "d_ff", "vocab", "seq"))
    if model.startswith("llama") or model == "nnx":
        block = 4 * d * d + 3 * d * (d_ff * 2 // 3) + 2 * d
        return vocab * d * (2 if model == "llama-untied" else 1) + sizes["layers"] * block + d
    block = 4 * d * d + 2 * d * d_ff + d_ff + 5 * d
    return vocab * d + seq * d + sizes["layers"] * block + 2 * d + d * vocab


def _bytes(count: float | None) -> str:
    if count is None:
        return "—"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def _ratio(result: dict, base: dict | None, key: str = "step_s") -> float | None:
    if base is None or result.get("status") != "ok" or base.get("status") != "ok":
        return None
    return result[key] / base[key]


def _memory_cells(result: dict) -> tuple[str, str]:
    memory = result.get("memory")
    if memory is None:
        return "—", "—"
    if memory["programs"] == 1:
        return _bytes(
            memory["temp_max"]
        ), f"{_bytes(memory['args_sum'])} + {_bytes(memory['out_sum'])}"
    temps = f"{_bytes(memory['temp_max'])} / {_bytes(memory['temp_sum'])} ({memory['programs']} programs)"
    return temps, f"{_bytes(memory['args_sum'])} + {_bytes(memory['out_sum'])} (sums)"


#: The issues' targets: the step's ratio for these rows (#40: S 4 and S 16 within
#: 1.05 x the scan), the first call's for S 16.
TARGETS = {"s1": 1.05, "s1-half": 1.05, "s4": 1.05, "s16": 1.05, "first": 1.5}


def _target_key(config: str) -> str:
    """``"s16"`` for ``"s16-d4"`` or ``"s16-f4-u1"``: a dispatch bound or fused actions
    do not change a row's target."""
    return re.sub(r"(-d\d+)?(-f\d+)?(-u\d+)?$", "", config)


def _met(key: str, ratio: float) -> str:
    """``", ≤ 1.05: met"`` where ``key`` has a target, else nothing."""
    target = TARGETS.get(_target_key(key))
    if target is None:
        return ""
    return f", ≤ {target:g}: {'met' if ratio <= target else 'not met'}"


def _compile_cell(compiles: dict[str, int]) -> str:
    """``"3: run 1, make_zeros 2"``: the count, then per function (``jit(...)`` dropped)."""
    counts = sorted(compiles.items(), key=lambda item: -item[1])
    short = [(re.sub(r"^jit[(](.*)[)]$", r"\1", name), n) for name, n in counts]
    return f"{sum(compiles.values())}: " + ", ".join(f"{name} {n}" for name, n in short)


def table(results: list[dict], sizes: dict, microbatches: int) -> str:
    by_config = {r["config"]: r for r in results}
    lines = [
        "| configuration | first call (s) | compilations | step (ms) | vs | TFLOP/s | "
        "temporaries (largest / sum) | arguments + outputs | peak memory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        config = result["config"]
        peak = result.get("peak")
        peak_cell = (
            "—"
            if peak is None
            else _bytes(peak) + (" (RSS)" if result["peak_kind"] != "device" else "")
        )
        name = label(config, sizes, microbatches)
        if "memory_budget" in pipeline_options(config) and "memory" in result:
            name += _budget_choice(result["memory"])
        if result["status"] != "ok":
            what = {"oom": "out of memory", "skipped": "skipped", "error": "failed"}[
                result["status"]
            ]
            lines.append(
                f"| {name} | — | — | {what}: {result['message']} | — | — | — | — | {peak_cell} |"
            )
            continue
        base_name = baseline_of(config)
        ratio = _ratio(result, by_config.get(base_name))
        versus = "—" if ratio is None else f"{ratio:.3f} × {base_name}" + _met(config, ratio)
        first = f"{result['first_s']:.1f}"
        if _target_key(config) == "s16" and "scan" in by_config:
            first_ratio = _ratio(result, by_config["scan"], "first_s")
            if first_ratio is not None:
                first += f" ({first_ratio:.2f} × scan{_met('first', first_ratio)})"
        tflops = model_flops(sizes, result["rows"]) / result["step_s"] / 1e12
        temps, io = _memory_cells(result)
        compiles = _compile_cell(result["compiles"])
        lines.append(
            f"| {name} | {first} | {compiles} | {1e3 * result['step_s']:.1f} | "
            f"{versus} | {tflops:.3g} | {temps} | {io} | {peak_cell} |"
        )
    return "\n".join(lines)


def _budget_choice(memory: dict) -> str:
    """What a memory budget chose: microbatches in flight and, where the run recorded
    them, how many forward stages it rematerialised."""
    chose = f"{memory['in_flight']} in flight"
    if memory.get("rematerialized"):
        chose += f", {memory['rematerialized']} stages rematerialised"
    return f" (chose {chose})"


def _verdict(value: float | None, target: float, what: str, failed: dict | None) -> str:
    if value is None:
        why = f"{failed['config']}: {failed['status']}; " if failed else ""
        return f"{what}: not measured ({why}target ≤ {target:g})"
    return f"{what} {value:.3f} (target ≤ {target:g}: {'met' if value <= target else 'not met'})"


def verdicts(results: list[dict]) -> list[str]:
    by_config = {r["config"]: r for r in results}

    def failed(*names: str) -> dict | None:
        return next(
            (by_config[n] for n in names if n in by_config and by_config[n]["status"] != "ok"), None
        )

    def memory_ratio(config: str, base: str, key: str) -> float | None:
        one, ref = by_config.get(config), by_config.get(base)
        if not one or not ref or "memory" not in one or "memory" not in ref:
            return None
        if key == "peak":
            return one["peak"] / ref["peak"]
        return one["memory"]["temp_sum"] / max(ref["memory"]["temp_sum"], 1)

    lines = []
    for config, base in (("s1", "jit"), ("s1-half", "jit-half")):
        if config not in by_config:
            continue
        why = failed(config, base)
        step = _verdict(_ratio(by_config[config], by_config.get(base)), 1.05, f"step / {base}", why)
        temps = _verdict(memory_ratio(config, base, "temp"), 1.05, "compiled temporaries", why)
        peak = _verdict(memory_ratio(config, base, "peak"), 1.05, "peak memory", why)
        lines.append(f"- {config} (S 1, M 1): {step}; vs {base}'s, {temps}; {peak}")
    # Against the scan of the same run only: a file without one has no verdict.
    scanned = "scan" in by_config
    for config in (c for c in by_config if scanned and _target_key(c) in ("s4", "s16")):
        ratio = _ratio(by_config[config], by_config.get("scan"))
        target = TARGETS[_target_key(config)]
        stages = _target_key(config)[1:]
        lines.append(
            f"- {config} (S {stages}, M {by_config[config].get('microbatches', 8)}): "
            f"{_verdict(ratio, target, 'step / scan', failed(config, 'scan'))}"
        )
        if stages == "16":
            ratio = _ratio(by_config[config], by_config.get("scan"), "first_s")
            first = _verdict(ratio, 1.5, "first call / the scan's", failed(config, "scan"))
            lines.append(f"- {config}: {first}")
    for r in results:
        predicted = (r.get("memory") or {}).get("predicted_peak")
        buffers = (r.get("memory") or {}).get("predicted_buffers")
        if buffers is not None and r.get("peak") and r.get("platform") == "tpu":
            lines.append(
                f"- {r['config']}: predicted buffers (the peak less the temporaries, which "
                f"the TPU's peak_bytes_in_use does not count) {_bytes(buffers)}, measured "
                f"{_bytes(r['peak'])}: {buffers / r['peak']:.2f} x (target within 10 %)"
            )
        if predicted is not None and r.get("peak"):
            lines.append(
                f"- {r['config']}: predicted peak (`Pipeline.memory`) {_bytes(predicted)}, "
                f"measured {_bytes(r['peak'])} ({r['peak_kind']}): "
                f"{predicted / r['peak']:.2f} x (target within 10 % on an accelerator)"
            )
    verdict = _beside("_ballast").verdict
    lines += [verdict(r["config"], r["ballast"]) for r in results if r.get("ballast")]
    late = {r["config"]: r["steady_compiles"] for r in results if r.get("steady_compiles")}
    queried = {r["config"]: r["memory_compiles"] for r in results if r.get("memory_compiles")}
    lines.append(f"- compilations in the timed calls after the first: {late or 'none'}")
    lines.append(f"- compilations while reading the compiled programs' memory: {queried or 'none'}")
    return lines


def _model_name(model: str) -> str:
    if model == "gpt":
        return "examples.gpt"
    if model == "nnx":
        return "flax nnx (benchmarks/nnx_model.py: MultiHeadAttention, SwiGLU, tied)"
    what = {"llama-mask": "dot_product_attention(mask=causal)", "llama-einsum": "einsum attention"}
    what["llama-untied"] = "dot_product_attention(is_causal=True), untied embeddings"
    what["llama-flash"] = "Pallas TPU flash_attention(causal=True)"
    attention = what.get(model, "dot_product_attention(is_causal=True)")
    return f"examples.llama (SwiGLU d_ff * 2 // 3 wide), {attention}"


def header(results: list[dict], sizes: dict, microbatches: int, repeat: int) -> list[str]:
    first = next((r for r in results if "device_kind" in r), {})
    jit = next((r for r in results if r["config"] == "jit" and r.get("memory")), None)
    xla = jit["memory"].get("xla_flops") if jit else None
    flops = model_flops(sizes, sizes["batch"])
    name = first.get("model", "gpt")
    model = ", ".join(
        f"{k} {sizes[k]}" for k in ("layers", "d_model", "heads", "d_ff", "vocab", "seq")
    )
    return [
        f"{first.get('date', datetime.date.today().isoformat())}; {first.get('device_kind', '?')} "
        f"({first.get('platform', '?')}); JAX {first.get('jax', '?')}",
        f"model: {_model_name(name)} ({sizes['preset']} sizes: {model}; "
        f"{param_count(sizes, name) / 1e6:.1f}M "
        "float32 parameters, bfloat16 matmuls); batch B rows, M microbatches "
        f"({microbatches}); step: median of {repeat} calls",
        f"model FLOPs per step of {sizes['batch']} rows: {flops / 1e12:.3g} T (counted: 6 x "
        "matmul parameters x tokens + attention)"
        + ("" if not xla else f"; XLA's count for the jit program: {xla / 1e12:.3g} T"),
    ]


def report(
    results: list[dict],
    microbatches: int | None = None,
    repeat: int | None = None,
    date: str | None = None,
) -> str:
    """The header, table and verdict lines of a run's results (as ``--out`` writes
    them, with the results as JSON beside them). ``microbatches``, ``repeat`` and
    ``date`` default to what the results record (runs before they recorded them need
    them given)."""
    ran = [r for r in results if "sizes" in r]
    sizes = ran[0]["sizes"]
    microbatches = microbatches or ran[0]["microbatches"]
    repeat = repeat or ran[0]["repeat"]
    if date is not None:
        results = [{**r, "date": date} for r in results]
    return "\n".join(
        [*header(results, sizes, microbatches, repeat), "",
         table(results, sizes, microbatches), "", *verdicts(results)]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated rows")
    add_model_arguments(parser)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--ballast", action="store_true",
        help="check each pipeline row's predicted peak with a ballast (a device with bytes_limit)",
    )  # fmt: skip
    parser.add_argument("--out", help="write the table here, and the results as JSON beside it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if not CONFIG.match(c)]
    if unknown:
        parser.error(
            f"unknown configurations {unknown}; known: {DEFAULT_CONFIGS}, sN, sN-half, "
            "sN-wK, sN-memG"
        )
    results = run_all(args, configs)
    if not any("sizes" in r for r in results):
        sys.exit("no configuration ran: " + "; ".join(r.get("message", "") for r in results))
    text = report(results, args.microbatches, args.repeat)
    print()
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
