"""pipemark: pipeline-stage markers for JAX jaxprs.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> def f(x):
...     x = pm.mark(x, name="layer0", mark_type="start")
...     return pm.mark(jnp.sin(x), name="layer0", mark_type="end")
>>> float(jax.grad(f)(0.0))
1.0
"""

from pipemark import passes as passes
from pipemark import views as views
from pipemark.caches import clear_caches as clear_caches
from pipemark.cost import Cost as Cost
from pipemark.cost import estimate_cost as estimate_cost
from pipemark.errors import MarkerError as MarkerError
from pipemark.errors import PipemarkError as PipemarkError
from pipemark.errors import PipemarkWarning as PipemarkWarning
from pipemark.errors import StageGraphError as StageGraphError
from pipemark.graph import critical_path as critical_path
from pipemark.graph import eqn_graph as eqn_graph
from pipemark.graph import stage_graph as stage_graph
from pipemark.graph import topological_order as topological_order
from pipemark.lowering import LOWERING_MODES as LOWERING_MODES
from pipemark.lowering import get_lowering as get_lowering
from pipemark.lowering import lowering as lowering
from pipemark.lowering import set_lowering as set_lowering
from pipemark.marks import MARK_TYPES as MARK_TYPES
from pipemark.plot import plot as plot
from pipemark.primitive import flatten_shape_byte_sizes as flatten_shape_byte_sizes
from pipemark.primitive import is_marker as is_marker
from pipemark.primitive import mark as mark
from pipemark.primitive import mark_gradient as mark_gradient
from pipemark.primitive import mark_hook_jaxpreqn as mark_hook_jaxpreqn
from pipemark.primitive import mark_pipeline_boundary as mark_pipeline_boundary
from pipemark.primitive import mark_pipeline_jaxpreqn as mark_pipeline_jaxpreqn
from pipemark.primitive import pipeline_p as pipeline_p
from pipemark.runtime import Action as Action
from pipemark.runtime import Pipeline as Pipeline
from pipemark.runtime import Schedule as Schedule
from pipemark.runtime import gpipe_schedule as gpipe_schedule
from pipemark.runtime import ideal_bubble_fraction as ideal_bubble_fraction
from pipemark.runtime import interleaved_schedule as interleaved_schedule
from pipemark.runtime import make_schedule as make_schedule
from pipemark.runtime import one_f_one_b_schedule as one_f_one_b_schedule
from pipemark.runtime import pipeline_train_step as pipeline_train_step
from pipemark.runtime import pipeline_value_and_grad as pipeline_value_and_grad
from pipemark.runtime import plot_schedule as plot_schedule
from pipemark.runtime import schedule_from_orders as schedule_from_orders
from pipemark.signature import Signature as Signature
from pipemark.signature import SignatureError as SignatureError
from pipemark.staged import Stage as Stage
from pipemark.staged import StagedJaxpr as StagedJaxpr
from pipemark.staging import show as show
from pipemark.staging import split as split
from pipemark.staging import split_jaxpr as split_jaxpr
from pipemark.views import summary as summary
from pipemark.views import write_report as write_report

__version__ = "0.1.0"
