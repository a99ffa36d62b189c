"""The top-level names of ``import pipemark as pm``: the list, grouped by task, pinned
here; every name resolves without a warning; the names that left the top level still
resolve, to the same object, with a DeprecationWarning naming their new place; every
PipemarkError subclass lives in pipemark.errors; and no doc, example, benchmark or
test uses a name that left."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import pipemark as pm

ROOT = Path(__file__).resolve().parent.parent

# The surface, by task (pipemark/__init__.py's _EXPORTS and docstring in this order).
SURFACE = {
    "mark": [
        "mark",
        "mark_gradient",
        "mark_pipeline_boundary",
        "mark_pipeline_jaxpreqn",
        "mark_hook_jaxpreqn",
        "pipeline_p",
        "lowering",
        "set_lowering",
    ],
    "split and check": [
        "split",
        "split_jaxpr",
        "StagedJaxpr",
        "VerifyReport",
        "load_staged",
        "flatten_shape_byte_sizes",
    ],
    "passes": ["passes"],
    "run and train": [
        "pipeline_value_and_grad",
        "pipeline_train_step",
        "Pipeline",
        "PipelinedStep",
        "PipelineOptions",
    ],
    "schedules": ["make_schedule", "Schedule", "Action", "simulate_schedule"],
    "inspect": ["show", "summary", "plot", "write_report"],
    "errors": [
        "PipemarkError",
        "PipemarkWarning",
        "VerificationError",
        "MemoryBudgetError",
        "DeviceOutOfMemoryError",
    ],
    "modules": ["runtime", "planner", "views", "errors"],
}
# The names the project started with (the Alpa markers and their helpers): top-level
# for good.
SEED = {
    "pipeline_p": "pipemark.primitive",
    "mark_pipeline_boundary": "pipemark.primitive",
    "mark_gradient": "pipemark.primitive",
    "mark_pipeline_jaxpreqn": "pipemark.primitive",
    "mark_hook_jaxpreqn": "pipemark.primitive",
    "flatten_shape_byte_sizes": "pipemark.cost",
    "set_lowering": "pipemark.lowering",
}


def _resolve(module: str, attribute: str | None) -> object:
    value = importlib.import_module(module)
    return value if attribute is None else getattr(value, attribute)


def test_all_is_the_grouped_surface():
    names = [name for group in SURFACE.values() for name in group]
    assert len(names) == len(set(names)) == 37
    assert sorted(pm.__all__) == sorted(names)
    assert list(pm._EXPORTS) == names  # _EXPORTS is written in the groups' order


def test_every_public_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in pm.__all__:
            assert getattr(pm, name) is _resolve(*pm._EXPORTS[name]), name
    assert set(pm.__all__) <= set(dir(pm))
    # The old names are not offered (a submodule is, once imported: pm.verification).
    assert not {name for name, (_, attribute) in pm._MOVED.items() if attribute} & set(dir(pm))


def test_seed_names_stay_top_level():
    for name, module in SEED.items():
        assert name in pm.__all__
        assert getattr(pm, name) is getattr(importlib.import_module(module), name)


def test_objects_users_hold_are_importable():
    from pipemark import PipelinedStep, PipelineOptions
    from pipemark.runtime.options import PipelineOptions as defined

    assert PipelineOptions is defined is pm.runtime.PipelineOptions
    assert PipelinedStep is pm.runtime.PipelinedStep
    # Every schedule builder is in pm.runtime, dualpipev's too; pm.make_schedule names them.
    assert {"gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev"} <= set(pm.runtime.SCHEDULES)
    assert callable(pm.runtime.dualpipev_schedule)


def test_the_docstring_lists_every_name():
    # help(pipemark) and the API reference's head (docs/api.md renders this docstring).
    listed = set(re.findall(r"`~pipemark\.(\w+)`", pm.__doc__))
    assert set(pm.__all__) <= listed


@pytest.mark.parametrize("name", sorted(pm._MOVED))
def test_moved_name_warns_and_is_the_same_object(name, monkeypatch):
    module, attribute = pm._MOVED[name]
    assert name not in pm.__all__ and name not in pm._EXPORTS
    # A submodule is an attribute of the package once imported: look it up as before.
    if name in vars(pm):
        monkeypatch.delattr(pm, name)
    new_place = module if attribute is None else f"from {module} import {attribute}"
    with pytest.warns(DeprecationWarning, match=re.escape(new_place)):
        value = getattr(pm, name)
    assert value is _resolve(module, attribute)
    with pytest.warns(DeprecationWarning):  # every lookup warns, not the first alone
        getattr(pm, name)


def test_renamed_error_keeps_its_old_name():
    from pipemark.errors import DeviceOutOfMemory, DeviceOutOfMemoryError

    assert DeviceOutOfMemory is DeviceOutOfMemoryError
    assert issubclass(DeviceOutOfMemoryError, (pm.PipemarkError, MemoryError))
    assert "DeviceOutOfMemory" not in pm.errors.__all__
    with pytest.warns(DeprecationWarning, match="DeviceOutOfMemoryError"):
        assert pm.DeviceOutOfMemory is DeviceOutOfMemoryError


def test_error_classes_keep_their_old_imports():
    from pipemark.mutation import StateMutationError
    from pipemark.signature import SignatureError
    from pipemark.verification import VerificationError

    assert SignatureError is pm.errors.SignatureError
    assert StateMutationError is pm.errors.StateMutationError
    assert VerificationError is pm.errors.VerificationError is pm.VerificationError


def _error_names() -> set[str]:
    return {
        name
        for name in pm.errors.__all__
        if isinstance(getattr(pm.errors, name), type)
        and issubclass(getattr(pm.errors, name), pm.PipemarkError)
    }


def test_every_pipemark_error_is_defined_in_the_errors_module():
    errors = _error_names()
    elsewhere = []
    for path in sorted((ROOT / "pipemark").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "pipemark":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases}
                if bases & errors:
                    elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not elsewhere, f"define these in pipemark/errors.py: {elsewhere}"


def _tracked(*patterns: str) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed]


def test_docs_examples_and_tests_use_no_moved_name():
    # (pipemark.verification, the module, is named by its path: not a top-level lookup.)
    moved = sorted(set(pm._MOVED) - {"verification"}, key=len, reverse=True)
    old = re.compile(rf"\b(?:pm|pipemark)\.({'|'.join(moved)})\b(?!\.py)")
    files = _tracked("*.md", "*.py", "*.ipynb")
    # (The changelog, the package and the docs' Griffe hook name them on purpose.)
    skipped = {
        ROOT / "CHANGELOG.md",
        Path(__file__).resolve(),
        ROOT / "pipemark/__init__.py",
        ROOT / "docs/hooks/griffe_docstrings.py",
    }
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in files
        if path not in skipped
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in old.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_import_pipemark_imports_no_jax():
    code = "import sys, pipemark; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
