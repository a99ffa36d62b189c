"""Programs written to a directory and read back: :func:`load_staged` and the export
format (``docs/export.md`` describes it for a loader in any language).

:meth:`pipemark.StagedJaxpr.export`, :meth:`pipemark.Pipeline.export` and
:meth:`pipemark.PipelinedStep.export` write a directory with

- ``programs/``: per program, the serialized ``jax.export.Exported``
  (``<file>.jaxexport``: StableHLO with its calling convention, which
  ``jax.export.deserialize`` reads) and the same StableHLO module alone
  (``<file>.mlirbc``, a StableHLO portable artifact) for a loader outside Python;
- ``manifest.json``: the values a caller passes (``inputs``), ``constants``, each
  program's calling convention, the ``steps`` (each runs one program on named values
  and names its results), the ``outputs``; and what pipemark knew around them (the
  stages with their roles and markers, the device slots, the schedule).

Running the steps in order is all a loader does (:class:`ExportedStages` here; a dozen
lines with ``jax.export`` alone, see ``docs/export.md``). The programs are written with
their markers lowered to nothing (the ``"identity"`` lowering): inside one stage program
a marker separates nothing, the runtime compiles each stage without them
(:func:`pipemark.runtime.devices.compilation.runtime_program`), and a program that kept a
``"custom_call"`` marker would need pipemark's custom-call target in the loading
process. Each stage's markers are listed in the manifest instead.

>>> import tempfile, jax, jax.numpy as jnp, pipemark as pm
>>> def f(x):
...     x = pm.mark(x, name="a", mark_type="start")
...     x = pm.mark(jnp.sin(x), name="a", mark_type="end")
...     x = pm.mark(x, name="b", mark_type="start")
...     return pm.mark(jnp.cos(x), name="b", mark_type="end")
>>> directory = tempfile.mkdtemp()
>>> exported = pm.split(f, 1.0).export(directory)
>>> [step["program"] for step in exported.manifest["steps"]]
['a', 'b']
>>> loaded = pm.load_staged(directory)
>>> [float(v) for v in loaded(0.5)] == [float(v) for v in exported(0.5)]
True
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun

from pipemark.errors import ExportError, PipemarkError
from pipemark.lowering import lowering
from pipemark.primitive import pipeline_p

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "ExportedStages",
    "ProgramGraph",
    "aval_entry",
    "constant_entry",
    "export_program",
    "export_staged",
    "load_staged",
    "stage_markers",
    "write_export",
]

#: The ``format`` field of every manifest.
FORMAT = "pipemark-export"
#: The manifest's version: a loader refuses a newer one (the fields it would not know).
FORMAT_VERSION = 1
#: The manifest's file name in an export directory.
MANIFEST = "manifest.json"


@dataclasses.dataclass
class ProgramGraph:
    """What an export directory holds, in memory: the programs and the steps that run
    them. :func:`write_export` writes it; the runtime
    (:mod:`pipemark.runtime.execution.plan_export`) and :func:`export_staged` build one.

    Attributes
    ----------
    kind:
        What was exported: ``"staged"``, ``"pipeline"`` or ``"train_step"``.
    inputs:
        Per value the caller passes, in call order: ``{"value", "name", "aval"}``.
    outputs:
        Per result, in order: ``{"value", "name"}``.
    programs:
        The exported programs by name.
    steps:
        In run order: ``{"program", "reads", "writes", "slot"}`` (value names; the slot
        index whose device runs it, or ``None``: where its inputs are).
    constants:
        Values the manifest holds: ``{"value", "aval", "data"}`` (:func:`constant_entry`).
    slots:
        The devices steps run on: ``{"platform", "id"}`` each.
    about:
        What pipemark knew around the programs (stages, schedule, microbatches), for
        people and tools; a loader needs none of it.
    """

    kind: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    programs: dict[str, jax.export.Exported]
    steps: list[dict[str, Any]]
    constants: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    slots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    about: dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------------ writing


def aval_entry(aval: Any) -> dict[str, Any]:
    """An abstract value as the manifest writes it: ``shape``, ``dtype`` (JAX's name:
    ``float32``, ``bfloat16``, ``key<fry>``), ``weak_type``, and for a PRNG key array
    its ``physical`` shape and dtype (what the StableHLO program takes).

    >>> import jax, jax.numpy as jnp
    >>> aval_entry(jax.ShapeDtypeStruct((2, 3), jnp.float32))
    {'shape': [2, 3], 'dtype': 'float32', 'weak_type': False}
    >>> aval_entry(jax.typeof(jax.random.key(0)))["physical"]
    {'shape': [2], 'dtype': 'uint32'}
    """
    entry: dict[str, Any] = {
        "shape": [int(d) for d in aval.shape],
        "dtype": str(aval.dtype),
        "weak_type": bool(getattr(aval, "weak_type", False)),
    }
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
        physical = jax.eval_shape(jax.random.key_data, struct)
        entry["physical"] = {"shape": list(physical.shape), "dtype": str(physical.dtype)}
    return entry


def constant_entry(value_name: str, value: Any, aval: Any) -> dict[str, Any]:
    """A constant as the manifest holds it: its value name, ``aval`` and ``data``
    (nested lists of numbers; a float is written with every digit its type has).

    >>> import numpy as np
    >>> constant_entry("scale", np.float32(0.25), jax.typeof(np.float32(0.25)))["data"]
    0.25
    """
    array = np.asarray(value, dtype=aval.dtype)
    data = array.astype(np.float64) if np.issubdtype(array.dtype, np.floating) else array
    return {"value": value_name, "aval": aval_entry(aval), "data": data.tolist()}


def stage_markers(closed_jaxpr: Any) -> list[dict[str, str]]:
    """The markers of a stage program, in order: ``{"name", "mark_type"}`` each.

    >>> import jax, pipemark as pm
    >>> stage_markers(jax.make_jaxpr(lambda x: pm.mark(x * 2, name="a", mark_type="end"))(1.0))
    [{'name': 'a', 'mark_type': 'end'}]
    """
    return [
        {"name": eqn.params["name"], "mark_type": eqn.params["mark_type"]}
        for eqn in closed_jaxpr.jaxpr.eqns
        if eqn.primitive is pipeline_p
    ]


def export_program(name: str, fn: Callable, *args: Any) -> jax.export.Exported:
    """``jax.export.export(fn)(*args)`` for the program named ``name`` (``fn`` a
    ``jax.jit`` function, ``args`` its arguments or their ``jax.ShapeDtypeStruct``),
    with markers lowered to nothing; a program JAX cannot export (a Python callback,
    an unregistered custom call) raises :class:`ExportError` naming it.

    >>> import jax, jax.numpy as jnp
    >>> exp = export_program("double", jax.jit(lambda x: 2 * x), jnp.ones(3))
    >>> exp.in_avals, exp.out_avals
    ((ShapedArray(float32[3]),), (ShapedArray(float32[3]),))
    """
    try:
        with lowering("identity"):
            return jax.export.export(fn)(*args)
    except PipemarkError:
        raise
    except Exception as error:  # JAX's own, for what it cannot serialize
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ExportError(
            f"Program {name!r} cannot be exported ({type(error).__name__}: {first}). "
            "jax.export writes only programs without host callbacks and with custom "
            "calls it knows; move such code out of the stages."
        ) from error


def export_staged(staged: Any, directory: str | Path) -> ExportedStages:
    """Write ``staged`` (a :class:`~pipemark.StagedJaxpr`) to ``directory``: each stage
    as its own program, run in stage order on the program's inputs; returns what
    :func:`load_staged` reads back from it. :meth:`pipemark.StagedJaxpr.export` calls it.
    """
    graph = ProgramGraph(kind="staged", inputs=[], outputs=[], programs={}, steps=[])
    for i, (var, name) in enumerate(zip(staged.invars, staged.input_names)):
        graph.inputs.append({"value": f"input/{i}", "name": name, "aval": aval_entry(var.aval)})
    stages = []
    for k, stage in enumerate(staged.stages):
        structs = [_struct(aval) for aval in stage.in_avals]
        graph.programs[stage.name] = export_program(
            stage.name, jax.jit(jaxpr_as_fun(stage.closed_jaxpr)), *structs
        )
        graph.steps.append(
            {
                "program": stage.name,
                "reads": [_ref_value(ref) for ref in stage.inputs],
                "writes": [f"stage/{k}/{o}" for o in range(len(stage.out_avals))],
                "slot": None,
            }
        )
        stages.append(
            {
                "name": stage.name,
                "role": {"kind": stage.role.kind, "owner": stage.role.owner},
                "program": stage.name,
                "inputs": [_ref_entry(ref) for ref in stage.inputs],
                "markers": stage_markers(stage.closed_jaxpr),
            }
        )
    for r, ref in enumerate(staged.outputs):
        value = _ref_value(ref) if ref.kind != "const" else f"const/{r}"
        if ref.kind == "const":
            constant = getattr(ref.value, "val", ref.value)
            graph.constants.append(constant_entry(value, constant, _const_aval(ref.value)))
        graph.outputs.append({"value": value, "name": f"result[{r}]"})
    graph.about["stages"] = stages
    return write_export(graph, directory)


def _struct(aval: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    weak = bool(getattr(aval, "weak_type", False))
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding, weak_type=weak)


def _ref_value(ref: Any) -> str:
    """The value name of a stage input reference (:class:`~pipemark.staged.ValueRef`)."""
    if ref.kind == "input":
        return f"input/{ref.index}"
    return f"stage/{ref.stage}/{ref.index}"


def _ref_entry(ref: Any) -> dict[str, Any]:
    if ref.kind == "input":
        return {"kind": "input", "index": ref.index}
    return {"kind": "stage", "stage": ref.stage, "index": ref.index}


def _const_aval(value: Any) -> Any:
    """A constant result's type: a literal's own aval (its value may be a Python float,
    which NumPy would make float64), else the value's."""
    aval = getattr(value, "aval", None)
    return aval if aval is not None else jax.typeof(value)


_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def write_export(graph: ProgramGraph, directory: str | Path) -> ExportedStages:
    """Write ``graph`` to ``directory`` (made if missing; a previous export there is
    replaced, anything else refused) and read it back with :func:`load_staged`, so
    that what is returned runs the very bytes on disk."""
    root = Path(directory)
    if root.exists() and any(root.iterdir()) and not (root / MANIFEST).is_file():
        raise ExportError(
            f"{str(root)!r} is a directory with files that are not an export; export "
            "into an empty or new directory."
        )
    shutil.rmtree(root / "programs", ignore_errors=True)
    (root / "programs").mkdir(parents=True)
    programs = {}
    for n, (name, exp) in enumerate(graph.programs.items()):
        file = f"programs/{n:03d}-{_UNSAFE.sub('_', name)}"
        (root / f"{file}.jaxexport").write_bytes(exp.serialize())
        (root / f"{file}.mlirbc").write_bytes(exp.mlir_module_serialized)
        programs[name] = _program_entry(exp, file)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": graph.kind,
        "producer": {"jax": jax.__version__},
        "inputs": graph.inputs,
        "constants": graph.constants,
        "slots": graph.slots,
        "programs": programs,
        "steps": graph.steps,
        "outputs": graph.outputs,
        **graph.about,
    }
    (root / MANIFEST).write_text(_dumps(manifest))
    return load_staged(root)


def _dumps(manifest: Mapping[str, Any]) -> str:
    """The manifest as JSON a person can read too: each entry of a top-level list or
    mapping (an input, a program, a step) on a line of its own."""
    lines = []
    for key, value in manifest.items():
        if isinstance(value, list) and value:
            items = [f"  {json.dumps(item)}" for item in value]
            lines.append(f" {json.dumps(key)}: [\n" + ",\n".join(items) + "\n ]")
        elif isinstance(value, dict) and value:
            items = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f" {json.dumps(key)}: {{\n" + ",\n".join(items) + "\n }")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _program_entry(exp: jax.export.Exported, file: str) -> dict[str, Any]:
    """A program's calling convention, as a loader outside JAX needs it."""

    def shardings(hlo: Sequence[Any]) -> list[str | None]:
        return [None if s is None else str(s) for s in hlo]

    return {
        "exported": f"{file}.jaxexport",
        "stablehlo": f"{file}.mlirbc",
        "platforms": list(exp.platforms),
        "nr_devices": exp.nr_devices,
        "calling_convention_version": exp.calling_convention_version,
        "in_avals": [aval_entry(a) for a in exp.in_avals],
        "out_avals": [aval_entry(a) for a in exp.out_avals],
        "kept_inputs": sorted(exp.module_kept_var_idx),
        "in_shardings": shardings(exp.in_shardings_hlo),
        "out_shardings": shardings(exp.out_shardings_hlo),
        "ordered_effects": [str(e) for e in exp.ordered_effects],
    }


# ------------------------------------------------------------------------ reading


class ExportedStages:
    """An export directory read back (:func:`load_staged`): calling it runs the
    exported programs, step by step, on the flat inputs.

    Attributes
    ----------
    directory:
        Where it was read from.
    manifest:
        The parsed ``manifest.json``.
    programs:
        Each program, as ``jax.export.deserialize`` gives it back, by name.
    devices:
        The device of each slot that steps run on (empty when no step names a slot).
    """

    def __init__(
        self,
        directory: Path,
        manifest: dict[str, Any],
        programs: dict[str, jax.export.Exported],
        devices: Sequence[Any],
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self.programs = programs
        self.devices = tuple(devices)
        self._calls = {name: _flat_call(exp) for name, exp in programs.items()}
        self._constants = {
            c["value"]: np.asarray(c["data"], dtype=_dtype(c["aval"]["dtype"]))
            for c in manifest["constants"]
        }

    @property
    def kind(self) -> str:
        """``"staged"``, ``"pipeline"`` or ``"train_step"``."""
        return self.manifest["kind"]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(entry["name"] for entry in self.manifest["inputs"])

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(entry["name"] for entry in self.manifest["outputs"])

    def __repr__(self) -> str:
        return (
            f"ExportedStages({self.kind}: {len(self.programs)} programs, "
            f"{len(self.manifest['steps'])} steps, from {str(self.directory)!r})"
        )

    def __call__(self, *args: Any) -> list[Any]:
        """Run the steps on ``args`` (flattened, in JAX's leaf order, to the
        manifest's ``inputs``) and return the flat outputs."""
        flat = jax.tree_util.tree_leaves(list(args))
        self._check_inputs(flat)
        values: dict[str, Any] = dict(self._constants)
        values.update((e["value"], x) for e, x in zip(self.manifest["inputs"], flat))
        for step in self.manifest["steps"]:
            reads = [values[name] for name in step["reads"]]
            if step["slot"] is not None:
                reads = jax.device_put(reads, self.devices[step["slot"]])
            values.update(zip(step["writes"], self._calls[step["program"]](*reads)))
        return [values[entry["value"]] for entry in self.manifest["outputs"]]

    def _check_inputs(self, flat: Sequence[Any]) -> None:
        inputs = self.manifest["inputs"]
        if len(flat) != len(inputs):
            raise PipemarkError(
                f"This {self.kind} export takes {len(inputs)} inputs (after flattening), "
                f"got {len(flat)}; its inputs are {', '.join(self.input_names)}."
            )
        for i, (value, entry) in enumerate(zip(flat, inputs)):
            shape = list(np.shape(value))
            if shape != entry["aval"]["shape"]:
                raise PipemarkError(
                    f"Input {i} ({entry['name']}) has shape {tuple(shape)}, but the "
                    f"export takes {tuple(entry['aval']['shape'])}."
                )


def _dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(name))


def _flat_call(exp: jax.export.Exported) -> Callable[..., list[Any]]:
    """``exp.call`` on its flat inputs, returning its flat results, compiled once."""

    def call(*flat: Any) -> list[Any]:
        args, kwargs = jax.tree_util.tree_unflatten(exp.in_tree, flat)
        return jax.tree_util.tree_leaves(exp.call(*args, **kwargs))

    return jax.jit(call)


def load_staged(directory: str | Path, *, devices: Sequence[Any] | None = None) -> ExportedStages:
    """Read an export directory back: a callable that runs its programs, step by step,
    bit for bit as they ran where they were exported (same programs, same XLA).

    Parameters
    ----------
    directory:
        What :meth:`pipemark.StagedJaxpr.export`, :meth:`pipemark.Pipeline.export` or
        :meth:`pipemark.PipelinedStep.export` wrote.
    devices:
        One device per slot of the manifest (a pipeline's stage devices); by default
        the devices of the manifest's platform and ids in this process.

    Raises
    ------
    ExportError
        Naming what is wrong: no manifest, another format or a newer version, a missing
        program file, a step reading a value nothing wrote before it, a device this
        process does not have.

    >>> import tempfile, jax, jax.numpy as jnp, pipemark as pm
    >>> directory = tempfile.mkdtemp()
    >>> _ = pm.split(lambda x: jnp.sin(x) * 2, jnp.ones(3), num_stages=1).export(directory)
    >>> loaded = pm.load_staged(directory)
    >>> loaded.kind, loaded.input_names, [a.tolist() for a in loaded(jnp.zeros(3))]
    ('staged', ('x',), [[0.0, 0.0, 0.0]])
    """
    root = Path(directory)
    manifest = _read_manifest(root)
    programs = {}
    for name, entry in manifest["programs"].items():
        path = root / entry["exported"]
        if not path.is_file():
            raise ExportError(f"Program {name!r}: its file {str(path)!r} is missing.")
        programs[name] = jax.export.deserialize(bytearray(path.read_bytes()))
    _check_steps(manifest)
    return ExportedStages(root, manifest, programs, _slot_devices(manifest["slots"], devices))


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise ExportError(
            f"{str(root)!r} has no {MANIFEST}; give the directory an export was written to."
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ExportError(f"{str(path)!r} is not a {FORMAT} manifest.")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ExportError(
            f"{str(path)!r} has format_version {version!r}; this pipemark reads up to "
            f"{FORMAT_VERSION}. Read it with the pipemark that wrote it, or a newer one."
        )
    return manifest


def _check_steps(manifest: Mapping[str, Any]) -> None:
    """Every step runs a program of the manifest and reads values written before it."""
    known = {e["value"] for e in manifest["inputs"]} | {c["value"] for c in manifest["constants"]}
    for n, step in enumerate(manifest["steps"]):
        if step["program"] not in manifest["programs"]:
            raise ExportError(f"Step {n} runs program {step['program']!r}, which is not listed.")
        missing = [name for name in step["reads"] if name not in known]
        if missing:
            raise ExportError(
                f"Step {n} ({step['program']!r}) reads {missing[0]!r}, which no input, "
                "constant or earlier step provides."
            )
        known.update(step["writes"])
    missing = [e["value"] for e in manifest["outputs"] if e["value"] not in known]
    if missing:
        raise ExportError(f"Output {missing[0]!r} is written by no step.")


def _slot_devices(slots: Sequence[Mapping[str, Any]], devices: Sequence[Any] | None) -> list:
    if devices is not None:
        if len(devices) != len(slots):
            raise ExportError(
                f"This export runs on {len(slots)} device slots; devices= gives {len(devices)}."
            )
        return list(devices)
    found = []
    for k, slot in enumerate(slots):
        try:
            here = {d.id: d for d in jax.devices(slot["platform"])}
        except RuntimeError:
            here = {}
        if slot["id"] not in here:
            raise ExportError(
                f"Slot {k} ran on {slot['platform']} device {slot['id']}, which this "
                "process does not have; pass devices= (one per slot)."
            )
        found.append(here[slot["id"]])
    return found
