"""pipemark: pipeline-stage markers for JAX jaxprs.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> def f(x):
...     x = pm.mark(x, name="layer0", mark_type="start")
...     return pm.mark(jnp.sin(x), name="layer0", mark_type="end")
>>> float(jax.grad(f)(0.0))
1.0
"""

import sys
import types

from pipemark.rendering import views_in as _views_in

# The public names, each loaded from its module on first use (PEP 562): `import
# pipemark` itself imports nothing but the views' registry (pipemark.rendering, a few
# lines of plain Python), so the command line answers `--help` and `--version` without
# importing JAX. Name -> (module, attribute), or (module, None) for a module.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "Action": ("pipemark.runtime", "Action"),
    "Cluster": ("pipemark.runtime", "Cluster"),
    "Layout": ("pipemark.runtime", "Layout"),
    "LayoutPrediction": ("pipemark.runtime", "LayoutPrediction"),
    "MeasuredPipeline": ("pipemark.runtime", "MeasuredPipeline"),
    "predict_layout": ("pipemark.runtime", "predict_layout"),
    "rank_layouts": ("pipemark.runtime", "rank_layouts"),
    "search_layouts": ("pipemark.runtime", "search_layouts"),
    "tpu_v5e": ("pipemark.runtime", "tpu_v5e"),
    "Transformer": ("pipemark.runtime", "Transformer"),
    "clear_caches": ("pipemark.caches", "clear_caches"),
    "Cost": ("pipemark.cost", "Cost"),
    "critical_path": ("pipemark.graph", "critical_path"),
    "eqn_graph": ("pipemark.graph", "eqn_graph"),
    "estimate_cost": ("pipemark.cost", "estimate_cost"),
    "ExportedStages": ("pipemark.exported", "ExportedStages"),
    "ExportError": ("pipemark.errors", "ExportError"),
    "flatten_shape_byte_sizes": ("pipemark.cost", "flatten_shape_byte_sizes"),
    "get_lowering": ("pipemark.lowering", "get_lowering"),
    "gpipe_schedule": ("pipemark.runtime", "gpipe_schedule"),
    "ideal_bubble_fraction": ("pipemark.runtime", "ideal_bubble_fraction"),
    "interleaved_schedule": ("pipemark.runtime", "interleaved_schedule"),
    "is_marker": ("pipemark.primitive", "is_marker"),
    "load_staged": ("pipemark.exported", "load_staged"),
    "lowering": ("pipemark.lowering", "lowering"),
    "LOWERING_MODES": ("pipemark.lowering", "LOWERING_MODES"),
    "make_schedule": ("pipemark.runtime", "make_schedule"),
    "mark": ("pipemark.primitive", "mark"),
    "mark_gradient": ("pipemark.primitive", "mark_gradient"),
    "mark_hook_jaxpreqn": ("pipemark.primitive", "mark_hook_jaxpreqn"),
    "mark_pipeline_boundary": ("pipemark.primitive", "mark_pipeline_boundary"),
    "mark_pipeline_jaxpreqn": ("pipemark.primitive", "mark_pipeline_jaxpreqn"),
    "MARK_TYPES": ("pipemark.marks", "MARK_TYPES"),
    "MarkerError": ("pipemark.errors", "MarkerError"),
    "MemoryEstimate": ("pipemark.runtime", "MemoryEstimate"),
    "one_f_one_b_schedule": ("pipemark.runtime", "one_f_one_b_schedule"),
    "passes": ("pipemark.passes", None),
    "Pipeline": ("pipemark.runtime", "Pipeline"),
    "pipeline_p": ("pipemark.primitive", "pipeline_p"),
    "pipeline_train_step": ("pipemark.runtime", "pipeline_train_step"),
    "pipeline_value_and_grad": ("pipemark.runtime", "pipeline_value_and_grad"),
    "PipemarkError": ("pipemark.errors", "PipemarkError"),
    "PipemarkWarning": ("pipemark.errors", "PipemarkWarning"),
    "plot": ("pipemark.plot", "plot"),
    "plot_schedule": ("pipemark.runtime", "plot_schedule"),
    "register_schedule": ("pipemark.runtime", "register_schedule"),
    "Schedule": ("pipemark.runtime", "Schedule"),
    "ScheduleEntry": ("pipemark.runtime", "ScheduleEntry"),
    "ScheduleProblem": ("pipemark.runtime", "ScheduleProblem"),
    "schedule_from_csv": ("pipemark.runtime", "schedule_from_csv"),
    "schedule_from_orders": ("pipemark.runtime", "schedule_from_orders"),
    "simulate_schedule": ("pipemark.runtime", "simulate_schedule"),
    "zero_bubble_schedule": ("pipemark.runtime", "zero_bubble_schedule"),
    "set_lowering": ("pipemark.lowering", "set_lowering"),
    "show": ("pipemark.staging", "show"),
    "Signature": ("pipemark.signature", "Signature"),
    "SignatureError": ("pipemark.signature", "SignatureError"),
    "split": ("pipemark.staging", "split"),
    "split_jaxpr": ("pipemark.staging", "split_jaxpr"),
    "Stage": ("pipemark.staged", "Stage"),
    "stage_graph": ("pipemark.graph", "stage_graph"),
    "StagedJaxpr": ("pipemark.staged", "StagedJaxpr"),
    "StageRole": ("pipemark.roles", "StageRole"),
    "StageGraphError": ("pipemark.errors", "StageGraphError"),
    "StateMutationError": ("pipemark.mutation", "StateMutationError"),
    "ProcessError": ("pipemark.errors", "ProcessError"),
    "MemoryBudgetError": ("pipemark.errors", "MemoryBudgetError"),
    "DeviceOutOfMemory": ("pipemark.errors", "DeviceOutOfMemory"),
    "runtime": ("pipemark.runtime", None),
    "summary": ("pipemark.views", "summary"),
    "topological_order": ("pipemark.graph", "topological_order"),
    "verification": ("pipemark.verification", None),
    "VerificationError": ("pipemark.verification", "VerificationError"),
    "VerifyReport": ("pipemark.verification", "VerifyReport"),
    "views": ("pipemark.views", None),
    "write_report": ("pipemark.views", "write_report"),
}

# The views (pipemark.views: tables, HTML) register how a staged program is drawn when
# they are imported; its summary(), str() and notebook view import them on first use
# (pipemark.rendering). Neither module imports JAX.
_views_in("pipemark.views")

__version__ = "0.1.0"
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'pipemark' has no attribute {name!r}") from None
    import importlib

    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """Importing a submodule sets it as an attribute of its package; where a public
    name is a function of a module of the same name (``pm.lowering``, ``pm.plot``),
    the function keeps the name."""

    def __setattr__(self, name: str, value: object) -> None:
        export = _EXPORTS.get(name)
        if export is not None and export[1] is not None and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
