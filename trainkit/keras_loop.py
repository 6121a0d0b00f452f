"""TensorFlow jobs: Keras `fit` under a distribution strategy, with the harness in a callback.

MultiWorkerMirroredStrategy when several processes train (Ray's TensorflowTrainer sets TF_CONFIG
for its workers; a user sets it for a plain multi-worker run), MirroredStrategy over the local
devices when one process does, ParameterServerStrategy with --strategy ps (`parameter_servers`:
its roles, and `fit` on its chief). Keras is tf-keras (Keras 2): Keras 3's
`fit` breaks under MultiWorkerMirroredStrategy, and Ray's trainer sets TF_USE_LEGACY_KERAS=1 on
its workers.

This module imports nothing of torch, so a TensorFlow job's processes never load torch's CUDA
libraries.

Timing: in Keras' `fit` the tf.data pipeline runs inside the compiled train step, so
`processing_s` (Keras' batch begin -> end) includes reading the batch, and `dataflow_s` is the
host's time between steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import flags, launch
from .contract import C, Exported, Job, Run
from .errors import UserError
from .flags import UseGpu, positive_int
from .keras_base import WEIGHTS, StepTimedReport, load

if TYPE_CHECKING:
    from .parameter_servers import PSWorld


class KerasWorld:
    """The strategy and this process's place in it (implements `contract.World`)."""

    def __init__(self, launcher: str, use_gpu: UseGpu):
        import tensorflow as tf

        self.tf, self.launcher = tf, launcher
        gpus = tf.config.list_physical_devices("GPU")
        if use_gpu == UseGpu.YES and not gpus:
            raise UserError(f"--use-gpu true but TensorFlow {tf.__version__} sees no GPU (built for "
                            f"CUDA {tf.sysconfig.get_build_info().get('cuda_version', 'none')}); "
                            "check the node's CUDA libraries, or pass --use-gpu false")
        self.use_gpu = bool(gpus) and use_gpu != UseGpu.NO
        if gpus and not self.use_gpu:
            tf.config.set_visible_devices([], "GPU")
        if launcher == "local":
            self.strategy = tf.distribute.MirroredStrategy()
            self.rank, self.size = 0, 1
        else:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
            if launcher == "ray":
                import ray.train

                ctx = ray.train.get_context()
                self.rank, self.size = ctx.get_world_rank(), ctx.get_world_size()
            else:
                self.rank, self.size, _ = launch.world_from_env(launcher)
        self.num_replicas = self.strategy.num_replicas_in_sync  # devices over all workers
        self.strategy_name = "mirrored" if launcher == "local" else "multiworker"

    @property
    def device_kind(self) -> str:
        return "GPU" if self.use_gpu else "CPU"

    def gather_bytes(self, data: bytes, width: int = 320) -> list[bytes]:
        """Every replica's `data` (at most `width` bytes), in rank order: an all-gather."""
        tf = self.tf
        padded = np.frombuffer(data.ljust(width, b"\0")[:width], np.uint8).astype(np.int32)
        gathered = tf.function(lambda: self.strategy.gather(
            self.strategy.run(lambda: tf.constant(padded[None, :])), axis=0))
        rows = gathered().numpy().astype(np.uint8)
        return [bytes(r).rstrip(b"\0") for r in rows]

    def gather(self, text: str) -> list[str]:
        return [b.decode() for b in self.gather_bytes(text.encode())]

    def agree(self, value: str) -> str:
        return self.gather(value)[0]

    def barrier(self) -> None:
        self.gather_bytes(b"")

    def shutdown(self) -> None:
        pass

    def record(self) -> dict:
        """What the manifest says of the strategy."""
        return {"strategy": self.strategy_name}


class KerasJob(Job["KerasWorld | PSWorld", C]):
    """A tf-keras job: the subclass gives model(), compile() and datasets()."""

    framework = "tensorflow"
    trainer = "tensorflow"
    launchers = ("ray", "tf_config", "local")
    packages = ("tf-keras", "tf2onnx")
    # TensorFlow wants CUDA 12 libraries, torch brings CUDA 13 ones under the same file names: the
    # GPU image gives TF jobs' workers a virtualenv of their own and names it here
    worker_python_env = "DLC_TF_PYTHON"

    def add_flags(self, p) -> None:
        """The strategy flags every Keras job has; a job's own flags come after (super() first)."""
        p.add_argument("--strategy", default="auto", choices=["auto", "multiworker", "mirrored", "ps"],
                       help="auto: MultiWorkerMirroredStrategy under Ray or TF_CONFIG (ParameterServer"
                            "Strategy where TF_CONFIG names ps tasks), MirroredStrategy alone; "
                            "mirrored: this one process (--launcher local); ps: ParameterServerStrategy "
                            "(a chief, --num-ps parameter servers, --num-workers workers)")
        p.add_argument("--num-ps", type=positive_int, default=1,
                       help="parameter servers of a --strategy ps run on Ray (one per node)")

    def launcher(self, settings: flags.RunFlags, args: argparse.Namespace) -> str:
        """The launcher, checked against --strategy (one line for a pair that cannot run):
        --strategy mirrored is this one process."""
        from .parameter_servers import read_tf_config

        launcher = "local" if args.strategy == "mirrored" else super().launcher(settings, args)
        if args.strategy in ("multiworker", "ps") and launcher == "local":
            raise UserError(f"--strategy {args.strategy} needs several processes: submit to Ray, or "
                            + ("start its roles with `python -m trainkit.parameter_servers -- python "
                               "<job> --strategy ps`" if args.strategy == "ps" else
                               "start one process per worker with TF_CONFIG")
                            + "; or use --strategy mirrored")
        if launcher == "tf_config":
            ps_cluster = read_tf_config() is not None
            if args.strategy != "auto" and ps_cluster != (args.strategy == "ps"):
                raise UserError(f"--strategy {args.strategy} but TF_CONFIG "
                                + ("names parameter servers (ps tasks): use --strategy ps or auto"
                                   if ps_cluster else "names no parameter servers: start the roles "
                                   "with `python -m trainkit.parameter_servers`, or use --strategy "
                                   "multiworker"))
        return launcher

    def parameter_servers(self, args: argparse.Namespace) -> int:
        """--num-ps under --strategy ps (on Ray: the harness's actors, not a Ray trainer)."""
        return int(args.num_ps) if args.strategy == "ps" else 0

    def manifest(self, config: C, run: Run) -> dict:
        """The strategy by launcher, for a checkpoint saved before its epochs recorded it (the
        checkpoint's own record, merged after this, names it otherwise)."""
        return {"strategy": "mirrored" if run.launcher == "local" else "multiworker"}

    def model(self, config: C):
        raise NotImplementedError

    def compile(self, model, lr: float) -> None:
        raise NotImplementedError

    def datasets(self, config: C, global_batch: int, num_replicas: int):
        """(training, validation) tf.data sets, batched by `global_batch`."""
        raise NotImplementedError

    def world(self, launcher: str, use_gpu: UseGpu) -> KerasWorld | PSWorld:
        """KerasWorld; under TF_CONFIG with parameter servers, the chief's PSWorld, while a parameter
        server or worker serves here until it is stopped (it never returns)."""
        from . import parameter_servers as ps

        found = ps.read_tf_config() if launcher == "tf_config" else None
        if found is None:
            return KerasWorld(launcher, use_gpu)
        cluster, role, index = found
        if role != "chief":
            ps.serve_until_stopped(self.name, cluster, role, index, use_gpu)
        return ps.PSWorld(self.name, cluster, use_gpu)

    def store(self, run: Run, config: C, world):
        """A parameter-server run keeps its checkpoints in the run's folder, on Ray too (Ray Train
        does not run it)."""
        from . import parameter_servers

        if isinstance(world, parameter_servers.PSWorld):
            return parameter_servers.run_store(self, run, config)
        return super().store(run, config, world)

    def fit(self, run: Run, config: C, world: KerasWorld | PSWorld | None = None) -> None:
        world = world or self.world(run.launcher, UseGpu.of(run.use_gpu))
        store = self.store(run, config, world)
        with world.strategy.scope():
            model = self.model(config)
            self.compile(model, run.lr)
            start = self.resume(store, run, world, lambda folder: load(model, folder))
        if start is None:
            return
        from . import parameter_servers

        if isinstance(world, parameter_servers.PSWorld):
            parameter_servers.fit(self, run, config, world, model, store, start)
            return
        global_batch = run.batch_size * world.num_replicas
        train, val = self.datasets(config, global_batch, world.num_replicas)
        report = StepTimedReport(self, run, world, store,
                                 self.train_size(config) // global_batch * global_batch)
        model.fit(train, validation_data=val, epochs=run.epochs, initial_epoch=start,
                  callbacks=[report], verbose=0)

    def export(self, folder: Path, config: C, inputs: np.ndarray, output: Path):
        from .onnx_export import export_keras

        model = self.model(config)
        model.load_weights(str(folder / WEIGHTS))
        return Exported(export_keras(model, inputs, output), model.predict(inputs, verbose=0))
