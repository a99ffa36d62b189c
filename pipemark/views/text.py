"""The stage table as text (plain, or drawn by ``rich``), and which inputs each stage
reads and which module it ends in.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))
>>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
>>> print(summary(staged, style="plain"))
#  stage   equations  inputs  outputs  FLOPs  param bytes  bytes in  bytes out  cost share
-  ------  ---------  ------  -------  -----  -----------  --------  ---------  ----------
0  stage0          3       1        1      4         16 B       0 B       16 B      50.0 %
1  stage1          3       1        1      4          0 B      16 B       16 B      50.0 %
-  ------  ---------  ------  -------  -----  -----------  --------  ---------  ----------
   total           6       2        2      8         16 B      16 B       32 B     100.0 %
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipemark.errors import PipemarkError
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

if TYPE_CHECKING:
    from pipemark.staged import StagedJaxpr

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


def _plain_table(rows: Sequence[tuple[str, ...]], total: tuple[str, ...]) -> str:
    widths = [max(len(r[c]) for r in (COLUMNS, *rows, total)) for c in range(len(COLUMNS))]

    def line(cells: Sequence[str]) -> str:
        text = "  ".join(
            cell.ljust(w) if c in LEFT_COLUMNS else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(cells, widths))
        )
        return text.rstrip()

    rule = line(["-" * w for w in widths])
    return "\n".join([line(COLUMNS), rule, *map(line, rows), rule, line(total)])


def _rich_table(
    rows: Sequence[tuple[str, ...]], total: tuple[str, ...], colors: list[str], swatches: bool
):
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_footer=True, pad_edge=False)
    for c, title in enumerate(COLUMNS):
        table.add_column(
            title,
            footer=escape(total[c]),
            justify="left" if c in LEFT_COLUMNS else "right",
            header_style="bold",
            footer_style="bold",
            no_wrap=True,
        )
    for cells, color in zip(rows, colors):
        # The colour swatch only means something on a terminal that shows colours.
        # Cells are text, never markup: a stage named "[bold]x[/]" is shown as named.
        cells = [escape(cell) for cell in cells]
        first = f"[{color}]■[/] {cells[0]}" if swatches else cells[0]
        table.add_row(first, f"[bold {color}]{cells[1]}[/]", *cells[2:])
    return table


def _have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def summary(staged: StagedJaxpr, *, style: str = "auto") -> str:
    """The stage table as text: one row per stage, then the totals.

    Columns: position, name, equations, number of inputs and outputs, FLOPs (``~``
    when approximate), parameter
    bytes, bytes in, bytes out and each stage's share of the program's FLOPs (see
    :class:`StageRow`).

    Parameters
    ----------
    style:
        ``"plain"`` (columns of text), ``"rich"`` (drawn by ``rich``, which must be
        installed) or ``"auto"`` (``rich`` when installed). Both hold the same cells;
        the returned string has no terminal colour codes.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(jnp.ones(4))
    >>> staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))
    >>> print(summary(staged, style="plain").splitlines()[2])
    0  stage0          3       1        1      4         16 B       0 B       16 B      50.0 %
    """
    if style not in STYLES:
        raise PipemarkError(f"Unknown style {style!r}; choose one of {', '.join(STYLES)}.")
    staged = check_staged(staged, "summary")
    rows, total = stage_rows(staged)
    cells = [row_cells(r) for r in rows]
    use_rich = style == "rich" or (style == "auto" and _have_rich())
    if not use_rich:
        return _plain_table(cells, row_cells(total))
    if not _have_rich():
        raise PipemarkError("style='rich' needs rich: pip install rich (or 'pipemark[viz]').")
    from rich.console import Console

    buffer = io.StringIO()
    # Wide enough never to wrap a cell; no colour codes in a returned string.
    console = Console(
        file=buffer, width=400, color_system=None, force_terminal=False, force_jupyter=False
    )
    console.print(_rich_table(cells, row_cells(total), stage_colors(staged), swatches=False))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")


def stage_inputs(staged: StagedJaxpr, *, limit: int = 6) -> str:
    """For each stage, the program inputs it reads, by their pytree paths (at most
    ``limit`` a stage, then how many more).

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
    lines = ["program inputs each stage reads:"]
    for stage in staged.stages:
        read = [
            f"{display_name(name)} {type_text(aval)}"
            for name, aval in program_inputs(staged, stage)
        ]
        more = f", … {len(read) - limit} more" if len(read) > limit else ""
        name = display_name(stage.name)
        lines.append(f"  {name}: {', '.join(read[:limit]) or '(none)'}{more}")
    return "\n".join(lines)


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


def print_stage_inputs(staged: StagedJaxpr, file: Any = None) -> None:
    """Print :func:`stage_inputs` and, where the program has module scopes, the module
    each stage ends in (:func:`stage_ends`), to ``file`` (standard output by default)."""
    import sys

    file = sys.stdout if file is None else file
    print(stage_inputs(staged), file=file)
    ends = stage_ends(staged)
    if ends:
        print("each stage ends in:", file=file)
        for name, scope in ends.items():
            print(f"  {display_name(name)}: after {display_name(scope)}", file=file)


def print_summary(staged: StagedJaxpr, file: Any = None) -> None:
    """Print the stage table to ``file`` (standard output by default): :func:`summary`,
    except that on a terminal, with ``rich`` installed, stage names are drawn in their
    colours."""
    import sys

    file = sys.stdout if file is None else file
    staged = check_staged(staged, "print_summary")
    is_terminal = getattr(file, "isatty", lambda: False)()
    if not (is_terminal and _have_rich()):
        print(summary(staged), file=file)
        return
    from rich.console import Console

    rows, total = stage_rows(staged)
    console = Console(file=file)
    table = _rich_table(
        [row_cells(r) for r in rows],
        row_cells(total),
        stage_colors(staged),
        swatches=console.color_system is not None,
    )
    console.print(table)
