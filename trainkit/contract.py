"""The job contract: what a job is (`Job`), what the harness asks of a rank's world (`World`),
what every rank knows of the run (`Run`, with where it is tracked: `Target`) and where a start's
time goes (`Timeline`). The harness's other modules build on these; this one builds on none of
them but the flags, the launcher's choice and the store (the entry point is `job`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from . import IMPORTED_AT, flags, launch
from .progress import say
from .store import FolderStore, RayStore, Store

# MLflow 3's UI opens a run in its GenAI view, filed under "Evaluation runs" beside an assistant;
# this query opens the model-training view (the sidebar's "Model training": runs, models, charts)
TRAINING_VIEW = "?workflowType=machine_learning"


def run_page(server: str, experiment_id: str, run_id: str, tab: str = "") -> str:
    """A run's page in MLflow's model-training view; `tab`: one of the page's tabs (model-metrics)."""
    return f"{server}/#/experiments/{experiment_id}/runs/{run_id}{'/' + tab if tab else ''}{TRAINING_VIEW}"


@dataclass(frozen=True)
class Target:
    """Where a run is tracked: what every rank's Run carries (no secret: each process reads the
    credentials from its own environment)."""

    url: str
    experiment_id: str
    run_id: str
    page_url: str | None = None  # the server where the operator opens it (None: url)

    def page(self) -> str:
        """The run's page where the operator's browser opens it."""
        return run_page(self.page_url or self.url, self.experiment_id, self.run_id)

    def node_page(self) -> str:
        """The run's page at the server's address on the cluster's network (the nodes')."""
        return run_page(self.url, self.experiment_id, self.run_id)

    def pages(self) -> str:
        """The link a run prints: the operator's, and the nodes' beside it where they differ."""
        return self.page() if self.page() == self.node_page() else \
            f"{self.page()} (on the cluster's network: {self.node_page()})"

    def manifest(self) -> dict:
        """The manifest's links: `page` the operator opens, `node_page` where they differ."""
        pages = {"page": self.page()}
        return pages if self.page() == self.node_page() else {**pages, "node_page": self.node_page()}


@dataclass
class Timeline:
    """Where a start's time goes, as the manifest records it (time.time() of each point): this
    process (Ray's job driver, or rank 0) reached the harness, had checked its flags and data,
    the workers entered training (model built, checkpoint restored), the first step ended."""

    imported_at: float | None = IMPORTED_AT
    prepared_at: float | None = None
    workers_started_at: float | None = None
    first_step_at: float | None = None

    def mark_prepared(self) -> None:
        self.prepared_at = time.time()

    def mark_workers_started(self) -> None:
        self.workers_started_at = self.workers_started_at or time.time()

    def mark_first_step(self) -> None:
        self.first_step_at = self.first_step_at or time.time()

    def for_manifest(self, export_s: float) -> dict:
        return {"imported_at": self.imported_at, "prepared_at": self.prepared_at,
                "workers_started_at": self.workers_started_at, "first_step_at": self.first_step_at,
                "export_s": export_s}


class World(Protocol):
    """This process's place in the run, as the harness uses it under every framework and
    launcher (`torch_loop.TorchWorld`, `torch_loop.HorovodWorld`, `keras_loop.KerasWorld`)."""

    rank: int
    size: int
    use_gpu: bool

    @property
    def device_kind(self) -> str:
        """"GPU" or "CPU", for the run's first line."""
        ...

    def gather(self, value: str) -> list[str]:
        """Every rank's `value`, in rank order (an all-gather)."""
        ...

    def agree(self, value: str) -> str:
        """Rank 0's `value` on every rank (e.g. a generated run name)."""
        ...

    def barrier(self) -> None: ...

    def shutdown(self) -> None:
        """Leave the group (all ranks together), where this world made it."""
        ...


@dataclass
class Exported:
    """What a job's `export` hands to publishing: the staged ONNX file and the framework's output
    on the held-out inputs (the parity check's reference); and, where a job has them, further
    staged files or folders published beside the model (name -> path) and manifest fields only
    the export knows (e.g. a language model's sampled text)."""

    model: Path
    reference: np.ndarray
    beside: dict[str, Path] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)


# what Run holds that is not the run's settings: left out of the manifest's "run"
RUN_REPORTERS = ("attempts", "timeline", "tracking", "tracking_off")


@dataclass(frozen=True)
class Run:
    """What every rank needs to know about the run (sent to Ray's workers with the job)."""

    job: str
    name: str
    launcher: str
    storage_path: str
    output: str
    epochs: int
    batch_size: int
    lr: float
    use_gpu: bool
    keep_checkpoints: int = 3
    attempts: Any = None  # on Ray: the handle of the Attempts actor every start of the workers reports to
    # under the other launchers: where rank 0 (this process) marks its start and first step
    timeline: Timeline | None = field(default=None, compare=False)
    # where rank 0 logs the run's history (trainkit.tracking), or why it does not
    tracking: Target | None = None
    tracking_off: str = ""

    @classmethod
    def from_flags(cls, job: Job[W, C], settings: flags.RunFlags, launcher: str, use_gpu: bool,
                   attempts: Any = None, timeline: Timeline | None = None) -> Run:
        """The run of resolved flags (RunFlags.resolved)."""
        return cls(job=job.name, name=settings.name, launcher=launcher, storage_path=settings.storage_path,
                   output=settings.output, epochs=settings.epochs, batch_size=settings.batch_size,
                   lr=settings.lr, use_gpu=use_gpu, keep_checkpoints=settings.keep_checkpoints,
                   attempts=attempts, timeline=timeline)


W = TypeVar("W", bound=World)  # the framework's World
C = TypeVar("C")  # the job's configuration: the dataclass its `prepare` returns (e.g. `AutoencoderConfig`),
# checked once on the driver and sent to every rank


class Job(Generic[W, C]):
    """What a job is: its name, frameworks and defaults here; its flags, data, model and step in
    the subclass, its configuration of type C. The framework base classes (`TorchJob`, `KerasJob`)
    supply `world`, `fit`, `load` and `export`."""

    name: str
    description: str
    framework: str  # "torch" | "tensorflow": the manifest's framework
    trainer: str  # the Ray trainer: "torch" | "horovod" | "tensorflow"
    launchers: tuple[str, ...]
    packages: tuple[str, ...] = ()  # further versions the manifest records
    batch_size: int = 128
    epochs: int = 1
    lr: float = 1e-3
    worker_help: str = "data-parallel workers (one process each)"
    # on Ray: the environment variable naming the interpreter its workers run (set per node: the
    # GPU image points TensorFlow's at its own virtualenv); None: the node's default interpreter
    worker_python_env: str | None = None

    # ---- the job's part
    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        """The job's own flags."""

    def prepare(self, args: argparse.Namespace) -> C:
        """Check the job's own flags (those it added: `args` holds them beside the shared ones) and
        its data (one-line UserError); the config every rank gets (the job's own dataclass)."""
        raise NotImplementedError

    def describe(self, config: C) -> str:
        raise NotImplementedError

    def train_size(self, config: C) -> int:
        raise NotImplementedError

    def signature(self, config: C) -> dict:
        """What a checkpoint must match to be resumed (model and data shapes)."""
        return {}

    def held_out(self, config: C) -> np.ndarray:
        """Inputs the ONNX model is checked on against the framework (float32, a batch)."""
        raise NotImplementedError

    def launcher(self, settings: flags.RunFlags, args: argparse.Namespace) -> str:
        """The launcher this run uses: --launcher, else what the environment shows (`args`: the
        job's own flags, where they decide it)."""
        return launch.choose(settings.launcher, self.launchers, self.name)

    def parameter_servers(self, args: argparse.Namespace) -> int:
        """How many parameter servers a run on Ray starts beside its workers (its own flags say;
        0: none, its workers are a Ray trainer's)."""
        return 0

    def manifest(self, config: C, run: Run) -> dict:
        """Further fields for the manifest."""
        return {}

    # ---- the framework's part
    def world(self, launcher: str, use_gpu: flags.UseGpu) -> W:
        raise NotImplementedError

    def fit(self, run: Run, config: C, world: W | None = None) -> None:
        raise NotImplementedError

    def export(self, folder: Path, config: C, inputs: np.ndarray, output: Path) -> Exported:
        """Load the checkpoint in `folder` and export it (staged in `output`)."""
        raise NotImplementedError

    # ---- shared by the frameworks' loops
    def store(self, run: Run, config: C, world: World) -> Store:
        """Where this rank saves and restores: Ray Train's checkpoints, or the run's folder."""
        if run.launcher == "ray":  # Ray keeps run.keep_checkpoints (CheckpointConfig)
            return RayStore(self.name, run.name, self.signature(config), world.rank)
        return FolderStore(self.name, run.name, self.signature(config), world.rank,
                           run.storage_path, world.barrier, keep=run.keep_checkpoints)

    def resume(self, store: Store, run: Run, world: World, load: Callable[[Path], None]) -> int | None:
        """Restore the run's latest checkpoint with `load(folder)`: the epoch to go on from, or
        None when the run has trained all its epochs already."""
        start = 0
        with store.latest() as last:
            if last is not None:
                load(last.folder)
                start = last.epoch
                if world.rank == 0:
                    self.say(f"resuming after epoch {start} from {last.where}")
        if world.rank == 0 and run.attempts is not None:
            run.attempts.start.remote(start, world.size, time.time())
        elif world.rank == 0 and run.timeline is not None:
            run.timeline.mark_workers_started()
        if start < run.epochs:
            return start
        if world.rank == 0:
            self.say(f"run already trained {start} epoch(s); publishing its latest checkpoint "
                     "(raise --epochs to train on)")
        return None

    def report_first_step(self, run: Run, world: World) -> None:
        """The loops call this after each start's first training step: rank 0 tells Attempts on
        Ray, and marks the run's timeline itself under the other launchers (it publishes there)."""
        if world.rank != 0:
            return
        if run.attempts is not None:
            run.attempts.first_step.remote(time.time())
        elif run.timeline is not None:
            run.timeline.mark_first_step()

    def say(self, message: str) -> None:
        say(self.name, message)
