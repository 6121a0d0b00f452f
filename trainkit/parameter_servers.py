"""TensorFlow's ParameterServerStrategy: a chief, parameter servers and workers, each a process
with its role in the cluster (`TF_CONFIG`).

Asynchronous data parallelism: the parameter servers hold the variables; each worker takes a
batch, reads the variables, pushes its gradients and takes the next batch without waiting for
the others. The chief (Keras `fit` through TF's cluster coordinator) only schedules those steps,
keeps the run's checkpoints and publishes. A slow worker does fewer steps instead of holding the
rest back; a lost worker's steps go to the others and it is taken back when it returns; a lost
parameter server or chief ends the attempt, and the run restarts from its last checkpoint.

Where the roles come from:

| launcher  | chief                          | parameter servers, workers                      |
|-----------|--------------------------------|-------------------------------------------------|
| ray       | an actor on the driver's node  | actors: workers in a placement group (--placement), |
|           | (no CPU reserved)              | one parameter server per node (no CPU reserved) |
| tf_config | the process whose TF_CONFIG    | processes whose TF_CONFIG names them "ps" or    |
|           | task is "chief"                | "worker": they serve until they are stopped     |

`python -m trainkit.parameter_servers --workers 2 --ps 1 -- python jobs/tf_cnn.py --strategy ps`
starts every role of a plain run on this machine and stops them when the chief ends (that
launcher imports no TensorFlow: the roles' processes do).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import UserError, find_user_error
from .flags import Parser, UseGpu, positive_int
from .launch import loopback_addresses
from .progress import say
from .store import FolderStore, Restored

ROLES = ("chief", "ps", "worker")
TF_LOGGER = "tensorflow"  # where TF's Python side (its cluster coordinator too) logs


# ------------------------------------------------------------------ the cluster of roles
def cluster_spec(chief: str, ps: list[str], workers: list[str]) -> dict:
    """TF's cluster: role -> addresses (host:port), in task order."""
    return {"chief": [chief], "ps": list(ps), "worker": list(workers)}


def tf_config(cluster: dict, role: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


def roles_of(cluster: dict) -> dict:
    """How many tasks of each role the cluster has (the manifest's `roles`)."""
    return {role: len(cluster.get(role, [])) for role in ROLES}


def read_tf_config(given: Mapping[str, str] | None = None) -> tuple[dict, str, int] | None:
    """(cluster, role, index) when TF_CONFIG describes a parameter-server cluster (it names "ps"
    tasks); None for any other. A malformed one is a one-line error."""
    env = os.environ if given is None else given
    text = env.get("TF_CONFIG")
    if not text:
        return None
    try:
        spec = json.loads(text)
        cluster, task = spec["cluster"], spec["task"]
        if "ps" not in cluster:
            return None
        role, index = task["type"], int(task["index"])
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise UserError(f"TF_CONFIG is malformed ({e!r}); give it a cluster and this process's "
                        "task, as `python -m trainkit.parameter_servers` does") from None
    if role not in ROLES or len(cluster.get("chief", [])) != 1 or not cluster.get("worker"):
        raise UserError(f"TF_CONFIG's cluster {roles_of(cluster)} with this task a {role!r}: a "
                        "parameter-server run needs one chief, parameter servers and workers; "
                        "start them with `python -m trainkit.parameter_servers`")
    if not 0 <= index < len(cluster[role]):
        raise UserError(f"TF_CONFIG's task {role} {index} is not in its cluster ({roles_of(cluster)})")
    return cluster, role, index


def local_tf_configs(workers: int, ps: int) -> list[str]:
    """A TF_CONFIG for each role of a run on this machine (free loopback ports): the chief first,
    then the parameter servers, then the workers."""
    chief, *rest = loopback_addresses(1 + ps + workers)
    cluster = cluster_spec(chief, rest[:ps], rest[ps:])
    return [tf_config(cluster, role, i) for role in ROLES for i in range(len(cluster[role]))]


def serve(cluster: dict, role: str, index: int, use_gpu: UseGpu):
    """Start this process's TF server as task `role` `index` (a parameter server or a worker):
    it serves in TF's own threads until the process ends. Workers train on their GPUs unless
    --use-gpu false hides them; parameter servers only hold variables."""
    from .keras_base import tensorflow

    tf = tensorflow()

    if role == "ps" or use_gpu == UseGpu.NO:
        tf.config.set_visible_devices([], "GPU")
    return tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=role, task_index=index,
                                protocol="grpc", start=True)


def serve_until_stopped(job: str, cluster: dict, role: str, index: int, use_gpu: UseGpu) -> None:
    """A parameter server's or worker's whole life under the TF_CONFIG launcher."""
    server = serve(cluster, role, index, use_gpu)
    say(job, f"{role} {index} of the parameter-server run serves at {cluster[role][index]} (pid "
             f"{os.getpid()}) until it is stopped")
    server.join()


def check_roles(num_ps: int, nodes: int) -> None:
    """What the cluster must have room for besides the workers (plan_workers checks those): one
    node for each parameter server, so that their traffic spreads too."""
    if num_ps > nodes:
        raise UserError(f"--num-ps {num_ps} is more than the cluster's {nodes} node(s), and each "
                        f"parameter server takes a node of its own; use --num-ps <= {nodes}")


# ------------------------------------------------------------------ the chief's world
class WorkerEvents(logging.Filter):
    """What TF's cluster coordinator says of its workers, on the chief: a worker lost (its steps go
    to the others) or back. Each change is one line and one entry of the run's record. The
    coordinator's own lines are dropped: it logs TF's whole error for every step a lost task fails
    (dozens); a lost parameter server ends the attempt, which the driver says in one line.
    Installed on TF's logger, where the coordinator logs."""

    LOST, BACK = "Worker %s failed with", "Worker %s has been recovered"
    COORDINATOR = "cluster_coordinator.py"

    def __init__(self, job: str, cluster: dict):
        super().__init__()
        self.job, self.cluster = job, cluster
        self.events: list[dict] = []
        self.epoch = 0  # the epoch in progress (set by the epoch callback)
        self.down: set[int] = set()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        lost, back = msg.startswith(self.LOST), msg.startswith(self.BACK)
        if not (lost or back):
            return not record.pathname.endswith(self.COORDINATOR)
        device = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        index = int(device.rsplit("task:", 1)[-1]) if "task:" in device else -1
        with self.lock:
            if lost == (index in self.down):  # the same news again (one line per failed step)
                return False
            (self.down.add if lost else self.down.discard)(index)
            event = "lost" if lost else "back"
            self.events.append({"worker": index, "event": event, "epoch": self.epoch, "at": time.time()})
        where = self.cluster["worker"][index] if 0 <= index < len(self.cluster["worker"]) else device
        say(self.job, f"worker {index} ({where}) " + (
            f"lost in epoch {self.epoch}: its steps go to the other workers" if lost
            else f"back in epoch {self.epoch}: it takes steps again"))
        return False


class PSWorld:
    """The chief's place in a parameter-server run (implements `contract.World`): the only process that
    runs the harness, so rank 0 of a world of one; `size` counts the workers that train."""

    strategy_name = "ps"

    def __init__(self, job: str, cluster: dict, use_gpu: UseGpu):
        from .keras_base import tensorflow

        tf = tensorflow()

        self.cluster = cluster
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        self.strategy = tf.distribute.ParameterServerStrategy(resolver)
        remote_gpus = [d for d in tf.config.list_logical_devices("GPU") if "/job:worker/" in d.name]
        if use_gpu == UseGpu.YES and not remote_gpus:
            raise UserError("--use-gpu true but the parameter-server run's workers see no GPU; "
                            "check the nodes' CUDA libraries, or pass --use-gpu false")
        self.use_gpu = bool(remote_gpus) and use_gpu != UseGpu.NO
        self.rank, self.size = 0, len(cluster["worker"])
        self.num_replicas = self.strategy.num_replicas_in_sync
        self.events = WorkerEvents(job, cluster)

    @property
    def device_kind(self) -> str:
        return "GPU" if self.use_gpu else "CPU"

    def describe(self) -> str:
        """Who trains, for the run's first line."""
        return f"{self.size} worker(s), {len(self.cluster['ps'])} parameter server(s) and a chief"

    def gather(self, value: str) -> list[str]:
        return [value]

    def agree(self, value: str) -> str:
        return value

    def barrier(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def record(self) -> dict:
        """What the manifest says of the run's roles and of the workers it lost."""
        return {"strategy": self.strategy_name, "roles": roles_of(self.cluster),
                "worker_events": list(self.events.events)}


@contextlib.contextmanager
def watching_workers(world: PSWorld):
    tf_logger = logging.getLogger(TF_LOGGER)
    tf_logger.addFilter(world.events)
    try:
        yield
    finally:
        tf_logger.removeFilter(world.events)


def run_store(job, run, config) -> FolderStore:
    """A parameter-server run's checkpoints: the run's folder under --storage-path, on Ray too (Ray
    Train does not run it); the chief, the only process of the harness, writes them."""
    return FolderStore(job.name, run.name, job.signature(config), 0, run.storage_path,
                       barrier=lambda: None, keep=run.keep_checkpoints)


def fit(job, run, config, world: PSWorld, model, store, start: int) -> None:
    """Keras `fit` on the chief: each step one batch on whichever worker is free; an epoch is as
    many steps as the training set has batches (the workers read their own shards, repeated).
    Validation runs on the chief, on a copy of the model outside the strategy, after each epoch."""
    import tf_keras as keras

    from .keras_base import EpochReport

    class EpochInProgress(keras.callbacks.Callback):  # which epoch a worker is lost or back in
        def on_epoch_begin(self, epoch, logs=None):
            world.events.epoch = epoch + 1

    steps = job.train_size(config) // run.batch_size
    with store.latest() as last:  # the workers lost before a restart stay on the record
        world.events.events[:0] = last.meta.get("replicas", {}).get("worker_events", []) if last else []

    def dataset_fn(context):
        train, _ = job.datasets(config, run.batch_size, 1)
        return train.shard(context.num_input_pipelines, context.input_pipeline_id).repeat()

    _, val = job.datasets(config, run.batch_size, 1)  # on the chief, outside the strategy
    plain = keras.models.clone_model(model)
    job.compile(plain, run.lr)
    # fit's strategy scope is the thread's: a thread of its own evaluates the plain copy
    with ThreadPoolExecutor(1, thread_name_prefix="validate") as validator, watching_workers(world):

        def validate() -> dict:
            plain.set_weights(model.get_weights())
            logs = validator.submit(plain.evaluate, val, verbose=0, return_dict=True).result()
            return {f"val_{k}": float(v) for k, v in logs.items()}

        report = EpochReport(job, run, world, store, steps * run.batch_size, validate=validate)
        model.fit(keras.utils.experimental.DatasetCreator(dataset_fn), epochs=run.epochs,
                  initial_epoch=start, steps_per_epoch=steps, verbose=0,
                  callbacks=[EpochInProgress(), report])


# ------------------------------------------------------------------ on Ray
class Role:
    """One task of the run, as a Ray actor. A parameter server or worker starts its TF server in
    its constructor, so Ray restarting a lost worker brings it back at the same address."""

    def __init__(self, cluster: dict, role: str, index: int, use_gpu: bool):
        self.cluster, self.role, self.index, self.use_gpu = cluster, role, index, UseGpu.of(use_gpu)
        if role == "chief":  # TF's C++ side logs an error per pending call to a lost task (dozens
            os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # a second): what was lost is said once, in Python
        else:
            self.server = serve(cluster, role, index, self.use_gpu)

    def __repr__(self) -> str:  # how Ray's state API and dashboard name the actor: "worker 1"
        return f"{self.role} {self.index}"

    def ready(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    def serve(self) -> None:
        """Returns never: the driver waits on it to learn at once that this task is gone."""
        threading.Event().wait()

    def fit(self, job, run, config) -> None:
        gc.freeze()  # as Ray Train's workers: Ray's own heap out of the collector's walks
        job.fit(run, config, PSWorld(job.name, self.cluster, self.use_gpu))


def _address() -> str:
    """host:port free on the node this runs on, for the role placed there next."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"


class RolesOnRay:
    """One attempt's roles placed on the cluster, their servers up: the workers in a placement
    group (--placement), a parameter server on each of the first nodes (the driver's node last),
    the chief on the driver's node. Parameter servers and the chief reserve no CPU: the workers
    compute."""

    def __init__(self, job: str, plan, num_ps: int, max_failures: int):
        self.group: Any = None  # Ray's PlacementGroup
        self.actors: dict[tuple[str, int], Any] = {}  # (role, index) -> its actor's handle
        self.cluster: dict[str, list[str]] = {}  # TF_CONFIG's cluster: role -> addresses
        try:
            self._place(job, plan, num_ps, max_failures)
        except BaseException:  # what was placed is taken down again
            self.stop()
            raise

    def _place(self, job: str, plan, num_ps: int, max_failures: int) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        import ray

        here = ray.get_runtime_context().get_node_id()
        nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")), key=lambda n: n == here)
        bundle = {"CPU": plan.cpus_per_worker, **({"GPU": 1} if plan.use_gpu else {})}
        self.group = placement_group([bundle] * plan.num_workers, strategy=plan.placement)
        ray.get(self.group.ready(), timeout=300)
        places = {"chief": [NodeAffinitySchedulingStrategy(here, soft=False)],
                  "ps": [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes[:num_ps]],
                  "worker": [PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)
                             for i in range(plan.num_workers)]}
        address = ray.remote(num_cpus=0)(_address)
        found = {role: ray.get([address.options(scheduling_strategy=s).remote() for s in where])
                 for role, where in places.items()}
        self.cluster = cluster_spec(found["chief"][0], found["ps"], found["worker"])
        actor = ray.remote(Role)
        for role, where in places.items():
            for i, strategy in enumerate(where):
                options = {"num_cpus": 0, "scheduling_strategy": strategy, "max_restarts": 0}
                if role == "worker":  # Ray starts a lost worker again, at the same address
                    options.update(num_cpus=plan.cpus_per_worker, num_gpus=1 if plan.use_gpu else 0,
                                   max_restarts=max_failures)
                self.actors[role, i] = actor.options(**options).remote(self.cluster, role, i, plan.use_gpu)
        started = ray.get([a.ready.remote() for a in self.actors.values()], timeout=600)
        say(job, "roles: " + ", ".join(
            f"{role} {i} {self.cluster[role][i]} ({host} pid {pid})"
            for (role, i), (host, pid) in zip(self.actors, started, strict=True)))

    @property
    def chief(self):
        return self.actors["chief", 0]

    def lost(self, error: Exception, watched: list) -> list[str]:
        """The chief or parameter servers that are gone ("ps 0 (host:port)"): a watch that ended,
        or the chief's own end. Workers come back."""
        import ray

        ended, _ = ray.wait(watched, num_returns=len(watched), timeout=2)
        parameter_servers = [key for key in self.actors if key[0] == "ps"]
        gone = [key for key, ref in zip(parameter_servers, watched, strict=True) if ref in ended]
        if isinstance(error, ray.exceptions.RayActorError) and not gone:
            gone = [("chief", 0)]
        return [f"{role} {i} ({self.cluster[role][i]})" for role, i in gone]

    def stop(self) -> None:
        from ray.util.placement_group import remove_placement_group

        import ray

        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)


def fit_on_ray(job, run, config, plan, num_ps: int,
               max_failures: int) -> contextlib.AbstractContextManager[Restored | None]:
    """Train the run with its roles as Ray actors; its final checkpoint (`with` opens it). A lost
    worker is the coordinator's to handle (and Ray's to start again); a lost chief or parameter
    server ends the attempt at once, and the run starts again from its last checkpoint, up to
    --max-failures times (-1: without limit)."""
    import ray

    failures = 0
    while True:
        roles, watched = None, []
        try:
            roles = RolesOnRay(job.name, plan, num_ps, max_failures)
            fit = roles.chief.fit.remote(job, run, config)
            # a parameter server's end is seen here at once; the chief would first wait out its steps
            watched = [roles.actors[key].serve.remote() for key in roles.actors if key[0] == "ps"]
            done, _ = ray.wait([fit, *watched], num_returns=1)
            if done[0] == fit:
                ray.get(fit)
                return run_store(job, run, config).latest()
            ray.get(done[0])  # raises: the actor is gone
        except Exception as e:
            if find_user_error(e) is not None:
                raise
            failures += 1
            if 0 <= max_failures < failures:
                raise
            lost = roles.lost(e, watched) if roles else []
            why = (f"{' and '.join(lost)} lost" if lost else
                   (str(e).strip().splitlines() or [type(e).__name__])[-1][:200])
            say(job.name, f"run {run.name}: {why}: the attempt ends; its roles start again from the "
                          f"last checkpoint (restart {failures} of "
                          f"{'unlimited' if max_failures < 0 else max_failures})")
        finally:
            if roles:
                roles.stop()


# ------------------------------------------------------------------ the plain launcher
def launch_locally(workers: int, ps: int, command: list[str]) -> int:
    """Every role of a plain run on this machine, each with its TF_CONFIG: the chief's exit code.
    A worker that ends is said and the run goes on; a parameter server that ends, or the last
    worker, ends the run (the chief cannot go on without them)."""
    if not command:
        raise UserError("give the job's command after --, e.g. -- python jobs/tf_cnn.py --strategy ps")
    configs = local_tf_configs(workers, ps)
    procs = {}
    for text in configs:
        task = json.loads(text)["task"]
        procs[task["type"], task["index"]] = subprocess.Popen(command, env={**os.environ, "TF_CONFIG": text})
    say("parameter_servers", ", ".join(f"{role} {i} pid {p.pid}" for (role, i), p in procs.items()))
    chief, ended = procs["chief", 0], set()
    try:
        while chief.poll() is None:
            time.sleep(0.5)
            for (role, i), p in procs.items():
                if role == "chief" or (role, i) in ended or p.poll() is None:
                    continue
                ended.add((role, i))
                say("parameter_servers", f"{role} {i} (pid {p.pid}) ended with exit code {p.returncode}")
                if role == "ps" or all((r, j) in ended for r, j in procs if r == "worker"):
                    chief.send_signal(signal.SIGTERM)
        # killed by a signal (stopped above, or from outside): the shell's 128 + its number
        return chief.returncode if chief.returncode >= 0 else 128 - chief.returncode
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: list[str] | None = None) -> None:
    from .errors import run_main

    p = Parser(prog="parameter_servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=positive_int, default=2, help="worker processes")
    p.add_argument("--ps", type=positive_int, default=1, help="parameter-server processes")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's command line")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    run_main(lambda: sys.exit(launch_locally(args.workers, args.ps, command)), "parameter_servers")


if __name__ == "__main__":
    main()


