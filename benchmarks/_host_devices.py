"""Host CPU devices for the benchmarks that time a pipeline on them (runtime.py,
submesh.py, reduction_overlap.py).

>>> import os
>>> before = os.environ.get("XLA_FLAGS")
>>> use_host_devices(4, environ=(env := {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}))
>>> env["XLA_FLAGS"]
'--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false'
>>> os.environ.get("XLA_FLAGS") == before
True
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping


def use_host_devices(num_devices: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Add to ``XLA_FLAGS`` (``os.environ``'s by default) ``num_devices`` host devices,
    each computing on one thread, so that devices, not intra-op thread pools, share the
    cores. It must run before JAX starts its backend; flags already set are kept."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={num_devices} "
        "--xla_cpu_multi_thread_eigen=false"
    ).strip()
