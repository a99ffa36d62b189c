"""Plan a training step for a cluster you do not have: the layout planner's public
names in one place (``pm.planner``), apart from what runs a pipeline (``pm.runtime``).

Describe the hardware (:class:`Cluster`, or a preset from vendors' specifications:
:func:`tpu_v5e`, :func:`tpu_v5p`, :func:`tpu_v6e`, :func:`h100`) and the model
(:class:`Transformer` from its sizes, or :class:`MeasuredPipeline` from a real
pipeline's measured action costs); :func:`predict_layout` predicts one
:class:`Layout`'s step time and per-chip peak memory (a :class:`LayoutPrediction`),
and :func:`rank_layouts` / :func:`search_layouts` predict a search space, refuse the
layouts that do not fit (:class:`Refusal`) and rank the rest (:class:`Ranking`).
docs/scale.md is the guide.

>>> import pipemark as pm
>>> layout = pm.planner.Layout(pp=4, fsdp=64, microbatches=16, remat=True)
>>> model, cluster = pm.planner.Transformer.llama2_7b(), pm.planner.tpu_v5e(256)
>>> p = pm.planner.predict_layout(model, layout, cluster, global_batch=1024)
>>> p.fits, round(p.step_seconds, 1)
(True, 7.9)
"""

# The planner lives in pipemark.runtime (it predicts with the runtime's schedules and
# simulation); these are the names its package exports, re-exported under one name.
from pipemark.runtime import (
    TPU_V5E_POD,
    Cluster,
    Layout,
    LayoutPrediction,
    MeasuredPipeline,
    Ranking,
    Refusal,
    StageWork,
    Transformer,
    h100,
    predict_layout,
    rank_layouts,
    search_layouts,
    tpu_v5e,
    tpu_v5p,
    tpu_v6e,
)

__all__ = [
    # the hardware
    "Cluster",
    "TPU_V5E_POD",
    "tpu_v5e",
    "tpu_v5p",
    "tpu_v6e",
    "h100",
    # the model and how it is laid out
    "Layout",
    "MeasuredPipeline",
    "StageWork",
    "Transformer",
    # predictions
    "LayoutPrediction",
    "Ranking",
    "Refusal",
    "predict_layout",
    "rank_layouts",
    "search_layouts",
]
