"""Per-phase timing of an epoch, named as PyTorch-Ignite's profilers name them.

- dataflow_s:   waiting for the next batch (the input pipeline, as the training loop sees it)
- processing_s: the step: forward, backward, optimizer, the gradient all-reduce included
- allreduce_s:  the gradient all-reduce alone, where the framework exposes it (a DDP comm hook:
                summed over buckets, overlapping the backward pass; Horovod: waiting in
                `optimizer.synchronize()`); part of processing_s
- validation_s: the validation pass
- epoch_s:      the training pass plus validation; dataflow + processing + validation add up
                to it (the loop's own bookkeeping is the small rest)

On a GPU each step ends with `torch.cuda.synchronize()`, so processing is the device's time and
not only the time to queue kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

PHASES = ("dataflow_s", "processing_s", "allreduce_s", "validation_s", "epoch_s")


class PhaseTimer:
    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync or (lambda: None)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.t0 = time.perf_counter()

    def batches(self, loader: Iterable) -> Iterator:
        """The loader's batches; the time spent waiting for each is dataflow."""
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self.seconds["dataflow_s"] += time.perf_counter() - t
                return
            self.seconds["dataflow_s"] += time.perf_counter() - t
            yield batch

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - t

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def done(self) -> dict[str, float]:
        self.sync()
        self.seconds["epoch_s"] = time.perf_counter() - self.t0
        return dict(self.seconds)

    @property
    def train_s(self) -> float:
        return self.seconds["dataflow_s"] + self.seconds["processing_s"]


def split(metrics: dict) -> str:
    """The progress line's part that shows where an epoch went."""
    return (f"dataflow {metrics['dataflow_s']:.1f} s, processing {metrics['processing_s']:.1f} s"
            + (f" (all-reduce {metrics['allreduce_s']:.1f} s)" if metrics.get("allreduce_s") else "")
            + f", validation {metrics['validation_s']:.1f} s")
