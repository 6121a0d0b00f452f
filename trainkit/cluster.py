"""The Ray side every job shares: connect, choose CPU or GPU, refuse what the cluster can't run.

A trainer asked for more workers than the cluster has slots waits forever in Ray; `plan_workers`
checks the cluster's totals first and fails fast with one line instead.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

DEFAULT_HOME = Path(os.environ.get("DLC_HOME", "~/dlcluster")).expanduser()


def default_storage() -> str:
    """Where Ray Train keeps runs and checkpoints: DLC_STORAGE_PATH, else ~/dlcluster/runs.

    On a multi-node cluster this must be storage every node sees (NFS or a cloud URI);
    `make cluster-up` sets DLC_STORAGE_PATH on the nodes.
    """
    return os.environ.get("DLC_STORAGE_PATH") or str(DEFAULT_HOME / "runs")


def default_output(name: str) -> Path:
    """Where a job's verified ONNX model and manifest land: DLC_MODELS/<name>."""
    return Path(os.environ.get("DLC_MODELS", DEFAULT_HOME / "models")).expanduser() / name


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where the help text says it (default None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


PLACEMENTS = ("PACK", "SPREAD", "STRICT_SPREAD")


def num_workers_arg(text: str) -> int:
    """--num-workers: a count, or `auto` (0): one worker per GPU, else one per node."""
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of workers or auto") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1 (or auto)")
    return n


def add_run_flags(parser, job: str, resumes: bool = False) -> None:
    """--storage-path, --name and --output, the same for every job."""
    parser.add_argument("--storage-path", default=None,
                        help="where Ray Train keeps runs and checkpoints; shared storage on a "
                             "multi-node cluster (default: $DLC_STORAGE_PATH or ~/dlcluster/runs)")
    parser.add_argument("--name", default=None,
                        help=f"run name (default: {job}-<date>-<time>)"
                             + ("; a rerun with the same name resumes from its latest checkpoint"
                                if resumes else ""))
    parser.add_argument("--output", default=None,
                        help="folder for model.onnx and manifest.json (default: $DLC_MODELS/<name> "
                             "or ~/dlcluster/models/<name>)")
    parser.add_argument("--placement", default="SPREAD", choices=PLACEMENTS,
                        help="how Ray places the workers: SPREAD (over as many nodes as it can), "
                             "PACK (on as few nodes as it can), STRICT_SPREAD (one per node; "
                             "workers <= nodes)")


def resolve_run_flags(args, job: str):
    """Fill in the defaults of add_run_flags' flags as absolute paths."""
    args.name = args.name or time.strftime(f"{job}-%Y%m%d-%H%M%S")
    args.storage_path = str(Path(args.storage_path or default_storage()).expanduser().resolve())
    args.output = (Path(args.output).expanduser().resolve() if args.output
                   else default_output(args.name))
    return args


def connect() -> tuple[dict, int]:
    """Join the Ray cluster (RAY_ADDRESS, as `ray job submit` sets it): its resource totals and
    how many nodes are alive."""
    import ray

    if not ray.is_initialized():
        ray.init(log_to_driver=True)
    return ray.cluster_resources(), sum(1 for n in ray.nodes() if n.get("Alive"))


@dataclass(frozen=True)
class WorkerPlan:
    num_workers: int
    use_gpu: bool
    cpus_per_worker: float
    placement: str = "SPREAD"

    def describe(self) -> str:
        return f"{self.num_workers} worker(s) on {'GPU' if self.use_gpu else 'CPU'}"


def plan_workers(num_workers: int, use_gpu: str, totals: dict, nodes: int,
                 cpus_per_worker: float = 1.0, placement: str = "SPREAD") -> WorkerPlan:
    """Check `--num-workers`, `--use-gpu auto|true|false` and `--placement` against the cluster.
    `--num-workers auto` (0) trains across the whole cluster: one worker per GPU when GPUs are
    used, else one per node (as far as the CPUs go)."""
    if num_workers == 0:
        gpus_total = int(totals.get("GPU", 0))
        if use_gpu != "false" and gpus_total > 0:
            num_workers = gpus_total
        else:
            num_workers = max(1, min(nodes, int(totals.get("CPU", 0) // cpus_per_worker)))
    if num_workers < 1:
        raise UserError(f"--num-workers {num_workers} must be at least 1")
    if placement == "STRICT_SPREAD" and num_workers > nodes:
        raise UserError(f"--placement STRICT_SPREAD puts one worker on each node, but --num-workers "
                        f"{num_workers} is more than the cluster's {nodes} node(s); use "
                        f"--num-workers <= {nodes} or --placement SPREAD")
    gpus = int(totals.get("GPU", 0))
    cpus = totals.get("CPU", 0)
    if use_gpu == "auto":
        gpu = gpus >= num_workers
    elif use_gpu in ("true", "false"):
        gpu = use_gpu == "true"
    else:
        raise UserError(f"--use-gpu {use_gpu!r} must be auto, true or false")
    if gpu and gpus < num_workers:
        raise UserError(f"--use-gpu true with --num-workers {num_workers} needs {num_workers} GPUs "
                        f"but the Ray cluster has {gpus} ({nodes} node(s)); use --use-gpu false "
                        f"or --num-workers <= {gpus}")
    need = num_workers * cpus_per_worker
    if need > cpus:
        fit = int(cpus // cpus_per_worker)
        raise UserError(f"--num-workers {num_workers} needs {need:g} CPUs but the Ray cluster has "
                        f"{cpus:g} in all ({nodes} node(s)); use --num-workers <= {fit} or add nodes")
    return WorkerPlan(num_workers, gpu, cpus_per_worker, placement)


def check_batch(batch_size: int, n_train: int, num_workers: int) -> int:
    """Each worker's share of the training set must hold at least one full batch."""
    share = n_train // num_workers
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    if batch_size > share:
        raise UserError(f"--batch-size {batch_size} is larger than each worker's share of the "
                        f"training set ({share} samples: {n_train} over {num_workers} workers); "
                        f"use --batch-size <= {max(share, 1)}, fewer workers or more data")
    return share
