"""A job file's entry point: everything a job does besides its model, its data and its step (what
a job is, `Job`, and what it is given, `Run` and `World`: `contract`).

A job is a `Job` subclass (through `torch_loop.TorchJob` or `keras_loop.KerasJob`) and one line,
`run_from_command_line(MyJob())`. That

1. parses and checks the shared flags (`flags`), then the job's own (`Job.prepare`, on the
   driver, before any worker starts);
2. finds the launcher (`launch`): on Ray (`on_ray`) it plans the workers against the cluster,
   builds the ScalingConfig / RunConfig (`cluster`) and runs the job's trainer (TorchTrainer,
   HorovodTrainer or TensorflowTrainer); under torchrun, horovodrun, TF_CONFIG or alone
   (`in_process`) this process is one rank and trains itself;
3. on every rank restores the latest checkpoint of the run, trains the missing epochs, times
   each phase (`timing`), checks that the ranks' parameters agree (`replicas`) and saves a
   checkpoint per epoch (`store`);
4. publishes from the final checkpoint (`publish`): ONNX export, onnxruntime parity and the
   manifest (`onnx_export`), returned as data (`Published`) and recorded in the run's folder.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from . import flags, in_process, on_ray
from .contract import C, Job, W
from .errors import run_main

if TYPE_CHECKING:
    from .onnx_export import Published


def run_from_command_line(job: Job[W, C], argv: list[str] | None = None) -> None:
    """A job file's entry point: train_and_publish() with bad input turned into one line and exit 2."""
    run_main(lambda: train_and_publish(job, argv), job.name)


def parse_flags(job: Job[W, C], argv: list[str] | None = None) -> argparse.Namespace:
    """The shared flags and the job's own, parsed (a bad value: one line, exit 2)."""
    p = flags.parser(job.name, job.description, batch_size=job.batch_size, epochs=job.epochs,
                     lr=job.lr, launchers=job.launchers, worker_help=job.worker_help)
    job.add_flags(p)
    return p.parse_args(argv)


def train_and_publish(job: Job[W, C], argv: list[str] | None = None) -> Published | None:
    """Train and publish; the published model and manifest as data (None on ranks other than 0).
    From here on the shared flags travel typed (RunFlags), the job's own as its config (C)."""
    args = parse_flags(job, argv)
    settings = flags.RunFlags.of(args)
    launcher = job.launcher(settings, args)
    own = flags.own_params(args)  # what the run history records beside the shared flags
    if launcher == "ray":
        return on_ray.train_on_ray(job, settings, lambda: job.prepare(args), job.parameter_servers(args), own)
    return in_process.train_in_process(job, settings, lambda: job.prepare(args), launcher, own)
