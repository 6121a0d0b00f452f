"""The flags every job shares, as argparse types: a bad value is one line (exit 2) before anything runs.

    --num-workers --batch-size --epochs --lr --use-gpu --launcher
    --storage-path --name --output --placement

A job adds its own flags (its data, its sizes) and its own defaults for batch size, epochs and
learning rate; everything else is the same in every job and is checked here once.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

LAUNCHERS = ("auto", "ray", "torchrun", "horovodrun", "tf_config", "local")
PLACEMENTS = ("PACK", "SPREAD", "STRICT_SPREAD")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def dlc_home() -> Path:
    """DLC_HOME (default ~/dlcluster): runs, models and built-in data of this user."""
    return Path(os.environ.get("DLC_HOME", "~/dlcluster")).expanduser()


def config_dir() -> Path:
    """$DLC_CONFIG, else ~/.config/dlcluster: the operator's clusters and their records, the one
    Python default (the Makefile has the shell's); the harness reads only the current record."""
    return Path(os.environ.get("DLC_CONFIG") or "~/.config/dlcluster").expanduser()


def default_storage() -> str:
    """Where runs and checkpoints go: DLC_STORAGE_PATH (set on a provisioned cluster's nodes to
    the shared storage), else $DLC_HOME/runs."""
    return os.environ.get("DLC_STORAGE_PATH") or str(dlc_home() / "runs")


def default_output(name: str) -> str:
    """Where a job's verified ONNX model and manifest land: $DLC_MODELS/<name>."""
    return str(Path(os.environ.get("DLC_MODELS") or dlc_home() / "models").expanduser() / name)


def default_name(job: str) -> str:
    """<job>-<date>-<time>-<4 hex>: unique even for two runs started in the same second."""
    return time.strftime(f"{job}-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where the help text says it (default None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one line for a bad flag (`prog: error: argument --x: why`), no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


# ------------------------------------------------------------------ argparse types
class UseGpu(StrEnum):
    """--use-gpu, parsed once: AUTO (GPUs where there are enough), YES (no GPU is an error, never a
    silent CPU run), NO. The values are the flag's words."""

    AUTO = "auto"
    YES = "true"
    NO = "false"

    @classmethod
    def of(cls, on_gpu: bool) -> UseGpu:
        """A choice already made (e.g. the worker plan's), as the tri-state the worlds take."""
        return cls.YES if on_gpu else cls.NO


class UseGpuAction(argparse.Action):
    """Stores --use-gpu as a UseGpu, after argparse checked it against the choices (so a bad
    value is argparse's own `invalid choice` line)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, UseGpu(values))


def _number(text: str, kind: type[int] | type[float], ok: Callable[[Any], bool], rule: str) -> Any:
    """`text` as `kind` (int or float) meeting `ok`, else argparse's error: what is wrong."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text} {rule}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda n: n >= 1, "must be at least 1")


def num_workers(text: str) -> int | tuple[int, int]:
    """A count; MIN-MAX (elastic: train on as many as the cluster has, at least MIN); or `auto`
    (0): one worker per GPU, else one per node."""
    if text == "auto":
        return 0
    low, dash, high = text.partition("-")
    try:
        if not dash:
            return positive_int(text)
        least, most = positive_int(low), positive_int(high)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (give a count, MIN-MAX or auto)") from None
    if least > most:
        raise argparse.ArgumentTypeError(f"{text}: the smaller count comes first, e.g. {most}-{least}")
    return least if least == most else (least, most)


def failures(text: str) -> int:
    """How many times a lost worker group is restarted; -1: without limit."""
    return _number(text, int, lambda n: n >= -1, "must be 0 or more, or -1 for no limit")


def learning_rate(text: str) -> float:
    return _number(text, float, lambda lr: math.isfinite(lr) and lr > 0,
                   "must be a finite number above 0, e.g. 1e-3")


def fraction(text: str) -> float:
    return _number(text, float, lambda f: 0 < f < 1, "must be between 0 and 1, e.g. 0.1")


def run_name(text: str) -> str:
    """A plain name: it becomes a folder under the storage path and the models folder."""
    if not NAME.fullmatch(text) or ".." in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a plain run name; use letters, digits, '.', '_' and '-' "
            "(no '/', no '..', at most 128 characters)")
    return text


def tracking(text: str) -> str:
    """--tracking: off, auto, or the server's http(s)://HOST:PORT."""
    if text in ("off", "auto"):
        return text
    u = urllib.parse.urlparse(text)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.username is not None or u.password is not None:  # never echoed: the line shows the host only
        raise argparse.ArgumentTypeError(
            f"'{u.scheme}://***@{u.hostname}{f':{port}' if port else ''}' holds credentials, which would "
            "land in the run's flags, log and manifest: give http(s)://HOST:PORT alone, and the "
            "credentials in the file DLC_TRACKING_AUTH names (one line user:password, mode 0600)")
    if u.scheme not in ("http", "https") or not u.hostname or not port:
        raise argparse.ArgumentTypeError(f"{text!r} is not off, auto or http://HOST:PORT (the MLflow "
                                         "server's address, e.g. http://127.0.0.1:5000)")
    return text


def location(text: str) -> str:
    """A path made absolute here (~ expanded), or a URI (s3://, gs://, ...) left as it is."""
    if URI.match(text):
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a folder")
    return str(Path(text).expanduser().resolve())


# ------------------------------------------------------------------ the shared flags
def _flag(**argparse_spec: object) -> Any:
    """A RunFlags field: its flag's argparse spec (type, default, choices, help) as the field's
    metadata; {job} and {worker_help} in the help are the job's."""
    return field(metadata={"flag": argparse_spec})


@dataclass(frozen=True)
class RunFlags:
    """The flags every job shares, parsed and checked: they build the parser (each field's metadata
    is its flag) and travel, typed, from the command line to the launchers, the run (`Run`) and its
    tracking. A job's own flags stay with it (`Job.prepare`). `name`, `storage_path` and `output`
    are "" until `resolved` fills in their defaults."""

    num_workers: int | tuple[int, int] = _flag(
        type=num_workers, default="auto",
        help="{worker_help} on Ray: a count, MIN-MAX (elastic: a run goes on with the nodes that are "
             "left, at least MIN), or auto: one per GPU, else one per node (under "
             "torchrun/horovodrun/TF_CONFIG the launcher decides)")
    batch_size: int = _flag(type=positive_int, help="batch size per worker")
    epochs: int = _flag(type=positive_int, help="epochs in all; a resumed run trains the missing ones")
    lr: float = _flag(type=learning_rate, help="learning rate")
    use_gpu: UseGpu = _flag(
        default=UseGpu.AUTO, choices=[u.value for u in UseGpu], action=UseGpuAction,
        help="train on GPUs (NCCL) or CPUs (gloo); auto: GPUs when there is one per worker")
    launcher: str = _flag(
        default="auto",
        help="who starts the workers; auto: found from the environment (a Ray job, torchrun's "
             "RANK/WORLD_SIZE, horovodrun's HOROVOD_RANK, TF_CONFIG), else one local process")
    storage_path: str = _flag(
        type=location, default=None,
        help="runs and checkpoints (a path or a URI such as s3://...); storage every node sees on a "
             "multi-node cluster (default: $DLC_STORAGE_PATH or ~/dlcluster/runs)")
    name: str = _flag(
        type=run_name, default=None,
        help="run name (default: {job}-<date>-<time>-<4 hex>); a rerun with the same name resumes "
             "from its latest checkpoint")
    output: str = _flag(
        type=location, default=None,
        help="folder for model.onnx and manifest.json (default: $DLC_MODELS/<name> or "
             "~/dlcluster/models/<name>)")
    max_failures: int = _flag(
        type=failures, default=3,
        help="on Ray: how often a lost worker or node restarts the workers from the latest checkpoint "
             "before the run fails; -1: without limit")
    keep_checkpoints: int = _flag(
        type=positive_int, default=3, help="checkpoints kept per run (the newest); older ones are deleted")
    placement: str = _flag(
        default="SPREAD", choices=PLACEMENTS,
        help="how Ray places the workers: SPREAD (over as many nodes as it can), PACK (on as few as it "
             "can), STRICT_SPREAD (one per node; workers <= nodes)")
    tracking: str = _flag(
        type=tracking, default="auto", metavar="URL|off|auto",
        help="the MLflow tracking server rank 0 logs the run to; auto: the cluster's (DLC_TRACKING_URL "
             "on its nodes, else the cluster record), else off")

    @classmethod
    def of(cls, args: argparse.Namespace) -> RunFlags:
        """The shared flags out of a parsed command line (a flag not given: "")."""
        values: dict[str, Any] = {f.name: getattr(args, f.name) for f in fields(cls)}
        for unset in [k for k, v in values.items() if v is None]:
            values[unset] = ""
        return cls(**values)

    def resolved(self, job: str, name: str | None = None) -> RunFlags:
        """The defaults that depend on the environment or on the run name filled in (`name`: one
        the ranks agreed on)."""
        name = name or self.name or default_name(job)
        return replace(self, name=name, storage_path=self.storage_path or location(default_storage()),
                       output=self.output or location(default_output(name)))

    def params(self) -> dict[str, str]:
        """Each flag as the run history records it (a param each)."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


def own_params(args: argparse.Namespace) -> dict[str, str]:
    """A job's own flags (those RunFlags does not hold) as the run history records them."""
    shared = {f.name for f in fields(RunFlags)}
    return {k: "" if v is None else str(v) for k, v in vars(args).items() if k not in shared}


# ------------------------------------------------------------------ the parser
def parser(job: str, description: str, *, batch_size: int, epochs: int, lr: float,
           launchers: tuple[str, ...], worker_help: str = "data-parallel workers (one process each)"
           ) -> argparse.ArgumentParser:
    """A job's parser with the shared flags (RunFlags' fields, the job's defaults for batch size,
    epochs and learning rate, its launchers); the job adds its own before parsing."""
    p = Parser(prog=job, description=description, formatter_class=HelpFormatter)
    job_defaults: dict[str, object] = {"batch_size": batch_size, "epochs": epochs, "lr": lr}
    for f in fields(RunFlags):
        spec = dict(f.metadata["flag"])
        spec["help"] = str(spec["help"]).format(job=job, worker_help=worker_help)
        if f.name in job_defaults:
            spec["default"] = job_defaults[f.name]
        if f.name == "launcher":
            spec["choices"] = ("auto", *launchers)
        p.add_argument("--" + f.name.replace("_", "-"), **spec)  # type: ignore[arg-type]
    return p
