"""Test-suite settings for tests/ and the doctests in pipemark/.

JAX checks every jaxpr it builds and runs (``jax_enable_checks``), and every pipemark
pass checks the jaxprs it returns (:func:`pipemark.passes.framework.jaxpr_pass`), so
a pass that builds an ill-typed program fails where it builds it.

The host CPU platform has 8 devices (``jax_num_cpu_devices``), so multi-device pipelines
(4 stages, 2x2x2 meshes) run in the test process itself. JAX reads the setting only when
it starts its CPU backend, so it is set here, before any test or doctest runs a JAX
operation; pytest imports this file in every pytest-xdist worker too. Tests that need
one device ask for ``jax.devices()[:1]``. Real multi-process runs
(tests/runtime/test_distributed.py, tests/test_launch.py) start their own processes.
"""

import jax

NUM_CPU_DEVICES = 8

jax.config.update("jax_enable_checks", True)
jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
