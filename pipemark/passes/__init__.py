"""Passes over closed jaxprs that insert, slice and rewrite pipeline markers.

Every pass is a pure function: it returns a new jaxpr (or a staged program) that passes
``jax.extend.core.check_jaxpr`` and leaves its input untouched.
"""
