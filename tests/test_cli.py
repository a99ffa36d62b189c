"""The command line: ``pipemark demo`` and ``pipemark inspect``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import pipemark as pm
from pipemark import _demo
from pipemark.cli import CommandError, main, parse_arg_spec

ROOT = Path(__file__).parents[1]

# A smaller language model than the demo's default, for the tests that only need the
# demo's plumbing; one test runs the default.
SMALL = {"num_layers": 4, "vocab": 32, "d_model": 16, "num_heads": 2, "seq": 8, "batch": 2}


_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\d+)\s.*\s([\d.]+) %$")


def _table_rows(out: str) -> dict[str, str]:
    """Stage name -> its cost share, read off the stage table in ``out``."""
    rows = {}
    for line in out.splitlines():
        match = _ROW.match(line.rstrip())
        if match:
            rows[match.group(2)] = match.group(4)
    return rows


def _entry(out: str, start: str) -> str:
    """The line of ``out`` that starts with ``start`` and the lines that continue it
    (indented deeper), joined by spaces."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    depth = len(start) - len(start.lstrip())
    entry = [lines[first]]
    for line in lines[first + 1 :]:
        if len(line) - len(line.lstrip()) <= depth:
            break
        entry.append(line.strip())
    return " ".join(entry)


def _error_lines(err: str) -> list[str]:
    # Progress lines start with "[k/n]"; everything else on stderr is an error.
    return [line for line in err.splitlines() if line and not line.startswith("[")]


# ------------------------------------------------------------------------------ demo


@pytest.mark.slow
def test_demo_prints_the_table_verifies_and_writes_files(tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(["demo", "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    rows = _table_rows(captured.out)
    names = ["layer0", "layer1", "layer2", "layer3"]
    assert list(rows) == names + [f"{n}_backward" for n in reversed(names)]
    assert "total" in captured.out
    assert "staged program == unsplit program: yes" in captured.out
    transforms = {line.split()[0]: line.split() for line in captured.out.splitlines() if line}
    for name in ("eager", "jit", "grad", "jit(grad)", "vmap", "vmap(grad)", "hessian"):
        assert transforms[name][2] == "yes", transforms[name]
    assert "boundary markers kept in make_jaxpr(grad(f)): 3 of 3" in captured.out
    # Progress went to stderr, one line per step, each ending in its time.
    progress = captured.err.splitlines()
    assert [line[:5] for line in progress] == [f"[{k}/6]" for k in range(1, 7)]
    assert all(line.endswith(" s") for line in progress)
    png = (out_dir / "stages.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out_dir / "report.html").read_text(encoding="utf-8")
    ET.fromstring(report.split("\n", 1)[1])  # well-formed after the doctype line
    assert report.count('<details class="pm-stage"') == 8
    assert "data:image/png;base64," in report
    assert "Markers under JAX transformations" in report


def test_demo_makes_the_output_directory_with_its_parents(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_demo, "MODEL", SMALL)
    out_dir = tmp_path / "a" / "b"
    assert main(["demo", "--out", str(out_dir)]) == 0
    assert {p.name for p in out_dir.iterdir()} == {"report.html", "stages.png"}


def test_demo_defaults_to_pipemark_demo_in_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_demo, "MODEL", SMALL)
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    assert (tmp_path / "pipemark-demo" / "report.html").is_file()


def test_demo_reports_a_transform_mismatch(tmp_path, monkeypatch, capsys):
    # A demo that cannot fail proves nothing: break the marked loss and watch it say so.
    monkeypatch.setattr(_demo, "MODEL", SMALL)
    original = _demo._loss

    def broken(params, x, *, marked):
        return original(params, x, marked=marked) + (1.0 if marked else 0.0)

    monkeypatch.setattr(_demo, "_loss", broken)
    assert main(["demo", "--out", str(tmp_path)]) == 1
    assert " NO " in capsys.readouterr().out


def test_demo_reports_a_staged_mismatch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_demo, "MODEL", SMALL)

    def failing_verify(self, reference, *args, **kwargs):
        raise pm.PipemarkError("Result 3 (output 0 of stage 'layer1') differs.")

    monkeypatch.setattr(pm.StagedJaxpr, "verify", failing_verify)
    assert main(["demo", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "staged program == unsplit program: NO: Result 3" in out


def test_python_dash_m_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "pipemark", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    assert "demo" in proc.stdout and "inspect" in proc.stdout


def test_unknown_command_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("pipemark: error: argument COMMAND: invalid choice: 'frobnicate'")


# --------------------------------------------------------------------------- inspect


def test_inspect_slices_at_markers(capsys):
    status = main(
        ["inspect", "tests._cli_targets:marked", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    )
    assert status == 0
    captured = capsys.readouterr()
    assert list(_table_rows(captured.out)) == ["layer0", "layer1"]
    assert _error_lines(captured.err) == []
    assert captured.err.splitlines()[1].startswith(
        "[2/3] tracing tests._cli_targets:marked(f32[4,8], f32[8,8])"
    )


def test_inspect_cuts_balanced_stages(capsys):
    args = ["inspect", "tests._cli_targets:plain", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    assert main([*args, "--num-stages", "3"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert list(rows) == ["layer0", "layer1", "layer2"]
    # Three equal layers (the loss joins the last): each stage has about a third.
    shares = [float(share) for share in rows.values()]
    assert all(30 < share < 37 for share in shares), shares
    assert abs(sum(shares) - 100) < 0.2


def test_inspect_reports_the_balance_and_takes_block_cuts(capsys):
    pytest.importorskip("flax")
    argv = ["inspect", "tests._cli_targets:flax_loss", "--args", "tests._cli_targets:flax_args"]
    assert main([*argv, "--num-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("balance:") for line in out.splitlines()) == 1
    balance = _entry(out, "balance:")
    assert balance.startswith("balance: 2 forward layers, largest / mean")
    assert balance.endswith("cuts between 3 blocks (name scopes 'Dense_0' … 'Dense_2')")
    assert main([*argv, "--num-stages", "2", "--block-cuts", "require"]) == 0
    assert main([*argv, "--num-stages", "2", "--block-cuts", "sometimes"]) == 1
    assert capsys.readouterr().err.endswith(
        "pipemark: error: Unknown block_cuts 'sometimes'; choose one of 'prefer', 'require', "
        "'off'.\n"
    )
    assert main([*argv]) == 1  # no balance without --num-stages: a marker error instead


def test_inspect_grad_gives_backward_stages(capsys):
    args = ["inspect", "tests._cli_targets:plain", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    assert main([*args, "--num-stages", "2", "--grad"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert list(rows) == ["layer0", "layer1", "layer1_backward", "layer0_backward"]


def test_inspect_grad_argnums_differentiates_the_weights(capsys):
    args = ["inspect", "tests._cli_targets:plain", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    assert main([*args, "--num-stages", "2", "--grad", "--argnums", "1"]) == 0
    captured = capsys.readouterr()
    assert "value_and_grad(tests._cli_targets:plain, argnums=1)" in captured.err
    assert list(_table_rows(captured.out))[-1] == "layer0_backward"


def test_inspect_a_flax_training_loss_from_make_args(capsys):
    pytest.importorskip("flax")
    argv = ["inspect", "tests._cli_targets:flax_loss", "--args", "tests._cli_targets:flax_args"]
    assert main([*argv, "--grad", "--num-stages", "2"]) == 0
    captured = capsys.readouterr()
    assert list(_table_rows(captured.out)) == [
        "layer0", "layer1", "layer1_backward", "layer0_backward"
    ]  # fmt: skip
    assert "program inputs each stage reads:" in captured.out
    layer0 = _entry(captured.out, "  layer0:")
    assert "params['params']['Dense_0']['kernel'] f32[8,8]" in layer0
    assert "argnums=0" in captured.err


def test_every_line_inspect_prints_fits_80_columns(capsys):
    # As the stage table does: the balance line and each stage's inputs (long pytree
    # paths here) continue on lines of their own.
    pytest.importorskip("flax")
    argv = ["inspect", "tests._cli_targets:flax_loss", "--args", "tests._cli_targets:flax_args"]
    assert main([*argv, "--grad", "--num-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert len(_entry(out, "balance:")) > 80 and len(_entry(out, "  layer0:")) > 80
    assert max(len(line) for line in out.splitlines()) <= 80


def test_inspect_make_args_with_keywords_and_html(tmp_path, capsys):
    pytest.importorskip("flax")
    page = tmp_path / "view.html"
    argv = [
        "inspect",
        "tests._cli_targets:flax_loss",
        "--args",
        "tests._cli_targets:flax_args_dict",
    ]
    assert main([*argv, "--num-stages", "2", "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "params[&#x27;params&#x27;][&#x27;Dense_0&#x27;][&#x27;kernel&#x27;]" in text
    assert ">reads<" in text


def test_inspect_int_arguments_and_html(tmp_path, capsys):
    page = tmp_path / "view.html"
    args = ["inspect", "tests._cli_targets:with_tokens", "--arg", "i32[8]", "--arg", "f32[16,4]"]
    assert main([*args, "--num-stages", "2", "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    ET.fromstring(text.split("\n", 1)[1])
    assert "i32[8]" in text
    assert "[4/4] writing" in capsys.readouterr().err


def test_inspect_a_python_file(tmp_path, capsys):
    source = Path(__file__).with_name("_cli_targets.py")
    copy = tmp_path / "model.py"
    copy.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["inspect", f"{copy}:marked", "--arg", "f32[2,3]", "--arg", "f32[3,3]"]) == 0
    assert list(_table_rows(capsys.readouterr().out)) == ["layer0", "layer1"]


MARKED = ["tests._cli_targets:marked", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
PLAIN = ["tests._cli_targets:plain", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]

BAD_INPUTS = [
    (
        ["inspect", "no_such_module_xyz:f", "--arg", "f32[2]"],
        1,
        "pipemark: error: cannot import module 'no_such_module_xyz': ModuleNotFoundError",
    ),
    (
        ["inspect", "tests._cli_targets", "--arg", "f32[2]"],
        2,
        "pipemark: error: bad target 'tests._cli_targets': expected MODULE:FUNCTION",
    ),
    (
        ["inspect", "tests._cli_targets:nope", "--arg", "f32[2]"],
        1,
        "pipemark: error: module 'tests._cli_targets' has no attribute 'nope'",
    ),
    (
        ["inspect", "tests._cli_targets:NOT_A_FUNCTION"],
        1,
        "pipemark: error: tests._cli_targets:NOT_A_FUNCTION is a int, not a function",
    ),
    (
        ["inspect", "tests._cli_targets:marked", "--arg", "f32[4,8", "--arg", "f32[8,8]"],
        2,
        "pipemark: error: bad --arg 'f32[4,8': expected DTYPE[DIM,...]",
    ),
    (
        ["inspect", "tests._cli_targets:marked", "--arg", "q7[4]"],
        2,
        "pipemark: error: bad --arg 'q7[4]': unknown dtype 'q7'",
    ),
    (
        ["inspect", "tests._cli_targets:marked", "--arg", "f32[4,x]"],
        2,
        "pipemark: error: bad --arg 'f32[4,x]': dimension 'x' is not a non-negative integer",
    ),
    (
        ["inspect", "tests._cli_targets:broken", "--arg", "f32[4,8]", "--arg", "f32[8,8]"],
        1,
        "pipemark: error: tracing tests._cli_targets:broken(f32[4,8], f32[8,8]) failed: TypeError",
    ),
    (
        ["inspect", "tests._cli_targets:marked", "--arg", "f32[4,8]"],
        1,
        "pipemark: error: tracing tests._cli_targets:marked(f32[4,8]) failed: TypeError",
    ),
    (
        ["inspect", *PLAIN],
        1,
        "pipemark: error: tests._cli_targets:plain has no stage markers; pass --num-stages K",
    ),
    (
        ["inspect", *PLAIN, "--num-stages", "500"],
        1,
        "pipemark: error: auto_layers: the program has 8 equations, too few for 500",
    ),
    (
        ["inspect", "tests._cli_targets:plain", "--num-stages", "0"],
        2,
        "pipemark inspect: error: argument --num-stages: '0' is not a positive integer",
    ),
    (
        ["inspect", "tests._cli_targets:plain", "--args", "tests._cli_targets:failing_args"],
        1,
        "pipemark: error: --args tests._cli_targets:failing_args raised RuntimeError: no data",
    ),
    (
        ["inspect", "tests._cli_targets:plain", "--args", "tests._cli_targets:wrong_args"],
        1,
        "pipemark: error: --args tests._cli_targets:wrong_args returned int; it must return a "
        "tuple",
    ),
    (
        ["inspect", *PLAIN, "--grad", "--argnums", "2"],
        1,
        "pipemark: error: --argnums 2: argument 2 does not exist; the function is given 2",
    ),
    (
        ["inspect", *PLAIN, "--grad", "--argnums", "w"],
        2,
        "pipemark: error: bad --argnums 'w'",
    ),
    (
        ["inspect", *PLAIN, "--argnums", "1"],
        2,
        "pipemark: error: --argnums goes with --grad",
    ),
    (
        ["inspect", *MARKED, "--html", "/nonexistent-dir/x/view.html"],
        1,
        "pipemark: error: cannot write /nonexistent-dir/x/view.html",
    ),
]


@pytest.mark.parametrize(("argv", "status", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_and_nonzero(argv, status, message, capsys):
    try:
        got = main(argv)
    except SystemExit as exit_info:  # argparse's own usage errors
        got = exit_info.code
    assert got == status
    captured = capsys.readouterr()
    errors = _error_lines(captured.err)
    assert len(errors) == 1, captured.err
    assert errors[0].startswith(message), errors[0]
    assert "Traceback" not in captured.err


def test_bad_input_from_the_installed_command_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "pipemark", "inspect", "tests._cli_targets:broken", *MARKED[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert _error_lines(proc.stderr)[0].startswith("pipemark: error: tracing")


def test_parse_arg_spec():
    spec = parse_arg_spec("bf16[2, 3]")
    assert spec.shape == (2, 3) and str(spec.dtype) == "bfloat16"
    assert parse_arg_spec("float32[]").shape == ()
    assert str(parse_arg_spec("bool[4]").dtype) == "bool"
    with pytest.raises(CommandError) as info:
        parse_arg_spec("[4]")
    assert info.value.status == 2


def test_inspect_shows_hostile_stage_names_as_text(capsys):
    status = main(
        ["inspect", "tests._cli_targets:hostile_names", "--arg", "f32[4,8]", "--arg", "f32[8,8]"]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "[bold]x[/]" in out and "[/]" in out
    assert "\x1b" not in out and "red\\x1b[31m[link=http://x]" in out


def test_a_traced_function_that_exits_is_an_error_not_a_success(capsys):
    status = main(["inspect", "tests._cli_targets:exits", "--arg", "f32[4,8]", "--arg", "f32[8,8]"])
    assert status == 1
    assert "failed: SystemExit: 0" in capsys.readouterr().err


def test_huge_dimensions_are_counted_not_overflowed(capsys):
    huge = "f32[99999999999999999999999,8]"
    status = main(["inspect", "tests._cli_targets:marked", "--arg", huge, "--arg", "f32[8,8]"])
    assert status == 0
    assert "TiB" in capsys.readouterr().out


def test_version_and_help_do_not_import_jax():
    import subprocess

    code = (
        "import sys\n"
        "from pipemark.cli import main\n"
        "for argv in (['--version'], ['--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('jax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("pipemark 0.1.0\n")
    assert out.stdout.strip().endswith("False")


def test_num_stages_on_a_marked_program_merges_its_stages(capsys):
    # Two marked layers into one stage: what pm.split and the runtime give.
    args = ["--arg", "f32[4,8]", "--arg", "f32[8,8]", "--num-stages", "1", "--grad"]
    assert main(["inspect", "tests._cli_targets:marked", *args]) == 0
    out = capsys.readouterr().out
    assert "stage0_backward" in out and "layer0" not in out
    status = main(["inspect", "tests._cli_targets:marked", *args[:-2], "3"])
    assert status == 1
    err = _error_lines(capsys.readouterr().err)
    assert err == [
        "pipemark: error: num_stages=3, but the program marks only 2 stages. Mark more "
        "layers, or pass 1 <= num_stages <= 2."
    ]


def test_demo_to_an_unwritable_place_fails_before_it_runs(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    status = main(["demo", "--out", str(blocker / "out")])
    assert status == 1
    captured = capsys.readouterr()
    assert _error_lines(captured.err) == [
        f"pipemark: error: --out {blocker / 'out'}: cannot write there (Not a directory)"
    ]
    assert "[1/" not in captured.err  # no step of the demo ran


def test_demo_help_lists_the_steps_in_the_order_they_run(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    steps = ["build", "trace", "cut it into 4", "run the stages", "check the markers", "write"]
    positions = [text.index(step) for step in steps]
    assert positions == sorted(positions)


def _cli(args: list[str], **popen) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen([sys.executable, "-m", "pipemark", *args], env=env, **popen)


@pytest.mark.parametrize("command", [["inspect", *PLAIN, "--num-stages", "2"], ["--help"]])
def test_output_to_a_closed_pipe_ends_quietly(command):
    proc = _cli(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    stderr = proc.stderr.read().decode()
    proc.wait(120)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert proc.returncode in (0, 141)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_to_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        proc = _cli(["inspect", *PLAIN, "--num-stages", "2"], stdout=full, stderr=subprocess.PIPE)
        stderr = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 1
    # Progress lines, then one line of error.
    assert stderr.strip().splitlines()[-1] == (
        "pipemark: error: cannot write the output: No space left on device"
    )
    assert "Traceback" not in stderr


def test_control_characters_from_the_user_are_shown_escaped(capsys):
    argv = ["inspect", "tests._cli_targets:plain", "--args", "tests._cli_targets:hostile_args"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\u202e" not in err
    assert "no \\x1b[2J\\x1b[31mdata\\u202e here" in err
    assert (
        main(["inspect", "tests._cli_targets:evil_names", "--arg", "f32[2,3]", "--arg", "f32[3,3]"])
        == 0
    )
    out = capsys.readouterr().out
    assert "\x1b[31m" not in out and "\u202e" not in out
    assert "a\\u202eb" in out and "c\\x1b[31m" in out


def test_inspect_microbatches_prints_what_each_device_would_hold(capsys, tmp_path):
    # The memory table is Pipeline.memory's for the same pipeline, made here directly.
    import jax
    import jax.numpy as jnp

    import pipemark as pm
    from pipemark.runtime.memory.estimate import format_bytes
    from tests._cli_targets import pipeline_loss

    report = tmp_path / "report.html"
    argv = ["inspect", "tests._cli_targets:pipeline_loss", "--arg", "f32[8,8]"]
    argv += ["--arg", "f32[16,8]", "--microbatches", "4", "--html", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    schedule = "1f1b" if len(jax.devices()) >= 2 else "interleaved"
    pipe = pm.pipeline_value_and_grad(pipeline_loss, num_microbatches=4, schedule=schedule)
    slots = pipe.memory(jnp.zeros((8, 8)), jnp.zeros((16, 8))).slots
    peaks = _entry(out, "predicted peak").split()[2:]
    assert peaks == [b for s in slots for b in format_bytes(s.predicted_peak).split()]
    assert f"schedule '{schedule}'" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "Memory per device" in report.read_text()
    assert main(["inspect", "tests._cli_targets:no_batch", "--arg", "f32[8,8]",
                 "--microbatches", "4"]) == 1  # fmt: skip
    assert "give the parameters and the batch" in capsys.readouterr().err
