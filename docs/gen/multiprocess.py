"""The four-process example of docs/processes.md:

    python -m pipemark.launch -n 4 docs/gen/multiprocess.py

Every process runs this same script. tests/runtime/test_distributed.py runs it and
checks that it prints what the page shows.
"""

from pipemark.launch import initialize

initialize()  # first: before anything else touches JAX

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pipemark as pm  # noqa: E402
from pipemark import examples  # noqa: E402

ex = examples.mlp(num_layers=4, width=64, batch=32)
# jax.devices() is every process's devices: stage i runs on devices[i], in process i.
step = pm.pipeline_value_and_grad(ex.loss_fn, num_microbatches=8, schedule="1f1b")
(loss, grads), timings = step.timed_call(ex.params, ex.batch)

# Every process has the whole result; process 0 reports.
if jax.process_index() == 0:
    plan = step.plan(ex.params, ex.batch)
    for index in sorted(plan.units):
        name = plan.staged.stages[index].name
        print(f"{name:<16} runs in process {plan.slot(index).process}")
    want_loss, want_grads = jax.value_and_grad(ex.loss_fn)(ex.params, ex.batch)
    close = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads))
    )
    # Rounded: the page shows these lines, and the last digits of a float32 sum may
    # differ from machine to machine.
    print(f"loss {float(loss):.3f}, jax.value_and_grad's {float(want_loss):.3f}")
    print(f"gradients equal to jax.value_and_grad's (rtol 1e-5): {close}")
    print(f"process 0 received {timings['bytes_received']:,} bytes from process 1 per step")
