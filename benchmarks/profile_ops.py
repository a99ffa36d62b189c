"""Where a step's device time goes: a ``jax.profiler`` trace of a few steps of each
configuration of ``benchmarks/accelerator.py``, its device's XLA operations added up by
kind and output shape, side by side (the stage programs against the
same blocks inside the scan).

    python benchmarks/profile_ops.py --model llama-flash --layers 16 --configs scan,s4 \\
        --out "$OUT/profile-llama-flash16.json"

For each configuration, in one process (one program at a time holds a TPU chip): the
first call and one more step outside the trace, then ``--steps`` steps inside it. From
the trace's device plane (``/device:TPU:0``, ``jax.profiler.ProfileData``) it reads

* the programs (its "XLA Modules" line): the device's busy time a step, and the wall
  time a step, so that the gap between them is the device waiting for its host (a
  pipeline's dispatch, its transfers' bookkeeping);
* the operations (its "XLA Ops" line): their time a step, grouped by the operation's
  kind (``fusion``, ``copy``, ``custom-call``..., its HLO category where the trace has
  one) and its first output's shape, read from the operation's HLO text; the table
  adds them up by shape.

The table goes to stdout: each output shape's milliseconds a step in every
configuration, the shapes whose times differ most first. A CPU trace has no device
plane: there the script says so and writes no groups.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import re
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/accelerator.py (the models, the configurations, the scan), beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerator

#: Operations whose time is their body's: not counted again.
CONTAINERS = frozenset({"while", "conditional", "call"})
#: The shape of an operation's first output in its HLO text: ``f32[1,16,1024,1024]``.
SHAPE = re.compile(r"\b((?:bf16|f16|f32|f64|s8|s32|u8|u32|pred)\[[\d,]*\])")


def group_of(name: str, stats: dict) -> tuple[str, str] | None:
    """An operation's ``(kind, output shape)``: its HLO category where the trace gives
    one, else its instruction's name less the number XLA appends (a TPU's trace names
    an operation by its HLO text, ``%copy.202 = f32[32768,1024]{1,0} copy(...)``); the
    first shape of its text. ``None`` for a loop or call, whose time its body's
    operations already count.

    >>> group_of("%copy.202 = f32[32768,1024]{1,0:T(8,128)} copy(f32[32768,1024] %x)", {})
    ('copy', 'f32[32768,1024]')
    >>> group_of("fusion.12", {"long_name": "%fusion.12 = (bf16[8]{0}, f32[2]) fusion()"})
    ('fusion', 'bf16[8]')
    >>> group_of("%while.3 = (s32[], f32[8]) while(...)", {}) is None
    True
    """
    text = str(stats.get("long_name") or name)
    head = re.match(r"%?([\w-]+?)(?:\.\d+)*\s*=\s*(.*)", text, re.DOTALL)
    kind = head.group(1) if head else re.sub(r"[.\d]+$", "", name) or name
    if kind in CONTAINERS:
        return None
    found = SHAPE.search(head.group(2) if head else text)
    return str(stats.get("hlo_category") or kind), found.group(1) if found else "?"


def summarise(events: list[tuple[str, str, int, dict]], steps: int, wall_s: float) -> dict:
    """A trace's device events ``(line, name, duration_ns, stats)`` as milliseconds a
    step: ``busy_ms`` (the programs' time), ``wall_ms``, ``programs`` (each program's
    time and count a step) and ``groups`` (``"kind shape"`` to milliseconds a step).

    >>> ev = [("XLA Modules", "jit_step", 4_000_000, {}),
    ...       ("XLA Ops", "fusion.1", 3_000_000, {"long_name": "%fusion.1 = f32[4]{0} fusion()"})]
    >>> s = summarise(ev, steps=2, wall_s=0.006)
    >>> s["busy_ms"], s["wall_ms"], s["groups"]
    (2.0, 3.0, {'fusion f32[4]': 1.5})
    """
    programs: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    groups: dict[str, float] = collections.defaultdict(float)
    for line, name, duration, stats in events:
        ms = duration / 1e6 / steps
        if line == "XLA Modules":
            program = re.sub(r"\(\d+\)$", "", name)
            programs[program][0] += ms
            programs[program][1] += 1 / steps
        elif line == "XLA Ops" and (group := group_of(name, stats)) is not None:
            groups[" ".join(group)] += ms
    busy = sum(ms for ms, _ in programs.values())
    return {
        "busy_ms": round(busy, 3),
        "wall_ms": round(1e3 * wall_s / steps, 3),
        "programs": {k: [round(ms, 3), round(n, 2)] for k, (ms, n) in programs.items()},
        "groups": {k: round(v, 4) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
    }


def device_events(path: str) -> tuple[list[tuple[str, str, int, dict]], list[str]]:
    """The events of a trace's first device plane (an ``.xplane.pb`` file), and the
    names of its planes and lines (what the trace held, for a report of none)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    events, seen = [], []
    for plane in data.planes:
        seen.append(f"{plane.name}: {', '.join(line.name for line in plane.lines)}")
        if not plane.name.startswith("/device:") or events:
            continue
        for line in plane.lines:
            for event in line.events:
                stats = {str(k): v for k, v in event.stats}
                events.append((line.name, event.name, event.duration_ns, stats))
    return events, seen


def profile(args: argparse.Namespace, config: str) -> dict:
    """One configuration's first call, then ``args.steps`` steps in a trace."""
    import jax

    device = jax.devices()[0]
    sizes = accelerator.resolve_sizes(args, device.platform)
    with accelerator.kernel_mode(args.model, device.platform):
        options = (sizes, args.microbatches, device, args.model)
        step, _, params, batch = accelerator.prepare(config, *options)
        start = time.perf_counter()
        jax.block_until_ready(step(params, batch))
        first = time.perf_counter() - start
        jax.block_until_ready(step(params, batch))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            start = time.perf_counter()
            for _ in range(args.steps):
                jax.block_until_ready(step(params, batch))
            wall = time.perf_counter() - start
        (path,) = Path(folder).rglob("*.xplane.pb")
        events, seen = device_events(str(path))
    result = summarise(events, args.steps, wall)
    result.update(config=config, first_s=round(first, 2), trace=seen, sizes=sizes)
    return result


def by_shape(groups: dict[str, float]) -> dict[str, float]:
    """Groups (``"kind shape"``) added up by their output shape alone: two programs'
    XLA names the same work differently (a scan's ``select_add_fusion`` accumulates
    what a stage's ``multiply_add_fusion`` does), and its shape says what it is.

    >>> by_shape({"copy f32[8]": 1.0, "fusion f32[8]": 2.0, "fusion bf16[2]": 0.5})
    {'f32[8]': 3.0, 'bf16[2]': 0.5}
    """
    shapes: dict[str, float] = collections.defaultdict(float)
    for key, ms in groups.items():
        shapes[key.rsplit(" ", 1)[-1]] += ms
    return dict(shapes)


def table(results: list[dict], top: int = 25) -> str:
    """The wall and device time a step of each configuration, and the milliseconds a
    step of each output shape's operations (:func:`by_shape`), those that differ most
    between the configurations first."""
    names = [r["config"] for r in results]
    shapes = [by_shape(r["groups"]) for r in results]
    lines = [
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| wall ms a step | " + " | ".join(f"{r['wall_ms']:.2f}" for r in results) + " |",
        "| device busy ms | " + " | ".join(f"{r['busy_ms']:.2f}" for r in results) + " |",
        "| programs a step | "
        + " | ".join(f"{sum(n for _, n in r['programs'].values()):.0f}" for r in results)
        + " |",
    ]
    keys = {k for s in shapes for k in s}
    spread = {
        k: max(s.get(k, 0.0) for s in shapes) - min(s.get(k, 0.0) for s in shapes) for k in keys
    }
    for key in sorted(keys, key=lambda k: (-spread[k], k))[:top]:
        cells = " | ".join(f"{s.get(key, 0.0):.2f}" for s in shapes)
        lines.append(f"| `{key}` ms | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="scan,s4")
    accelerator.add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")
    results = []
    for config in args.configs.split(","):
        results.append(profile(args, config))
        gc.collect()
    header = f"{datetime.date.today()}; {jax.devices()[0].device_kind}; JAX {jax.__version__}"
    print(f"{header}; model {args.model}, {args.microbatches} microbatches")
    if not any(r["groups"] for r in results):
        print("no device operations in the trace (a CPU has no device plane): " + "; ".join(
            results[0]["trace"]))  # fmt: skip
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "results": results}) + "\n")


if __name__ == "__main__":
    main()
