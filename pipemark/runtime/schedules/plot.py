"""Draw a :class:`~pipemark.runtime.schedules.Schedule` as the usual device × time grid.

matplotlib is imported only when a plot is drawn, so ``import pipemark`` never needs it.
"""

from __future__ import annotations

from typing import Any

from pipemark._text import format_share
from pipemark.errors import PipemarkError
from pipemark.runtime.schedules.core import FORWARD, WEIGHT, Schedule

__all__ = ["plot_schedule"]


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PipemarkError(
            "plot_schedule needs matplotlib: pip install 'pipemark[viz]' (or matplotlib)."
        ) from None
    return Figure


def plot_schedule(schedule: Schedule, *, ax: Any = None, title: str | None = None) -> Any:
    """Plot ``schedule``: one row per device, one column per tick, each action a box
    labelled with its microbatch (and stage, when a device holds several), forwards
    light and backwards dark, one hue per microbatch. Idle cells stay blank.

    Parameters
    ----------
    schedule:
        The schedule to draw (see :func:`pipemark.make_schedule`).
    ax:
        A matplotlib ``Axes`` to draw on; by default a new figure is made.
    title:
        The plot title; by default the schedule's name, sizes and bubble fraction.

    Returns
    -------
    matplotlib.figure.Figure
        The figure drawn on (no pyplot state is touched, so it works headless; call
        ``fig.savefig(path)`` or display it in a notebook).

    Examples
    --------
    >>> import pipemark as pm
    >>> fig = pm.runtime.plot_schedule(pm.make_schedule("1f1b", 4, 8))
    >>> len(fig.axes[0].patches)  # one box per action
    64
    """
    if not isinstance(schedule, Schedule):
        raise PipemarkError(
            f"plot_schedule takes a Schedule, got {type(schedule).__name__}; build one with "
            "pm.make_schedule(kind, num_stages, num_microbatches)."
        )
    if ax is None:
        figure_class = _matplotlib()
        width = min(max(4.0, 0.45 * schedule.num_ticks + 1.5), 30.0)
        fig = figure_class(figsize=(width, 0.55 * schedule.num_devices + 1.2))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle

    cmap = colormaps["tab10"]
    single = len(set(schedule.stage_devices)) == schedule.num_stages
    font = 7 if single else 5
    for t, d, action in schedule.actions():
        color = cmap(action.microbatch % 10)
        forward = action.kind == FORWARD
        # Forward light, backward hatched, weight (split backward) cross-hatched.
        hatch = None if forward else ("xx" if action.kind == WEIGHT else "//")
        ax.add_patch(
            Rectangle(
                (t, d - 0.4),
                1.0,
                0.8,
                facecolor=color,
                alpha=0.45 if forward else 0.95,
                edgecolor="black",
                linewidth=0.5,
                hatch=hatch,
            )
        )
        ax.text(
            t + 0.5,
            d,
            action.label(single),
            ha="center",
            va="center",
            fontsize=font,
        )
    ax.set_xlim(0, schedule.num_ticks)
    ax.set_ylim(schedule.num_devices - 0.5, -0.5)  # device 0 on top
    ax.set_yticks(range(schedule.num_devices))
    ax.set_yticklabels([f"device {d}" for d in range(schedule.num_devices)])
    ax.set_xlabel("tick")
    ax.set_title(
        title
        if title is not None
        else f"{schedule.name}: {schedule.num_stages} stages, {schedule.num_microbatches} "
        f"microbatches, bubble {format_share(schedule.bubble_fraction)}"
    )
    return fig
