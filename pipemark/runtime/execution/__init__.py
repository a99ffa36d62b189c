"""A plan run: each device's column of the schedule dispatched, values moved and
results accumulated (``run``), a traced call as a Perfetto trace (``perfetto``),
and the programs a call dispatches written as an export (``plan_export``).

The package hands on the names of ``run``, which was the module
``pipemark.runtime.execution``: ``from pipemark.runtime.execution import run_plan``
reads as it did.
"""

from pipemark.runtime.execution.run import STRATEGIES as STRATEGIES
from pipemark.runtime.execution.run import ActionRecord as ActionRecord
from pipemark.runtime.execution.run import Placed as Placed
from pipemark.runtime.execution.run import action_costs as action_costs
from pipemark.runtime.execution.run import out_of_memory as out_of_memory
from pipemark.runtime.execution.run import run_plan as run_plan
from pipemark.runtime.execution.run import split_leaf as split_leaf

__all__ = ["STRATEGIES", "ActionRecord", "action_costs", "out_of_memory", "run_plan", "split_leaf"]
