"""One decoder layer's measured compute on the TPU v5e, for the layout planner's
:class:`~pipemark.runtime.planning.workload.Transformer`: :class:`LayerCosts` reads the
records of ``benchmarks/layer_costs.py`` (``benchmarks/results/layer-costs-tpu-v5e.json``,
shipped in the package as ``layer-costs-tpu-v5e.json``) and gives the FLOP/s a layer
reaches at a per-chip shape (:class:`LayerShape`) as :class:`LayerRates`.

The rules (written down, not fitted):

* a record's rates: forward FLOP/s = its forward FLOPs (MaxText's count) over its
  forward seconds; backward FLOP/s = twice the forward FLOPs over its forward+backward
  seconds less its forward seconds (policy ``none``); a remat policy's recomputation =
  its forward+backward seconds less those of ``none``, as a fraction of the forward
  (at least 0);
* a shape's *family* is the measured shape nearest to it: the least Euclidean distance
  in log₂ of (d_model, attention width, MLP width), all per chip, plus 1 for another
  MLP kind (gated or not); within the family the rates are linear in log₂ of the
  tokens a chip computes at once, and outside its measured tokens the nearest
  measured value (no extrapolation);
* another chip (:meth:`LayerRates.on_chip`): each measured second is split into the
  chip's peak time for its FLOPs and the rest, taken as HBM traffic; the first scales
  with peak bf16 FLOP/s, the second with HBM bandwidth.

>>> costs = LayerCosts.load()
>>> rates = costs.rates(LayerShape(d_model=4096, attention=8192, kv=8192, mlp=28672,
...                                gated=True, tokens=6 * 2048))
>>> rates.family, round(rates.forward / 1e12), round(rates.recompute["full"], 2)
('16B', 162, 0.54)
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipemark.errors import PipemarkError

__all__ = ["MEASURED_CHIP", "REMAT_POLICIES", "LayerCosts", "LayerRates", "LayerShape"]

#: MaxText's remat policies the planner knows (``get_remat_policy`` in its decoders.py).
REMAT_POLICIES = ("none", "full", "save_dot_except_mlpwi", "minimal")
#: The chip the packaged records were measured on and its specifications (Google's
#: TPU v5e page, https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 819 GB/s).
MEASURED_CHIP = {"name": "TPU v5e", "peak_flops": 197e12, "hbm_bandwidth": 819e9}
PACKAGED = Path(__file__).with_name("layer-costs-tpu-v5e.json")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One layer's per-chip shape: ``d_model``, ``attention`` (query heads × head_dim
    on this chip), ``kv`` (key/value heads × head_dim on this chip), ``mlp`` (MLP
    width on this chip), ``gated`` (SwiGLU: three matrices) and ``tokens`` (rows ×
    sequence computed at once)."""

    d_model: int
    attention: int
    kv: int
    mlp: int
    gated: bool
    tokens: int

    def distance(self, other: LayerShape) -> float:
        """The family distance of the module's text (tokens left out)."""
        logs = [
            math.log2(a / b)
            for a, b in zip(
                (self.d_model, self.attention, self.mlp),
                (other.d_model, other.attention, other.mlp),
            )
        ]
        return math.sqrt(sum(x * x for x in logs)) + (self.gated != other.gated)


@dataclasses.dataclass(frozen=True)
class LayerRates:
    """What one layer reaches: ``forward`` and ``backward`` FLOP/s, ``recompute`` (a
    policy's recomputation as a fraction of the forward's seconds), the measured
    ``family`` they come from and ``note`` (where they come from, for predictions)."""

    forward: float
    backward: float
    recompute: Mapping[str, float]
    family: str
    note: str

    def on_chip(self, peak_flops: float, hbm_bandwidth: float) -> LayerRates:
        """These rates on a chip of ``peak_flops`` and ``hbm_bandwidth`` (the module's
        rule); the same rates on the measured chip's specifications.

        >>> r = LayerRates(98.5e12, 98.5e12, {}, "x", "")
        >>> round(r.on_chip(2 * 197e12, 819e9).forward / 1e12, 1)  # twice the peak
        131.3
        """
        peak, bandwidth = MEASURED_CHIP["peak_flops"], MEASURED_CHIP["hbm_bandwidth"]
        if (peak_flops, hbm_bandwidth) == (peak, bandwidth):
            return self

        def scaled(rate: float) -> float:
            rest = max(0.0, 1 / rate - 1 / peak) * bandwidth / hbm_bandwidth
            return 1 / (1 / peak_flops + rest)

        note = (
            f"{self.note}, scaled to a chip of {peak_flops / 1e12:.0f} TFLOP/s and "
            f"{hbm_bandwidth / 1e9:.0f} GB/s from the {MEASURED_CHIP['name']}'s "
            f"{peak / 1e12:.0f} TFLOP/s and {bandwidth / 1e9:.0f} GB/s"
        )
        return dataclasses.replace(
            self, forward=scaled(self.forward), backward=scaled(self.backward), note=note
        )


def _record_rates(none: dict, policies: list[dict]) -> tuple[float, float, dict[str, float]]:
    """A measured shape's forward and backward FLOP/s and recomputation fractions."""
    flops, fwd = none["forward_flops"], none["fwd_s"]
    recompute = {p["policy"]: max(0.0, p["fwdbwd_s"] - none["fwdbwd_s"]) / fwd for p in policies}
    return flops / fwd, 2 * flops / (none["fwdbwd_s"] - fwd), recompute


def _between(points: list[tuple[float, Any]], x: float) -> tuple[Any, Any, float]:
    """The two points around ``x`` (sorted by their first item) and the weight of the
    second: linear in ``x``, the nearest end outside."""
    if x <= points[0][0]:
        return points[0][1], points[0][1], 0.0
    for (x0, a), (x1, b) in itertools.pairwise(points):
        if x <= x1:
            return a, b, (x - x0) / (x1 - x0)
    return points[-1][1], points[-1][1], 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class LayerCosts:
    """Measured layer records (``benchmarks/layer_costs.py``'s JSON), by family (one
    per-chip shape at several rows a chip): ``families`` maps a family's name (its
    records' names before their rows, joined by ``/``) to its shape (tokens 0) and its
    ``(tokens, (forward, backward, recompute))`` points, by tokens."""

    families: Mapping[str, tuple[LayerShape, list]]
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None) -> LayerCosts:
        """The records in ``path`` (default: the packaged TPU v5e records)."""
        path = Path(path) if path is not None else PACKAGED
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise PipemarkError(
                f"LayerCosts.load: cannot read {path} ({err}); give the JSON that "
                "benchmarks/layer_costs.py --out writes."
            ) from None
        groups: dict[tuple[LayerShape, int], list[dict]] = {}
        names: dict[LayerShape, set[str]] = {}
        for r in data.get("records", []):
            if "error" in r or not r.get("fwd_s"):
                continue
            shape = LayerShape(
                r["d_model"], r["n_heads"] * r["head_dim"], r["n_kv_heads"] * r["head_dim"],
                r["mlp"], r["mlp_kind"] == "swiglu", 0,
            )  # fmt: skip
            groups.setdefault((shape, r["rows"] * r["seq"]), []).append(r)
            names.setdefault(shape, set()).add(r["name"].rsplit(" r", 1)[0])
        families: dict[str, tuple[LayerShape, list]] = {}
        for (shape, tokens), records in sorted(groups.items(), key=lambda g: g[0][1]):
            none = next((r for r in records if r["policy"] == "none"), None)
            if none is not None:
                family = "/".join(sorted(names[shape]))
                families.setdefault(family, (shape, []))[1].append(
                    (tokens, _record_rates(none, records))
                )
        if not families:
            raise PipemarkError(f"LayerCosts.load: {path} holds no measured records with 'none'.")
        when = data.get("date", "?")[:10]
        return cls(families, f"{data.get('device_kind', '?')} layer records of {when}")

    def rates(self, shape: LayerShape) -> LayerRates:
        """The rates at ``shape`` by the module's rules."""
        family = min(self.families, key=lambda f: (shape.distance(self.families[f][0]), f))
        points = [(math.log2(t), v) for t, v in self.families[family][1]]
        a, b, w = _between(points, math.log2(max(shape.tokens, 1)))
        forward, backward = ((1 - w) * a[i] + w * b[i] for i in (0, 1))
        recompute = {p: (1 - w) * a[2].get(p, 1.0) + w * b[2].get(p, 1.0) for p in REMAT_POLICIES}
        note = f"measured: {self.source}, nearest family {family!r}"
        return LayerRates(forward, backward, recompute, family, note)
