"""What a model costs on a layout, for the layout planner
(:mod:`pipemark.runtime.planning.planner`): a :class:`Layout` (pipeline stages × data
parallelism × FSDP × tensor parallelism, schedule, microbatches, remat policy) and two
model descriptions that turn one into :class:`StageWork` (each pipeline stage's
forward, backward and weight seconds per microbatch, and its bytes):
:class:`Transformer`, from its sizes, and :class:`MeasuredPipeline`, from the measured
action costs of a real pipeline (``pipe.action_costs``).

The transformer's costs (per token; ``P`` a layer's matrix parameters, ``h`` the hidden
size, ``A`` the attention width ``heads × head_dim``, ``K`` the key/value width, ``f``
the MLP width, ``s`` the sequence length, ``V`` the vocabulary):

* FLOPs are MaxText's (``calculate_tflops_training_per_device`` in its
  maxtext_utils.py): forward ``2 P + 2 s A`` per layer (the matrix products, and
  causal attention's ``Q Kᵀ`` and ``A V``: ``4 s A`` halved for the mask), backward
  ``2 P + 4 s A`` (B: the input cotangents, attention's backward all there) and weight
  ``2 P`` (W: the parameter gradients); the output head adds ``2 h V`` to each of the
  last stage's F, B and W (tied or not); the embedding lookup costs nothing;
* time, with ``efficiency``: FLOPs / (tensor-parallel chips × peak FLOP/s ×
  ``efficiency``), a remat policy's recomputation counted in FLOPs
  (:meth:`Transformer.recompute_flops`); without (the default): at the FLOP/s one
  layer was measured to reach at its per-chip shape on a TPU v5e
  (:mod:`pipemark.runtime.planning.measured`), F at the forward's, B and W at the
  backward's, a policy's recomputation the measured fraction of the forward, and for
  another chip scaled by its peak FLOP/s and HBM bandwidth (``StageWork.compute`` and
  ``LayoutPrediction.compute`` say which);
* tensor parallelism (Megatron, with sequence parallelism) divides the heads and the
  MLP width, and moves the layer's activations (``tokens × h`` bfloat16) through two
  all-reduces in each of F and B, exposed (not overlapped with compute);
* activations held from a layer's forward to its backward, bfloat16, per token and
  layer, all divided by ``tp`` (sequence parallelism; flash attention: no ``s × s``
  scores), by remat policy (MaxText's, as ``benchmarks/layer_costs.py`` measured their
  residuals): ``none``, the norms' inputs and outputs (``4 h``; ``2 h`` for a parallel
  block), ``q``, ``k``, ``v`` and the attention output (``2 A + 2 K``) and the MLP's
  intermediates (``3 f`` gated, ``2 f`` not); ``full``, the layer's input (``h``);
  ``save_dot_except_mlpwi``, the input, ``q``, ``k``, ``v`` and the output projection
  (``2 h + A + 2 K``); ``minimal``, those and the MLP's input projections (``+ 2 f``
  gated, ``+ f`` not);
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
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipemark.errors import PipemarkError
from pipemark.roles import BACKWARD, FORWARD, WEIGHT
from pipemark.runtime.planning.measured import MEASURED_CHIP, REMAT_POLICIES, LayerCosts, LayerShape
from pipemark.runtime.schedules.registry import schedule_entry

__all__ = [
    "GATHERS",
    "MLP_KINDS",
    "REDUCTIONS",
    "Layout",
    "MeasuredPipeline",
    "StageWork",
    "Transformer",
    "maxtext_scales",
    "packaged_costs",
]

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
    recomputes its forward in its backward instead of keeping its activations
    (``True``, MaxText's ``"full"``), or only part of it, keeping what a MaxText policy
    keeps (``"save_dot_except_mlpwi"``, ``"minimal"``; :data:`REMAT_POLICIES`).

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
    remat: bool | str = False
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
        if not isinstance(self.remat, bool) and self.remat not in REMAT_POLICIES:
            raise PipemarkError(
                f"Layout: remat = {self.remat!r}; give True (full), False (none) or one of "
                f"{REMAT_POLICIES}."
            )
        if self.remat in ("none", "full"):  # the booleans' spellings
            object.__setattr__(self, "remat", self.remat == "full")

    @property
    def remat_policy(self) -> str:
        """The remat policy by MaxText's name: ``remat=True`` is ``"full"``, ``False``
        ``"none"``.

        >>> Layout(remat=True).remat_policy, Layout(remat="minimal").remat_policy
        ('full', 'minimal')
        """
        if isinstance(self.remat, str):
            return self.remat
        return "full" if self.remat else "none"

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
        remat = {"none": "", "full": ", remat"}.get(self.remat_policy, f", remat {self.remat}")
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
    model's, a whole step on all chips, for the model FLOP utilisation); ``compute``
    says where the compute seconds come from (measured, scaled, or assumed)."""

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
    compute: str = ""

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


#: MLP kinds of :class:`Transformer`: gated (three matrices) or two matrices.
MLP_KINDS = ("swiglu", "gelu", "relu")


def maxtext_scales(scale: int) -> tuple[int, int, int, int]:
    """MaxText's ``get_individual_scales``: for a ``global_parameter_scale`` (a power
    of two), the powers of two its embedding, heads, MLP width and layers grow by.

    >>> maxtext_scales(16), maxtext_scales(128)
    ((1, 2, 2, 1), (2, 3, 3, 2))
    """
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1 or scale & (scale - 1):
        raise PipemarkError(f"Transformer.maxtext: scale = {scale!r}; give a power of two.")
    base, rem = divmod(scale.bit_length() - 1, 3)
    heads = base + (rem > 0)
    return base + (rem > 1), heads, heads, base


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer by its sizes: ``hidden`` (d_model), ``ffn`` (MLP
    width), ``heads`` query and ``kv_heads`` key/value heads of ``head_dim`` (``None``:
    ``hidden // heads``; attention width ``heads × head_dim`` need not be ``hidden``),
    ``mlp`` (:data:`MLP_KINDS`: ``"swiglu"``, three matrices; ``"gelu"`` or
    ``"relu"``, two), ``parallel`` (attention and MLP side by side on one norm, as
    GPT-J and PaLM), ``tied_embeddings`` (the output head is the embedding).

    Compute: ``efficiency`` (a fraction of peak FLOP/s for every matrix product) if
    given, else the measured layer records ``costs``
    (:class:`~pipemark.runtime.planning.measured.LayerCosts`, the packaged TPU v5e ones
    when ``None``), scaled to another chip by its specifications. See the module's
    text for the cost rules.

    >>> Transformer.llama2_70b().parameters > 68e9
    True
    >>> Transformer.maxtext(16).hidden, Transformer.maxtext(128).heads
    (4096, 128)
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    efficiency: float | None = None
    head_dim: int | None = None
    mlp: str = "swiglu"
    parallel: bool = False
    tied_embeddings: bool = False
    costs: LayerCosts | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        owner = f"Transformer {self.name!r}"
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq"):
            _positive_int(owner, name, getattr(self, name))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        _positive_int(owner, "head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise PipemarkError(
                f"{owner}: {self.heads} heads in groups of {self.kv_heads} key/value heads; "
                "give kv_heads that divides heads."
            )
        if self.mlp not in MLP_KINDS:
            raise PipemarkError(f"{owner}: mlp = {self.mlp!r}; choose one of {MLP_KINDS}.")
        e = self.efficiency
        if e is not None and not (isinstance(e, (int, float)) and 0 < e <= 1):
            raise PipemarkError(
                f"{owner}: efficiency = {e!r}; give a number in (0, 1], or None for the "
                "measured layer costs."
            )

    @classmethod
    def llama2_7b(cls, seq: int = 4096) -> Transformer:
        """Llama 2 7B (Touvron et al. 2023): 32 layers, hidden 4096, MLP 11008, 32 heads."""
        return cls("Llama 2 7B", 32, 4096, 11008, 32, 32, 32000, seq)

    @classmethod
    def llama2_70b(cls, seq: int = 4096) -> Transformer:
        """Llama 2 70B: 80 layers, hidden 8192, MLP 28672, 64 heads, 8 key-value heads."""
        return cls("Llama 2 70B", 80, 8192, 28672, 64, 8, 32000, seq)

    @classmethod
    def maxtext(cls, scale: int, seq: int = 2048) -> Transformer:
        """MaxText's base model (its base.yml: d_model 2048, 16 heads of 128, MLP 7168,
        16 layers, SwiGLU, vocabulary 32000) at ``global_parameter_scale`` ``scale``,
        as its ``get_individual_scales`` grows it (its v5e configs: 16, 32, 64, 128)."""
        emb, heads, mlp, layers = maxtext_scales(scale)
        return cls(
            f"MaxText {scale}B", 16 << layers, 2048 << emb, 7168 << mlp, 16 << heads,
            16 << heads, 32000, seq, head_dim=128,
        )  # fmt: skip

    @property
    def attention_width(self) -> int:
        """Query heads × head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """Key/value heads × head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def matmul_parameters(self) -> int:
        """A layer's matrices' parameters (what its matrix products multiply by)."""
        h = self.hidden
        attention = h * (2 * self.attention_width + 2 * self.kv_hidden)
        return attention + self.mlp_matrices * h * self.ffn

    @property
    def layer_parameters(self) -> int:
        """A layer's parameters: its matrices and its norms' scales (one if parallel)."""
        return self.matmul_parameters + (1 if self.parallel else 2) * self.hidden

    @property
    def parameters(self) -> int:
        """All of them: the layers, the embedding and the output head (once if tied)."""
        tables = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_parameters + tables * self.vocab * self.hidden

    @property
    def attention_flops(self) -> int:
        """Forward FLOPs per token of one layer's causal ``Q Kᵀ`` and ``A V``:
        MaxText's ``4 s H D``, halved for the mask."""
        return 2 * self.seq * self.attention_width

    def training_flops(self, tokens: int) -> int:
        """The model's training FLOPs for ``tokens`` tokens, MaxText's count: 3 × the
        forward's matrix products (the layers' and the output head's) and attention.

        >>> Transformer.maxtext(16).training_flops(6 * 2048) / 1e12 > 1000
        True
        """
        layer = 2 * self.matmul_parameters + self.attention_flops
        return 3 * tokens * (self.layers * layer + 2 * self.hidden * self.vocab)

    def layer_shape(self, layout: Layout, tokens: int) -> LayerShape:
        """One layer's per-chip shape on ``layout`` (tensor parallelism divides the
        heads and the MLP width) for ``tokens`` tokens of one microbatch."""
        tp = layout.tp
        return LayerShape(
            self.hidden, self.attention_width // tp, max(1, self.kv_hidden // tp),
            self.ffn // tp, self.mlp == "swiglu", tokens,
        )  # fmt: skip

    def saved_per_token(self, policy: str) -> int:
        """Elements a layer keeps per token from its forward for its backward under
        ``policy`` (before tensor parallelism divides them): see the module's text."""
        h, a, kv, f = self.hidden, self.attention_width, self.kv_hidden, self.ffn
        projections = h + a + 2 * kv + h  # the input, q, k, v, the attention's output projection
        if policy == "full":
            return h
        if policy == "save_dot_except_mlpwi":
            return projections
        if policy == "minimal":
            return projections + (self.mlp_matrices - 1) * f
        norms = (2 if self.parallel else 4) * h  # the norms' inputs and outputs
        return norms + 2 * a + 2 * kv + self.mlp_matrices * f  # q, k, v, attention out, MLP

    def recompute_flops(self, policy: str) -> int:
        """Forward FLOPs per token a layer repeats in its backward under ``policy``:
        all for ``full``; all but the saved projections for
        ``save_dot_except_mlpwi``; attention's for ``minimal``; none for ``none``."""
        h = self.hidden
        everything = 2 * self.matmul_parameters + self.attention_flops
        saved = 2 * h * (2 * self.attention_width + 2 * self.kv_hidden)
        return {
            "none": 0,
            "full": everything,
            "save_dot_except_mlpwi": everything - saved,
            "minimal": self.attention_flops,
        }[policy]

    def rates(self, layout: Layout, tokens: int, peak_flops: float, hbm_bandwidth: float) -> Any:
        """The layer's :class:`~pipemark.runtime.planning.measured.LayerRates` on this
        layout and chip (``None`` with ``efficiency``)."""
        if self.efficiency is not None:
            return None
        costs = self.costs if self.costs is not None else packaged_costs()
        return costs.rates(self.layer_shape(layout, tokens)).on_chip(peak_flops, hbm_bandwidth)

    def stage_work(
        self,
        layout: Layout,
        *,
        global_batch: int,
        peak_flops: float,
        tp_seconds: Any = None,
        hbm_bandwidth: float = MEASURED_CHIP["hbm_bandwidth"],
    ) -> StageWork:
        """This model on ``layout`` with ``global_batch`` sequences a step, on chips of
        ``peak_flops`` and ``hbm_bandwidth``; ``tp_seconds(nbytes)``: one
        tensor-parallel all-reduce of ``nbytes`` (0 without)."""
        owner = f"Transformer {self.name!r}"
        tokens = _replica_rows(layout, global_batch, owner) * self.seq
        layers = _split_layers(self.layers, layout.num_stages, owner)
        rates = self.rates(layout, tokens, peak_flops, hbm_bandwidth)
        seconds = _layer_seconds(self, layout, tokens, peak_flops, rates)
        allreduce = (
            tp_seconds(tokens * self.hidden * _BF16) if (tp_seconds and layout.tp > 1) else 0.0
        )
        last = len(layers) - 1
        table: dict[str, list[float]] = {FORWARD: [], BACKWARD: [], WEIGHT: []}
        for j, count in enumerate(layers):
            for kind, (layer_s, head_s) in seconds.items():
                comm = 2 * count * allreduce if kind != WEIGHT else 0.0
                table[kind].append(count * layer_s + (head_s if j == last else 0.0) + comm)
        return StageWork(
            forward=tuple(table[FORWARD]),
            backward=tuple(table[BACKWARD]),
            weight=tuple(table[WEIGHT]),
            tp_seconds=tuple(4 * c * allreduce for c in layers),
            parameters=_stage_parameters(self, layers),
            layers=tuple(layers),
            activation_bytes=tuple(
                tokens * c * self.saved_per_token(layout.remat_policy) * _BF16 / layout.tp
                for c in layers
            ),
            boundary_bytes=tuple(
                tokens * self.hidden * _BF16 / layout.tp if j < last else 0.0
                for j in range(len(layers))
            ),
            temporary_bytes=tuple(
                2 * tokens * self.vocab * 4 / layout.tp if j == last else 0.0
                for j in range(len(layers))
            ),
            tokens_per_microbatch=tokens,
            flops=self.training_flops(global_batch * self.seq),
            compute=rates.note if rates is not None else f"efficiency {self.efficiency:g} of peak",
        )


@functools.cache
def packaged_costs() -> LayerCosts:
    """The packaged TPU v5e layer records, read once."""
    return LayerCosts.load()


def _layer_seconds(
    model: Transformer, layout: Layout, tokens: int, peak_flops: float, rates: Any
) -> dict[str, tuple[float, float]]:
    """Per kind (F, B, W): one layer's seconds and the output head's, on one chip.

    FLOPs per token: F ``2 P + a`` (``P`` the layer's matrix parameters, ``a``
    attention's), B ``2 P + 2 a`` with the policy's recomputation, W ``2 P``; the head
    ``2 h V`` in each. With ``efficiency`` all run at that fraction of peak; measured,
    F at the forward rate, B and W at the backward rate, the recomputation the measured
    fraction of the layer's forward seconds."""
    p, a, tp = model.matmul_parameters, model.attention_flops, layout.tp
    head = 2 * model.hidden * model.vocab
    flops = {FORWARD: 2 * p + a, BACKWARD: 2 * p + 2 * a, WEIGHT: 2 * p}
    policy = layout.remat_policy
    if rates is None:
        speed = tp * peak_flops * model.efficiency
        flops[BACKWARD] += model.recompute_flops(policy)
        return {k: (tokens * f / speed, tokens * head / speed) for k, f in flops.items()}
    out = {}
    for kind, f in flops.items():
        speed = tp * (rates.forward if kind == FORWARD else rates.backward)
        out[kind] = (tokens * f / speed, tokens * head / speed)
    forward = out[FORWARD][0]
    out[BACKWARD] = (out[BACKWARD][0] + rates.recompute[policy] * forward, out[BACKWARD][1])
    return out


def _stage_parameters(model: Transformer, layers: list[int]) -> tuple[float, ...]:
    """Each stage's parameters: its layers', the embedding on the first, the output
    head on the last (one table if tied and one stage; a copy on each end if tied
    over several, as Megatron keeps them)."""
    last = len(layers) - 1
    table = model.vocab * model.hidden
    counts = [(j == 0) + (j == last) for j in range(len(layers))]
    if model.tied_embeddings and last == 0:
        counts[0] = 1
    return tuple(c * model.layer_parameters + n * table for c, n in zip(layers, counts))


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
        self,
        layout: Layout,
        *,
        global_batch: int,
        peak_flops: float = 0.0,
        tp_seconds: Any = None,
        hbm_bandwidth: float = 0.0,
    ) -> StageWork:
        """The measured costs scaled to ``layout`` (see the class's rules)."""
        del peak_flops, tp_seconds, hbm_bandwidth  # measured: in the costs already
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
            compute="measured action costs of the pipeline, scaled by rows a chip",
        )
