"""A team's own model on the harness: a small MLP regressor on a CSV of numbers (each row the
features, then the target), PyTorch DDP on Ray, under torchrun, or alone.

Copied to jobs/tabular_regression.py it runs like the project's jobs (docs/jobs.md, "Bring your
own model"):

    ray job submit --working-dir . -- python jobs/tabular_regression.py --csv /srv/dlcluster/data/prices.csv
    torchrun --nproc-per-node 2 jobs/tabular_regression.py --csv prices.csv
    python jobs/tabular_regression.py --csv prices.csv

The harness gives it every shared flag (--epochs, --batch-size, --lr, --num-workers, --name,
--storage-path, --output, --use-gpu...), checkpoints and resume, per-phase timing, replica checks
and the verified ONNX model with its manifest.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainkit.errors import UserError
from trainkit.job import run_from_command_line
from trainkit.torch_loop import TorchJob


@dataclass(frozen=True)
class TableConfig:
    """What prepare() checked on the driver; every rank gets it."""

    csv: str
    features: int
    rows: int


def read_table(path: str | Path) -> np.ndarray:
    return np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)


class TabularRegression(TorchJob[TableConfig]):
    name = "tabular_regression"
    description = __doc__.split("\n\n")[0]
    batch_size, epochs, lr = 32, 5, 1e-2

    def add_flags(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--csv", required=True,
                       help="rows of numbers, the features then the target; on a cluster a path "
                            "every node reads (the shared storage)")

    def prepare(self, args: argparse.Namespace) -> TableConfig:
        path = Path(args.csv).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"--csv: no file {path}; give a CSV that every node can read "
                            "(on a cluster: under the shared storage)")
        try:
            table = read_table(path)
        except ValueError as e:
            raise UserError(f"--csv: {path} is not rows of numbers ({e}); fix the file") from None
        if table.shape[1] < 2 or len(table) < 10:
            raise UserError(f"--csv: {path} has {len(table)} row(s) of {table.shape[1]} column(s); "
                            "give at least 10 rows of one or more features and the target")
        return TableConfig(str(path), table.shape[1] - 1, len(table))

    def describe(self, config: TableConfig) -> str:
        return f"{config.rows} rows of {config.features} feature(s) from {config.csv}"

    def train_size(self, config: TableConfig) -> int:
        return config.rows - config.rows // 5  # the last fifth validates

    def signature(self, config: TableConfig) -> dict:
        return {"model": "MLP", "features": config.features}

    def model(self, config: TableConfig) -> nn.Module:
        return nn.Sequential(nn.Linear(config.features, 32), nn.ReLU(), nn.Linear(32, 1))

    def datasets(self, config: TableConfig):
        table = torch.from_numpy(read_table(config.csv))
        train, val = table[:self.train_size(config)], table[self.train_size(config):]
        return TensorDataset(train[:, :-1], train[:, -1:]), TensorDataset(val[:, :-1], val[:, -1:])

    def step(self, model: nn.Module, batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"loss": loss * len(x)}

    def held_out(self, config: TableConfig) -> np.ndarray:
        return read_table(config.csv)[-8:, :-1]


if __name__ == "__main__":
    run_from_command_line(TabularRegression())
