"""Test-suite settings for tests/ and the doctests in pipemark/.

JAX checks every jaxpr it builds and runs (``jax_enable_checks``), and every pipemark
pass checks the jaxprs it returns (:func:`pipemark.passes.framework.jaxpr_pass`), so
a pass that builds an ill-typed program fails where it builds it.
"""

import jax

jax.config.update("jax_enable_checks", True)
