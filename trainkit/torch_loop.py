"""PyTorch jobs: the epoch loop, and the two ways ranks talk (torch.distributed, Horovod).

The loop is the same under every launcher. What differs sits in a small world (in the spirit
of Ignite's `idist`): rank, size, device, how the model and optimizer are wrapped (DDP, or
Horovod's DistributedOptimizer + broadcasts), and the collectives the harness needs (a sum, an
all-gather, a barrier). Under Ray's TorchTrainer the process group is Ray's; under torchrun the
world makes it from torchrun's environment; alone there is none.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import launch
from .contract import C, Exported, Job, Run
from .errors import UserError
from .flags import UseGpu
from .metrics import export_epoch
from .progress import say_epoch
from .replicas import check_replicas_agree, describe_rank, record_shards
from .timing import PhaseTimer
from .tracking import log_epoch

STATE_FILE = "state.pt"


def want_gpu(use_gpu: UseGpu) -> bool:
    """--use-gpu for this process: auto uses CUDA when it sees a device; true without one is an error."""
    seen = torch.cuda.is_available()
    if use_gpu == UseGpu.YES and not seen:
        raise UserError("--use-gpu true but this process sees no CUDA device (torch "
                        f"{torch.__version__}, CUDA build {torch.version.cuda}); check the driver "
                        "and CUDA_VISIBLE_DEVICES, or pass --use-gpu false")
    return seen if use_gpu == UseGpu.AUTO else use_gpu == UseGpu.YES


class TorchWorld:
    """torch.distributed: Ray's TorchTrainer group, torchrun's, or a single process. Implements
    `contract.World`, plus what the torch loop needs: the device, a sum, the model's wrapping, the
    optimizer's step."""

    def __init__(self, launcher: str, use_gpu: UseGpu):
        import torch.distributed as dist

        self.launcher, self.dist = launcher, dist
        self.use_gpu = want_gpu(use_gpu)
        if launcher == "ray":
            import ray.train.torch

            self.device = ray.train.torch.get_device() if self.use_gpu else torch.device("cpu")
        else:
            _, _, local = launch.world_from_env(launcher)
            self.device = torch.device("cuda", local) if self.use_gpu else torch.device("cpu")
        if self.use_gpu:
            torch.cuda.set_device(self.device)
        if launcher == "torchrun" and not dist.is_initialized():
            dist.init_process_group("nccl" if self.use_gpu else "gloo")
        self.grouped = dist.is_available() and dist.is_initialized()
        self.backend = dist.get_backend() if self.grouped else "none"
        self.rank = dist.get_rank() if self.grouped else 0
        self.size = dist.get_world_size() if self.grouped else 1
        self.allreduce_s = 0.0

    @property
    def device_kind(self) -> str:
        return "GPU" if self.use_gpu else "CPU"

    def sync(self) -> None:
        if self.use_gpu:
            torch.cuda.synchronize(self.device)

    def sum(self, values: list) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.grouped:
            self.dist.all_reduce(t)
        return t.tolist()

    def gather(self, obj) -> list:
        if not self.grouped:
            return [obj]
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def agree(self, value):
        """Rank 0's value on every rank (e.g. a generated run name)."""
        if not self.grouped:
            return value
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.grouped:
            self.dist.barrier()

    def wrap(self, model: nn.Module, optimizer):
        """DDP over the group (its parameters start as rank 0's), with a comm hook that times
        the gradient all-reduce."""
        if self.size == 1:
            return model, optimizer
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[self.device.index] if self.use_gpu else None)

        def timed(state, bucket):
            t0 = time.perf_counter()

            def done(fut):
                self.allreduce_s += time.perf_counter() - t0
                return fut.value()

            return allreduce_hook(state, bucket).then(done)

        ddp.register_comm_hook(None, timed)
        return ddp, optimizer

    def step(self, optimizer) -> None:
        optimizer.step()

    def take_allreduce_s(self) -> float:
        seconds, self.allreduce_s = self.allreduce_s, 0.0
        return seconds

    def shutdown(self) -> None:
        """Under torchrun: wait for every rank, then take the group down (the others' is Ray's)."""
        if self.launcher == "torchrun" and self.grouped:
            self.dist.barrier()
            self.dist.destroy_process_group()


class HorovodWorld(TorchWorld):
    """Horovod: hvd.init(), one GPU per local rank, DistributedOptimizer and broadcasts from rank 0."""

    def __init__(self, launcher: str, use_gpu: UseGpu):
        import horovod.torch as hvd

        self.hvd, self.launcher = hvd, launcher
        self.use_gpu = want_gpu(use_gpu)
        hvd.init()
        self.rank, self.size, self.grouped = hvd.rank(), hvd.size(), True
        self.backend = "horovod-nccl" if self.use_gpu and hvd.nccl_built() else "horovod-gloo"
        self.device = torch.device("cuda", hvd.local_rank()) if self.use_gpu else torch.device("cpu")
        if self.use_gpu:
            torch.cuda.set_device(self.device)
        self.allreduce_s = 0.0

    def sum(self, values: list) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return self.hvd.allreduce(t, op=self.hvd.Sum, name="harness.sum").tolist()

    def gather(self, obj) -> list:
        return self.hvd.allgather_object(obj, name="harness.gather")

    def agree(self, value):
        return self.hvd.broadcast_object(value, root_rank=0, name="harness.agree")

    def barrier(self) -> None:
        self.hvd.allreduce(torch.zeros(1), name="harness.barrier")

    def wrap(self, model: nn.Module, optimizer):
        hvd = self.hvd
        restored = optimizer.state_dict()  # DistributedOptimizer starts with an empty state
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        optimizer.load_state_dict(restored)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return model, optimizer

    def step(self, optimizer) -> None:
        # Horovod all-reduces each gradient as backward produces it; synchronize() waits for all.
        t0 = time.perf_counter()
        optimizer.synchronize()
        self.allreduce_s += time.perf_counter() - t0
        with optimizer.skip_synchronize():
            optimizer.step()

    def shutdown(self) -> None:
        self.hvd.shutdown()  # all ranks leave together (no "connection reset" from an early one)


class TorchJob(Job[TorchWorld, C]):
    """A PyTorch job: the subclass gives model(), optimizer(), datasets() and step()."""

    framework = "torch"
    trainer = "torch"
    launchers = ("ray", "torchrun", "local")
    loader_workers = 0
    # checkpoints in torch.distributed.checkpoint's layout (trainkit.sharding), every rank writing
    # its part; False: rank 0 writes STATE_FILE (torch.save) for the replicas
    distributed_checkpoint = False

    # ---- the job's part
    def model(self, config: C) -> nn.Module:
        raise NotImplementedError

    def optimizer(self, model: nn.Module, lr: float, world_size: int):
        return torch.optim.Adam(model.parameters(), lr=lr)

    def datasets(self, config: C):
        """(training set, validation set): torch Datasets."""
        raise NotImplementedError

    def shard(self, model: nn.Module, world: TorchWorld, config: C) -> bool:
        """Shard the model across the world's group in place before its optimizer is made (FSDP:
        `sharding.shard`): True when it did. False (the default, and always without a group):
        replicas, wrapped by the world."""
        return False

    def accumulation(self, config: C) -> int:
        """Batches whose gradients add up before each optimizer step."""
        return 1

    def finish_metrics(self, metrics: dict) -> None:
        """Metrics derived from an epoch's (e.g. a perplexity from a loss), added in place."""

    def before_step(self, model: nn.Module, optimizer) -> None:
        """Called before each optimizer step, gradients in place (e.g. to measure what a rank holds)."""

    def rank_metrics(self, model: nn.Module, optimizer, world: TorchWorld) -> dict:
        """Metrics each rank measures of itself, after an epoch (every rank calls this: it may gather)."""
        return {}

    def step(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward one batch: the mean loss to back-propagate, and per-batch sums of the metrics
        (e.g. {"loss": loss * n, "accuracy": correct}); the harness divides by the samples seen."""
        raise NotImplementedError

    # ---- the framework's part
    def world(self, launcher: str, use_gpu: UseGpu) -> TorchWorld:
        return HorovodWorld(launcher, use_gpu) if self.trainer == "horovod" else TorchWorld(launcher, use_gpu)

    def fit(self, run: Run, config: C, world: TorchWorld | None = None) -> None:
        world = world or self.world(run.launcher, UseGpu.of(run.use_gpu))
        store = self.store(run, config, world)
        torch.manual_seed(world.rank)  # ranks start apart on purpose: the wrap must align them
        model = self.model(config).to(world.device)
        sharded = self.shard(model, world, config)
        optimizer = self.optimizer(model, run.lr, world.size)
        start = self.resume(store, run, world, lambda folder: self.restore(folder, model, optimizer,
                                                                           world, run.name))
        if start is None:
            return
        wrapped, optimizer = (model, optimizer) if sharded else world.wrap(model, optimizer)
        accumulate = self.accumulation(config)
        train_set, val_set = self.datasets(config)
        train = self.loader(train_set, run.batch_size, world, shuffle=True)
        val = self.loader(val_set, run.batch_size, world, shuffle=False)
        for epoch in range(start, run.epochs):
            if world.size > 1:
                train.sampler.set_epoch(epoch)
            first_step = (lambda: self.report_first_step(run, world)) if epoch == start else None
            metrics = self.epoch(wrapped, optimizer, train, val, world, f"epoch {epoch + 1}/{run.epochs}",
                                 first_step, accumulate)
            self.finish_metrics(metrics)
            metrics.update(self.rank_metrics(model, optimizer, world))
            metrics.update(epoch=epoch + 1, world_size=world.size, device=world.device.type,
                           launcher=run.launcher, backend=world.backend)
            if world.use_gpu:  # what the tutorial read off nvidia-smi, from the allocator itself
                metrics["gpu_memory_peak_mb"] = torch.cuda.max_memory_allocated(world.device) / 2**20
            check = self.check_ranks(model, world, sharded)
            if world.rank == 0:
                say_epoch(self.name, epoch + 1, run.epochs, metrics)
                export_epoch(self.name, run.name, metrics, run.attempts)

            store.save(epoch + 1, metrics, lambda folder: self.save_state(folder, model, optimizer),
                       replicas=check, every_rank=self.distributed_checkpoint)
            if world.rank == 0:
                log_epoch(self.name, run, metrics)

    def save_state(self, folder: Path, model: nn.Module, optimizer) -> None:
        """The checkpoint's files: every rank's part (DCP), or rank 0's whole state."""
        if self.distributed_checkpoint:
            from . import sharding

            sharding.save(folder, model, optimizer)
        else:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       folder / STATE_FILE)

    def restore(self, folder: Path, model: nn.Module, optimizer, world: TorchWorld, name: str) -> None:
        """A checkpoint into this rank's model and optimizer (before they are wrapped)."""
        if self.distributed_checkpoint:
            from . import sharding

            sharding.load(folder, model, optimizer, name)
        else:
            load_state(model, optimizer, torch.load(folder / STATE_FILE, map_location=world.device,
                                                    weights_only=True), name)

    def load_weights(self, folder: Path, model: nn.Module) -> None:
        """A checkpoint's weights into a plain model, in one process (publishing)."""
        if self.distributed_checkpoint:
            from . import sharding

            sharding.load_alone(folder, model)
        else:
            state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])

    def check_ranks(self, model: nn.Module, world: TorchWorld, sharded: bool) -> dict:
        """After each epoch: replicas hold the same parameters (else a RuntimeError); sharded ranks
        each hold their own part, recorded with its digest and host."""
        if not sharded:
            return check_replicas_agree(world.gather(describe_rank(
                p.detach().cpu().numpy() for p in model.state_dict().values())))
        from . import sharding

        return record_shards(world.gather(describe_rank(sharding.local_arrays(model))))

    def loader(self, dataset, batch_size: int, world: TorchWorld, shuffle: bool):
        """Ignite's auto_dataloader: a DistributedSampler over the world, pinned memory on GPU."""
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = (DistributedSampler(dataset, num_replicas=world.size, rank=world.rank, shuffle=shuffle)
                   if world.size > 1 else None)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                          shuffle=shuffle and sampler is None, num_workers=self.loader_workers,
                          pin_memory=world.use_gpu, persistent_workers=self.loader_workers > 0)

    def epoch(self, model, optimizer, train, val, world: TorchWorld, label: str, first_step,
              accumulate: int = 1) -> dict:
        timer = PhaseTimer(world.sync)
        sums: dict[str, torch.Tensor] = {}
        model.train()
        n_train = self.run_pass(model, train, world, timer, "processing_s", sums, optimizer, label,
                                first_step, accumulate)
        train_s = timer.train_s
        timer.add("allreduce_s", world.take_allreduce_s())
        val_sums: dict[str, torch.Tensor] = {}
        model.eval()
        with timer.phase("validation_s"), torch.no_grad():
            n_val = self.run_pass(model, val, world, None, None, val_sums, None, "", None)
        seconds = timer.done()
        # one all-reduce per epoch: metric sums, sample counts and phase times of every rank
        keys, vkeys = list(sums), list(val_sums)  # the step's order, the same on every rank
        totals = world.sum([*(sums[k].item() for k in keys), n_train, len(train),
                            *(val_sums[k].item() for k in vkeys), n_val, len(val),
                            *seconds.values(), train_s])
        it = iter(totals)
        metrics = {k: next(it) for k in keys}
        n = next(it)
        metrics = {k: v / n for k, v in metrics.items()}
        train_iters = round(next(it) / world.size)
        val_metrics = {k: next(it) for k in vkeys}
        n_v = next(it)
        metrics.update({f"val_{k}": v / n_v for k, v in val_metrics.items()})
        val_iters = round(next(it) / world.size)
        metrics.update({k: next(it) / world.size for k in seconds})  # mean over the ranks
        metrics.update(train_iters=train_iters, val_iters=val_iters,
                       iters_per_epoch=train_iters + val_iters,  # per worker, as the tutorial counts
                       samples_per_s=n / (next(it) / world.size))
        return metrics

    def run_pass(self, model, loader, world: TorchWorld, timer: PhaseTimer | None, phase: str | None,
                 sums: dict, optimizer, label: str, first_step, accumulate: int = 1) -> int:
        """One pass over a loader; metric sums stay on the device (no host sync per step). In
        training, the optimizer steps after every `accumulate` batches (and after the last).
        Rank 0 shows the training pass's progress in quarters."""
        seen, every = 0, max(1, len(loader) // 4)
        batches = timer.batches(loader) if timer else loader
        for i, batch in enumerate(batches, 1):
            with timer.phase(phase) if timer and phase else contextlib.nullcontext():
                batch = to_device(batch, world.device)
                loss, stats = self.step(model, batch)
                if optimizer is not None:
                    (loss / accumulate if accumulate > 1 else loss).backward()
                    if i % accumulate == 0 or i == len(loader):
                        self.before_step(model, optimizer)
                        world.step(optimizer)
                        optimizer.zero_grad()
                for k, v in stats.items():
                    sums[k] = sums[k] + v.detach() if k in sums else v.detach().double()
            if i == 1 and first_step is not None:
                first_step()
            seen += len(batch[0] if isinstance(batch, list | tuple) else batch)
            if label and world.rank == 0 and i % every == 0 and i < len(loader):
                self.say(f"{label}: {i}/{len(loader)} iterations")
        return seen

    # ---- publishing
    def export(self, folder: Path, config: C, inputs: np.ndarray, output: Path) -> Exported:
        from .onnx_export import export_torch

        model = self.model(config)
        self.load_weights(folder, model)
        model.eval()
        x = torch.from_numpy(inputs)
        with torch.no_grad():
            reference = model(x).numpy()
        return Exported(export_torch(model, x, output), reference)


def load_state(model: nn.Module, optimizer, state: dict, name: str) -> None:
    """A checkpoint's weights into the model; one line when they do not fit it."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"run {name}'s checkpoint does not fit this model ({first}); resume it with "
                        "its own flags, or use another --name for a new run") from None


def to_device(batch, device: torch.device):
    if isinstance(batch, list | tuple):
        return type(batch)(b.to(device, non_blocking=True) for b in batch)
    return batch.to(device, non_blocking=True)
