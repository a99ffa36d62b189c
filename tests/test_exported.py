"""Exported stages (pipemark/exported.py): a staged program and a pipeline written to a
directory, read back in a fresh process by the loader docs/export.md prints (jax alone),
equal bit for bit to the export; the results against JAX's own evaluation; the manifest;
the errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipemark as pm
from pipemark import examples
from tests._devices import devices
from tests._trees import assert_trees_close, assert_trees_equal, assert_trees_within_ulps

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "export.md"


def loss(w, x):
    x = pm.mark(x, name="a", mark_type="start")
    h = pm.mark(jnp.tanh(x @ w), name="a", mark_type="end")
    h = pm.mark(h, name="b", mark_type="start")
    return pm.mark(jnp.sum(jnp.sin(h) ** 2), name="b", mark_type="end")


W = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
X = jnp.linspace(0.5, -0.5, 6, dtype=jnp.float32).reshape(2, 3)


def _page_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def _loader_source() -> str:
    (block,) = [b for b in _page_blocks() if b.startswith("# A loader with jax alone")]
    return block


# The loader of docs/export.md on both exports, in a process that imports jax alone.
SCRIPT = """
import sys
{loader}
staged_dir, pipeline_dir, inputs, outputs = sys.argv[1:]
given = np.load(inputs)
got = load(staged_dir)(given["w"], given["x"])
got += load(pipeline_dir)(*[given[f"p{{i}}"] for i in range(int(given["n"]))])
np.savez(outputs, *[np.asarray(v) for v in got])
assert not [m for m in sys.modules if m.split(".")[0] == "pipemark"], "imported pipemark"
"""


def test_a_fresh_process_with_jax_alone_runs_both_exports_bit_for_bit(tmp_path):
    vg = jax.value_and_grad(loss)
    exported = pm.split(vg, W, X).export(tmp_path / "staged")
    ex = examples.mlp(num_layers=2, batch=4)
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, devices=devices(2)
    )
    pipeline = pipe.export(tmp_path / "pipeline", ex.params, ex.batch)
    flat = jax.tree_util.tree_leaves((ex.params, ex.batch))
    arrays = {f"p{i}": np.asarray(v) for i, v in enumerate(flat)}
    np.savez(tmp_path / "in.npz", w=np.asarray(W), x=np.asarray(X), n=len(flat), **arrays)
    script = tmp_path / "load.py"
    script.write_text(SCRIPT.format(loader=_loader_source()))
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}  # the pipeline's slots may be CPUs
    args = [tmp_path / "staged", tmp_path / "pipeline", tmp_path / "in.npz", tmp_path / "out.npz"]
    run = subprocess.run(
        [sys.executable, script, *map(str, args)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    with np.load(tmp_path / "out.npz") as out:
        fresh = [out[f"arr_{i}"] for i in range(len(out.files))]
    here = [*exported(W, X), *pipeline(*flat)]
    assert_trees_equal(fresh, [np.asarray(v) for v in here])
    # Against JAX's own evaluation of the unsplit functions: to float rounding.
    assert_trees_close(here[:2], jax.tree_util.tree_leaves(jax.jit(vg)(W, X)))
    want = jax.value_and_grad(ex.loss_fn)(ex.params, ex.batch)
    assert_trees_close(here[2:], jax.tree_util.tree_leaves(want))


def test_the_export_runs_the_stage_programs_and_reads_back_equal(tmp_path):
    staged = pm.split(jax.value_and_grad(loss), W, X)
    exported = staged.export(tmp_path)
    # The same computations: each stage compiled alone by jax.jit, without its markers
    # (an exported module wraps them in its calling convention: another program to
    # XLA, so within ulps; tests/_exact.py). Read back, the same programs: the same bits.
    results: list[list] = []
    for stage in staged.stages:
        inputs = [
            (W, X)[ref.index] if ref.kind == "input" else results[ref.stage][ref.index]
            for ref in stage.inputs
        ]
        program = pm.passes.remove_markers(stage.closed_jaxpr)
        results.append(jax.jit(jax.extend.core.jaxpr_as_fun(program))(*inputs))
    per_stage = [results[ref.stage][ref.index] for ref in staged.outputs]
    assert_trees_within_ulps(exported(W, X), per_stage)
    assert_trees_equal(pm.load_staged(tmp_path)(W, X), exported(W, X))
    # The staged call evaluates equation by equation: another program (docs/export.md).
    assert_trees_within_ulps(exported(W, X), staged(W, X))


def test_the_manifest_wires_the_stages_and_keeps_their_markers_apart(tmp_path):
    staged = pm.split(jax.value_and_grad(loss), W, X)
    manifest = staged.export(tmp_path).manifest
    assert [s["name"] for s in manifest["stages"]] == ["a", "b", "b_backward", "a_backward"]
    assert manifest["stages"][2]["role"] == {"kind": "backward", "owner": "b"}
    assert manifest["stages"][1]["markers"] == [
        {"name": "b", "mark_type": "start"},
        {"name": "b", "mark_type": "end"},
    ]
    for k, (step, stage) in enumerate(zip(manifest["steps"], staged.stages)):
        assert step["writes"] == [f"stage/{k}/{o}" for o in range(len(stage.out_avals))]
        assert step["reads"] == [
            f"input/{r.index}" if r.kind == "input" else f"stage/{r.stage}/{r.index}"
            for r in stage.inputs
        ]
        entry = manifest["programs"][step["program"]]
        assert [a["shape"] for a in entry["in_avals"]] == [list(a.shape) for a in stage.in_avals]
        assert (tmp_path / entry["stablehlo"]).read_bytes()  # the module alone
    assert [i["name"] for i in manifest["inputs"]] == ["w", "x"]
    texts = [exp.mlir_module() for exp in pm.load_staged(tmp_path).programs.values()]
    assert not [t for t in texts if "optimization_barrier" in t or "custom_call" in t]


def test_keys_constants_and_inputs_returned_as_they_are(tmp_path):
    def f(key, x):
        key = pm.mark(key, name="a", mark_type="start")
        noise = pm.mark(jax.random.normal(key, x.shape), name="a", mark_type="end")
        return noise + x, x, 2.0

    key = jax.random.key(3)
    exported = pm.split(f, key, X).export(tmp_path)
    entry = exported.manifest["inputs"][0]["aval"]
    assert entry["dtype"] == "key<fry>" and entry["physical"] == {"shape": [2], "dtype": "uint32"}
    assert exported.manifest["constants"][0]["value"] == "const/2"
    got = exported(key, X)
    want = jax.jit(f)(key, X)
    assert_trees_close(got, [np.asarray(w) for w in want])
    assert got[1] is X  # an input returned as is, as the staged program does


def test_the_intro_example_of_the_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(_page_blocks()[0], namespace)
    want = jax.value_and_grad(namespace["loss"])(namespace["w"], namespace["x"])
    assert_trees_close([namespace["value"], namespace["grad"]], list(want))


def test_bad_directories_and_calls_are_refused_naming_the_culprit(tmp_path):
    with pytest.raises(pm.errors.ExportError, match=r"has no manifest\.json"):
        pm.load_staged(tmp_path)
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(pm.errors.ExportError, match="not an export"):
        pm.split(jax.value_and_grad(loss), W, X).export(tmp_path)
    good = tmp_path / "good"
    exported = pm.split(jax.value_and_grad(loss), W, X).export(good)
    with pytest.raises(pm.PipemarkError, match=r"Input 1 \(x\) has shape \(3, 2\)"):
        exported(W, X.T)
    with pytest.raises(pm.PipemarkError, match="takes 2 inputs"):
        exported(W)
    manifest = json.loads((good / "manifest.json").read_text())
    manifest["steps"][1]["reads"] = ["stage/7/0"]
    (good / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pm.errors.ExportError, match=r"Step 1 \('b'\) reads 'stage/7/0'"):
        pm.load_staged(good)
    manifest["format_version"] = 99
    (good / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pm.errors.ExportError, match="format_version 99"):
        pm.load_staged(good)


def test_a_stage_with_a_host_callback_is_refused_by_name(tmp_path):
    def f(x):
        x = pm.mark(pm.mark(x, name="ok", mark_type="start") * 2, name="ok", mark_type="end")
        x = pm.mark(x, name="calls_back", mark_type="start")
        y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return pm.mark(y, name="calls_back", mark_type="end")

    with pytest.raises(pm.errors.ExportError, match="Program 'calls_back' cannot be exported"):
        pm.split(f, X).export(tmp_path)
