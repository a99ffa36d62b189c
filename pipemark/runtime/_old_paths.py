"""The runtime's module paths from before it was parted into rooms: an old path such as
``pipemark.runtime.zero_bubble`` still imports, as the module at its new path
(:data:`MOVED`; the same object, registered under both names), with a
``DeprecationWarning`` that names the new path. Three old paths are packages now
(``schedules``, ``memory``, ``execution``) and hand on their old module's names
themselves, so they are not here.

>>> import importlib, warnings
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore", DeprecationWarning)
...     old = importlib.import_module("pipemark.runtime.zero_bubble")
>>> old is importlib.import_module("pipemark.runtime.schedules.zero_bubble")
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install", "new_path", "old_module"]

PREFIX = "pipemark.runtime."

#: Old module name (under ``pipemark.runtime``) -> its path now, from ``pipemark.runtime``.
MOVED: dict[str, str] = {
    "zero_bubble": "schedules.zero_bubble",
    "dualpipe": "schedules.dualpipe",
    "registry": "schedules.registry",
    "problem": "schedules.problem",
    "schedule_csv": "schedules.schedule_csv",
    "csv_cells": "schedules.csv_cells",
    "simulation": "schedules.simulation",
    "plot": "schedules.plot",
    "cluster": "planning.cluster",
    "workload": "planning.workload",
    "planner": "planning.planner",
    "dispatches": "planning.dispatches",
    "sharding": "devices.sharding",
    "placement": "devices.placement",
    "transport": "devices.transport",
    "exchange": "devices.exchange",
    "agreement": "devices.agreement",
    "processes": "devices.processes",
    "compilation": "devices.compilation",
    "accumulation": "devices.accumulation",
    "steps": "devices.steps",
    "programs": "memory.programs",
    "budget": "memory.budget",
    "perfetto": "execution.perfetto",
    "plan_export": "execution.plan_export",
    "update": "training.update",
    "update_run": "training.update_run",
    "keeping": "training.keeping",
    "holdings": "training.holdings",
    "orbax_arrays": "training.orbax_arrays",
    "sharing": "training.sharing",
    "layouts": "training.layouts",
}


def new_path(old: str) -> str | None:
    """The full module path that replaced the full module path ``old``, or ``None``.

    >>> new_path("pipemark.runtime.placement")
    'pipemark.runtime.devices.placement'
    >>> new_path("pipemark.runtime.pipeline") is None
    True
    """
    short = old.removeprefix(PREFIX)
    return PREFIX + MOVED[short] if old.startswith(PREFIX) and short in MOVED else None


def _importer_level() -> int:
    """The ``stacklevel`` of the frame that imported an old path, seen from the loader's
    ``create_module``: the frames of this module and of importlib are passed over, so
    that the warning points at the import line. ``warnings`` itself does not count the
    frames of importlib's bootstrap, so neither does this."""
    machinery = os.path.dirname(importlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        filename = frame.f_code.co_filename
        bootstrap = "importlib" in filename and "_bootstrap" in filename
        if not (bootstrap or filename == __file__ or os.path.dirname(filename) == machinery):
            break
        level += not bootstrap
        frame = frame.f_back
    return level


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if new_path(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there",
            DeprecationWarning,
            stacklevel=_importer_level(),
        )
        # The import system registers what this returns under the old name as well.
        return importlib.import_module(new)

    def exec_module(self, module):
        """Nothing to run: the module ran once, at its new path."""


def install() -> None:
    """Put the finder of old paths first on ``sys.meta_path`` (once): first, so that no
    other finder (an editable install's, say) looks for an old path's file elsewhere.

    >>> install()
    >>> sum(type(f).__name__ == "_OldPaths" for f in sys.meta_path)
    1
    """
    if not any(type(f).__name__ == _OldPaths.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())


def old_module(name: str) -> ModuleType:
    """``pipemark.runtime.<name>`` for an old module name (the package's
    ``__getattr__``): ``pm.runtime.zero_bubble`` reads as it did, with the warning.

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     old_module("cluster").__name__
    'pipemark.runtime.planning.cluster'
    """
    if name not in MOVED:
        raise AttributeError(f"module 'pipemark.runtime' has no attribute {name!r}")
    return importlib.import_module(PREFIX + name)
