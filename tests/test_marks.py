"""pipemark.marks: the one table of mark-type roles, and the docs that show it."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pipemark as pm
from pipemark.marks import (
    CLOSERS,
    KEPT_BY_DCE,
    MARK_ROLES,
    MARK_TYPES,
    OPENERS,
    PAIRED_MARK_TYPES,
    STAGE_MARK_TYPES,
    backward_name,
    forward_name,
)
from pipemark.primitive import is_marker

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_derived_sets_follow_the_table():
    assert MARK_TYPES == ("start", "end", "jvp_start", "jvp_end", "boundary", "grad", "hook")
    assert OPENERS == {"start": "end", "jvp_start": "jvp_end"}
    assert CLOSERS == {"end": "start", "jvp_end": "jvp_start"}
    assert {"start", "end", "jvp_start", "jvp_end"} == PAIRED_MARK_TYPES
    assert PAIRED_MARK_TYPES | {"boundary"} == STAGE_MARK_TYPES
    assert STAGE_MARK_TYPES | {"grad"} == KEPT_BY_DCE


@pytest.mark.parametrize(
    ("name", "forward"), [("a_backward", "a"), ("a", None), ("_backward", None)]
)
def test_stage_names(name, forward):
    assert forward_name(name) == forward
    if forward is not None:
        assert backward_name(forward) == name


@pytest.mark.parametrize("mark_type", [t for t in MARK_TYPES if MARK_ROLES[t].tangent])
def test_the_primitive_makes_the_tangent_the_table_names(mark_type):
    def f(x):
        return pm.mark(jnp.sin(x), name="s", mark_type=mark_type)

    cj = jax.make_jaxpr(lambda x, t: jax.jvp(f, (x,), (t,)))(1.0, 1.0)
    types = [e.params["mark_type"] for e in cj.eqns if is_marker(e)]
    assert types == [mark_type, MARK_ROLES[mark_type].tangent]


@pytest.mark.parametrize("mark_type", [t for t in MARK_TYPES if MARK_ROLES[t].transposed])
def test_the_primitive_makes_the_transpose_the_table_names(mark_type):
    role = MARK_ROLES[mark_type]

    def f(x):
        return pm.mark(x * 2.0, name="s", mark_type=mark_type)

    cj = jax.make_jaxpr(jax.grad(f))(1.0)
    markers = [(e.params["name"], e.params["mark_type"]) for e in cj.eqns if is_marker(e)]
    name = backward_name("s") if role.mirrored else "s"
    assert markers[-1] == (name, role.transposed)


def _doc_table(heading: str) -> dict[str, list[str]]:
    text = (DOCS / "mark-types.md").read_text()
    section = text[text.index(heading) :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_docs_table_says_what_the_roles_say():
    rows = _doc_table("## Under each transformation")
    assert list(rows) == list(MARK_TYPES)
    for mark_type, (jvp, transpose, _vmap, dce) in rows.items():
        role = MARK_ROLES[mark_type]
        if role.tangent is None:
            assert jvp.startswith("none"), mark_type
        else:
            assert jvp.startswith(f"`{role.tangent}`"), mark_type
        if role.transposed is None:
            assert transpose.startswith("none"), mark_type
        else:
            named = "name + `_backward`" if role.mirrored else "same name"
            assert re.match(rf"`{role.transposed}`, {re.escape(named)}", transpose), mark_type
        assert dce.startswith("kept") == role.kept_by_dce, mark_type


def test_the_architecture_page_example_pass_runs():
    text = (DOCS / "architecture.md").read_text()
    # The page's pass example (its other Python block adds a schedule).
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def my_pass" in b]
    namespace: dict = {}
    exec(compile(block, "architecture.md", "exec"), namespace)
    cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(1.0)
    out = namespace["my_pass"](cj)
    assert [e.primitive.name for e in out.eqns] == ["sin", "cos"]
    with pytest.raises(pm.PipemarkError, match=r"my_pass takes a jax\.extend\.core\.ClosedJaxpr"):
        namespace["my_pass"](cj.eqns)  # no ClosedJaxpr on any JAX (cj.jaxpr is, from 0.11)
