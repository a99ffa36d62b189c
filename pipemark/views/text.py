"""The stage table as text (plain, or drawn by ``rich``), and which inputs each stage
reads and which module it ends in.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))
>>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
>>> print(summary(staged, style="plain"))
#  stage   eqns  in  out  FLOPs  params  bytes in  bytes out    share
-  ------  ----  --  ---  -----  ------  --------  ---------  -------
0  stage0     3   1    1      4     0 B       0 B       16 B   50.0 %
1  stage1     3   1    1      4     0 B      16 B       16 B   50.0 %
-  ------  ----  --  ---  -----  ------  --------  ---------  -------
   total      6   2    2      8     0 B      16 B       32 B  100.0 %
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from pipemark._text import KEEP_TOGETHER, wrap
from pipemark.errors import PipemarkError
from pipemark.rendering import register_view
from pipemark.staged import StagedJaxpr
from pipemark.views.rows import (
    COLUMNS,
    LEFT_COLUMNS,
    check_staged,
    display_name,
    program_inputs,
    row_cells,
    stage_colors,
    stage_rows,
    type_text,
)

__all__ = [
    "STYLES",
    "print_stage_inputs",
    "print_summary",
    "stage_ends",
    "stage_inputs",
    "summary",
]

#: Text styles :func:`summary` takes.
STYLES: tuple[str, ...] = ("auto", "plain", "rich")


#: The width :func:`summary` fits the table to by default (a terminal's classic width).
DEFAULT_WIDTH = 80
# Columns left out, in this order, while the table is wider than asked. The position,
# name, FLOPs and share always stay: they say how balanced the stages are.
_DROP_ORDER = (("in", "out"), ("bytes out",), ("eqns",), ("params",), ("bytes in",))
# A stage name is never shortened below this many characters.
_MIN_NAME = 12
_NAME = COLUMNS.index("stage")


class _Layout(NamedTuple):
    """Which columns a table shows and how long a stage name may be (``None``: any)."""

    keep: tuple[int, ...]
    name_width: int | None

    def cells(self, row: Sequence[str]) -> tuple[str, ...]:
        return tuple(
            _shorten(row[c], self.name_width) if c == _NAME and self.name_width else row[c]
            for c in self.keep
        )

    def dropped(self) -> list[str]:
        return [title for c, title in enumerate(COLUMNS) if c not in self.keep]


def _shorten(name: str, width: int) -> str:
    """``name`` cut in the middle to ``width`` characters (both ends say the most:
    ``layer11_b…kward``)."""
    if len(name) <= width:
        return name
    head = width // 2
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


def _fit(rows: Sequence[Sequence[str]], width: int | None, measure) -> _Layout:
    """The layout of the widest table ``measure`` finds no wider than ``width``: drop
    columns in :data:`_DROP_ORDER`, then shorten long stage names (to no fewer than
    :data:`_MIN_NAME` characters; a table may stay wider than asked)."""
    keep = list(range(len(COLUMNS)))
    layout = _Layout(tuple(keep), None)
    if width is None or measure(layout) <= width:
        return layout
    for titles in _DROP_ORDER:
        for title in titles:
            keep.remove(COLUMNS.index(title))
        layout = _Layout(tuple(keep), None)
        if measure(layout) <= width:
            return layout
    longest = max(len(row[_NAME]) for row in rows)
    name_width = max(_MIN_NAME, longest - (measure(layout) - width))
    return _Layout(tuple(keep), name_width) if name_width < longest else layout


def _note(layout: _Layout, width: int | None) -> str:
    """The last line(s) of a table that left columns out: which, and how to see them."""
    import textwrap

    dropped = layout.dropped()
    if not dropped:
        return ""
    text = f"(left out to fit {width} columns: {', '.join(dropped)}; width=None shows all)"
    return "\n" + "\n".join(textwrap.wrap(text, max(width or 0, 40)))


def _plain_table(rows: Sequence[Sequence[str]], layout: _Layout) -> str:
    titles = layout.cells(COLUMNS)
    cells = [layout.cells(row) for row in rows]
    widths = [max(len(r[c]) for r in (titles, *cells)) for c in range(len(titles))]
    left = [c in LEFT_COLUMNS for c in layout.keep]

    def line(row: Sequence[str]) -> str:
        text = "  ".join(
            cell.ljust(w) if is_left else cell.rjust(w)
            for cell, w, is_left in zip(row, widths, left)
        )
        return text.rstrip()

    rule = line(["-" * w for w in widths])
    return "\n".join([line(titles), rule, *map(line, cells[:-1]), rule, line(cells[-1])])


def _plain_width(rows: Sequence[Sequence[str]]):
    def measure(layout: _Layout) -> int:
        cells = [layout.cells(row) for row in (COLUMNS, *rows)]
        return sum(max(len(r[c]) for r in cells) for c in range(len(layout.keep))) + 2 * (
            len(layout.keep) - 1
        )

    return measure


def _rich_table(rows: Sequence[Sequence[str]], layout: _Layout, colors: list[str], swatches: bool):
    """``rows`` (the totals last) as a ``rich`` table."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # No outer edge and one padded space between columns: as narrow as the plain table.
    table = Table(
        box=box.SIMPLE, show_footer=True, pad_edge=False, show_edge=False, collapse_padding=True
    )
    total = layout.cells(rows[-1])
    for k, (c, title) in enumerate(zip(layout.keep, layout.cells(COLUMNS))):
        table.add_column(
            title,
            footer=Text(total[k]),
            justify="left" if c in LEFT_COLUMNS else "right",
            header_style="bold",
            footer_style="bold",
            no_wrap=True,
        )
    for row, color in zip(rows[:-1], colors):
        # The colour swatch only means something on a terminal that shows colours.
        # Cells are Text, never markup: a stage named "[bold]x[/]", or a backslash and a
        # bracket (which rich's escape() leaves for markup to read as an escaped
        # bracket), is shown as named.
        cells = [Text(cell) for cell in layout.cells(row)]
        first = Text.assemble(("■ ", color), cells[0]) if swatches else cells[0]
        table.add_row(first, Text(cells[1].plain, style=f"bold {color}"), *cells[2:])
    return table


def _rich_width(rows: Sequence[Sequence[str]], swatches: bool):
    from rich.console import Console

    console = Console(width=10_000, color_system=None, force_terminal=False)

    def measure(layout: _Layout) -> int:
        table = _rich_table(rows, layout, ["red"] * (len(rows) - 1), swatches)
        return console.measure(table).maximum

    return measure


def _have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def summary(staged: StagedJaxpr, *, style: str = "auto", width: int | None = DEFAULT_WIDTH) -> str:
    """The stage table as text: one row per stage, then the totals.

    Columns: position, name, equations (``eqns``), values in and out, FLOPs (``~``
    when approximate), bytes of the parameters the stage reads (``params``: see
    :func:`~pipemark.views.rows.parameter_inputs`; data inputs are not counted), bytes
    in and out, and each stage's share of the program's FLOPs (see
    :class:`~pipemark.views.rows.StageRow`).

    Parameters
    ----------
    style:
        ``"plain"`` (columns of text), ``"rich"`` (drawn by ``rich``, which must be
        installed) or ``"auto"`` (``rich`` when installed). Both hold the same cells;
        the returned string has no terminal colour codes.
    width:
        The most characters a line may take (80 by default). A wider table leaves out
        columns (values in and out, bytes out, equations, params, bytes in, in that
        order; position, name, FLOPs and share always stay) and then shortens long stage names in the middle, and says so in a
        last line. ``None``: every column, whatever the width.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(jnp.ones(4))
    >>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
    >>> print(summary(staged, style="plain"))
    #  stage   eqns  in  out  FLOPs  params  bytes in  bytes out    share
    -  ------  ----  --  ---  -----  ------  --------  ---------  -------
    0  stage0     3   1    1      4     0 B       0 B       16 B   50.0 %
    1  stage1     3   2    1      4     0 B      16 B       16 B   50.0 %
    -  ------  ----  --  ---  -----  ------  --------  ---------  -------
       total      6   3    2      8     0 B      16 B       32 B  100.0 %
    >>> print(summary(staged, style="plain", width=40))
    #  stage   FLOPs  bytes in    share
    -  ------  -----  --------  -------
    0  stage0      4       0 B   50.0 %
    1  stage1      4      16 B   50.0 %
    -  ------  -----  --------  -------
       total       8      16 B  100.0 %
    (left out to fit 40 columns: eqns, in,
    out, params, bytes out; width=None shows
    all)
    """
    if style not in STYLES:
        raise PipemarkError(f"Unknown style {style!r}; choose one of {', '.join(STYLES)}.")
    _check_width(width)
    staged = check_staged(staged, "summary")
    rows, total = stage_rows(staged)
    cells = [row_cells(r) for r in (*rows, total)]
    use_rich = style == "rich" or (style == "auto" and _have_rich())
    if not use_rich:
        layout = _fit(cells, width, _plain_width(cells))
        return _plain_table(cells, layout) + _note(layout, width)
    if not _have_rich():
        raise PipemarkError("style='rich' needs rich: pip install rich (or 'pipemark[viz]').")
    from rich.console import Console

    layout = _fit(cells, width, _rich_width(cells, swatches=False))
    buffer = io.StringIO()
    # Wide enough never to wrap a cell; no colour codes in a returned string.
    console = Console(
        file=buffer, width=10_000, color_system=None, force_terminal=False, force_jupyter=False
    )
    console.print(_rich_table(cells, layout, stage_colors(staged), swatches=False))
    text = "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")
    return text + _note(layout, width)


register_view(StagedJaxpr, "text", summary)  # StagedJaxpr.summary() and str()


def _check_width(width: Any) -> None:
    if width is not None and (type(width) is not int or width < 1):
        raise PipemarkError(f"width must be a positive int or None, got {width!r}.")


def stage_inputs(staged: StagedJaxpr, *, limit: int = 6, width: int | None = DEFAULT_WIDTH) -> str:
    """For each stage, the program inputs it reads, by their pytree paths (at most
    ``limit`` a stage, then how many more), in lines of at most ``width`` columns
    (``None``: one line a stage).

    >>> import jax.numpy as jnp, pipemark as pm
    >>> def f(params, x):
    ...     x = jnp.sin(x * params["w"])
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x + params["b"])
    >>> staged = pm.split(f, {"w": 1.0, "b": 2.0}, 0.5)
    >>> print(stage_inputs(staged))
    program inputs each stage reads:
      layer0: params['w'] f32[], x f32[]
      layer1: params['b'] f32[]
    """
    staged = check_staged(staged, "stage_inputs")
    _check_width(width)
    lines = ["program inputs each stage reads:"]
    for stage in staged.stages:
        # A name and its type stay on one line.
        read = [
            f"{display_name(name)}{KEEP_TOGETHER}{type_text(aval)}"
            for name, aval in program_inputs(staged, stage)
        ]
        more = f", …{KEEP_TOGETHER}{len(read) - limit} more" if len(read) > limit else ""
        name = display_name(stage.name)
        lines.append(_fitted(f"  {name}: {', '.join(read[:limit]) or '(none)'}{more}", width))
    return "\n".join(lines)


def _fitted(line: str, width: int | None) -> str:
    """A line of :func:`stage_inputs` or :func:`print_stage_inputs`, continued under its
    stage's name past ``width`` columns."""
    if width is None:
        return line.replace(KEEP_TOGETHER, " ")
    return wrap(line, width, indent="    ")


def stage_ends(staged: StagedJaxpr) -> dict[str, str]:
    """For each stage, the module its last computing equation belongs to: where the
    cut after it falls. That is the equation's name scope (flax linen modules,
    ``jax.named_scope``) when it has one that names an instance; otherwise (nnx, or
    equinox, whose scopes name only classes) the module path of the last layer whose
    parameters the stage reads, such as ``model.blocks[1]``. Stages with neither (a
    backward stage gets its parameters from its forward stage) are left out.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     with jax.named_scope("block0"):
    ...         x = jnp.sin(x)
    ...     with jax.named_scope("block1"):
    ...         return jnp.cos(x)
    >>> stage_ends(pm.split(f, 1.0, num_stages=2))
    {'layer0': 'block0', 'layer1': 'block1'}
    >>> def g(params, x):
    ...     x = jnp.sin(x * params["blocks"][0]["w"])
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x * params["blocks"][1]["w"])
    >>> stage_ends(pm.split(g, {"blocks": [{"w": 1.0}, {"w": 2.0}]}, 0.5))
    {'layer0': "params['blocks'][0]", 'layer1': "params['blocks'][1]"}
    """
    staged = check_staged(staged, "stage_ends")
    ends = {}
    for stage in staged.stages:
        end = _scope_end(stage) or _parameter_end(staged, stage)
        if end:
            ends[stage.name] = end
    return ends


def _scope_end(stage: Any) -> str | None:
    from pipemark._compat import name_stack_scopes
    from pipemark.primitive import pipeline_p

    tail = [e for e in stage.jaxpr.eqns[-24:] if e.primitive is not pipeline_p][-16:]
    # The deepest module among the last few equations: after a layer's Dense, the
    # activation applied in the enclosing module's body is still "after Dense_1".
    best: tuple[str, ...] = ()
    for eqn in reversed(tail):
        scopes = name_stack_scopes(eqn.source_info)[0]
        if len(scopes) > len(best):
            best = scopes
    if not best or all(scope.startswith("eqx.") for scope in best):
        return None  # equinox scopes name classes, not which instance
    return "/".join(best)


# A pytree path's parts: the argument, `.attr`, `['key']`, `[0]`.
_PATH_PART = re.compile(r"[A-Za-z_]\w*|\.[A-Za-z_]\w*|\[[^\[\]]*\]")


def _module_parts(path: str) -> list[str]:
    """The parts of a parameter's path without the leaf's own name (and nnx's
    ``.value``): ``m.blocks[1].mlp.bias`` -> ``['m', '.blocks', '[1]', '.mlp']``."""
    parts = _PATH_PART.findall(path)
    if parts[-1:] == [".value"]:
        parts.pop()
    return parts[:-1]


def _parameter_end(staged: StagedJaxpr, stage: Any) -> str | None:
    """The module the stage's parameters end in: among the program inputs it reads
    (those inside a container, grouped by argument, the argument read most), their
    common module path, extended along the last of them (in pytree order) down to the
    first list index (which layer), if any."""
    names = staged.input_names
    read = sorted(ref.index for ref in stage.inputs if ref.kind == "input")
    paths = [parts for parts in (_module_parts(names[i]) for i in read) if parts]
    if not paths:
        return None
    groups: dict[str, list[list[str]]] = {}
    for parts in paths:
        groups.setdefault(parts[0], []).append(parts)
    group = max(groups.values(), key=len)
    common = 0
    while all(len(p) > common and p[common] == group[0][common] for p in group):
        common += 1
    last = group[-1]
    end = next(
        (i + 1 for i in range(common, len(last)) if last[i][1:-1].isdigit()),
        common,
    )
    return "".join(last[:end])


def print_stage_inputs(
    staged: StagedJaxpr, file: Any = None, width: int | None = DEFAULT_WIDTH
) -> None:
    """Print :func:`stage_inputs` and, where the program has module scopes, the module
    each stage ends in (:func:`stage_ends`), to ``file`` (standard output by default),
    in lines of at most ``width`` columns (``None``: one line each)."""
    import sys

    file = sys.stdout if file is None else file
    print(stage_inputs(staged, width=width), file=file)
    ends = stage_ends(staged)
    if ends:
        print("each stage ends in:", file=file)
        for name, scope in ends.items():
            line = f"  {display_name(name)}: after {display_name(scope)}"
            print(_fitted(line, width), file=file)


def print_summary(staged: StagedJaxpr, file: Any = None, width: int | None = None) -> None:
    """Print the stage table to ``file`` (standard output by default): :func:`summary`,
    fitted to ``width`` (by default the terminal's width, or 80 columns when ``file``
    is not a terminal), except that on a terminal, with ``rich`` installed, stage
    names are drawn in their colours."""
    import shutil
    import sys

    file = sys.stdout if file is None else file
    staged = check_staged(staged, "print_summary")
    _check_width(width)
    is_terminal = getattr(file, "isatty", lambda: False)()
    if width is None:
        width = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if is_terminal else None
        width = width or DEFAULT_WIDTH
    if not (is_terminal and _have_rich()):
        print(summary(staged, width=width), file=file)
        return
    from rich.console import Console

    rows, total = stage_rows(staged)
    cells = [row_cells(r) for r in (*rows, total)]
    console = Console(file=file, width=max(width, 40))
    swatches = console.color_system is not None
    layout = _fit(cells, width, _rich_width(cells, swatches))
    console.print(_rich_table(cells, layout, stage_colors(staged), swatches))
    note = _note(layout, width)
    if note:
        print(note.strip("\n"), file=file)
