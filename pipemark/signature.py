"""How a function's example arguments map to the flat inputs of its jaxpr.

:func:`pipemark.split` traces a function the way ``eqx.filter_jit`` would: arguments
named by ``static_argnums`` / ``static_argnames`` are held static, and so is every pytree
leaf that is not an array (an equinox module's activation function, a string, a
dataclass field that is not a number; inside an equinox module, Python numbers too,
such as ``Dropout``'s ``inference`` flag). The array leaves, in ``jax.tree_util`` order,
are the jaxpr's inputs. A :class:`Signature` records that split, rebuilds the call from
flat inputs for tracing, and checks what a staged program is later called with.

>>> import jax.numpy as jnp
>>> sig = Signature.of((jnp.ones(2), "relu"), {"scale": 2.0})
>>> sig.names
('args[0]', 'scale')
>>> len(sig.flatten((jnp.zeros(2), "relu"), {"scale": 3.0}))
2
"""

from __future__ import annotations

import inspect as _pyinspect
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# SignatureError is defined with the other errors; it is imported from here too.
from pipemark.errors import PipemarkWarning, SignatureError
from pipemark.mutation import call_watching_arguments

__all__ = ["Signature", "is_traced_leaf", "traced_mask"]


_SCALARS = (bool, int, float, complex)
# What JAX narrows without jax_enable_x64 (complex64 is two 32-bit floats: kept).
_WIDE_DTYPES = frozenset(np.dtype(t) for t in ("float64", "int64", "uint64", "complex128"))


def is_traced_leaf(leaf: Any) -> bool:
    """Whether a pytree leaf becomes a jaxpr input: arrays (JAX, NumPy, NumPy scalars),
    ``jax.ShapeDtypeStruct`` and Python numbers. Anything else (functions, strings,
    arbitrary objects) is held static, as ``eqx.filter_jit`` holds non-arrays static;
    Python numbers are traced, as ``jax.jit`` traces them, except inside an equinox
    module (:func:`traced_mask`).

    >>> import jax.numpy as jnp
    >>> [is_traced_leaf(v) for v in (jnp.ones(2), 1.0, jnp.tanh, "gelu")]
    [True, True, False, False]
    """
    return (
        isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, *_SCALARS))
        or hasattr(leaf, "__jax_array__")
        or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
    )


def _is_equinox_module(node: Any) -> bool:
    eqx = sys.modules.get("equinox")  # no equinox imported: no equinox module exists
    return eqx is not None and isinstance(node, eqx.Module)


def _array_mask(module: Any) -> Any:
    # Inside an equinox module, eqx.is_array decides (eqx.filter_jit's rule): a Python
    # number there is a hyperparameter (Dropout's ``inference`` flag, its rate).
    return jax.tree_util.tree_map(
        lambda leaf: is_traced_leaf(leaf) and not isinstance(leaf, _SCALARS), module
    )


def traced_mask(tree: Any) -> list[bool]:
    """For each leaf of ``tree`` (in ``jax.tree_util`` order), whether it is traced:
    :func:`is_traced_leaf`, except inside an equinox module, where Python numbers are
    static as ``eqx.filter_jit`` holds them (so ``if self.inference:`` works).

    >>> import jax.numpy as jnp
    >>> traced_mask({"w": jnp.ones(2), "scale": 2.0, "act": jnp.tanh})
    [False, True, True]
    """
    mask = jax.tree_util.tree_map(
        lambda node: _array_mask(node) if _is_equinox_module(node) else is_traced_leaf(node),
        tree,
        is_leaf=_is_equinox_module,
    )
    return jax.tree_util.tree_leaves(mask)


def _same(a: Any, b: Any) -> bool:
    """Equality for static values, never raising (``==`` of arrays is elementwise)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _parameter_names(fn: Callable[..., Any] | None, count: int) -> list[str]:
    names = [f"args[{i}]" for i in range(count)]
    if fn is None:
        return names
    try:
        params = list(_pyinspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some wrappers have no signature
        return names
    for i, param in enumerate(params[:count]):
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names[i] = param.name
        else:
            break
    return names


def _normalise_argnums(static_argnums: int | Iterable[int], num_args: int) -> tuple[int, ...]:
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    out = []
    for n in nums:
        if not isinstance(n, int) or isinstance(n, bool):
            raise SignatureError(f"static_argnums must hold ints, got {n!r}.")
        if not -num_args <= n < num_args:
            raise SignatureError(
                f"static_argnums names argument {n}, but the function was given "
                f"{num_args} positional argument(s)."
            )
        out.append(n % num_args)
    return tuple(sorted(set(out)))


def _normalise_argnames(static_argnames: str | Iterable[str], kwargs: dict) -> tuple[str, ...]:
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    for name in names:
        if name not in kwargs:
            raise SignatureError(
                f"static_argnames names {name!r}, but no keyword argument {name!r} was "
                f"given (keyword arguments: {sorted(kwargs) or 'none'}). Pass it as a "
                "keyword argument, or name its position in static_argnums."
            )
    return tuple(sorted(set(names)))


def _path_name(path: tuple, positional: Sequence[str]) -> str:
    """``params['Dense_0']['kernel']`` for a leaf path of ``(args, kwargs)``."""
    part, key, *rest = path
    head = positional[key.idx] if part.idx == 0 else str(key.key)
    return head + jax.tree_util.keystr(tuple(rest))


@dataclass(frozen=True, eq=False)
class Signature:
    """What a function was traced with: the pytree structure of its non-static
    arguments, which leaves are jaxpr inputs, and the static values.

    Build one with :meth:`of`; :meth:`bind` gives the function over flat inputs that
    :func:`jax.make_jaxpr` traces, :meth:`flatten` turns a later call's arguments into
    those inputs (checking them), and :attr:`names` names each input by its path, e.g.
    ``params['Dense_0']['kernel']``.
    """

    treedef: Any
    traced: tuple[bool, ...]
    static_leaves: tuple[Any, ...]
    static_args: tuple[tuple[int | str, Any], ...]
    num_args: int
    paths: tuple[str, ...]

    @classmethod
    def of(
        cls,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None = None,
        *,
        static_argnums: int | Iterable[int] = (),
        static_argnames: str | Iterable[str] = (),
        fn: Callable[..., Any] | None = None,
    ) -> Signature:
        """The signature of the call ``fn(*args, **kwargs)``; ``fn`` only lends its
        parameter names to :attr:`names`."""
        args, kwargs = tuple(args), dict(kwargs or {})
        nums = _normalise_argnums(static_argnums, len(args))
        names = _normalise_argnames(static_argnames, kwargs)
        statics = tuple((i, args[i]) for i in nums) + tuple((k, kwargs[k]) for k in names)
        dynamic = (
            tuple(a for i, a in enumerate(args) if i not in nums),
            {k: v for k, v in kwargs.items() if k not in names},
        )
        positional = [n for i, n in enumerate(_parameter_names(fn, len(args))) if i not in nums]
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
        traced = tuple(traced_mask(dynamic))
        return cls(
            treedef=treedef,
            traced=traced,
            static_leaves=tuple(leaf for (_, leaf), t in zip(with_paths, traced) if not t),
            static_args=statics,
            num_args=len(args),
            paths=tuple(_path_name(path, positional) for path, _ in with_paths),
        )

    @property
    def names(self) -> tuple[str, ...]:
        """The path of each jaxpr input, in order."""
        return tuple(p for p, t in zip(self.paths, self.traced) if t)

    @property
    def num_inputs(self) -> int:
        """How many jaxpr inputs the traced leaves make."""
        return sum(self.traced)

    def rebuild(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The ``(args, kwargs)`` of a call whose traced leaves are ``inputs``."""
        inputs, statics = iter(inputs), iter(self.static_leaves)
        leaves = [next(inputs) if t else next(statics) for t in self.traced]
        dyn_args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        args = list(dyn_args)
        for key, value in self.static_args:
            if isinstance(key, int):
                args.insert(key, value)  # static_args holds positions in increasing order
            else:
                kwargs[key] = value
        return tuple(args), kwargs

    def bind(self, fn: Callable[..., Any]) -> Callable[..., list[Any]]:
        """``fn`` as a function of the flat jaxpr inputs, returning its array results
        as a flat list (non-array results, like an equinox module's functions, are
        dropped: a jaxpr cannot return them)."""

        def flat_fn(*inputs: Any) -> list[Any]:
            args, kwargs = self.rebuild(inputs)
            out = call_watching_arguments(fn, args, kwargs)
            leaves = jax.tree_util.tree_leaves(out)
            return [leaf for leaf, traced in zip(leaves, traced_mask(out)) if traced]

        return flat_fn

    def trace(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict | None = None):
        """``jax.make_jaxpr`` of :meth:`bind` on this call's inputs, with the inputs
        named by their paths in the jaxpr's debug info. Warns (once per call site) when
        64-bit array inputs are traced as 32-bit because ``jax_enable_x64`` is off."""
        inputs = self.flatten(args, kwargs)
        self._warn_narrowed(inputs)
        try:
            cj = jax.make_jaxpr(self.bind(fn))(*inputs)
        except TypeError as error:
            if "is not a valid JAX type" not in str(error):
                raise
            # The arguments' non-array leaves were held static, so the function itself
            # handed one to a JAX transformation (jax.grad of an equinox module, say).
            raise SignatureError(
                f"Tracing {getattr(fn, '__qualname__', fn)!r} failed: {error} The "
                "function passes a non-array leaf to a JAX transformation. Differentiate "
                "or vmap only the array leaves: eqx.filter_value_and_grad / eqx.filter_grad "
                "instead of jax.value_and_grad, or eqx.partition(model, eqx.is_array) "
                "first."
            ) from error
        info = cj.jaxpr.debug_info
        if info is not None:
            info = info._replace(
                arg_names=self.names,
                func_src_info=getattr(fn, "__qualname__", info.func_src_info),
            )
            cj = cj.replace(jaxpr=cj.jaxpr.replace(debug_info=info))
        return cj

    def _warn_narrowed(self, inputs: Sequence[Any]) -> None:
        if jax.config.jax_enable_x64:
            return
        wide = [
            f"{name} ({leaf.dtype})"
            for name, leaf in zip(self.names, inputs)
            # Compared as dtypes, not through np.dtype, which refuses a typed PRNG key's
            # dtype (key<fry>, in an nnx model's Rngs).
            if getattr(leaf, "dtype", None) is not None and leaf.dtype in _WIDE_DTYPES
        ]
        if wide:
            shown = ", ".join(wide[:3]) + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
            warnings.warn(
                f"{shown} will be traced as 32-bit: jax_enable_x64 is off, so JAX narrows "
                "64-bit inputs. Pass 32-bit arrays, or turn on "
                'jax.config.update("jax_enable_x64", True) before tracing.',
                PipemarkWarning,
                stacklevel=4,
            )

    def flatten(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> list[Any]:
        """The jaxpr inputs of a call with ``args`` and ``kwargs``.

        The call must have the traced structure and the same static values; the flat
        inputs alone (``len(args) == num_inputs`` arrays, no keywords) are accepted too.

        Raises
        ------
        SignatureError
            Naming both structures, or the static value that changed.
        """
        args, kwargs = tuple(args), dict(kwargs or {})
        if self.is_flat_call(args, kwargs):
            return list(args)
        self._check_static_args(args, kwargs)
        flat, treedef = self._dynamic_leaves(args, kwargs)
        if treedef != self.treedef:
            raise SignatureError(
                "The arguments do not have the structure the program was traced with.\n"
                f"  traced with: {self._describe(self.treedef)}\n"
                f"  called with: {self._describe(treedef)}\n"
                "Call it with arguments of the traced structure (or trace again)."
            )
        inputs = []
        statics = iter(self.static_leaves)
        for leaf, traced, path in zip(flat, self.traced, self.paths):
            if traced:
                inputs.append(leaf)
                continue
            expected = next(statics)
            if not _same(leaf, expected):
                raise SignatureError(
                    f"{path} is a static (non-array) leaf; it was {expected!r} when the "
                    f"program was traced, got {leaf!r}. A traced program is specialised to "
                    "its static leaves: trace again for the new value."
                )
        return inputs

    def is_flat_call(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
        """Whether ``args`` are the flat inputs themselves rather than a call of the
        traced structure."""
        args = tuple(args)
        return (
            not kwargs
            and len(args) == self.num_inputs
            and all(map(is_traced_leaf, args))
            and not self._has_structure(args)
        )

    def _has_structure(self, args: tuple) -> bool:
        return len(args) == self.num_args and self._dynamic_leaves(args, {})[1] == self.treedef

    def _dynamic_leaves(self, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        static = {key for key, _ in self.static_args}
        dynamic = (
            tuple(a for i, a in enumerate(args) if i not in static),
            {k: v for k, v in kwargs.items() if k not in static},
        )
        return jax.tree_util.tree_flatten(dynamic)

    def _check_static_args(self, args: tuple, kwargs: dict) -> None:
        if len(args) != self.num_args:
            raise SignatureError(
                f"The program was traced with {self.num_args} positional argument(s), "
                f"got {len(args)}."
            )
        for key, expected in self.static_args:
            where = f"static argument {key}" if isinstance(key, int) else f"static {key!r}"
            if isinstance(key, str) and key not in kwargs:
                raise SignatureError(f"{where} is missing; pass {key}={expected!r}.")
            value = args[key] if isinstance(key, int) else kwargs[key]
            if not _same(value, expected):
                raise SignatureError(
                    f"{where} was {expected!r} when the program was traced, got {value!r}; "
                    "a traced program is specialised to its static arguments: trace again "
                    "for the new value."
                )

    @staticmethod
    def _describe(treedef: Any) -> str:
        try:
            args, kwargs = jax.tree_util.tree_unflatten(treedef, ["*"] * treedef.num_leaves)
        except Exception:  # a custom pytree node that validates its leaves
            return str(treedef)
        parts = [_shape_of(a) for a in args] + [f"{k}={_shape_of(v)}" for k, v in kwargs.items()]
        return f"({', '.join(parts)})"


def _shape_of(tree: Any) -> str:
    """A pytree with every leaf shown as ``*``: ``{'b': *, 'w': *}``."""
    return repr(tree).replace("'*'", "*")
