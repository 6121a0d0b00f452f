"""Horovod with PyTorch on MNIST, on Ray's HorovodTrainer or under horovodrun.

The Horovod tutorial's steps: hvd.init(), the device pinned to hvd.local_rank() on GPU, a
DistributedSampler over hvd.size() replicas, hvd.DistributedOptimizer, hvd.broadcast_parameters
from rank 0, the learning rate scaled by the number of ranks; the test split evaluated every epoch.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/horovod_mnist.py
    horovodrun -np 2 -H localhost:2 python jobs/horovod_mnist.py

Every epoch the ranks' parameter digests must agree; rank 0 exports the model to ONNX and
verifies it in onnxruntime.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainkit import flags, mnist
from trainkit.job import run_from_command_line
from trainkit.torch_loop import TorchJob


class Net(nn.Module):
    """Horovod's own MNIST example network: two convolutions, two dense layers, 10 logits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return self.fc2(x)


def load_mnist(root: Path, train: bool):
    import torchvision

    return torchvision.datasets.MNIST(root=str(root), train=train, download=False,
                                      transform=torchvision.transforms.ToTensor())


@dataclass(frozen=True)
class MNISTConfig:
    root: str  # the MNIST root the driver checked
    data_dir: str | None  # --data-dir; None: the built-in set, written on each node
    train_size: int


class HorovodMNIST(TorchJob[MNISTConfig]):
    name = "horovod_mnist"
    description = __doc__.split("\n\n")[0]
    trainer = "horovod"
    launchers = ("ray", "horovodrun", "local")
    packages = ("horovod", "torchvision")
    batch_size, epochs, lr = 128, 2, 1e-4
    worker_help = "Horovod ranks"

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--data-dir", default=None,
                       help="torchvision MNIST root (holding MNIST/raw/*-ubyte); default: built-in "
                            "digits written once in MNIST's format under $DLC_HOME/data")

    def prepare(self, args) -> MNISTConfig:
        root = (mnist.check_dir(args.data_dir) if args.data_dir
                else mnist.ensure_builtin(flags.dlc_home() / "data" / "mnist-builtin"))
        return MNISTConfig(str(root), args.data_dir, len(load_mnist(root, True)))

    def describe(self, config: MNISTConfig) -> str:
        return f"{config.train_size} MNIST training images from {config.root}"

    def train_size(self, config: MNISTConfig) -> int:
        return config.train_size

    def signature(self, config: MNISTConfig) -> dict:
        return {"model": "Net", "input": [1, 28, 28]}

    def root(self, config: MNISTConfig) -> Path:
        # on another node the built-in set is written there once (its own $DLC_HOME)
        if config.data_dir:
            return Path(config.root)
        return mnist.ensure_builtin(flags.dlc_home() / "data" / "mnist-builtin")

    def model(self, config: MNISTConfig) -> nn.Module:
        return Net()

    def optimizer(self, model: nn.Module, lr: float, world_size: int):
        return torch.optim.Adam(model.parameters(), lr=lr * world_size)  # Horovod's scaling rule

    def datasets(self, config: MNISTConfig):
        root = self.root(config)
        return load_mnist(root, True), load_mnist(root, False)

    def step(self, model, batch):
        x, target = batch
        logits = model(x)
        loss = F.cross_entropy(logits, target)
        return loss, {"loss": loss * len(x), "accuracy": (logits.argmax(1) == target).sum()}

    def held_out(self, config: MNISTConfig) -> np.ndarray:
        test = load_mnist(self.root(config), False)
        return torch.stack([test[i][0] for i in range(16)]).numpy()


if __name__ == "__main__":
    run_from_command_line(HorovodMNIST())
