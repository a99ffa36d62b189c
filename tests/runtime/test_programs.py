"""Tests of pipemark.runtime.memory.programs: the compiled stage programs of a plan are those
its calls run (nothing compiles twice, either way round), and their memory analysis
counts what the program takes and returns, checked against the model's own arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pipemark as pm
from pipemark import examples
from pipemark.caches import clear_caches
from pipemark.errors import PipemarkError
from tests.runtime._compiles import compilations


def _bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def _placed(ex, device):
    return jax.device_put(ex.params, device), jax.device_put(ex.batch, device)


def test_after_a_call_nothing_compiles_again_and_the_names_follow_the_schedule():
    clear_caches()
    ex = examples.mlp(num_layers=4, width=5, batch=8)
    params, batch = _placed(ex, jax.devices()[0])
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=2, num_microbatches=2, devices=jax.devices()[:2]
    )
    jax.block_until_ready(pipe(params, batch))
    with compilations() as compiled:
        programs = pipe.compiled_programs(params, batch)
    assert compiled == []
    # 1F1B on 2 stages: stage 1's forward and backward run as one program.
    assert list(programs) == ["stage0", "stage1+stage1_backward", "stage0_backward"]
    assert all(isinstance(p, jax.stages.Compiled) for p in programs.values())


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_compiled_before_the_first_call_the_call_compiles_none_of_them(num_microbatches):
    # With one microbatch the program keeps no accumulators: the call passes none.
    clear_caches()
    ex = examples.mlp(num_layers=2, width=6, batch=4)
    params, batch = _placed(ex, jax.devices()[0])
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=1, num_microbatches=num_microbatches, devices=jax.devices()[:1]
    )
    with compilations() as before:
        pipe.compiled_programs(params, batch)
    assert before.count("jit(run)") == 1
    with compilations() as compiled:
        jax.block_until_ready(pipe(params, batch))
    assert "jit(run)" not in compiled


def test_one_stage_memory_analysis_counts_parameters_batch_and_gradients():
    ex = examples.mlp(num_layers=3, width=16, batch=8)
    params, batch = _placed(ex, jax.devices()[0])
    pipe = pm.pipeline_value_and_grad(
        ex.loss_fn, num_stages=1, num_microbatches=1, devices=jax.devices()[:1]
    )
    (program,) = pipe.compiled_programs(params, batch).values()
    memory = program.memory_analysis()
    # Arguments: the parameters, the batch and the scale (4 bytes): with one microbatch
    # the program keeps no accumulators (Unit.starts).
    weights, data = _bytes(ex.params), _bytes(ex.batch)
    assert memory.argument_size_in_bytes == weights + data + 4
    # Outputs: the loss and gradients (the backend may add a table of their addresses).
    assert weights + 4 <= memory.output_size_in_bytes <= weights + 4 + 8 * 16


def test_stages_on_sub_meshes_are_refused():
    ex = examples.tensor_parallel_mlp(num_layers=2, width=8, batch=8, num_stages=2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "model"))
    pipe = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=2, mesh=mesh)
    with pytest.raises(PipemarkError, match="sub-meshes"):
        pipe.compiled_programs(*ex.args)
