"""The HTML view of a staged program for notebooks and reports: the stage table, then
the program, each stage's equations in the stage's own colour, one collapsible block
per stage, with the values that cross stage boundaries highlighted. The HTML is
self-contained (one ``<style>`` element, no script, no network) and well-formed XML,
and it inherits the page's text colour so that it reads in light and dark notebook
themes alike.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from pipemark._text import plural
from pipemark.rendering import register_view
from pipemark.staged import StagedJaxpr
from pipemark.views.rows import (
    COLUMN_MEANINGS,
    COLUMNS,
    LEFT_COLUMNS,
    StageRow,
    check_staged,
    display_name,
    format_bytes,
    format_count,
    format_share,
    program_inputs,
    row_cells,
    stage_colors,
    stage_rows,
    type_text,
)
from pipemark.views.text import summary

__all__ = ["HTMLView", "to_html", "write_report"]


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


def _param_text(value: Any) -> str:
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
        jaxpr = value.jaxpr if isinstance(value, ClosedJaxpr) else value
        return f"{{jaxpr: {plural(len(jaxpr.eqns), 'equation')}}}"
    if isinstance(value, (tuple, list)) and any(isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value):
        return f"({len(value)} jaxprs)"
    text = display_name(value)  # a marker name with control characters, say
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
        f'{atom(v)}:<span class="pm-t">{html.escape(type_text(v.aval))}</span>' for v in eqn.outvars
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
.pipemark-view .pm-scroll { overflow-x: auto; max-width: 100%; }
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
    left = ' class="pm-l"'
    head = "".join(
        f"<th{left if c in LEFT_COLUMNS else ''} "
        f'title="{html.escape(meaning)}">{html.escape(t)}</th>'
        for c, (t, meaning) in enumerate(zip(COLUMNS, COLUMN_MEANINGS))
    )
    body = []
    largest = max((r.share or 0.0 for r in rows), default=0.0)
    for row, color in zip(rows, colors):
        cells = [html.escape(c) for c in row_cells(row)]
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
        f'<td class="pm-l">{html.escape(c)}</td>'
        if i in LEFT_COLUMNS
        else f"<td>{html.escape(c)}</td>"
        for i, c in enumerate(row_cells(total))
    )
    # The table scrolls inside its own box when it is wider than the page or cell
    # around it, so the page itself never scrolls sideways.
    return (
        '<div class="pm-scroll"><table class="pm-summary">'
        f"<thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody>"
        f"<tfoot><tr>{foot}</tr></tfoot>"
        "</table></div>"
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
    staged = check_staged(staged, "to_html")
    rows, total = stage_rows(staged)
    colors = stage_colors(staged)
    if open_stages is None:
        open_stages = total.equations <= 300
    namer = _Namer()
    for i, var in enumerate(staged.invars):
        namer.alias(var, _var_name(i))
    boundary, readers = _crossings(staged)
    parts = [
        f'<div class="pipemark-view"><style>{_css()}</style>',
        f'<p class="pm-caption">{plural(len(rows), "stage")}, '
        f"{plural(total.equations, 'equation')}, "
        f"{html.escape(format_count(total.flops))} FLOPs. Values sent between stages are "
        '<span class="pm-b">highlighted</span>.</p>',
        _table_html(rows, total, colors),
    ]
    outvar_names: list[list[str]] = []
    for k, (row, color) in enumerate(zip(rows, colors)):
        view = _StageView(staged, k, namer, (outvar_names, boundary, readers), max_eqns_per_stage)
        parts.append(view.html(row, color, open_stages))
    parts.append("</div>")
    return "".join(parts)


register_view(StagedJaxpr, "html", to_html)  # StagedJaxpr._repr_html_, for notebooks


def _crossings(staged: StagedJaxpr) -> tuple[set[Var], dict[tuple[int, int], list[str]]]:
    """Every variable a stage receives from another stage, and who reads each stage
    result (stage names, or ``result k`` for the program's results)."""
    boundary: set[Var] = set()
    readers: dict[tuple[int, int], list[str]] = {}
    for stage in staged.stages:
        for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars):
            if ref.kind == "stage":
                boundary.add(var)
                readers.setdefault((ref.stage, ref.index), []).append(display_name(stage.name))
    for k, ref in enumerate(staged.outputs):
        if ref.kind == "stage":
            readers.setdefault((ref.stage, ref.index), []).append(f"result {k}")
    return boundary, readers


class _StageView:
    """One stage's ``<details>`` block. Names its variables in ``namer`` in the order
    they appear (a received value takes the name its stage gave it, in
    ``outvar_names``) and appends its own result names to ``outvar_names``."""

    def __init__(self, staged, k, namer, crossings, limit: int) -> None:
        outvar_names, boundary, readers = crossings
        self.staged, self.k, self.namer = staged, k, namer
        self.stage = staged.stages[k]
        self.jaxpr = self.stage.closed_jaxpr.jaxpr
        self.received = []
        for ref, var in zip(self.stage.inputs, self.jaxpr.invars):
            if ref.kind == "stage":
                namer.alias(var, outvar_names[ref.stage][ref.index])
                source = f"from {display_name(staged.stages[ref.stage].name)}"
                self.received.append((namer.name(var), type_text(var.aval), source))
            elif ref.kind == "input":
                namer.alias(var, _var_name(ref.index))
        outvars = self.jaxpr.outvars
        self.boundary = boundary | {v for v in outvars if isinstance(v, Var)}
        self.eqns_html = self.equations(limit)
        names = [namer.name(v) if isinstance(v, Var) else _literal_text(v) for v in outvars]
        outvar_names.append(names)
        self.sent = [
            (names[i], type_text(v.aval), "to " + ", ".join(readers.get((k, i), ["nobody"])))
            for i, v in enumerate(outvars)
        ]

    def equations(self, limit: int) -> str:
        # One block per equation: a long one wraps with a hanging indent.
        eqns = self.jaxpr.eqns
        lines = [
            f'<div class="pm-e">{_eqn_html(eqn, self.namer, self.boundary)}</div>'
            for eqn in eqns[:limit]
        ]
        if len(eqns) > limit:
            more = plural(len(eqns) - limit, "more equation", "more equations")
            lines.append(f'<div class="pm-e pm-more">… {more}</div>')
        return f'<div class="pm-eqns">{"".join(lines)}</div>'

    def html(self, row: StageRow, color: str, open_stages: bool) -> str:
        style = f"--pm-color: {color}; --pm-tint: {_rgba(color, 0.09)}"
        meta = (
            f"{plural(row.equations, 'equation')} · {format_count(row.flops)} FLOPs · "
            f"{format_share(row.share)} · in {format_bytes(row.bytes_in)} · "
            f"out {format_bytes(row.bytes_out)}"
        )
        open_attr = ' open="open"' if open_stages else ""
        read = [
            (display_name(name), type_text(aval), "program input")
            for name, aval in program_inputs(self.staged, self.stage)
        ]
        parts = [
            f'<details class="pm-stage" style="{style}"{open_attr}>'
            f'<summary><span class="pm-name">{self.k} · {html.escape(display_name(self.stage.name))}</span>'
            f'<span class="pm-meta">{html.escape(meta)}</span></summary>',
            _io("reads", read),
            _io("receives", self.received),
            self.eqns_html,
            _io("sends", self.sent),
            "</details>",
        ]
        return "".join(parts)


def _io(label: str, values: list[tuple[str, str, str]]) -> str:
    if not values:
        return ""
    return f'<div class="pm-io"><span class="pm-io-label">{label}</span>{_value_list(values)}</div>'


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


# ----------------------------------------------------------------------------- pages

_PAGE_CSS = """
:root { color-scheme: light dark; }
body { margin: 0; padding: 24px 32px 48px 32px; background: Canvas; color: CanvasText;
  font-family: system-ui, -apple-system, "Segoe UI", sans-serif; }
main { max-width: 1200px; margin: 0 auto; }
h1 { font-size: 24px; margin: 0 0 4px 0; }
h2 { font-size: 18px; margin: 28px 0 8px 0; }
p.pm-lead { margin: 0 0 16px 0; opacity: 0.85; }
img.pm-plot { max-width: 100%; height: auto; border-radius: 6px;
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

    staged = check_staged(staged, "write_report")
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
