"""Passes over closed jaxprs that insert, slice and rewrite pipeline markers.

Every pass is a pure function: it returns a new jaxpr (or a staged program) that passes
``jax.extend.core.check_jaxpr`` and leaves its input untouched.
"""

from pipemark.passes.auto import auto_layers as auto_layers
from pipemark.passes.auto import balanced_cuts as balanced_cuts
from pipemark.passes.auto import plan_layers as plan_layers
from pipemark.passes.backward_split import split_backward as split_backward
from pipemark.passes.gradient import apply_start as apply_start
from pipemark.passes.gradient import mark_apply_stage as mark_apply_stage
from pipemark.passes.gradient import split_at_gradient as split_at_gradient
from pipemark.passes.inline import inline_calls as inline_calls
from pipemark.passes.insert import insert_markers as insert_markers
from pipemark.passes.insert import insert_markers_by_scope as insert_markers_by_scope
from pipemark.passes.insert import layers_from_boundaries as layers_from_boundaries
from pipemark.passes.residuals import recompute_residuals as recompute_residuals
from pipemark.passes.rewrite import dce as dce
from pipemark.passes.rewrite import mark_missing_vars as mark_missing_vars
from pipemark.passes.rewrite import remove_markers as remove_markers
from pipemark.passes.scan import layers_from_scans as layers_from_scans
from pipemark.passes.scan import split_scan as split_scan
from pipemark.passes.slice import slice_stages as slice_stages
from pipemark.passes.stages import consecutive_layers as consecutive_layers
from pipemark.passes.stages import merge_consecutive as merge_consecutive
from pipemark.passes.stages import merge_stages as merge_stages
from pipemark.passes.stages import pair_stages as pair_stages
from pipemark.passes.stages import rename_stages as rename_stages
