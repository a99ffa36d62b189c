"""A Griffe extension that adapts pipemark's docstrings to the Markdown renderer of the
API reference (docs/api.md), without changing the docstrings themselves.

pipemark's docstrings are numpydoc with doctest examples, written for `help()` and for
pytest's doctest run. Some things in them read badly once rendered:

- numpydoc ends a section only at the next heading, so a doctest or a paragraph of
  prose written after the items of "Parameters", "Raises", "Attributes" … would be read
  as more items (and warn, failing the strict build). Such a doctest starts an
  "Examples" section here, and such prose a "Notes" section;
- a doctest in the prose above the sections (say, in a module docstring) is plain text
  to Markdown, and its `>>>` prompts turn into nested blockquotes: it is fenced as a
  `pycon` block;
- a package without ``__all__`` (``pipemark.passes``, ``pipemark.runtime``,
  ``pipemark.views``) exports names by re-importing them from its own modules
  (``from pipemark.passes.slice import slice_stages as slice_stages``). Griffe takes
  imported names for private, so these re-exports are marked public here, and the
  reference documents them under the name users call them by;
- RST simple tables (rows of ``=``) become preformatted text, as the author aligned
  them, and RST's ``Before::`` before a literal block reads ``Before:``;
- Sphinx roles such as :func:`split` would show their colons and role names. They
  become code that links to the object where the reference documents it (an "optional"
  autoref renders as plain code when its target is not on the site, instead of
  failing the strict build).
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import griffe

import pipemark  # cheap: the package imports its modules on first use only

ROLE = re.compile(r":(func|class|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")
# Sections whose body is a list of items, each a line at the section's indentation.
LIST_SECTIONS = frozenset(
    {"parameters", "other parameters", "attributes", "raises", "warns", "returns", "yields"}
)
# Sections whose items start with a name (or names) and an optional ": type"; any other
# line at that indentation is prose. (A "Returns" item may be a bare type, so that
# section is left alone.)
NAMED_SECTIONS = frozenset({"parameters", "other parameters", "attributes", "raises", "warns"})
KEPT_SPECIAL = frozenset({"__init__", "__new__", "__call__"})
RST_TABLE_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")
ITEM = re.compile(r"^\*{0,2}[A-Za-z_][\w.]*(?:\s*,\s*\*{0,2}[A-Za-z_][\w.]*)*\s*(?::.*)?$")


def _is_heading(lines: list[str], index: int) -> bool:
    """A numpydoc section heading is a line underlined by dashes."""
    underline = lines[index + 1].strip() if index + 1 < len(lines) else ""
    return bool(lines[index].strip()) and len(underline) >= 3 and set(underline) == {"-"}


def _new_section(lines: list[str], index: int, section: str) -> str | None:
    """The heading to insert before line ``index`` when it is a doctest or prose that
    follows the items of a list section (after a blank line, not indented)."""
    line = lines[index]
    if section not in LIST_SECTIONS or index == 0 or lines[index - 1].strip():
        return None
    if not line.strip() or line != line.lstrip():
        return None
    if line.startswith(">>>"):
        return "Examples"
    if section in NAMED_SECTIONS and not ITEM.match(line):
        return "Notes"
    return None


def _doctest_end(lines: list[str], index: int) -> int:
    """A doctest runs up to the next blank line."""
    while index < len(lines) and lines[index].strip():
        index += 1
    return index


def _table_end(lines: list[str], index: int) -> int:
    """An RST simple table ends with a border line followed by a blank line."""
    for stop in range(index + 1, len(lines)):
        last = stop + 1 == len(lines) or not lines[stop + 1].strip()
        if RST_TABLE_BORDER.match(lines[stop]) and last:
            return stop + 1
    return len(lines)


def _fence(block: list[str], language: str) -> list[str]:
    indent = block[0][: len(block[0]) - len(block[0].lstrip())]
    return [f"{indent}```{language}", *block, f"{indent}```"]


def _literal_marker(lines: list[str], index: int) -> str:
    """RST's ``Before::`` (a paragraph that introduces an indented literal block, which
    Markdown shows as code anyway) reads ``Before:``; a lone ``::`` goes."""
    line = lines[index]
    next_blank = index + 1 < len(lines) and not lines[index + 1].strip()
    if not line.endswith("::") or not next_blank or line.lstrip().startswith((">>>", "...")):
        return line
    return "" if line.strip() == "::" else line[:-1]


def normalise_docstring(text: str) -> str:
    """Give doctests and prose that follow a list section their own section, fence the
    doctests of prose outside any section as ``pycon`` code and RST tables as text."""
    lines = text.splitlines()
    out: list[str] = []
    section = ""
    in_fence = False
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.lstrip()
        heading = None if in_fence else _new_section(lines, index, section)
        if stripped.startswith("```"):
            in_fence = not in_fence
        elif in_fence:
            pass
        elif _is_heading(lines, index):
            section = line.strip().lower()
        elif heading is not None:
            out += [heading, "-" * len(heading)]
            section = heading.lower()
        elif RST_TABLE_BORDER.match(line):
            # Kept as the author aligned it: its cells may wrap onto several lines.
            stop = _table_end(lines, index)
            out += _fence(lines[index:stop], "text")
            index = stop
            continue
        elif section not in ("examples", *LIST_SECTIONS) and stripped.startswith(">>>"):
            stop = _doctest_end(lines, index)
            out += _fence(lines[index:stop], "pycon")
            index = stop
            continue
        else:
            line = _literal_marker(lines, index)
        out.append(line)
        index += 1
    return "\n".join(out)


def _canonical(name: str, role: str) -> str:
    """``pipemark.StagedJaxpr`` -> ``pipemark.staged.StagedJaxpr``: the package exports
    its names lazily (``pipemark._EXPORTS``), so the reference documents them where they
    are defined, or under the package that re-exports them; so is a name that has left
    the top level (``pipemark._MOVED``: ``pipemark.Cluster`` ->
    ``pipemark.planner.Cluster``). A path into a module that shares its name with a
    function (``pipemark.plot.stage_layout``) stays as it is."""
    head, _, rest = name.removeprefix("pipemark.").partition(".")
    module, attribute = {**pipemark._MOVED, **pipemark._EXPORTS}.get(head, (None, None))
    if module is None:
        return name
    if (rest or role == "mod") and importlib.util.find_spec(f"pipemark.{head}") is not None:
        return name
    target = module if attribute is None else f"{module}.{attribute}"
    return f"{target}.{rest}" if rest else target


def _identifier(obj: griffe.Object, name: str, role: str) -> str:
    """The dotted path a role's target most likely has: a name relative to the object's
    class or module is looked up in the enclosing scopes, as Sphinx does, and an
    imported name is followed to where it comes from."""
    if name.startswith("pipemark."):
        return _canonical(name, role)
    scope: Any = obj if obj.is_module or obj.is_class else obj.parent
    head, _, rest = name.partition(".")
    while scope is not None:
        member = scope.members.get(head)
        if member is not None:
            path = member.target_path if member.is_alias else member.path
            return _canonical(f"{path}.{rest}" if rest else path, role)
        scope = scope.parent
    return name


def link_roles(text: str, obj: griffe.Object) -> str:
    """Turn Sphinx roles into code that links to the object where the site has it; in
    fenced blocks (where HTML would show as text) into the bare name."""

    def replace(match: re.Match[str]) -> str:
        role, short, name = match.group(1), match.group(2), match.group(3)
        shown = name.rsplit(".", 1)[-1] if short else name
        if match.group(0).endswith("()`"):
            shown += "()"
        identifier = _identifier(obj, name, role)
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    lines = text.splitlines()
    in_fence = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif in_fence:
            lines[index] = ROLE.sub(lambda match: match.group(3), line)
        else:
            lines[index] = ROLE.sub(replace, line)
    return "\n".join(lines)


def mark_reexports_public(module: griffe.Module) -> None:
    """In a module without ``__all__``, the names it imports from its own submodules
    are its public API."""
    if module.exports:
        return
    for name, member in module.members.items():
        own = member.is_alias and member.target_path.startswith(f"{module.path}.")
        if own and not name.startswith("_"):
            member.public = True


def drop_undocumented_class_members(cls: griffe.Class) -> None:
    """The reference shows module constants without docstrings (``show_if_no_docstring``),
    but not a class's undocumented fields, which its signature and "Attributes" section
    already give, nor its undocumented special methods (``__post_init__``,
    ``__repr__``; ``__init__`` stays, since its parameters make the class's
    signature). Undocumented properties stay: nothing else shows them. They are removed from Griffe's model rather than marked private,
    because a re-exported class (``pipemark.runtime.Schedule``) shows its members
    through new aliases that would not carry the mark."""
    for name, member in list(cls.members.items()):
        if member.is_alias or member.docstring is not None or "property" in member.labels:
            continue
        special = name.startswith("__") and name.endswith("__")
        if member.is_attribute or (special and name not in KEPT_SPECIAL):
            del cls.members[name]


class PipemarkDocstrings(griffe.Extension):
    """Rewrites each docstring once, when Griffe has loaded the whole package (so that
    relative role targets can be looked up among all members)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "pipemark":  # not a package Griffe loads to follow an import
            self._rewrite(pkg, seen=set())

    def _rewrite(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.is_module:
            mark_reexports_public(obj)
        if obj.is_class:
            drop_undocumented_class_members(obj)
        if obj.docstring is not None:
            obj.docstring.value = link_roles(normalise_docstring(obj.docstring.value), obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member, seen)
