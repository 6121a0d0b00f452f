"""The `ray` launcher: this process is the Ray job's driver. It checks the flags, the data and
the cluster, plans the workers, runs the job's Ray trainer (TorchTrainer, HorovodTrainer or
TensorflowTrainer) whose workers run `ray_worker`, and publishes from the final checkpoint."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import cluster, flags, tracking
from .contract import C, Job, Run, Timeline, W
from .errors import UserError
from .metrics import hold_until_exported, set_gauges
from .onnx_export import Published
from .progress import say
from .publish import prepare_publishing, publish
from .store import Restored, hold_run, precheck


class Attempts:
    """Every start of a run's workers on Ray, as rank 0 saw it: the epoch it resumed after, the
    number of workers, when its first training step ended; and the run's training metrics as
    Prometheus series (trainkit.metrics). A Ray actor pinned to the driver's node, so it outlives
    lost workers (Ray Train 2.60 tells the workers nothing of restarts) and the run's last epoch."""

    def __init__(self) -> None:
        self.starts: list[dict] = []
        self.tracking: list[str] = []  # why the run's logging stopped on a worker, first first
        self.exported: float | None = None  # the last epoch whose metrics this actor set

    def tracking_stopped(self, reason: str) -> None:
        self.tracking.append(reason)

    def tracking_reasons(self) -> list[str]:
        return self.tracking

    def start(self, epoch: int, world_size: int, at: float) -> None:
        self.starts.append({"resumed_after_epoch": epoch, "world_size": world_size, "started_at": at})

    def first_step(self, at: float) -> None:
        if self.starts and "first_step_at" not in self.starts[-1]:
            self.starts[-1]["first_step_at"] = at

    def all(self) -> list[dict]:
        return self.starts

    def export(self, job: str, run: str, metrics: dict) -> None:
        if set_gauges(job, run, metrics, starts=len(self.starts) or None):
            self.exported = metrics["epoch"]

    def last_exported(self) -> float | None:
        return self.exported


def restarts_summary(starts: list[dict]) -> dict:
    """The manifest's account of restarts: how many, and after which epoch each resumed."""
    restarted = starts[1:]
    return {"count": len(restarted), "resumed_after_epochs": [s["resumed_after_epoch"] for s in restarted],
            "attempts": starts}


def train_on_ray(job: Job[W, C], settings: flags.RunFlags, prepare: Callable[[], C], num_ps: int,
                 own: dict[str, str]) -> Published:
    """This process is the Ray job's driver. `prepare`: the job's config from its own flags (`own`:
    them as the run history records them); `num_ps`: the parameter servers its flags ask for
    (TensorFlow's ParameterServerStrategy: its roles are the harness's actors, not a Ray trainer's)."""
    settings = settings.resolved(job.name)
    parameter_servers = num_ps > 0
    if parameter_servers and isinstance(settings.num_workers, tuple):
        raise UserError(f"--num-workers {'-'.join(map(str, settings.num_workers))}: a parameter-server run "
                        f"goes on with fewer workers by itself; give one count, e.g. --num-workers "
                        f"{settings.num_workers[1]}")
    trainer_class = None if parameter_servers else ray_trainer_class(job.trainer)  # before anything
    config = prepare()  # imports Ray Train
    totals, nodes = cluster.connect(job.worker_python_env)
    plan = cluster.plan_workers(settings.num_workers, settings.use_gpu, totals, nodes,
                                placement=settings.placement, elastic=job.trainer != "horovod")
    if parameter_servers:
        from .parameter_servers import check_roles

        check_roles(num_ps, nodes)
    cluster.check_batch(settings.batch_size, job.train_size(config), plan.num_workers)
    cluster.check_storage(settings.storage_path)
    precheck(settings.storage_path, job.name, settings.name, job.signature(config))
    with hold_run(settings.storage_path, settings.name):  # a second run of this --name: one line
        attempts = cluster.on_this_node(Attempts)
        run = tracking.start(job, settings, own, Run.from_flags(job, settings, "ray", plan.use_gpu,
                                                                attempts=attempts), plan.num_workers)
        roles = f", {num_ps} parameter server(s) and a chief" if parameter_servers else ""
        say(job.name, f"run {run.name}: {job.describe(config)}; {plan.describe()}{roles}, batch "
                      f"{run.batch_size} per worker, {run.epochs} epoch(s); storage {run.storage_path}")
        timeline = Timeline()
        timeline.mark_prepared()
        with tracking.ended_if_failed(run):
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

            held_out = ThreadPoolExecutor(1, thread_name_prefix="publish-ahead").submit(
                prepare_publishing, job, config, attempts)
            if parameter_servers:
                from .parameter_servers import fit_on_ray

                final = fit_on_ray(job, run, config, plan, num_ps, settings.max_failures)
            else:
                assert trainer_class is not None  # found before anything, above
                trainer = trainer_class(
                    ray_worker, train_loop_config={"job": job, "run": run, "config": config},
                    scaling_config=plan.scaling_config(train_v1=job.trainer == "horovod"),
                    run_config=cluster.run_config(run.name, run.storage_path, keep=settings.keep_checkpoints,
                                                  max_failures=settings.max_failures),
                    **({"horovod_config": cluster.horovod_config()} if job.trainer == "horovod" else {}),
                )
                final = ray_checkpoint(trainer.fit(), run.name)
            import ray

            restarts = restarts_summary(ray.get(attempts.all.remote()))
            tracking.stopped_on_workers(run, ray.get(attempts.tracking_reasons.remote()))
            first_start = restarts["attempts"][0] if restarts["attempts"] else {}
            timeline.workers_started_at = first_start.get("started_at")
            timeline.first_step_at = first_start.get("first_step_at")
            with final as last:
                if last is None:
                    raise RuntimeError(f"run {run.name} finished without a checkpoint")
                published = publish(job, run, config, last.folder, last.where, restarts, timeline,
                                    held_out.result())
            # the Attempts actor holds the run's series and ends with this driver: not before its
            # node's agent has the last epoch (seconds only after a short run; docs/metrics.md)
            exported = ray.get(attempts.last_exported.remote())
            waited = hold_until_exported(run.name, exported) if exported is not None else None
            if waited is not None and waited >= 1:
                say(job.name, f"run {run.name}: {waited:.1f} s until Ray's metrics agent had its last epoch")
            say(job.name, f"run {run.name}: {restarts['count']} restart(s)" + (
                f", resumed after epoch(s) {', '.join(map(str, restarts['resumed_after_epochs']))}"
                if restarts["count"] else ""))
            return published


@contextlib.contextmanager
def ray_checkpoint(result: Any, name: str) -> Iterator[Restored | None]:
    """A Ray trainer's final checkpoint, opened as a local folder."""
    if result.checkpoint is None:
        raise RuntimeError(f"run {name} finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        yield Restored(Path(d), result.checkpoint.path, {})


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


def ray_trainer_class(kind: str) -> Any:
    """The Ray trainer for a job's `trainer`: "torch", "horovod" or "tensorflow"."""
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

