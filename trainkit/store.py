"""Checkpoints: save on rank 0 and report every epoch, restore the latest at start.

One interface, two places: under Ray Train the checkpoints are Ray's (`ray.train.report`,
`ray.train.get_checkpoint`, kept under `<storage>/<name>/` by Ray); under torchrun, horovodrun,
TF_CONFIG or one local process they are folders `<storage>/<name>/checkpoint_<epoch>/` that rank
0 writes whole and renames into place. Either way each checkpoint holds the framework's files
plus `meta.json`: the job, the epoch, its metrics and the run's *signature* (the model and data
shapes it was trained with). A rerun whose signature differs is a one-line error, not a
state_dict traceback, and its checkpoints are not touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

META = "meta.json"
LOCK = ".run.lock"  # in the run's folder: held by the process that trains and publishes it
PLAIN = re.compile(r"checkpoint_(\d{6})")


@dataclass(frozen=True)
class Restored:
    """The latest checkpoint, opened as a local folder (valid inside `Store.latest()`)."""

    folder: Path
    where: str  # where it lives (a path or a URI), for messages and the manifest
    meta: dict

    @property
    def epoch(self) -> int:
        return int(self.meta["epoch"])


def read_meta(folder: Path) -> dict:
    return json.loads((folder / META).read_text())


def check_signature(meta: dict, job: str, signature: dict, name: str) -> None:
    """A checkpoint of another job, model or data shape cannot be resumed: say so in one line."""
    if meta.get("job") != job:
        raise UserError(f"run {name} holds checkpoints of {meta.get('job')!r}, not {job}; use "
                        "another --name")
    theirs = meta.get("signature") or {}
    changed = {k: (theirs.get(k), v) for k, v in signature.items() if theirs.get(k) != v}
    if changed:
        what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        raise UserError(f"run {name} was trained with other shapes than asked ({what}); resume "
                        "it with its own flags, or use another --name for a new run")


def precheck(storage_path: str, job: str, name: str, signature: dict) -> None:
    """On the driver, before any worker starts: the run's newest checkpoint (Ray's folders are
    named by time) must fit this run's signature. Ray would otherwise retry the mismatch
    --max-failures times. Workers check again when they restore (also for URIs, skipped here)."""
    if "://" in storage_path:
        return
    found = sorted(p for p in (Path(storage_path) / name).glob("checkpoint_*") if (p / META).is_file())
    if found:
        check_signature(read_meta(found[-1]), job, signature, name)


@contextlib.contextmanager
def hold_run(storage_path: str, name: str) -> Iterator[None]:
    """The run's folder held by this process while it trains and publishes: a second run with the
    same --name at the same time is one line before it touches the folder, so the first run's
    checkpoints and model stay its own, wherever the two run. A POSIX record lock (fcntl), not an
    flock: an NFS client sends its locks to the server, where they are POSIX locks, which a local
    flock on the server (the head, whose storage is the export itself) never sees, so a driver on
    the head and a rank on a worker could both hold "the" lock. The kernel (and the NFS server for a
    client) drops it when the process ends, however it ends, so a resumed run is never refused by
    a dead one. URIs (s3://...) are not held."""
    if "://" in storage_path:
        yield
        return
    run_dir = Path(storage_path) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+") as f:
        try:
            # the whole file; held while this process keeps any descriptor of it open (this one)
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN, or EACCES on some systems
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise UserError(f"run {name} is running already ({holder}): wait for it to end, or "
                            "give this one another --name") from None
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()} pid {os.getpid()} since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
        f.flush()
        try:
            yield
        finally:  # emptied again: a run that stopped on bad input leaves the folder as it was
            f.seek(0)
            f.truncate()


class Store:
    """Where one rank saves and restores; every rank calls `save` each epoch (rank 0 writes)."""

    def __init__(self, job: str, name: str, signature: dict, rank: int):
        self.job, self.name, self.signature, self.rank = job, name, signature, rank

    def meta(self, epoch: int, metrics: dict, replicas: dict | None) -> dict:
        return {"job": self.job, "epoch": epoch, "metrics": metrics, "signature": self.signature,
                "replicas": replicas or {}}

    @contextlib.contextmanager
    def latest(self) -> Iterator[Restored | None]:
        with self._latest() as found:
            if found is not None:
                check_signature(found.meta, self.job, self.signature, self.name)
            yield found

    def _latest(self):
        raise NotImplementedError

    def save(self, epoch: int, metrics: dict, write: Callable[[Path], None],
             replicas: dict | None = None, every_rank: bool = False) -> None:
        """Every rank calls this after each epoch; rank 0 calls `write(folder)` for the framework's
        files, or with `every_rank` each rank for its part (a sharded checkpoint: one folder in
        the end). `replicas`: the ranks' parameter digests, kept for the manifest."""
        raise NotImplementedError


class RayStore(Store):
    """Ray Train's checkpoints: rank 0 hands a folder to `ray.train.report`, every rank reports."""

    @contextlib.contextmanager
    def _latest(self):
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as d:
            yield Restored(Path(d), checkpoint.path, read_meta(Path(d)))

    def save(self, epoch: int, metrics: dict, write: Callable[[Path], None],
             replicas: dict | None = None, every_rank: bool = False) -> None:
        import ray.train

        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if self.rank == 0 or every_rank:  # Ray merges the ranks' folders into one checkpoint
                write(Path(d))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            if self.rank == 0:
                (Path(d) / META).write_text(json.dumps(self.meta(epoch, metrics, replicas), indent=1))
            ray.train.report(metrics, checkpoint=checkpoint)


class FolderStore(Store):
    """`<storage>/<name>/checkpoint_<epoch>/`, written to a hidden folder and renamed into place,
    so a crash mid-save leaves the previous checkpoint as the latest; only the newest `keep` stay."""

    def __init__(self, job: str, name: str, signature: dict, rank: int, storage_path: str,
                 barrier: Callable[[], None], keep: int | None = None):
        super().__init__(job, name, signature, rank)
        self.keep = keep
        if "://" in storage_path:
            raise UserError(f"--storage-path {storage_path} is a URI, which only the Ray launcher "
                            "writes to; give a folder every rank sees, or run on Ray")
        self.run_dir = Path(storage_path) / name
        self.barrier = barrier

    def checkpoints(self) -> list[Path]:
        if not self.run_dir.is_dir():
            return []
        return sorted(p for p in self.run_dir.iterdir()
                      if PLAIN.fullmatch(p.name) and (p / META).is_file())

    @contextlib.contextmanager
    def _latest(self):
        found = self.checkpoints()
        yield Restored(found[-1], str(found[-1]), read_meta(found[-1])) if found else None

    def save(self, epoch: int, metrics: dict, write: Callable[[Path], None],
             replicas: dict | None = None, every_rank: bool = False) -> None:
        final = self.run_dir / f"checkpoint_{epoch:06d}"
        if every_rank:  # one staging folder every rank knows, made empty by rank 0 first
            tmp = self.run_dir / f".{final.name}.partial"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.barrier()
            write(tmp)
            self.barrier()  # every part is written before rank 0 puts the folder in place
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not every_rank:
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=self.run_dir))
            try:
                if not every_rank:
                    write(tmp)
                (tmp / META).write_text(json.dumps(self.meta(epoch, metrics, replicas), indent=1))
                if final.exists():  # the same epoch saved again by a run that failed after it
                    shutil.rmtree(final)
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            for old in self.checkpoints()[: -self.keep] if self.keep else []:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()  # no rank starts the next epoch before the checkpoint is in place
