"""A convolutional autoencoder on video frames, data-parallel with PyTorch DDP.

The model is the one of the PyTorch Lightning DDP tutorial (an autoencoder on 6472 video frames,
3 GPUs). The same file trains on the cluster, under torchrun and in one process:

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/ddp_autoencoder.py
    torchrun --nproc_per_node 2 jobs/ddp_autoencoder.py --epochs 1
    python jobs/ddp_autoencoder.py --epochs 1

Rerunning with the same --name (and --storage-path) resumes from that run's latest checkpoint.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import Subset

from trainkit import data, flags
from trainkit.job import run_from_command_line
from trainkit.torch_loop import TorchJob


class AutoEncoder(nn.Module):
    """The tutorial's autoencoder: H x W maps back onto H x W when both are multiples of 20."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(4, 4),
            nn.Conv2d(8, 16, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(5, 5),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(16, 8, kernel_size=5, stride=5),
            nn.ReLU(),
            nn.ConvTranspose2d(8, 3, kernel_size=5, stride=4, padding=1, output_padding=1),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


@dataclass(frozen=True)
class AutoencoderConfig:
    source: data.FrameSource  # the frames, checked on the driver
    train: list[int]  # frame indices
    val: list[int]


class DDPAutoencoder(TorchJob[AutoencoderConfig]):
    name = "ddp_autoencoder"
    description = __doc__.split("\n\n")[0]
    packages = ("torchvision", "onnxscript")
    batch_size, epochs, lr = 128, 1, 1e-3

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--data", default=None,
                       help="a folder of images (searched recursively) or a video file (split into "
                            "frames); default: 6472 built-in frames panned over scikit-learn's "
                            "sample photographs")
        p.add_argument("--image-size", default="120x160",
                       help="HEIGHTxWIDTH every frame is resized to (multiples of 20)")
        p.add_argument("--limit", type=flags.positive_int, default=None, help="use only the first N frames")
        p.add_argument("--val-fraction", type=flags.fraction, default=0.1,
                       help="share of the frames held out for validation and the ONNX check")

    def prepare(self, args) -> AutoencoderConfig:
        size = data.parse_size(args.image_size, multiple=20)
        source = data.inspect_frames(args.data, size, args.limit)
        train, val = data.split_indices(source.count, args.val_fraction)
        return AutoencoderConfig(source, train, val)

    def describe(self, config: AutoencoderConfig) -> str:
        return config.source.describe()

    def train_size(self, config: AutoencoderConfig) -> int:
        return len(config.train)

    def signature(self, config: AutoencoderConfig) -> dict:
        return {"model": "AutoEncoder", "image_size": list(config.source.size)}

    def model(self, config: AutoencoderConfig) -> nn.Module:
        return AutoEncoder()

    def datasets(self, config: AutoencoderConfig):
        frames = data.FrameDataset(config.source)
        return Subset(frames, config.train), Subset(frames, config.val)

    def step(self, model, batch):
        x = batch.float().div_(255.0)  # uint8 frames, scaled on the device
        loss = nn.functional.mse_loss(model(x), x)
        return loss, {"loss": loss * len(x)}

    def held_out(self, config: AutoencoderConfig) -> np.ndarray:
        return data.frames_at(config.source, config.val[:16])


if __name__ == "__main__":
    run_from_command_line(DDPAutoencoder())
