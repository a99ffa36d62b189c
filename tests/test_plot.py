"""pipemark.plot: the stage graph and cost-per-stage figure."""

from __future__ import annotations

import io
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark import examples
from pipemark.plot import stage_layout

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

P = pm.passes


def test_import_pipemark_does_not_import_matplotlib():
    # Plotting loads matplotlib when it draws; a fresh interpreter shows what
    # `import pipemark` alone loads.
    code = "import sys, pipemark; print('matplotlib' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def _training_staged(num_layers=3):
    ex = examples.mlp(num_layers=num_layers, width=4, batch=2)
    return pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)


def _resnet_staged():
    ex = examples.resnet(num_blocks=5, skip=3)
    return pm.split(ex.loss_fn, *ex.args)


def test_returns_a_figure_with_the_graph_and_the_bars():
    staged = _training_staged()
    fig = pm.plot(staged, title="three layers")
    assert isinstance(fig, Figure)
    graph_ax, cost_ax = fig.axes
    arrows = [p for p in graph_ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == staged.graph.number_of_edges()
    assert len(cost_ax.patches) == len(staged.stages)
    assert [t.get_text() for t in cost_ax.get_yticklabels()] == [
        f"{k} {s.name}" for k, s in enumerate(staged.stages)
    ]
    rows, _ = pm.views.stage_rows(staged)
    assert [bar.get_width() for bar in cost_ax.patches] == [r.flops for r in rows]
    assert fig.get_suptitle() == "three layers"


def test_arrow_width_grows_with_bytes():
    staged = _training_staged()
    graph_ax = pm.plot(staged).axes[0]
    arrows = [p for p in graph_ax.patches if isinstance(p, FancyArrowPatch)]
    sizes = [d["bytes"] for _, _, d in staged.graph.edges(data=True)]
    widths = [a.get_linewidth() for a in arrows]
    by_size = [w for _, w in sorted(zip(sizes, widths))]
    assert by_size == sorted(by_size)
    assert widths[sizes.index(max(sizes))] == pytest.approx(8.0)


def test_colours_match_the_html_view():
    staged = _training_staged()
    cost_ax = pm.plot(staged).axes[1]
    from matplotlib.colors import to_hex

    assert [to_hex(bar.get_facecolor()) for bar in cost_ax.patches] == (
        pm.views.stage_colors(staged)
    )


def test_savefig_writes_a_png():
    buffer = io.BytesIO()
    pm.plot(_resnet_staged()).savefig(buffer, format="png", dpi=60)
    assert buffer.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_steps_are_drawn_as_a_u():
    layout = stage_layout(_training_staged())
    assert layout == {
        "layer0": (0.0, 1.0),
        "layer1": (1.0, 1.0),
        "layer2": (2.0, 1.0),
        "layer2_backward": (2.0, 0.0),
        "layer1_backward": (1.0, 0.0),
        "layer0_backward": (0.0, 0.0),
    }


def test_other_programs_are_drawn_in_a_row():
    layout = stage_layout(_resnet_staged())
    assert layout == {f"block{i}": (float(i), 0.0) for i in range(5)}
    # A stage named like a backward stage without its forward one stays in the row.
    cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(2))
    staged = P.slice_stages(P.insert_markers(cj, [1], names=["a", "b_backward"]))
    assert stage_layout(staged) == {"a": (0.0, 0.0), "b_backward": (1.0, 0.0)}


def test_skip_connections_bow_out_of_the_row():
    graph_ax = pm.plot(_resnet_staged()).axes[0]
    arrows = [p for p in graph_ax.patches if isinstance(p, FancyArrowPatch)]
    rads = sorted(a.get_connectionstyle().rad for a in arrows)
    assert rads.count(0.0) == 4 and len(rads) == 6
    assert all(rad == -0.3 for rad in rads[:2])  # left to right, bowing upwards


def test_bad_input_is_a_pipemark_error(monkeypatch):
    cj = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(pm.PipemarkError, match="plot takes a StagedJaxpr, got ClosedJaxpr"):
        pm.plot(cj)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(
        pm.PipemarkError, match=r"plot needs matplotlib: pip install 'pipemark\[viz\]'"
    ):
        pm.plot(_training_staged(1))
