"""Data-pipeline efficiency on a GPU: the autoencoder's training samples/s on its real input
pipeline (the job itself, one process, built-in frames) over the same model and step fed
synthetic uint8 batches already on the GPU. Prints both, their ratio (target: >= 0.9 for an
in-memory source on one H100 at batch 128) and the job's per-phase split; --json writes them.

    python tests/gpu/bench_pipeline.py [--batch-size 128] [--frames 6472] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "jobs"))

import torch  # noqa: E402
from ddp_autoencoder import AutoEncoder  # noqa: E402


def real(batch: int, frames: int, home: Path) -> dict:
    """The job alone on the GPU, 2 epochs; epoch 2's metrics (the first one warms up)."""
    cmd = [sys.executable, "jobs/ddp_autoencoder.py", "--use-gpu", "true", "--epochs", "2",
           "--batch-size", str(batch), "--limit", str(frames), "--name", "pipeline"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "DLC_HOME": str(home)},
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench_pipeline: the job failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads((home / "models" / "pipeline" / "manifest.json").read_text())["metrics"]


def synthetic(batch: int, steps: int, size=(120, 160)) -> float:
    """The seconds the job's step takes `steps` times on batches already on the GPU: no input
    pipeline at all."""
    device = torch.device("cuda")
    model = AutoEncoder().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch, 3, *size), dtype=torch.uint8, device=device)

    def step():
        y = x.float().div_(255.0)
        loss = torch.nn.functional.mse_loss(model(y), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(10):  # warm-up: cuDNN's algorithm choice, the allocator
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--frames", type=int, default=6472)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_pipeline: no CUDA device")
    with tempfile.TemporaryDirectory() as home:
        metrics = real(a.batch_size, a.frames, Path(home))
    steps = max(20, metrics["train_iters"])
    seconds = synthetic(a.batch_size, steps)
    fake = steps * a.batch_size / seconds
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "batch_size": a.batch_size, "frames": a.frames,
              "real_samples_per_s": metrics["samples_per_s"], "synthetic_samples_per_s": fake,
              "efficiency": metrics["samples_per_s"] / fake,
              "train_iters": metrics["train_iters"], "synthetic_steps": steps, "synthetic_s": seconds,
              "split": {k: metrics[k] for k in ("dataflow_s", "processing_s", "validation_s", "epoch_s")}}
    print(f"{result['device']}, batch {a.batch_size}: real pipeline {result['real_samples_per_s']:.0f} "
          f"samples/s, synthetic on-device {fake:.0f} samples/s, efficiency {result['efficiency']:.2f}")
    print(f"epoch split: {result['split']}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
