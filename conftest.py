"""Test-suite settings for tests/ and the doctests in pipemark/.

JAX checks every jaxpr it builds and runs (``jax_enable_checks``), and every pipemark
pass checks the jaxprs it returns (:func:`pipemark.passes.framework.jaxpr_pass`), so
a pass that builds an ill-typed program fails where it builds it.

The host CPU platform has 8 devices (``jax_num_cpu_devices``), so multi-device pipelines
(4 stages, 2x2x2 meshes) run in the test process itself. JAX reads the setting only when
it starts its CPU backend, so it is set here, before any test or doctest runs a JAX
operation; pytest imports this file in every pytest-xdist worker too. Tests take their
devices from ``tests._devices.devices(k)``: the default backend's first ``k``, or on an
accelerator with fewer (``make test-tpu`` on one TPU chip) the host CPU platform's. Real
multi-process runs (tests/runtime/test_distributed.py, tests/test_launch.py) start their
own processes.

On an accelerator, float32 matrix products run at full float32 precision
(``jax_default_matmul_precision="highest"``), as on the CPU: a TPU's default is
bfloat16 passes (about three digits), far coarser than the tolerances the tests
compare results to. On the CPU nothing changes (the setting would print in every
jaxpr's ``dot_general``).

Tests marked ``slow`` run first. pytest-xdist deals the first quarter of the tests out
one by one, in turn, to its workers, and then hands out the rest as workers free up:
with the long tests at the front, each worker gets its share of them at the start, and
the run ends with short tests on every worker instead of one worker still running a
long test while the other has nothing left.
"""

import atexit
import os
import shutil
import tempfile

import jax

NUM_CPU_DEVICES = 8

# The script that wrote the schedule CSVs of tests/runtime/fixtures imports torch, which
# is no test dependency: it is run by hand, never collected (nor its doctests).
collect_ignore = ["tests/runtime/fixtures/torch_schedules.py"]

jax.config.update("jax_enable_checks", True)
jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)

if jax.default_backend() == "cpu":
    # Many tests compile the same programs (the same example model, split the same way,
    # in several tests): a compilation cache of this test process, kept on disk for the
    # session only, compiles each once. XLA's CPU compiler is most of the suite's time;
    # measured on three test files with -n 2: 50 s without it, 43-45 s with it (a
    # directory shared by the workers: 52 s, JAX then locks it for every read and
    # write). One directory per process: no two processes write one cache. The programs
    # are the same, so are their results. Not on an accelerator: there every program,
    # however small, would be serialized to disk, which cost more than it saved (TPU).
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="pipemark-tests-xla-")
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, True)
    jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
else:
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_report_header(config):
    """Which JAX and which devices the run is on (the same suite runs on the CPU and,
    ``make test-tpu``, on an accelerator), and the XLA flags (``make test XLA_ISA=AVX2``
    pins the CPU code to a lower instruction set: tests/_exact.py)."""
    return (
        f"jax {jax.__version__}: default backend {jax.default_backend()} "
        f"({jax.device_count()} devices: {jax.devices()[0].device_kind}), host CPU "
        f"{len(jax.devices('cpu'))} devices, matmul precision "
        f"{jax.config.jax_default_matmul_precision or 'default'}, XLA_FLAGS "
        f"{os.environ.get('XLA_FLAGS') or '(none)'}"
    )


def _covering(cases: list) -> list:
    """Of one test function's parametrized ``cases``, in their collected order: each
    case that has a parameter value no case kept before it had. Every value of every
    parameter runs once, not every combination."""
    seen: set = set()
    kept = []
    for item in cases:
        values = {(name, repr(value)) for name, value in item.callspec.params.items()}
        if not values <= seen:
            kept.append(item)
            seen |= values
    return kept


def _fewest_processes(cases: list) -> list:
    """Of a test function parametrized over ``num_processes``, the cases with the
    fewest: the runs in more processes (4, against 2) check the same runtime on the same
    JAX with more of the host's cores than it has, at twice the time."""
    counts = [item.callspec.params.get("num_processes") for item in cases]
    if None in counts:
        return cases
    return [item for item, n in zip(cases, counts) if n == min(counts)]


def _cover_cases(config, items) -> None:
    """With ``PIPEMARK_CASES=cover`` (``make test-newest``: CI time), a test function
    with 4 or more parametrized cases runs :func:`_covering`'s, and one parametrized
    over ``num_processes`` its :func:`_fewest_processes`; ``make test`` runs them all."""
    groups: dict = {}
    for item in items:
        if getattr(item, "callspec", None) is not None:
            groups.setdefault((item.path, item.originalname), []).append(item)
    dropped = set()
    for cases in groups.values():
        kept = _fewest_processes(cases)
        if len(kept) >= 4:
            kept = _covering(kept)
        dropped.update(id(item) for item in cases if item not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]


def pytest_collection_modifyitems(config, items):
    """The ``slow`` tests first, those marked ``slow(first=True)`` (a script whose
    output other tests read) before the others; each group in its collected order.
    ``PIPEMARK_CASES=cover``: of each large parametrized matrix, the cases that run
    every parameter value once (:func:`_cover_cases`)."""
    if os.environ.get("PIPEMARK_CASES") == "cover":
        _cover_cases(config, items)

    def rank(item):
        slow = item.get_closest_marker("slow")
        if slow is None:
            return 2
        return 0 if slow.kwargs.get("first") else 1

    items.sort(key=rank)
