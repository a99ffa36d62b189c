"""The runtime's rooms (CHANGELOG.md, "The runtime in rooms"): every module path from
before them still imports, as the same module as its new path, with a
DeprecationWarning that names the new path; the three old modules that are packages
now hand on the same objects; and no folder of the runtime is crowded again."""

from __future__ import annotations

import importlib
import pickle
import sys
import warnings
from pathlib import Path

import pytest

import pipemark.runtime
from pipemark.runtime._old_paths import MOVED

RUNTIME = Path(pipemark.runtime.__file__).parent

# Every module of pipemark/runtime/ before the rooms, written out here (not read from
# MOVED) so that a path dropped from the table fails below.
OLD_MODULES = [
    "accumulation",
    "agreement",
    "arguments",
    "budget",
    "calls",
    "cluster",
    "compilation",
    "csv_cells",
    "dispatches",
    "dualpipe",
    "exchange",
    "execution",
    "holdings",
    "keeping",
    "layouts",
    "losses",
    "memory",
    "options",
    "orbax_arrays",
    "perfetto",
    "pipeline",
    "pipeline_stages",
    "placement",
    "plan",
    "plan_export",
    "planner",
    "plot",
    "problem",
    "processes",
    "programs",
    "registry",
    "schedule_csv",
    "schedules",
    "scheduling",
    "sharding",
    "sharing",
    "simulation",
    "steps",
    "tracing",
    "train_step",
    "transport",
    "update",
    "update_run",
    "workload",
    "zero_bubble",
]

# The old modules whose path is a package now, and the module that was them.
PACKAGES = {"schedules": "core", "memory": "estimate", "execution": "run"}


def _forget(name: str) -> None:
    """Drop an old path from ``sys.modules`` (and the attribute its import set on the
    package), so that the next import goes through the finder again."""
    sys.modules.pop(f"pipemark.runtime.{name}", None)
    pipemark.runtime.__dict__.pop(name, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_new_module_and_says_where_it_went(old):
    new = f"pipemark.runtime.{MOVED[old]}"
    module = importlib.import_module(new)
    _forget(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert importlib.import_module(f"pipemark.runtime.{old}") is module
    messages = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert new in str(messages[0].message)
    # The warning points at the import, not at the import system.
    assert messages[0].filename == __file__
    assert sys.modules[f"pipemark.runtime.{old}"] is module
    assert module.__name__ == new


def test_an_old_path_imports_with_an_import_statement_and_as_an_attribute():
    _forget("zero_bubble")
    _forget("placement")
    _forget("cluster")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from pipemark.runtime import placement
        from pipemark.runtime.zero_bubble import zero_bubble_schedule

        assert pipemark.runtime.cluster.Cluster is pipemark.runtime.Cluster
    from pipemark.runtime.devices import placement as new_placement
    from pipemark.runtime.schedules import zero_bubble

    assert zero_bubble_schedule is zero_bubble.zero_bubble_schedule
    assert placement is new_placement
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 3
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        pipemark.runtime.no_such_module  # noqa: B018


def test_an_object_pickled_under_an_old_path_unpickles():
    from pipemark.runtime.devices.placement import Slot

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert pickle.loads(b"cpipemark.runtime.placement\nSlot\n.") is Slot


@pytest.mark.parametrize("old", sorted(PACKAGES))
def test_an_old_module_that_is_a_package_now_hands_on_its_names(old):
    package = importlib.import_module(f"pipemark.runtime.{old}")
    module = importlib.import_module(f"pipemark.runtime.{old}.{PACKAGES[old]}")
    public = {n for n in vars(module) if not n.startswith("_")}
    defined = {
        n for n in public if getattr(getattr(module, n), "__module__", None) == module.__name__
    }
    assert set(module.__all__) <= set(vars(package))
    for name in defined | set(module.__all__):
        assert getattr(package, name) is getattr(module, name), name
    assert package.__all__ == module.__all__


def test_every_old_path_still_imports():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old in OLD_MODULES:
            importlib.import_module(f"pipemark.runtime.{old}")
    assert set(MOVED) | set(PACKAGES) <= set(OLD_MODULES)


def test_no_old_module_is_left_as_a_file_and_no_folder_is_crowded():
    assert not [name for name in MOVED if (RUNTIME / f"{name}.py").exists()]
    for folder in [RUNTIME, *(p for p in RUNTIME.iterdir() if (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, (folder, sorted(p.name for p in modules))
        if folder != RUNTIME:  # each room says what it owns
            assert importlib.import_module(f"pipemark.runtime.{folder.name}").__doc__
