"""A binary image classifier (the tutorial's 150x150x3 CNN) under TensorFlow's distribution strategies.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/tf_cnn.py

Default: Ray Train's TensorflowTrainer, one worker per process across the nodes, with
MultiWorkerMirroredStrategy (synchronous all-reduce). `--strategy mirrored` trains in this one
process with MirroredStrategy over its local devices, as the tutorial (../shared/seeds/002_*)
starts. Either way the model ends as a verified ONNX file.

Keras: tf-keras (Keras 2). Keras 3's fit() breaks under MultiWorkerMirroredStrategy, and Ray's
trainer sets TF_USE_LEGACY_KERAS=1 on its workers; this job does the same on the driver.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TF_USE_LEGACY_KERAS"] = "1"  # before TensorFlow is imported anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainkit, also outside Ray

import numpy as np  # noqa: E402

from trainkit import cluster, data  # noqa: E402
from trainkit.errors import UserError, run_main  # noqa: E402
from trainkit.onnx_export import export_keras, verify_and_publish  # noqa: E402
from trainkit.progress import say  # noqa: E402

JOB = "tf_cnn"
SIZE = (150, 150)
WEIGHTS = "weights.h5"


def build_model():
    """The tutorial's CNN: four conv/pool stages, dropout, a 512-unit layer, a sigmoid output."""
    import tf_keras as keras
    from tf_keras import layers

    model = keras.Sequential([
        keras.Input(shape=(*SIZE, 3), name="input"),
        layers.Conv2D(32, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)),
        layers.Conv2D(64, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)),
        layers.Conv2D(128, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)),
        layers.Conv2D(128, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(512, activation="relu"),
        layers.Dense(1, activation="sigmoid"),
    ])
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=JOB, description=__doc__.split("\n\n")[0],
                                formatter_class=cluster.HelpFormatter)
    p.add_argument("--strategy", default="multiworker", choices=["multiworker", "mirrored"],
                   help="multiworker: MultiWorkerMirroredStrategy over Ray workers on all nodes; "
                        "mirrored: MirroredStrategy in this one process")
    p.add_argument("--num-workers", type=cluster.num_workers_arg, default="auto",
                   help="Ray workers (multiworker only); auto: one per GPU, else one per node")
    p.add_argument("--batch-size", type=int, default=16, help="batch size per worker")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--use-gpu", default="auto", choices=["auto", "true", "false"],
                   help="train on GPUs; auto: when the cluster has one per worker")
    p.add_argument("--data", default=None,
                   help="a folder with exactly two sub-folders of images, one per class; default: "
                        "crops of scikit-learn's two sample photographs (temple vs flower)")
    p.add_argument("--per-class", type=int, default=200,
                   help="images per class: built-in set size, or a cap on a folder's")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="share held out for validation and the ONNX check")
    cluster.add_run_flags(p, JOB)
    args = p.parse_args(argv)
    cluster.resolve_run_flags(args, JOB)
    return args


def load_data(config: dict) -> tuple[np.ndarray, np.ndarray, list[str]]:
    if config["data"] is None:
        return data.builtin_two_class(config["per_class"], SIZE)
    return data.load_two_class_folder(config["data"], SIZE, config["per_class"])


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ training (Ray worker or local)
def train_func(config: dict):
    """Train under MultiWorkerMirroredStrategy (on a Ray worker) or MirroredStrategy (locally)."""
    import tensorflow as tf
    import tf_keras as keras

    on_ray = config["strategy"] == "multiworker"
    if on_ray:
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        strategy = tf.distribute.MultiWorkerMirroredStrategy()  # TF_CONFIG comes from Ray
    else:
        rank, strategy = 0, tf.distribute.MirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    x, y, _ = load_data(config)
    train_idx, val_idx = data.split_indices(len(x), config["val_fraction"])
    global_batch = config["batch_size"] * replicas
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA

    def dataset(idx, shuffle):
        # Whole batches only, so every worker takes the same number of steps; a validation set
        # smaller than a global batch gets the largest batch that splits evenly over the workers.
        batch = min(global_batch, len(idx) // replicas * replicas)
        ds = tf.data.Dataset.from_tensor_slices((x[idx], y[idx].astype(np.float32)))
        if shuffle:
            ds = ds.shuffle(len(idx), seed=0, reshuffle_each_iteration=True)
        ds = ds.map(lambda img, label: (tf.cast(img, tf.float32) / 255.0, label))
        return ds.batch(batch, drop_remainder=True).with_options(options)

    with strategy.scope():
        model = build_model()
        model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(config["lr"]),
                      metrics=["accuracy"])

    class Report(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.perf_counter() - self.t0
            metrics = {k: float(v) for k, v in (logs or {}).items()}
            metrics.update(epoch=epoch + 1, epoch_s=seconds, world_size=replicas,
                           samples_per_s=len(train_idx) // global_batch * global_batch / seconds)
            if rank == 0:
                say(JOB, f"epoch {epoch + 1}/{config['epochs']}: loss {metrics['loss']:.4f} "
                         f"accuracy {metrics['accuracy']:.3f} val_loss {metrics['val_loss']:.4f} "
                         f"val_accuracy {metrics['val_accuracy']:.3f} {seconds:.1f} s")
            if on_ray:
                with tempfile.TemporaryDirectory() as d:
                    ckpt = None
                    if rank == 0:
                        self.model.save_weights(os.path.join(d, WEIGHTS))
                        ckpt = ray.train.Checkpoint.from_directory(d)
                    ray.train.report(metrics, checkpoint=ckpt)
            self.last = metrics

    report = Report()
    model.fit(dataset(train_idx, True), validation_data=dataset(val_idx, False),
              epochs=config["epochs"], callbacks=[report], verbose=0)
    digest = weights_digest(model)
    if on_ray:  # every worker leaves its weights' digest in the shared run folder
        path = Path(config["digest_dir"]) / f"rank{rank}.sha256"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(digest + "\n")
        return None
    return model, report.last


# ------------------------------------------------------------------ on the driver
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.epochs < 1:
        raise UserError(f"--epochs {args.epochs} must be at least 1")
    if args.per_class < 2:
        raise UserError(f"--per-class {args.per_class} must be at least 2")
    config = {"strategy": args.strategy, "data": args.data, "per_class": args.per_class,
              "val_fraction": args.val_fraction, "batch_size": args.batch_size,
              "epochs": args.epochs, "lr": args.lr,
              "digest_dir": str(Path(args.storage_path) / args.name / "weight-digests")}
    x, y, classes = load_data(config)  # checks --data before any worker starts
    train_idx, val_idx = data.split_indices(len(x), args.val_fraction)
    say(JOB, f"run {args.name}: {len(x)} images of classes {classes}, strategy {args.strategy}")

    if args.strategy == "mirrored":
        cluster.check_batch(args.batch_size, len(train_idx), 1)
        model, metrics = train_func(config)
        world, in_sync = 1, {"workers_in_sync": True, "weight_digests": [weights_digest(model)]}
    else:
        plan = cluster.plan_workers(args.num_workers, args.use_gpu, *cluster.connect(),
                                    placement=args.placement)
        cluster.check_batch(args.batch_size, len(train_idx), plan.num_workers)
        if len(val_idx) < plan.num_workers:
            raise UserError(f"{len(val_idx)} validation images cannot be split over {plan.num_workers} "
                            "workers; raise --per-class or --val-fraction")
        model, metrics, in_sync = train_on_ray(args, config, plan)
        world = plan.num_workers

    held_out = x[val_idx[:16]].astype(np.float32) / 255.0
    reference = model.predict(held_out, verbose=0)
    staged = export_keras(model, held_out, args.output)
    _, manifest_path, manifest = verify_and_publish(
        staged, args.output, job=JOB, framework="tensorflow", inputs=held_out,
        reference=reference, metrics=metrics, world_size=world, packages=("tf-keras", "tf2onnx"),
        extra={"classes": classes, "strategy": args.strategy, **in_sync,
               "run": {"name": args.name, "storage_path": args.storage_path,
                       "batch_size": args.batch_size, "images": len(x)}})
    say(JOB, f"ONNX parity: max abs diff {manifest['parity']['max_abs_diff']:.2e}")
    say(JOB, f"ONNX model: {args.output / 'model.onnx'}")
    say(JOB, f"manifest:   {manifest_path}")


def train_on_ray(args, config: dict, plan):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    trainer = TensorflowTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                     placement_strategy=plan.placement,
                                     resources_per_worker={"CPU": plan.cpus_per_worker}),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path),
    )
    shutil.rmtree(config["digest_dir"], ignore_errors=True)  # none left from an earlier run
    result = trainer.fit()
    digests = sorted(Path(config["digest_dir"]).glob("rank*.sha256"))
    values = [p.read_text().strip() for p in digests]
    if len(values) != plan.num_workers or len(set(values)) != 1:
        raise RuntimeError(f"workers ended with different weights: {dict(zip(digests, values, strict=True))}")
    say(JOB, f"all {len(values)} workers ended with identical weights ({values[0][:12]})")
    model = build_model()
    with result.checkpoint.as_directory() as d:
        model.load_weights(os.path.join(d, WEIGHTS))
    return model, result.metrics, {"workers_in_sync": True, "weight_digests": values}


if __name__ == "__main__":
    run_main(main, JOB)
