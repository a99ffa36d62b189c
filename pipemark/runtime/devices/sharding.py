"""Stage programs on sub-meshes: one pipeline stage as an SPMD program over its slice of
the devices, with data parallelism reduced once per step.

Three building blocks, in the order a runtime uses them:

1. :func:`stage_meshes` cuts a ``jax.sharding.Mesh`` with a stage axis (or takes a list
   of meshes) into one sub-mesh per pipeline device slot.
2. :func:`retarget_shardings` rebuilds the model's own sharding annotations (the
   ``NamedSharding`` in ``with_sharding_constraint``, ``device_put``, ``reshard``, the
   shardings JAX records on avals) on a sub-mesh.
3. :func:`compile_stage` jits a stage program over its sub-mesh as ``D`` data-parallel
   replicas (``D`` the size of the data axis) and :attr:`CompiledStage.reduce` sums the
   replicas' gradient accumulators once at the end of a step.

The rules
---------
- **The stage axis is dropped** from every sharding: inside one stage it has no meaning.
- **The pipeline owns the data axis.** A stage with data-axis size ``D`` runs each
  microbatch as ``D`` replicas: ``jax.vmap`` over a leading replica axis, with
  ``spmd_axis_name=data_axis`` so that the replica axis is laid out along ``data``.
  Every value a stage reads from the batch or from another stage carries that leading
  axis (sharded ``P(data_axis)`` on it); parameters are read whole. So a spec in the
  model's program names the data axis for the rows of the *whole* microbatch, while the
  stage program sees the rows of one replica: the data axis is removed from every spec
  (``P("data", "model")`` becomes ``P(None, "model")``) and ``vmap`` puts it back on
  the replica axis.
- **Parameters may be sharded over the data axis (FSDP).** A parameter spec
  (``param_specs``) naming the data axis (``P("data", None)``) keeps each device's
  shard of the parameter between calls; a stage program reads it whole, gathered (an
  all-gather over ``data``) as ``fsdp_gather`` says: ``"once"`` (the default), the
  parameter is gathered once per call, before the stage's first microbatch, and every
  microbatch reads the gathered copy (held until the end of the call); or
  ``"per_microbatch"``, each stage program gathers it itself (the gathered copy lives
  only while one program runs, at the cost of an all-gather per program).
- **Every other axis keeps its name and must keep its size**: a spec naming an axis the
  sub-mesh lacks, or one of another size, is a :class:`~pipemark.errors.PipemarkError`.
- **Delayed reduction** (NVIDIA JaxPP's): gradients accumulate per replica, with a
  leading replica axis sharded ``P(data_axis, *param_spec)``, so no microbatch pays a
  cross-replica all-reduce; :attr:`CompiledStage.reduce` sums the replica axis once
  into the parameter's own sharding (the one all-reduce of a step). The gradient of a
  data-sharded parameter is reduced into its data-sharded spec: with ``"once"`` it
  accumulates per replica (``P(data_axis, *gathered spec)``, a whole gradient per
  device) and ``reduce`` is one reduce-scatter per step; with ``"per_microbatch"``
  each program reduce-scatters its microbatch's gradient into an accumulator sharded
  like the parameter (a shard per device, never a whole gradient), and ``reduce``
  leaves it as it is.
- With ``D == 1`` (no data axis, or one of size 1) there is no replica axis: inputs,
  outputs and accumulators have the shapes of the traced program.
- **A sub-mesh may span processes** (``jax.distributed``): each process that owns some
  of its devices runs the stage's programs on them, and the runtime moves values
  between stages as collectives over both sub-meshes
  (:mod:`pipemark.runtime.devices.transport`).
- Sub-meshes have ``Auto`` axes (``jax.sharding.AxisType.Auto``) whatever the user's
  mesh has: the compiler propagates shardings from the parameters and constraints.
  A program with ``Explicit``-axis shardings is refused.

Example
-------
>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("stage", "data", "model"))
>>> first, second = stage_meshes(mesh, 2)
>>> first.axis_names, first.devices.shape
(('data', 'model'), (2, 2))
>>> def layer(w, x):  # x: one replica's rows of a microbatch
...     h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("data", "model")))
...     return jnp.tanh(h), (h * h).sum()
>>> cj = jax.make_jaxpr(layer)(jnp.ones((3, 6)), jnp.ones((2, 3)))
>>> stage = compile_stage(cj, first, param_specs={0: P(None, "model")},
...                       accumulated=[1], passed=[0])
>>> stage.replicas, stage.passed_shardings[0].spec == P("data")
(2, True)
>>> w = jax.device_put(jnp.ones((3, 6)), stage.in_shardings[0])
>>> x = jax.device_put(jnp.ones((2, 2, 3)), stage.in_shardings[1])  # 2 replicas of 2 rows
>>> accs, (y,) = stage.run(stage.zeros(), [w, x], 1.0)
>>> y.shape, accs[0].shape, [float(s) for s in stage.reduce(accs)]
((2, 2, 6), (2,), [216.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var, jaxpr_as_fun
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from pipemark._compat import eqn_context_mesh, eqn_context_with_mesh, literal_value_with_aval
from pipemark.errors import PipemarkError, check_closed_jaxpr, describe_eqn
from pipemark.runtime.losses import microbatch_share
from pipemark.walk import map_bodies

__all__ = [
    "FSDP_GATHERS",
    "CompiledStage",
    "compile_stage",
    "gathered_spec",
    "retarget_shardings",
    "retarget_spec",
    "stage_meshes",
]


#: How a stage gathers its parameters sharded over the data axis (``fsdp_gather``):
#: once per call for every microbatch, or inside each stage program.
FSDP_GATHERS = ("once", "per_microbatch")


# ------------------------------------------------------------------------ sub-meshes


def stage_meshes(
    mesh: Mesh | Sequence[Mesh], num_stages: int, stage_axis: str = "stage"
) -> tuple[Mesh, ...]:
    """One sub-mesh per pipeline device slot.

    Parameters
    ----------
    mesh:
        A ``Mesh`` with a ``stage_axis`` of size ``num_stages`` (slot ``k`` gets the
        devices at position ``k`` along it, the other axes in order), or a sequence of
        ``num_stages`` meshes, one per slot.
    num_stages:
        The number of pipeline device slots.
    stage_axis:
        The name of the stage axis of ``mesh``.

    Returns
    -------
    The sub-meshes, all with the same axis names and shape (``Auto`` axes), no device
    in two of them. Under ``jax.distributed`` a sub-mesh may span processes: each
    process that owns some of its devices runs the stage's programs on them.

    >>> import jax, numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
    >>> [m.devices.flatten().tolist() for m in stage_meshes(mesh, 2)]
    [[CpuDevice(id=0), CpuDevice(id=1), CpuDevice(id=4), CpuDevice(id=5)], [CpuDevice(id=2), CpuDevice(id=3), CpuDevice(id=6), CpuDevice(id=7)]]
    """
    if isinstance(mesh, Mesh):
        meshes = _split_stage_axis(mesh, num_stages, stage_axis)
    elif isinstance(mesh, Sequence) and all(isinstance(m, Mesh) for m in mesh):
        if len(mesh) != num_stages:
            raise PipemarkError(
                f"{len(mesh)} sub-meshes were given for {num_stages} pipeline device slots; "
                "give one jax.sharding.Mesh per slot."
            )
        meshes = tuple(Mesh(m.devices, m.axis_names) for m in mesh)  # Auto axes
    else:
        raise PipemarkError(
            f"stage_meshes takes a jax.sharding.Mesh with a {stage_axis!r} axis or a list "
            f"of Meshes, got {type(mesh).__name__}."
        )
    _check_sub_meshes(meshes)
    return meshes


def _split_stage_axis(mesh: Mesh, num_stages: int, stage_axis: str) -> tuple[Mesh, ...]:
    names = tuple(mesh.axis_names)
    if stage_axis not in names:
        raise PipemarkError(
            f"The mesh has axes {names} and no stage axis {stage_axis!r}. Name the axis "
            f"along which the pipeline stages lie {stage_axis!r} (e.g. "
            f"Mesh(devices.reshape(stages, data, model), ('{stage_axis}', 'data', 'model'))), "
            "pass stage_axis=, or pass one Mesh per stage."
        )
    position = names.index(stage_axis)
    size = mesh.devices.shape[position]
    if size != num_stages:
        raise PipemarkError(
            f"The mesh's stage axis {stage_axis!r} has size {size} but the pipeline has "
            f"{num_stages} device slots; make the stage axis {num_stages} long."
        )
    others = names[:position] + names[position + 1 :]
    return tuple(Mesh(np.take(mesh.devices, k, axis=position), others) for k in range(size))


def _check_sub_meshes(meshes: Sequence[Mesh]) -> None:
    first = meshes[0]
    owner: dict[Any, int] = {}
    for k, sub in enumerate(meshes):
        if sub.axis_names != first.axis_names or sub.devices.shape != first.devices.shape:
            raise PipemarkError(
                f"Sub-mesh {k} has axes {dict(sub.shape)} but sub-mesh 0 has "
                f"{dict(first.shape)}; every stage's sub-mesh needs the same axis names "
                "and sizes."
            )
        for device in sub.devices.flat:
            if device in owner:
                raise PipemarkError(
                    f"{device} is in sub-mesh {owner[device]} and in sub-mesh {k}; give "
                    "each device to one stage."
                )
            owner[device] = k


# ------------------------------------------------------------ retargeting shardings


def retarget_spec(
    spec: P,
    sizes: Mapping[str, int],
    submesh: Mesh,
    *,
    data_axis: str = "data",
    stage_axis: str = "stage",
    where: str = "A sharding",
) -> P:
    """``spec`` (over a mesh with axis ``sizes``) for ``submesh``: the stage and data
    axes removed, every other axis checked to exist on ``submesh`` with the same size.

    >>> import jax, numpy as np
    >>> sub = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    >>> spec = retarget_spec(P(("stage", "data"), "model"), {"stage": 2, "data": 2, "model": 2}, sub)
    >>> spec == P(None, "model")
    True
    """
    dropped = {stage_axis, data_axis}
    entries = []
    for entry in spec:
        if entry is None or entry is P.UNCONSTRAINED:
            entries.append(entry)
            continue
        names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n not in dropped]
        for name in names:
            if name not in submesh.shape:
                raise PipemarkError(
                    f"{where} shards over axis {name!r}, which the stage's sub-mesh "
                    f"{dict(submesh.shape)} lacks. Name only the sub-mesh's axes (and "
                    f"{stage_axis!r}, {data_axis!r}) in the model's PartitionSpecs."
                )
            if sizes.get(name, submesh.shape[name]) != submesh.shape[name]:
                raise PipemarkError(
                    f"{where} shards over axis {name!r} of size {sizes[name]}, but the "
                    f"stage's sub-mesh has it of size {submesh.shape[name]}. Build the "
                    "model's mesh with the sub-mesh's axis sizes."
                )
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return P(*entries)


def gathered_spec(spec: P, data_axis: str = "data") -> P:
    """``spec`` with ``data_axis`` left out: how a parameter sharded over the data axis
    (FSDP) is laid out once gathered, as the stage program reads it.

    >>> gathered_spec(P("data", "model")) == P(None, "model")
    True
    >>> gathered_spec(P(("data", "model"), None)) == P("model", None)
    True
    """
    entries = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n != data_axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


def _names_axis(spec: P, axis: str) -> bool:
    return any(
        axis in (entry if isinstance(entry, tuple) else (entry,))
        for entry in spec
        if entry is not None
    )


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where shardings are rebuilt, and what to say when one cannot be."""

    submesh: Mesh
    data_axis: str
    stage_axis: str

    def mesh(self, mesh: Any, where: str) -> Any:
        if mesh.empty:
            return mesh
        if any(t == AxisType.Explicit for t in mesh.axis_types):
            raise PipemarkError(
                f"{where} uses a mesh with Explicit axes {mesh.axis_names}; stage programs "
                "support Auto axes only for now. Build the mesh with "
                "axis_types=(jax.sharding.AxisType.Auto, ...) and shard with "
                "jax.lax.with_sharding_constraint."
            )
        return self.submesh.abstract_mesh if isinstance(mesh, AbstractMesh) else self.submesh

    def sharding(self, sharding: NamedSharding, where: str) -> NamedSharding:
        if sharding.mesh.empty:  # nothing to rebuild
            return sharding
        mesh = self.mesh(sharding.mesh, where)
        spec = retarget_spec(
            sharding.spec,
            dict(sharding.mesh.shape),
            self.submesh,
            data_axis=self.data_axis,
            stage_axis=self.stage_axis,
            where=where,
        )
        return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)

    def value(self, value: Any, where: str) -> Any:
        """A parameter value with every mesh and NamedSharding in it rebuilt."""
        if isinstance(value, NamedSharding):
            return self.sharding(value, where)
        if isinstance(value, (Mesh, AbstractMesh)):
            return self.mesh(value, where)
        if isinstance(value, (tuple, list)):
            items = [self.value(item, where) for item in value]
            same = all(a is b for a, b in zip(items, value))
            return value if same else type(value)(items)
        if isinstance(value, (Sharding, jax.Device)):
            raise PipemarkError(
                f"{where} places a value with {value!r}, which a stage on a sub-mesh cannot "
                "honour. Use a jax.sharding.NamedSharding over the model's mesh."
            )
        return value

    def aval(self, aval: Any) -> Any:
        sharding = getattr(aval, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            return aval
        return aval.update(sharding=self.sharding(sharding, f"A value of type {aval}"))


def retarget_shardings(
    closed: ClosedJaxpr,
    submesh: Mesh,
    *,
    data_axis: str = "data",
    stage_axis: str = "stage",
) -> ClosedJaxpr:
    """``closed`` with every sharding the model gave rebuilt on ``submesh``.

    Every ``NamedSharding`` and mesh in an equation's parameters and context (the mesh
    it was traced under) (the ``sharding`` and
    ``context_mesh`` of ``sharding_constraint``, ``device_put``'s ``devices``/``srcs``,
    ``reshard``'s ``dst_sharding``, ``broadcast_in_dim``'s ``sharding``...) and on the
    avals of its values, in sub-jaxprs too, is rebuilt on ``submesh`` (a concrete mesh
    on ``submesh``, an abstract one on ``submesh.abstract_mesh``) with the same spec,
    less the stage and data axes (see the module docstring for why). The input is left
    untouched.

    Raises
    ------
    PipemarkError
        Naming the equation: a spec naming an axis ``submesh`` lacks or has of another
        size, a mesh with ``Explicit`` axes, a placement on one device or another kind
        of sharding, or a ``shard_map`` (not supported in stage programs yet).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("stage", "data", "model"))
    >>> sub = stage_meshes(mesh, 2)[1]
    >>> cj = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(
    ...     x, NamedSharding(mesh, P("data", "model"))))(jnp.ones((4, 4)))
    >>> new = retarget_shardings(cj, sub).eqns[0].params["sharding"]
    >>> new.mesh is sub, new.spec == P(None, "model")
    (True, True)
    """
    check_closed_jaxpr(closed, "retarget_shardings")
    target = _Target(submesh, data_axis, stage_axis)
    new = _retarget_jaxpr(closed.jaxpr, target)
    return closed if new is closed.jaxpr else ClosedJaxpr(new, closed.consts)


def _retarget_jaxpr(jaxpr: Jaxpr, target: _Target) -> Jaxpr:
    renamed: dict[Var, Var] = {}  # values whose aval carried a sharding, with their new var

    def bind(var: Any) -> Any:
        aval = target.aval(var.aval)
        if aval is var.aval:
            return var
        new = DropVar(aval) if type(var) is DropVar else Var(aval)
        renamed[var] = new
        return new

    def read(atom: Any) -> Any:
        if type(atom) is not Literal:
            return renamed.get(atom, atom)
        # JAX 0.12 types literals under the mesh they were traced under, too.
        aval = target.aval(atom.aval)
        return atom if aval is atom.aval else Literal(literal_value_with_aval(atom.val, aval), aval)

    constvars = [bind(v) for v in jaxpr.constvars]
    invars = [bind(v) for v in jaxpr.invars]
    eqns = []
    changed = False
    for index, eqn in enumerate(jaxpr.eqns):
        new = _retarget_eqn(eqn, index, target, read, bind)
        changed |= new is not eqn
        eqns.append(new)
    outvars = [read(v) for v in jaxpr.outvars]
    if not changed and not renamed:
        return jaxpr
    return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns, outvars=outvars)


def _retarget_eqn(
    eqn: JaxprEqn,
    index: int,
    target: _Target,
    read: Callable[[Any], Any],
    bind: Callable[[Any], Any],
) -> JaxprEqn:
    where = describe_eqn(eqn, index)
    if eqn.primitive.name == "shard_map":
        raise PipemarkError(
            f"{where} is a shard_map; stage programs on sub-meshes do not support "
            "shard_map yet. Write the layer with jax.lax.with_sharding_constraint instead."
        )
    params = {name: target.value(value, where) for name, value in eqn.params.items()}
    if any(params[name] is not value for name, value in eqn.params.items()):
        eqn = eqn.replace(params=params)
    # Evaluating an equation enters the mesh it was traced under (set_mesh): the user's.
    traced_under = eqn_context_mesh(eqn.ctx)
    if not traced_under.empty:
        eqn = eqn.replace(ctx=eqn_context_with_mesh(eqn.ctx, target.mesh(traced_under, where)))
    eqn = map_bodies(eqn, lambda body: _retarget_jaxpr(body, target))
    invars = [read(a) for a in eqn.invars]
    outvars = [bind(v) for v in eqn.outvars]
    if all(a is b for a, b in zip(invars, eqn.invars)) and all(
        a is b for a, b in zip(outvars, eqn.outvars)
    ):
        return eqn
    return eqn.replace(invars=invars, outvars=outvars)


# ------------------------------------------------------------------ stage programs


@dataclasses.dataclass(frozen=True)
class CompiledStage:
    """A stage program compiled for its sub-mesh (made by :func:`compile_stage`).

    Attributes
    ----------
    run:
        ``run(accs, inputs, scale) -> (new accs, passed outputs)``: one microbatch. Each
        accumulator gets ``scale`` times its output added (for a mean loss pass
        ``scale = 1 / (num_microbatches * replicas)``, for a sum 1). The accumulators
        are donated: do not read ``accs`` after the call.
    zeros:
        ``zeros() -> accs``: fresh accumulators, on the sub-mesh; ``None`` when the
        stage accumulates nothing.
    reduce:
        ``reduce(accs) -> sums``: the replica axis summed, each sum in its own
        sharding (``accumulated_shardings``: a reduce-scatter for a data-sharded
        one); the accumulators themselves when ``replicas == 1``, and those already
        reduced per microbatch (``fsdp_gather="per_microbatch"``).
    replicas:
        ``D``, the size of the sub-mesh's data axis (1 without one).
    in_shardings:
        Where each input of ``run`` must be (parameters with their spec, a
        data-sharded one gathered when ``fsdp_gather="once"``; other inputs with a
        leading replica axis ``P(data_axis)`` when ``replicas > 1``).
    passed_shardings:
        The layout a passed output is placed in to cross to another process. ``run``
        itself takes per-microbatch inputs in any layout on the sub-mesh and gives its
        passed outputs the layout the compiler chooses (split over ``model`` where the
        program splits them), so a residual a forward hands its backward is never
        gathered.
    accumulator_shardings, accumulated_shardings:
        Where each accumulator lives (``P(data_axis, *spec)``, or ``spec`` where each
        microbatch is reduced into it) and where its sum goes (``spec``).
    """

    run: Callable[[list[Any], list[Any], Any], tuple[list[Any], list[Any]]]
    zeros: Callable[[], list[Any]] | None
    reduce: Callable[[list[Any]], list[Any]]
    replicas: int
    submesh: Mesh
    in_shardings: tuple[NamedSharding, ...]
    passed_shardings: tuple[NamedSharding, ...]
    accumulator_shardings: tuple[NamedSharding, ...]
    accumulated_shardings: tuple[NamedSharding, ...]
    #: Per accumulator: whether it has a leading replica axis (``reduce`` sums it).
    per_replica: tuple[bool, ...] = ()


def compile_stage(
    closed: ClosedJaxpr,
    submesh: Mesh,
    *,
    param_specs: Mapping[int, P],
    accumulated: Sequence[int],
    passed: Sequence[int],
    accumulated_specs: Sequence[P] | None = None,
    data_axis: str = "data",
    stage_axis: str = "stage",
    fsdp_gather: str = "once",
) -> CompiledStage:
    """Jit the stage program ``closed`` over ``submesh``, as ``replicas`` data-parallel
    replicas of it when the sub-mesh has a data axis longer than 1.

    Parameters
    ----------
    closed:
        The stage program, traced for one replica's rows of a microbatch (``B / (M D)``
        rows of a batch of ``B`` in ``M`` microbatches); its shardings are rebuilt by
        :func:`retarget_shardings`.
    submesh:
        The stage's sub-mesh (:func:`stage_meshes`).
    param_specs:
        Input index -> ``PartitionSpec`` on ``submesh`` of each input that is a
        parameter (read whole by every replica; one naming the data axis is gathered
        first, see ``fsdp_gather``). Every other input is per-microbatch (the batch or
        another stage's value) and gets the replica axis.
    accumulated:
        Output indices summed over microbatches (the loss and gradients).
    passed:
        Output indices other stages read.
    accumulated_specs:
        The ``PartitionSpec`` of each accumulated output's sum (a gradient's is its
        parameter's); replicated when ``None``.
    data_axis, stage_axis:
        The axis names (see the module docstring).
    fsdp_gather:
        One of :data:`FSDP_GATHERS` (see the module docstring): ``"once"``, ``run``
        takes data-sharded parameters gathered (``in_shardings``) and accumulates
        their gradients per replica; ``"per_microbatch"``, ``run`` takes them sharded,
        gathers them itself and reduce-scatters each microbatch's gradient.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> sub = Mesh(np.array(jax.devices()[:2]), ("data",))
    >>> cj = jax.make_jaxpr(lambda w, x: (x @ w).sum())(jnp.ones((4, 3)), jnp.ones((1, 4)))
    >>> stage = compile_stage(cj, sub, param_specs={0: P("data", None)}, accumulated=[0],
    ...                       passed=[], accumulated_specs=[P()], fsdp_gather="per_microbatch")
    >>> stage.in_shardings[0].spec == P("data", None)
    True
    """
    check_closed_jaxpr(closed, "compile_stage")
    if fsdp_gather not in FSDP_GATHERS:
        raise PipemarkError(
            f"fsdp_gather is {fsdp_gather!r}; use one of {FSDP_GATHERS}: gather the "
            "parameters sharded over the data axis once per call, or in every program."
        )
    program = retarget_shardings(closed, submesh, data_axis=data_axis, stage_axis=stage_axis)
    _check_indices(program, param_specs, accumulated, passed, accumulated_specs)
    replicas = int(submesh.shape.get(data_axis, 1))
    replicated = replicas > 1
    params = {i: _param_spec(s, f"input {i}", submesh) for i, s in param_specs.items()}
    sum_specs = [
        _param_spec(s, f"accumulated output {o}", submesh)
        for o, s in zip(accumulated, accumulated_specs or [P()] * len(accumulated))
    ]
    layout = _stage_layout(
        submesh, params, sum_specs, len(program.jaxpr.invars), data_axis, fsdp_gather
    )
    in_shardings, acc_shardings, per_replica = (
        layout.inputs,
        layout.accumulators,
        layout.per_replica,
    )
    sum_shardings = tuple(NamedSharding(submesh, s) for s in sum_specs)
    per_microbatch = NamedSharding(submesh, P(data_axis) if replicated else P())
    passed_shardings = (per_microbatch,) * len(passed)
    fun = _replicated(program, params, replicas if replicated else 0, data_axis)
    fun = _gathering(fun, layout.gathers)
    # A value handed between stages keeps the layout its program gives it (along data on
    # the replica axis, and split over model where the program splits it): pinning it
    # to P(data) would gather the model shards of every residual and weight a forward
    # hands its backward, inside every action. So per-microbatch inputs and passed
    # outputs are left to the compiler; in_shardings/passed_shardings stay the layout a
    # microbatch is placed in.
    loose_in = tuple(s if i in params else None for i, s in enumerate(in_shardings))
    reduced = [replicated and not r for r in per_replica]  # summed over replicas by run
    run = _runner(
        fun, accumulated, passed, (acc_shardings, loose_in, (None,) * len(passed)), reduced
    )
    avals = [program.jaxpr.outvars[o].aval for o in accumulated]
    shapes = [((replicas, *a.shape) if r else a.shape, a.dtype) for a, r in zip(avals, per_replica)]
    zeros = None
    if accumulated:

        def make_zeros() -> list[Any]:
            return [jnp.zeros(shape, dtype) for shape, dtype in shapes]

        zeros = jax.jit(make_zeros, out_shardings=list(acc_shardings))
    return CompiledStage(
        run=run,
        zeros=zeros,
        reduce=_reducer(acc_shardings, sum_shardings, per_replica) if replicated else list,
        replicas=replicas,
        submesh=submesh,
        in_shardings=in_shardings,
        passed_shardings=passed_shardings,
        accumulator_shardings=acc_shardings,
        accumulated_shardings=sum_shardings,
        per_replica=per_replica,
    )


class _Layout(NamedTuple):
    """Where a stage program's inputs and accumulators lie on its sub-mesh."""

    inputs: tuple[NamedSharding, ...]
    accumulators: tuple[NamedSharding, ...]
    #: Per accumulator: whether it keeps a replica axis until ``reduce``.
    per_replica: tuple[bool, ...]
    #: The data-sharded parameters the program gathers itself, and how.
    gathers: dict[int, NamedSharding]


def _stage_layout(
    submesh: Mesh,
    params: Mapping[int, P],
    sum_specs: Sequence[P],
    num_inputs: int,
    data_axis: str,
    fsdp_gather: str,
) -> _Layout:
    replicated = int(submesh.shape.get(data_axis, 1)) > 1
    once = fsdp_gather == "once"

    def on_mesh(spec: P) -> NamedSharding:
        return NamedSharding(submesh, spec)

    per_microbatch = on_mesh(P(data_axis) if replicated else P())
    # Gathered once per call, a data-sharded parameter reaches the program whole.
    read = {i: gathered_spec(s, data_axis) if once else s for i, s in params.items()}
    inputs = tuple(on_mesh(read[i]) if i in read else per_microbatch for i in range(num_inputs))
    # An accumulator keeps a replica axis until reduce, but a data-sharded gradient
    # gathered per microbatch: it is reduce-scattered each microbatch, so that no device
    # holds a whole gradient (the memory "per_microbatch" is chosen to save).
    per_replica = tuple(replicated and (once or not _names_axis(s, data_axis)) for s in sum_specs)
    accumulators = tuple(
        on_mesh(P(data_axis, *gathered_spec(s, data_axis)) if r else s)
        for s, r in zip(sum_specs, per_replica)
    )
    gathers = {} if once else {i: on_mesh(gathered_spec(s, data_axis)) for i, s in params.items()}
    return _Layout(inputs, accumulators, per_replica, gathers)


def _check_indices(
    program: ClosedJaxpr,
    param_specs: Mapping[int, P],
    accumulated: Sequence[int],
    passed: Sequence[int],
    accumulated_specs: Sequence[P] | None,
) -> None:
    num_in, num_out = len(program.jaxpr.invars), len(program.jaxpr.outvars)
    for what, indices, count in (
        ("param_specs", list(param_specs), num_in),
        ("accumulated", accumulated, num_out),
        ("passed", passed, num_out),
    ):
        bad = [i for i in indices if not isinstance(i, int) or not 0 <= i < count]
        if bad:
            raise PipemarkError(
                f"compile_stage: {what} names {bad}, but the stage program has {count} "
                f"{'inputs' if what == 'param_specs' else 'outputs'}; use indices "
                f"0..{count - 1}."
            )
    if accumulated_specs is not None and len(accumulated_specs) != len(accumulated):
        raise PipemarkError(
            f"compile_stage: {len(accumulated_specs)} accumulated_specs for "
            f"{len(accumulated)} accumulated outputs; give one PartitionSpec each."
        )


def _param_spec(spec: Any, what: str, submesh: Mesh) -> P:
    """``spec`` checked: a PartitionSpec over ``submesh``'s axes (the data axis among
    them: a parameter sharded over it is gathered, see the module docstring)."""
    if not isinstance(spec, P):
        raise PipemarkError(
            f"compile_stage: the spec of {what} is {spec!r}; give a "
            "jax.sharding.PartitionSpec over the sub-mesh's axes."
        )
    for entry in spec:
        if entry is None:
            continue
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name not in submesh.shape:
                raise PipemarkError(
                    f"compile_stage: the spec {spec} of {what} names axis {name!r}, which "
                    f"the sub-mesh {dict(submesh.shape)} lacks."
                )
    return spec


def _replicated(
    program: ClosedJaxpr, params: Mapping[int, P], replicas: int, data_axis: str
) -> Callable[..., list[Any]]:
    """The program as a function of its flat inputs; with ``replicas``, mapped over a
    leading replica axis of every input but the parameters, laid out along the data
    axis (``spmd_axis_name``) so the model's own constraints shard the replica axis."""
    fun = jaxpr_as_fun(program)
    if not replicas:
        return fun
    in_axes = tuple(None if i in params else 0 for i in range(len(program.jaxpr.invars)))
    return jax.vmap(fun, in_axes=in_axes, axis_size=replicas, spmd_axis_name=data_axis)


def _gathering(
    fun: Callable[..., list[Any]], gathers: Mapping[int, NamedSharding]
) -> Callable[..., list[Any]]:
    """``fun`` reading each input in ``gathers`` (a parameter sharded over the data
    axis) gathered into its sharding there first: an all-gather in the program, whose
    result XLA frees once the program no longer reads it."""
    if not gathers:
        return fun

    def gathered(*inputs: Any) -> list[Any]:
        inputs = tuple(
            jax.lax.with_sharding_constraint(x, gathers[i]) if i in gathers else x
            for i, x in enumerate(inputs)
        )
        return fun(*inputs)

    return gathered


def _runner(
    fun: Callable[..., list[Any]],
    accumulated: Sequence[int],
    passed: Sequence[int],
    shardings: tuple[tuple[NamedSharding | None, ...], ...],
    reduced: Sequence[bool],
) -> Callable[[list[Any], list[Any], Any], tuple[list[Any], list[Any]]]:
    acc_shardings, in_shardings, passed_shardings = shardings
    scale_sharding = NamedSharding(acc_shardings[0].mesh, P()) if acc_shardings else None

    def run(accs: list[Any], inputs: list[Any], scale: Any) -> tuple[list[Any], list[Any]]:
        # scale is an argument so that one compiled program serves every number of
        # microbatches and replicas (1/(M*D) for a mean, 1 for a sum).
        outs = fun(*inputs)
        shares = [microbatch_share(outs[o], scale) for o in accumulated]
        # An accumulator without a replica axis (a data-sharded gradient, reduced per
        # microbatch) gets the replicas' sum: a reduce-scatter into its sharding.
        shares = [v.sum(axis=0, dtype=v.dtype) if r else v for v, r in zip(shares, reduced)]
        new = [acc + share for acc, share in zip(accs, shares)]
        return new, [outs[o] for o in passed]

    return jax.jit(
        run,
        in_shardings=(list(acc_shardings), list(in_shardings), scale_sharding),
        out_shardings=(list(acc_shardings), list(passed_shardings)),
        donate_argnums=0,  # the accumulators: updated in place, no second copy
    )


def _reducer(
    acc_shardings: tuple[NamedSharding, ...],
    sum_shardings: tuple[NamedSharding, ...],
    per_replica: Sequence[bool],
) -> Callable[[list[Any]], list[Any]]:
    """The one cross-replica reduction of a step: each accumulator's replica axis summed
    into its own sharding (a reduce-scatter where that is sharded over the data axis);
    an accumulator without one (reduced per microbatch) as it is."""

    def reduce(accs: list[Any]) -> list[Any]:
        return [acc.sum(axis=0, dtype=acc.dtype) if r else acc for acc, r in zip(accs, per_replica)]

    return jax.jit(reduce, in_shardings=(list(acc_shardings),), out_shardings=list(sum_shardings))
