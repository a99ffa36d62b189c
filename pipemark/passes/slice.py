"""Cut a marked program into stages: :func:`slice_stages`."""

from __future__ import annotations

from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var

from pipemark.errors import (
    MarkerError,
)
from pipemark.passes.flow import StageFlow, stage_flow
from pipemark.passes.framework import jaxpr_pass
from pipemark.roles import role_from_name
from pipemark.staged import (
    Stage,
    StagedJaxpr,
    ValueRef,
    new_ref,
    new_stage,
    stage_debug_info,
)

__all__ = ["slice_stages"]


@jaxpr_pass
def slice_stages(cj: ClosedJaxpr, unmarked: str = "assign") -> StagedJaxpr:
    """Cut a program at its start/end markers into a :class:`~pipemark.StagedJaxpr`.

    One stage per start/end pair (a ``jvp_start``/``jvp_end`` pair of the same name
    belongs to the same stage), in program order. Each stage is a ``ClosedJaxpr`` whose
    inputs are the program inputs and earlier-stage values it reads, and whose outputs
    are the values that later stages or the program's result read. A constant lives in
    every stage that reads it. A value may skip stages (stage 0 feeding stage 3).
    ``make_jaxpr(jax.value_and_grad(f))`` of a marked ``f`` gives forward stages
    followed by mirrored ``<name>_backward`` stages.

    Parameters
    ----------
    cj:
        A program with start/end markers (see :func:`insert_markers`,
        :func:`layers_from_boundaries`).
    unmarked:
        What to do with equations outside every start/end pair (such as a loss after
        the last ``end`` marker, or the seed of the backward pass):

        ``"assign"`` (default)
            An equation that reads a value computed in some stage joins the *latest*
            such stage. An equation that reads only program inputs, constants, literals
            and other such equations joins the *earliest* stage that reads its result;
            if no stage does, the first stage after it, or the last stage. Stages
            therefore still run in order, and an unmarked equation between two stages
            stays with the computation it continues.
        ``"error"``
            Refuse the program with a :class:`MarkerError` naming the first such
            equation.

    Returns
    -------
    StagedJaxpr
        Calling it runs the stages in order and returns the original's flat results;
        :meth:`~pipemark.StagedJaxpr.as_closed_jaxpr` stitches them back.

    Raises
    ------
    MarkerError
        For malformed markers (see :func:`pipemark.passes._markers.find_stage_spans`),
        a program without start/end markers, boundary markers (call
        :func:`layers_from_boundaries` first) or, with ``unmarked="error"``, an equation
        outside every stage.

    Examples
    --------
    Before::

        { lambda ; a:f32[]. let
            b:f32[] = pipeline_marker[mark_type=start name=s0] a
            c:f32[] = sin b
            d:f32[] = pipeline_marker[mark_type=end name=s0] c
            e:f32[] = pipeline_marker[mark_type=start name=s1] d
            f:f32[] = cos e
            g:f32[] = pipeline_marker[mark_type=end name=s1] f
          in (g,) }

    After: stage ``s0`` is ``{ lambda ; a. let b = start a; c = sin b; d = end c in
    (d,) }`` and stage ``s1`` takes ``d`` and returns ``g``.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = pm.passes.insert_markers(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0),
    ...                               [1], names=["s0", "s1"])
    >>> staged = slice_stages(cj)
    >>> print(staged.stages[1].closed_jaxpr)  # doctest: +NORMALIZE_WHITESPACE
    { lambda ; a:f32[]. let
        b:f32[] = pipeline_marker[mark_type=start name=s1] a
        c:f32[] = cos b
        d:f32[] = pipeline_marker[mark_type=end name=s1] c
      in (d,) }
    >>> staged.stages[1].inputs
    (ValueRef.stage_output(0, 0),)
    """
    return _slice_stages(cj, unmarked)


def _slice_stages(cj: ClosedJaxpr, unmarked: str = "assign") -> StagedJaxpr:
    jaxpr = cj.jaxpr
    flow = stage_flow(jaxpr, unmarked)
    if not flow.spans:
        raise MarkerError(
            "slice_stages: the program has no start/end markers, so there is nothing to cut. "
            "Mark the model's layers with pm.mark(..., mark_type='start'/'end') or "
            "pm.mark_pipeline_boundary(), or insert markers with "
            "pm.passes.insert_markers(cj, cuts) or pm.passes.insert_markers_by_scope(cj)."
        )
    builder = _Builder(cj)
    stages = [builder.stage(flow, k) for k in range(len(flow.spans))]
    # The references are valid by construction: stage names are unique (the marker
    # validation refuses duplicates) and every stage reads program inputs and earlier
    # stages only (the flow analysis refuses anything else).
    return StagedJaxpr._trusted(stages, jaxpr.invars, builder.outputs(), jaxpr.debug_info)


class _Builder:
    """Builds the stage programs of one program from its flow, in stage order: each
    stage's results are named where later stages read them."""

    def __init__(self, cj: ClosedJaxpr) -> None:
        jaxpr = cj.jaxpr
        self.jaxpr = jaxpr
        self.input_position = {v: i for i, v in enumerate(jaxpr.invars)}
        self.const_value = dict(zip(jaxpr.constvars, cj.consts))
        self.output_ref: dict[Var, ValueRef] = {}
        self.output_name: dict[Var, str] = {}
        self.input_names: dict[int, str] = {}

    def results(self, flow: StageFlow, k: int, stage_eqns: list) -> tuple[list[Var], set]:
        """The stage's results (its values read later) and its effects."""
        exported, output_ref, output_name = flow.exported, self.output_ref, self.output_name
        outvars: list[Var] = []
        effects: set[Any] = set()
        if flow.leaving is None:
            candidates = (v for eqn in stage_eqns for v in eqn.outvars)
        else:
            candidates = iter(flow.leaving[k])
        for v in candidates:
            if v in exported:
                output_ref[v] = new_ref("stage", len(outvars), k)
                output_name[v] = f"stage{k}[{len(outvars)}]"
                outvars.append(v)
        for eqn in stage_eqns:
            if eqn.effects:
                effects.update(eqn.effects)
        return outvars, effects

    def stage(self, flow: StageFlow, k: int) -> Stage:
        indices = flow.members[k]
        eqns = self.jaxpr.eqns
        if type(indices) is range:
            stage_eqns = eqns[indices.start : indices.stop]
        else:
            stage_eqns = [eqns[i] for i in indices]
        outvars, effects = self.results(flow, k, stage_eqns)
        invars: list[Var] = []
        refs: list[ValueRef] = []
        arg_names: list[str] = []
        constvars: list[Var] = []
        for a, producer in flow.reads[k].items():
            if producer is not None:
                invars.append(a)
                refs.append(self.output_ref[a])
                arg_names.append(self.output_name[a])
            elif a in self.input_position:
                invars.append(a)
                position = self.input_position[a]
                refs.append(ValueRef.input(position))
                arg_name = self.input_names.get(position)
                if arg_name is None:
                    arg_name = self.input_names[position] = f"input[{position}]"
                arg_names.append(arg_name)
            else:
                constvars.append(a)
        name = flow.spans[k].name
        info = stage_debug_info(name, refs, len(outvars), arg_names)
        stage_jaxpr = Jaxpr(constvars, invars, outvars, stage_eqns, effects, info)
        closed = ClosedJaxpr(stage_jaxpr, [self.const_value[c] for c in constvars])
        # Where markers' names become stages: the one place a name is read as a role.
        return new_stage(name, closed, tuple(refs), tuple(indices), role_from_name(name))

    def outputs(self) -> list[ValueRef]:
        outputs = []
        for a in self.jaxpr.outvars:
            if isinstance(a, Literal) or not isinstance(a, Var):
                outputs.append(ValueRef.const(a))
            elif a in self.output_ref:
                outputs.append(self.output_ref[a])
            elif a in self.input_position:
                outputs.append(ValueRef.input(self.input_position[a]))
            else:
                outputs.append(ValueRef.const(self.const_value[a]))
        return outputs
