"""Tests for pipemark.runtime.devices.sharding: sub-meshes, retargeted shardings and stage
programs compiled over sub-meshes with data parallelism reduced once.

The equivalence tests run a tensor-parallel MLP's training step cut into 2 stages, each
on one half of a (stage 2, data 2, model 2) mesh of the 8 host CPU devices (conftest.py),
and compare loss and gradients with ``jax.jit(jax.value_and_grad(loss))`` of the same
model on a (data 2, model 2) mesh: JAX's own evaluation, never pipemark's.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import check_jaxpr, jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark.errors import PipemarkError
from pipemark.passes.stages import pair_stages
from pipemark.runtime.devices.sharding import (
    compile_stage,
    gathered_spec,
    retarget_shardings,
    retarget_spec,
    stage_meshes,
)
from pipemark.staging import split_jaxpr
from pipemark.walk import iter_eqns
from tests._trees import assert_trees_within_ulps

ROWS, WIDTH, HIDDEN = 8, 4, 8  # the batch of one step (one microbatch), layer sizes


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], first: int = 0) -> Mesh:
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[first : first + count]).reshape(shape), names)


# --------------------------------------------------------------------------- the model

PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def _mlp(annotate):
    """A 2-layer tensor-parallel MLP (column- then row-parallel) with a boundary marker
    between the layers; ``annotate(x, spec)`` pins an activation's sharding."""

    def loss(params, batch):
        x, y = batch
        h = annotate(x @ params["w1"] + params["b1"], P("data", "model"))
        h = jnp.tanh(h)
        pm.mark_pipeline_boundary()
        out = annotate(h @ params["w2"] + params["b2"], P("data", None))
        return jnp.mean((jnp.tanh(out) - y) ** 2)

    return loss


def _annotations(style: str, mesh: Mesh):
    """How the model pins shardings: a NamedSharding over ``mesh``, or a bare spec
    under ``jax.sharding.set_mesh(mesh)`` (then tracing must run under it too)."""
    if style == "named":
        return lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    if style == "device_put":
        return lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    return lambda x, spec: lax.with_sharding_constraint(x, spec)


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(WIDTH, HIDDEN)).astype(np.float32) / 2,
        "b1": rng.normal(size=(HIDDEN,)).astype(np.float32) / 10,
        "w2": rng.normal(size=(HIDDEN, WIDTH)).astype(np.float32) / 3,
        "b2": rng.normal(size=(WIDTH,)).astype(np.float32) / 10,
    }
    batch = (
        rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
    )
    return params, batch


def _reference(loss, params, batch, mesh: Mesh, under_mesh: bool):
    """``jax.jit(jax.value_and_grad(loss))`` with the parameters sharded by their specs
    and the batch by rows over ``data``."""
    param_shardings = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS.items()}
    rows = NamedSharding(mesh, P("data"))
    step = jax.jit(jax.value_and_grad(loss), in_shardings=(param_shardings, (rows, rows)))
    if under_mesh:
        with jax.sharding.set_mesh(mesh):
            return step(params, batch)
    return step(params, batch)


# ------------------------------------------------------------------ a tiny pipeline


def _staged_step(loss, params, batch, replicas: int, mesh: Mesh | None):
    """The training step for one replica's rows, cut at the model's boundary marker."""
    structs = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // replicas, *a.shape[1:]), a.dtype), batch
    )
    if mesh is not None:
        with jax.sharding.set_mesh(mesh):
            cj = jax.make_jaxpr(jax.value_and_grad(loss))(params, structs)
    else:
        cj = jax.make_jaxpr(jax.value_and_grad(loss))(params, structs)
    return split_jaxpr(cj)


def _compile(staged, index: int, sub: Mesh, specs: list, passed: list[int]):
    """``compile_stage`` of stage ``index`` on ``sub``: the parameters it reads (the
    first program inputs, one per leaf of ``specs``) laid out by their specs, the
    program results it computes accumulated (result 0, the loss, replicated; result
    ``r`` the gradient of parameter ``r - 1``); and those results' ``(result, output)``
    pairs."""
    stage = staged.stages[index]
    param_specs = {
        i: specs[ref.index]
        for i, ref in enumerate(stage.inputs)
        if ref.kind == "input" and ref.index < len(specs)
    }
    accumulated = [
        (r, ref.index)
        for r, ref in enumerate(staged.outputs)
        if ref.kind == "stage" and ref.stage == index
    ]
    compiled = compile_stage(
        stage.closed_jaxpr,
        sub,
        param_specs=param_specs,
        accumulated=[o for _, o in accumulated],
        passed=passed,
        accumulated_specs=[P() if r == 0 else specs[r - 1] for r, _ in accumulated],
    )
    return compiled, accumulated


def _run_pipeline(staged, subs, params, batch, *, replicas):
    """Run the stages one after another, each compiled with compile_stage on the
    sub-mesh of its pipeline stage, moving values between sub-meshes with device_put;
    return the loss and gradients (reduced) as a flat list."""
    leaves = jax.tree_util.tree_leaves(params)
    specs = jax.tree_util.tree_leaves(
        {k: PARAM_SPECS[k] for k in params}, is_leaf=lambda s: isinstance(s, P)
    )
    batch_leaves = jax.tree_util.tree_leaves(batch)
    forward, backward, _ = pair_stages(staged)
    owner = {s: k for k, pair in enumerate(zip(forward, backward)) for s in pair if s is not None}
    results: list = [None] * len(staged.outputs)
    values: dict = {}
    for index, stage in enumerate(staged.stages):
        sub = subs[owner[index]]
        readers = {(ref.stage, ref.index) for s in staged.stages for ref in s.inputs}
        passed = [o for o in range(len(stage.out_avals)) if (index, o) in readers]
        compiled, accumulated = _compile(staged, index, sub, specs, passed)
        assert compiled.replicas == replicas
        inputs = []
        for i, ref in enumerate(stage.inputs):
            if ref.kind == "stage":
                value = values[(ref.stage, ref.index)]
            elif ref.index < len(leaves):
                value = leaves[ref.index]
            else:
                value = batch_leaves[ref.index - len(leaves)]
                if replicas > 1:  # one replica's rows each
                    value = value.reshape(replicas, -1, *value.shape[1:])
            inputs.append(jax.device_put(value, compiled.in_shardings[i]))
        zeros = compiled.zeros() if compiled.zeros else []
        accs, outs = compiled.run(zeros, inputs, 1.0 / replicas)
        for o, value in zip(passed, outs):
            values[(index, o)] = value
        for (r, _), total in zip(accumulated, compiled.reduce(accs)):
            results[r] = total
    return results


def _assert_close(results, reference):
    expected = jax.tree_util.tree_leaves(reference)
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style", ["named", "bare_spec", "device_put"])
@pytest.mark.parametrize("model_mesh", ["sub_mesh_shaped", "full"])
def test_two_stages_data_and_tensor_parallel_match_jit(style, model_mesh):
    full = _mesh((2, 2, 2), ("stage", "data", "model"))
    reference_mesh = _mesh((2, 2), ("data", "model"))
    annotated_mesh = full if model_mesh == "full" else reference_mesh
    loss = _mlp(_annotations(style, annotated_mesh))
    params, batch = _data()
    under_mesh = style == "bare_spec"
    # With shardings over the full mesh the reference runs on all 8 devices (the stage
    # axis replicates).
    reference = _reference(loss, params, batch, annotated_mesh, under_mesh)
    staged = _staged_step(loss, params, batch, 2, annotated_mesh if under_mesh else None)
    assert len(staged.stages) == 4
    results = _run_pipeline(staged, stage_meshes(full, 2), params, batch, replicas=2)
    _assert_close(results, reference)


def test_one_replica_without_a_data_axis_matches_jit():
    full = _mesh((2, 2), ("stage", "model"))
    reference_mesh = _mesh((1, 2), ("data", "model"))
    loss = _mlp(_annotations("named", reference_mesh))
    params, batch = _data(1)
    reference = _reference(loss, params, batch, reference_mesh, False)
    staged = _staged_step(loss, params, batch, 1, None)
    subs = stage_meshes(full, 2)
    assert subs[0].axis_names == ("model",)
    results = _run_pipeline(staged, subs, params, batch, replicas=1)
    _assert_close(results, reference)


def test_list_of_sub_meshes_matches_jit():
    full = _mesh((2, 2, 2), ("stage", "data", "model"))
    reference_mesh = _mesh((2, 2), ("data", "model"))
    subs = [Mesh(full.devices[1], ("data", "model")), Mesh(full.devices[0], ("data", "model"))]
    loss = _mlp(_annotations("named", reference_mesh))
    params, batch = _data(2)
    staged = _staged_step(loss, params, batch, 2, None)
    results = _run_pipeline(staged, stage_meshes(subs, 2), params, batch, replicas=2)
    _assert_close(results, _reference(loss, params, batch, reference_mesh, False))


# ------------------------------------------------------------------- all-reduce counts


def _all_reduce_groups(text: str) -> list[list[list[int]]]:
    """The replica groups (device positions) of each all-reduce in compiled HLO text, in
    any of XLA's notations: explicit ``{{0,2},{1,3}}``, iota ``[2,2]<=[2,2]T(1,0)`` or
    mesh axes ``mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``."""
    found = []
    for line in text.splitlines():
        if not re.search(r"\ball-reduce(-start)?\(", line):
            continue
        explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
        iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        axes = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        if explicit:
            groups = [
                [int(i) for i in g.split(",") if i]
                for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))
            ]
        elif iota:
            shape = [int(i) for i in iota.group(1).split(",")]
            dims = [int(i) for i in iota.group(2).split(",")]
            ids = np.arange(int(np.prod(dims))).reshape(dims)
            if iota.group(3):
                ids = ids.transpose([int(i) for i in iota.group(3).split(",")])
            groups = ids.reshape(shape).tolist()
        elif axes:
            sizes = dict(re.findall(r"'(\w+)'=(\d+)", axes.group(1)))
            names = list(sizes)
            reduced = [names.index(n) for n in re.findall(r"'(\w+)'", axes.group(2))]
            kept = [k for k in range(len(names)) if k not in reduced]
            ids = np.arange(int(np.prod([int(v) for v in sizes.values()])))
            ids = ids.reshape([int(v) for v in sizes.values()]).transpose(kept + reduced)
            size = int(np.prod([int(sizes[names[k]]) for k in reduced]))
            groups = ids.reshape(-1, size).tolist()
        else:
            raise AssertionError(f"replica groups in a notation this test cannot read: {line}")
        found.append(groups)
    return found


def _crosses_data(groups: list[list[int]], model_size: int) -> bool:
    """Whether some group holds devices of two data rows (device ids data-major)."""
    return any(len({i // model_size for i in group}) > 1 for group in groups)


@pytest.mark.parametrize("model", [1, 2])
def test_stage_programs_do_not_all_reduce_over_data(model):
    full = _mesh((2, 2, model), ("stage", "data", "model"))
    reference_mesh = _mesh((2, model), ("data", "model"))
    loss = _mlp(_annotations("named", reference_mesh))
    params, batch = _data(3)
    staged = _staged_step(loss, params, batch, 2, None)
    subs = stage_meshes(full, 2)
    specs = jax.tree_util.tree_leaves(PARAM_SPECS, is_leaf=lambda s: isinstance(s, P))
    forward, backward, _ = pair_stages(staged)
    reduce_texts = []
    for k, (f, b) in enumerate(zip(forward, backward)):
        for index in (f, b):
            stage = staged.stages[index]
            passed = list(range(len(stage.out_avals)))
            compiled, accumulated = _compile(staged, index, subs[k], specs, passed)
            args = _abstract_args(compiled, stage)
            text = compiled.run.lower(*args).compile().as_text()
            groups = _all_reduce_groups(text)
            if model == 1:
                assert groups == [], f"stage {stage.name} all-reduces: {groups}"
            assert not any(_crosses_data(g, model) for g in groups), stage.name
            if accumulated:
                zeros = compiled.zeros()
                reduce_texts.append(compiled.reduce.lower(zeros).compile().as_text())
    assert reduce_texts
    for text in reduce_texts:
        groups = _all_reduce_groups(text)
        assert groups and all(_crosses_data(g, model) for g in groups)


def _abstract_args(compiled, stage):
    accs = [
        jax.ShapeDtypeStruct(z.shape, z.dtype, sharding=s)
        for z, s in zip(compiled.zeros() if compiled.zeros else [], compiled.accumulator_shardings)
    ]
    inputs = []
    for var, sharding in zip(stage.closed_jaxpr.jaxpr.invars, compiled.in_shardings):
        shape = var.aval.shape
        if sharding.spec == P("data"):
            shape = (compiled.replicas, *shape)
        inputs.append(jax.ShapeDtypeStruct(shape, var.aval.dtype, sharding=sharding))
    return accs, inputs, jax.ShapeDtypeStruct((), jnp.float32)


def test_naive_data_parallel_stage_all_reduces_every_microbatch():
    """The check above can fail: the backward stage traced for the whole microbatch,
    its rows sharded over data and its gradients out in the parameters' (replicated)
    sharding, all-reduces over data inside the stage program."""
    full = _mesh((2, 2, 1), ("stage", "data", "model"))
    reference_mesh = _mesh((2, 1), ("data", "model"))
    loss = _mlp(_annotations("named", reference_mesh))
    params, batch = _data(4)
    staged = _staged_step(loss, params, batch, 1, None)  # all rows in one program
    sub = stage_meshes(full, 2)[0]
    _, backward, _ = pair_stages(staged)
    stage = staged.stages[backward[0]]
    # The model's constraints keep their data axis: its mesh is the stage's sub-mesh.
    assert sub.devices.tolist() == reference_mesh.devices.tolist()
    grads = [
        ref.index for ref in staged.outputs if ref.kind == "stage" and ref.stage == backward[0]
    ]
    leaves = len(jax.tree_util.tree_leaves(params))
    in_shardings = [
        NamedSharding(sub, P() if ref.kind == "input" and ref.index < leaves else P("data"))
        for ref in stage.inputs
    ]
    fun = jaxpr_as_fun(stage.closed_jaxpr)
    naive = jax.jit(
        lambda *xs: [fun(*xs)[o] for o in grads],
        in_shardings=in_shardings,
        out_shardings=[NamedSharding(sub, P())] * len(grads),
    )
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
        for v, s in zip(stage.closed_jaxpr.jaxpr.invars, in_shardings)
    ]
    groups = _all_reduce_groups(naive.lower(*args).compile().as_text())
    assert any(_crosses_data(g, 1) for g in groups)


# --------------------------------------------------------------------- retargeting


def test_retarget_is_pure_and_recursive_and_checks():
    full = _mesh((2, 2, 2), ("stage", "data", "model"))
    sub = stage_meshes(full, 2)[1]

    def body(carry, _):
        carry = lax.with_sharding_constraint(carry, NamedSharding(full, P("data", "model")))
        return jnp.sin(carry), None

    @jax.checkpoint
    def f(x):
        y = jax.jit(lambda v: lax.scan(body, v, None, length=2)[0])(x)
        return jax.device_put(y, NamedSharding(full, P(("stage", "data"), None)))

    cj = jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(jnp.ones((4, 4)))
    before = str(cj)
    new = retarget_shardings(cj, sub)
    assert str(cj) == before
    check_jaxpr(new.jaxpr)
    shardings = _shardings(new)
    assert {"sharding_constraint", "device_put"} <= {name for name, _ in shardings}
    for name, sharding in shardings:
        assert sharding.mesh in (sub, sub.abstract_mesh), name
        assert "data" not in str(sharding.spec) and "stage" not in str(sharding.spec)
    assert P(None, "model") in {s.spec for _, s in shardings}
    for eqn in iter_eqns(new):
        for var in eqn.outvars:
            mesh = var.aval.sharding.mesh
            assert mesh.empty or mesh == sub.abstract_mesh
    # idempotent: a retargeted program is retargeted to itself
    assert str(retarget_shardings(new, sub)) == str(new)


def _shardings(cj) -> list[tuple[str, NamedSharding]]:
    found = []
    for eqn in iter_eqns(cj):
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, NamedSharding):
                    found.append((eqn.primitive.name, item))
    return found


def test_retarget_spec_rules():
    sub = _mesh((2, 2), ("data", "model"))
    sizes = {"stage": 2, "data": 2, "model": 2}
    assert retarget_spec(P("data", "model"), sizes, sub) == P(None, "model")
    assert retarget_spec(P(("data", "model"), None), sizes, sub) == P("model", None)
    assert retarget_spec(P("stage"), sizes, sub) == P(None)
    assert retarget_spec(P(), sizes, sub) == P()


@pytest.mark.parametrize(
    ("shape", "names", "axis", "match"),
    [
        (
            (2, 2),
            ("data", "expert"),
            "expert",
            r"equation 0 \(sharding_constraint.*'expert'.*lacks",
        ),
        ((1, 4), ("data", "model"), "model", r"sharding_constraint.*'model' of size 4.*size 2"),
    ],
    ids=["an-axis-the-sub-mesh-lacks", "an-axis-of-another-size"],
)
def test_retarget_refuses_a_constraint_the_sub_mesh_cannot_hold(shape, names, axis, match):
    other = _mesh(shape, names)
    sub = _mesh((2, 2), ("data", "model"))
    cj = jax.make_jaxpr(lambda x: lax.with_sharding_constraint(x, NamedSharding(other, P(axis))))(
        jnp.ones((4,))
    )
    with pytest.raises(PipemarkError, match=match):
        retarget_shardings(cj, sub)


def test_retarget_refuses_explicit_axes():
    explicit = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    sub = _mesh((2, 2), ("data", "model"))
    cj = jax.make_jaxpr(lambda x: jax.sharding.reshard(x, NamedSharding(explicit, P("model"))))(
        jnp.ones((4,))
    )
    with pytest.raises(PipemarkError, match="Explicit axes"):
        retarget_shardings(cj, sub)


def test_retarget_refuses_a_placement_on_one_device():
    sub = _mesh((2, 2), ("data", "model"))
    cj = jax.make_jaxpr(lambda x: jax.device_put(x * 2, jax.devices()[3]))(jnp.ones((4,)))
    with pytest.raises(PipemarkError, match=r"device_put.*cannot honour"):
        retarget_shardings(cj, sub)


def test_retarget_refuses_shard_map():
    mesh = _mesh((2,), ("model",))
    sub = _mesh((2, 2), ("data", "model"))
    fn = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("model"), out_specs=P("model"))
    cj = jax.make_jaxpr(fn)(jnp.ones((4,)))
    with pytest.raises(PipemarkError, match="shard_map"):
        retarget_shardings(cj, sub)


def test_retarget_takes_a_closed_jaxpr():
    with pytest.raises(PipemarkError, match="retarget_shardings takes"):
        retarget_shardings("program", _mesh((2,), ("data",)))


# ----------------------------------------------------------------------- sub-meshes


def test_stage_meshes_takes_the_stage_axis_anywhere():
    mesh = _mesh((2, 2, 2), ("data", "stage", "model"))
    subs = stage_meshes(mesh, 2)
    assert [s.axis_names for s in subs] == [("data", "model")] * 2
    for k, sub in enumerate(subs):
        assert sub.devices.tolist() == mesh.devices[:, k, :].tolist()
        assert all(t == AxisType.Auto for t in sub.axis_types)


def test_stage_meshes_makes_explicit_axes_auto():
    mesh = jax.make_mesh((2, 2), ("stage", "data"), axis_types=(AxisType.Explicit,) * 2)
    assert all(t == AxisType.Auto for s in stage_meshes(mesh, 2) for t in s.axis_types)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: _mesh((2, 2), ("data", "model")), "no stage axis 'stage'"),
        (lambda: _mesh((4, 2), ("stage", "data")), "size 4 but the pipeline has 2"),
        (lambda: [_mesh((2,), ("data",))], "1 sub-meshes were given for 2"),
        (
            lambda: [_mesh((2,), ("data",)), _mesh((2, 1), ("data", "model"), 2)],
            "same axis names and sizes",
        ),
        (lambda: [_mesh((2,), ("data",)), _mesh((2,), ("data",), 1)], "give each device"),
        (lambda: "mesh", "takes a jax.sharding.Mesh"),
    ],
)
def test_stage_meshes_errors(make, message):
    with pytest.raises(PipemarkError, match=message):
        stage_meshes(make(), 2)


# ------------------------------------------------------------------- compile errors


def _tiny():
    cj = jax.make_jaxpr(lambda w, x: (x @ w, (x @ w).sum()))(jnp.ones((2, 2)), jnp.ones((2, 2)))
    return cj, _mesh((2, 2), ("data", "model"))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fsdp_gather": "twice"}, "fsdp_gather is 'twice'; use one of"),
        ({"param_specs": {0: P("expert")}}, "names axis 'expert'"),
        ({"param_specs": {0: ("model",)}}, "give a jax.sharding.PartitionSpec"),
        ({"param_specs": {5: P()}}, r"param_specs names \[5\].*2 inputs"),
        ({"accumulated": [2]}, r"accumulated names \[2\].*2 outputs"),
        ({"accumulated_specs": [P(), P()]}, "2 accumulated_specs for 1"),
    ],
)
def test_compile_stage_errors(kwargs, message):
    cj, sub = _tiny()
    arguments = {"param_specs": {0: P()}, "accumulated": [1], "passed": [0], **kwargs}
    with pytest.raises(PipemarkError, match=message):
        compile_stage(cj, sub, **arguments)


def test_accumulators_are_donated_without_warnings(recwarn):
    cj, sub = _tiny()
    stage = compile_stage(cj, sub, param_specs={0: P()}, accumulated=[1], passed=[0])
    zeros = stage.zeros()
    w = jax.device_put(jnp.ones((2, 2)), stage.in_shardings[0])
    x = jax.device_put(jnp.ones((2, 2, 2)), stage.in_shardings[1])
    accs, _ = stage.run(zeros, [w, x], 0.5)
    assert zeros[0].is_deleted()
    assert [str(w.message) for w in recwarn] == []
    np.testing.assert_allclose(np.asarray(stage.reduce(accs)[0]), 8.0)


def test_the_model_constraints_shard_the_replica_axis_over_data():
    """vmap's spmd_axis_name puts the data axis on each constraint's replica axis
    (without it the replica axis is left unconstrained and XLA may gather it)."""
    full = _mesh((2, 2, 2), ("stage", "data", "model"))
    sub = stage_meshes(full, 2)[0]
    cj = jax.make_jaxpr(
        lambda w, x: lax.with_sharding_constraint(x @ w, NamedSharding(full, P("data", "model")))
    )(jnp.ones((3, 4)), jnp.ones((2, 3)))
    stage = compile_stage(cj, sub, param_specs={0: P()}, accumulated=[], passed=[0])
    w = jax.device_put(jnp.ones((3, 4)), stage.in_shardings[0])
    x = jax.device_put(jnp.ones((2, 2, 3)), stage.in_shardings[1])
    traced = jax.make_jaxpr(stage.run)([], [w, x], 1.0)
    specs = [
        eqn.params["sharding"].spec
        for eqn in iter_eqns(traced)
        if eqn.primitive.name == "sharding_constraint"
    ]
    assert specs == [P("data", None, "model")]


# ------------------------------------------------------------ FSDP: data-sharded params


def _collectives(text: str) -> set[str]:
    found = re.findall(r"\b(all-gather|reduce-scatter|all-reduce)(?:-start)?\(", text)
    return set(found)


@pytest.mark.parametrize("gather", ["once", "per_microbatch"])
def test_a_data_sharded_parameter_is_gathered_and_its_gradient_reduce_scattered(gather):
    """A parameter sharded ``P("data", None)`` over 4 replicas: its gradient, summed
    over 2 microbatches of 4 replicas, equals ``jax.jit(jax.grad)`` over all their rows
    and comes back sharded like the parameter. ``"once"`` runs on the gathered
    parameter (no collective per microbatch) and reduces once; ``"per_microbatch"``
    gathers and reduces in the program (a CPU reduce-scatter is an all-reduce)."""
    sub = _mesh((4,), ("data",))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jax.random.normal(jax.random.key(0), (8, 3))
    xs = jax.random.normal(jax.random.key(1), (2, 4, 2, 8))  # microbatch, replica, rows
    cj = jax.make_jaxpr(jax.grad(loss))(w, xs[0, 0])
    stage = compile_stage(
        cj, sub, param_specs={0: P("data", None)}, accumulated=[0], passed=[],
        accumulated_specs=[P("data", None)], fsdp_gather=gather,
    )  # fmt: skip
    # The program reads the parameter gathered, or gathers it itself.
    read = P("data", None) if gather == "per_microbatch" else gathered_spec(P("data", None))
    assert stage.in_shardings[0].spec == read
    placed = jax.device_put(w, NamedSharding(sub, P("data", None)))
    accs = stage.zeros()
    first = jax.device_put([placed, xs[0]], list(stage.in_shardings))
    run_text = stage.run.lower(accs, first, 1.0).compile().as_text()
    reduce_text = stage.reduce.lower(accs).compile().as_text()
    for m in range(2):
        inputs = jax.device_put([placed, xs[m]], list(stage.in_shardings))
        accs, _ = stage.run(accs, inputs, 0.5)
    (grad,) = stage.reduce(accs)
    want = jax.jit(jax.grad(lambda w: 0.5 * loss(w, xs.reshape(-1, 8))))(w)
    assert_trees_within_ulps(grad, want, ulps=8)
    assert grad.sharding.spec == P("data", None)
    assert {s.data.shape for s in grad.addressable_shards} == {(2, 3)}
    if gather == "once":  # whole per replica until the one reduction
        assert accs[0].shape == (4, 8, 3) and stage.per_replica == (True,)
        assert not _collectives(run_text) and _collectives(reduce_text)
    else:  # a shard per device between microbatches
        assert accs[0].shape == (8, 3) and stage.per_replica == (False,)
        assert "all-gather" in _collectives(run_text) and not _collectives(reduce_text)
        assert _collectives(run_text) & {"reduce-scatter", "all-reduce"}
