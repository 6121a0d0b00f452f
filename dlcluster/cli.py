"""dlcluster: the operator's one command, run on the control host (a laptop), never on a node.

Each subcommand is a Make target's (the Makefile calls `python -m dlcluster <command>` and names
the variables it reads); `dlcluster <command> --help` says what the command changes, then the
flags of the program behind it. The harness the jobs import on the nodes is the other package,
trainkit/, and it never imports this one.

    dlcluster --help
    dlcluster up                       # INVENTORY set: provision through the bastion; else a local cluster
    dlcluster submit ddp_autoencoder --epochs 2
    dlcluster doctor --quarantine
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this package lives in


@dataclass(frozen=True)
class Command:
    changes: str  # one line: what the command changes (or that it changes nothing)
    target: str  # the Make target that calls it
    run: tuple[str, ...]  # ("module", name, *args): run here; ("script", path, *args): exec'd
    flags: bool = False  # the program behind it has flags of its own (and its own --help)


def _cluster(action: str, changes: str, target: str | None = None) -> Command:
    return Command(changes, target or action, ("script", "scripts/cluster.sh", action))


COMMANDS: dict[str, Command] = {
    "up": _cluster("up", "INVENTORY set: provisions its servers through the bastion (driver, container "
                   "runtime, image, Ray), starts Ray and opens the tunnel; else starts a local cluster "
                   "on this machine", "cluster-up"),
    "status": _cluster("status", "changes nothing: each node's Ray service and the nodes and resources "
                       "the head sees", "cluster-status"),
    "down": _cluster("down", "stops Ray (workers, then head) and closes the tunnel; data, images and "
                     "packages stay", "cluster-down"),
    "attach": _cluster("attach", "INVENTORY set: this machine's record, token and tunnel for a running "
                       "cluster; changes no server"),
    "rotate-token": _cluster("rotate-token", "INVENTORY set: a new Ray token (and the run history's jobs' "
                             "password) on every node and here; Ray restarted with it (no job running)"),
    "remove-node": _cluster("remove-node", "INVENTORY and NODE set: worker NODE drained, its Ray stopped "
                            "and disabled, taken out of every list and the record"),
    "upgrade": _cluster("upgrade", "INVENTORY set: a new image, environment or setting rolled onto the "
                        "running cluster, one worker at a time (drained, restarted, checked, rolled back "
                        "on failure), the head last"),
    "token": Command("changes nothing: prints the current cluster's Ray token to the terminal", "token",
                     ("module", "dlcluster.record", "token")),
    "grafana-password": Command("changes nothing: prints the current cluster's Grafana admin password to "
                                "the terminal", "grafana-password",
                                ("module", "dlcluster.record", "grafana-password")),
    "tracking-password": Command("changes nothing: prints the run history's URL, user and password to the "
                                 "terminal", "tracking-password",
                                 ("module", "dlcluster.record", "tracking-password")),
    "runs": Command("changes nothing: the last runs from the cluster's run history (--run NAME: its "
                    "metrics per epoch)", "runs", ("module", "dlcluster.runs"), flags=True),
    "submit": Command("starts a job: `ray job submit` of jobs/JOB.py and its flags to the current "
                      "cluster, uploading what git tracks and UPLOAD; the submission is kept for resume",
                      "submit", ("script", "ray/submit.sh")),
    "resume": Command("starts a job: run RUN submitted again as it first was (same job, flags, --name), "
                      "going on from its last checkpoint", "resume", ("script", "ray/submit.sh", "--resume")),
    "smoke": Command("runs short jobs, changes no setting: the nodes, all-reduce bandwidth, perf against "
                     "the baseline, the trainers, the way in", "smoke", ("module", "dlcluster.smoke.run"),
                     flags=True),
    "baseline": Command("writes the cluster's performance baseline (no job may run): per node step time "
                        "and storage, per link iperf3, all-reduce busbw", "baseline",
                        ("module", "dlcluster.smoke.run", "--record-baseline"), flags=True),
    "doctor": Command("changes nothing, unless --quarantine: then each worker with a finding is taken out "
                      "of Ray (a quarantine file, its Ray stopped)", "doctor", ("module", "dlcluster.doctor"),
                      flags=True),
    "unquarantine": Command("puts the quarantined node NODE back into Ray (its quarantine file removed, "
                            "Ray started)", "unquarantine", ("module", "dlcluster.doctor", "--unquarantine")),
    "bench": Command("runs jobs on the current cluster, changes no setting: Ray Train against each job's "
                     "own launcher; writes bench.json and plots under --out", "bench",
                     ("module", "dlcluster.bench.bench"), flags=True),
    "bench-ae": Command("runs jobs on the current cluster, changes no setting: the autoencoder at workers "
                        "1, 2 x batch 64, 128", "bench-ae", ("module", "dlcluster.bench.bench_autoencoder"),
                        flags=True),
    "image-report": Command("changes nothing: the image's size per layer group and its build times",
                            "image-report", ("module", "dlcluster.image_report")),
}


def checkout(start: Path) -> Path | None:
    """The checkout `start` is in (a folder with versions.env and ansible/), or None."""
    for folder in (start, *start.parents):
        if (folder / "versions.env").is_file() and (folder / "ansible").is_dir():
            return folder
    return None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlcluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The operator's command for a Ray cluster of GPU servers behind an SSH bastion "
                    "(each command is a Make target's: `make help`). The variables it reads (INVENTORY, "
                    "DLC_CONFIG, NODE, ...) are the Makefile's, with their defaults there.",
        epilog="`dlcluster COMMAND --help`: what it changes, then its flags.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, c in COMMANDS.items():
        sub.add_parser(name, help=c.changes, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser().parse_args(argv)  # the help, or one line naming the unknown command and the known ones
    command, rest = argv[0], argv[1:]  # the rest goes to the program behind the command, untouched
    c = COMMANDS[command]
    here = checkout(Path.cwd())
    if here is not None and here != ROOT:  # another checkout's dlcluster (its folder on PYTHONPATH)
        sys.exit(f"dlcluster: this command is the checkout {ROOT}'s, run from the checkout {here}: run "
                 f"`.venv/bin/python -m dlcluster` from {here}'s root (or its make targets)")
    if rest[:1] in (["-h"], ["--help"]):
        print(f"dlcluster {command} (make {c.target}): {c.changes}")
        if not c.flags:  # what it reads are Make's variables (make help)
            return
        print()
    kind, what, args = c.run[0], c.run[1], [*c.run[2:], *rest]
    if kind == "script":  # from the checkout's root, as make runs it (its lines name it so)
        os.chdir(ROOT)
        os.execv(what, [what, *args])
    sys.argv = [f"dlcluster {command}", *args]
    runpy.run_module(what, run_name="__main__", alter_sys=True)
