"""The peak ``Pipeline.memory`` predicts for each cell of the accelerator targets on this
device, without running a step (the stage programs are compiled for their
temporaries; nothing else runs).

    python benchmarks/predicted_peaks.py --out benchmarks/results/predicted-tpu-v5e.json
    python benchmarks/predicted_peaks.py --size tiny --models gpt,nnx     # on CPU
    python benchmarks/predicted_peaks.py --size tiny --layers 4 --configs s4  # quicker

A ballast check (``accelerator.py --ballast``) bounds a step's whole peak by the rooms
it ran and ran out of memory in. When the prediction changes and the step does not, the
check still says whether the new prediction covers the step and by how much:
``benchmarks/_targets.py`` judges an older check's rooms against these predictions. Each
cell is a model of ``accelerator.py --model`` at 16 blocks (or ``--layers``) in a layout
of ``_targets.LAYOUTS`` (those of ``--configs``), with one row a microbatch (the
targets' runs: 8 rows at M 8, 16 at M 16), all in this process, one after another.
Each compilation takes about 40 s on a TPU v5e (the M 16 cells reuse the M 8 cells'
programs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accelerator
from _targets import LAYERS, LAYOUTS


def predict(model: str, config: str, microbatches: int, sizes: dict, device) -> dict:
    """One cell's predicted peak and buffers (``accelerator.predicted_memory``, as
    ``accelerator.py`` records them)."""
    sizes = dict(sizes, batch=microbatches)  # a row a microbatch
    start = time.perf_counter()
    with accelerator.kernel_mode(model, device.platform):
        _, pipe, params, batch = accelerator.prepare(config, sizes, microbatches, device, model)
        predicted = accelerator.predicted_memory(pipe, params, batch)
    cell = {"model": model, "config": config, "microbatches": microbatches, "sizes": sizes}
    return {**cell, **predicted, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    accelerator.add_size_arguments(parser)
    parser.add_argument("--models", default=",".join(accelerator.MODELS))
    configs = sorted({config for _, config, _ in LAYOUTS})
    parser.add_argument(
        "--configs", default=",".join(configs), help="the layouts' configurations to predict"
    )
    parser.add_argument("--out", help="write the predictions here as JSON")
    args = parser.parse_args(argv)
    import jax

    import pipemark as pm

    pm.set_lowering("barrier")  # as accelerator.py measures
    device = jax.devices()[0]
    sizes = accelerator.resolve_sizes(args, device.platform)
    sizes["layers"] = args.layers or LAYERS
    recorded = {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "date": f"{datetime.date.today()}",
    }
    shown = {k: v for k, v in sizes.items() if k not in ("layers", "batch")}
    blocks = f"{sizes['layers']} blocks of {shown}"
    print(f"{recorded['device_kind']}, JAX {recorded['jax']}, {recorded['date']}, {blocks}")
    print("| model | layout | configuration | predicted peak | predicted buffers | took |")
    print("|---|---|---|---:|---:|---:|")
    results, chosen = [], args.configs.split(",")
    for model in args.models.split(","):
        for label, config, microbatches in LAYOUTS:
            if config not in chosen:
                continue
            row = {**recorded, **predict(model, config, microbatches, sizes, device)}
            results.append(row)
            print(
                f"| {model} | {label} | {config} | {row['predicted_peak'] / 2**20:,.1f} MiB | "
                f"{row['predicted_buffers'] / 2**20:,.1f} MiB | {row['seconds']:.0f} s |",
                flush=True,
            )
            if args.out:  # after each cell: a run cut short keeps what it predicted
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
