"""The package's structure, checked on its source: one table of mark types, no
private names imported across modules, no import cycles, functions that fit on a
screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipemark.marks import BACKWARD_SUFFIX, MARK_TYPES, WEIGHT_SUFFIX

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


def _all_names(tree: ast.AST) -> set[str]:
    """The strings of the module's ``__all__``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)}
    return set()


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"pipemark.marks"}))
def test_mark_type_roles_and_stage_naming_live_in_marks(module):
    tree = TREES[module]
    exported = _all_names(tree)  # a function named like the suffix is not a stage name
    suffixes = [
        node.lineno
        for node in _strings(tree)
        if node.value.endswith((BACKWARD_SUFFIX, WEIGHT_SUFFIX))
        and "\n" not in node.value
        and node.value not in exported
    ]
    assert not suffixes, (
        f"{module} spells the backward suffix at lines {suffixes}; use "
        "pipemark.marks.backward_name / forward_name / weight_name"
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


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(module: str, type_checking: bool = False) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import of a
    pipemark module in ``module``, at any depth (a lazy import inside a function counts),
    and under ``if TYPE_CHECKING:`` only when ``type_checking``."""
    found = []
    is_package = MODULES[module].name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node) and not type_checking:
            return
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] == "pipemark":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in MODULES:
                        found.append((full, None, node.lineno))
                    else:
                        found.append((base, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found.extend(
                (a.name, None, node.lineno)
                for a in node.names
                if a.name.split(".")[0] == "pipemark"
            )
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(TREES[module])
    return found


def test_no_private_names_are_imported_across_modules():
    bad = []
    for module in MODULES:
        for target, name, line in _imports(module):
            dunder = name is not None and name.startswith("__") and name.endswith("__")
            if name is not None and name.startswith("_") and not dunder:
                bad.append(f"{module}:{line} imports {name} from {target}")
            # A private module belongs to its package: only that package imports it.
            private = [i for i, p in enumerate(target.split(".")) if p.startswith("_")]
            if private:
                owner = ".".join(target.split(".")[: private[0]])
                if not (module == owner or module.startswith(owner + ".")):
                    bad.append(f"{module}:{line} imports the private module {target}")
    assert not bad, "\n".join(bad)


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        # An import for type hints counts too: it says which module knows which, and a
        # reader (and `farm-studio look`) follows it like any other.
        for target, _, _ in _imports(module, type_checking=True):
            # A package's __init__ re-exports; an import of a name from it depends on the
            # package's modules, which its own imports list, so packages are left out.
            if target in MODULES and target != module and MODULES[target].name != "__init__.py":
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    cycles = _cycles(_edges())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_shadows_the_standard_library():
    import sys

    shadowing = [m for m in MODULES if m.split(".")[-1] in sys.stdlib_module_names]
    assert not shadowing, shadowing


def _long_functions(limit: int = 80) -> list[str]:
    """Functions whose code (the docstring aside) runs over ``limit`` lines, unless
    their docstring gives the reason in a line starting with ``Long:``."""
    found = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            first = node.body[0]
            skip = first.end_lineno - first.lineno + 1 if doc else 0
            length = node.end_lineno - node.lineno + 1 - skip
            reason = any(line.strip().startswith("Long:") for line in doc.splitlines())
            if length > limit and not reason:
                found.append(f"{module}.{node.name}: {length} lines")
    return found


def test_functions_fit_on_a_screen():
    long = _long_functions()
    assert not long, "\n".join(long)
    assert _long_functions(limit=40), "the check finds functions longer than 40 lines"


def _runtime_room(module: str) -> str | None:
    """The room of the runtime a module lives in: a package of ``pipemark/runtime/``
    (``pipemark.runtime.schedules``), or a module at its top, which is a room of its own;
    ``None`` outside the runtime and for the package itself."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["pipemark", "runtime"] and len(parts) > 2 else None


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_runtime_rooms_import_only_rooms_below_them():
    # The runtime is parted along the way data flows (docs/architecture.md, "The
    # runtime"): a room that imported one above it would tie two rooms into one.
    graph: dict[str, set[str]] = {}
    for module, targets in _edges().items():
        room = _runtime_room(module)
        if room is not None:
            graph.setdefault(room, set()).update(
                other for t in targets if (other := _runtime_room(t)) not in (None, room)
            )
    for targets in list(graph.values()):
        for target in targets:
            graph.setdefault(target, set())
    assert "pipemark.runtime.schedules" in graph and "pipemark.runtime.devices" in graph
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    ("room", "allowed"),
    [
        # Schedules are data: nothing of them knows a device, a program or a plan.
        ("pipemark.runtime.schedules", set()),
        # A plan is built from the devices' room; nothing in it knows a plan.
        ("pipemark.runtime.devices", {"pipemark.runtime.schedules", "pipemark.runtime.losses"}),
    ],
)
def test_the_lower_rooms_of_the_runtime_know_nothing_above_them(room, allowed):
    graph = _edges()
    above = {
        (module, target)
        for module in graph
        if _runtime_room(module) == room
        for target in _reachable(graph, module)
        if _runtime_room(target) not in (None, room, *allowed)
    }
    assert not above, sorted(above)
