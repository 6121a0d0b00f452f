"""The training harness: everything a job does besides its model, its data and its step.

A job is a `Job` subclass (through `torch_loop.TorchJob` or `keras_loop.KerasJob`) and one line,
`harness.run(MyJob())`. The harness then

1. parses and checks the shared flags (`flags`), then the job's own (`Job.prepare`, on the
   driver, before any worker starts);
2. finds the launcher (`launch`): on Ray it plans the workers against the cluster, builds the
   ScalingConfig / RunConfig (`cluster`) and runs the job's trainer (TorchTrainer,
   HorovodTrainer or TensorflowTrainer); under torchrun, horovodrun, TF_CONFIG or alone this
   process is one rank and trains itself;
3. on every rank restores the latest checkpoint of the run, trains the missing epochs, times
   each phase (`timing`) and saves a checkpoint per epoch (`store`);
4. publishes from the final checkpoint: ONNX export, onnxruntime parity and the manifest
   (`onnx_export`), returned as data (`Published`) and recorded in the run's folder.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from . import cluster, flags, launch
from .errors import run_main
from .onnx_export import Published, verify_and_publish
from .progress import say
from .store import FolderStore, RayStore, Store, precheck, read_meta


@dataclass(frozen=True)
class Run:
    """What every rank needs to know about the run (sent to Ray's workers with the job)."""

    job: str
    name: str
    launcher: str
    storage_path: str
    output: str
    epochs: int
    batch_size: int
    lr: float
    use_gpu: bool
    keep_checkpoints: int = 3
    attempts: object = None  # on Ray: the Attempts actor every start of the workers reports to


class Job:
    """What a job is: its name, frameworks and defaults here; its flags, data, model and step in
    the subclass. The framework base classes (`TorchJob`, `KerasJob`) supply `world`, `fit`,
    `load` and `export`."""

    name: str
    description: str
    framework: str  # "torch" | "tensorflow": the manifest's framework
    trainer: str  # the Ray trainer: "torch" | "horovod" | "tensorflow"
    launchers: tuple[str, ...]
    packages: tuple[str, ...] = ()  # further versions the manifest records
    batch_size: int = 128
    epochs: int = 1
    lr: float = 1e-3
    worker_help: str = "data-parallel workers (one process each)"
    # on Ray: the environment variable naming the interpreter its workers run (set per node: the
    # GPU image points TensorFlow's at its own virtualenv); None: the node's default interpreter
    worker_python_env: str | None = None

    # ---- the job's part
    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """The job's own flags."""

    def prepare(self, args: argparse.Namespace) -> dict:
        """Check the job's own flags and its data (one-line UserError); the config every rank gets."""
        raise NotImplementedError

    def describe(self, config: dict) -> str:
        raise NotImplementedError

    def train_size(self, config: dict) -> int:
        raise NotImplementedError

    def signature(self, config: dict) -> dict:
        """What a checkpoint must match to be resumed (model and data shapes)."""
        return {}

    def held_out(self, config: dict) -> np.ndarray:
        """Inputs the ONNX model is checked on against the framework (float32, a batch)."""
        raise NotImplementedError

    def launcher(self, args: argparse.Namespace) -> str:
        """The launcher this run uses: --launcher, else what the environment shows."""
        return launch.choose(args.launcher, self.launchers, self.name)

    def manifest(self, config: dict, run: Run) -> dict:
        """Further fields for the manifest."""
        return {}

    # ---- the framework's part
    def world(self, launcher: str, use_gpu: str | bool):
        raise NotImplementedError

    def fit(self, run: Run, config: dict, world=None) -> None:
        raise NotImplementedError

    def export(self, folder: Path, config: dict, inputs: np.ndarray, output: Path):
        """Load the checkpoint in `folder`, export it: (staged ONNX file, the framework's output)."""
        raise NotImplementedError

    # ---- shared by the frameworks' loops
    def store(self, run: Run, config: dict, world) -> Store:
        """Where this rank saves and restores: Ray Train's checkpoints, or the run's folder."""
        if run.launcher == "ray":  # Ray keeps run.keep_checkpoints (CheckpointConfig)
            return RayStore(self.name, run.name, self.signature(config), world.rank)
        return FolderStore(self.name, run.name, self.signature(config), world.rank,
                           run.storage_path, world.barrier, keep=run.keep_checkpoints)

    def resume(self, store: Store, run: Run, world, load: Callable[[Path], None]) -> int | None:
        """Restore the run's latest checkpoint with `load(folder)`: the epoch to go on from, or
        None when the run has trained all its epochs already."""
        start = 0
        with store.latest() as last:
            if last is not None:
                load(last.folder)
                start = last.epoch
                if world.rank == 0:
                    self.say(f"resuming after epoch {start} from {last.where}")
        if world.rank == 0 and run.attempts is not None:
            run.attempts.start.remote(start, world.size, time.time())
        elif world.rank == 0:
            self.started_at = getattr(self, "started_at", None) or time.time()
        if start < run.epochs:
            return start
        if world.rank == 0:
            self.say(f"run already trained {start} epoch(s); publishing its latest checkpoint "
                     "(raise --epochs to train on)")
        return None

    def stepped(self, run: Run, world) -> None:
        """The loops call this after each start's first training step: rank 0 tells Attempts on
        Ray, and keeps the time itself under the other launchers (it publishes there)."""
        if world.rank != 0:
            return
        if run.attempts is not None:
            run.attempts.first_step.remote(time.time())
        else:
            self.first_step_at = getattr(self, "first_step_at", None) or time.time()

    def say(self, message: str) -> None:
        say(self.name, message)


def run(job: Job, argv: list[str] | None = None) -> None:
    """A job file's entry point: main() with bad input turned into one line and exit 2."""
    run_main(lambda: main(job, argv), job.name)


def parse(job: Job, argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser(job.name, job.description, batch_size=job.batch_size, epochs=job.epochs,
                     lr=job.lr, launchers=job.launchers, worker_help=job.worker_help)
    job.add_flags(p)
    return p.parse_args(argv)


def main(job: Job, argv: list[str] | None = None) -> Published | None:
    """Train and publish; the published model and manifest as data (None on ranks other than 0)."""
    args = parse(job, argv)
    launcher = job.launcher(args)
    if launcher == "ray":
        return on_ray(job, args)
    return alone(job, args, launcher)


def make_run(job: Job, args: argparse.Namespace, launcher: str, use_gpu: bool, attempts=None) -> Run:
    return Run(job.name, args.name, launcher, args.storage_path, args.output, args.epochs,
               args.batch_size, args.lr, use_gpu, args.keep_checkpoints, attempts)


class Attempts:
    """Every start of a run's workers on Ray, as rank 0 saw it: the epoch it resumed after, the
    number of workers, when its first training step ended. A Ray actor pinned to the driver's
    node, so it outlives lost workers (Ray Train 2.60 tells the workers nothing of restarts)."""

    def __init__(self):
        self.starts: list[dict] = []

    def start(self, epoch: int, world_size: int, at: float) -> None:
        self.starts.append({"resumed_after_epoch": epoch, "world_size": world_size, "started_at": at})

    def first_step(self, at: float) -> None:
        if self.starts and "first_step_at" not in self.starts[-1]:
            self.starts[-1]["first_step_at"] = at

    def all(self) -> list[dict]:
        return self.starts


def restarts(starts: list[dict]) -> dict:
    """The manifest's account of restarts: how many, and after which epoch each resumed."""
    again = starts[1:]
    return {"count": len(again), "resumed_after_epochs": [s["resumed_after_epoch"] for s in again],
            "attempts": starts}


# ------------------------------------------------------------------ on Ray
def on_ray(job: Job, args: argparse.Namespace) -> Published:
    flags.resolve(args, job.name)
    trainer_class = ray_trainer(job.trainer)  # before anything imports Ray Train
    config = job.prepare(args)
    totals, nodes = cluster.connect(job.worker_python_env)
    plan = cluster.plan_workers(args.num_workers, args.use_gpu, totals, nodes,
                                placement=args.placement, elastic=job.trainer != "horovod")
    cluster.check_batch(args.batch_size, job.train_size(config), plan.num_workers)
    cluster.check_storage(args.storage_path)
    precheck(args.storage_path, job.name, args.name, job.signature(config))
    attempts = cluster.on_this_node(Attempts)
    run_ = make_run(job, args, "ray", plan.use_gpu, attempts)
    say(job.name, f"run {run_.name}: {job.describe(config)}; {plan.describe()}, batch "
                  f"{run_.batch_size} per worker, {run_.epochs} epoch(s); storage {run_.storage_path}")
    job.prepared_at = time.time()
    # Ray Train's controller looks at its workers every 2 s by default: a finished run waited up
    # to that long to be noticed (measured: a no-op TorchTrainer's fit() 13.7 s -> 10.4 s at 0.2 s).
    # Propagated by Ray Train to the controller and the workers; an operator's own value wins.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Ray Train's preemption watcher asks the cluster every 5 s whether a node is being drained
    # for preemption (a cloud's spot capacity, an autoscaler) and logs an error line on every run
    # as it starts (its arguments live in the object store while it may restart). Servers a team
    # owns are not preempted: a lost node is a failure, which --max-failures handles.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # the driver idles while the workers train: read the held-out inputs and import the exporters
    # meanwhile, not after training (on the 2-core machine: 1.7 s of every run's wall time)
    from concurrent.futures import ThreadPoolExecutor

    ahead = ThreadPoolExecutor(1, thread_name_prefix="publish-ahead").submit(ready_to_publish, job, config,
                                                                              attempts)
    trainer = trainer_class(
        ray_worker, train_loop_config={"job": job, "run": run_, "config": config},
        scaling_config=plan.scaling_config(train_v1=job.trainer == "horovod"),
        run_config=cluster.run_config(run_.name, run_.storage_path, keep=args.keep_checkpoints,
                                      max_failures=args.max_failures),
        **({"horovod_config": cluster.horovod_config()} if job.trainer == "horovod" else {}),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"run {run_.name} finished without a checkpoint")
    import ray

    again = restarts(ray.get(attempts.all.remote()))
    with result.checkpoint.as_directory() as d:
        published = publish(job, run_, config, Path(d), result.checkpoint.path, again, ahead.result())
    say(job.name, f"run {run_.name}: {again['count']} restart(s)" + (
        f", resumed after epoch(s) {', '.join(map(str, again['resumed_after_epochs']))}"
        if again["count"] else ""))
    return published


def ray_worker(loop_config: dict) -> None:
    """What every Ray Train worker runs."""
    # A Ray worker's heap holds Ray, Ray Train and their imports (about 450 000 objects the garbage
    # collector tracks, against a third of that after freezing): each full collection walks them
    # all. Frozen, the collector skips them (measured, Horovod job, 2 epochs: 0.54-0.60 s of
    # collections per worker down to 0.15-0.22 s).
    gc.freeze()
    quiet_ray_train()
    loop_config["job"].fit(loop_config["run"], loop_config["config"])


def quiet_ray_train() -> None:
    """Ray Train (V2) logs each report() whole, metrics and checkpoint, from every worker, at INFO
    on a logger named by its file: the harness prints the epoch line itself. Warnings stay."""
    context = sys.modules.get("ray.train.v2._internal.execution.context")
    if context is not None:
        logging.getLogger(context.__file__).setLevel(logging.WARNING)


def ray_trainer(kind: str):
    if kind == "torch":
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    if kind == "horovod":
        # Ray 2.60 trains with Train V2 by default, and V2's HorovodTrainer is only a stub that
        # raises ("HorovodTrainer is not supported"); V1 still runs Horovod. The switch is read
        # when Ray Train is first imported, which nothing has done before this point.
        if "ray.train" in sys.modules and os.environ.get("RAY_TRAIN_V2_ENABLED") != "0":
            raise RuntimeError("Ray Train was imported before the Horovod job could choose Train V1")
        os.environ["RAY_TRAIN_V2_ENABLED"] = "0"
        from ray.train.horovod import HorovodTrainer

        return HorovodTrainer
    from ray.train.tensorflow import TensorflowTrainer

    return TensorflowTrainer


# ------------------------------------------------------------------ torchrun, horovodrun, TF_CONFIG, alone
def alone(job: Job, args: argparse.Namespace, launcher: str) -> Published | None:
    """This process is one rank of a plain launcher (or the only one): train, then rank 0 publishes."""
    world = job.world(launcher, args.use_gpu)
    try:
        args.name = world.agree(args.name or flags.default_name(job.name))  # one name on every rank
        flags.resolve(args, job.name)
        config = job.prepare(args)
        cluster.check_batch(args.batch_size, job.train_size(config), world.size)
        run_ = make_run(job, args, launcher, world.use_gpu)
        job.prepared_at = time.time()
        if world.rank == 0:
            say(job.name, f"run {run_.name} under {launcher}: {job.describe(config)}; {world.size} "
                          f"process(es) on {world.device_kind}, batch {run_.batch_size} per process, "
                          f"{run_.epochs} epoch(s); storage {run_.storage_path}")
        job.fit(run_, config, world)
        if world.rank != 0:
            return None
        store = job.store(run_, config, world)
        with store.latest() as last:
            # torchrun restarts its processes itself (--max-restarts) and says how often
            count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
            return publish(job, run_, config, last.folder, last.where, {"count": count})
    finally:
        world.shutdown()


# ------------------------------------------------------------------ publishing
def ready_to_publish(job: Job, config: dict, attempts=None) -> np.ndarray:
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


def publish(job: Job, run_: Run, config: dict, folder: Path, where: str, again: dict,
            inputs: np.ndarray | None = None) -> Published:
    """The final checkpoint -> a verified ONNX model + manifest in run.output. The manifest's
    timeline: when this run's first training step ended and how long export + verify took."""
    t0 = time.perf_counter()
    starts = again.get("attempts") or [{}]
    first_step_at = starts[0].get("first_step_at") or getattr(job, "first_step_at", None)
    from . import IMPORTED_AT

    # where a start's time goes: this process (Ray's job driver, or rank 0) reached the harness,
    # had checked its flags and data, the workers entered training (model built, checkpoint
    # restored), the first step ended
    timeline = {"imported_at": IMPORTED_AT,
                "prepared_at": getattr(job, "prepared_at", None),
                "workers_started_at": starts[0].get("started_at") or getattr(job, "started_at", None),
                "first_step_at": first_step_at}
    meta = read_meta(folder)
    world_size = meta["metrics"]["world_size"]  # after an elastic restart: the last epoch's
    inputs = job.held_out(config) if inputs is None else inputs
    output = Path(run_.output)
    staged, reference = job.export(folder, config, inputs, output)
    export_s = time.perf_counter() - t0  # the parity check times itself (parity.seconds)
    published = verify_and_publish(
        staged, output, job=job.name, framework=job.framework, inputs=inputs, reference=reference,
        metrics=meta["metrics"], world_size=world_size, packages=job.packages,
        extra={"launcher": run_.launcher, **job.manifest(config, run_), **meta.get("replicas", {}),
               "restarts": again,
               "timeline": {**timeline, "export_s": export_s},
               "run": {**{f.name: getattr(run_, f.name) for f in fields(run_) if f.name != "attempts"},
                       "checkpoint": where, "epochs_trained": meta["epoch"],
                       "signature": meta.get("signature", {}), "data": job.describe(config)}},
        record_dir=None if "://" in run_.storage_path else Path(run_.storage_path) / run_.name,
    )
    m = published.manifest
    say(job.name, f"ONNX parity: max abs diff {m['parity']['max_abs_diff']:.2e} "
                  f"(tolerance {m['parity']['tolerance']:g})")
    say(job.name, f"ONNX model: {output / published.model.name}")
    say(job.name, f"manifest:   {output / published.manifest_path.name}")
    say(job.name, f"published:  {published.model.parent} (sha256 {m['model_sha256'][:16]}...)")
    return published


def digest(arrays) -> str:
    """sha256 over a model's parameter arrays: equal on every rank when the replicas agree."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def replicas(found: list[str]) -> dict:
    """The check every job makes after each epoch: all ranks hold the same parameters. `found`:
    each rank's "<host> <runtime> <digest>" (rank order), from `replica()` gathered over the world."""
    hosts, runtimes, digests = zip(*(f.split(" ", 2) for f in found), strict=True)
    in_sync = len(set(digests)) == 1
    if not in_sync:
        raise RuntimeError(f"ranks ended the epoch with different parameters: {list(digests)}")
    return {"replicas_in_sync": in_sync, "replica_digests": list(digests), "replica_hosts": list(hosts),
            "replica_runtimes": list(runtimes)}


def replica(arrays) -> str:
    """This rank's part of the replica check: its host, how Ray runs there (DLC_RAY_RUNTIME, set by
    the node's dlc-ray service: docker or host; "-" elsewhere) and its parameters' digest."""
    return f"{socket.gethostname()} {os.environ.get('DLC_RAY_RUNTIME') or '-'} {digest(arrays)}"


# the harness's own metrics; the rest are the job's
COUNTERS = {"epoch", "world_size", "device", "worker_python", "launcher", "backend", "train_iters",
            "val_iters", "iters_per_epoch", "samples_per_s", "dataflow_s", "processing_s", "allreduce_s",
            "validation_s", "epoch_s", "gpu_memory_peak_mb"}


def progress(job: str, epoch: int, epochs: int, metrics: dict) -> None:
    """The per-epoch line rank 0 prints: the metrics, then where the time went."""
    from .timing import split

    shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in COUNTERS)
    say(job, f"epoch {epoch}/{epochs}: {shown} {metrics['samples_per_s']:.1f} samples/s "
             f"{metrics['epoch_s']:.1f} s ({split(metrics)})")

