"""Run staged programs on several devices: pipeline schedules as data
(:mod:`pipemark.runtime.schedules`, :mod:`pipemark.runtime.zero_bubble`,
:mod:`pipemark.runtime.dualpipe`; read from and written to
``torch.distributed.pipelining``'s CSV by :mod:`pipemark.runtime.schedule_csv`), built for a
:class:`ScheduleProblem` by builders named in one registry
(:mod:`pipemark.runtime.registry`), their simulation
(:mod:`pipemark.runtime.simulation`) and plots (:mod:`pipemark.runtime.plot`), and
:func:`pipeline_value_and_grad` (:mod:`pipemark.runtime.pipeline`) and
:func:`pipeline_train_step` (:mod:`pipemark.runtime.train_step`), which plan (:mod:`pipemark.runtime.plan`) and run
(:mod:`pipemark.runtime.execution`) a pipeline with :class:`PipelineOptions`; and the
layout planner for a cluster you do not have (:mod:`pipemark.runtime.planner`, with
:mod:`pipemark.runtime.cluster` and :mod:`pipemark.runtime.workload`), which predicts
step time and memory with the same simulation. :func:`stage_devices`
(:mod:`pipemark.runtime.processes`) chooses the stages' devices across processes.
"""

from pipemark.runtime.cluster import TPU_V5E_POD as TPU_V5E_POD
from pipemark.runtime.cluster import Cluster as Cluster
from pipemark.runtime.cluster import tpu_v5e as tpu_v5e
from pipemark.runtime.dualpipe import dualpipev_schedule as dualpipev_schedule
from pipemark.runtime.memory import MemoryEstimate as MemoryEstimate
from pipemark.runtime.memory import SlotMemory as SlotMemory
from pipemark.runtime.options import PipelineOptions as PipelineOptions
from pipemark.runtime.pipeline import LOSS_REDUCTIONS as LOSS_REDUCTIONS
from pipemark.runtime.pipeline import Pipeline as Pipeline
from pipemark.runtime.pipeline import pipeline_value_and_grad as pipeline_value_and_grad
from pipemark.runtime.plan import PipelinePlan as PipelinePlan
from pipemark.runtime.planner import LayoutPrediction as LayoutPrediction
from pipemark.runtime.planner import Ranking as Ranking
from pipemark.runtime.planner import Refusal as Refusal
from pipemark.runtime.planner import predict_layout as predict_layout
from pipemark.runtime.planner import rank_layouts as rank_layouts
from pipemark.runtime.planner import search_layouts as search_layouts
from pipemark.runtime.plot import plot_schedule as plot_schedule
from pipemark.runtime.problem import ScheduleProblem as ScheduleProblem
from pipemark.runtime.processes import stage_devices as stage_devices
from pipemark.runtime.registry import SCHEDULES as SCHEDULES
from pipemark.runtime.registry import ZERO_BUBBLE_VARIANTS as ZERO_BUBBLE_VARIANTS
from pipemark.runtime.registry import ScheduleEntry as ScheduleEntry
from pipemark.runtime.registry import build_schedule as build_schedule
from pipemark.runtime.registry import make_schedule as make_schedule
from pipemark.runtime.registry import register_schedule as register_schedule
from pipemark.runtime.registry import schedule_entry as schedule_entry
from pipemark.runtime.registry import unregister_schedule as unregister_schedule
from pipemark.runtime.schedule_csv import schedule_from_csv as schedule_from_csv
from pipemark.runtime.schedules import BACKWARD as BACKWARD
from pipemark.runtime.schedules import FORWARD as FORWARD
from pipemark.runtime.schedules import WEIGHT as WEIGHT
from pipemark.runtime.schedules import Action as Action
from pipemark.runtime.schedules import Schedule as Schedule
from pipemark.runtime.schedules import gpipe_schedule as gpipe_schedule
from pipemark.runtime.schedules import ideal_bubble_fraction as ideal_bubble_fraction
from pipemark.runtime.schedules import interleaved_schedule as interleaved_schedule
from pipemark.runtime.schedules import one_f_one_b_schedule as one_f_one_b_schedule
from pipemark.runtime.schedules import schedule_from_orders as schedule_from_orders
from pipemark.runtime.simulation import Simulation as Simulation
from pipemark.runtime.simulation import simulate_schedule as simulate_schedule
from pipemark.runtime.train_step import PipelinedStep as PipelinedStep
from pipemark.runtime.train_step import pipeline_train_step as pipeline_train_step
from pipemark.runtime.workload import Layout as Layout
from pipemark.runtime.workload import MeasuredPipeline as MeasuredPipeline
from pipemark.runtime.workload import StageWork as StageWork
from pipemark.runtime.workload import Transformer as Transformer
from pipemark.runtime.zero_bubble import build_zero_bubble as build_zero_bubble
from pipemark.runtime.zero_bubble import zero_bubble_schedule as zero_bubble_schedule
