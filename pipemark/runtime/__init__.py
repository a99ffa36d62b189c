"""Run staged programs on several devices. The runtime's rooms, in the order data flows
through them:

- ``schedules/``: pipeline schedules as data (:class:`Schedule`, :class:`Action`, the
  GPipe, 1F1B, interleaved, zero-bubble and DualPipeV builders), what a builder is given
  (:class:`ScheduleProblem`), the one registry of schedule names
  (:func:`register_schedule`, :func:`build_schedule`), ``torch.distributed.pipelining``'s
  CSV (:func:`schedule_from_csv`), their simulation (:func:`simulate_schedule`) and plots.
- ``planning/``: the layout planner for a cluster you do not have (:func:`predict_layout`,
  :func:`rank_layouts`, :class:`Cluster`, :class:`Transformer`), which predicts step time
  and memory with the same simulation.
- here, what a user passes and how a pipeline is planned: :class:`PipelineOptions`
  (``options``), a loss's arguments and reductions (``arguments``, ``losses``), one
  microbatch traced (``tracing``), cut into pipeline stages (``pipeline_stages``) and
  scheduled (``scheduling``).
- ``devices/``: what runs where: device slots and sub-meshes, each stage program
  compiled for its slot, the steps each worker runs, and the transports between slots and
  processes (:func:`stage_devices` chooses devices across processes); from these the
  plan is made (``plan``: :class:`PipelinePlan`).
- ``memory/``: what a plan holds on each device, predicted (:class:`MemoryEstimate`), and a
  plan within a memory budget.
- ``execution/``: a plan run, traced (Perfetto) and exported.
- ``training/``: a training step's update after its pipeline, and the state it keeps
  between calls and checkpoints.
- here, the entry points: :func:`pipeline_value_and_grad` (``pipeline``) and
  :func:`pipeline_train_step` (``train_step``), and what both do around a call (``calls``).

A module's path from before the rooms (``pipemark.runtime.zero_bubble``, say) still
imports, with a ``DeprecationWarning`` naming its new path (``_old_paths``; CHANGELOG.md
lists them).
"""

from pipemark.runtime import _old_paths
from pipemark.runtime.devices.processes import stage_devices as stage_devices
from pipemark.runtime.memory.estimate import MemoryEstimate as MemoryEstimate
from pipemark.runtime.memory.estimate import SlotMemory as SlotMemory
from pipemark.runtime.options import PipelineOptions as PipelineOptions
from pipemark.runtime.pipeline import LOSS_REDUCTIONS as LOSS_REDUCTIONS
from pipemark.runtime.pipeline import Pipeline as Pipeline
from pipemark.runtime.pipeline import pipeline_value_and_grad as pipeline_value_and_grad
from pipemark.runtime.plan import PipelinePlan as PipelinePlan
from pipemark.runtime.planning.cluster import TPU_V5E_POD as TPU_V5E_POD
from pipemark.runtime.planning.cluster import Cluster as Cluster
from pipemark.runtime.planning.cluster import h100 as h100
from pipemark.runtime.planning.cluster import tpu_v5e as tpu_v5e
from pipemark.runtime.planning.cluster import tpu_v5p as tpu_v5p
from pipemark.runtime.planning.cluster import tpu_v6e as tpu_v6e
from pipemark.runtime.planning.planner import LayoutPrediction as LayoutPrediction
from pipemark.runtime.planning.planner import Ranking as Ranking
from pipemark.runtime.planning.planner import Refusal as Refusal
from pipemark.runtime.planning.planner import predict_layout as predict_layout
from pipemark.runtime.planning.planner import rank_layouts as rank_layouts
from pipemark.runtime.planning.planner import search_layouts as search_layouts
from pipemark.runtime.planning.workload import Layout as Layout
from pipemark.runtime.planning.workload import MeasuredPipeline as MeasuredPipeline
from pipemark.runtime.planning.workload import StageWork as StageWork
from pipemark.runtime.planning.workload import Transformer as Transformer
from pipemark.runtime.schedules.core import BACKWARD as BACKWARD
from pipemark.runtime.schedules.core import FORWARD as FORWARD
from pipemark.runtime.schedules.core import WEIGHT as WEIGHT
from pipemark.runtime.schedules.core import Action as Action
from pipemark.runtime.schedules.core import Schedule as Schedule
from pipemark.runtime.schedules.core import gpipe_schedule as gpipe_schedule
from pipemark.runtime.schedules.core import ideal_bubble_fraction as ideal_bubble_fraction
from pipemark.runtime.schedules.core import interleaved_schedule as interleaved_schedule
from pipemark.runtime.schedules.core import one_f_one_b_schedule as one_f_one_b_schedule
from pipemark.runtime.schedules.core import schedule_from_orders as schedule_from_orders
from pipemark.runtime.schedules.dualpipe import dualpipev_schedule as dualpipev_schedule
from pipemark.runtime.schedules.plot import plot_schedule as plot_schedule
from pipemark.runtime.schedules.problem import ScheduleProblem as ScheduleProblem
from pipemark.runtime.schedules.registry import SCHEDULES as SCHEDULES
from pipemark.runtime.schedules.registry import ZERO_BUBBLE_VARIANTS as ZERO_BUBBLE_VARIANTS
from pipemark.runtime.schedules.registry import ScheduleEntry as ScheduleEntry
from pipemark.runtime.schedules.registry import build_schedule as build_schedule
from pipemark.runtime.schedules.registry import make_schedule as make_schedule
from pipemark.runtime.schedules.registry import register_schedule as register_schedule
from pipemark.runtime.schedules.registry import schedule_entry as schedule_entry
from pipemark.runtime.schedules.registry import unregister_schedule as unregister_schedule
from pipemark.runtime.schedules.schedule_csv import schedule_from_csv as schedule_from_csv
from pipemark.runtime.schedules.simulation import Simulation as Simulation
from pipemark.runtime.schedules.simulation import simulate_schedule as simulate_schedule
from pipemark.runtime.schedules.zero_bubble import build_zero_bubble as build_zero_bubble
from pipemark.runtime.schedules.zero_bubble import zero_bubble_schedule as zero_bubble_schedule
from pipemark.runtime.train_step import PipelinedStep as PipelinedStep
from pipemark.runtime.train_step import pipeline_train_step as pipeline_train_step

# Old module paths keep importing (and reading as attributes), with a warning.
_old_paths.install()
__getattr__ = _old_paths.old_module
