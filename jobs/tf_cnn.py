"""A binary image classifier (a 150x150x3 CNN) under TensorFlow's distribution strategies.

The model is the one of the TensorFlow distributed-training tutorial (MirroredStrategy,
MultiWorkerMirroredStrategy, ParameterServerStrategy). The same file trains on the cluster,
across processes that a TF_CONFIG describes, and in one process:

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/tf_cnn.py
    ray job submit ... -- python jobs/tf_cnn.py --strategy ps   # a chief, parameter servers, workers
    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
               "task": {"type": "worker", "index": 0}}' python jobs/tf_cnn.py  # one per worker
    python -m trainkit.parameter_servers --workers 2 --ps 1 -- python jobs/tf_cnn.py --strategy ps
    python jobs/tf_cnn.py         # MirroredStrategy over this process's devices

Keras is tf-keras (Keras 2): Keras 3's fit() breaks under MultiWorkerMirroredStrategy.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from trainkit import data, flags
from trainkit.errors import UserError
from trainkit.job import run_from_command_line
from trainkit.keras_loop import KerasJob

SIZE = (150, 150)


def build_model():
    """The tutorial's CNN: four conv/pool stages, dropout, a 512-unit layer, a sigmoid output."""
    import tf_keras as keras
    from tf_keras import layers

    return keras.Sequential([
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


@dataclass(frozen=True)
class CNNConfig:
    data: str | None  # --data; None: the built-in set
    per_class: int
    classes: list[str]
    train: list[int]  # image indices
    val: list[int]


def load_images(data_folder: str | None, per_class: int):
    """(images, labels, class names): the built-in set, or a folder's two classes."""
    if data_folder is None:
        return data.builtin_two_class(per_class, SIZE)
    return data.load_two_class_folder(data_folder, SIZE, per_class)


class TFCNN(KerasJob[CNNConfig]):
    name = "tf_cnn"
    description = __doc__.split("\n\n")[0]
    batch_size, epochs, lr = 16, 2, 1e-4

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        super().add_flags(p)  # --strategy (mirrored, multiworker, ps), --num-ps
        p.add_argument("--data", default=None,
                       help="a folder with exactly two sub-folders of images, one per class; "
                            "default: crops of scikit-learn's two sample photographs (temple vs flower)")
        p.add_argument("--per-class", type=flags.positive_int, default=200,
                       help="images per class: built-in set size, or a cap on a folder's")
        p.add_argument("--val-fraction", type=flags.fraction, default=0.2,
                       help="share held out for validation and the ONNX check")

    def prepare(self, args) -> CNNConfig:
        if args.per_class < 2:
            raise UserError(f"--per-class {args.per_class} must be at least 2")
        x, _, classes = load_images(args.data, args.per_class)
        train, val = data.split_indices(len(x), args.val_fraction)
        return CNNConfig(args.data, args.per_class, classes, train, val)

    def describe(self, config: CNNConfig) -> str:
        n = len(config.train) + len(config.val)
        return f"{n} images of classes {config.classes}"

    def train_size(self, config: CNNConfig) -> int:
        return len(config.train)

    def signature(self, config: CNNConfig) -> dict:
        return {"model": "CNN", "input": [*SIZE, 3], "classes": config.classes}

    def model(self, config: CNNConfig):
        return build_model()

    def compile(self, model, lr: float) -> None:
        import tf_keras as keras

        model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(lr),
                      metrics=["accuracy"])

    def datasets(self, config: CNNConfig, global_batch: int, num_replicas: int):
        import tensorflow as tf

        x, y, _ = load_images(config.data, config.per_class)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA

        def dataset(idx, shuffle):
            # Whole batches only, so every worker takes the same number of steps; a validation
            # set smaller than a global batch gets the largest batch that splits evenly.
            batch = min(global_batch, len(idx) // num_replicas * num_replicas)
            if batch < 1:
                raise UserError(f"{len(idx)} validation images cannot be split over {num_replicas} "
                                "workers; raise --per-class or --val-fraction")
            ds = tf.data.Dataset.from_tensor_slices((x[idx], y[idx].astype(np.float32)))
            if shuffle:
                ds = ds.shuffle(len(idx), seed=0, reshuffle_each_iteration=True)
            ds = ds.map(lambda img, label: (tf.cast(img, tf.float32) / 255.0, label))
            return ds.batch(batch, drop_remainder=True).with_options(options)

        return dataset(config.train, True), dataset(config.val, False)

    def manifest(self, config: CNNConfig, run) -> dict:
        return {**super().manifest(config, run), "classes": config.classes}

    def held_out(self, config: CNNConfig) -> np.ndarray:
        x, _, _ = load_images(config.data, config.per_class)
        return x[config.val[:16]].astype(np.float32) / 255.0


if __name__ == "__main__":
    run_from_command_line(TFCNN())
