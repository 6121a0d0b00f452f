"""Progress lines from the jobs, printed once.

Ray Train V2 patches `print` on its workers and, when stdout is redirected (as on a Ray
worker), both prints and logs each line, so every line shows up twice in the job's log.
Writing to the process's own stdout sidesteps the patch.
"""

import sys


def say(job: str, message: str) -> None:
    print(f"[{job}] {message}", file=sys.__stdout__, flush=True)


# the harness's own metrics; the rest are the job's
COUNTERS = {"epoch", "world_size", "device", "worker_python", "launcher", "backend", "train_iters",
            "val_iters", "iters_per_epoch", "samples_per_s", "dataflow_s", "processing_s", "allreduce_s",
            "validation_s", "epoch_s", "gpu_memory_peak_mb"}


def say_epoch(job: str, epoch: int, epochs: int, metrics: dict) -> None:
    """The per-epoch line rank 0 prints: the metrics, then where the time went."""
    from .timing import split

    shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in COUNTERS)
    say(job, f"epoch {epoch}/{epochs}: {shown} {metrics['samples_per_s']:.1f} samples/s "
             f"{metrics['epoch_s']:.1f} s ({split(metrics)})")
