"""How an object is shown: views registered by the modules that draw them.

An object that can be shown (a :class:`~pipemark.StagedJaxpr`: ``summary()``, ``str()``,
a notebook's ``_repr_html_``) asks :func:`render` for the view of its type; it never
imports the module that draws it. The views register themselves
(:func:`register_view`, on the line under the function that draws) when their module
is imported, and they import the objects they draw: the arrows run one way, from the
views down to the objects. Which modules hold views is said once, by the package
(``pipemark/__init__.py``, :func:`views_in`), and a render that finds no view imports
them first: ``str(staged)`` works whether or not anything imported
:mod:`pipemark.views` before.

>>> class Point:
...     def __init__(self, x):
...         self.x = x
...     def __str__(self):
...         return render("text", self)
>>> register_view(Point, "text", lambda point: f"Point at {point.x}")
>>> str(Point(2))
'Point at 2'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pipemark.errors import PipemarkError

__all__ = ["register_view", "render", "views_in"]

_VIEWS: dict[tuple[type, str], Callable[..., Any]] = {}
_VIEW_MODULES: list[str] = []


def register_view(cls: type, kind: str, draw: Callable[..., Any]) -> None:
    """Have ``render(kind, obj, **options)`` call ``draw(obj, **options)`` for an
    instance of ``cls`` (or of a subclass). ``kind`` is the view's name: ``"text"``
    (``summary()`` and ``str()``), ``"html"`` (``_repr_html_``), or one of your own."""
    _VIEWS[(cls, kind)] = draw


def views_in(*modules: str) -> None:
    """Name the modules whose import registers views (``"pipemark.views"``): a render
    that finds no view for an object imports them, then looks again."""
    _VIEW_MODULES.extend(m for m in modules if m not in _VIEW_MODULES)


def _find(cls: type, kind: str) -> Callable[..., Any] | None:
    for base in cls.__mro__:
        draw = _VIEWS.get((base, kind))
        if draw is not None:
            return draw
    return None


def render(kind: str, obj: Any, **options: Any) -> Any:
    """``obj``'s ``kind`` view: what the function registered for its type returns.

    Raises
    ------
    PipemarkError
        When no view of that kind is registered for the object's type, naming both.
    """
    draw = _find(type(obj), kind)
    if draw is None:
        for module in _VIEW_MODULES:
            importlib.import_module(module)
        draw = _find(type(obj), kind)
    if draw is None:
        raise PipemarkError(
            f"No {kind!r} view is registered for {type(obj).__name__}; register one "
            "with pipemark.rendering.register_view."
        )
    return draw(obj, **options)
