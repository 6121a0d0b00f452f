"""Horovod with PyTorch on MNIST, on Ray's HorovodTrainer or under horovodrun.

The tutorial (../shared/seeds/001_*), step by step: hvd.init(), the device pinned to
hvd.local_rank() on GPU, a DistributedSampler over hvd.size() replicas, hvd.DistributedOptimizer,
hvd.broadcast_parameters from rank 0, the learning rate scaled by the number of workers.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python jobs/horovod_mnist.py
    horovodrun -np 2 -H localhost:2 python jobs/horovod_mnist.py

Either way rank 0 checks that every rank ends with identical parameters, exports the model to
ONNX and verifies it in onnxruntime.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

# Ray 2.60 trains with Train V2 by default, and V2's HorovodTrainer is only a stub that raises
# ("HorovodTrainer is not supported"); V1 still runs Horovod. The switch is read when Ray Train
# is first imported, so it is set here, before anything imports it.
os.environ["RAY_TRAIN_V2_ENABLED"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainkit, also outside Ray

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from trainkit import cluster, mnist  # noqa: E402
from trainkit.errors import UserError, run_main  # noqa: E402
from trainkit.onnx_export import export_torch, verify_and_publish  # noqa: E402
from trainkit.progress import say  # noqa: E402

JOB = "horovod_mnist"
STATE_FILE = "state.pt"


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=JOB, description=__doc__.split("\n\n")[0],
                                formatter_class=cluster.HelpFormatter)
    p.add_argument("--num-workers", type=cluster.num_workers_arg, default="auto",
                   help="Horovod ranks on Ray; auto: one per GPU, else one per node "
                        "(under horovodrun, -np decides)")
    p.add_argument("--batch-size", type=int, default=128, help="batch size per rank")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train")
    p.add_argument("--lr", type=float, default=1e-4,
                   help="Adam learning rate for one rank; multiplied by the number of ranks")
    p.add_argument("--use-gpu", default="auto", choices=["auto", "true", "false"],
                   help="train on GPUs (each rank pinned to its local_rank); auto: when the "
                        "cluster has one per worker")
    p.add_argument("--data-dir", default=None,
                   help="torchvision MNIST root (holding MNIST/raw/*-ubyte); default: built-in "
                        "digits written once in MNIST's format under $DLC_HOME/data")
    cluster.add_run_flags(p, JOB)
    args = p.parse_args(argv)
    cluster.resolve_run_flags(args, JOB)
    return args


def mnist_root(data_dir: str | None) -> Path:
    if data_dir:
        return mnist.check_dir(data_dir)
    return mnist.ensure_builtin(cluster.DEFAULT_HOME / "data" / "mnist-builtin")


def load_mnist(root: Path, train: bool):
    import torchvision

    return torchvision.datasets.MNIST(root=str(root), train=train, download=False,
                                      transform=torchvision.transforms.ToTensor())


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ every rank
def train_func(config: dict) -> dict | None:
    import horovod.torch as hvd
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from tqdm import tqdm

    hvd.init()
    if config["use_gpu"]:
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
    dataset = load_mnist(mnist_root(config["data_dir"]), train=True)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)

    torch.manual_seed(hvd.rank())  # different starting points: broadcast_parameters must align them
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"] * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    criterion = nn.CrossEntropyLoss()

    metrics = {}
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.perf_counter()
        loss_sum = correct = seen = 0.0
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{config['epochs']}", disable=hvd.rank() != 0,
                   file=sys.__stdout__, mininterval=2, ncols=80)
        for x, target in bar:
            x, target = x.to(device), target.to(device)
            optimizer.zero_grad()
            logits = model(x)
            loss = criterion(logits, target)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(x)
            correct += (logits.argmax(1) == target).sum().item()
            seen += len(x)
        seconds = time.perf_counter() - t0
        totals = hvd.allreduce(torch.tensor([loss_sum, correct, seen], dtype=torch.float64),
                               op=hvd.Sum, name=f"epoch{epoch}")
        metrics = {"epoch": epoch + 1, "loss": totals[0].item() / totals[2].item(),
                   "accuracy": totals[1].item() / totals[2].item(), "epoch_s": seconds,
                   "samples_per_s": totals[2].item() / seconds, "iters_per_epoch": len(loader),
                   "world_size": hvd.size()}
        if hvd.rank() == 0:
            say(JOB, f"epoch {epoch + 1}/{config['epochs']}: loss {metrics['loss']:.4f} accuracy "
                     f"{metrics['accuracy']:.3f} {metrics['samples_per_s']:.0f} samples/s {seconds:.1f} s")
        if config["on_ray"]:
            import ray.train

            with tempfile.TemporaryDirectory() as d:
                ckpt = None
                if hvd.rank() == 0:
                    torch.save({"model": model.state_dict(), "epoch": epoch + 1, "metrics": metrics},
                               Path(d) / STATE_FILE)
                    ckpt = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=ckpt)

    # Every rank must end with the very same parameters: gather their digests on every rank.
    digests = hvd.allgather_object(params_digest(model))
    in_sync = len(set(digests)) == 1
    rank = hvd.rank()
    hvd.shutdown()  # all ranks leave together (no "connection reset" from a rank that left early)
    if rank == 0:
        say(JOB, f"{len(digests)} ranks end with {'identical' if in_sync else 'DIFFERENT'} parameters")
        if not config["on_ray"]:
            return {"state": {k: v.cpu() for k, v in model.state_dict().items()},
                    "metrics": metrics, "digests": digests}
        # On Ray the driver reads the state from the checkpoint; the digests go in one more file.
        Path(config["digest_file"]).parent.mkdir(parents=True, exist_ok=True)
        Path(config["digest_file"]).write_text("\n".join(digests) + "\n")
    if not in_sync:
        raise RuntimeError(f"ranks ended with different parameters: {digests}")
    return None


# ------------------------------------------------------------------ driver / rank 0
def export(args, state: dict, metrics: dict, digests: list[str], world: int) -> None:
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks ended with different parameters: {digests}")
    model = Net()
    model.load_state_dict(state)
    model.eval()
    test = load_mnist(mnist_root(args.data_dir), train=False)
    held_out = torch.stack([test[i][0] for i in range(16)])
    with torch.no_grad():
        reference = model(held_out).numpy()
    staged = export_torch(model, held_out, args.output)
    _, manifest_path, manifest = verify_and_publish(
        staged, args.output, job=JOB, framework="torch", inputs=held_out.numpy(),
        reference=reference, metrics=metrics, world_size=world,
        packages=("horovod", "torchvision"),
        extra={"ranks_in_sync": True, "param_digests": digests,
               "run": {"name": args.name, "storage_path": args.storage_path,
                       "batch_size": args.batch_size, "data_dir": str(mnist_root(args.data_dir))}})
    say(JOB, f"ONNX parity: max abs diff {manifest['parity']['max_abs_diff']:.2e}")
    say(JOB, f"ONNX model: {args.output / 'model.onnx'}")
    say(JOB, f"manifest:   {manifest_path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.epochs < 1:
        raise UserError(f"--epochs {args.epochs} must be at least 1")
    root = mnist_root(args.data_dir)  # a bad --data-dir fails here, before any rank starts
    train_size = len(load_mnist(root, train=True))
    config = {"data_dir": args.data_dir, "batch_size": args.batch_size, "epochs": args.epochs,
              "lr": args.lr, "digest_file": str(Path(args.storage_path) / args.name / "param-digests")}

    if "HOROVOD_RANK" in os.environ:  # started by horovodrun: this process is one rank
        size = int(os.environ.get("HOROVOD_SIZE", "1"))
        cluster.check_batch(args.batch_size, train_size, size)
        use_gpu = args.use_gpu == "true" or (args.use_gpu == "auto" and torch.cuda.device_count() > 0)
        out = train_func({**config, "on_ray": False, "use_gpu": use_gpu})
        if out is not None:  # rank 0
            export(args, out["state"], out["metrics"], out["digests"], size)
        return

    plan = cluster.plan_workers(args.num_workers, args.use_gpu, *cluster.connect(),
                                        placement=args.placement)
    cluster.check_batch(args.batch_size, train_size, plan.num_workers)
    say(JOB, f"run {args.name}: {train_size} MNIST training images from {root}; {plan.describe()}")

    from ray.train import RunConfig, ScalingConfig
    from ray.train.horovod import HorovodTrainer

    trainer = HorovodTrainer(
        train_func,
        train_loop_config={**config, "on_ray": True, "use_gpu": plan.use_gpu},
        # Train V1 reserves a CPU for the trainer itself unless told not to: on a cluster with
        # exactly one CPU per worker the workers would wait for ever.
        scaling_config=ScalingConfig(num_workers=plan.num_workers, use_gpu=plan.use_gpu,
                                     placement_strategy=plan.placement,
                                     resources_per_worker={"CPU": plan.cpus_per_worker},
                                     trainer_resources={"CPU": 0}),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path),
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    with result.checkpoint.as_directory() as d:
        saved = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True)
    digests = Path(config["digest_file"]).read_text().split()
    export(args, saved["model"], saved["metrics"], digests, plan.num_workers)


if __name__ == "__main__":
    run_main(main, JOB)
