"""More than fits: the largest batch and the largest number of blocks that train on one
device with ``jax.jit``, a ``lax.scan`` accumulation and the pipeline with
``memory_budget`` equal to the device's memory, side by side.

    python benchmarks/capacity.py --out "$OUT/capacity-tpu-v5e.json"       # on a TPU
    python benchmarks/capacity.py --size tiny --memory-bytes 3000000        # on CPU

The model is ``benchmarks/accelerator.py``'s (``pipemark.examples.gpt``: float32
parameters, bfloat16 matmuls, its blocks ``--layers`` deep; ``--model mlp``:
``pipemark.examples.mlp``, ``--d-model`` wide, whose programs compile in a tenth of the
time, for the tests). The three methods, as accelerator.py runs them:

* ``jit``: ``jax.jit(jax.value_and_grad(loss))`` of the unmarked model on the batch;
* ``scan``: ``jax.jit`` of a ``lax.scan`` accumulating ``value_and_grad`` over the
  batch's microbatches, what a user writes instead of a pipeline;
* ``pipeline``: ``pm.pipeline_value_and_grad`` of the model with a boundary between its
  blocks, one stage per block, interleaved on the one device, the microbatches the
  scan's, with ``memory_budget`` the device's memory (the budget chooses fewer
  microbatches in flight, rematerialisation...).

Two searches per method: the largest batch, in whole microbatches of
``--microbatch-rows`` rows, at ``--layers`` blocks; and the largest number of blocks at
``--microbatches`` microbatches. A size *trains* when, on a device that reports its
memory (``memory_stats()["bytes_limit"]``, a TPU's), its program compiles (XLA refuses
one that does not fit with ``RESOURCE_EXHAUSTED``) and one step runs without running out
of memory (for the pipeline also: ``memory_budget`` accepts a plan, refused before
compiling otherwise). A CPU has no such limit: ``--memory-bytes N`` pretends one, and a
``jit`` or ``scan`` program fits when its compiled ``memory_analysis()`` (arguments +
outputs + temporaries - aliased) is at most ``N``, the pipeline when
``memory_budget=N`` accepts a plan; the step then runs. The table says which criterion
it used.

Each probe compiles, so the search grows the size (extrapolating from the bytes of the
sizes that fitted, at most ``x 16`` a probe but to the cap, else doubling) until one
does not fit or ``--max-microbatches`` / ``--max-blocks`` is reached, then narrows the
gap (interpolating, every other probe halving it), at most ``--max-probes`` probes a
search; the searches share ``--budget-s`` seconds (each gets an equal share of what is
left, and starts no probe that, as long as its longest, would end past it; the batch
searches go first), and a probe made for one search (the same method,
blocks and microbatches) answers the other. A search cut short reports the range it
narrowed to; ``--resume FILE`` goes on from the searches an earlier run's ``--out``
wrote (the same device, JAX, model and limits), each from the sizes it found, with
``--max-probes`` more probes (the searches it does not run are kept as they were).
The table goes to stdout, the results as JSON to ``--out`` (``report``
renders them: docs/benchmarks/tpu-v5e.md, "More than fits").
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

# benchmarks/accelerator.py (the model, its sizes, the scan, XLA's messages), found
# beside this file also when the docs run this module by path to render results.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import accelerator

METHODS = ("jit", "scan", "pipeline")
AXES = ("batch", "blocks")
#: ``--size`` presets: ``tpu`` (``auto`` on an accelerator) is accelerator.py's GPT
#: twice as wide (50M parameters a block), so that about 20 blocks fill a 16 GiB chip
#: and the block searches compile programs of tens of blocks, not of a hundred, within
#: the budget; its batch search at 4 blocks.
SIZES = {
    "tpu": dict(accelerator.SIZES["gpt"], layers=4, d_model=2048, d_ff=8192),
    "tiny": dict(layers=2, d_model=32, heads=2, d_ff=128, vocab=64, seq=16),
}
MODEL_KEYS = ("layers", "d_model", "heads", "d_ff", "vocab", "seq")


def _log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ the search


def largest(
    fits: Callable[[int], dict],
    start: int,
    cap: int,
    limit: int,
    max_probes: int = 8,
    deadline: float = math.inf,
    known: dict[int, dict] | None = None,
) -> dict:
    """The largest ``n`` in ``[start, cap]`` with ``fits(n)["fits"]``, for ``fits``
    that holds up to some size and not beyond, each call costly. ``fits(n)`` returns
    ``{"fits": bool, "bytes": int | None}`` (what ``n`` needs, where known: the growth
    extrapolates from it to ``limit``). Returns ``largest`` (``None``: not even
    ``start``), ``upper`` (the smallest size seen not to fit, ``None`` if none),
    ``exact`` (``upper == largest + 1``), ``capped`` (``cap`` fits) and the sizes
    ``tried``, in order. It stops early after ``max_probes`` calls, or where a call as
    long as the longest so far (its ``"seconds"``) would end past ``deadline``
    (``time.perf_counter()``). ``known``: the answers of an earlier search of the same
    function (``{n: fits(n)}``), which this one goes on from where one of them fits;
    ``max_probes`` counts the new calls.

    >>> search = largest(lambda n: {"fits": 10 * n <= 95, "bytes": 10 * n}, 1, 64, 95)
    >>> search["largest"], search["exact"], search["tried"]
    (9, True, [1, 2, 9, 10])
    >>> again = largest(lambda n: {"fits": n <= 9}, 1, 64, 95, known={1: {"fits": True}})
    >>> again["largest"], again["tried"]  # 1 known: it doubles from there
    (9, [1, 2, 4, 8, 16, 12, 10, 9])
    """
    seen = dict(known or {})
    low, high = _bounds(seen)
    if low is None:  # nothing known fits: a search of its own
        seen, high = {}, None
    new = len(seen)

    def probe(n: int) -> bool:
        seen[n] = fits(n)
        return seen[n]["fits"]

    def more() -> bool:  # a probe as long as the longest so far still ends in time
        longest = max((r.get("seconds", 0.0) for r in seen.values()), default=0.0)
        return len(seen) - new < max_probes and time.perf_counter() + longest < deadline

    n = start if low is None else _grow(seen, low, cap, limit)
    while high is None and (low is None or low < cap) and more():  # grow
        if not probe(n):
            high = n
            break
        low = n
        if n >= cap:
            break
        n = _grow(seen, low, cap, limit)
    halve = False
    while low is not None and high is not None and high - low > 1 and more():  # narrow
        guess = None if halve else _interpolate(seen, low, high, limit)
        n = (low + high) // 2 if guess is None else min(max(guess, low + 1), high - 1)
        low, high = (n, high) if probe(n) else (low, n)
        halve = not halve
    return {
        "largest": low,
        "upper": high,
        "exact": (high == low + 1) if low is not None else high == start,
        "capped": low is not None and low >= cap,
        "tried": list(seen),
        "probes": {str(n): result for n, result in seen.items()},
        "recorded": new,  # of the probes, those known before
    }


def _bounds(seen: dict[int, dict]) -> tuple[int | None, int | None]:
    """The largest size seen to fit, and the smallest above it seen not to."""
    low = max((n for n, r in seen.items() if r["fits"]), default=None)
    above = [n for n, r in seen.items() if not r["fits"] and (low is None or n > low)]
    return low, min(above, default=None)


def _fitted_bytes(seen: dict[int, dict]) -> list[tuple[int, int]]:
    return sorted((n, r["bytes"]) for n, r in seen.items() if r["fits"] and r.get("bytes"))


def _grow(seen: dict[int, dict], low: int, cap: int, limit: int) -> int:
    """The next size to try above ``low``, which fits: where the bytes of the two
    largest sizes that fitted extrapolate to ``limit`` (within ``low + 1`` and
    ``16 * low``, or ``cap``), else ``2 * low``; at most ``cap``."""
    points = _fitted_bytes(seen)
    guess = 2 * low
    if len(points) >= 2:
        (n0, b0), (n1, b1) = points[-2:]
        if b1 > b0:
            guess = n1 + (limit - b1) * (n1 - n0) // (b1 - b0)
            # At most 16 x (a step too far costs a large compilation), but the cap
            # where the bytes hardly grow (a scan's batch: only the tokens).
            guess = cap if guess >= cap else min(max(guess, low + 1), 16 * low)
    return min(guess, cap)


def _interpolate(seen: dict[int, dict], low: int, high: int, limit: int) -> int | None:
    """Where the bytes reach ``limit`` between ``low`` (fits) and ``high`` (does not):
    linear between their bytes where both are known, else from the slope of the two
    largest sizes that fitted; ``None`` where neither is known."""
    b_low, b_high = seen[low].get("bytes"), seen[high].get("bytes")
    if b_low and b_high and b_high > b_low:
        return low + (limit - b_low) * (high - low) // (b_high - b_low)
    points = _fitted_bytes(seen)
    if len(points) >= 2 and b_low:
        (n0, b0), (n1, b1) = points[-2:]
        if b1 > b0:
            return low + (limit - b_low) * (n1 - n0) // (b1 - b0)
    return None


# ------------------------------------------------------------------------ the probes


class Prober:
    """Whether a method trains at a size on ``device``: ``prober(method, blocks,
    microbatches)`` returns ``{"fits", "bytes", "why", "seconds"}``, each answer kept
    (the batch and the blocks searches meet at ``--layers`` blocks and
    ``--microbatches`` microbatches). ``limit``: the device's bytes; ``pretend``: the
    limit is ``--memory-bytes`` on a device without one (judged by the compiled
    programs' bytes, not by running out)."""

    def __init__(
        self, sizes: dict, rows: int, device, limit: int, pretend: bool, model: str = "gpt"
    ) -> None:
        self.sizes, self.rows, self.device = sizes, rows, device
        self.limit, self.pretend, self.kind = limit, pretend, model
        self.answers: dict[tuple[str, int, int], dict] = {}
        self._model: tuple[int, tuple] | None = None  # (blocks, its model)

    def __call__(self, method: str, blocks: int, microbatches: int) -> dict:
        key = (method, blocks, microbatches)
        if key not in self.answers:
            start = time.perf_counter()
            answer = self._probe(method, blocks, microbatches)
            answer["seconds"] = round(time.perf_counter() - start, 2)
            gc.collect()  # the probe's arrays and programs, before the next allocates
            _log(f"{method}, {blocks} blocks, {microbatches} microbatches: {answer}")
            self.answers[key] = answer
        return self.answers[key]

    def model(self, blocks: int) -> tuple:
        """``(plain_loss, marked_loss, params, one_microbatch)`` at ``blocks`` blocks
        (the last asked for kept: its parameters take the device's memory)."""
        import jax

        if self._model is None or self._model[0] != blocks:
            self._model = None
            gc.collect()
            # The marked model's parameters dropped before the plain one draws its own:
            # never two copies on the device.
            marked = self._example(blocks, "boundary").loss_fn
            plain = self._example(blocks, None)
            params, batch = jax.device_put(plain.args, self.device)
            self._model = (blocks, (plain.loss_fn, marked, params, batch))
        return self._model[1]

    def _example(self, blocks: int, markers: str | None):
        if self.kind == "mlp":
            from pipemark import examples

            width = self.sizes["d_model"]
            return examples.mlp(blocks, width, self.rows, markers=markers)
        return accelerator.gpt_example(dict(self.sizes, layers=blocks), self.rows, markers)

    def _probe(self, method: str, blocks: int, microbatches: int) -> dict:
        import jax
        import jax.numpy as jnp

        import pipemark as pm

        try:  # the parameters themselves may not fit, nor the batch
            plain, marked, params, one = self.model(blocks)
            batch = jax.tree.map(lambda x: jnp.tile(x, (microbatches, 1)), one)
            if method == "pipeline":
                return self._pipeline(marked, blocks, microbatches, params, batch)
            return self._jit(method, plain, microbatches, params, batch)
        except pm.MemoryBudgetError as error:
            why = "memory_budget: " + _first(error)
            return {"fits": False, "bytes": needed_bytes(str(error)), "why": why}
        except pm.DeviceOutOfMemoryError as error:
            return {"fits": False, "bytes": None, "why": "ran out: " + _first(error)}
        except Exception as error:  # XLA's: at compile time or while running
            message = f"{type(error).__name__}: {error}"
            if not accelerator.is_out_of_memory(message):
                raise
            short = accelerator.short_error(message)
            return {"fits": False, "bytes": needed_bytes(message), "why": short}

    def _jit(self, method: str, loss_fn, microbatches: int, params, batch) -> dict:
        import jax

        if method == "jit":
            step = jax.jit(jax.value_and_grad(loss_fn))
        else:
            step = jax.jit(accelerator.scan_accumulation(loss_fn, microbatches))
        compiled = step.lower(params, batch).compile()  # a TPU refuses what does not fit
        analysis = compiled.memory_analysis()
        needs = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes
        )
        if self.pretend and needs > self.limit:
            why = f"memory_analysis {_bytes(needs)}, over the limit"
            return {"fits": False, "bytes": needs, "why": why}
        jax.block_until_ready(compiled(params, batch))
        return {"fits": True, "bytes": needs, "why": "trained"}

    def _pipeline(self, loss_fn, blocks: int, microbatches: int, params, batch) -> dict:
        import jax

        import pipemark as pm

        pipe = pm.pipeline_value_and_grad(
            loss_fn,
            num_stages=blocks,
            num_microbatches=microbatches,
            schedule="interleaved",
            devices=[self.device],
            memory_budget=self.limit,
        )
        jax.block_until_ready(pipe(params, batch))  # the budget refuses before compiling
        plan = pipe.plan(params, batch)
        peak = max(s.predicted_peak for s in pipe.memory(params, batch).slots)
        how = f"{max(plan.schedule.in_flight())} in flight"
        if plan.rematerialized:
            how += f", {len(plan.rematerialized)} of {blocks} stages rematerialised"
        return {"fits": True, "bytes": peak, "why": f"trained ({how})"}


_UNITS = {"": 1, "B": 1, "K": 2**10, "KiB": 2**10, "M": 2**20, "MiB": 2**20}
_UNITS.update(G=2**30, GiB=2**30)


def needed_bytes(message: str) -> int | None:
    """What a refusal says a program needs, where it says (the search interpolates
    with it): ``memory_budget``'s "needs (at least) 3.9 MiB", XLA's "Used 26.81G of
    15.75G hbm"; ``None`` where it does not.

    >>> needed_bytes("Slot 0 (tpu:0) needs at least 2.0 GiB, 1.0 GiB over memory_budget")
    2147483648
    >>> needed_bytes("RESOURCE_EXHAUSTED: Ran out of memory. Used 1.5G of 15.75G hbm.")
    1610612736
    """
    found = re.search(r"needs (?:at least )?([\d.]+) (B|KiB|MiB|GiB)\b", message) or re.search(
        r"Used ([\d.]+)([KMG]?) of [\d.]+[KMG]? hbm", message
    )
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


def _first(error: Exception) -> str:
    """An error's first clause: ``"Slot 0 (cpu:0) needs at least 5.1 MiB, 2.3 MiB over
    memory_budget=3000000 (2.9 MiB)"``."""
    text = " ".join(str(error).split())
    for end in (" with ", ". ", ": "):
        text = text.split(end)[0]
    return text[:160]


# ---------------------------------------------------------------------- the searches


def search_all(
    args: argparse.Namespace, prober: Prober, recorded: dict | None = None
) -> list[dict]:
    """Each method's two searches (``args.methods``, ``args.axes``), each within an
    equal share of what is left of ``args.budget_s``; with ``recorded`` (an earlier
    run's results, as ``run`` returns them), each goes on from that run's search, and
    that run's other searches are kept as they were."""
    begin = time.perf_counter()
    earlier = {(s["method"], s["axis"]): s for s in (recorded or {}).get("searches", [])}
    # The batches first: the block searches, which compile the largest programs, get
    # what the others left of the budget.
    todo = [(method, axis) for axis in args.axes for method in args.methods]
    searches = [s for key, s in earlier.items() if key not in todo]
    for k, (method, axis) in enumerate(todo):
        left = args.budget_s - (time.perf_counter() - begin)
        deadline = time.perf_counter() + left / (len(todo) - k)
        start = time.perf_counter()
        if axis == "batch":
            fits = lambda n, m=method: prober(m, args.layers, n)  # noqa: E731
            cap = args.max_microbatches
        else:
            fits = lambda n, m=method: prober(m, n, args.microbatches)  # noqa: E731
            cap = args.max_blocks
        before = earlier.get((method, axis), {"probes": {}, "seconds": 0.0})
        known = {int(n): probe for n, probe in before["probes"].items()}
        found = largest(fits, 1, cap, prober.limit, args.max_probes, deadline, known)
        spent = before["seconds"] * bool(found["recorded"]) + time.perf_counter() - start
        found.update(method=method, axis=axis, seconds=round(spent, 1))
        _log(f"{method}, largest {axis}: {found['largest']} (tried {found['tried']})")
        searches.append(found)
    return searches


def run(args: argparse.Namespace) -> dict:
    """The searches on the default device, and what they ran on, as JSON."""
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")
    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    pretend = args.memory_bytes is not None
    if pretend:
        limit = args.memory_bytes
    elif limit is None:
        sys.exit(
            f"{device.platform} reports no memory limit (memory_stats()['bytes_limit']): "
            "pass --memory-bytes N to judge the programs against N bytes"
        )
    sizes = resolve_sizes(args, device.platform)
    args.layers = sizes["layers"]
    results = {
        "date": f"{datetime.date.today()}",
        "platform": device.platform,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "model": args.model,
        "sizes": sizes,
        "microbatch_rows": args.microbatch_rows,
        "microbatches": args.microbatches,
        "max_microbatches": args.max_microbatches,
        "max_blocks": args.max_blocks,
        "max_probes": args.max_probes,
        "limit": limit,
        "pretend": pretend,
    }
    recorded = _recorded(args.resume, results) if args.resume else None
    begin = time.perf_counter()
    prober = Prober(sizes, args.microbatch_rows, device, limit, pretend, args.model)
    results["searches"] = search_all(args, prober, recorded)
    results["seconds"] = round(time.perf_counter() - begin, 1)
    if recorded is not None:  # each run's date and seconds, the earlier ones first
        earlier = recorded.get("runs") or [{k: recorded[k] for k in ("date", "seconds")}]
        results["runs"] = [*earlier, {k: results[k] for k in ("date", "seconds")}]
        results["seconds"] = round(results["seconds"] + recorded["seconds"], 1)
        results.update({"note": recorded["note"]} if "note" in recorded else {})
    return results


#: What an earlier run must share with this one for its probes to answer this one's.
SAME = ("platform", "device_kind", "jax", "model", "sizes", "microbatch_rows")
SAME += ("microbatches", "max_microbatches", "max_blocks", "limit", "pretend")


def _recorded(path: str, results: dict) -> dict:
    """The earlier run ``--resume`` names, if it ran what this one runs."""
    recorded = json.loads(Path(path).read_text())
    differ = [key for key in SAME if recorded.get(key) != results[key]]
    if differ:
        sys.exit(
            f"--resume {path} ran another search: its "
            + ", ".join(f"{k} {recorded.get(k)!r} (here {results[k]!r})" for k in differ)
        )
    return recorded


def resolve_sizes(args: argparse.Namespace, platform: str) -> dict:
    """The model sizes: the preset (``auto``: ``tiny`` on CPU, ``tpu`` elsewhere) with
    the flags over it."""
    name = args.size if args.size != "auto" else ("tiny" if platform == "cpu" else "tpu")
    sizes = dict(SIZES[name], preset=name)
    for key in MODEL_KEYS:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    return sizes


# -------------------------------------------------------------------------- the table

NAMES = {
    "jit": "`jax.jit(value_and_grad)`",
    "scan": "`jax.jit` of a `lax.scan` accumulation",
    "pipeline": "pipeline, a stage per block, `memory_budget` = the limit",
}


def cell(search: dict, unit: int = 1) -> str:
    """A search's answer in words: ``"12"``, ``"≥ 64 (the cap)"``, ``"12–15 (stopped)"``
    or ``"none"``; sizes times ``unit`` (rows per microbatch).

    >>> cell({"largest": 3, "upper": 4, "exact": True, "capped": False}, unit=2)
    '6'
    """
    low, high = search["largest"], search["upper"]
    if low is None:
        return "none" if search["exact"] else f"none found ({high * unit} does not fit)"
    if search["capped"]:
        return f"≥ {low * unit} (the cap)"
    if search["exact"]:
        return f"{low * unit}"
    if high is None:
        return f"≥ {low * unit} (stopped)"
    return f"{low * unit}–{(high - 1) * unit} (stopped)"


def ratio(top: dict, bottom: dict) -> str:
    """``top``'s largest size over ``bottom``'s, as a number where both are exact and
    as the bounds they allow where not.

    >>> ratio({"largest": 8, "upper": None}, {"largest": 4, "upper": 5})
    '≥ 2.00 ×'
    """
    if not top["largest"] or not bottom["largest"]:
        return "—"
    least = None if bottom["upper"] is None else top["largest"] / (bottom["upper"] - 1)
    most = None if top["upper"] is None else (top["upper"] - 1) / bottom["largest"]
    if least is not None and most is not None:
        return f"{least:.2f} ×" if least == most else f"{least:.2f}–{most:.2f} ×"
    if least is not None:
        return f"≥ {least:.2f} ×"
    return "—" if most is None else f"≤ {most:.2f} ×"


def criterion(results: dict, method: str) -> str:
    if results["pretend"]:
        if method == "pipeline":
            return "`memory_budget` accepts a plan, one step runs"
        return "`memory_analysis()` within the limit, one step runs"
    if method == "pipeline":
        return "`memory_budget` accepts a plan, it compiles, one step runs on the device"
    return "compiles (XLA), one step runs on the device"


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def _probe_line(search: dict, unit: int) -> str:
    """``"- jit, batch: 4 probes in 20.1 s: 1 fits, 2 fits, 9 fits, 10 does not ..."``"""
    words = []
    for n, probe in search["probes"].items():
        size = int(n) * (unit if search["axis"] == "batch" else 1)
        if probe["fits"]:
            need = f", {_bytes(probe['bytes'])}" if probe.get("bytes") else ""
            how = probe["why"].removeprefix("trained")  # what the budget chose
            words.append(f"{size} fits{need}{how}")
        else:
            words.append(f"{size} does not ({probe['why']})")
    before = search.get("recorded")  # none in a search that was not resumed
    recorded = f" ({before} of them before it was resumed)" if before else ""
    return (
        f"- {search['method']}, {search['axis']}: {len(search['probes'])} probes{recorded} in "
        f"{search['seconds']:.1f} s: " + "; ".join(words)
    )


def _runs(results: dict) -> str:
    """``", in 2 runs (2026-12-06: 598 s; 2026-12-07: 102 s)"`` for searches that went
    on from earlier ones (``--resume``); ``""`` for one run."""
    runs = results.get("runs", [])
    if len(runs) < 2:
        return ""
    return f", in {len(runs)} runs (" + "; ".join(
        f"{run['date']}: {run['seconds']:.0f} s" for run in runs) + ")"  # fmt: skip


def report(results: dict) -> str:
    """The header, table, ratios and probes of a run's results (as ``--out`` writes
    them)."""
    sizes, rows = results["sizes"], results["microbatch_rows"]
    if results.get("model", "gpt") == "mlp":
        model = f"examples.mlp ({sizes['d_model']} wide, float32); a microbatch is {rows} row"
        model += "s" * (rows > 1)
    else:
        sized = ", ".join(f"{k} {sizes[k]}" for k in MODEL_KEYS[1:])
        model = (
            f"examples.gpt ({sizes['preset']} sizes: {sized}; float32 parameters, bfloat16 "
            f"matmuls); a microbatch is {rows} row{'s' * (rows > 1)} of {sizes['seq']} tokens"
        )
    if results["pretend"]:
        limit = f"a pretend limit of {_bytes(results['limit'])} (`--memory-bytes`)"
    else:
        limit = f"the device's `bytes_limit`, {_bytes(results['limit'])}"
    by = {(s["method"], s["axis"]): s for s in results["searches"]}
    lines = [
        f"{results['date']}; {results['device_kind']} ({results['platform']}); "
        f"JAX {results['jax']}; {results['seconds']:.0f} s in all{_runs(results)}",
        f"model: {model}",
        f"largest batch (rows) at {sizes['layers']} blocks, in whole microbatches, at most "
        f"{results['max_microbatches']}; largest blocks at {results['microbatches']} "
        f"microbatches ({results['microbatches'] * rows} rows), at most "
        f"{results['max_blocks']}; at most {results['max_probes']} probes a search",
        f"memory: {limit}",
        "",
        "| method | largest batch (rows) | largest blocks | criterion |",
        "|---|---|---|---|",
    ]
    for method in METHODS:
        batch, blocks = by.get((method, "batch")), by.get((method, "blocks"))
        if batch is None and blocks is None:
            continue
        lines.append(
            f"| {NAMES[method]} | {cell(batch, rows) if batch else '—'} | "
            f"{cell(blocks) if blocks else '—'} | {criterion(results, method)} |"
        )
    lines.append("")
    for other in ("jit", "scan"):
        ratios = [
            f"{axis} {ratio(by[('pipeline', axis)], by[(other, axis)])}"
            for axis in AXES
            if ("pipeline", axis) in by and (other, axis) in by
        ]
        if ratios:
            lines.append(f"- pipeline ÷ {other}: " + ", ".join(ratios))
    lines += [_probe_line(s, rows) for s in results["searches"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    parser.add_argument("--size", choices=["auto", *SIZES], default="auto")
    for key in MODEL_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int)
    parser.add_argument("--microbatch-rows", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8, help="the blocks search's")
    parser.add_argument("--max-microbatches", type=int, default=64)
    parser.add_argument("--max-blocks", type=int, default=64)
    parser.add_argument("--max-probes", type=int, default=8, help="a search's")
    parser.add_argument("--budget-s", type=float, default=480.0, help="for all searches")
    parser.add_argument("--memory-bytes", type=int, help="a pretend limit (CPU)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--axes", default=",".join(AXES))
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--resume", help="go on from the searches of this earlier --out")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    args.axes = [a for a in args.axes.split(",") if a]
    unknown = sorted(set(args.methods) - set(METHODS)) + sorted(set(args.axes) - set(AXES))
    if unknown:
        parser.error(f"unknown methods or axes {unknown}; known: {METHODS}, {AXES}")
    results = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(report(results))


if __name__ == "__main__":
    main()
