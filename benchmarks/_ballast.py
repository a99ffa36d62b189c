"""The ballast check of a predicted peak (is it an upper bound, and how close?), for
``benchmarks/accelerator.py --ballast``.

A TPU's ``memory_stats()["peak_bytes_in_use"]`` counts arrays, not the programs' XLA
temporaries, so it cannot say whether a predicted peak covers the whole peak. What can:
fill the device with one array (the ballast) that leaves ``fraction`` x the predicted
peak free, and run the step. With the room the prediction asks for (``fraction`` 1, less
a small margin) the step must run; a prediction that is at most 7 % over what the step
needs makes it run out of memory once the room is below ``1 / 1.07`` x the prediction.
The tries go down the fractions and stop at the first that runs out of memory.

The check runs where a device reports ``bytes_limit``; on CPU it is not made.
"""

from __future__ import annotations

import gc

#: The free room tried, as fractions of the predicted peak, largest first: around
#: ``1 / 1.07`` (0.9346) closely, so that a loose prediction says by how much.
FRACTIONS = (1.0, 0.97, 0.95, 0.935, 0.92, 0.9, 0.8)
#: What the first try leaves free beyond the predicted peak (allocator rounding).
MARGIN = 64 * 2**20


def _fill(size: int, device):
    """An array of about ``size`` bytes made on ``device`` (float32 rows of 1024: the
    TPU's tiles, no padding), without a host copy."""
    import jax
    import jax.numpy as jnp

    rows = max(size // 4096, 1)
    make = jax.jit(lambda: jnp.zeros((rows, 1024), jnp.float32))
    with jax.default_device(device):
        return jax.block_until_ready(make())


def _in_use(device) -> int:
    return int((device.memory_stats() or {}).get("bytes_in_use", 0))


def ballast_check(step, params, batch, device, predicted_peak: int, out_of_memory) -> dict:
    """Run ``step(params, batch)`` on ``device`` beside ballasts that leave each of
    :data:`FRACTIONS` x ``predicted_peak`` free; ``out_of_memory(message)`` says whether
    an error is the device running out of memory (anything else is raised).

    Returns the device's limit, its bytes in use before the ballast (the step's own
    arguments and programs), and per try the fraction, the ballast's bytes and
    ``"ran"``, ``"out of memory"`` or ``"ballast did not fit"``.
    """
    import jax

    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    if not limit:
        return {"status": "no bytes_limit on this device"}
    gc.collect()
    out = {"limit": limit, "predicted": predicted_peak, "in_use": _in_use(device), "tries": []}
    for fraction in FRACTIONS:
        size = limit - int(fraction * predicted_peak) - (MARGIN if fraction >= 1 else 0)
        try:
            ballast = _fill(size, device)
        except Exception as error:  # sorted into "did not fit", or raised
            if not out_of_memory(f"{type(error).__name__}: {error}"):
                raise
            out["tries"].append(
                {"fraction": fraction, "ballast": size, "result": "ballast did not fit"}
            )
            continue
        try:
            jax.block_until_ready(step(params, batch))
            result = "ran"
        except Exception as error:  # sorted into out of memory, or raised
            if not (isinstance(error, MemoryError) or out_of_memory(f"{error}")):
                raise
            result = "out of memory"
        finally:
            del ballast
            gc.collect()
        out["tries"].append({"fraction": fraction, "ballast": size, "result": result})
        if result == "out of memory":
            break
    return out


def verdict(config: str, check: dict) -> str:
    """One line: the smallest room the step ran in and the largest it ran out of memory
    in, as fractions of the prediction, and the two conditions.

    >>> verdict("s4", {"limit": 16, "predicted": 8, "in_use": 1, "tries": [
    ...     {"fraction": 1.0, "ballast": 7, "result": "ran"},
    ...     {"fraction": 0.93, "ballast": 8, "result": "out of memory"}]})
    '- s4, ballast: ran with 1.0 x the predicted peak free (less 64 MiB); out of memory with 0.93 x: the prediction covers the step (met), and is at most 1/0.93 = 1.08 x what it needs'
    """
    if "tries" not in check:
        return f"- {config}, ballast: not checked ({check.get('status')})"
    ran, short = _rooms(check)
    covered = "met" if 1.0 in ran else "NOT met: ran out of memory with the room predicted"
    line = f"- {config}, ballast: "
    line += f"ran with {min(ran)} x the predicted peak free" if ran else "never ran"
    line += " (less 64 MiB)" if ran and min(ran) >= 1 else ""
    if short:
        line += f"; out of memory with {max(short)} x: the prediction covers the step ({covered})"
        line += f", and is at most 1/{max(short)} = {1 / max(short):.2f} x what it needs"
    else:
        line += f"; ran in every room tried: the prediction covers the step ({covered}), and"
        line += f" is more than 1/{min(ran)} = {1 / min(ran):.2f} x what it needs" if ran else ""
    return line


#: At most how many times what the step needs a prediction may be (issue #40).
TIGHT = 1.07


def _rooms(check: dict) -> tuple[list[float], list[float]]:
    """The fractions of the predicted peak the step ran in, and ran out of memory in."""
    ran = [t["fraction"] for t in check["tries"] if t["result"] == "ran"]
    short = [t["fraction"] for t in check["tries"] if t["result"] == "out of memory"]
    return ran, short


def cell(check: dict) -> str:
    """A table cell: whether the predicted peak covers the step (it ran with the room
    predicted) and is within :data:`TIGHT` of it (it ran out of memory with ``1 /
    TIGHT`` of that room or more).

    >>> cell({"tries": [{"fraction": 1.0, "result": "ran"},
    ...     {"fraction": 0.95, "result": "out of memory"}]})
    'runs at 1.0, out of memory at 0.95 (met)'
    >>> cell({"tries": [{"fraction": 1.0, "result": "ran"},
    ...     {"fraction": 0.9, "result": "ran"}]})
    'runs at 0.9, never out of memory (NOT met: loose)'
    """
    if "tries" not in check:
        return f"not checked ({check.get('status')})"
    ran, short = _rooms(check)
    tight = bool(short) and max(short) >= 1 / TIGHT - 1e-9
    text = f"runs at {min(ran)}" if ran else "never runs"
    text += f", out of memory at {max(short)}" if short else ", never out of memory"
    why = [] if 1.0 in ran else ["under-predicted"]
    why += [] if tight else ["loose"]
    return text + (" (met)" if not why else f" (NOT met: {', '.join(why)})")


def whole_peak(*checks: dict) -> tuple[int | None, int | None]:
    """The bounds the tries of ``checks``, each a check of the same step, put on its
    whole peak (its arrays and its programs' temporaries, with what the device held
    before): above the largest room it ran out of memory in, at most the smallest it ran
    in (a room is the check's ``limit`` less the try's ballast); ``None`` where no try
    says. Checks of one step on other days, with other predictions, bound it together.

    >>> once = {"limit": 100, "tries": [{"ballast": 20, "result": "ran"},
    ...     {"ballast": 25, "result": "ran"}, {"ballast": 30, "result": "out of memory"}]}
    >>> whole_peak(once)
    (70, 75)
    >>> whole_peak(once, {"limit": 90, "tries": [{"ballast": 18, "result": "out of memory"}]})
    (72, 75)

    Tries that contradict each other (it ran in less room than it ran out of memory in)
    are not of one step, and are refused."""
    rooms = {"ran": [], "out of memory": []}
    for check in checks:
        for t in check.get("tries", ()):
            rooms.get(t["result"], []).append(check["limit"] - t["ballast"])
    above, at_most = rooms["out of memory"], rooms["ran"]
    low, high = (max(above) if above else None), (min(at_most) if at_most else None)
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"the checks' tries contradict each other (out of memory in {_mib(low)} MiB of "
            f"room, ran in {_mib(high)}): they are not of one step"
        )
    return low, high


def rejudged(predicted: int, *checks: dict) -> str:
    """A table cell for ``predicted``, another prediction than the ones ``checks`` tried
    (the prediction changed and the step did not), judged by the whole peak their tries
    bound (:func:`whole_peak`): the prediction covers the step where the step ran in
    ``predicted`` plus :data:`MARGIN` or less, and under-predicts it where it ran out of
    memory in that much or more; it is within :data:`TIGHT` where the step needs more
    than ``predicted / TIGHT``, loose where it needs at most that. Else the check does
    not settle it.

    >>> MiB = 2**20
    >>> check = {"limit": 4000 * MiB, "tries": [{"ballast": 1100 * MiB, "result": "ran"},
    ...     {"ballast": 1150 * MiB, "result": "out of memory"}]}
    >>> rejudged(2860 * MiB, check)
    'needs 2,850–2,900 MiB, predicted 2,860 (met)'
    >>> rejudged(2800 * MiB, check)  # 2,864 MiB of room: the step may need more
    'needs 2,850–2,900 MiB, predicted 2,800 (NOT met: not settled, check again)'
    >>> rejudged(2700 * MiB, check)
    'needs 2,850–2,900 MiB, predicted 2,700 (NOT met: under-predicted)'
    >>> rejudged(3200 * MiB, check)
    'needs 2,850–2,900 MiB, predicted 3,200 (NOT met: loose)'
    """
    low, high = whole_peak(*checks)
    room = predicted + MARGIN
    covers = "met" if high is not None and high <= room else "under-predicted"
    covers = "unsettled" if covers != "met" and (low is None or low < room) else covers
    tight = "met" if low is not None and predicted <= TIGHT * low * (1 + 1e-9) else "loose"
    tight = "unsettled" if tight != "met" and (high is None or predicted <= TIGHT * high) else tight
    why = [v for v in (covers, tight) if v not in ("met", "unsettled")]
    why += ["not settled, check again"] if "unsettled" in (covers, tight) else []
    text = f"needs {_mib(low, high)} MiB, predicted {_mib(predicted)}"
    return text + (" (met)" if not why else f" (NOT met: {', '.join(why)})")


def _mib(low: float | None, high: float | None = None) -> str:
    if low is None and high is None:
        return "—"
    if high is None or low == high:
        return f"{low / 2**20:,.0f}"
    if low is None:
        return f"≤ {high / 2**20:,.0f}"
    return f"{low / 2**20:,.0f}–{high / 2**20:,.0f}"


def breakdown(rows: list[tuple[str, dict, dict, tuple[dict, ...]]]) -> str:
    """Per ``(label, pipeline row, prediction, checks)``, in MiB: the predicted peak
    (``prediction["predicted_peak"]``: the check's own, or the current one where the
    prediction changed since), the buffers it holds (the prediction less the programs'
    temporaries), the device's ``peak_bytes_in_use`` (buffers alone on a TPU, but the
    process's: the first call's too), and the whole peak the ballast ``checks`` of the
    step bound together (:func:`whole_peak`). What the prediction adds to its buffers
    for the temporaries is set beside what the step took beyond them."""
    lines = [
        "| row | predicted peak | predicted buffers | peak_bytes_in_use | whole peak "
        "(ballast) | predicted − buffers | whole − predicted buffers |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r, prediction, checks in rows:
        predicted, buffers = prediction["predicted_peak"], prediction["predicted_buffers"]
        low, high = whole_peak(*checks)
        beyond = (None if low is None else low - buffers, None if high is None else high - buffers)
        lines.append(
            f"| {label} | {_mib(predicted)} | {_mib(buffers)} | {_mib(r.get('peak'))} | "
            f"{_mib(low, high)} | {_mib(predicted - buffers)} | {_mib(*beyond)} |"
        )
    return "\n".join(lines)
