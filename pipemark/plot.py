"""A picture of a staged program: its stage graph and the cost of each stage.

matplotlib (the ``viz`` extra) is imported only when a plot is drawn, so ``import
pipemark`` never needs it; no pyplot state is touched, so plotting works headless.
"""

from __future__ import annotations

import math
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.roles import BACKWARD
from pipemark.staged import StagedJaxpr
from pipemark.views.rows import (
    check_staged,
    display_name,
    format_bytes,
    format_count,
    format_share,
    stage_colors,
    stage_rows,
)

__all__ = ["INK", "plot", "stage_layout"]

#: The colour of every text, axis and arrow: a mid grey that reads on a white page and
#: on a dark one (contrast about 3.7:1 on white, 5:1 on #111), since the figure has no
#: background of its own (it is transparent: no white card on a dark page).
INK = "#7b8794"


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PipemarkError(
            "plot needs matplotlib: pip install 'pipemark[viz]' (or matplotlib)."
        ) from None
    return Figure


def stage_layout(staged: StagedJaxpr) -> dict[str, tuple[float, float]]:
    """Where each stage is drawn, ``name -> (x, y)``.

    Stages sit in one row in the order they run. When the forward stage of every
    backward (and weight) stage is in the program (by their
    :attr:`~pipemark.staged.Stage.role`), forward stages form the top row and each backward
    stage sits under its forward stage, so a training step reads as a U: forward left to
    right, backward right to left.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2)
    >>> stage_layout(pm.split(jax.value_and_grad(ex.loss_fn), *ex.args))
    {'layer0': (0.0, 1.0), 'layer1': (1.0, 1.0), 'layer1_backward': (1.0, 0.0), 'layer0_backward': (0.0, 0.0)}
    """
    staged = check_staged(staged, "stage_layout")
    stages = staged.stages
    names = [s.name for s in stages]
    known = set(names)
    owned = [s for s in stages if s.role.owner is not None]
    paired = owned and all(s.role.owner in known for s in owned)
    if not paired:
        return {name: (float(k), 0.0) for k, name in enumerate(names)}
    layout: dict[str, tuple[float, float]] = {}
    column = 0
    for stage in stages:
        if stage.role.owner is None:
            layout[stage.name] = (float(column), 1.0)
            column += 1
    for stage in owned:
        # A weight-gradient stage (pm.passes.split_backward) sits under its backward.
        row = 0.0 if stage.role.kind == BACKWARD else -1.0
        layout[stage.name] = (layout[stage.role.owner][0], row)
    return {name: layout[name] for name in names}


def _draw_graph(ax: Any, staged: StagedJaxpr, colors: list[str]) -> None:
    layout = stage_layout(staged)
    edges = [(u, v, int(d.get("bytes", 0))) for u, v, d in staged.graph.edges(data=True)]
    largest = max((b for _, _, b in edges), default=0)
    two_rows = len({y for _, y in layout.values()}) > 1
    for u, v, size in edges:
        _draw_edge(ax, layout[u], layout[v], size, largest, two_rows)
    for k, (stage, color) in enumerate(zip(staged.stages, colors)):
        owned = stage.role.owner is not None
        _draw_stage(ax, k, display_name(stage.name), layout[stage.name], color, two_rows, owned)
    xs = [x for x, _ in layout.values()]
    ys = [y for _, y in layout.values()]
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax.set_axis_off()
    note = f"arrow width grows with the bytes sent (largest {format_bytes(largest)})"
    ax.set_title("stage graph", fontsize=11, loc="left", color=INK)
    ax.text(0.0, -0.02, note, transform=ax.transAxes, fontsize=8, color=INK, va="top")


def _draw_edge(ax: Any, start: tuple, stop: tuple, size: int, largest: int, two_rows: bool) -> None:
    from matplotlib.patches import FancyArrowPatch

    (x0, y0), (x1, y1) = start, stop
    # Edges between neighbours in a row are straight; longer jumps bow away from
    # the other row (upwards in a single row) so that they do not run through the
    # stages in between. arc3 bends left of the direction of travel for rad > 0.
    same_row = y0 == y1
    upward = y0 > 0 or not two_rows
    rad = 0.0
    if same_row and abs(x1 - x0) > 1:
        rad = (-0.3 if upward else 0.3) * (1 if x1 > x0 else -1)
    elif not same_row and x0 != x1:
        rad = 0.15
    width = 1.0 + 7.0 * math.sqrt(size / largest) if largest else 1.0
    arrow = FancyArrowPatch(
        (x0, y0),
        (x1, y1),
        arrowstyle="-|>",
        mutation_scale=10 + 1.5 * width,
        linewidth=width,
        color=INK,
        alpha=0.7,
        shrinkA=19,
        shrinkB=19,
        connectionstyle=f"arc3,rad={rad}",
        zorder=1,
    )
    ax.add_patch(arrow)
    # The label sits on the arrow's own bounding box, which matplotlib knows only
    # when it draws: beside a vertical arrow, on top of a straight or upward one.
    if not same_row:
        where, offset, ha, va = (1.0, 0.5), (4, 0), "left", "center"
    elif rad == 0 or upward:
        where, offset, ha, va = (0.5, 1.0), (0, 3), "center", "bottom"
    else:
        where, offset, ha, va = (0.5, 0.0), (0, -3), "center", "top"
    ax.annotate(
        format_bytes(size),
        where,
        xycoords=arrow,
        xytext=offset,
        textcoords="offset points",
        fontsize=8,
        color=INK,
        ha=ha,
        va=va,
        zorder=3,
    )


def _draw_stage(
    ax: Any, k: int, name: str, at: tuple, color: str, two_rows: bool, backward: bool
) -> None:
    """Stage ``k`` at ``at``; a backward or weight stage (``backward``) hatched."""
    x, y = at
    ax.scatter(
        [x],
        [y],
        s=900,
        c=[color],
        edgecolors=INK if not backward else color,
        linewidths=1.2,
        hatch="////" if backward else None,
        zorder=2,
    )
    ax.text(
        x, y, str(k), ha="center", va="center", fontsize=10, color="white", zorder=4,
        fontweight="bold",
    )  # fmt: skip
    # Labels go where no arc bows: above the top row of a U, below a single row.
    above = two_rows and y > 0
    ax.annotate(
        name,
        (x, y),
        xytext=(0, 22 if above else -22),
        textcoords="offset points",
        ha="center",
        va="bottom" if above else "top",
        fontsize=9,
        color=INK,
        zorder=4,
    )


def _draw_costs(ax: Any, staged: StagedJaxpr, colors: list[str]) -> None:
    from matplotlib.ticker import FuncFormatter

    rows, total = stage_rows(staged)
    values = [r.flops for r in rows]
    positions = list(range(len(rows)))
    bars = ax.barh(positions, values, color=colors, edgecolor=INK, linewidth=0.6)
    for bar, row in zip(bars, rows):
        if staged.stages[row.index].role.owner is not None:
            bar.set_hatch("////")
            bar.set_edgecolor("white")
    ax.set_yticks(positions, labels=[f"{r.index} {display_name(r.name)}" for r in rows], fontsize=9)
    ax.invert_yaxis()
    largest = max(values, default=0)
    for position, row in zip(positions, rows):
        ax.annotate(
            f"{format_count(row.flops)}  {format_share(row.share)}",
            (row.flops, position),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color=INK,
        )
    ax.set_xlim(0, largest * 1.35 if largest else 1)
    ax.set_xlabel("FLOPs (incl. transcendentals)", fontsize=9, color=INK)
    ax.tick_params(axis="x", labelsize=8, colors=INK)
    ax.tick_params(axis="y", colors=INK)
    for side in ("bottom", "left"):
        ax.spines[side].set_color(INK)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_count(int(value))))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"cost per stage (total {format_count(total.flops)} FLOPs)",
        fontsize=11,
        loc="left",
        color=INK,
    )


def plot(staged: StagedJaxpr, *, title: str | None = None) -> Any:
    """Draw ``staged``: the stage graph (one node per stage, in its colour; an arrow per
    pair of stages a value crosses, as wide as the bytes sent) and a bar chart of the
    FLOPs of each stage. Backward stages are hatched. The figure is transparent and
    its text is grey (:data:`INK`), so it reads on light and dark pages alike.

    Returns
    -------
    matplotlib.figure.Figure
        Save it with ``fig.savefig("stages.png")``; a notebook displays it.

    Examples
    --------
    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=3)
    >>> fig = plot(pm.split(jax.value_and_grad(ex.loss_fn), *ex.args))
    >>> [ax.get_title(loc="left") for ax in fig.axes][0]
    'stage graph'
    """
    staged = check_staged(staged, "plot")
    if not staged.stages:
        raise PipemarkError("plot: the program has no stages to draw.")
    figure_class = _figure_class()
    colors = stage_colors(staged)
    columns = len({x for x, _ in stage_layout(staged).values()})
    graph_width = min(max(4.0, 1.5 * columns), 14.0)
    height = max(3.6, 0.32 * len(staged.stages) + 1.6)
    fig = figure_class(figsize=(graph_width + 5.5, height), layout="constrained")
    graph_ax, cost_ax = fig.subplots(1, 2, width_ratios=[graph_width, 5.0])
    # Transparent: the page's own background shows, light or dark.
    for patch in (fig.patch, graph_ax.patch, cost_ax.patch):
        patch.set_alpha(0.0)
    _draw_graph(graph_ax, staged, colors)
    _draw_costs(cost_ax, staged, colors)
    if title:
        fig.suptitle(title, fontsize=12, color=INK)
    return fig
