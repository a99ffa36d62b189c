"""From a traced program to pipeline stages: :func:`stage_program` cuts it as
:func:`pipemark.split` does, and :func:`pipeline_stages` pairs each forward stage with
its mirrored backward (and, split for a zero-bubble schedule, weight-gradient) stage
into one pipeline stage, with the stage graph between pipeline stages and the
residual bytes each holds per microbatch in flight: what
:class:`~pipemark.runtime.ScheduleProblem` needs from the program.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> staged = pm.split(jax.grad(lambda x: jnp.sum(jnp.cos(jnp.sin(x)))), jnp.ones(4),
...                   num_stages=2)
>>> stages = pipeline_stages(staged, split_backward=False)
>>> stages.forward, stages.backward, stages.edges, stages.activation_bytes
((0, 1), (3, 2), ((0, 1),), (16, 16))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jax.extend.core import ClosedJaxpr

from pipemark.cost import nbytes
from pipemark.errors import PipemarkError, StageGraphError
from pipemark.passes.backward_split import split_backward as split_backward_stages
from pipemark.passes.inline import inline_calls
from pipemark.passes.stages import consecutive_layers, merge_consecutive, pair_stages
from pipemark.staged import StagedJaxpr
from pipemark.staging import cuts_at_marked_layers, has_stage_markers, split_jaxpr

__all__ = ["PipelineStages", "pipeline_stages", "stage_program"]


def stage_program(
    cj: ClosedJaxpr,
    num_stages: int | None,
    what: str,
    block_cuts: str = "prefer",
    stage_layers: Sequence[int] | None = None,
) -> tuple[StagedJaxpr, tuple[int, ...] | None]:
    """Cut a traced program for the runtime as :func:`pipemark.split` cuts it (through
    :func:`pipemark.split_jaxpr`): at its markers, or, without any, into ``num_stages``
    balanced stages under the split policy ``block_cuts`` (``what`` names the program
    in the error when there is neither). A program marked with more layers than
    ``num_stages`` has consecutive layers merged into each stage, ``stage_layers[g]``
    of them into stage ``g`` (by default about equal equation counts). Returns the
    staged program and how many marked layers each stage merged (``None`` where its
    stages are not merged from marked layers).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     for _ in range(3):
    ...         pm.mark_pipeline_boundary()
    ...         x = jnp.sin(x)
    ...     return x
    >>> stage_program(jax.make_jaxpr(f)(1.0), 2, "f", stage_layers=(1, 2))[1]
    (1, 2)
    """
    # Inlined once here; has_stage_markers and split_jaxpr then find nothing to inline.
    cj = inline_calls(cj)
    if stage_layers is not None:
        num_stages = _count_of(stage_layers, num_stages)
    if num_stages is None and not has_stage_markers(cj):
        raise PipemarkError(
            f"{what} has no pipeline markers, so the pipeline cannot tell where to cut it. "
            "Pass num_stages= to cut it automatically into balanced stages, or mark the "
            "layers with pm.mark(..., mark_type='start'/'end') or "
            "pm.mark_pipeline_boundary()."
        )
    if num_stages is None or not cuts_at_marked_layers(cj):
        if stage_layers is not None:
            raise PipemarkError(
                f"stage_layers={tuple(stage_layers)!r} shares marked layers among the "
                f"stages, but {what} is not cut at top-level layer markers (it is balanced "
                "automatically, or its layers are a marked scan). Mark the layers with "
                "pm.mark_pipeline_boundary(), or leave stage_layers=None."
            )
        # An unmarked program is cut into num_stages as pm.split and the CLI cut it.
        return split_jaxpr(cj, num_stages=num_stages, block_cuts=block_cuts), None
    marked = split_jaxpr(cj, block_cuts=block_cuts)  # one stage per marked layer
    layers = consecutive_layers(marked, num_stages) if stage_layers is None else stage_layers
    return merge_consecutive(marked, num_stages, layers), tuple(layers)


def _count_of(stage_layers: Sequence[int], num_stages: int | None) -> int:
    count = len(tuple(stage_layers))
    if num_stages is not None and num_stages != count:
        raise PipemarkError(
            f"stage_layers={tuple(stage_layers)!r} gives {count} stages but "
            f"num_stages={num_stages}; give one count of layers per stage, or leave "
            "num_stages=None."
        )
    return count


class PipelineStages(NamedTuple):
    """A staged program's stages grouped into pipeline stages.

    Attributes
    ----------
    staged:
        The staged program (its backward split into B and W where asked).
    forward, backward, weight:
        Per pipeline stage, the index in ``staged.stages`` of its forward, backward and
        weight-gradient programs (``None`` where it has none).
    edges:
        The pipeline-stage graph, sorted ``(source, target)`` pairs: a value read from
        another pipeline stage orders the two.
    activation_bytes:
        Per pipeline stage, the bytes of the forward's outputs its backward and weight
        programs read, for one microbatch (each value once): buffers the forward's
        program returns and the stage's slot holds until the backward has run, the
        residuals of one microbatch in flight (a parameter the forward hands its
        backward through its markers counts too: it is one of the program's outputs).
    """

    staged: StagedJaxpr
    forward: tuple[int, ...]
    backward: tuple[int | None, ...]
    weight: tuple[int | None, ...]
    edges: tuple[tuple[int, int], ...]
    activation_bytes: tuple[int, ...]

    def pipeline_stage(self) -> dict[int, int]:
        """The pipeline stage of each stage index it groups."""
        owner: dict[int, int] = {}
        for k, group in enumerate(zip(self.forward, self.backward, self.weight)):
            owner.update((index, k) for index in group if index is not None)
        return owner


def pipeline_stages(staged: StagedJaxpr, split_backward: bool) -> PipelineStages:
    """``staged`` grouped into pipeline stages (its backward split into B and W first
    where ``split_backward``: a zero-bubble schedule runs each backward's parameter
    gradients apart). Raises :class:`~pipemark.errors.StageGraphError` where a forward stage
    reads a backward stage's value."""
    if split_backward:
        staged = split_backward_stages(staged)
    forward, backward, weight = pair_stages(staged)
    grouped = PipelineStages(staged, tuple(forward), tuple(backward), tuple(weight), (), ())
    is_backward = {b for b in (*backward, *weight) if b is not None}
    edges = _stage_edges(staged, grouped.pipeline_stage(), is_backward)
    return grouped._replace(edges=tuple(sorted(edges)), activation_bytes=_residual_bytes(grouped))


def _stage_edges(
    staged: StagedJaxpr, pipeline_stage: dict[int, int], is_backward: set[int]
) -> set[tuple[int, int]]:
    """Edges of the pipeline-stage graph that make every cross-stage read safe: a value
    read from another pipeline stage orders the two stages (see the module docstring of
    :mod:`pipemark.runtime.schedules`)."""
    edges: set[tuple[int, int]] = set()
    for c, stage in enumerate(staged.stages):
        for ref in stage.inputs:
            if ref.kind != "stage":
                continue
            p = ref.stage
            if c not in is_backward and p in is_backward:
                raise StageGraphError(
                    f"Forward stage {stage.name!r} reads a value of backward stage "
                    f"{staged.stages[p].name!r}; a pipeline runs every forward before the "
                    "matching backward. Keep gradient computations out of the forward "
                    "stages."
                )
            a, b = pipeline_stage[p], pipeline_stage[c]
            if a != b:
                edges.add((min(a, b), max(a, b)))
    return edges


def _residual_bytes(grouped: PipelineStages) -> tuple[int, ...]:
    """Per pipeline stage, the bytes of its forward's outputs that its backward and
    weight programs read (each output once)."""
    stages = grouped.staged.stages
    sizes = []
    for forward, *later in zip(grouped.forward, grouped.backward, grouped.weight):
        read = {
            ref.index
            for index in later
            if index is not None
            for ref in stages[index].inputs
            if ref.kind == "stage" and ref.stage == forward
        }
        sizes.append(sum(nbytes(stages[forward].out_avals[o]) for o in read))
    return tuple(sizes)
