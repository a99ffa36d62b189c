"""pipemark: pipeline-stage markers for JAX jaxprs.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> def f(x):
...     x = pm.mark(x, name="layer0", mark_type="start")
...     return pm.mark(jnp.sin(x), name="layer0", mark_type="end")
>>> float(jax.grad(f)(0.0))
1.0
"""

from pipemark.errors import MarkerError as MarkerError
from pipemark.errors import PipemarkError as PipemarkError
from pipemark.errors import StageGraphError as StageGraphError
from pipemark.lowering import LOWERING_MODES as LOWERING_MODES
from pipemark.lowering import get_lowering as get_lowering
from pipemark.lowering import lowering as lowering
from pipemark.lowering import set_lowering as set_lowering
from pipemark.primitive import MARK_TYPES as MARK_TYPES
from pipemark.primitive import flatten_shape_byte_sizes as flatten_shape_byte_sizes
from pipemark.primitive import is_marker as is_marker
from pipemark.primitive import mark as mark
from pipemark.primitive import mark_gradient as mark_gradient
from pipemark.primitive import mark_hook_jaxpreqn as mark_hook_jaxpreqn
from pipemark.primitive import mark_pipeline_boundary as mark_pipeline_boundary
from pipemark.primitive import mark_pipeline_jaxpreqn as mark_pipeline_jaxpreqn
from pipemark.primitive import pipeline_p as pipeline_p

__version__ = "0.1.0"
