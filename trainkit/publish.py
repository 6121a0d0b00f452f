"""Publishing a run: its final checkpoint -> a verified ONNX model and its manifest (through
`onnx_export`), the same under every launcher."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from . import tracking
from .contract import RUN_REPORTERS, C, Job, Run, Timeline, W
from .onnx_export import Published, verify_and_publish
from .progress import say
from .store import read_meta


def prepare_publishing(job: Job[W, C], config: C, attempts: Any = None) -> np.ndarray:
    """What publishing needs besides the final checkpoint: the held-out inputs; and the
    exporters imported. With `attempts` (on Ray): once the workers have taken their first step,
    so this does not compete with their start for the CPU."""
    if attempts is not None:
        import ray

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(
                "first_step_at" in start for start in ray.get(attempts.all.remote())):
            time.sleep(1)
    inputs = job.held_out(config)
    import onnxruntime  # noqa: F401

    if job.framework == "torch":
        import torch.onnx  # noqa: F401
    return inputs


def publish(job: Job[W, C], run: Run, config: C, folder: Path, where: str, restarts: dict,
            timeline: Timeline, inputs: np.ndarray | None = None) -> Published:
    """The final checkpoint -> a verified ONNX model + manifest in run.output. The manifest's
    timeline: when this run's first training step ended and how long export + verify took."""
    t0 = time.perf_counter()
    meta = read_meta(folder)
    world_size = meta["metrics"]["world_size"]  # after an elastic restart: the last epoch's
    inputs = job.held_out(config) if inputs is None else inputs
    output = Path(run.output)
    exported = job.export(folder, config, inputs, output)
    export_s = time.perf_counter() - t0  # the parity check times itself (parity.seconds)
    published = verify_and_publish(
        exported.model, output, job=job.name, framework=job.framework, inputs=inputs,
        reference=exported.reference, metrics=meta["metrics"], world_size=world_size,
        packages=job.packages, beside=exported.beside,
        extra={"launcher": run.launcher, **job.manifest(config, run), **exported.manifest,
               **meta.get("replicas", {}),
               "restarts": restarts, "tracking": tracking.check(run, meta["epoch"]),
               "timeline": timeline.for_manifest(export_s),
               "run": {**{f.name: getattr(run, f.name) for f in fields(run) if f.name not in RUN_REPORTERS},
                       "checkpoint": where, "epochs_trained": meta["epoch"],
                       "signature": meta.get("signature", {}), "data": job.describe(config)}},
        record_dir=None if "://" in run.storage_path else Path(run.storage_path) / run.name,
    )
    m = published.manifest
    say(job.name, f"ONNX parity: max abs diff {m['parity']['max_abs_diff']:.2e} "
                  f"(tolerance {m['parity']['tolerance']:g})")
    say(job.name, f"ONNX model: {output / published.model.name}")
    say(job.name, f"manifest:   {output / published.manifest_path.name}")
    say(job.name, f"published:  {published.model.parent} (sha256 {m['model_sha256'][:16]}...)")
    tracking.log_model(job.name, run, published, restarts.get("count", 0))
    return published
