"""The data every view of a staged program shares: one row per stage (counts, FLOPs,
bytes), number formatting, and one colour per stage.

>>> import jax, jax.numpy as jnp, pipemark as pm
>>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))
>>> rows, total = stage_rows(pm.passes.slice_stages(pm.passes.insert_markers(cj, [1])))
>>> [(r.name, r.flops) for r in rows], total.flops
([('stage0', 4), ('stage1', 4)], 8)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipemark._compat import jaxpr_type_name
from pipemark._text import display_name, format_bytes, format_count, format_share, type_text
from pipemark.cost import estimate_cost, nbytes
from pipemark.errors import PipemarkError

if TYPE_CHECKING:
    from pipemark.staged import StagedJaxpr

__all__ = [
    "COLUMNS",
    "COLUMN_MEANINGS",
    "LEFT_COLUMNS",
    "parameter_inputs",
    "program_inputs",
    "row_cells",
    "PALETTE",
    "StageRow",
    "check_staged",
    "display_name",
    "format_bytes",
    "format_count",
    "format_share",
    "stage_colors",
    "type_text",
    "stage_rows",
]


# Ten hues that stay distinguishable on white and on near-black, and for most colour
# vision deficiencies; a program with more stages reuses them in order.
PALETTE: tuple[str, ...] = (
    "#3b7dd8",
    "#e8702a",
    "#2ca05a",
    "#d6455d",
    "#8a63d2",
    "#a0703c",
    "#d45fb0",
    "#6f7f8f",
    "#b5a020",
    "#1fa5b5",
)


# ------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class StageRow:
    """One row of the stage table.

    Attributes
    ----------
    index, name:
        The stage's position and name (``"total"`` and ``-1`` for the totals row).
    equations:
        Top-level equations.
    inputs, outputs:
        How many values the stage takes (program inputs, constants it is handed and
        earlier stages' values) and how many it hands on.
    flops:
        FLOPs plus transcendental calls (:attr:`pipemark.cost.Cost.total_flops`), the
        number :func:`pipemark.passes.auto_layers` balances.
    param_bytes:
        Bytes of the parameters the stage reads (:func:`parameter_inputs`, and the
        program's constants): what must be on the stage's device before it runs. Data
        inputs (a batch) are not counted. In the totals row each parameter counts once,
        however many stages read it.
    bytes_in, bytes_out:
        Bytes received from earlier stages; bytes handed to later stages or returned.
    share:
        ``flops`` as a fraction of the program's; ``None`` when the program does no
        arithmetic at all.
    approximate:
        True when the cost model could not count some equation exactly.
    """

    index: int
    name: str
    equations: int
    inputs: int
    outputs: int
    flops: int
    param_bytes: int
    bytes_in: int
    bytes_out: int
    share: float | None
    approximate: bool = False


def check_staged(staged: Any, what: str) -> StagedJaxpr:
    """``staged`` when it is a staged program, else a :class:`PipemarkError` naming
    ``what`` was called. It checks what a view reads, so that anything shaped like a
    staged program can be drawn."""
    if not all(hasattr(staged, a) for a in ("stages", "outputs", "invars", "input_names")):
        raise PipemarkError(
            f"{what} takes a StagedJaxpr, got {jaxpr_type_name(staged)}; make one with "
            "pm.split(fn, *args) or pm.passes.slice_stages(cj)."
        )
    return staged


def stage_rows(staged: StagedJaxpr) -> tuple[list[StageRow], StageRow]:
    """The rows of the stage table and the totals row.

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> cj = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(jnp.ones(4))
    >>> rows, total = stage_rows(pm.passes.slice_stages(pm.passes.insert_markers(cj, [1])))
    >>> [(r.name, r.flops, r.bytes_in) for r in rows]
    [('stage0', 4, 0), ('stage1', 4, 16)]
    """
    staged = check_staged(staged, "stage_rows")
    costs = [estimate_cost(stage.closed_jaxpr) for stage in staged.stages]
    total_flops = sum(c.total_flops for c in costs)
    parameters = parameter_inputs(staged)
    rows = []
    inputs_read: dict[int, int] = {}
    const_bytes = 0
    for k, (stage, cost) in enumerate(zip(staged.stages, costs)):
        jaxpr = stage.closed_jaxpr.jaxpr
        params = received = 0
        for ref, var in zip(stage.inputs, jaxpr.invars):
            size = nbytes(var.aval)
            if ref.kind == "stage":
                received += size
            elif ref.index in parameters:
                params += size
                inputs_read[ref.index] = size
        consts = sum(nbytes(v.aval) for v in jaxpr.constvars)
        const_bytes += consts
        rows.append(
            StageRow(
                k,
                stage.name,
                stage.num_eqns,
                len(jaxpr.invars),
                len(jaxpr.outvars),
                cost.total_flops,
                params + consts,
                received,
                sum(nbytes(v.aval) for v in jaxpr.outvars),
                cost.total_flops / total_flops if total_flops else None,
                cost.approximate,
            )
        )
    total = StageRow(
        -1,
        "total",
        sum(r.equations for r in rows),
        sum(r.inputs for r in rows),
        sum(r.outputs for r in rows),
        total_flops,
        sum(inputs_read.values()) + const_bytes,
        sum(r.bytes_in for r in rows),
        sum(r.bytes_out for r in rows),
        1.0 if total_flops else None,
        any(r.approximate for r in rows),
    )
    return rows, total


# A pytree path's leading argument name: ``params`` in ``params['Dense_0']['kernel']``.
_ARGUMENT = re.compile(r"[A-Za-z_]\w*")
_UNNAMED = re.compile(r"input\[\d+\]")


def _argument_groups(names: tuple[str, ...]) -> list[list[int]]:
    """The program inputs grouped by the function argument they come from, in order."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        match = _ARGUMENT.match(name)
        # A program with no argument names (``input[3]``): each input is its own.
        key = name if match is None or _UNNAMED.fullmatch(name) else match.group()
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _type_of(aval: Any) -> tuple:
    return (getattr(aval, "shape", None), str(getattr(aval, "dtype", aval)))


def _result_types(staged: StagedJaxpr) -> list[tuple | None]:
    """The type of each program result the program computes; ``None`` for an input or
    constant it returns as it is."""
    types: list[tuple | None] = []
    for ref in staged.outputs:
        if ref.kind == "stage":
            aval = staged.stages[ref.stage].closed_jaxpr.jaxpr.outvars[ref.index].aval
            types.append(_type_of(aval))
        else:
            types.append(None)
    return types


def _claim_run(results: list[tuple | None], wanted: list[tuple]) -> bool:
    """Whether ``wanted`` appears, in order and contiguous, among the ``results`` not
    claimed yet (claiming them: set to ``None``), with something else returned too
    (the value beside the gradients, the loss beside the new state). A program
    returning only a value of its argument's types, such as ``sin(x) * x``,
    transforms data, not parameters."""
    n = len(wanted)
    if len(results) <= n:
        return False
    for i in range(len(results) - n + 1):
        if results[i : i + n] == wanted:
            results[i : i + n] = [None] * n
            return True
    return False


def parameter_inputs(staged: StagedJaxpr) -> frozenset[int]:
    """The program inputs that are parameters rather than data, by argument:

    * the arguments the program returns a computed value of the same types for, in
      the same order (each result counted for one argument, the first that matches),
      beside other results: what ``jax.value_and_grad``
      differentiates (it returns their gradients after the value) and what a
      training step updates (parameters, optimizer state; beside the loss);
    * when the program returns no such thing (a forward pass, a loss), the first
      argument of a function of several (``apply(params, x)``, ``loss(model, x, y)``);
    * none for a function of one argument.

    Arguments are told apart by the inputs' names (:attr:`StagedJaxpr.input_names`).

    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def loss(p, x):
    ...     return jnp.sum(jnp.sin(x * p["w"]) + p["b"])
    >>> p, x = {"w": jnp.ones(3), "b": jnp.ones(3)}, jnp.ones((2, 3))
    >>> staged = pm.split(jax.value_and_grad(loss), p, x, num_stages=2)
    >>> [staged.input_names[i] for i in sorted(parameter_inputs(staged))]
    ["p['b']", "p['w']"]
    """
    staged = check_staged(staged, "parameter_inputs")
    groups = _argument_groups(staged.input_names)
    results = _result_types(staged)
    invars = staged.invars
    # In argument order, each result matched once: of two arguments of one type, the
    # first takes the gradient (``jax.value_and_grad`` returns them in that order).
    returned = [
        group for group in groups if _claim_run(results, [_type_of(invars[i].aval) for i in group])
    ]
    if returned:
        return frozenset(i for group in returned for i in group)
    return frozenset(groups[0]) if len(groups) > 1 else frozenset()


#: The stage table's columns: position, name, equations, values in and out, FLOPs,
#: parameter bytes, bytes in and out, share of the FLOPs (see :class:`StageRow`).
COLUMNS = (
    "#",
    "stage",
    "eqns",
    "in",
    "out",
    "FLOPs",
    "params",
    "bytes in",
    "bytes out",
    "share",
)
#: What each column of :data:`COLUMNS` holds, in words (the HTML view's tooltips).
COLUMN_MEANINGS = (
    "position of the stage",
    "stage name",
    "top-level equations",
    "values the stage takes (parameters, data, earlier stages' values)",
    "values the stage hands on or returns",
    "FLOPs plus transcendental calls (~: estimated)",
    "bytes of the parameters the stage reads (not data inputs)",
    "bytes received from earlier stages",
    "bytes handed to later stages or returned",
    "share of the program's FLOPs",
)
# Left-aligned columns; the others are numbers, aligned right.
LEFT_COLUMNS = frozenset({0, 1})


# C0 and C1 control characters: ESC starts the terminal's escape sequences.
def row_cells(row: StageRow) -> tuple[str, ...]:
    """The cells of one row, under :data:`COLUMNS`."""
    return (
        "" if row.index < 0 else str(row.index),
        display_name(row.name),
        str(row.equations),
        str(row.inputs),
        str(row.outputs),
        ("~" if row.approximate else "") + format_count(row.flops),
        format_bytes(row.param_bytes),
        format_bytes(row.bytes_in),
        format_bytes(row.bytes_out),
        format_share(row.share),
    )


def program_inputs(staged: StagedJaxpr, stage: Any) -> list[tuple[str, Any]]:
    """``(name, aval)`` of each program input a stage reads, named by its pytree path
    in the traced function's arguments (:attr:`StagedJaxpr.input_names`)."""
    names = staged.input_names
    read = sorted(
        (ref.index, var.aval)
        for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars)
        if ref.kind == "input"
    )
    return [(names[index], aval) for index, aval in read]


# ---------------------------------------------------------------------------- colours


def stage_colors(staged: StagedJaxpr) -> list[str]:
    """One ``#rrggbb`` colour per stage. A backward stage (and a weight-gradient stage)
    gets the colour of the forward stage its :attr:`~pipemark.staged.Stage.role` names, so a
    layer reads as one colour both ways.

    >>> import jax, pipemark as pm
    >>> from pipemark import examples
    >>> ex = examples.mlp(num_layers=2)
    >>> staged = pm.split(jax.value_and_grad(ex.loss_fn), *ex.args)
    >>> colors = stage_colors(staged)
    >>> colors[0] == colors[3], colors[0] == colors[1]
    (True, False)
    """
    staged = check_staged(staged, "stage_colors")
    assigned: dict[str, str] = {}
    colors = []
    next_color = 0
    for stage in staged.stages:
        partner = stage.role.owner
        if partner is not None and partner in assigned:
            color = assigned[partner]
        else:
            color = PALETTE[next_color % len(PALETTE)]
            next_color += 1
        assigned[stage.name] = color
        colors.append(color)
    return colors
