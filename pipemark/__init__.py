"""pipemark: pipeline-stage markers for JAX jaxprs.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> def f(x):
...     x = pm.mark(x, name="layer0", mark_type="start")
...     return pm.mark(jnp.sin(x), name="layer0", mark_type="end")
>>> float(jax.grad(f)(0.0))
1.0

The top-level names, by task:

- **Mark** a program: :func:`~pipemark.mark`, :func:`~pipemark.mark_gradient`,
  :func:`~pipemark.mark_pipeline_boundary`, :func:`~pipemark.mark_pipeline_jaxpreqn`,
  :func:`~pipemark.mark_hook_jaxpreqn`, :data:`~pipemark.pipeline_p`; how markers
  lower: :func:`~pipemark.lowering`, :func:`~pipemark.set_lowering`.
- **Split and check**: :func:`~pipemark.split`, :func:`~pipemark.split_jaxpr`,
  :class:`~pipemark.StagedJaxpr` (its ``verify`` returns a
  :class:`~pipemark.VerifyReport`), :func:`~pipemark.load_staged` (an exported
  program), :func:`~pipemark.flatten_shape_byte_sizes`.
- **Passes**: :mod:`~pipemark.passes`, the pass library (``pm.passes.insert_markers``
  ...).
- **Run and train** on several devices: :func:`~pipemark.pipeline_value_and_grad` (a
  :class:`~pipemark.Pipeline`), :func:`~pipemark.pipeline_train_step` (a
  :class:`~pipemark.PipelinedStep`), :class:`~pipemark.PipelineOptions`.
- **Schedules**: :func:`~pipemark.make_schedule` (by name: ``"gpipe"``, ``"1f1b"``,
  ``"zb-h1"``, ``"dualpipev"`` ...), :class:`~pipemark.Schedule`,
  :class:`~pipemark.Action`, :func:`~pipemark.simulate_schedule`; the builders
  (:func:`~pipemark.runtime.gpipe_schedule` ...
  :func:`~pipemark.runtime.dualpipev_schedule`) and the rest are in
  :mod:`~pipemark.runtime`.
- **Inspect**: :func:`~pipemark.show`, :func:`~pipemark.summary`,
  :func:`~pipemark.plot`, :func:`~pipemark.write_report`.
- **Errors**: :class:`~pipemark.PipemarkError` (every error pipemark raises on bad
  input), :class:`~pipemark.PipemarkWarning`, :class:`~pipemark.VerificationError`,
  :class:`~pipemark.MemoryBudgetError`, :class:`~pipemark.DeviceOutOfMemoryError`; all
  of them in :mod:`~pipemark.errors`.
- **Modules**: :mod:`~pipemark.runtime` (pipelines and schedules: every name),
  :mod:`~pipemark.planner` (the layout planner: ``pm.planner.predict_layout`` ...),
  :mod:`~pipemark.views` (tables and HTML), :mod:`~pipemark.errors`.
"""

import sys
import types

from pipemark.rendering import views_in as _views_in

# The public names, each loaded from its module on first use (PEP 562): `import
# pipemark` itself imports nothing but the views' registry (pipemark.rendering, a few
# lines of plain Python), so the command line answers `--help` and `--version` without
# importing JAX. Name -> (module, attribute), or (module, None) for a module. Grouped by
# what a program does with them, as the docstring above lists them; everything else is
# in the modules (pm.runtime, pm.planner, pm.passes, pm.views, pm.errors).
_EXPORTS: dict[str, tuple[str, str | None]] = {
    # Mark a program: where stages begin and end, and how markers lower to XLA.
    "mark": ("pipemark.primitive", "mark"),
    "mark_gradient": ("pipemark.primitive", "mark_gradient"),
    "mark_pipeline_boundary": ("pipemark.primitive", "mark_pipeline_boundary"),
    "mark_pipeline_jaxpreqn": ("pipemark.primitive", "mark_pipeline_jaxpreqn"),
    "mark_hook_jaxpreqn": ("pipemark.primitive", "mark_hook_jaxpreqn"),
    "pipeline_p": ("pipemark.primitive", "pipeline_p"),
    "lowering": ("pipemark.lowering", "lowering"),
    "set_lowering": ("pipemark.lowering", "set_lowering"),
    # Split and check: a marked program as stages, compared with jax.jit of the original.
    "split": ("pipemark.staging", "split"),
    "split_jaxpr": ("pipemark.staging", "split_jaxpr"),
    "StagedJaxpr": ("pipemark.staged", "StagedJaxpr"),
    "VerifyReport": ("pipemark.verification", "VerifyReport"),
    "load_staged": ("pipemark.exported", "load_staged"),
    "flatten_shape_byte_sizes": ("pipemark.cost", "flatten_shape_byte_sizes"),
    # The pass library: pure functions over jaxprs (insert, slice, merge, rewrite ...).
    "passes": ("pipemark.passes", None),
    # Run and train a pipeline on several devices.
    "pipeline_value_and_grad": ("pipemark.runtime", "pipeline_value_and_grad"),
    "pipeline_train_step": ("pipemark.runtime", "pipeline_train_step"),
    "Pipeline": ("pipemark.runtime", "Pipeline"),
    "PipelinedStep": ("pipemark.runtime", "PipelinedStep"),
    "PipelineOptions": ("pipemark.runtime", "PipelineOptions"),
    # Schedules: made by name (the builders, gpipe_schedule ..., are in pm.runtime).
    "make_schedule": ("pipemark.runtime", "make_schedule"),
    "Schedule": ("pipemark.runtime", "Schedule"),
    "Action": ("pipemark.runtime", "Action"),
    "simulate_schedule": ("pipemark.runtime", "simulate_schedule"),
    # Inspect a staged program: HTML, a text table, a figure, a report file.
    "show": ("pipemark.staging", "show"),
    "summary": ("pipemark.views", "summary"),
    "plot": ("pipemark.plot", "plot"),
    "write_report": ("pipemark.views", "write_report"),
    # Errors a program catches (all of them: pm.errors).
    "PipemarkError": ("pipemark.errors", "PipemarkError"),
    "PipemarkWarning": ("pipemark.errors", "PipemarkWarning"),
    "VerificationError": ("pipemark.errors", "VerificationError"),
    "MemoryBudgetError": ("pipemark.errors", "MemoryBudgetError"),
    "DeviceOutOfMemoryError": ("pipemark.errors", "DeviceOutOfMemoryError"),
    # Modules: the runtime's every name, the layout planner, the views, the errors.
    "runtime": ("pipemark.runtime", None),
    "planner": ("pipemark.planner", None),
    "views": ("pipemark.views", None),
    "errors": ("pipemark.errors", None),
}

# Names that were top-level before the surface above (CHANGELOG.md, "Top-level names"):
# each still resolves, to the same object, with a DeprecationWarning that names where it
# lives now. Name -> (module, attribute) as in _EXPORTS.
_MOVED: dict[str, tuple[str, str | None]] = {
    # the layout planner
    "Cluster": ("pipemark.planner", "Cluster"),
    "Layout": ("pipemark.planner", "Layout"),
    "LayoutPrediction": ("pipemark.planner", "LayoutPrediction"),
    "MeasuredPipeline": ("pipemark.planner", "MeasuredPipeline"),
    "predict_layout": ("pipemark.planner", "predict_layout"),
    "rank_layouts": ("pipemark.planner", "rank_layouts"),
    "search_layouts": ("pipemark.planner", "search_layouts"),
    "tpu_v5e": ("pipemark.planner", "tpu_v5e"),
    "Transformer": ("pipemark.planner", "Transformer"),
    # schedule builders and the runtime's helpers
    "gpipe_schedule": ("pipemark.runtime", "gpipe_schedule"),
    "one_f_one_b_schedule": ("pipemark.runtime", "one_f_one_b_schedule"),
    "interleaved_schedule": ("pipemark.runtime", "interleaved_schedule"),
    "zero_bubble_schedule": ("pipemark.runtime", "zero_bubble_schedule"),
    "ideal_bubble_fraction": ("pipemark.runtime", "ideal_bubble_fraction"),
    "MemoryEstimate": ("pipemark.runtime", "MemoryEstimate"),
    "plot_schedule": ("pipemark.runtime", "plot_schedule"),
    "register_schedule": ("pipemark.runtime", "register_schedule"),
    "ScheduleEntry": ("pipemark.runtime", "ScheduleEntry"),
    "ScheduleProblem": ("pipemark.runtime", "ScheduleProblem"),
    "schedule_from_csv": ("pipemark.runtime", "schedule_from_csv"),
    "schedule_from_orders": ("pipemark.runtime", "schedule_from_orders"),
    # errors, all in pipemark.errors
    "DeviceOutOfMemory": ("pipemark.errors", "DeviceOutOfMemoryError"),
    "ExportError": ("pipemark.errors", "ExportError"),
    "MarkerError": ("pipemark.errors", "MarkerError"),
    "ProcessError": ("pipemark.errors", "ProcessError"),
    "SignatureError": ("pipemark.errors", "SignatureError"),
    "StageGraphError": ("pipemark.errors", "StageGraphError"),
    "StateMutationError": ("pipemark.errors", "StateMutationError"),
    # helpers, in the module of their concept
    "clear_caches": ("pipemark.caches", "clear_caches"),
    "Cost": ("pipemark.cost", "Cost"),
    "estimate_cost": ("pipemark.cost", "estimate_cost"),
    "critical_path": ("pipemark.graph", "critical_path"),
    "eqn_graph": ("pipemark.graph", "eqn_graph"),
    "stage_graph": ("pipemark.graph", "stage_graph"),
    "topological_order": ("pipemark.graph", "topological_order"),
    "ExportedStages": ("pipemark.exported", "ExportedStages"),
    "get_lowering": ("pipemark.lowering", "get_lowering"),
    "LOWERING_MODES": ("pipemark.lowering", "LOWERING_MODES"),
    "is_marker": ("pipemark.primitive", "is_marker"),
    "MARK_TYPES": ("pipemark.marks", "MARK_TYPES"),
    "Signature": ("pipemark.signature", "Signature"),
    "Stage": ("pipemark.staged", "Stage"),
    "StageRole": ("pipemark.roles", "StageRole"),
    "verification": ("pipemark.verification", None),
}

# The views (pipemark.views: tables, HTML) register how a staged program is drawn when
# they are imported; its summary(), str() and notebook view import them on first use
# (pipemark.rendering). Neither module imports JAX.
_views_in("pipemark.views")

__version__ = "0.1.0"
__all__ = sorted(_EXPORTS)


def _load(module_name: str, attribute: str | None) -> object:
    import importlib

    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = _load(*_EXPORTS[name])
        globals()[name] = value  # later lookups do not come here
        return value
    if name in _MOVED:
        module_name, attribute = _MOVED[name]
        import warnings

        use = (
            f"import {module_name}"
            if attribute is None
            else f"from {module_name} import {attribute}"
        )
        # Not cached in globals(): every lookup of an old name warns.
        warnings.warn(
            f"pipemark.{name} is no longer a top-level name; use `{use}`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return _load(module_name, attribute)
    raise AttributeError(f"module 'pipemark' has no attribute {name!r}")


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
