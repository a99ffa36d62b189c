"""pipemark.views: the stage table (plain and rich), the HTML view, show and reports."""

from __future__ import annotations

import io
import re
import sys
import textwrap
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import ClosedJaxpr, DropVar

import pipemark as pm
from pipemark import examples
from pipemark import views as pmi
from pipemark._compat import jax_form
from pipemark.cost import estimate_cost

P = pm.passes


def skip(x):
    a = jnp.sin(x)
    return jnp.cos(a) + a


def _skip_staged():
    cj = jax.make_jaxpr(skip)(jnp.ones(4))
    return P.slice_stages(P.insert_markers(cj, [1, 2]))


def _mlp_training_staged():
    ex = examples.mlp(num_layers=2, width=4, batch=2)
    return pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)


# ------------------------------------------------------------------------------ text


def test_plain_table_of_a_fixed_program():
    expected = textwrap.dedent(
        """\
        #  stage   eqns  in  out  FLOPs  params  bytes in  bytes out    share
        -  ------  ----  --  ---  -----  ------  --------  ---------  -------
        0  stage0     3   1    1      4     0 B       0 B       16 B   33.3 %
        1  stage1     3   1    1      4     0 B      16 B       16 B   33.3 %
        2  stage2     3   2    1      4     0 B      32 B       16 B   33.3 %
        -  ------  ----  --  ---  -----  ------  --------  ---------  -------
           total      9   4    3     12     0 B      48 B       48 B  100.0 %"""
    )
    assert pmi.summary(_skip_staged(), style="plain") == expected


# The training step's table per form of tanh's derivative (pipemark._compat's "tanh
# derivative" row): JAX 0.11 stages 1 - y*y as one equation that the forward stage
# computes and hands on (one value fewer crosses each boundary), where 0.10 stages two.
TRAINING_TABLES = {
    "sub/mul": """\
        #  stage            eqns  in  out  FLOPs  params  bytes in  bytes out    share
        -  ---------------  ----  --  ---  -----  ------  --------  ---------  -------
        0  layer0              7   3    4     88    80 B       0 B      128 B   18.9 %
        1  layer1             12   4    6    120    80 B      32 B      196 B   25.8 %
        2  layer1_backward    14   5    3    165     0 B     192 B      112 B   35.5 %
        3  layer0_backward    10   4    2     92     0 B     128 B       80 B   19.8 %
        -  ---------------  ----  --  ---  -----  ------  --------  ---------  -------
           total              43  16   15    465   160 B     352 B      516 B  100.0 %""",
    "one_minus_square": """\
        #  stage            eqns  in  out  FLOPs  params  bytes in  bytes out    share
        -  ---------------  ----  --  ---  -----  ------  --------  ---------  -------
        0  layer0              7   3    3     96    80 B       0 B       96 B   21.4 %
        1  layer1             12   4    5    128    80 B      32 B      164 B   28.5 %
        2  layer1_backward    12   4    3    149     0 B     160 B      112 B   33.2 %
        3  layer0_backward     8   3    2     76     0 B      96 B       80 B   16.9 %
        -  ---------------  ----  --  ---  -----  ------  --------  ---------  -------
           total              39  14   13    449   160 B     288 B      452 B  100.0 %""",
}


def test_plain_table_of_a_training_step():
    # Weights go through the start markers, so each backward stage receives them from
    # its forward stage: backward stages read no program input. The batch is data: the
    # params column counts the two layers' weights and biases only (4 x 4 + 4 floats).
    expected = textwrap.dedent(TRAINING_TABLES[jax_form("tanh derivative")])
    assert pmi.summary(_mlp_training_staged(), style="plain") == expected


def _long_named_staged(length: int):
    def f(x):
        for i in range(3):
            x = pm.mark(x, name=f"{'n' * length}{i}", mark_type="start")
            x = pm.mark(jnp.sin(x) * 2.0, name=f"{'n' * length}{i}", mark_type="end")
        return x

    return pm.split(f, jnp.ones((64, 64)))


@pytest.mark.parametrize("style", ["plain", "rich"])
@pytest.mark.parametrize("width", [40, 56, 64, 72, 80, 100])
def test_tables_fit_the_width_by_leaving_columns_out(style, width):
    pytest.importorskip("rich")
    for staged in (_mlp_training_staged(), _long_named_staged(20)):
        text = pmi.summary(staged, style=style, width=width)
        assert max(map(len, text.splitlines())) <= width
        full = pmi.summary(staged, style=style, width=None)
        if max(map(len, full.splitlines())) <= width:
            assert text == full  # nothing left out when everything fits
        else:
            note = " ".join(text.split())  # the note wraps at the width
            assert f"(left out to fit {width} columns:" in note and "width=None shows all)" in note
        # The position, name, FLOPs and share columns always stay.
        header = text.splitlines()[0].split()
        assert header[:2] == ["#", "stage"] and "FLOPs" in header and "share" in header


def test_long_names_are_shortened_in_the_middle_never_to_nothing():
    staged = _long_named_staged(60)
    text = pmi.summary(staged, style="plain", width=40)
    names = [line.split()[1] for line in text.splitlines()[2:5]]
    assert all("…" in n and len(n) >= 12 for n in names)
    assert [n[-1] for n in names] == ["0", "1", "2"]  # the end of a name tells them apart
    # A width nothing fits in leaves the names at 12 characters: wider than asked.
    narrow = pmi.summary(staged, style="plain", width=10)
    assert len(narrow.splitlines()[2].split()[1]) == 12


def test_summary_refuses_a_bad_width():
    with pytest.raises(pm.PipemarkError, match="width must be a positive int"):
        pmi.summary(_skip_staged(), width=0)
    with pytest.raises(pm.PipemarkError, match="width must be a positive int"):
        pmi.summary(_skip_staged(), width="80")


def _tokens(text: str) -> list[str]:
    # Box-drawing characters and rule lines are decoration; the cells are the content.
    words = []
    for line in text.splitlines():
        line = re.sub(r"[\u2500-\u257f]", " ", line)
        if set(line) <= {"-", " "}:
            continue
        words.extend(line.split())
    return words


@pytest.mark.parametrize("build", [_skip_staged, _mlp_training_staged])
def test_rich_and_plain_hold_the_same_cells(build):
    pytest.importorskip("rich")
    staged = build()
    rich_text = pmi.summary(staged, style="rich")
    plain_text = pmi.summary(staged, style="plain")
    assert rich_text != plain_text
    assert "\x1b[" not in rich_text  # no terminal colour codes in a string
    assert _tokens(rich_text) == _tokens(plain_text)


def test_auto_style_follows_whether_rich_is_installed(monkeypatch):
    staged = _skip_staged()
    monkeypatch.setitem(sys.modules, "rich", None)  # `import rich` raises ImportError
    assert pmi.summary(staged) == pmi.summary(staged, style="plain")
    assert str(staged) == pmi.summary(staged, style="plain")
    with pytest.raises(pm.PipemarkError, match="style='rich' needs rich"):
        pmi.summary(staged, style="rich")


def test_print_summary_writes_the_table():
    staged = _skip_staged()
    buffer = io.StringIO()
    pmi.print_summary(staged, buffer)
    assert buffer.getvalue() == pmi.summary(staged) + "\n"


def test_unknown_style_and_wrong_types_are_pipemark_errors():
    with pytest.raises(pm.PipemarkError, match="Unknown style 'fancy'; choose one of auto"):
        pmi.summary(_skip_staged(), style="fancy")
    cj = jax.make_jaxpr(skip)(jnp.ones(4))
    for function in (pmi.summary, pmi.stage_rows, pmi.to_html, pmi.stage_colors):
        with pytest.raises(pm.PipemarkError, match="takes a StagedJaxpr, got ClosedJaxpr"):
            function(cj)


def test_rows_count_each_program_input_once_in_the_total():
    staged = _mlp_training_staged()
    rows, total = pmi.stage_rows(staged)
    assert [r.name for r in rows] == [s.name for s in staged.stages]
    assert sum(r.equations for r in rows) == total.equations
    assert (
        sum(r.flops for r in rows)
        == total.flops
        == estimate_cost(staged.as_closed_jaxpr()).total_flops
    )
    assert abs(sum(r.share for r in rows) - 1.0) < 1e-12
    # The total counts each parameter once (the batch is not a parameter).
    params = sorted(pmi.parameter_inputs(staged))
    assert [staged.input_names[i] for i in params] == [
        "params[0][0]",
        "params[0][1]",
        "params[1][0]",
        "params[1][1]",
    ]
    avals = [staged.in_avals[i] for i in params]
    assert total.param_bytes == sum(pm.flatten_shape_byte_sizes(avals))
    assert sum(r.param_bytes for r in rows) >= total.param_bytes


def test_parameters_are_the_differentiated_or_updated_arguments():
    import optax

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)

    p = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
    x, y = jnp.ones((8, 4)), jnp.zeros((8, 4))

    def names(staged):
        return sorted(staged.input_names[i] for i in pmi.parameter_inputs(staged))

    weights = ["p['b']", "p['w']"]
    # value_and_grad: the differentiated argument, not the data of the same shape.
    assert names(pm.split(jax.value_and_grad(loss), p, x, y, num_stages=2)) == weights
    by_x = pm.split(jax.value_and_grad(loss, argnums=1), p, x, y, num_stages=2)
    assert names(by_x) == ["x"]
    # A forward pass or a loss: the first argument.
    assert names(pm.split(loss, p, x, y, num_stages=2)) == weights
    # One argument returned transformed is data, not a parameter.
    assert names(pm.split(lambda x: jnp.sin(x) * x, x, num_stages=2)) == []
    # A training step: what it updates (the parameters and the optimizer state).
    opt = optax.adam(1e-3)

    def step(p, state, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    staged = pm.split(step, p, opt.init(p), x, y, num_stages=2)
    found = names(staged)
    assert weights[0] in found and weights[1] in found
    assert not {"x", "y"} & set(found) and any(n.startswith("state") for n in found)


def test_a_program_without_arithmetic_has_no_share():
    cj = jax.make_jaxpr(lambda x: x.reshape(2, 2).T)(jnp.ones(4))
    staged = P.slice_stages(P.insert_markers(cj, [1]))
    rows, total = pmi.stage_rows(staged)
    assert [r.share for r in rows] == [None, None] and total.share is None
    assert pmi.summary(staged, style="plain").splitlines()[2].endswith("  -")


def test_approximate_costs_are_marked():
    def loop(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]

    cj = jax.make_jaxpr(loop)(jnp.ones(4))
    staged = P.slice_stages(P.insert_markers(cj, [0]))
    assert "~" in pmi.summary(staged, style="plain").splitlines()[2]


@pytest.mark.parametrize(
    ("n", "count", "size"),
    [
        (0, "0", "0 B"),
        (1023, "1023", "1023 B"),
        (1024, "1024", "1 KiB"),
        (9999, "9999", "9.76 KiB"),
        (10_000, "10k", "9.77 KiB"),
        (999_499, "999k", "976 KiB"),
        (999_500, "1M", "976 KiB"),
        (1_048_576, "1.05M", "1 MiB"),
        (3 * 10**12, "3T", "2.73 TiB"),
        (5 * 10**15, "5P", "4,547 TiB"),
        (5 * 10**18, "5,000P", "4,547,474 TiB"),
    ],
)
def test_number_formats(n, count, size):
    assert pmi.format_count(n) == count
    assert pmi.format_bytes(n) == size


# ---------------------------------------------------------------------------- colours


def test_backward_stages_share_their_forward_stage_colour():
    staged = _mlp_training_staged()
    colors = pmi.stage_colors(staged)
    assert colors[0] == colors[3] and colors[1] == colors[2]
    assert colors[0] != colors[1]
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colors)


def test_colours_repeat_after_the_palette():
    def chain(x):
        for _ in range(12):
            x = jnp.sin(x)
        return x

    cj = jax.make_jaxpr(chain)(jnp.ones(2))
    staged = P.slice_stages(P.insert_markers(cj, list(range(1, 12))))
    colors = pmi.stage_colors(staged)
    assert len(set(colors)) == 10 and colors[10] == colors[0]


# ------------------------------------------------------------------------------ HTML


class _TagChecker(HTMLParser):
    """Checks that every opened tag is closed, in order (void elements excepted)."""

    VOID = frozenset({"br", "img", "meta", "hr", "input", "link"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack[-5:], tag)
        self.stack.pop()


def _check_html(text: str) -> _TagChecker:
    checker = _TagChecker()
    checker.feed(text)
    checker.close()
    assert checker.stack == []
    return checker


def _check_self_contained(text: str) -> None:
    assert not re.search(r"https?://", text)
    assert "<script" not in text.lower()
    assert "<link" not in text.lower()
    assert "@import" not in text
    for source in re.findall(r'src="([^"]*)"', text):
        assert source.startswith("data:image/png;base64,")


def test_html_view_is_valid_and_self_contained():
    staged = _mlp_training_staged()
    text = pmi.to_html(staged)
    root = ET.fromstring(text)  # well-formed XML
    assert root.tag == "div" and root.get("class") == "pipemark-view"
    _check_html(text)
    _check_self_contained(text)
    stages = root.findall("./details")
    assert [s.find("summary/span").text for s in stages] == [
        f"{k} · {s.name}" for k, s in enumerate(staged.stages)
    ]
    # Each stage block carries its own colour.
    for block, color in zip(stages, pmi.stage_colors(staged)):
        assert f"--pm-color: {color}" in block.get("style")
    # One row per stage in the table, and the totals.
    table = root.find("div[@class='pm-scroll']/table")
    assert len(table.findall("./tbody/tr")) == len(staged.stages)
    assert "total" in "".join(table.find("tfoot").itertext())


def _stage_blocks(text: str) -> list[ET.Element]:
    return ET.fromstring(text).findall("./details")


def test_boundary_values_keep_their_name_and_are_highlighted():
    staged = _skip_staged()
    blocks = _stage_blocks(pmi.to_html(staged))
    # stage0 makes `a = sin x`, which stage1 and stage2 both read (a skip connection).
    sent_by_0 = {span.text for span in blocks[0].iter("span") if span.get("class") == "pm-b"}
    received_by_2 = [
        span.text
        for div in blocks[2].findall("./div[@class='pm-io']")
        if div.find("span").text == "receives"
        for span in div.iter("span")
        if span.get("class") == "pm-b"
    ]
    assert len(received_by_2) == 2
    assert set(received_by_2) & sent_by_0
    eqn_lines = ["".join(e.itertext()) for e in blocks[2].iter("div") if e.get("class") == "pm-e"]
    assert any(line.split(" = ")[1].startswith("add ") for line in eqn_lines)
    receives_text = "".join(blocks[2].find("./div[@class='pm-io']").itertext())
    assert "from stage0" in receives_text and "from stage1" in receives_text


def test_equations_print_types_params_and_literals():
    def f(x):
        return jnp.sum(x * 2.0, axis=0)

    cj = jax.make_jaxpr(f)(jnp.ones((3, 4)))
    staged = P.slice_stages(P.insert_markers(cj, [1]))
    blocks = _stage_blocks(pmi.to_html(staged, open_stages=True))
    lines = [
        "".join(e.itertext()) for b in blocks for e in b.iter("div") if e.get("class") == "pm-e"
    ]
    assert lines == [
        "b:f32[3,4] = pipeline_marker[name=stage0 mark_type=start] a",
        "c:f32[3,4] = mul b 2.0",
        "d:f32[3,4] = pipeline_marker[name=stage0 mark_type=end] c",
        "e:f32[3,4] = pipeline_marker[name=stage1 mark_type=start] d",
        # reduce_sum's out_sharding=None is left out: None parameters say nothing.
        "f:f32[4] = reduce_sum[axes=(0,)] e",
        "g:f32[4] = pipeline_marker[name=stage1 mark_type=end] f",
    ]
    assert blocks[0].get("open") == "open"


def test_dropped_results_print_as_underscore():
    cj = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.cos(x))(jnp.ones(2))
    eqns = list(cj.jaxpr.eqns)
    # A result nobody reads, as JAX's own passes leave them: a DropVar.
    extra = eqns[0].replace(outvars=[DropVar(eqns[0].outvars[0].aval)])
    jaxpr = cj.jaxpr.replace(eqns=[extra, *eqns])
    staged = P.slice_stages(P.insert_markers(ClosedJaxpr(jaxpr, cj.consts), [2]))
    lines = [
        "".join(e.itertext())
        for b in _stage_blocks(pmi.to_html(staged))
        for e in b.iter("div")
        if e.get("class") == "pm-e"
    ]
    assert "_:f32[2] = sin b" in lines


def test_long_stages_are_cut_and_large_programs_start_collapsed():
    ex = examples.mlp(num_layers=20, width=4, batch=2)
    staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    assert sum(s.num_eqns for s in staged.stages) > 300
    text = pmi.to_html(staged, max_eqns_per_stage=5)
    blocks = _stage_blocks(text)
    assert all(b.get("open") is None for b in blocks)  # more than 300 equations
    first = [e for e in blocks[-1].iter("div") if "pm-e" in (e.get("class") or "").split()]
    assert len(first) == 6
    assert "".join(first[-1].itertext()) == (f"… {staged.stages[-1].num_eqns - 5} more equations")


def test_css_inherits_the_theme_text_colour():
    # Readable in light and dark notebook themes: text colour comes from the page, and
    # every background in the view is translucent.
    staged = pm.split(lambda x: jnp.sin(x), 1.0, num_stages=1)
    css = re.search(r"<style>(.*?)</style>", pmi.to_html(staged), re.S).group(1)
    assert "color: inherit" in css
    assert not re.search(r"(?<![-\w])color:\s*#", css)
    for background in re.findall(r"background:\s*([^;]+);", css):
        assert background.startswith(("rgba(", "var(", "transparent")), background


def test_staged_repr_html_is_the_view():
    staged = _skip_staged()
    assert staged._repr_html_() == pmi.to_html(staged)


# ------------------------------------------------------------------------------ show


def _boundary_marked(x):
    x = jnp.sin(x)
    pm.mark_pipeline_boundary()
    return jnp.cos(x)


def test_show_slices_a_marked_program():
    cj = jax.make_jaxpr(_boundary_marked)(1.0)
    view = pm.show(cj)
    assert isinstance(view, pmi.HTMLView)
    assert [s.name for s in view.staged.stages] == ["layer0", "layer1"]
    assert view._repr_html_() == pmi.to_html(view.staged)
    assert str(view) == pmi.summary(view.staged, style="plain")
    assert "HTMLView" in repr(view)


def test_show_takes_start_end_markers_and_staged_programs():
    ex = examples.mlp(num_layers=2)
    cj = jax.make_jaxpr(ex.loss_fn)(*ex.args)
    assert [s.name for s in pm.show(cj).staged.stages] == ["layer0", "layer1"]
    staged = _skip_staged()
    assert pm.show(staged).staged is staged


def test_show_refuses_unmarked_programs_and_other_things():
    cj = jax.make_jaxpr(skip)(jnp.ones(4))
    with pytest.raises(pm.errors.MarkerError, match="no start/end markers"):
        pm.show(cj)
    with pytest.raises(pm.PipemarkError, match="show takes a marked ClosedJaxpr"):
        pm.show(skip)


def test_view_save_and_report_are_valid_pages(tmp_path):
    staged = _skip_staged()
    saved = pm.show(staged).save(tmp_path / "view.html", title="a & b")
    report = pm.write_report(
        staged,
        tmp_path / "report.html",
        title="report",
        description="x < y",
        png=b"\x89PNG fake",
        sections=[("notes", "1 < 2 & 3")],
    )
    for path in (saved, report):
        text = path.read_text(encoding="utf-8")
        assert text.startswith("<!DOCTYPE html>\n")
        ET.fromstring(text.split("\n", 1)[1])
        _check_html(text)
        _check_self_contained(text)
        assert "color-scheme: light dark" in text
    text = report.read_text(encoding="utf-8")
    assert "x &lt; y" in text and "1 &lt; 2 &amp; 3" in text
    assert 'src="data:image/png;base64,iVBORyBmYWtl"' in text
    assert "<title>a &amp; b</title>" in saved.read_text(encoding="utf-8")


HOSTILE = ["[bold]x[/]", "[/]", "[link=http://example.com]y", "red\x1b[31mz\x07"]


def _hostile_staged():
    def f(x):
        for name in HOSTILE:
            x = pm.mark(x, name=name, mark_type="start")
            x = pm.mark(jnp.sin(x), name=name, mark_type="end")
        return x

    return pm.split(f, 1.0)


@pytest.mark.parametrize("style", ["plain", "rich"])
def test_hostile_stage_names_are_shown_as_written(style):
    pytest.importorskip("rich") if style == "rich" else None
    text = pmi.summary(_hostile_staged(), style=style)
    assert "\x1b" not in text and "\x07" not in text
    for name in ["[bold]x[/]", "[/]", "[link=http://example.com]y", "red\\x1b[31mz\\x07"]:
        assert name in text, name


def test_hostile_stage_names_in_the_other_views(capsys):
    staged = _hostile_staged()
    print(staged)
    pmi.print_stage_inputs(staged)
    pmi.print_summary(staged)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "[bold]x[/]" in out
    page = pmi.to_html(staged)
    ET.fromstring(page)  # still well-formed
    assert "\x1b" not in page and "[bold]x[/]" in page
