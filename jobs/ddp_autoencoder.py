"""A convolutional autoencoder on video frames, data-parallel (PyTorch DDP) on Ray Train.

The model is the tutorial's (../shared/seeds/000_*), trained with Ray Train's TorchTrainer across
every node of the cluster, checkpointed each epoch, exported to ONNX and checked in onnxruntime:

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/ddp_autoencoder.py --num-workers 2 --epochs 1

Rerunning with the same --name (and --storage-path) resumes from that run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainkit, also outside Ray

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainkit import cluster, data  # noqa: E402
from trainkit.errors import UserError, run_main  # noqa: E402
from trainkit.onnx_export import export_torch, verify_and_publish  # noqa: E402
from trainkit.progress import say  # noqa: E402

JOB = "ddp_autoencoder"
STATE_FILE = "state.pt"


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=JOB, description=__doc__.split("\n\n")[0],
                                formatter_class=cluster.HelpFormatter)
    p.add_argument("--num-workers", type=cluster.num_workers_arg, default="auto",
                   help="data-parallel workers (one process each); auto: one per GPU, else one per node")
    p.add_argument("--batch-size", type=int, default=128, help="batch size per worker")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train (in all, when resuming)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--use-gpu", default="auto", choices=["auto", "true", "false"],
                   help="train on GPUs (NCCL) or CPUs (gloo); auto: GPUs when the cluster has "
                        "one per worker")
    p.add_argument("--data", default=None,
                   help="a folder of images (searched recursively) or a video file (split into "
                        "frames); default: 6472 built-in frames panned over scikit-learn's "
                        "sample photographs")
    p.add_argument("--image-size", default="120x160",
                   help="HEIGHTxWIDTH every frame is resized to (multiples of 20)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N frames")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of the frames held out for validation and the ONNX check")
    cluster.add_run_flags(p, JOB, resumes=True)
    args = p.parse_args(argv)
    cluster.resolve_run_flags(args, JOB)
    return args


# ------------------------------------------------------------------ on every Ray worker
def train_loop(config: dict) -> None:
    import ray.train
    import ray.train.torch
    from torch.utils.data import DataLoader, Subset

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    frames = data.FrameDataset(config["source"])
    train_idx, val_idx = data.split_indices(len(frames), config["val_fraction"])
    bs = config["batch_size"]
    train_loader = ray.train.torch.prepare_data_loader(
        DataLoader(Subset(frames, train_idx), batch_size=bs, shuffle=True))
    val_loader = ray.train.torch.prepare_data_loader(DataLoader(Subset(frames, val_idx), batch_size=bs))

    model = ray.train.torch.prepare_model(AutoEncoder())
    plain = model.module if hasattr(model, "module") else model
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    loss_fn = nn.MSELoss()

    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / STATE_FILE, map_location=device, weights_only=True)
        plain.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if rank == 0:
            say(JOB, f"resuming after epoch {start_epoch} from {checkpoint.path}")
            if start_epoch >= config["epochs"]:
                say(JOB, f"run already trained {start_epoch} epoch(s); exporting its latest "
                      f"checkpoint (raise --epochs to train on)")

    for epoch in range(start_epoch, config["epochs"]):
        if world > 1:
            train_loader.sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        model.train()
        train = _run(train_loader, model, loss_fn, optimizer, rank, f"epoch {epoch + 1} train")
        t_train = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            val = _run(val_loader, model, loss_fn, None, rank, f"epoch {epoch + 1} val")
        epoch_s = time.perf_counter() - t0
        # Sum losses and sample counts over all workers so the metrics describe the whole step.
        sums = torch.tensor([train[0], train[1], val[0], val[1]], dtype=torch.float64, device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        tr_loss, tr_n, va_loss, va_n = sums.tolist()
        metrics = {
            "epoch": epoch + 1,
            "loss": tr_loss / tr_n,
            "val_loss": va_loss / va_n,
            "train_iters": train[2],
            "val_iters": val[2],
            "iters_per_epoch": train[2] + val[2],  # per worker, as in the tutorial's table
            "samples_per_s": tr_n / t_train,  # training samples over all workers
            "epoch_s": epoch_s,
            "world_size": world,
            "device": str(device.type),
        }
        if rank == 0:
            say(JOB, f"epoch {epoch + 1}/{config['epochs']}: loss {metrics['loss']:.5f} "
                  f"val_loss {metrics['val_loss']:.5f} iters/epoch {metrics['iters_per_epoch']} "
                  f"{metrics['samples_per_s']:.1f} samples/s {epoch_s:.1f} s")
        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if rank == 0:
                torch.save({"model": plain.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch + 1, "metrics": metrics}, Path(d) / STATE_FILE)
                ckpt = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=ckpt)


def _run(loader, model, loss_fn, optimizer, rank: int, label: str) -> tuple[float, int, int]:
    """One pass; returns (loss summed over samples, samples, iterations). Rank 0 shows progress."""
    total, n, iters = 0.0, 0, 0
    every = max(1, len(loader) // 4)
    for x in loader:
        out = model(x)
        loss = loss_fn(out, x)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        total += loss.item() * len(x)
        n += len(x)
        iters += 1
        if rank == 0 and (iters % every == 0 or iters == len(loader)):
            say(JOB, f"{label}: {iters}/{len(loader)} iterations")
    return total, n, iters


# ------------------------------------------------------------------ on the driver
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.epochs < 1:
        raise UserError(f"--epochs {args.epochs} must be at least 1")
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction {args.val_fraction} must be between 0 and 1")
    size = data.parse_size(args.image_size, multiple=20)
    source = data.inspect_frames(args.data, size, args.limit)
    train_idx, val_idx = data.split_indices(source.count, args.val_fraction)
    plan = cluster.plan_workers(args.num_workers, args.use_gpu, *cluster.connect(),
                                        placement=args.placement)
    cluster.check_batch(args.batch_size, len(train_idx), plan.num_workers)
    say(JOB, f"run {args.name}: {source.describe()}; {plan.describe()}, batch "
          f"{args.batch_size} per worker, {args.epochs} epoch(s); storage {args.storage_path}")

    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"source": source, "batch_size": args.batch_size, "epochs": args.epochs,
                           "lr": args.lr, "val_fraction": args.val_fraction},
        scaling_config=ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                     placement_strategy=plan.placement,
                                     resources_per_worker={"CPU": plan.cpus_per_worker}),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                             checkpoint_config=CheckpointConfig(num_to_keep=None)),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"run {args.name} finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True)

    model = AutoEncoder()
    model.load_state_dict(state["model"])
    model.eval()
    frames = data.FrameDataset(source)
    held_out = torch.stack([frames[i] for i in val_idx[:16]])
    with torch.no_grad():
        reference = model(held_out).numpy()
    staged = export_torch(model, held_out, args.output)
    onnx_path, manifest_path, manifest = verify_and_publish(
        staged, args.output, job=JOB, framework="torch", inputs=held_out.numpy(),
        reference=reference, metrics=state["metrics"], world_size=plan.num_workers,
        packages=("torchvision", "onnxscript"),
        extra={"run": {"name": args.name, "storage_path": args.storage_path,
                       "checkpoint": result.checkpoint.path, "epochs": state["epoch"],
                       "batch_size": args.batch_size, "data": source.describe()}},
    )
    say(JOB, f"ONNX parity: max abs diff {manifest['parity']['max_abs_diff']:.2e} "
          f"(tolerance {manifest['parity']['tolerance']:g})")
    say(JOB, f"ONNX model: {onnx_path}")
    say(JOB, f"manifest:   {manifest_path}")


if __name__ == "__main__":
    run_main(main, JOB)
