"""Property tests: random programs x random cuts -> insert -> slice == the original.

Programs are small (a few dozen equations of 4x4 arrays) and are evaluated eagerly with
``jaxpr_as_fun``, so no example compiles anything new after the first few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import check_jaxpr, jaxpr_as_fun

import pipemark as pm

settings.register_profile(
    "pipemark-slice",
    max_examples=200,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("pipemark-slice")

SHAPE = (4, 4)
NUM_INPUTS = 3
_CONSTANTS = [np.linspace(-1, 1, 16, dtype=np.float32).reshape(SHAPE) * (k + 1) for k in range(3)]

# Each op: (name, arity, function of jnp arrays). Literal operands appear as Python
# scalars; constants as closed-over NumPy arrays (constvars of the traced program).
_OPS = [
    ("sin", 1, jnp.sin),
    ("tanh", 1, jnp.tanh),
    ("neg", 1, lambda x: -x),
    ("add", 2, lambda x, y: x + y),
    ("mul", 2, lambda x, y: x * y),
    ("sub", 2, lambda x, y: x - y),
    ("max", 2, jnp.maximum),
    ("dot", 2, lambda x, y: x @ y),
    ("scale", 1, lambda x: x * 0.5),  # literal operand
    ("shift", 1, lambda x: 1.25 + x),  # literal operand first
    ("const0", 1, lambda x: x + _CONSTANTS[0]),
    ("const1", 1, lambda x: x * _CONSTANTS[1]),
    ("const2", 1, lambda x: _CONSTANTS[2] - x),
    ("rowsum", 1, lambda x: jnp.broadcast_to(jnp.sum(x, axis=0), SHAPE)),
    ("colmax", 1, lambda x: jnp.broadcast_to(jnp.max(x, axis=1, keepdims=True), SHAPE)),
]


@st.composite
def programs(draw, max_ops: int = 14):
    """A program spec: ops reading any earlier value (far-downstream reuse is common)
    and a set of results that may include inputs."""
    num_ops = draw(st.integers(1, max_ops))
    ops = []
    for k in range(num_ops):
        op = draw(st.integers(0, len(_OPS) - 1))
        pool = NUM_INPUTS + k
        operands = [draw(st.integers(0, pool - 1)) for _ in range(_OPS[op][1])]
        ops.append((op, operands))
    total = NUM_INPUTS + num_ops
    results = draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=4))
    if total - 1 not in results:
        results.append(total - 1)  # keep the last op alive
    return ops, results


def _function(spec, marks=None):
    """A Python function running ``spec``; ``marks`` maps op index -> list of
    (mark_type, name) zero-operand markers emitted before that op (``len(ops)`` for
    after the last)."""
    ops, results = spec
    marks = marks or {}

    def emit(k):
        for mark_type, name in marks.get(k, ()):
            pm.mark((), name=name, mark_type=mark_type)

    def fn(*inputs):
        values = list(inputs)
        for k, (op, operands) in enumerate(ops):
            emit(k)
            values.append(_OPS[op][2](*(values[i] for i in operands)))
        emit(len(ops))
        return [values[i] for i in results]

    return fn


def _args():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.normal(size=SHAPE).astype(np.float32)) for _ in range(NUM_INPUTS)]


ARGS = _args()


def _same_bits(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def _signature(eqn):
    return (
        eqn.primitive,
        tuple(sorted((k, repr(v)) for k, v in eqn.params.items())),
        tuple(str(v.aval) for v in eqn.invars),
        tuple(str(v.aval) for v in eqn.outvars),
    )


@PROFILE
@given(spec=programs(), data=st.data())
def test_insert_then_slice_equals_original(spec, data):
    cj = jax.make_jaxpr(_function(spec))(*ARGS)
    num_eqns = len(cj.eqns)
    cuts = sorted(data.draw(st.sets(st.integers(0, num_eqns - 1), max_size=6), label="cuts"))
    before = str(cj)
    marked = pm.passes.insert_markers(cj, cuts)
    check_jaxpr(marked.jaxpr)
    staged = pm.passes.slice_stages(marked, unmarked="error")
    assert len(staged.stages) == len(set(cuts) | {0})
    for stage in staged.stages:
        check_jaxpr(stage.closed_jaxpr.jaxpr)

    want = jaxpr_as_fun(cj)(*ARGS)
    _same_bits(staged(*ARGS), want)

    stitched = staged.as_closed_jaxpr()
    check_jaxpr(stitched.jaxpr)
    # Stitching gives the marked program, equation for equation (the same objects) ...
    assert len(stitched.eqns) == len(marked.eqns)
    assert all(a is b for a, b in zip(stitched.eqns, marked.eqns))
    # ... whose non-marker equations are the original's, in order.
    plain = [e for e in stitched.eqns if e.primitive is not pm.pipeline_p]
    assert [_signature(e) for e in plain] == [_signature(e) for e in cj.eqns]
    _same_bits(jaxpr_as_fun(stitched)(*ARGS), want)
    assert str(cj) == before  # the passes never touch their input


@PROFILE
@given(spec=programs(), data=st.data())
def test_slice_with_unmarked_gaps_equals_original(spec, data):
    """Marked ranges with unmarked equations between them: ``unmarked="assign"`` puts
    every stray equation into a stage, and stages still run in order."""
    num_ops = len(spec[0])
    points = sorted(
        data.draw(st.sets(st.integers(0, num_ops), min_size=2, max_size=8), label="points")
    )
    # Consecutive pairs of points delimit stages; the rest of the program is unmarked.
    marks: dict[int, list[tuple[str, str]]] = {}
    for s, (a, b) in enumerate(zip(points[0::2], points[1::2])):
        marks.setdefault(a, []).append(("start", f"s{s}"))
        marks.setdefault(b, []).append(("end", f"s{s}"))
    fn = _function(spec, marks)
    cj = jax.make_jaxpr(fn)(*ARGS)
    staged = pm.passes.slice_stages(cj)
    assert [s.name for s in staged.stages] == [f"s{i}" for i in range(len(points) // 2)]
    for stage in staged.stages:
        check_jaxpr(stage.closed_jaxpr.jaxpr)
    _same_bits(staged(*ARGS), jaxpr_as_fun(cj)(*ARGS))
    stitched = staged.as_closed_jaxpr()
    check_jaxpr(stitched.jaxpr)
    assert sorted(map(id, stitched.eqns)) == sorted(map(id, cj.eqns))
