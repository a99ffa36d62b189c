"""The ``pipemark`` command line (also ``python -m pipemark``).

``pipemark demo [--out DIR]``
    Split a small transformer language model's training step into 4 stages, print the
    stage table, check the stages against the unsplit program and write ``report.html``
    and ``stages.png`` into ``DIR``.
``pipemark inspect MODULE:FUNCTION [--args MODULE:MAKE_ARGS] [--arg f32[8,128] ...]
[--grad [--argnums N]] [--num-stages K [--block-cuts POLICY]] [--html FILE]``
    Trace any importable function with example arguments (pytrees from ``MAKE_ARGS()``,
    or abstract arrays of the given shapes), cut it at its markers (or into ``K``
    balanced stages, then also printing how balanced they are) and print the stage
    table and the program inputs each stage reads, named by their pytree paths.

Progress goes to standard error, tables to standard output. Bad input ends the command
with one line, ``pipemark: error: ...``, and a nonzero exit status: 2 for a malformed
command line, 1 for everything else. No traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipemark._text import display_name, plural, wrap
from pipemark.progress import Progress

__all__ = ["main", "build_parser", "parse_arg_spec", "CommandError"]


class CommandError(Exception):
    """Bad input on the command line: printed as one line, then exit with ``status``."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _one_line(text: str, limit: int = 400) -> str:
    """``text`` squeezed onto one line, cut at ``limit`` characters, its control
    characters (from a user's exception, say) written as escapes."""
    line = display_name(" ".join(str(text).split()))
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ------------------------------------------------------------------------ arg specs

_DTYPES = {
    "bool": "bool",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
}
_SPEC = re.compile(r"^\s*([A-Za-z0-9]+)\s*\[([^\]]*)\]\s*$")


def parse_arg_spec(spec: str) -> Any:
    """``"f32[8,128]"`` → ``jax.ShapeDtypeStruct((8, 128), float32)``.

    The dtype is a short name (``f32``, ``bf16``, ``i32``, ``u8``, ``bool`` …) or a full
    one (``float32``); ``f32[]`` is a scalar.

    >>> parse_arg_spec("i32[8]")
    ShapeDtypeStruct(shape=(8,), dtype=int32)
    >>> parse_arg_spec("f32[8,")
    Traceback (most recent call last):
    ...
    pipemark.cli.CommandError: bad --arg 'f32[8,': expected DTYPE[DIM,...] such as f32[8,128] or i32[8]
    """
    import jax
    import jax.numpy as jnp

    usage = f"bad --arg {spec!r}: expected DTYPE[DIM,...] such as f32[8,128] or i32[8]"
    match = _SPEC.match(spec)
    if match is None:
        raise CommandError(usage, status=2)
    name, dims = match.groups()
    dtype_name = _DTYPES.get(name.lower(), name.lower())
    if dtype_name not in _DTYPES.values():
        known = ", ".join(_DTYPES)
        raise CommandError(
            f"bad --arg {spec!r}: unknown dtype {name!r}; use one of {known}", status=2
        )
    shape = []
    for dim in dims.split(",") if dims.strip() else []:
        dim = dim.strip()
        if not dim.isdigit():
            raise CommandError(
                f"bad --arg {spec!r}: dimension {dim!r} is not a non-negative integer", status=2
            )
        shape.append(int(dim))
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype_name))


# -------------------------------------------------------------------------- targets


def _import_target(target: str) -> Any:
    """``MODULE:FUNCTION`` (a dotted module or a ``.py`` file) → the function."""
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise CommandError(
            f"bad target {target!r}: expected MODULE:FUNCTION, e.g. mymodel:loss", status=2
        )
    # Like `python -m`, look in the current directory first.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise CommandError(f"cannot import {module_name!r}: no such file")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or spec.loader is None:
                raise CommandError(f"cannot import {module_name!r}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except CommandError:
        raise
    except (Exception, SystemExit) as err:  # whatever the module raises on import
        raise CommandError(
            f"cannot import module {module_name!r}: {type(err).__name__}: {_one_line(err)}"
        ) from None
    value = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise CommandError(f"module {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise CommandError(
            f"{target} is a {type(value).__name__}, not a function; name a function to trace"
        )
    return value


# ------------------------------------------------------------------------- commands


def _demo(args: argparse.Namespace) -> int:
    from pipemark import _demo

    out_dir = Path(args.out)
    _check_writable(out_dir)  # before the demo runs, not after a minute of work
    return 0 if _demo.run(sys.stdout, out_dir, progress=sys.stderr) else 1


def _check_writable(out_dir: Path) -> None:
    probe = out_dir / ".pipemark-write-check"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise CommandError(f"--out {out_dir}: cannot write there ({reason})") from None


def _example_args(target: str) -> tuple[list[Any], dict[str, Any]]:
    """Call ``--args MODULE:FUNCTION``: it returns a tuple (or list) of positional
    arguments, or a dict with keys ``args`` and/or ``kwargs``."""
    make = _import_target(target)
    try:
        made = make()
    except (Exception, SystemExit) as err:  # whatever the user's function raises
        raise CommandError(
            f"--args {target} raised {type(err).__name__}: {_one_line(err)}"
        ) from None
    if isinstance(made, (tuple, list)):
        return list(made), {}
    if isinstance(made, dict) and made and set(made) <= {"args", "kwargs"}:
        args, kwargs = made.get("args", ()), made.get("kwargs", {})
        if isinstance(args, (tuple, list)) and isinstance(kwargs, dict):
            return list(args), dict(kwargs)
    raise CommandError(
        f"--args {target} returned {type(made).__name__}; it must return a tuple of the "
        "positional arguments, e.g. (params, batch), or a dict "
        "{'args': (params,), 'kwargs': {'train': False}}"
    )


def _parse_argnums(text: str, num_args: int) -> int | tuple[int, ...]:
    try:
        nums = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise CommandError(
            f"bad --argnums {text!r}: expected an argument index such as 0, or 0,1", status=2
        ) from None
    for n in nums:
        if not 0 <= n < num_args:
            raise CommandError(
                f"--argnums {text}: argument {n} does not exist; the function is given "
                f"{num_args} positional argument(s)"
            )
    return nums[0] if len(nums) == 1 else nums


def _inspect(args: argparse.Namespace) -> int:
    specs = [parse_arg_spec(spec) for spec in args.arg]
    steps = 3 + bool(args.html) + bool(args.microbatches)
    progress = Progress(steps, sys.stderr)
    with progress.step(f"importing {args.target}"):
        import jax

        import pipemark as pm
        from pipemark.signature import Signature
        from pipemark.staging import has_stage_markers
        from pipemark.views.text import DEFAULT_WIDTH, print_stage_inputs, print_summary

        fn = _import_target(args.target)
        made, kwargs = _example_args(args.args) if args.args else ([], {})
    positional = [*made, *specs]
    shown = ", ".join([*([f"*{args.args}()"] if args.args else []), *args.arg])
    if args.argnums is not None and not args.grad:
        raise CommandError("--argnums goes with --grad", status=2)
    argnums = _parse_argnums(args.argnums or "0", len(positional)) if args.grad else 0
    traced_fn = jax.value_and_grad(fn, argnums=argnums) if args.grad else fn
    label = f"value_and_grad({args.target}, argnums={argnums})" if args.grad else args.target
    with progress.step(f"tracing {label}({shown})"):
        try:
            signature = Signature.of(positional, kwargs, fn=fn)
            cj = pm.passes.inline_calls(signature.trace(traced_fn, positional, kwargs))
        except (Exception, SystemExit) as err:  # any error of the user's function
            raise CommandError(
                f"tracing {label}({shown}) failed: {type(err).__name__}: {_one_line(err)}"
            ) from None
    has_markers = has_stage_markers(cj)
    if args.num_stages is None:
        what = "slicing"
    elif has_markers:  # consecutive marked stages are merged, as pm.split and the runtime do
        what = f"merging the marked stages into {plural(args.num_stages, 'stage')}"
    else:
        what = f"cutting into {plural(args.num_stages, 'balanced stage')}"
    with progress.step(what):
        if args.num_stages is None and not has_markers:
            raise CommandError(
                f"{args.target} has no stage markers; pass --num-stages K to cut it into "
                "K balanced stages"
            )
        staged = pm.split_jaxpr(
            cj, num_stages=args.num_stages, block_cuts=args.block_cuts
        ).with_signature(signature)
    memory = None
    if args.microbatches:
        microbatches = plural(args.microbatches, "microbatch", "microbatches")
        with progress.step(f"planning a pipeline of {microbatches}"):
            memory = _memory_text(fn, positional, kwargs, staged, args)
    if args.html:
        with progress.step(f"writing {args.html}"):
            from pipemark.views.html_view import write_report

            try:
                write_report(
                    staged,
                    args.html,
                    title=f"pipemark: {label}",
                    description=f"{label} traced with arguments {shown}.",
                    sections=[("Memory per device", memory)] if memory else (),
                )
            except OSError as err:
                raise CommandError(f"cannot write {args.html}: {err.strerror or err}") from None
    # Every line within DEFAULT_WIDTH columns, as the table is (on a terminal, the table
    # may take its width).
    print_summary(staged, sys.stdout)
    if staged.balance is not None:
        print(wrap(f"balance: {staged.balance}", DEFAULT_WIDTH), file=sys.stdout)
    print_stage_inputs(staged, sys.stdout, width=DEFAULT_WIDTH)
    if memory:
        print(memory, file=sys.stdout)
    return 0


def _memory_text(fn: Any, positional: list, kwargs: dict, staged: Any, args: Any) -> str:
    """What each device would hold running ``fn`` as ``pm.pipeline_value_and_grad``
    (its first argument the parameters, the others the batch) over ``--microbatches``,
    with the arguments as zeros of their shapes: ``Pipeline.memory``'s table."""
    import jax
    import jax.numpy as jnp

    import pipemark as pm
    from pipemark.roles import FORWARD

    if kwargs or len(positional) < 2:
        raise CommandError(
            "--microbatches plans pipeline_value_and_grad(FUNCTION): give the parameters "
            "and the batch as positional arguments (at least two), parameters first"
        )
    concrete = jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x,
        positional,
    )
    devices = jax.devices()
    num_stages = sum(s.role.kind == FORWARD for s in staged.stages)
    schedule = args.schedule or ("1f1b" if len(devices) >= num_stages else "interleaved")
    try:
        pipe = pm.pipeline_value_and_grad(
            fn,
            num_stages=args.num_stages,
            num_microbatches=args.microbatches,
            schedule=schedule,
            block_cuts=args.block_cuts,
        )
        estimate = pipe.memory(*concrete)
    except pm.PipemarkError as err:
        raise CommandError(f"planning the pipeline failed: {_one_line(err)}") from None
    head = (
        "memory per device: pipeline_value_and_grad over "
        f"{plural(args.microbatches, 'microbatch', 'microbatches')}, "
        f"schedule {schedule!r}, {plural(len(estimate.slots), 'device slot')} (predicted; "
        "pipemark.runtime.memory)"
    )
    return "\n".join([wrap(head, 80), *_memory_columns(estimate)])


def _memory_columns(estimate: Any, per_line: int = 4) -> list[str]:
    """``estimate`` as a table of a column per device slot (``per_line`` slots side by
    side, so every line fits 80 columns) and a row per part of the peak."""
    from pipemark.runtime.memory.estimate import format_bytes

    parts = ("parameters", "batch", "accumulators", "in_flight", "temporaries", "update")
    parts = tuple(p for p in parts if any(getattr(s, p) for s in estimate.slots))
    lines = []
    for start in range(0, len(estimate.slots), per_line):
        slots = estimate.slots[start : start + per_line]
        rows = [("", *(f"slot {s.slot}" for s in slots))]
        rows.append(("", *(s.devices[:13] for s in slots)))
        rows += [
            (p.replace("_", " "), *(format_bytes(getattr(s, p)) for s in slots)) for p in parts
        ]
        rows.append(("predicted peak", *(format_bytes(s.predicted_peak) for s in slots)))
        lines += [f"{r[0]:<15}" + "".join(f"{c:>14}" for c in r[1:]) for r in rows]
    return lines


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2)."""

    def error(self, message: str) -> Any:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``pipemark inspect``."""
    parser.add_argument("target", metavar="MODULE:FUNCTION", help="e.g. mymodel:loss")
    parser.add_argument(
        "--args",
        metavar="MODULE:FUNCTION",
        help="a function returning example arguments (pytrees of arrays): a tuple of the "
        "positional arguments, or a dict {'args': (...), 'kwargs': {...}}",
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="SPEC",
        help="one per positional argument (after those of --args), DTYPE[DIM,...], e.g. "
        "f32[8,128] or i32[8]",
    )
    parser.add_argument(
        "--num-stages",
        type=_positive,
        metavar="K",
        help="cut into K balanced stages (a marked function: merge its consecutive marked "
        "stages into K)",
    )
    parser.add_argument(
        "--block-cuts",
        default="prefer",
        metavar="POLICY",
        help="with --num-stages: cut between the model's repeated blocks when that costs "
        "little balance (prefer, the default), always (require) or anywhere (off)",
    )
    parser.add_argument(
        "--grad",
        action="store_true",
        help="trace jax.value_and_grad(FUNCTION, argnums=...) instead",
    )
    parser.add_argument(
        "--argnums",
        metavar="N[,N...]",
        help="with --grad: the positional arguments to differentiate (default: 0, the "
        "first argument, usually the parameters)",
    )
    parser.add_argument(
        "--microbatches",
        type=_positive,
        metavar="M",
        help="also plan FUNCTION as pm.pipeline_value_and_grad over M microbatches (its "
        "first argument the parameters, the others the batch) and print what each device "
        "would hold (Pipeline.memory)",
    )
    parser.add_argument(
        "--schedule",
        metavar="NAME",
        help="with --microbatches: the schedule (default 1f1b, or interleaved when there "
        "are fewer devices than stages)",
    )
    parser.add_argument("--html", metavar="FILE", help="also write an HTML report")


def build_parser() -> argparse.ArgumentParser:
    from pipemark import __version__

    parser = _Parser(prog="pipemark", description="Pipeline-stage markers for JAX jaxprs.")
    parser.add_argument("--version", action="version", version=f"pipemark {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    demo = commands.add_parser(
        "demo",
        help="split a small transformer language model into 4 stages, check it and "
        "write report.html and stages.png",
        description="In this order: build a small transformer language model in plain "
        "JAX, trace jax.value_and_grad of its loss, cut it into 4 balanced stages (and "
        "print the stage table), run the stages and check them against the unsplit "
        "program, check the markers under jit, grad, vmap and hessian, and write "
        "report.html and stages.png into DIR.",
    )
    demo.add_argument(
        "--out", metavar="DIR", default="pipemark-demo", help="where to write (./pipemark-demo)"
    )
    demo.set_defaults(run=_demo)
    inspect = commands.add_parser(
        "inspect",
        help="trace a function with abstract arguments and print its stage table",
        description="Trace MODULE:FUNCTION with abstract arguments of the given shapes, "
        "cut it at its markers (or into K balanced stages) and print the stage table.",
    )
    _inspect_arguments(inspect)
    inspect.set_defaults(run=_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status.

    Output to a pipe that closed (``pipemark inspect ... | head -1``) ends the command
    quietly; output that cannot be written (a full disk) is one line of error."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a failure would be a traceback
        return status
    except BrokenPipeError:
        _discard_stdout()
        return 128 + 13  # as a command killed by SIGPIPE
    except OSError as err:
        if err.errno not in _WRITE_ERRNOS:
            raise
        _discard_stdout()
        print(f"pipemark: error: cannot write the output: {err.strerror}", file=sys.stderr)
        return 1


# Errors writing the output: no space, over quota, file too large, I/O error.
_WRITE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO))


def _discard_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of
    what is still buffered fails no more."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except CommandError as err:
        print(f"pipemark: error: {display_name(err)}", file=sys.stderr)
        return err.status
    except Exception as err:
        from pipemark.errors import PipemarkError

        if not isinstance(err, PipemarkError):
            raise
        print(f"pipemark: error: {_one_line(err, limit=1000)}", file=sys.stderr)
        return 1
