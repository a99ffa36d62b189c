"""What a model costs on a layout, for the layout planner
(:mod:`pipemark.runtime.planning.planner`): a :class:`Layout` (pipeline stages × data
parallelism × FSDP × tensor parallelism, schedule, microbatches) and two model descriptions that turn one into
:class:`StageWork` (each pipeline stage's forward, backward and weight seconds per
microbatch, and its bytes): :class:`Transformer`, from a Llama-style description
(analytic FLOPs), and :class:`MeasuredPipeline`, from the measured action costs of a
real pipeline (``pipe.action_costs``).

The analytic model (per token; ``P`` a layer's parameters, ``h`` the hidden size,
``s`` the sequence length, ``V`` the vocabulary):

* forward ``2 P + 4 s h`` FLOPs per layer (the matrix products, and attention's
  ``Q Kᵀ`` and ``A V``), backward ``2 P + 8 s h`` (B: the input cotangents, attention's
  backward all there) and weight ``2 P`` (W: the parameter gradients): the usual
  ``6 N + 12 L h s`` per token in all (PaLM, appendix B); the output head adds
  ``2 h V`` to each of the last stage's F, B and W; the embedding lookup costs nothing;
* time = FLOPs / (tensor-parallel chips × peak FLOP/s × ``efficiency``);
* tensor parallelism (Megatron, with sequence parallelism) moves the layer's
  activations (``tokens × h`` bfloat16) through two all-reduces in each of F and B,
  exposed (not overlapped with compute);
* activations held from a layer's forward to its backward, bfloat16, per token and
  layer: the two norms' inputs and outputs (``4 h``), ``q``, ``k``, ``v`` and the
  attention output (``2 h + 2 h_kv``, flash attention: no ``s × s`` scores) and the
  gated MLP's three intermediates (``3 f``), all divided by ``tp`` (sequence
  parallelism); with ``remat``, only each layer's input (``h``), and B repeats F;
* the last stage also holds one microbatch's logits and their gradient (float32,
  ``2 × tokens × V / tp``) while it runs.

>>> model = Transformer.llama2_7b()
>>> round(model.parameters / 1e9, 2)
6.74
>>> work = model.stage_work(Layout(pp=2, dp=4, microbatches=8), global_batch=64,
...                         peak_flops=197e12)
>>> len(work.forward), work.tokens_per_microbatch
(2, 8192)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.roles import BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.schedules.registry import schedule_entry

__all__ = ["GATHERS", "REDUCTIONS", "Layout", "MeasuredPipeline", "StageWork", "Transformer"]

_BF16 = 2
#: When FSDP gathers a stage's weights: once a ``"step"``, or for each ``"microbatch"``.
GATHERS = ("step", "microbatch")
#: When gradients are reduced: once a ``"step"`` (delayed), reduce-scattered every
#: microbatch and all-reduced over DP once a step (``"scatter"``), or every
#: ``"microbatch"``.
REDUCTIONS = ("step", "scatter", "microbatch")


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipemarkError(f"{owner}: {name} = {value!r}; give an int >= 1.")
    return value


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a training step is laid out on ``pp × dp × fsdp × tp`` chips.

    ``pp`` pipeline ranks, each running ``stages_per_device`` stages (``None``: 1, or 2
    for a schedule that puts several stages on each device: interleaved, ZB-V,
    DualPipeV); ``dp`` data-parallel replicas (parameters replicated, gradients
    all-reduced); ``fsdp`` replicas that also shard the parameters, gradients and
    optimizer state (gathered once per step, reduce-scattered once per step); ``tp``
    tensor-parallel chips per layer; ``microbatches`` per step; ``remat``: each layer
    recomputes its forward in its backward instead of keeping its activations.

    ``gather`` (:data:`GATHERS`): FSDP all-gathers a stage's weights once a
    ``"step"`` and keeps them, or again for every ``"microbatch"``'s forward and
    backward (ZeRO-3: two layers' weights whole at a time). ``reduce``
    (:data:`REDUCTIONS`): gradients accumulate over the microbatches and are
    reduce-scattered over FSDP and all-reduced over DP once a ``"step"`` (delayed
    reduction); or reduce-scattered after every microbatch and all-reduced over DP
    once a step (``"scatter"``: accumulators sharded, the DP reduction delayed); or
    both after every ``"microbatch"``.

    >>> layout = Layout(pp=4, dp=2, fsdp=8, tp=4, schedule="interleaved", microbatches=16)
    >>> layout.chips, layout.num_stages, str(layout)
    (256, 8, 'PP 4 × DP 2 × FSDP 8 × TP 4, interleaved (2 stages a device), M 16')
    """

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_device: int | None = None
    remat: bool = False
    gather: str = "step"
    reduce: str = "step"

    def __post_init__(self) -> None:
        if self.gather not in GATHERS:
            raise PipemarkError(f"Layout: gather = {self.gather!r}; choose one of {GATHERS}.")
        if self.reduce not in REDUCTIONS:
            raise PipemarkError(f"Layout: reduce = {self.reduce!r}; choose one of {REDUCTIONS}.")
        for name in ("pp", "dp", "fsdp", "tp", "microbatches"):
            _positive_int("Layout", name, getattr(self, name))
        entry = schedule_entry(self.schedule)
        if self.stages_per_device is None:
            object.__setattr__(self, "stages_per_device", 1 if entry.one_stage_per_device else 2)
        _positive_int("Layout", "stages_per_device", self.stages_per_device)
        if entry.one_stage_per_device and self.stages_per_device != 1:
            raise PipemarkError(
                f"Layout: schedule {self.schedule!r} runs one stage a device, not "
                f"{self.stages_per_device}; use 'interleaved' for several."
            )
        if not isinstance(self.remat, bool):
            raise PipemarkError(f"Layout: remat = {self.remat!r}; give True or False.")

    @property
    def chips(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def num_stages(self) -> int:
        """Pipeline stages: ``pp × stages_per_device``."""
        return self.pp * self.stages_per_device

    @property
    def sizes(self) -> dict[str, int]:
        """The mesh axes' sizes (:data:`pipemark.runtime.planning.cluster.MESH_ORDER`)."""
        return {"tp": self.tp, "fsdp": self.fsdp, "pp": self.pp, "dp": self.dp}

    @property
    def splits_backward(self) -> bool:
        return schedule_entry(self.schedule).splits_backward

    def __str__(self) -> str:
        per = "" if self.stages_per_device == 1 else f" ({self.stages_per_device} stages a device)"
        remat = ", remat" if self.remat else ""
        modes = ""
        if self.gather != "step":
            modes += f", gather every {self.gather}"
        if self.reduce != "step":
            modes += (
                ", reduce-scatter every microbatch"
                if self.reduce == "scatter"
                else (", reduce every microbatch")
            )
        return (
            f"PP {self.pp} × DP {self.dp} × FSDP {self.fsdp} × TP {self.tp}, "
            f"{self.schedule}{per}, M {self.microbatches}{remat}{modes}"
        )


@dataclasses.dataclass(frozen=True)
class StageWork:
    """A model on a layout, per pipeline stage (one microbatch on one chip of the
    stage's ``dp × fsdp × tp`` group): seconds of ``forward``, ``backward`` and
    ``weight`` (compute with the exposed tensor-parallel collectives; ``weight`` 0 where
    the model does not split the backward), ``tp_seconds`` (the collectives' part of F
    + B + W), ``parameters`` (whole stage, before tensor parallelism or FSDP shards
    it), ``layers``, ``activation_bytes`` (held on one chip from a microbatch's forward
    to its last backward action), ``boundary_bytes`` (sent on one chip to the next
    stage, and the cotangent back), ``temporary_bytes`` (the most a stage's program
    needs while it runs), ``tokens_per_microbatch`` (one replica's) and ``flops`` (the
    model's, a whole step on all chips, for the model FLOP utilisation)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    tp_seconds: tuple[float, ...]
    parameters: tuple[float, ...]
    layers: tuple[int, ...]
    activation_bytes: tuple[float, ...]
    boundary_bytes: tuple[float, ...]
    temporary_bytes: tuple[float, ...]
    tokens_per_microbatch: float
    flops: float

    @property
    def costs(self) -> dict[str, tuple[float, ...]]:
        """As :func:`pipemark.simulate_schedule` takes them."""
        return {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}


def _replica_rows(layout: Layout, global_batch: int, owner: str) -> int:
    """Rows (sequences) of one microbatch of one data-parallel replica."""
    _positive_int(owner, "global_batch", global_batch)
    shares = layout.dp * layout.fsdp * layout.microbatches
    if global_batch % shares:
        raise PipemarkError(
            f"{owner}: a global batch of {global_batch} does not split into DP {layout.dp} × "
            f"FSDP {layout.fsdp} × {layout.microbatches} microbatches; choose a layout whose "
            "product divides it."
        )
    return global_batch // shares


def _split_layers(layers: int, stages: int, owner: str) -> list[int]:
    """``layers`` over ``stages`` as evenly as can be, the extra ones on the first."""
    if stages > layers:
        raise PipemarkError(
            f"{owner}: {stages} pipeline stages for {layers} layers; use at most one stage a layer."
        )
    base, extra = divmod(layers, stages)
    return [base + (j < extra) for j in range(stages)]


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer (Llama: gated MLP, grouped-query attention), by its
    sizes; ``efficiency`` is the fraction of peak FLOP/s its matrix products reach
    (0.5: ``benchmarks/results`` records 0.49 for a 270 M-parameter GPT's microbatched
    step on one v5e chip, and larger matrices do no worse). See the module's text for
    the cost rules.

    >>> Transformer.llama2_70b().parameters > 68e9
    True
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    efficiency: float = 0.5

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq"):
            _positive_int(f"Transformer {self.name!r}", name, getattr(self, name))
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise PipemarkError(
                f"Transformer {self.name!r}: efficiency = {self.efficiency!r}; give a number in (0, 1]."
            )

    @classmethod
    def llama2_7b(cls, seq: int = 4096) -> Transformer:
        """Llama 2 7B (Touvron et al. 2023): 32 layers, hidden 4096, MLP 11008, 32 heads."""
        return cls("Llama 2 7B", 32, 4096, 11008, 32, 32, 32000, seq)

    @classmethod
    def llama2_70b(cls, seq: int = 4096) -> Transformer:
        """Llama 2 70B: 80 layers, hidden 8192, MLP 28672, 64 heads, 8 key-value heads."""
        return cls("Llama 2 70B", 80, 8192, 28672, 64, 8, 32000, seq)

    @property
    def kv_hidden(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    @property
    def layer_parameters(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_hidden + 3 * h * self.ffn + 2 * h

    @property
    def parameters(self) -> int:
        """All of them: the layers, the embedding and the (untied) output head."""
        return self.layers * self.layer_parameters + 2 * self.vocab * self.hidden

    def stage_work(
        self, layout: Layout, *, global_batch: int, peak_flops: float, tp_seconds: Any = None
    ) -> StageWork:
        """This model on ``layout`` with ``global_batch`` sequences a step, on chips of
        ``peak_flops``; ``tp_seconds(nbytes)``: one tensor-parallel all-reduce of
        ``nbytes`` (0 without)."""
        owner = f"Transformer {self.name!r}"
        rows = _replica_rows(layout, global_batch, owner)
        tokens = rows * self.seq
        layers = _split_layers(self.layers, layout.num_stages, owner)
        h, p, tp = self.hidden, self.layer_parameters, layout.tp
        speed = tp * peak_flops * self.efficiency
        attention = 4 * self.seq * h
        per_layer = {FORWARD: 2 * p + attention, BACKWARD: 2 * p + 2 * attention, WEIGHT: 2 * p}
        if layout.remat:
            per_layer[BACKWARD] += per_layer[FORWARD]
        allreduce = tp_seconds(tokens * h * _BF16) if (tp_seconds and tp > 1) else 0.0
        head = 2 * h * self.vocab
        kept = h if layout.remat else 4 * h + 2 * h + 2 * self.kv_hidden + 3 * self.ffn
        last = len(layers) - 1
        table: dict[str, list[float]] = {FORWARD: [], BACKWARD: [], WEIGHT: []}
        for j, count in enumerate(layers):
            for kind, flops in per_layer.items():
                flops = count * flops + (head if j == last else 0)
                comm = 2 * count * allreduce if kind != WEIGHT else 0.0
                table[kind].append(tokens * flops / speed + comm)
        boundary = tokens * h * _BF16 / tp
        return StageWork(
            forward=tuple(table[FORWARD]),
            backward=tuple(table[BACKWARD]),
            weight=tuple(table[WEIGHT]),
            tp_seconds=tuple(4 * c * allreduce for c in layers),
            parameters=tuple(
                c * p + self.vocab * h * ((j == 0) + (j == last)) for j, c in enumerate(layers)
            ),
            layers=tuple(layers),
            activation_bytes=tuple(tokens * c * kept * _BF16 / tp for c in layers),
            boundary_bytes=tuple(boundary if j < last else 0.0 for j in range(len(layers))),
            temporary_bytes=tuple(
                2 * tokens * self.vocab * 4 / tp if j == last else 0.0 for j in range(len(layers))
            ),
            tokens_per_microbatch=tokens,
            flops=(6 * self.parameters + 12 * self.layers * h * self.seq) * global_batch * self.seq,
        )


def _per_stage(values: Any, count: int, what: str) -> tuple[float, ...]:
    values = tuple(values) if isinstance(values, Sequence) else (values,) * count
    if len(values) != count or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)
        for v in values
    ):
        raise PipemarkError(
            f"MeasuredPipeline: {what} = {values!r}; give {count} non-negative numbers, one a stage."
        )
    return tuple(float(v) for v in values)


@dataclasses.dataclass(frozen=True)
class MeasuredPipeline:
    """A real pipeline's measured action costs (``pipe.action_costs(params, batch)``:
    seconds per stage of ``forward``, ``backward`` and ``weight``) on the ``layout`` it
    was measured on, with ``global_batch`` rows a step, and its bytes per stage:
    ``parameters`` (count), ``activation_bytes`` and ``boundary_bytes`` (one
    microbatch of one replica, as the plan counts them:
    ``pipe.plan(...).problem.activation_bytes``) and ``layers`` (the pieces a stage's
    gradients become final in during its backward: what a reduction overlaps with).

    Scaling rules to another layout (written down, not measured):

    * its stages are grouped (a layout with fewer stages: consecutive stages summed) or
      split evenly (more stages than measured, a multiple of them);
    * an action's time and bytes scale with the rows one chip handles per microbatch
      (``global_batch / (dp × fsdp × microbatches × tp)``): linear, no fixed cost;
    * measured without a split backward (``weight`` all 0), a schedule that splits it
      gets B = W = half the measured backward.

    >>> measured = MeasuredPipeline({"forward": 1.0, "backward": 2.0, "weight": 0.0},
    ...                             Layout(pp=2, microbatches=4), global_batch=8)
    >>> measured.stage_work(Layout(pp=1, microbatches=8), global_batch=8).forward
    (1.0,)
    """

    costs: Mapping[str, Any]
    layout: Layout
    global_batch: int
    parameters: Any = 0
    activation_bytes: Any = 0
    boundary_bytes: Any = 0
    layers: Any = 1

    def __post_init__(self) -> None:
        count = self.layout.num_stages
        table = {}
        for kind in (FORWARD, BACKWARD, WEIGHT):
            table[kind] = _per_stage(self.costs.get(kind, 0.0), count, f"costs[{kind!r}]")
        object.__setattr__(self, "costs", table)
        for name in ("parameters", "activation_bytes", "boundary_bytes", "layers"):
            object.__setattr__(self, name, _per_stage(getattr(self, name), count, name))
        _replica_rows(self.layout, self.global_batch, "MeasuredPipeline")

    def _regroup(self, values: tuple[float, ...], stages: int, extensive: bool) -> list[float]:
        """Per-stage ``values`` for ``stages`` stages: summed over grouped stages or
        divided over split ones (``extensive``), else the group's largest or kept."""
        measured = len(values)
        if measured % stages == 0:
            size = measured // stages
            groups = [values[j * size : (j + 1) * size] for j in range(stages)]
            return [sum(g) if extensive else max(g) for g in groups]
        if stages % measured == 0:
            parts = stages // measured
            return [values[j // parts] / (parts if extensive else 1) for j in range(stages)]
        raise PipemarkError(
            f"MeasuredPipeline: measured with {measured} stages, asked for {stages}; use a "
            "stage count that divides it or that it divides."
        )

    def stage_work(
        self, layout: Layout, *, global_batch: int, peak_flops: float = 0.0, tp_seconds: Any = None
    ) -> StageWork:
        """The measured costs scaled to ``layout`` (see the class's rules)."""
        del peak_flops, tp_seconds  # measured: in the costs already
        old = self.layout
        rows = _replica_rows(layout, global_batch, "MeasuredPipeline") / layout.tp
        scale = rows / (_replica_rows(old, self.global_batch, "MeasuredPipeline") / old.tp)
        stages = layout.num_stages
        measured = self.costs
        if layout.splits_backward and not any(measured[WEIGHT]):
            half = tuple(b / 2 for b in measured[BACKWARD])
            measured = {FORWARD: measured[FORWARD], BACKWARD: half, WEIGHT: half}
        timed = {k: [v * scale for v in self._regroup(measured[k], stages, True)] for k in measured}
        boundary = [b * scale for b in self._regroup(self.boundary_bytes, stages, False)]
        boundary[-1] = 0.0
        return StageWork(
            forward=tuple(timed[FORWARD]),
            backward=tuple(timed[BACKWARD]),
            weight=tuple(timed[WEIGHT]),
            tp_seconds=(0.0,) * stages,
            parameters=tuple(self._regroup(self.parameters, stages, True)),
            layers=tuple(max(1, round(n)) for n in self._regroup(self.layers, stages, True)),
            activation_bytes=tuple(
                a * scale for a in self._regroup(self.activation_bytes, stages, True)
            ),
            boundary_bytes=tuple(boundary),
            temporary_bytes=(0.0,) * stages,
            tokens_per_microbatch=rows * layout.tp,
            flops=0.0,
        )
