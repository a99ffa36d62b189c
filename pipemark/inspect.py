"""Looking at a staged program: a text table, and an HTML view for notebooks and reports.

The text formatter comes first and everything else is a thin layer over the same rows
(:func:`stage_rows`): :func:`summary` renders them as plain text, or with ``rich`` when
it is installed (the same cells, drawn with box characters); :func:`to_html` renders them
as a table followed by the program, each stage's equations in the stage's own colour,
one collapsible block per stage, with the values that cross stage boundaries
highlighted. The HTML is self-contained (one ``<style>`` element, no script, no
network) and well-formed XML, and it inherits the page's text colour so that it reads
in light and dark notebook themes alike.

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

import html
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from pipemark._compat import jaxpr_type_name
from pipemark.cost import _nbytes, estimate_cost
from pipemark.errors import PipemarkError
from pipemark.marks import forward_name
from pipemark.staged import StagedJaxpr

__all__ = [
    "STYLES",
    "StageRow",
    "HTMLView",
    "stage_rows",
    "stage_colors",
    "summary",
    "to_html",
    "show",
    "write_report",
]

#: Text styles :func:`summary` takes.
STYLES: tuple[str, ...] = ("auto", "plain", "rich")

# Ten hues that stay distinguishable on white and on near-black, and for most colour
# vision deficiencies; a program with more stages reuses them in order.
_PALETTE: tuple[str, ...] = (
    "#3b7dd8",
    "#e8702a",
    "#2ca05a",
    "#d6455d",
    "#8a63d2",
    "#a0703c",
    "#d45fb0",
    "#6f7f8f",
    "#b5a020",
    "#1fa5b5",
)


# ------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class StageRow:
    """One row of the stage table.

    Attributes
    ----------
    index, name:
        The stage's position and name (``"total"`` and ``-1`` for the totals row).
    equations:
        Top-level equations.
    inputs, outputs:
        How many values the stage takes (program inputs, constants it is handed and
        earlier stages' values) and how many it hands on.
    flops:
        FLOPs plus transcendental calls (:attr:`pipemark.cost.Cost.total_flops`), the
        number :func:`pipemark.passes.auto_layers` balances.
    param_bytes:
        Bytes of the program inputs and constants the stage reads: what must be on the
        stage's device before it runs, rather than sent by another stage. In the
        totals row each program input counts once, however many stages read it.
    bytes_in, bytes_out:
        Bytes received from earlier stages; bytes handed to later stages or returned.
    share:
        ``flops`` as a fraction of the program's; ``None`` when the program does no
        arithmetic at all.
    approximate:
        True when the cost model could not count some equation exactly.
    """

    index: int
    name: str
    equations: int
    inputs: int
    outputs: int
    flops: int
    param_bytes: int
    bytes_in: int
    bytes_out: int
    share: float | None
    approximate: bool = False


def _check_staged(staged: Any, what: str) -> StagedJaxpr:
    if not isinstance(staged, StagedJaxpr):
        raise PipemarkError(
            f"{what} takes a StagedJaxpr, got {jaxpr_type_name(staged)}; make one with "
            "pm.split(fn, *args) or pm.passes.slice_stages(cj)."
        )
    return staged


def stage_rows(staged: StagedJaxpr) -> tuple[list[StageRow], StageRow]:
    """The rows of the stage table and the totals row.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(jnp.ones(4))
    >>> rows, total = stage_rows(pm.passes.slice_stages(pm.passes.insert_markers(cj, [1])))
    >>> [(r.name, r.flops, r.param_bytes, r.bytes_in) for r in rows]
    [('stage0', 4, 16, 0), ('stage1', 4, 16, 16)]
    >>> total.param_bytes  # both stages read the same input
    16
    """
    staged = _check_staged(staged, "stage_rows")
    costs = [estimate_cost(stage.closed_jaxpr) for stage in staged.stages]
    total_flops = sum(c.total_flops for c in costs)
    rows = []
    inputs_read: dict[int, int] = {}
    const_bytes = 0
    for k, (stage, cost) in enumerate(zip(staged.stages, costs)):
        jaxpr = stage.closed_jaxpr.jaxpr
        params = received = 0
        for ref, var in zip(stage.inputs, jaxpr.invars):
            size = _nbytes(var.aval)
            if ref.kind == "stage":
                received += size
            else:
                params += size
                inputs_read[ref.index] = size
        consts = sum(_nbytes(v.aval) for v in jaxpr.constvars)
        const_bytes += consts
        rows.append(
            StageRow(
                k,
                stage.name,
                stage.num_eqns,
                len(jaxpr.invars),
                len(jaxpr.outvars),
                cost.total_flops,
                params + consts,
                received,
                sum(_nbytes(v.aval) for v in jaxpr.outvars),
                cost.total_flops / total_flops if total_flops else None,
                cost.approximate,
            )
        )
    total = StageRow(
        -1,
        "total",
        sum(r.equations for r in rows),
        sum(r.inputs for r in rows),
        sum(r.outputs for r in rows),
        total_flops,
        sum(inputs_read.values()) + const_bytes,
        sum(r.bytes_in for r in rows),
        sum(r.bytes_out for r in rows),
        1.0 if total_flops else None,
        any(r.approximate for r in rows),
    )
    return rows, total


def format_count(n: int) -> str:
    """``n`` exactly below 10 000, else with three significant digits and an SI prefix.

    >>> format_count(9999), format_count(12345), format_count(59_219_712)
    ('9999', '12.3k', '59.2M')
    """
    if abs(n) < 10_000:
        return str(n)
    value = n / 1000.0
    for prefix in ("k", "M", "G", "T"):
        if abs(value) < 999.5:
            return f"{value:.3g}{prefix}"
        value /= 1000.0
    return f"{value:.3g}P" if abs(value) < 999.5 else f"{value:,.0f}P"


def format_bytes(n: int) -> str:
    """``n`` bytes in B, KiB, MiB … with three significant digits.

    >>> format_bytes(16), format_bytes(489_472), format_bytes(7_106_816)
    ('16 B', '478 KiB', '6.78 MiB')
    """
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024.0
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 999.5:
            return f"{value:.3g} {unit}"
        value /= 1024.0
    return f"{value:.3g} TiB" if abs(value) < 999.5 else f"{value:,.0f} TiB"


def format_share(share: float | None) -> str:
    return "-" if share is None else f"{100.0 * share:.1f} %"


_HEADER = (
    "#",
    "stage",
    "equations",
    "inputs",
    "outputs",
    "FLOPs",
    "param bytes",
    "bytes in",
    "bytes out",
    "cost share",
)
# Left-aligned columns; the others are numbers, aligned right.
_LEFT = frozenset({0, 1})


def _cells(row: StageRow) -> tuple[str, ...]:
    return (
        "" if row.index < 0 else str(row.index),
        row.name,
        str(row.equations),
        str(row.inputs),
        str(row.outputs),
        ("~" if row.approximate else "") + format_count(row.flops),
        format_bytes(row.param_bytes),
        format_bytes(row.bytes_in),
        format_bytes(row.bytes_out),
        format_share(row.share),
    )


def _plain_table(rows: Sequence[tuple[str, ...]], total: tuple[str, ...]) -> str:
    widths = [max(len(r[c]) for r in (_HEADER, *rows, total)) for c in range(len(_HEADER))]

    def line(cells: Sequence[str]) -> str:
        text = "  ".join(
            cell.ljust(w) if c in _LEFT else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(cells, widths))
        )
        return text.rstrip()

    rule = line(["-" * w for w in widths])
    return "\n".join([line(_HEADER), rule, *map(line, rows), rule, line(total)])


def _rich_table(
    rows: Sequence[tuple[str, ...]], total: tuple[str, ...], colors: list[str], swatches: bool
):
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE, show_footer=True, pad_edge=False)
    for c, title in enumerate(_HEADER):
        table.add_column(
            title,
            footer=total[c],
            justify="left" if c in _LEFT else "right",
            header_style="bold",
            footer_style="bold",
            no_wrap=True,
        )
    for cells, color in zip(rows, colors):
        # The colour swatch only means something on a terminal that shows colours.
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
    staged = _check_staged(staged, "summary")
    rows, total = stage_rows(staged)
    cells = [_cells(r) for r in rows]
    use_rich = style == "rich" or (style == "auto" and _have_rich())
    if not use_rich:
        return _plain_table(cells, _cells(total))
    if not _have_rich():
        raise PipemarkError("style='rich' needs rich: pip install rich (or 'pipemark[viz]').")
    from rich.console import Console

    buffer = io.StringIO()
    # Wide enough never to wrap a cell; no colour codes in a returned string.
    console = Console(
        file=buffer, width=400, color_system=None, force_terminal=False, force_jupyter=False
    )
    console.print(_rich_table(cells, _cells(total), stage_colors(staged), swatches=False))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")


def _program_inputs(staged: StagedJaxpr, stage: Any) -> list[tuple[str, Any]]:
    """``(name, aval)`` of each program input a stage reads, named by its pytree path
    in the traced function's arguments (:attr:`StagedJaxpr.input_names`)."""
    names = staged.input_names
    read = sorted(
        (ref.index, var.aval)
        for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars)
        if ref.kind == "input"
    )
    return [(names[index], aval) for index, aval in read]


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
    staged = _check_staged(staged, "stage_inputs")
    lines = ["program inputs each stage reads:"]
    for stage in staged.stages:
        read = [f"{name} {_type(aval)}" for name, aval in _program_inputs(staged, stage)]
        more = f", … {len(read) - limit} more" if len(read) > limit else ""
        lines.append(f"  {stage.name}: {', '.join(read[:limit]) or '(none)'}{more}")
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
    staged = _check_staged(staged, "stage_ends")
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
            print(f"  {name}: after {scope}", file=file)


def print_summary(staged: StagedJaxpr, file: Any = None) -> None:
    """Print the stage table to ``file`` (standard output by default): :func:`summary`,
    except that on a terminal, with ``rich`` installed, stage names are drawn in their
    colours."""
    import sys

    file = sys.stdout if file is None else file
    staged = _check_staged(staged, "print_summary")
    is_terminal = getattr(file, "isatty", lambda: False)()
    if not (is_terminal and _have_rich()):
        print(summary(staged), file=file)
        return
    from rich.console import Console

    rows, total = stage_rows(staged)
    console = Console(file=file)
    table = _rich_table(
        [_cells(r) for r in rows],
        _cells(total),
        stage_colors(staged),
        swatches=console.color_system is not None,
    )
    console.print(table)


# ---------------------------------------------------------------------------- colours


def stage_colors(staged: StagedJaxpr) -> list[str]:
    """One ``#rrggbb`` colour per stage. A backward stage ``<name>_backward`` gets the
    colour of its forward stage ``<name>``, so a layer reads as one colour both ways.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2)
    >>> staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    >>> colors = stage_colors(staged)
    >>> colors[0] == colors[3], colors[0] == colors[1]
    (True, False)
    """
    staged = _check_staged(staged, "stage_colors")
    assigned: dict[str, str] = {}
    colors = []
    next_color = 0
    for stage in staged.stages:
        name = stage.name
        partner = forward_name(name)
        if partner is not None and partner in assigned:
            color = assigned[partner]
        else:
            color = _PALETTE[next_color % len(_PALETTE)]
            next_color += 1
        assigned[name] = color
        colors.append(color)
    return colors


def _rgba(color: str, alpha: float) -> str:
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r}, {g}, {b}, {alpha})"


# --------------------------------------------------------------------- equation text


def _var_name(n: int) -> str:
    # a … z, ba … bz, ca …: the names JAX's own printer uses, so the two read alike.
    letters = "abcdefghijklmnopqrstuvwxyz"
    name = letters[n % 26]
    n //= 26
    while n:
        name = letters[n % 26] + name
        n //= 26
    return name


class _Namer:
    """Names for the variables of all stages at once, so that a value keeps its name
    from the stage that makes it to the stages that read it."""

    def __init__(self) -> None:
        self.names: dict[Var, str] = {}

    def name(self, var: Var) -> str:
        found = self.names.get(var)
        if found is None:
            found = self.names[var] = _var_name(len(self.names))
        return found

    def alias(self, var: Var, name: str) -> None:
        self.names.setdefault(var, name)


def _type(aval: Any) -> str:
    try:
        return aval.str_short(short_dtypes=True)
    except (AttributeError, TypeError):
        return str(aval)


def _param_text(value: Any) -> str:
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
        jaxpr = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        return f"{{jaxpr: {len(jaxpr.eqns)} equations}}"
    if isinstance(value, (tuple, list)) and any(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
        return f"({len(value)} jaxprs)"
    text = str(value)
    return text if len(text) <= 48 else text[:45] + "..."


def _literal_text(atom: Literal) -> str:
    value = atom.val
    try:
        import numpy as np

        array = np.asarray(value)
        if array.ndim == 0:
            # str of a 0-d array prints a float32 as float32 (1e-05), not as the
            # nearest double (9.99999974e-06).
            return str(array)
    except (TypeError, ValueError):
        pass
    return str(value)


# Parameters that say nothing about the computation (placement, compiler hints); a
# parameter whose value is None is left out too.
_PARAMS_HIDDEN = frozenset(
    {
        "in_shardings",
        "out_shardings",
        "in_layouts",
        "out_layouts",
        "donated_invars",
        "ctx_mesh",
        "keep_unused",
        "inline",
        "compiler_options_kvs",
        "out_sharding",
        "sharding",
    }
)


def _eqn_html(eqn: JaxprEqn, namer: _Namer, boundary: set[Var]) -> str:
    def atom(a: Any) -> str:
        if isinstance(a, Literal):
            return html.escape(_literal_text(a))
        if isinstance(a, DropVar):  # a result nobody reads, written `_` as JAX does
            return "_"
        text = html.escape(namer.name(a))
        return f'<span class="pm-b">{text}</span>' if a in boundary else text

    outs = " ".join(
        f'{atom(v)}:<span class="pm-t">{html.escape(_type(v.aval))}</span>' for v in eqn.outvars
    )
    params = [
        f"{key}={_param_text(value)}"
        for key, value in eqn.params.items()
        if value is not None and key not in _PARAMS_HIDDEN
    ]
    prim = f'<span class="pm-p">{html.escape(eqn.primitive.name)}</span>'
    if params:
        prim += f'<span class="pm-q">[{html.escape(" ".join(params))}]</span>'
    ins = " ".join(atom(a) for a in eqn.invars)
    return f"{outs or '_'} = {prim} {ins}".rstrip()


# ------------------------------------------------------------------------------ HTML

_CSS = """
.pipemark-view { font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
  font-size: 14px; line-height: 1.45; color: inherit; max-width: 100%; }
.pipemark-view .pm-caption { margin: 0 0 6px 0; opacity: 0.8; }
.pipemark-view table.pm-summary { border-collapse: collapse; margin: 4px 0 12px 0;
  font-variant-numeric: tabular-nums; }
.pipemark-view .pm-summary th, .pipemark-view .pm-summary td { padding: 4px 12px;
  text-align: right; white-space: nowrap; border: none; color: inherit; }
.pipemark-view .pm-summary th.pm-l, .pipemark-view .pm-summary td.pm-l { text-align: left; }
.pipemark-view .pm-summary thead th { font-weight: 600;
  border-bottom: 2px solid rgba(128, 128, 128, 0.55); }
.pipemark-view .pm-summary tbody tr:nth-child(even) { background: rgba(128, 128, 128, 0.08); }
.pipemark-view .pm-summary tfoot td { font-weight: 600;
  border-top: 2px solid rgba(128, 128, 128, 0.55); }
.pipemark-view .pm-swatch { display: inline-block; width: 10px; height: 10px;
  border-radius: 2px; margin-right: 6px; vertical-align: baseline; }
.pipemark-view .pm-share { display: inline-block; white-space: nowrap; }
.pipemark-view .pm-track { display: inline-block; width: 90px; height: 9px;
  margin-right: 10px; vertical-align: middle; text-align: left;
  background: rgba(128, 128, 128, 0.15); border-radius: 2px; }
.pipemark-view .pm-bar { display: block; height: 100%; border-radius: 2px; }
.pipemark-view details.pm-stage { border-left: 5px solid var(--pm-color);
  background: var(--pm-tint); margin: 6px 0; border-radius: 0 4px 4px 0; }
.pipemark-view details.pm-stage > summary { cursor: pointer; padding: 5px 10px;
  list-style-position: inside; }
.pipemark-view .pm-name { font-weight: 700; }
.pipemark-view .pm-meta { opacity: 0.8; margin-left: 8px; }
.pipemark-view .pm-io { padding: 2px 12px 4px 12px; font-size: 12.5px; }
.pipemark-view .pm-io-label { font-weight: 600; margin-right: 4px; }
.pipemark-view .pm-eqns { margin: 0; padding: 6px 12px 8px 12px;
  font-family: ui-monospace, "SFMono-Regular", Menlo, Consolas, "DejaVu Sans Mono",
  monospace; font-size: 12.5px; line-height: 1.5; }
.pipemark-view .pm-e { white-space: pre-wrap; overflow-wrap: anywhere;
  padding-left: 3em; text-indent: -3em; }
.pipemark-view .pm-b { background: rgba(255, 190, 0, 0.38); border-radius: 3px;
  padding: 0 2px; font-weight: 600; }
.pipemark-view .pm-t { opacity: 0.7; }
.pipemark-view .pm-p { font-weight: 600; }
.pipemark-view .pm-q { opacity: 0.7; }
.pipemark-view .pm-more { font-style: italic; opacity: 0.75; }
"""


def _css() -> str:
    return " ".join(line.strip() for line in _CSS.strip().splitlines())


def _table_html(rows: list[StageRow], total: StageRow, colors: list[str]) -> str:
    head = "".join(
        f'<th class="pm-l">{html.escape(t)}</th>' if c in _LEFT else f"<th>{html.escape(t)}</th>"
        for c, t in enumerate(_HEADER)
    )
    body = []
    largest = max((r.share or 0.0 for r in rows), default=0.0)
    for row, color in zip(rows, colors):
        cells = [html.escape(c) for c in _cells(row)]
        # Bars are scaled to the largest stage, so that imbalance is what stands out.
        width = 0.0 if not row.share or not largest else 100.0 * row.share / largest
        bar = (
            f'<span class="pm-track"><span class="pm-bar" '
            f'style="width: {width:.1f}%; background: {color}"></span></span>'
        )
        body.append(
            "<tr>"
            f'<td class="pm-l"><span class="pm-swatch" style="background: {color}"></span>'
            f"{cells[0]}</td>"
            f'<td class="pm-l">{cells[1]}</td>'
            + "".join(f"<td>{c}</td>" for c in cells[2:-1])
            + f'<td><span class="pm-share">{bar}{cells[-1]}</span></td>'
            "</tr>"
        )
    foot = "".join(
        f'<td class="pm-l">{html.escape(c)}</td>' if i in _LEFT else f"<td>{html.escape(c)}</td>"
        for i, c in enumerate(_cells(total))
    )
    return (
        '<table class="pm-summary">'
        f"<thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody>"
        f"<tfoot><tr>{foot}</tr></tfoot>"
        "</table>"
    )


def _value_list(values: Sequence[tuple[str, str, str]], limit: int = 40) -> str:
    parts = [
        f'<span class="pm-b">{html.escape(name)}</span>:{html.escape(ty)}'
        + (f" ({html.escape(where)})" if where else "")
        for name, ty, where in values[:limit]
    ]
    if len(values) > limit:
        parts.append(f'<span class="pm-more">and {len(values) - limit} more</span>')
    return ", ".join(parts)


def to_html(
    staged: StagedJaxpr,
    *,
    max_eqns_per_stage: int = 500,
    open_stages: bool | None = None,
) -> str:
    """The HTML view of a staged program: the stage table, then each stage's equations.

    Each stage is a ``<details>`` block in the stage's colour; its summary line gives
    the equation count and FLOPs, then the values it receives from earlier stages and
    the values it hands on, and its equations. Variables have one name across stages,
    and the values that cross a stage boundary are highlighted wherever they appear.

    Parameters
    ----------
    max_eqns_per_stage:
        Show at most this many equations of each stage (a note says how many more).
    open_stages:
        Whether the stage blocks start expanded; by default they do when the program
        has at most 300 equations.

    Returns
    -------
    str
        A ``<div class="pipemark-view">`` fragment with its own ``<style>``; no script,
        no external resource. It is well-formed XML.
    """
    staged = _check_staged(staged, "to_html")
    rows, total = stage_rows(staged)
    colors = stage_colors(staged)
    if open_stages is None:
        open_stages = total.equations <= 300
    namer = _Namer()
    for i, var in enumerate(staged.invars):
        namer.alias(var, _var_name(i))
    # Every variable a stage receives from another stage or hands on to one.
    boundary: set[Var] = set()
    readers: dict[tuple[int, int], list[str]] = {}
    for stage in staged.stages:
        for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars):
            if ref.kind == "stage":
                boundary.add(var)
                readers.setdefault((ref.stage, ref.index), []).append(stage.name)
    for k, ref in enumerate(staged.outputs):
        if ref.kind == "stage":
            readers.setdefault((ref.stage, ref.index), []).append(f"result {k}")
    parts = [
        f'<div class="pipemark-view"><style>{_css()}</style>',
        f'<p class="pm-caption">{len(rows)} stages, {total.equations} equations, '
        f"{html.escape(format_count(total.flops))} FLOPs. Values sent between stages are "
        '<span class="pm-b">highlighted</span>.</p>',
        _table_html(rows, total, colors),
    ]
    outvar_names: list[list[str]] = []
    for k, (stage, row, color) in enumerate(zip(staged.stages, rows, colors)):
        jaxpr = stage.closed_jaxpr.jaxpr
        received = []
        for ref, var in zip(stage.inputs, jaxpr.invars):
            if ref.kind == "stage":
                namer.alias(var, outvar_names[ref.stage][ref.index])
                received.append(
                    (namer.name(var), _type(var.aval), f"from {staged.stages[ref.stage].name}")
                )
            elif ref.kind == "input":
                namer.alias(var, _var_name(ref.index))
        stage_boundary = boundary | {v for v in jaxpr.outvars if isinstance(v, Var)}
        # One block per equation: a long one wraps with a hanging indent.
        lines = [
            f'<div class="pm-e">{_eqn_html(eqn, namer, stage_boundary)}</div>'
            for eqn in jaxpr.eqns[:max_eqns_per_stage]
        ]
        if len(jaxpr.eqns) > max_eqns_per_stage:
            lines.append(
                f'<div class="pm-e pm-more">… {len(jaxpr.eqns) - max_eqns_per_stage} more '
                "equations</div>"
            )
        names = [namer.name(v) if isinstance(v, Var) else _literal_text(v) for v in jaxpr.outvars]
        outvar_names.append(names)
        sent = [
            (
                names[i],
                _type(v.aval),
                "to " + ", ".join(readers.get((k, i), ["nobody"])),
            )
            for i, v in enumerate(jaxpr.outvars)
        ]
        style = f"--pm-color: {color}; --pm-tint: {_rgba(color, 0.09)}"
        meta = (
            f"{row.equations} equations · {format_count(row.flops)} FLOPs · "
            f"{format_share(row.share)} · in {format_bytes(row.bytes_in)} · "
            f"out {format_bytes(row.bytes_out)}"
        )
        open_attr = ' open="open"' if open_stages else ""
        parts.append(
            f'<details class="pm-stage" style="{style}"{open_attr}>'
            f'<summary><span class="pm-name">{k} · {html.escape(stage.name)}</span>'
            f'<span class="pm-meta">{html.escape(meta)}</span></summary>'
        )
        read = [
            (name, _type(aval), "program input") for name, aval in _program_inputs(staged, stage)
        ]
        if read:
            parts.append(
                '<div class="pm-io"><span class="pm-io-label">reads</span>'
                f"{_value_list(read)}</div>"
            )
        if received:
            parts.append(
                '<div class="pm-io"><span class="pm-io-label">receives</span>'
                f"{_value_list(received)}</div>"
            )
        parts.append(f'<div class="pm-eqns">{"".join(lines)}</div>')
        if sent:
            parts.append(
                '<div class="pm-io"><span class="pm-io-label">sends</span>'
                f"{_value_list(sent)}</div>"
            )
        parts.append("</details>")
    parts.append("</div>")
    return "".join(parts)


class HTMLView:
    """An HTML view that notebooks display (``_repr_html_``) and that can be saved.

    ``str(view)`` is the plain-text stage table.
    """

    def __init__(self, staged: StagedJaxpr, html_text: str) -> None:
        self.staged = staged
        self.html = html_text

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return summary(self.staged, style="plain")

    def __repr__(self) -> str:
        return f"<HTMLView of {self.staged!r}>"

    def save(self, path: str | Path, *, title: str = "pipemark stages") -> Path:
        """Write a standalone HTML page holding this view; returns the path."""
        path = Path(path)
        path.write_text(_page(title, "", self.html), encoding="utf-8")
        return path


def _as_staged(program: Any) -> StagedJaxpr:
    if isinstance(program, StagedJaxpr):
        return program
    if isinstance(program, ClosedJaxpr):
        from pipemark.passes.inline import inline_calls
        from pipemark.passes.insert import layers_from_boundaries
        from pipemark.passes.slice import slice_stages
        from pipemark.primitive import is_marker

        program = inline_calls(program)
        if any(is_marker(eqn, "boundary") for eqn in program.jaxpr.eqns):
            program = layers_from_boundaries(program)
        return slice_stages(program)
    raise PipemarkError(
        f"show takes a marked ClosedJaxpr or a StagedJaxpr, got {type(program).__name__}; "
        "trace a function first: jax.make_jaxpr(fn)(*args)."
    )


def show(program: ClosedJaxpr | StagedJaxpr, **options: Any) -> HTMLView:
    """The HTML view of a marked ``ClosedJaxpr`` (sliced at its markers) or of a
    ``StagedJaxpr``. In a notebook, leave it as a cell's last expression to display it.

    ``options`` go to :func:`to_html`. A program without stage markers raises
    :class:`~pipemark.errors.MarkerError`; cut it with ``pm.passes.auto_layers`` first.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = jnp.sin(x)
    ...     pm.mark_pipeline_boundary()
    ...     return jnp.cos(x)
    >>> view = show(jax.make_jaxpr(f)(1.0))
    >>> view._repr_html_().startswith('<div class="pipemark-view">')
    True
    """
    staged = _as_staged(program)
    return HTMLView(staged, to_html(staged, **options))


# ----------------------------------------------------------------------------- pages

_PAGE_CSS = """
:root { color-scheme: light dark; }
body { margin: 0; padding: 24px 32px 48px 32px; background: Canvas; color: CanvasText;
  font-family: system-ui, -apple-system, "Segoe UI", sans-serif; }
main { max-width: 1200px; margin: 0 auto; }
h1 { font-size: 24px; margin: 0 0 4px 0; }
h2 { font-size: 18px; margin: 28px 0 8px 0; }
p.pm-lead { margin: 0 0 16px 0; opacity: 0.85; }
img.pm-plot { max-width: 100%; height: auto; background: #ffffff; border-radius: 6px;
  border: 1px solid rgba(128, 128, 128, 0.35); }
pre.pm-text { font-size: 12.5px; overflow-x: auto; }
"""


def _page(title: str, lead_html: str, body_html: str) -> str:
    css = " ".join(line.strip() for line in _PAGE_CSS.strip().splitlines())
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8" />'
        '<meta name="viewport" content="width=device-width, initial-scale=1" />'
        f"<title>{html.escape(title)}</title><style>{css}</style></head>"
        f"<body><main><h1>{html.escape(title)}</h1>{lead_html}{body_html}</main></body></html>\n"
    )


def write_report(
    staged: StagedJaxpr,
    path: str | Path,
    *,
    title: str = "pipemark stages",
    description: str = "",
    png: bytes | None = None,
    sections: Sequence[tuple[str, str]] = (),
    **options: Any,
) -> Path:
    """Write a standalone HTML report: a title, ``description`` (plain text), the plot
    (``png`` bytes, embedded as a data URL), the HTML view, and extra ``sections``
    (``(heading, preformatted text)`` pairs). Returns the path.

    The page needs nothing but itself: no script, no network. It follows the reader's
    light or dark colour scheme.
    """
    import base64

    staged = _check_staged(staged, "write_report")
    lead = f'<p class="pm-lead">{html.escape(description)}</p>' if description else ""
    body = []
    if png is not None:
        data = base64.b64encode(png).decode("ascii")
        body.append(
            '<img class="pm-plot" alt="stage graph and cost per stage" '
            f'src="data:image/png;base64,{data}" />'
        )
    body.append("<h2>Stages</h2>")
    body.append(to_html(staged, **options))
    for heading, text in sections:
        body.append(f"<h2>{html.escape(heading)}</h2>")
        body.append(f'<pre class="pm-text">{html.escape(text)}</pre>')
    path = Path(path)
    path.write_text(_page(title, lead, "".join(body)), encoding="utf-8")
    return path
