"""One-command check of pipemark's CUDA custom-call targets on one NVIDIA GPU.

Made for an H200 with JAX 0.11 and cupy-cuda13x installed and no network; finishes in a
few minutes and prints one table:

(a) kernel correctness: the batched identity kernel on poisoned random buffers of many
    sizes and alignments (0 and odd sizes, mutually misaligned pointers, aliased pairs),
    and the JAX ``identity`` target on arrays of many dtypes;
(b) bandwidth of the batched copy ÷ CuPy device-to-device memcpy bandwidth, 64 MiB–1 GiB
    (target ≥ 0.9);
(c) an 8-layer MLP training step with custom-call markers ÷ identity lowering, with XLA
    command buffers (CUDA graphs) off and on; also how many marker calls XLA put inside
    command buffers;
(d) zero copies with donation: the marked output lives in the donated input's buffer.

    python benchmarks/gpu_check.py            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run  # anywhere: imports, kernel compile, CPU path

Exit status 1 when any row fails.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MiB = 1 << 20
ROWS: list[tuple[str, str, str, str, str]] = []  # check, case, value, target, status


def row(check: str, case: str, value: str, target: str, ok: bool | None) -> None:
    status = "skip" if ok is None else ("ok" if ok else "FAIL")
    ROWS.append((check, case, value, target, status))


def print_table(title: str) -> None:
    print(f"\n{title}\n")
    print("| check | case | value | target | status |")
    print("|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")


# -------------------------------------------------------------- shared pieces


def random_pairs(rng, sizes, arena_bytes):
    """Offsets (src, dst, size) of disjoint ranges with random mutual misalignment; about
    one pair in eight is aliased (dst == src)."""
    pairs, cursor = [], 0
    for size in sizes:
        src = cursor + int(rng.integers(0, 64))
        aliased = rng.random() < 0.125
        dst = src if aliased else src + size + int(rng.integers(0, 64))
        cursor = max(src, dst) + size + 1
        pairs.append((src, dst, size))
    if cursor > arena_bytes:
        raise SystemExit(f"internal error: arena of {arena_bytes} bytes is too small")
    return pairs


def pair_sizes(rng, large: bool):
    sizes = [0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 255, 4095, 4096, 4097, 65535, 65537]
    sizes += [int(s) for s in rng.integers(1, 100_000, 200)]
    if large:
        sizes += [MiB, 3 * MiB + 5, 8 * MiB + 1]
    return sizes


def mlp_inputs(width: int, batch: int, depth: int = 8):
    import jax

    keys = jax.random.split(jax.random.PRNGKey(0), depth + 1)
    params = [
        (jax.random.normal(k, (width, width)) / width**0.5, jax.numpy.zeros((width,)))
        for k in keys[:depth]
    ]
    return params, jax.random.normal(keys[-1], (batch, width))


def time_mlp(mode: str, params, x, repeats: int) -> tuple[float, object]:
    import jax
    from markers import make_step  # the step benchmarks/markers.py times, beside this script

    import pipemark as pm

    with pm.lowering(mode):
        step = jax.jit(make_step(True), donate_argnums=0)
        compiled_text = step.lower(params, x).compile().as_text()
        params = jax.tree_util.tree_map(jax.numpy.copy, params)
        for _ in range(3):
            params = step(params, x)
        jax.block_until_ready(params)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            params = step(params, x)
            jax.block_until_ready(params)
            times.append(time.perf_counter() - start)
    return statistics.median(times), compiled_text


def markers_in_command_buffers(compiled_text: str) -> tuple[int, int]:
    """(marker calls inside command-buffer computations, all marker calls)."""
    inside = total = 0
    computation = ""
    for line in compiled_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
        if 'custom_call_target="pipeline_marker"' in line:
            total += 1
            inside += "command_buffer" in computation
    return inside, total


def entry_copies(compiled_text: str) -> int:
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    return len(re.findall(r"= \S+ copy\(", entry))


def check_zero_copy(device) -> None:
    """(d): with donation the marker's result is the donated buffer itself."""
    import jax
    import jax.numpy as jnp

    import pipemark as pm
    from pipemark import custom_call

    def step(x, w):
        return pm.mark((x, w), name="s", mark_type="start")

    platform = device.platform
    for donate in (True, False):
        x = jax.device_put(jnp.arange(1 << 16, dtype=jnp.float32), device)
        w = jax.device_put(jnp.ones((257, 3), jnp.bfloat16), device)
        pointers = (x.unsafe_buffer_pointer(), w.unsafe_buffer_pointer())
        expected = (np.array(x), np.array(w))  # copies: a view would block donation
        fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
        with pm.lowering("custom_call"):
            copies = entry_copies(fn.lower(x, w).compile().as_text())
            custom_call.reset_cpu_copy_stats()
            out = jax.block_until_ready(fn(x, w))
        target_copies = custom_call.copy_stats(platform).copies
        same = tuple(o.unsafe_buffer_pointer() for o in out) == pointers
        values = all(np.array_equal(np.asarray(o), e) for o, e in zip(out, expected))
        if donate:
            ok = same and copies == 0 and target_copies == 0 and values
            row("(d) zero copy", "donated", f"same buffers: {same}, copies {target_copies}"
                f" + XLA {copies}", "same, 0 + 0", ok)  # fmt: skip
        else:
            intact = np.array_equal(np.asarray(x), expected[0])
            ok = not same and values and intact
            row("(d) zero copy", "not donated", f"XLA copies {copies}, input intact: {intact}",
                "copied, intact", ok)  # fmt: skip


def check_marked_grad_matches(device) -> None:
    import jax

    import pipemark as pm

    params, x = mlp_inputs(64, 16)
    params, x = jax.device_put((params, x), device)
    from markers import make_step  # the step benchmarks/markers.py times, beside this script

    grad = jax.jit(make_step(True))
    results = {}
    for mode in ("identity", "custom_call"):
        with pm.lowering(mode):
            results[mode] = jax.tree_util.tree_map(np.asarray, grad(params, x))
    diffs = jax.tree_util.tree_map(
        lambda a, b: float(np.max(np.abs(a - b))), results["identity"], results["custom_call"]
    )
    worst = max(jax.tree_util.tree_leaves(diffs))
    row("(a) correctness", "MLP step: custom_call vs identity", f"max abs diff {worst:.1e}",
        "≤ 1e-5", worst <= 1e-5)  # fmt: skip


# ------------------------------------------------------------------ dry run


def dry_run() -> int:
    import jax

    import pipemark as pm
    from pipemark import custom_call

    row("imports", "pipemark, jax", f"pipemark {pm.__version__}, jax {jax.__version__}", "", True)
    try:
        import cupy

        row("imports", "cupy", cupy.__version__, "needed on the GPU", True)
    except ImportError:
        row("imports", "cupy", "not installed", "needed on the GPU only", None)
    sources = custom_call.kernel_sources()
    row("kernels", "sources found", ", ".join(sources), custom_call.KERNEL_FILE,
        custom_call.KERNEL_FILE in sources)  # fmt: skip
    nvcc = shutil.which("nvcc") or (
        "/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None
    )
    for name in sources:
        if nvcc is None:
            row("kernels", f"{name} for sm_90", "nvcc not found", "compiles", None)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run(
                [nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-o", f"{tmp}/k.cubin",
                 str(custom_call.kernel_dir() / name)],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        row("kernels", f"{name} for sm_90 (nvcc)", "compiled" if done.returncode == 0
            else done.stderr.strip()[-200:], "compiles", done.returncode == 0)  # fmt: skip

    # (a) on the host: the launches plan_copies makes, executed pair by pair with memmove
    # over a poisoned host arena, must copy exactly the requested pairs.
    rng = np.random.default_rng(0)
    sizes = pair_sizes(rng, large=False)
    arena = rng.integers(0, 256, 32 * MiB, dtype=np.uint8)
    base = arena.ctypes.data
    pairs = random_pairs(rng, sizes, arena.size)
    expected = arena.copy()
    for s, d, n in pairs:
        expected[d : d + n] = arena[s : s + n]
    launches = custom_call.plan_copies(*zip(*((base + s, base + d, n) for s, d, n in pairs)))
    for launch in launches:
        for i in range(launch.table.count):
            pair = launch.table.pairs[i]
            ctypes.memmove(pair.dst, pair.src, pair.size)
    ok = np.array_equal(arena, expected)
    row("(a) correctness", f"copy plan, {len(pairs)} pairs on the host",
        f"{len(launches)} launches", "exact copy", ok)  # fmt: skip

    cpu = jax.devices("cpu")[0]
    check_identity_target(cpu)
    check_marked_grad_matches(cpu)
    row("(b) bandwidth", "64 MiB – 1 GiB", "needs a GPU", "≥ 0.9", None)
    params, x = mlp_inputs(64, 16)
    marked, _ = time_mlp("custom_call", params, x, repeats=3)
    plain, _ = time_mlp("identity", params, x, repeats=3)
    row("(c) MLP step", "CPU, width 64 (smoke test)", f"{marked / plain:.2f}×", "runs", True)
    check_zero_copy(cpu)
    print_table("pipemark GPU check — dry run (CPU path only; no GPU numbers)")
    return 0 if all(r[4] != "FAIL" for r in ROWS) else 1


# --------------------------------------------------------------------- GPU run


def check_kernel_on_gpu(cupy, custom_call, device_ordinal: int) -> None:
    rng = np.random.default_rng(1)
    sizes = pair_sizes(rng, large=True)
    arena_bytes = 96 * MiB
    with cupy.cuda.Device(device_ordinal):
        memory = cupy.random.randint(0, 256, arena_bytes, dtype=cupy.uint8)  # poison
        base = memory.data.ptr
        pairs = random_pairs(rng, sizes, arena_bytes)
        expected = memory.copy()
        for s, d, n in pairs:
            expected[d : d + n] = memory[s : s + n]
        launches = custom_call.plan_copies(*zip(*((base + s, base + d, n) for s, d, n in pairs)))
        stream = cupy.cuda.Stream(non_blocking=True)
        custom_call.launch_copies(launches, stream.ptr, device_ordinal)
        stream.synchronize()
        wrong = int((memory != expected).sum())
    row("(a) correctness", f"kernel, {len(pairs)} poisoned pairs, 0 B – 8 MiB",
        f"{wrong} wrong bytes", "0", wrong == 0)  # fmt: skip


def check_identity_target(device) -> None:
    import jax
    import jax.numpy as jnp

    from pipemark import custom_call

    rng = np.random.default_rng(2)
    # Only dtypes JAX keeps as they are: without jax_enable_x64 a float64 array would
    # come back as float32 and never equal its input.
    arrays = [
        rng.integers(0, 255, 7).astype(np.uint8),
        np.zeros(0, np.float32),
        rng.standard_normal((3, 5)).astype(np.float16),
        rng.standard_normal((33,)).astype(jnp.bfloat16),
        rng.integers(-5, 5, (1000, 3)).astype(np.int8),
        rng.standard_normal(1 << 20).astype(np.float32),
    ]
    on_device = [jax.device_put(a, device) for a in arrays]
    outs = jax.jit(lambda *a: custom_call.identity(*a, alias=False))(*on_device)
    ok = all(np.array_equal(np.asarray(o), a) for o, a in zip(outs, arrays))
    row("(a) correctness", "identity target, 6 dtypes/sizes", "equal" if ok else "differs",
        "equal", ok)  # fmt: skip


def check_bandwidth(cupy, custom_call, device_ordinal: int) -> None:
    repeats = 10
    with cupy.cuda.Device(device_ordinal):
        stream = cupy.cuda.Stream(non_blocking=True)
        for size in (64 * MiB, 256 * MiB, 1024 * MiB):
            src = cupy.ones(size, dtype=cupy.uint8)
            dst = cupy.empty(size, dtype=cupy.uint8)
            for pieces in (1, 8):
                chunk = size // pieces
                launches = custom_call.plan_copies(
                    [src.data.ptr + i * chunk for i in range(pieces)],
                    [dst.data.ptr + i * chunk for i in range(pieces)],
                    [chunk] * pieces,
                )

                def kernel(launches=launches):
                    custom_call.launch_copies(launches, stream.ptr, device_ordinal)

                def memcpy(src=src, dst=dst, size=size):
                    cupy.cuda.runtime.memcpyAsync(
                        dst.data.ptr, src.data.ptr, size,
                        cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr,
                    )  # fmt: skip

                seconds = {}
                for name, fn in (("kernel", kernel), ("memcpy", memcpy)):
                    fn()
                    stream.synchronize()
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record(stream)
                    for _ in range(repeats):
                        fn()
                    end.record(stream)
                    end.synchronize()
                    seconds[name] = cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats
                ratio = seconds["memcpy"] / seconds["kernel"]
                gbps = 2 * size / seconds["kernel"] / 1e9
                row("(b) bandwidth", f"{size // MiB} MiB in {pieces} buffer(s)",
                    f"{ratio:.2f}× memcpy ({gbps:.0f} GB/s r+w)", "≥ 0.9", ratio >= 0.9)  # fmt: skip
            del src, dst


def mlp_worker(command_buffers: bool) -> None:
    """(c) in a process of its own: XLA reads its flags once, at backend start."""
    import jax

    from pipemark import custom_call

    params, x = mlp_inputs(4096, 2048)
    plain, _ = time_mlp("identity", params, x, repeats=20)
    marked, text = time_mlp("custom_call", params, x, repeats=20)
    inside, total = markers_in_command_buffers(text)
    calls = custom_call.copy_stats("cuda").calls
    print(json.dumps({"ratio": marked / plain, "identity_ms": plain * 1e3, "inside": inside,
                      "total": total, "handler_calls": calls,
                      "jax": jax.__version__, "command_buffers": command_buffers}))  # fmt: skip


def run_mlp(command_buffers: bool) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if command_buffers:
        flags += " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"
    else:
        flags += " --xla_gpu_enable_command_buffer="
    # This process holds JAX's preallocated 75% of the GPU and CuPy's pool; JAX's docs
    # name a second preallocating process as a common cause of out-of-memory errors, so
    # the worker allocates as it goes.
    env = {**os.environ, "XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run(
        [sys.executable, __file__, "--mlp-worker", "on" if command_buffers else "off"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    case = f"8×4096 MLP, command buffers {'on' if command_buffers else 'off'}"
    if done.returncode != 0:
        row("(c) MLP step", case, done.stderr.strip()[-200:], "runs", False)
        return
    result = json.loads(done.stdout.strip().splitlines()[-1])
    row("(c) MLP step", case, f"{result['ratio']:.3f}× identity ({result['identity_ms']:.2f} ms)"
        f"; markers in command buffers {result['inside']}/{result['total']}", "≤ 1.05×",
        result["ratio"] <= 1.05)  # fmt: skip


def gpu_run() -> int:
    import jax

    import pipemark as pm
    from pipemark import custom_call

    try:
        import cupy
    except ImportError:
        print("cupy is not installed: pip install 'pipemark[gpu]'", file=sys.stderr)
        return 1
    devices = jax.devices("cuda")
    device = devices[0]
    custom_call.register_targets("cuda")
    ordinal = device.local_hardware_id
    row("imports", "versions", f"jax {jax.__version__}, cupy {cupy.__version__}, "
        f"pipemark {pm.__version__}, {device.device_kind}", "", True)  # fmt: skip
    check_kernel_on_gpu(cupy, custom_call, ordinal)
    check_identity_target(device)
    check_marked_grad_matches(device)
    check_bandwidth(cupy, custom_call, ordinal)
    run_mlp(command_buffers=False)
    run_mlp(command_buffers=True)
    check_zero_copy(device)
    print_table("pipemark GPU check")
    return 0 if all(r[4] != "FAIL" for r in ROWS) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: imports, compile, CPU")
    parser.add_argument("--mlp-worker", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlp_worker:
        mlp_worker(args.mlp_worker == "on")
        return 0
    start = time.perf_counter()
    status = dry_run() if args.dry_run else gpu_run()
    print(f"\n{time.perf_counter() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
