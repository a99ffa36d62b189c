"""kernels/*.cu: they compile for sm_90, and the copy table Python builds makes the
kernel do what a NumPy model of it says (the kernel's own code is run on the host)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipemark import custom_call as cc

REPO = Path(__file__).resolve().parent.parent
KERNELS = sorted((REPO / "kernels").glob("*.cu"))
NVCC = shutil.which("nvcc") or (
    "/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None
)

# struct pipemark_copy_table, field by field, as the kernel reads its parameter.
PAIR_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("size", "<u8")])
TABLE_DTYPE = np.dtype(
    [("pairs", PAIR_DTYPE, (cc.MAX_PAIRS,)), ("count", "<u4"), ("unused", "<u4")]
)
BASE = 0x7F0000000000  # a fake device address, 256-byte aligned like XLA's buffers


def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


# --------------------------------------------------------------------- compiling


def test_there_are_kernels():
    assert [p.name for p in KERNELS] == [cc.KERNEL_FILE]


@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
@pytest.mark.parametrize("what", ["cubin", "ptx"])
def test_kernel_compiles_for_sm90(source, what, tmp_path):
    if NVCC:
        arch = "sm_90" if what == "cubin" else "compute_90"
        out = tmp_path / f"kernel.{what}"
        done = subprocess.run(
            [NVCC, f"-{what}", f"-arch={arch}", "-std=c++17", "-o", str(out), str(source)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert out.stat().st_size > 0
        if what == "ptx":
            ptx = out.read_text()
            assert f".entry {cc.KERNEL_NAME}(" in ptx
            assert "ld.global.v4" in ptx and "st.global.v4" in ptx  # 16-byte accesses
        return
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("neither nvcc nor NVRTC (cupy + nvidia-cuda-nvrtc) is available")
    program = nvrtc.createProgram(source.read_text(), source.name, [], [])
    arch = "sm_90" if what == "cubin" else "compute_90"
    nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", "--std=c++17"])
    image = nvrtc.getCUBIN(program) if what == "cubin" else nvrtc.getPTX(program)
    assert len(image) > 0


def test_python_table_layout_matches_the_kernel():
    source = (REPO / "kernels" / cc.KERNEL_FILE).read_text()
    (max_pairs,) = re.findall(r"#define PIPEMARK_MAX_PAIRS (\d+)", source)
    assert int(max_pairs) == cc.MAX_PAIRS
    # the kernel static_asserts these same sizes
    assert ctypes.sizeof(cc.CopyTable) == TABLE_DTYPE.itemsize == 24 * cc.MAX_PAIRS + 8 <= 4096
    assert cc.CopyTable.count.offset == TABLE_DTYPE.fields["count"][1]


# ------------------------------------------------------------ the NumPy model


def _word_width(src: int, dst: int) -> int:
    for width in (16, 8, 4, 2):
        if (src - dst) % width == 0:
            return width
    return 1


def kernel_model(launches, memory: np.ndarray) -> None:
    """What the batched identity kernel does to ``memory`` (addresses start at BASE),
    written from its specification: per pair, the bytes before the first address where
    both pointers are aligned to the widest common word, whole words, then the tail."""
    for launch in launches:
        table = np.frombuffer(bytes(launch.table), dtype=TABLE_DTYPE)[0]
        count = int(table["count"])
        assert launch.grid[1] == count and 0 < count <= cc.MAX_PAIRS
        assert launch.grid[0] >= 1 and launch.block == (cc.BLOCK_THREADS, 1, 1)
        for pair in table["pairs"][:count]:
            src, dst, size = (int(pair[f]) for f in ("src", "dst", "size"))
            assert size > 0 and src != dst  # no-op pairs never reach the kernel
            width = _word_width(src, dst)
            head = min((-src) % width, size)
            words = (size - head) // width
            tail = size - head - words * width
            assert head < width and tail < width
            assert words == 0 or ((src + head) % width, (dst + head) % width) == (0, 0)
            s, d = src - BASE, dst - BASE
            memory[d : d + head] = memory[s : s + head]
            body = memory[s + head : s + head + words * width].reshape(words, width)
            memory[d + head : d + head + words * width] = body.reshape(-1)
            memory[d + size - tail : d + size] = memory[s + size - tail : s + size]


def _random_pairs(rng, count, max_size, arena_bytes):
    """Disjoint source/destination ranges of random sizes and alignments, some aliased."""
    srcs, dsts, sizes = [], [], []
    cursor = 0
    for _ in range(count):
        size = int(rng.choice([0, 1, 2, 3, 15, 16, 17, 31, 33, int(rng.integers(1, max_size))]))
        src = cursor + int(rng.integers(0, 48))
        if rng.random() < 0.15:
            dst = src  # aliased: the kernel must leave it alone
            cursor = src + size
        else:
            # same misalignment mod 16 half of the time, to exercise the wide path
            dst = src + size + int(rng.integers(0, 48))
            if rng.random() < 0.5:
                dst += (src - dst) % 16
            cursor = dst + size
        cursor += 1
        srcs.append(BASE + src)
        dsts.append(BASE + dst)
        sizes.append(size)
    assert cursor < arena_bytes
    return srcs, dsts, sizes


@pytest.mark.parametrize("seed", range(4))
def test_model_of_the_planned_launches_copies_exactly_the_pairs(seed):
    rng = np.random.default_rng(seed)
    arena = 1 << 20
    srcs, dsts, sizes = _random_pairs(rng, 300, 2000, arena)
    launches = cc.plan_copies(srcs, dsts, sizes)
    work = [(s, d, n) for s, d, n in zip(srcs, dsts, sizes) if n and s != d]
    assert [launch.table.count for launch in launches] == [
        min(cc.MAX_PAIRS, len(work) - i) for i in range(0, len(work), cc.MAX_PAIRS)
    ]
    memory = rng.integers(0, 256, arena, dtype=np.uint8)  # poison everywhere
    expected = memory.copy()
    for s, d, n in work:
        expected[d - BASE : d - BASE + n] = memory[s - BASE : s - BASE + n]
    kernel_model(launches, memory)
    np.testing.assert_array_equal(memory, expected)


def test_block_count_grows_with_the_largest_buffer():
    (small,) = cc.plan_copies([BASE], [BASE + (1 << 31)], [100])
    (large,) = cc.plan_copies([BASE, BASE + 64], [BASE + (1 << 31), BASE + (1 << 32)], [1 << 30, 4])
    assert small.grid == (1, 1, 1)
    assert large.grid == (cc.MAX_BLOCKS_X, 2, 1)


# ------------------------------------------- the kernel's own code, run on the host

_HOST_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "batched_identity.cu"

// argv: memory file, launches file, base address. Each launch in the launches file is
// the raw pipemark_copy_table followed by grid_x and block_x (uint32 each). Runs every
// (blockIdx, threadIdx) of every launch through pipemark_copy_pair_part, sequentially.
int main(int argc, char** argv) {
  if (argc != 4) return 2;
  FILE* f = std::fopen(argv[1], "rb");
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  unsigned char* memory = static_cast<unsigned char*>(std::aligned_alloc(256, (n + 255) / 256 * 256));
  if (std::fread(memory, 1, n, f) != (size_t)n) return 3;
  std::fclose(f);
  unsigned long long base = std::strtoull(argv[3], nullptr, 0);
  FILE* l = std::fopen(argv[2], "rb");
  pipemark_copy_table table;
  unsigned int dims[2];
  while (std::fread(&table, sizeof table, 1, l) == 1) {
    if (std::fread(dims, sizeof dims, 1, l) != 1) return 4;
    unsigned long long stride = (unsigned long long)dims[0] * dims[1];
    for (unsigned int p = 0; p < table.count; ++p) {
      pipemark_copy_pair pair = table.pairs[p];
      pair.src = memory + ((unsigned long long)pair.src - base);
      pair.dst = memory + ((unsigned long long)pair.dst - base);
      for (unsigned long long first = 0; first < stride; ++first)
        pipemark_copy_pair_part(pair, first, stride);
    }
  }
  std::fclose(l);
  f = std::fopen(argv[1], "wb");
  std::fwrite(memory, 1, n, f);
  std::fclose(f);
  return 0;
}
"""


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    if not NVCC:
        pytest.skip("nvcc is needed to build the kernel's code for the host")
    work = tmp_path_factory.mktemp("host_kernel")
    (work / "driver.cu").write_text(_HOST_DRIVER)
    binary = work / "driver"
    command = [NVCC, "-std=c++17", "-arch=sm_90", f"-I{REPO / 'kernels'}", "-o", str(binary)]
    done = subprocess.run(
        [*command, str(work / "driver.cu")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return binary


def test_kernel_code_on_the_host_matches_the_model(host_kernel, tmp_path):
    rng = np.random.default_rng(7)
    arena = 1 << 20
    srcs, dsts, sizes = _random_pairs(rng, 200, 6000, arena)
    srcs.append(BASE + 600_000)  # one buffer large enough for several blocks
    dsts.append(BASE + 800_016)
    sizes.append(70_001)
    launches = cc.plan_copies(srcs, dsts, sizes)
    assert len(launches) == 2 and max(launch.grid[0] for launch in launches) > 1
    memory = rng.integers(0, 256, arena, dtype=np.uint8)
    (tmp_path / "memory").write_bytes(memory.tobytes())
    with open(tmp_path / "launches", "wb") as out:
        for launch in launches:
            out.write(bytes(launch.table))
            out.write(np.array([launch.grid[0], launch.block[0]], "<u4").tobytes())
    done = subprocess.run(
        [str(host_kernel), str(tmp_path / "memory"), str(tmp_path / "launches"), hex(BASE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    kernel_model(launches, memory)
    got = np.frombuffer((tmp_path / "memory").read_bytes(), dtype=np.uint8)
    np.testing.assert_array_equal(got, memory)


# ------------------------------------------------------------- GPU check script


def test_gpu_check_dry_run():
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dry run" in done.stdout and "FAIL" not in done.stdout
