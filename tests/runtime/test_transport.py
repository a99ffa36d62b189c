"""The in-process transport's byte count: what a pipeline copies between its slots in
one process, against the bytes of the values that cross a stage boundary, counted by
hand from the model (multi-process transfers: tests/runtime/test_distributed.py); and
what a failed transfer between processes and the watchdog say, with and without an
error another process published (pipemark.failures)."""

from __future__ import annotations

import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pipemark as pm
from pipemark.failures import Failure
from pipemark.runtime.devices import transport as transport_module
from pipemark.runtime.devices.placement import device_slot, mesh_slot
from pipemark.runtime.devices.transport import CollectiveTransport, InProcessTransport, Watchdog

WIDTH, ROWS = 16, 32


def test_in_process_copies_count_each_value_once_by_its_global_size():
    devices = jax.devices()
    mesh = Mesh(np.array(devices[4:8]).reshape(2, 2), ("data", "model"))
    transport = InProcessTransport()
    values = [jnp.ones((2, 8, WIDTH), jnp.float32), jnp.ones((2, 3), jnp.int8)]
    moved = transport.move(values, (), device_slot(devices[0]), mesh_slot(mesh, "data"), None)
    # Replicated over "model", each value lands on two devices, and counts once.
    assert moved[0].sharding == NamedSharding(mesh, P("data"))
    assert transport.bytes_sent == transport.bytes_received == 2 * 8 * WIDTH * 4 + 6


def test_in_process_counts_add_up_across_threads():
    devices = jax.devices()
    transport = InProcessTransport()
    value = jnp.ones((4,), jnp.float32)
    source, target = device_slot(devices[0]), device_slot(devices[1])

    def copy_many() -> None:
        for _ in range(200):
            transport.move([value], (), source, target, None)

    threads = [threading.Thread(target=copy_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert transport.bytes_received == 4 * 200 * 16


def _two_stage_mlp():
    """Two residual tanh layers, a stage each: the forward hands ``x`` on, the backward
    hands its cotangent back; nothing else crosses."""
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / 4, jnp.float32) for _ in range(2)]
    batch = jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)

    def loss_fn(params, x):
        for i, w in enumerate(params):
            if i:
                pm.mark_pipeline_boundary()
            x = x + jnp.tanh(x @ w)
        return jnp.mean(x**2)

    return loss_fn, params, batch


def test_a_pipeline_on_sub_meshes_copies_exactly_its_boundary_bytes():
    loss_fn, params, batch = _two_stage_mlp()
    # Every microbatch's rows, each replica's share, cross once each way.
    boundary = 2 * ROWS * WIDTH * 4
    for shape, names in (((2, 2, 2), ("stage", "data", "model")), ((2, 4), ("stage", "data"))):
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            pipe = pm.pipeline_value_and_grad(
                loss_fn, num_microbatches=4, schedule=schedule, mesh=mesh
            )
            _, timings = pipe.timed_call(params, batch)
            assert timings["bytes_copied"] == boundary, (shape, schedule)


def test_one_device_per_stage_copies_the_same_and_one_stage_nothing():
    loss_fn, params, batch = _two_stage_mlp()
    for devices, num_stages, boundary in ((2, 2, 2 * ROWS * WIDTH * 4), (1, 1, 0)):
        pipe = pm.pipeline_value_and_grad(
            loss_fn, num_stages=num_stages, num_microbatches=2, devices=jax.devices()[:devices]
        )
        _, timings = pipe.timed_call(params, batch)
        assert timings["bytes_copied"] == boundary, devices


def _failed_transfer(error: Exception) -> str:
    """The message of process 0's transfer to process 1 failing with ``error``."""

    def program(arrays):
        raise error

    transport = CollectiveTransport(Watchdog(None, 0), 0)
    peer = types.SimpleNamespace(process_index=1)
    with pytest.raises(pm.errors.ProcessError) as raised:
        transport._transfer(program, [], ("sending", "the outputs of stage 's0'", "to", peer))
    assert raised.value.__cause__ is error
    return str(raised.value)


def test_a_failed_transfer_names_the_error_the_other_process_published(monkeypatch):
    gloo = ValueError("UNKNOWN: Gloo collective permute failed: Connection closed by peer")
    monkeypatch.setattr(transport_module, "peer_failures", lambda me: [])
    assert _failed_transfer(gloo) == (
        "process 0: the transfer sending the outputs of stage 's0' to process 1 failed; that "
        "process has probably died or raised (ValueError: UNKNOWN: Gloo collective permute "
        "failed: Connection closed by peer)."
    )
    boom = Failure(1, "ValueError: boom in process 1")
    monkeypatch.setattr(transport_module, "peer_failures", lambda me: [boom] if me == 0 else [])
    assert _failed_transfer(gloo) == (
        "process 0: the transfer sending the outputs of stage 's0' to process 1 failed: "
        "process 1 raised ValueError: boom in process 1."
    )


def test_the_watchdog_names_the_error_the_other_process_published(monkeypatch):
    watchdog = Watchdog(5.0, 0)
    what = "sending the outputs of stage 's0' (microbatch 0) to process 1"
    monkeypatch.setattr(transport_module, "peer_failures", lambda me: [])
    message, failure = watchdog._stopping(lambda: what)
    assert message == (
        f"pipemark: process 0 waited more than 5 s {what}; that process has died, raised or "
        "hangs. Stopping this process (PipelineOptions.timeout_s)."
    )
    # What it waited for, published in turn: it did not raise, and followed process 1.
    assert (failure.process, failure.raised, failure.reaction) == (0, False, True)
    assert str(failure) == f"process 0 waited more than 5 s {what}"
    boom = Failure(1, "JaxRuntimeError: UNIMPLEMENTED: Cross-host transfers are not supported")
    monkeypatch.setattr(transport_module, "peer_failures", lambda me: [boom])
    message, _ = watchdog._stopping(what)
    assert message == (
        f"pipemark: process 0 waited more than 5 s {what}; process 1 raised JaxRuntimeError: "
        "UNIMPLEMENTED: Cross-host transfers are not supported. Stopping this process "
        "(PipelineOptions.timeout_s)."
    )
