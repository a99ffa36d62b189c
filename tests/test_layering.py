"""The package's structure, checked on its source: one table of mark types, no
private names imported across modules, no import cycles, functions that fit on a
screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipemark.marks import BACKWARD_SUFFIX, MARK_TYPES

PACKAGE = Path(__file__).resolve().parent.parent / "pipemark"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def _strings(tree: ast.AST) -> list[ast.Constant]:
    docs = _docstrings(tree)
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"pipemark.marks"}))
def test_mark_type_roles_and_stage_naming_live_in_marks(module):
    tree = TREES[module]
    suffixes = [
        node.lineno
        for node in _strings(tree)
        if node.value.endswith(BACKWARD_SUFFIX) and "\n" not in node.value
    ]
    assert not suffixes, (
        f"{module} spells the backward suffix at lines {suffixes}; use "
        "pipemark.marks.backward_name / forward_name"
    )
    sets = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List, ast.Dict)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            kinds = {
                item.value
                for item in items
                if isinstance(item, ast.Constant) and item.value in MARK_TYPES
            }
            if len(kinds) >= 2:
                sets.append(node.lineno)
    assert not sets, (
        f"{module} lists mark types itself at lines {sets}; read the roles from "
        "pipemark.marks (OPENERS, CLOSERS, PAIRED_MARK_TYPES, STAGE_MARK_TYPES, ...)"
    )
