"""Pipeline schedules as data, and what needs nothing but a schedule: the
:class:`Schedule` grid, its actions and the classic builders (``core``), what a
builder is given (``problem``), the zero-bubble and DualPipeV builders
(``zero_bubble``, ``dualpipe``), the one registry of schedule names
(``registry``), ``torch.distributed.pipelining``'s CSV (``csv_cells``,
``schedule_csv``), the simulation (``simulation``) and plots (``plot``).
Nothing here knows devices, JAX programs or a plan.

The package hands on the names of ``core``, which was the module
``pipemark.runtime.schedules``: ``from pipemark.runtime.schedules import gpipe_schedule``
reads as it did.
"""

from pipemark.runtime.schedules.core import BACKWARD as BACKWARD
from pipemark.runtime.schedules.core import FORWARD as FORWARD
from pipemark.runtime.schedules.core import WEIGHT as WEIGHT
from pipemark.runtime.schedules.core import Action as Action
from pipemark.runtime.schedules.core import Schedule as Schedule
from pipemark.runtime.schedules.core import check_schedule_fits as check_schedule_fits
from pipemark.runtime.schedules.core import crossings as crossings
from pipemark.runtime.schedules.core import dependencies as dependencies
from pipemark.runtime.schedules.core import gpipe_schedule as gpipe_schedule
from pipemark.runtime.schedules.core import ideal_bubble_fraction as ideal_bubble_fraction
from pipemark.runtime.schedules.core import in_waves as in_waves
from pipemark.runtime.schedules.core import interleaved_schedule as interleaved_schedule
from pipemark.runtime.schedules.core import normalize_stage_graph as normalize_stage_graph
from pipemark.runtime.schedules.core import one_f_one_b_schedule as one_f_one_b_schedule
from pipemark.runtime.schedules.core import schedule_from_orders as schedule_from_orders
from pipemark.runtime.schedules.core import stage_successors as stage_successors

__all__ = [
    "FORWARD",
    "BACKWARD",
    "WEIGHT",
    "Action",
    "Schedule",
    "schedule_from_orders",
    "gpipe_schedule",
    "one_f_one_b_schedule",
    "interleaved_schedule",
    "check_schedule_fits",
    "ideal_bubble_fraction",
    "in_waves",
]
