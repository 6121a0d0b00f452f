"""The Ray side every job shares: connect, choose CPU or GPU, refuse what the cluster can't run.

A trainer asked for more workers than the cluster has slots waits forever in Ray; `plan_workers`
checks the cluster's totals first and fails fast with one line instead.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .flags import UseGpu


def connect(python_env: str | None = None) -> tuple[dict, int]:
    """Join the Ray cluster (RAY_ADDRESS, as `ray job submit` sets it): its resource totals and
    how many nodes are alive. With `python_env`, the job's workers run the interpreter that
    variable names on their node (worker_python)."""
    import ray

    if not ray.is_initialized():
        ray.init(log_to_driver=True, runtime_env=worker_python(python_env))
    return ray.cluster_resources(), sum(1 for n in ray.nodes() if n.get("Alive"))


def horovod_config():
    """Horovod's settings on Ray: the network interface named where every node names the same one.

    The servers' Ray runs with GLOO_SOCKET_IFNAME set to the interface holding the node's private
    address (roles/ray). Told that interface, Horovod skips its own discovery, which otherwise
    probes every interface of every node from every other one and waits out each unreachable
    probe (a node with a second network: measured 4 min 40 s of a 3-node run's start on the
    emulated cluster). Where the nodes name no interface, or different ones, Horovod discovers."""
    from ray.train.horovod import HorovodConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    @ray.remote(num_cpus=0)
    def interface() -> str:
        return os.environ.get("GLOO_SOCKET_IFNAME", "")

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len({n["NodeManagerAddress"] for n in nodes}) < 2:  # one host: Horovod discovers nothing
        return HorovodConfig()
    alive = [n["NodeID"] for n in nodes]
    on = [interface.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
          for node in alive]
    names = set(ray.get([task.remote() for task in on]))
    if len(names) == 1 and "" not in names:
        return HorovodConfig(nics=names)
    return HorovodConfig()


def worker_python(python_env: str | None) -> dict | None:
    """Ray's runtime env for workers that run the interpreter `$python_env` names on their own node
    (Ray starts a worker with `bash -c "exec <py_executable> ..."` there), else this driver's
    interpreter; nothing when the job was submitted with its own py_executable, which wins."""
    if not python_env:
        return None
    submitted = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    if (submitted.get("runtime_env") or {}).get("py_executable"):
        return None
    return {"py_executable": f'"${{{python_env}:-{sys.executable}}}"'}


@dataclass(frozen=True)
class WorkerPlan:
    num_workers: int  # the most workers
    use_gpu: bool
    cpus_per_worker: float
    placement: str = "SPREAD"
    min_workers: int | None = None  # elastic: the fewest workers the run goes on with

    def describe(self) -> str:
        count = (f"{self.min_workers}-{self.num_workers} (elastic)" if self.min_workers
                 else str(self.num_workers))
        return f"{count} worker(s) on {'GPU' if self.use_gpu else 'CPU'}"

    def scaling_config(self, train_v1: bool = False):
        """Ray Train's ScalingConfig for this plan (the one place a job's workers are sized)."""
        from ray.train import ScalingConfig

        extra = {}
        if train_v1:
            # Train V1 reserves a CPU for the trainer itself unless told not to: on a cluster
            # with exactly one CPU per worker the workers would wait for ever.
            extra["trainer_resources"] = {"CPU": 0}
        workers = (self.min_workers, self.num_workers) if self.min_workers else self.num_workers
        return ScalingConfig(num_workers=workers, use_gpu=self.use_gpu,
                             placement_strategy=self.placement,
                             resources_per_worker={"CPU": self.cpus_per_worker}, **extra)


def run_config(name: str, storage_path: str, keep: int | None = None, max_failures: int = 0):
    """Ray Train's RunConfig: the run's folder, how many checkpoints stay, how often a lost
    worker group is restarted (FailureConfig) before the run fails."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(name=name, storage_path=storage_path,
                     checkpoint_config=CheckpointConfig(num_to_keep=keep),
                     failure_config=FailureConfig(max_failures=max_failures))


def plan_workers(num_workers: int | tuple[int, int], use_gpu: UseGpu, totals: dict, nodes: int,
                 cpus_per_worker: float = 1.0, placement: str = "SPREAD",
                 elastic: bool = True) -> WorkerPlan:
    """Check `--num-workers`, `--use-gpu auto|true|false` and `--placement` against the cluster.
    `--num-workers auto` (0) trains across the whole cluster: one worker per GPU when GPUs are
    used, else one per node (as far as the CPUs go). MIN-MAX (a tuple) is elastic: the cluster
    must hold MIN now; Ray starts as many as fit, up to MAX, and goes on with fewer after a loss."""
    if isinstance(num_workers, tuple):
        least, most = num_workers
        if not elastic:
            raise UserError(f"--num-workers {least}-{most}: this trainer cannot change its number "
                            f"of workers (Ray Train V1); give one count, e.g. --num-workers {most}")
        plan = plan_workers(least, use_gpu, totals, nodes, cpus_per_worker, placement="SPREAD"
                            if placement == "STRICT_SPREAD" else placement)
        return WorkerPlan(most, plan.use_gpu, cpus_per_worker, placement, min_workers=least)
    if num_workers == 0:
        gpus_total = int(totals.get("GPU", 0))
        if use_gpu != UseGpu.NO and gpus_total > 0:
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
    gpu = gpus >= num_workers if use_gpu == UseGpu.AUTO else use_gpu == UseGpu.YES
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


def on_this_node(cls, *args):
    """A Ray actor of `cls` pinned to this (the driver's) node, taking no CPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(cls).options(scheduling_strategy=here).remote(*args)


def check_storage(storage_path: str, timeout: float = 60) -> None:
    """The run's storage must be writable here and, on several nodes, the same on every node:
    else Ray fails late with a long traceback, or checkpoints land on one node's own disk. A
    marker written here must be seen by a task on every alive node. URIs are Ray's to check."""
    if "://" in storage_path:
        return
    import secrets

    import ray

    root = Path(storage_path)
    marker = root / f".dlc-shared-{secrets.token_hex(4)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        marker.write_text("shared\n")
    except OSError as e:
        raise UserError(f"--storage-path {storage_path} is not writable ({e.strerror}); give a "
                        "folder this user can write, on storage every node mounts") from None
    try:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) < 2:
            return
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        sees = ray.remote(num_cpus=0)(os.path.exists)
        probes = {n["NodeManagerAddress"]: sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(str(marker)) for n in alive}
        ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=timeout)

        def blind_there(ref) -> bool:
            if ref not in ready:
                return True
            try:
                return not ray.get(ref)
            except (ray.exceptions.TaskUnschedulableError, ray.exceptions.NodeDiedError):
                return False  # the node left Ray after it was listed: not one of the run's

        blind = sorted(ip for ip, ref in probes.items() if blind_there(ref))
        if blind:
            raise UserError(f"--storage-path {storage_path} is not shared: node(s) {', '.join(blind)} "
                            "do not see it; use storage every node mounts (the cluster's "
                            "$DLC_STORAGE_PATH, NFS) or a URI such as s3://bucket/runs")
    finally:
        marker.unlink(missing_ok=True)
