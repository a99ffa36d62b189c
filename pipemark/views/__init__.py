"""Looking at a staged program: a text table, the inputs and module ends of each stage,
and an HTML view for notebooks and reports.

Everything is a thin layer over the same rows (:func:`stage_rows`, in
:mod:`pipemark.views.rows`): :mod:`pipemark.views.text` renders them as plain text or
with ``rich``; :mod:`pipemark.views.html_view` renders them, and the program, as HTML.
:func:`pipemark.show` slices a program and returns its HTML view.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))
>>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
>>> [row.name for row in stage_rows(staged)[0]]
['stage0', 'stage1']
"""

from pipemark.views.html_view import HTMLView as HTMLView
from pipemark.views.html_view import to_html as to_html
from pipemark.views.html_view import write_report as write_report
from pipemark.views.rows import StageRow as StageRow
from pipemark.views.rows import display_name as display_name
from pipemark.views.rows import format_bytes as format_bytes
from pipemark.views.rows import format_count as format_count
from pipemark.views.rows import parameter_inputs as parameter_inputs
from pipemark.views.rows import stage_colors as stage_colors
from pipemark.views.rows import stage_rows as stage_rows
from pipemark.views.text import STYLES as STYLES
from pipemark.views.text import print_stage_inputs as print_stage_inputs
from pipemark.views.text import print_summary as print_summary
from pipemark.views.text import stage_ends as stage_ends
from pipemark.views.text import stage_inputs as stage_inputs
from pipemark.views.text import summary as summary
