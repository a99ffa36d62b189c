"""How objects are shown (pipemark/rendering.py): views found by type, the package's
view modules imported by the first render, an object with no view refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pipemark as pm
from pipemark.rendering import register_view, render


class Shape:
    pass


class Square(Shape):
    pass


class Unshown:
    pass


def test_a_view_serves_the_subclasses_of_its_type_and_options_pass_through():
    register_view(Shape, "text", lambda shape, *, width=1: f"{type(shape).__name__} x{width}")
    assert render("text", Square(), width=3) == "Square x3"
    register_view(Square, "text", lambda square, **_: "a square")
    assert (render("text", Square()), render("text", Shape())) == ("a square", "Shape x1")


def test_an_object_without_a_view_is_refused_naming_its_type_and_the_kind():
    with pytest.raises(pm.PipemarkError, match="No 'html' view is registered for Unshown"):
        render("html", Unshown())


def test_a_staged_program_draws_itself_though_nothing_imported_the_views():
    # A fresh process: the passes hand out a staged program without importing the
    # views, and its summary imports them (the modules the package names) on first use.
    code = (
        "import sys, jax, jax.numpy as jnp, pipemark as pm\n"
        "cj = jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(4))\n"
        "staged = pm.passes.slice_stages(pm.passes.insert_markers(cj, [1]))\n"
        "before = 'pipemark.views' in sys.modules\n"
        "table = staged.summary(style='plain')\n"
        "print(before, 'stage1' in table, staged._repr_html_().startswith('<div'))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True"]
