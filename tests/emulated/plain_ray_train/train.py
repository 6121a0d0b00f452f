"""A Ray Train script as a team brings it, nothing of this project in it: a TorchTrainer whose
ranks each report a checkpoint every epoch and go on from the latest after a restart, with
RunConfig left without a storage_path (Ray Train's default: the driver's ~/ray_results).

    ray job submit --working-dir tests/emulated/plain_ray_train -- python train.py

The emulated tier submits it to the provisioned cluster and kills a worker mid-run
(test_an_unchanged_ray_train_script_keeps_its_checkpoints_on_the_shared_storage)."""

import os
import tempfile
import time

import ray.train
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

EPOCHS = 8


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model = prepare_model(net)  # DDP across the ranks; `net` is the module it wraps
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    rank = ray.train.get_context().get_world_rank()
    x = torch.randn(256, 8)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(start, config["epochs"]):
        for i in range(0, len(x), 32):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[i:i + 32]), y[i:i + 32])
            loss.backward()
            optimizer.step()
        time.sleep(2)  # the rest of an epoch's work
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(folder, "state.pt"))
            ray.train.report({"epoch": epoch, "loss": loss.item(), "started_at_epoch": start},
                             checkpoint=Checkpoint.from_directory(folder) if rank == 0 else None)


if __name__ == "__main__":
    trainer = TorchTrainer(
        train_loop, train_loop_config={"epochs": EPOCHS},
        scaling_config=ScalingConfig(num_workers=3, placement_strategy="SPREAD"),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    print(f"RESULT path={result.path} checkpoint={result.checkpoint.path} epoch={result.metrics['epoch']} "
          f"started_at_epoch={result.metrics['started_at_epoch']}", flush=True)
