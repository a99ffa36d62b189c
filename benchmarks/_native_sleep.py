"""A stage of fixed duration that waits without Python: a C custom call that copies its
operand to its result and sleeps, for benchmarking a pipeline runtime rather than JAX's
host-callback path.

``pipemark.examples.sleeping`` waits in a ``jax.pure_callback``; a program with a host
callback has no C++ fast dispatch path in JAX and takes the GIL, which costs 100–220 µs
per call on CPU. The custom call here is a few lines of C compiled at run time with the
system C compiler (``cc``, or ``$CC``) into a cache directory under
:func:`tempfile.gettempdir`, keyed by a hash of the source, and registered with XLA's CPU
custom-call API version 3 (status-returning, unified): the duration and the byte count
travel in the opaque ``backend_config`` bytes, so nothing calls back into Python and the
GIL is free while it sleeps.

Only the benchmark and its tests use this module; ``pipemark`` itself needs no C
compiler.

>>> import jax.numpy as jnp
>>> if available():
...     x = native_sleep(jnp.ones(3), 0.0)
...     assert x.tolist() == [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import batching, mlir

from pipemark import mark
from pipemark._compat import lower_with_devices
from pipemark.examples import Example

__all__ = [
    "NativeSleepUnavailable",
    "available",
    "compiler",
    "dispatch_seconds",
    "native_sleep",
    "sleeping",
]

# The opaque bytes are ASCII "<bytes> <microseconds>", readable in the lowered HLO. The
# deadline is taken on entry, so the copy counts towards the duration. A per-thread timer
# slack of 1 ns (Linux) halves the oversleep of nanosleep (about 100 µs to about 50 µs on
# the development machine). ``pm_native_sleep_claim`` is a process-wide flag kept in the
# shared library itself (dlopen returns the same copy for the same path), so the target
# is registered once per process even if this module is imported under two names:
# registering a name twice after the backend started kills the process.
_SOURCE = r"""
#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

static int claimed = 0;

int pm_native_sleep_claim(void) { return __atomic_exchange_n(&claimed, 1, __ATOMIC_SEQ_CST); }

static unsigned long long parse(const char **p, const char *end) {
  unsigned long long v = 0;
  while (*p < end && (**p < '0' || **p > '9')) ++*p;
  while (*p < end && **p >= '0' && **p <= '9') { v = v * 10 + (unsigned long long)(**p - '0'); ++*p; }
  return v;
}

void pm_native_sleep(void *out, const void **in, const char *opaque, size_t opaque_len,
                     void *status) {
  (void)status;
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  const char *p = opaque, *end = opaque + opaque_len;
  unsigned long long nbytes = parse(&p, end);
  unsigned long long us = parse(&p, end);
  memcpy(out, in[0], (size_t)nbytes);
  if (us == 0) return;
#ifdef __linux__
  static __thread int slack_set = 0;
  if (!slack_set) { prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); slack_set = 1; }
#endif
  deadline.tv_sec += (time_t)(us / 1000000ULL);
  deadline.tv_nsec += (long)(us % 1000000ULL) * 1000L;
  if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec += 1; deadline.tv_nsec -= 1000000000L; }
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, NULL) == EINTR) {}
}
"""

_TARGET = "pipemark_bench_native_sleep"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class NativeSleepUnavailable(RuntimeError):
    """No C compiler, or the native sleep did not compile or load."""


def compiler() -> str | None:
    """The C compiler to use (``$CC``, else ``cc``, else ``gcc``), or ``None``."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def available() -> bool:
    """Whether the native sleep can be built here (a C compiler exists and compiles it)."""
    try:
        _load()
    except NativeSleepUnavailable:
        return False
    return True


def _build(cc: str) -> Path:
    digest = hashlib.sha256(f"{cc}\n{_SOURCE}".encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "pipemark-native-sleep"
    library = cache / f"sleep-{digest}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    # Compile under a private name, then rename: concurrent processes (pytest-xdist, two
    # benchmarks) never load a half-written library.
    with tempfile.TemporaryDirectory(dir=cache) as work:
        source = Path(work) / "sleep.c"
        source.write_text(_SOURCE)
        built = Path(work) / "sleep.so"
        run = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(built), str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise NativeSleepUnavailable(
                f"{cc} could not compile the native sleep (exit {run.returncode}):\n"
                f"{run.stderr.strip()}\nUse the callback stage instead (--stage callback)."
            )
        os.replace(built, library)
    return library


def _load() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is not None:
            return _library
        cc = compiler()
        if cc is None:
            raise NativeSleepUnavailable(
                "no C compiler found (tried $CC, cc, gcc); install one or use the callback "
                "stage (--stage callback)"
            )
        try:
            library = ctypes.CDLL(str(_build(cc)))
        except OSError as error:
            raise NativeSleepUnavailable(f"could not load the native sleep: {error}") from error
        library.pm_native_sleep_claim.restype = ctypes.c_int
        if library.pm_native_sleep_claim() == 0:
            jax.ffi.register_ffi_target(
                _TARGET, jax.ffi.pycapsule(library.pm_native_sleep), platform="cpu", api_version=0
            )
        _library = library
        return library


def _abstract_eval(x, *, microseconds: int):
    del microseconds
    return x


def _lowering(ctx, x, *, microseconds: int):
    aval = ctx.avals_in[0]
    ir = mlir.ir
    op = hlo.CustomCallOp.build_generic(
        results=[x.type],
        operands=[x],
        attributes={
            "call_target_name": ir.StringAttr.get(_TARGET),
            # A side-effecting call is neither removed nor fused across nor moved.
            "has_side_effect": ir.BoolAttr.get(True),
            "backend_config": ir.StringAttr.get(
                f"{aval.size * aval.dtype.itemsize} {microseconds}"
            ),
            "api_version": mlir.i32_attr(3),
            "called_computations": ir.ArrayAttr.get([]),
        },
    )
    return op.results


# The custom call itself, on the operand as one device holds it.
local_sleep_p = Primitive("native_sleep_local")
local_sleep_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(local_sleep_p, _lowering, platform="cpu")


def _on_shards(microseconds: int, mesh, arg_shapes, result_shape):
    # Each device sleeps once on its own shard, in the operand's layout: the call is
    # elementwise (a copy), so any layout is one.
    del result_shape
    sharding = arg_shapes[0].sharding
    return (
        mesh,
        functools.partial(local_sleep_p.bind, microseconds=microseconds),
        sharding,
        (sharding,),
    )


def _operand_sharding(microseconds: int, mesh, arg_shapes, result_shape):
    del microseconds, mesh, result_shape
    return arg_shapes[0].sharding


# XLA's SPMD partitioner refuses a side-effecting custom call without a sharding
# ("Side-effect HLO must have sharding"), and the byte count in the opaque bytes must be
# a device's, not the whole array's. custom_partitioning gives the call both: on a
# sharded operand it is lowered again for one shard (the rule: elementwise, as Shardy
# reads it; the callbacks for the older partitioner), and on one device it is the custom
# call as it is.
_partitioned = custom_partitioning(
    lambda x, microseconds: local_sleep_p.bind(x, microseconds=microseconds),
    static_argnums=(1,),
)
_partitioned.def_partition(
    partition=_on_shards,
    infer_sharding_from_operands=_operand_sharding,
    propagate_user_sharding=lambda microseconds, mesh, user_shape: user_shape.sharding,
    sharding_rule="... -> ...",
)


def _partitioned_lowering(ctx, x, *, microseconds: int):
    return mlir.lower_fun(lambda x: [_partitioned(x, microseconds)], multiple_results=True)(ctx, x)


def _batch(args, dims, *, microseconds: int):
    # One sleep for the whole batch: the copy does not care about the shape.
    return native_sleep_p.bind(args[0], microseconds=microseconds), dims[0]


native_sleep_p = Primitive("native_sleep")
native_sleep_p.def_abstract_eval(_abstract_eval)
native_sleep_p.def_impl(
    lambda x, *, microseconds: jax.jit(
        functools.partial(native_sleep_p.bind, microseconds=microseconds)
    )(x)
)
mlir.register_lowering(native_sleep_p, _partitioned_lowering, platform="cpu")
lower_with_devices(native_sleep_p)
batching.primitive_batchers[native_sleep_p] = _batch


def _microseconds(seconds: float) -> int:
    if not seconds >= 0:  # also rejects NaN
        raise ValueError(f"seconds must be >= 0, got {seconds!r}")
    return round(seconds * 1e6)


def _sleep_call(x: jax.Array, microseconds: int) -> jax.Array:
    _load()
    return native_sleep_p.bind(x, microseconds=microseconds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sleep(x: jax.Array, microseconds: int) -> jax.Array:
    return _sleep_call(x, microseconds)


# The derivative of a copy is a copy; the backward waits as long as the forward.
_sleep.defvjp(
    lambda x, microseconds: (_sleep_call(x, microseconds), None),
    lambda microseconds, _, g: (_sleep_call(g, microseconds),),
)


def native_sleep(x: jax.Array, seconds: float) -> jax.Array:
    """``x`` unchanged, after waiting ``seconds`` in C on the device's thread (CPU only);
    its derivative waits ``seconds`` too.

    Raises :class:`NativeSleepUnavailable` without a working C compiler, ``ValueError``
    for a negative duration.

    >>> import jax.numpy as jnp
    >>> if available():
    ...     assert float(jax.grad(lambda x: native_sleep(x, 1e-3) * 3)(2.0)) == 3.0
    """
    return _sleep(jnp.asarray(x), _microseconds(seconds))


def sleeping(
    num_stages: int = 2, seconds: float = 0.005, batch: int = 8, width: int = 32
) -> Example:
    """``pipemark.examples.sleeping`` with :func:`native_sleep` in place of the host
    callback: ``num_stages`` small marked stages (``stage{i}``) whose forward and backward
    each wait ``seconds``; ``params`` is a list of ``(width, width)`` weights, ``batch``
    is ``ones((batch, width))``.

    Why ``width`` = 32 rather than the callback example's 4: XLA's CPU client runs a
    program whose estimated cost is under 1000 flops *inline*, on the thread that
    dispatches it (the call returns when the program is done), and anything larger
    asynchronously, one program at a time per device. A stage that really takes
    milliseconds is always in the second class, so the waiting stage has to be too:
    a 4-wide stage (about 64 flops per row pair) would make every dispatch block for
    ``seconds`` and measure a synchronous device. At width 32 one row already costs
    2048 flops of ``x @ w``, a few microseconds.
    """
    if num_stages < 1 or batch < 1 or width < 1:
        raise ValueError(
            f"num_stages, batch and width must be >= 1, got {num_stages}, {batch}, {width}"
        )
    microseconds = _microseconds(seconds)
    _load()  # fail here, not in the middle of tracing
    params = [jnp.eye(width, dtype=jnp.float32) * 0.5 for _ in range(num_stages)]

    def loss_fn(params, batch):
        x = batch
        for i, w in enumerate(params):
            x, w = mark((x, w), name=f"stage{i}", mark_type="start")
            x = _sleep(jnp.tanh(x @ w), microseconds)
            if i == len(params) - 1:
                x = jnp.mean(x * x)
            x = mark(x, name=f"stage{i}", mark_type="end")
        return x

    return Example(loss_fn, params, jnp.ones((batch, width), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _slow_matmul(x: jax.Array, w: jax.Array, microseconds: int) -> jax.Array:
    return _sleep_call(x @ w, microseconds)


def _slow_matmul_fwd(x, w, microseconds):
    return _sleep_call(x @ w, microseconds), (x, w)


def _slow_matmul_bwd(microseconds, residuals, g):
    # The input cotangent (B) and the weight gradient (W) each wait: two separate waits,
    # so pipemark.passes.split_backward puts one in each half.
    x, w = residuals
    return _sleep_call(g @ w.T, microseconds), _sleep_call(x.T @ g, microseconds)


_slow_matmul.defvjp(_slow_matmul_fwd, _slow_matmul_bwd)


def sleeping_split(
    num_stages: int = 2, seconds: float = 0.005, batch: int = 8, width: int = 32
) -> Example:
    """Like :func:`sleeping`, but each stage's backward waits ``seconds`` twice, once for
    the input cotangent (B) and once for the weight gradient (W), so that a zero-bubble
    schedule has equal F, B and W of ``seconds`` each."""
    microseconds = _microseconds(seconds)
    _load()
    params = [jnp.eye(width, dtype=jnp.float32) * 0.5 for _ in range(num_stages)]

    def loss_fn(params, batch):
        x = batch
        for i, w in enumerate(params):
            x, w = mark((x, w), name=f"stage{i}", mark_type="start")
            x = _slow_matmul(x, w, microseconds)
            if i == len(params) - 1:
                x = jnp.mean(x * x)
            x = mark(x, name=f"stage{i}", mark_type="end")
        return x

    return Example(loss_fn, params, jnp.ones((batch, width), jnp.float32))


def dispatch_seconds(example: Example) -> tuple[float, float]:
    """How long dispatching ``jax.jit(jax.value_and_grad(example.loss_fn))`` takes, and
    how long until its results are ready, both from the call (compiled first). A
    dispatch much shorter than the run means XLA runs the program asynchronously; as
    long as the run, inline on the dispatching thread (see :func:`sleeping`)."""
    step = jax.jit(jax.value_and_grad(example.loss_fn))
    jax.block_until_ready(step(*example.args))  # compiled
    start = time.perf_counter()
    out = step(*example.args)
    dispatched = time.perf_counter() - start
    jax.block_until_ready(out)
    return dispatched, time.perf_counter() - start
