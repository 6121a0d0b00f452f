"""What TensorFlow's two loops share (`keras_loop`'s Keras `fit` under Mirrored or MultiWorkerMirrored,
`parameter_servers`' chief): TensorFlow's import settings, the checkpoint's files, and the callback
that times each epoch, checks the replicas, prints rank 0's line and saves the checkpoint.

Like keras_loop, it imports nothing of torch."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .contract import Job, Run, World
from .errors import UserError
from .metrics import export_epoch
from .progress import say_epoch
from .replicas import check_replicas_agree, describe_rank
from .tracking import log_epoch

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def tensorflow():
    """TensorFlow, imported after the settings above (for modules that import it late)."""
    import tensorflow as tf

    return tf


class StrategyWorld(World, Protocol):
    """A TensorFlow rank's world (`keras_loop.KerasWorld`, `parameter_servers`' chief): what the
    manifest records of its strategy, beside `World`."""

    def record(self) -> dict: ...


WEIGHTS = "weights.h5"
OPTIMIZER = "optimizer.npz"


def save(model, folder: Path) -> None:
    model.save_weights(str(folder / WEIGHTS))
    np.savez(folder / OPTIMIZER, *[v.numpy() for v in model.optimizer.variables])


def load(model, folder: Path) -> None:
    """Weights and the optimizer's state (its step count and moments) from a checkpoint."""
    try:
        model.load_weights(str(folder / WEIGHTS))
        saved = np.load(folder / OPTIMIZER)
        model.optimizer.build(model.trainable_variables)
        variables = model.optimizer.variables
        if len(saved.files) != len(variables):
            raise ValueError(f"{len(saved.files)} optimizer variables saved, {len(variables)} here")
        for v, key in zip(variables, saved.files, strict=True):
            v.assign(saved[key])
    except (ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"the checkpoint in {folder} does not fit this model ({first}); resume it "
                        "with its own flags, or use another --name for a new run") from None


_Callback: Any  # Keras' Callback, where TensorFlow is installed
try:
    import tf_keras as _keras

    _Callback = _keras.callbacks.Callback
except ImportError:  # pragma: no cover - only where TensorFlow is missing
    _Callback = object


class EpochReport(_Callback):
    """Times each phase, checks the replicas, prints rank 0's line and saves the checkpoint.

    With `validate` (parameter servers, where Keras allows no batch-level callbacks and `fit`
    does not validate): the epoch's steps are timed whole, as processing, the first step is
    reported at the first epoch's end, and `validate()` gives the val_ metrics."""

    def __init__(self, job: Job, run: Run, world: StrategyWorld, store, samples: int, validate=None):
        super().__init__()
        self.job, self.run, self.world, self.store, self.samples = job, run, world, store, samples
        self.validate = validate
        self.first_step_reported = False

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()
        self.processing = self.validation = 0.0
        self.val_t0 = None

    def first_step(self) -> None:
        if not self.first_step_reported:
            self.first_step_reported = True
            self.job.report_first_step(self.run, self.world)

    def on_test_begin(self, logs=None):
        self.val_t0 = time.perf_counter()

    def on_test_end(self, logs=None):
        self.validation = time.perf_counter() - self.val_t0

    def on_epoch_end(self, epoch, logs=None):
        metrics = {k: float(v) for k, v in (logs or {}).items()}
        if self.validate is not None:
            self.processing = time.perf_counter() - self.t0
            self.first_step()
            self.val_t0 = time.perf_counter()
            metrics.update(self.validate())
            self.validation = time.perf_counter() - self.val_t0
        end = time.perf_counter()
        train_s = (end - self.t0) - self.validation
        metrics.update(epoch=epoch + 1, world_size=self.world.size, device="gpu" if self.world.use_gpu
                       else "cpu", worker_python=sys.executable, launcher=self.run.launcher,
                       dataflow_s=train_s - self.processing, processing_s=self.processing,
                       validation_s=self.validation, epoch_s=end - self.t0,
                       samples_per_s=self.samples / train_s)
        check = {**check_replicas_agree(self.world.gather(describe_rank(self.model.get_weights()))),
                 **self.world.record()}
        if self.world.rank == 0:
            say_epoch(self.job.name, epoch + 1, self.run.epochs, metrics)
            export_epoch(self.job.name, self.run.name, metrics, self.run.attempts)
        self.store.save(epoch + 1, metrics, lambda folder: save(self.model, folder), replicas=check)
        if self.world.rank == 0:
            log_epoch(self.job.name, self.run, metrics)


class StepTimedReport(EpochReport):
    """EpochReport that also times each step (where Keras allows batch-level callbacks)."""

    def on_train_batch_begin(self, batch, logs=None):
        self.b0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.processing += time.perf_counter() - self.b0
        self.first_step()
