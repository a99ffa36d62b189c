"""Staged programs: a program cut into stages that run one after another.

A :class:`StagedJaxpr` holds a tuple of :class:`Stage` objects, each a ``ClosedJaxpr``
with explicit inputs and outputs. A stage input comes from a program input or from an
earlier stage's output (a :class:`ValueRef` says which); constants live inside the stage
that uses them. The program's results are references too.

Stage jaxprs share the variables of the program they were sliced from, so stitching the
stages back together (:meth:`StagedJaxpr.as_closed_jaxpr`) gives the original equations,
the very same equation objects, in stage order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    jaxpr_as_fun,
)

from pipemark._text import plural
from pipemark.cost import flatten_shape_byte_sizes
from pipemark.errors import PipemarkError, StageGraphError
from pipemark.precision import reference_compute_types
from pipemark.rendering import render
from pipemark.roles import StageRole, role_from_name
from pipemark.signature import Signature
from pipemark.verification import (
    REFERENCE_KINDS,
    VerifyReport,
    compare_results,
    evaluate_reference,
    raise_on_mismatch,
)

if TYPE_CHECKING:
    from pipemark.exported import ExportedStages

__all__ = ["Stage", "StagedJaxpr", "ValueRef"]


@dataclass(frozen=True)
class ValueRef:
    """Where a value comes from.

    ``kind`` is ``"input"`` (program input ``index``), ``"stage"`` (output ``index`` of
    stage ``stage``) or ``"const"`` (the constant or literal ``value``; only for program
    results).
    """

    kind: str
    index: int = 0
    stage: int = -1
    value: Any = None

    @staticmethod
    def input(index: int) -> ValueRef:
        return new_ref("input", index, -1)

    @staticmethod
    def stage_output(stage: int, index: int) -> ValueRef:
        return new_ref("stage", index, stage)

    @staticmethod
    def const(value: Any) -> ValueRef:
        return ValueRef("const", value=value)

    def __str__(self) -> str:
        kind = self.kind
        if kind == "stage":  # the most common: stage debug info names each input so
            return f"stage{self.stage}[{self.index}]"
        if kind == "input":
            return f"input[{self.index}]"
        return f"const({self.value!r})"

    def __repr__(self) -> str:
        """The call that makes this reference: ``ValueRef.stage_output(1, 0)``.

        >>> ValueRef.input(2), ValueRef.stage_output(1, 0), ValueRef.const(1.5)
        (ValueRef.input(2), ValueRef.stage_output(1, 0), ValueRef.const(1.5))
        """
        if self.kind == "input":
            return f"ValueRef.input({self.index})"
        if self.kind == "stage":
            return f"ValueRef.stage_output({self.stage}, {self.index})"
        value = self.value
        # An array constant is shown by its type, not its (possibly huge) contents.
        shown = repr(value) if isinstance(value, (bool, int, float, complex)) else _short(value)
        return f"ValueRef.const({shown})"


def _short(value: Any) -> str:
    """An array by its type (``<f32[2,3]>``); a scalar or anything else as itself."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or not shape:
        return repr(value)
    return f"<{jax.core.ShapedArray(tuple(shape), dtype).str_short(short_dtypes=True)}>"


def new_ref(kind: str, index: int, stage: int) -> ValueRef:
    # The frozen dataclass's __init__ sets each field through object.__setattr__; a
    # sliced program makes one reference per value crossing a stage boundary, and
    # filling the instance dict directly is twice as fast. Same object, same fields.
    ref = _object_new(ValueRef)
    fields = ref.__dict__
    fields["kind"] = kind
    fields["index"] = index
    fields["stage"] = stage
    fields["value"] = None
    return ref


_object_new = object.__new__


@dataclass(frozen=True)
class Stage:
    """One stage: a name, its program, and where each of its inputs comes from.

    Attributes
    ----------
    name:
        The stage name (from the markers).
    closed_jaxpr:
        The stage's program. Its invars are the stage inputs, in the order of
        ``inputs``; its outvars are the values later stages or the result read.
    inputs:
        One :class:`ValueRef` per invar of ``closed_jaxpr``.
    eqn_indices:
        The indices, in the sliced program, of the equations this stage holds.
    role:
        What the stage is (forward, backward, weight, update) and which forward stage
        a backward or weight stage belongs to (:class:`~pipemark.roles.StageRole`). The
        passes that make stages set it; ``None`` (a stage made by hand) reads it from
        the name, as slicing does (:func:`~pipemark.roles.role_from_name`).
    """

    name: str
    closed_jaxpr: ClosedJaxpr
    inputs: tuple[ValueRef, ...]
    eqn_indices: tuple[int, ...] = ()
    role: StageRole = None  # type: ignore[assignment]  # None: from the name

    def __post_init__(self) -> None:
        if self.role is None:
            object.__setattr__(self, "role", role_from_name(self.name))
        elif not isinstance(self.role, StageRole):
            raise PipemarkError(
                f"Stage {self.name!r}: role must be a pipemark.roles.StageRole, got {self.role!r}."
            )

    @property
    def jaxpr(self) -> Jaxpr:
        return self.closed_jaxpr.jaxpr

    @property
    def num_eqns(self) -> int:
        return len(self.closed_jaxpr.jaxpr.eqns)

    @property
    def in_avals(self) -> tuple[Any, ...]:
        return tuple(v.aval for v in self.closed_jaxpr.jaxpr.invars)

    @property
    def out_avals(self) -> tuple[Any, ...]:
        return tuple(v.aval for v in self.closed_jaxpr.jaxpr.outvars)

    @property
    def bytes_in(self) -> int:
        """Bytes of the values this stage receives (program inputs and earlier stages)."""
        return int(flatten_shape_byte_sizes(list(self.in_avals)).sum())

    @property
    def bytes_out(self) -> int:
        """Bytes of the values this stage hands to later stages or the result."""
        return int(flatten_shape_byte_sizes(list(self.out_avals)).sum())


def new_stage(
    name: str,
    closed_jaxpr: ClosedJaxpr,
    inputs: tuple[ValueRef, ...],
    eqn_indices: tuple,
    role: StageRole,
) -> Stage:
    # As new_ref: a sliced program makes one Stage per stage, and filling the frozen
    # dataclass's instance dict directly skips its per-field object.__setattr__.
    stage = _object_new(Stage)
    fields = stage.__dict__
    fields["name"] = name
    fields["closed_jaxpr"] = closed_jaxpr
    fields["inputs"] = inputs
    fields["eqn_indices"] = eqn_indices
    fields["role"] = role
    return stage


def substitute_operands(eqns: Sequence[JaxprEqn], sub: dict[Var, Any]) -> list[JaxprEqn]:
    """``eqns`` with operands renamed through ``sub``; untouched equations are reused."""
    if not sub:
        return list(eqns)
    out = []
    for eqn in eqns:
        new_invars = [
            sub.get(a, a) if isinstance(a, Var) and not isinstance(a, Literal) else a
            for a in eqn.invars
        ]
        changed = any(a is not b for a, b in zip(new_invars, eqn.invars))
        out.append(eqn.replace(invars=new_invars) if changed else eqn)
    return out


def stage_debug_info(
    name: str,
    inputs: Sequence[ValueRef],
    num_outputs: int,
    arg_names: Sequence[str] | None = None,
) -> DebugInfo:
    """Debug info for a stage jaxpr: its inputs are named after where they come from
    (``arg_names``, when given, must be ``str(ref)`` of each input)."""
    return DebugInfo(
        "pipemark stage",
        f"stage {name}",
        tuple(str(ref) for ref in inputs) if arg_names is None else tuple(arg_names),
        _result_paths(num_outputs),
    )


_RESULT_PATHS: dict[int, tuple[str, ...]] = {}


def _result_paths(count: int) -> tuple[str, ...]:
    """``("result[0]", …, f"result[{count-1}]")``; the short ones are shared between
    stages."""
    paths = _RESULT_PATHS.get(count)
    if paths is None:
        paths = tuple(f"result[{i}]" for i in range(count))
        if count <= 64:
            _RESULT_PATHS[count] = paths
    return paths


def _flat_args(args: Sequence[Any]) -> list[Any]:
    return jax.tree_util.tree_leaves(list(args))


class StagedJaxpr:
    """A program cut into stages; see :func:`pipemark.passes.slice_stages`.

    Parameters
    ----------
    stages:
        The stages, in an order in which they can run.
    invars:
        The program's input variables (their avals give the inputs' types).
    outputs:
        One :class:`ValueRef` per program result.
    debug_info:
        The sliced program's ``debug_info``, kept for :meth:`as_closed_jaxpr`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, pipemark as pm
    >>> def f(x):
    ...     x = pm.mark(x, name="a", mark_type="start")
    ...     x = pm.mark(jnp.sin(x), name="a", mark_type="end")
    ...     x = pm.mark(x, name="b", mark_type="start")
    ...     return pm.mark(jnp.cos(x), name="b", mark_type="end")
    >>> staged = pm.passes.slice_stages(jax.make_jaxpr(f)(1.0))
    >>> [s.name for s in staged.stages]
    ['a', 'b']
    >>> staged.verify(f, 0.5).passed
    True
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        invars: Sequence[Var],
        outputs: Sequence[ValueRef],
        debug_info: Any = None,
        signature: Signature | None = None,
    ) -> None:
        self._stages = tuple(stages)
        self._invars = tuple(invars)
        self._outputs = tuple(outputs)
        self._debug_info = debug_info
        self._signature = signature
        self._balance = None
        self._check()

    @classmethod
    def _trusted(
        cls,
        stages: list[Stage],
        invars: Sequence[Var],
        outputs: list[ValueRef],
        debug_info: Any,
    ) -> StagedJaxpr:
        """Without :meth:`_check`: for a pass whose stages are valid by construction
        (unique names, every reference to a program input or an earlier stage's
        output), such as :func:`~pipemark.passes.slice_stages`."""
        staged = cls.__new__(cls)
        staged._stages = tuple(stages)
        staged._invars = tuple(invars)
        staged._outputs = tuple(outputs)
        staged._debug_info = debug_info
        staged._signature = None
        staged._balance = None
        return staged

    def with_signature(self, signature: Signature | None) -> StagedJaxpr:
        """The same stages, called like the traced function: ``signature`` (from
        :func:`pipemark.split`) says how the function's arguments (pytrees, keyword and
        static arguments, non-array leaves) map to the program's inputs, and a call
        with another structure is refused (:class:`~pipemark.signature.SignatureError`).
        """
        if signature is not None and signature.num_inputs != len(self._invars):
            raise PipemarkError(
                f"The signature has {signature.num_inputs} traced inputs, the program "
                f"{len(self._invars)}."
            )
        staged = type(self)._trusted(
            list(self._stages), self._invars, list(self._outputs), self._debug_info
        )
        staged._signature = signature
        staged._balance = self._balance
        return staged

    def with_balance(self, balance: Any) -> StagedJaxpr:
        """The same stages, reporting ``balance``: how
        :func:`pipemark.passes.auto.plan_layers` cut them (see :attr:`balance`)."""
        staged = self.with_signature(self._signature)
        staged._balance = balance
        return staged

    # ------------------------------------------------------------------- structure

    def _check_ref(self, ref: ValueRef, before: int, what: str) -> None:
        if ref.kind == "input":
            if not 0 <= ref.index < len(self._invars):
                raise StageGraphError(
                    f"{what} reads program input {ref.index}, but the program has "
                    f"{len(self._invars)} inputs."
                )
        elif ref.kind == "stage":
            if not 0 <= ref.stage < before:
                raise StageGraphError(
                    f"{what} reads stage {ref.stage}, which does not run before it; stages "
                    "may read only earlier stages."
                )
            num_out = len(self._stages[ref.stage].closed_jaxpr.jaxpr.outvars)
            if not 0 <= ref.index < num_out:
                raise StageGraphError(
                    f"{what} reads output {ref.index} of stage "
                    f"{self._stages[ref.stage].name!r}, which has {num_out} outputs."
                )
        elif ref.kind != "const" or before < len(self._stages):
            raise StageGraphError(f"{what}: {ref} is not a valid value reference.")

    def _check(self) -> None:
        names: set[str] = set()
        num_inputs = len(self._invars)
        # The common references, checked inline (a big program has one per value
        # crossing a stage boundary); anything else goes to _check_ref, which says
        # what is wrong.
        num_outputs: list[int] = []
        for k, stage in enumerate(self._stages):
            if stage.name in names:
                raise StageGraphError(f"Two stages are named {stage.name!r}; names are unique.")
            names.add(stage.name)
            jaxpr = stage.closed_jaxpr.jaxpr
            if len(stage.inputs) != len(jaxpr.invars):
                raise StageGraphError(
                    f"Stage {k} ({stage.name!r}) has {len(jaxpr.invars)} inputs but "
                    f"{len(stage.inputs)} input references."
                )
            for ref in stage.inputs:
                kind = ref.kind
                if kind == "stage":
                    if 0 <= ref.stage < k and 0 <= ref.index < num_outputs[ref.stage]:
                        continue
                elif kind == "input" and 0 <= ref.index < num_inputs:
                    continue
                self._check_ref(ref, k, f"Stage {k} ({stage.name!r})")
            num_outputs.append(len(jaxpr.outvars))
        for i, ref in enumerate(self._outputs):
            self._check_ref(ref, len(self._stages), f"Program result {i}")

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in the order they run."""
        return self._stages

    @property
    def signature(self) -> Signature | None:
        """How the traced function's arguments map to :attr:`invars` (set by
        :func:`pipemark.split`), or ``None`` for a program sliced from a jaxpr."""
        return self._signature

    @property
    def balance(self) -> Any:
        """How balanced the automatic cut is (a
        :class:`~pipemark.passes.auto.LayerBalance`: layer costs, largest over mean,
        whether the cuts fall between the model's blocks), for a program that
        :func:`pipemark.split` cut into ``num_stages`` stages; ``None`` otherwise."""
        return self._balance

    @property
    def debug_info(self) -> Any:
        """The sliced program's ``debug_info`` (input names, source function)."""
        return self._debug_info

    @property
    def input_names(self) -> tuple[str, ...]:
        """A name per program input: its pytree path in the traced function's arguments
        (``params['Dense_0']['kernel']``) where the program was traced from a function,
        else ``input[i]``."""
        if self._signature is not None:
            return self._signature.names
        info = self._debug_info
        names = getattr(info, "arg_names", None)
        if names is not None and len(names) == len(self._invars) and all(names):
            return tuple(names)
        return tuple(f"input[{i}]" for i in range(len(self._invars)))

    @property
    def invars(self) -> tuple[Var, ...]:
        """The program's input variables."""
        return self._invars

    @property
    def outputs(self) -> tuple[ValueRef, ...]:
        """Where each program result comes from."""
        return self._outputs

    @property
    def in_avals(self) -> tuple[Any, ...]:
        return tuple(v.aval for v in self._invars)

    def __len__(self) -> int:
        return len(self._stages)

    def __getitem__(self, key: int | str) -> Stage:
        """A stage by position or by name."""
        if isinstance(key, str):
            for stage in self._stages:
                if stage.name == key:
                    return stage
            raise PipemarkError(
                f"No stage named {key!r}; the stages are "
                f"{', '.join(repr(s.name) for s in self._stages)}."
            )
        try:
            return self._stages[key]
        except (IndexError, TypeError):
            raise PipemarkError(
                f"No stage {key!r}: this program has {plural(len(self._stages), 'stage')}."
            ) from None

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self._stages)
        return f"StagedJaxpr({plural(len(self._stages), 'stage')}: {names})"

    # ------------------------------------------------------------------------ run

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run the stages one after another and return the program's flat results.

        ``args`` are the program's inputs, flat or as the pytrees the traced function
        took (they are flattened). A program made by :func:`pipemark.split` is called
        like the function it traced (keyword, static and non-array arguments too), and
        arguments of another pytree structure are refused. Each stage runs eagerly,
        equation by equation, as ``jax.extend.core.jaxpr_as_fun`` does, so the results
        are those of the sliced program's equations evaluated that way, bit for bit;
        against ``jax.jit`` of the function (one compiled program, whose calls staging
        may have inlined) they agree to float rounding (:meth:`verify`). Wrap the call in
        ``jax.jit`` to compile it instead.
        """
        flat = self._inputs(args, kwargs)
        if len(flat) != len(self._invars):
            raise PipemarkError(
                f"The staged program takes {len(self._invars)} inputs (after flattening), "
                f"got {len(flat)}."
            )
        for i, (value, var) in enumerate(zip(flat, self._invars)):
            shape = tuple(np.shape(value))
            if shape != tuple(var.aval.shape):
                raise PipemarkError(
                    f"Input {i} has shape {shape}, but the program was traced with "
                    f"{var.aval.str_short()}."
                )
        results: list[list[Any]] = []
        for stage in self._stages:
            inputs = [self._fetch(ref, flat, results) for ref in stage.inputs]
            results.append(list(jaxpr_as_fun(stage.closed_jaxpr)(*inputs)))
        return [self._fetch(ref, flat, results) for ref in self._outputs]

    def _inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        if self._signature is not None:
            return self._signature.flatten(args, kwargs)
        if kwargs:
            raise PipemarkError(
                "This staged program was sliced from a jaxpr and takes its inputs "
                "positionally; keyword arguments need a program made by pm.split."
            )
        return _flat_args(args)

    @staticmethod
    def _fetch(ref: ValueRef, flat: list[Any], results: list[list[Any]]) -> Any:
        if ref.kind == "input":
            return flat[ref.index]
        if ref.kind == "stage":
            return results[ref.stage][ref.index]
        value = ref.value
        if isinstance(value, Literal):
            # The literal's type, as jax.jit of the program returns it (its value may be
            # a Python float, which numpy would make float64).
            return np.asarray(value.val, value.aval.dtype)
        return value

    def as_closed_jaxpr(self) -> ClosedJaxpr:
        """Stitch the stages back into one program with the original inputs and results.

        The equations are the stages' equations in stage order; for a program sliced by
        :func:`~pipemark.passes.slice_stages` from a fully marked program they are the
        original equation objects in the original order.
        """
        produced: list[list[Any]] = []
        eqns: list[JaxprEqn] = []
        constvars: list[Var] = []
        consts: list[Any] = []
        seen_consts: set[Var] = set()
        for stage in self._stages:
            jaxpr = stage.closed_jaxpr.jaxpr
            sub: dict[Var, Any] = {}
            for var, ref in zip(jaxpr.invars, stage.inputs):
                atom = self._atom(ref, produced)
                if atom is not var:
                    sub[var] = atom
            for var, value in zip(jaxpr.constvars, stage.closed_jaxpr.consts):
                if var not in seen_consts:
                    seen_consts.add(var)
                    constvars.append(var)
                    consts.append(value)
            eqns.extend(substitute_operands(jaxpr.eqns, sub))
            produced.append([sub.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars])
        outvars = []
        for ref in self._outputs:
            if ref.kind == "const":
                value = ref.value
                if isinstance(value, Literal):
                    outvars.append(value)
                else:
                    # A constant returned as-is becomes a constvar of the stitched program.
                    var = Var(jax.typeof(value))
                    constvars.append(var)
                    consts.append(value)
                    outvars.append(var)
            else:
                outvars.append(self._atom(ref, produced))
        effects = set()
        for eqn in eqns:
            effects |= set(eqn.effects)
        debug_info = self._debug_info or DebugInfo(
            "pipemark",
            "stitched stages",
            tuple(f"input[{i}]" for i in range(len(self._invars))),
            tuple(f"result[{i}]" for i in range(len(outvars))),
        )
        jaxpr = Jaxpr(constvars, self._invars, outvars, eqns, effects, debug_info)
        return ClosedJaxpr(jaxpr, consts)

    def _atom(self, ref: ValueRef, produced: list[list[Any]]) -> Any:
        if ref.kind == "input":
            return self._invars[ref.index]
        if ref.kind == "stage":
            return produced[ref.stage][ref.index]
        raise StageGraphError(f"A stage input cannot be {ref}.")

    def verify(
        self,
        reference: Callable[..., Any] | ClosedJaxpr,
        *args: Any,
        rtol: float | None = None,
        atol: float | None = None,
        against: str | Sequence[str] = REFERENCE_KINDS,
        **kwargs: Any,
    ) -> VerifyReport:
        """Run the staged program on ``args`` (and ``kwargs``) and compare its results
        with JAX's own evaluation of ``reference``, the unsplit function.

        ``reference`` is the function the program was split from (called with this
        program's static arguments; non-array leaves static) or a ``ClosedJaxpr``
        (called with the flat arguments). It is evaluated as JAX evaluates it, never
        through a pipemark pass: ``against="jit"`` compiles it with ``jax.jit``,
        ``"eager"`` calls it as it is; by default both.

        Floating-point results agree to rounding, not bit for bit (``jax.jit`` lets XLA
        fuse and reorder arithmetic), and the rounding is that of the narrowest floating
        type each result's computation passes through, which ``verify`` reads from the
        reference's own trace: a float32 gradient of a model that casts to bfloat16
        before its matmuls is judged at bfloat16's tolerance (``rtol`` 3e-2), one that
        meets only float32 values at float32's (``rtol`` 1e-5), and on a TPU a float32
        matmul at ``DEFAULT`` precision counts as bfloat16. ``atol`` is ``rtol`` times
        the result's largest magnitude (:mod:`pipemark.verification` has the tables).
        Against both references, the report measures how far ``jax.jit`` and eager
        differ from each other per result (the spread), and a result whose references
        differ by more than its tolerance allows is judged at twice that spread.
        Integer results must be equal. ``rtol=0, atol=0`` demands bit equality; other
        numbers set the tolerance of every result.

        Returns a :class:`~pipemark.verification.VerifyReport` (what was compared, with
        which tolerance and why, the largest difference, the jit-eager spread; ``print``
        it for a table). Raises :class:`~pipemark.verification.VerificationError` (a
        :class:`PipemarkError`) naming the first result that differs, where its
        tolerance comes from and how its difference compares with the spread.

        >>> import jax, jax.numpy as jnp, pipemark as pm
        >>> def f(w, x):
        ...     return jnp.sum((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)) ** 2), x * 2
        >>> w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
        >>> report = pm.split(f, w, x, num_stages=1).verify(f, w, x)
        >>> [c.tolerance_from for c in report.checks[:2]], report.comparison
        (['bfloat16', 'float32'], 'within rtol 1e-05, 0.03')
        """
        kinds = (against,) if isinstance(against, str) else tuple(against)
        got = self(*args, **kwargs)
        if isinstance(reference, ClosedJaxpr):
            fn, inputs = jaxpr_as_fun(reference), self._inputs(args, kwargs)
        elif callable(reference):
            signature = self._signature
            if signature is None or signature.is_flat_call(args, kwargs):
                # The reference takes the arguments as given (the flat inputs, say).
                signature = Signature.of(args, kwargs, fn=reference)
            fn, inputs = signature.bind(reference), signature.flatten(args, kwargs)
        else:
            raise PipemarkError(
                f"verify: reference must be a ClosedJaxpr or a callable, got "
                f"{type(reference).__name__}."
            )
        wants = {kind: evaluate_reference(fn, inputs, kind) for kind in kinds}
        where = [self._describe_output(i) for i in range(len(got))]
        compute_types = None
        if rtol is None and atol is None:
            # The reference's own trace, never a rewritten one, says what it computes in.
            traced = reference if isinstance(reference, ClosedJaxpr) else fn
            compute_types = reference_compute_types(traced, inputs)
        report = compare_results(
            got, wants, where, rtol=rtol, atol=atol, compute_types=compute_types
        )
        return raise_on_mismatch(report)

    def _describe_output(self, i: int) -> str:
        ref = self._outputs[i]
        if ref.kind == "stage":
            return f"output {ref.index} of stage {self._stages[ref.stage].name!r}"
        if ref.kind == "input":
            return f"program input {ref.index}"
        return "a constant"

    def export(self, directory: str | os.PathLike) -> ExportedStages:
        """Write each stage to ``directory`` as a serialized ``jax.export.Exported``
        (StableHLO with its calling convention), with a ``manifest.json`` that says
        which outputs feed which inputs, the avals, each stage's role and markers;
        returns the export read back (:func:`pipemark.load_staged` gives an equal one,
        in any process, without the model's code). ``docs/export.md`` describes the
        format.

        The programs are the stages without their markers (lowered to nothing), as the
        runtime compiles them; the loaded callable takes the flat inputs and returns
        the flat results, as calling this program does, computed by the compiled
        stage programs (equal to this program's eager results up to float rounding).

        >>> import tempfile, jax.numpy as jnp, pipemark as pm
        >>> staged = pm.split(lambda x: jnp.cos(jnp.sin(x)), jnp.ones(2), num_stages=2)
        >>> exported = staged.export(tempfile.mkdtemp())
        >>> [stage["name"] for stage in exported.manifest["stages"]]
        ['layer0', 'layer1']
        """
        from pipemark.exported import export_staged

        return export_staged(self, directory)

    # ----------------------------------------------------------------- inspection

    @property
    def graph(self):
        """The stage graph: a ``networkx.DiGraph`` with one node per stage name (node
        attributes ``index`` and ``num_eqns``) and an edge from each stage to every stage
        that reads its outputs (attributes ``refs``: the stage outputs that cross, as
        :class:`ValueRef`; their ``types`` and ``avals``; ``bytes``, ``num_values``
        and ``skip``, True for a skip connection that jumps over stages in between).

        Raises :class:`~pipemark.errors.StageGraphError` naming the stages on a cycle, should
        the stages depend on each other in one.
        """
        from pipemark.graph import stage_graph

        names = [stage.name for stage in self._stages]
        crossings = [
            (names[ref.stage], stage.name, var, ref)
            for stage in self._stages
            for ref, var in zip(stage.inputs, stage.closed_jaxpr.jaxpr.invars)
            if ref.kind == "stage"
        ]
        graph = stage_graph(names, crossings)
        for stage in self._stages:
            graph.nodes[stage.name]["num_eqns"] = stage.num_eqns
        return graph

    def summary(self, *, style: str = "auto", width: int | None = 80) -> str:
        """The stage table: one row per stage with its equations, values in and out,
        FLOPs, parameter bytes, bytes in and out and share of the program's FLOPs, then
        the totals, fitted to ``width`` columns (``None``: every column).

        ``style`` is ``"plain"``, ``"rich"`` or ``"auto"`` (``rich`` when installed);
        see :func:`pipemark.views.summary`.

        >>> import jax, jax.numpy as jnp, pipemark as pm
        >>> cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))
        >>> print(pm.passes.slice_stages(pm.passes.insert_markers(cj, [1])).summary(style="plain"))
        #  stage   eqns  in  out  FLOPs  params  bytes in  bytes out    share
        -  ------  ----  --  ---  -----  ------  --------  ---------  -------
        0  stage0     3   1    1      4     0 B       0 B       16 B   50.0 %
        1  stage1     3   1    1      4     0 B      16 B       16 B   50.0 %
        -  ------  ----  --  ---  -----  ------  --------  ---------  -------
           total      6   2    2      8     0 B      16 B       32 B  100.0 %
        """
        return render("text", self, style=style, width=width)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        """The notebook view: :func:`pipemark.views.to_html`."""
        return render("html", self)
