"""dlcluster: the operator's one command, run on the control host (a laptop), never on a node.

Installed by `make setup` (`.venv/bin/dlcluster`, pyproject's [project.scripts]). Each subcommand is
a Make target's and a Python function with its own flags (`dlcluster COMMAND --help`), whose
defaults are the Makefile's variables of the same names; the harness the jobs import on the nodes
is the other package, trainkit/, and it never imports this one.

    dlcluster --help
    dlcluster up                       # INVENTORY set: provision through the bastion; else a local cluster
    dlcluster submit ddp_autoencoder --epochs 2
    dlcluster doctor --quarantine
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dlcluster import lifecycle
from trainkit.errors import EXIT_USER_ERROR, find_user_error


@dataclass(frozen=True)
class Command:
    changes: str  # one line: what the command changes (or that it changes nothing)
    target: str  # the Make target that calls it
    run: Callable[[list[str]], int | None]  # the command: its flags in, its exit status out
    prog: str = ""  # the name its one-line errors go by (default: the command's)


def _cluster(action: str, changes: str, target: str | None = None) -> Command:
    def run(argv: list[str]) -> int:
        return lifecycle.run(action, argv, changes)
    return Command(changes, target or action, run, lifecycle.ACTIONS[action])


def _record(what: str, changes: str) -> Command:
    def run(argv: list[str]) -> None:
        from dlcluster import record
        p = argparse.ArgumentParser(prog=f"dlcluster {what}", description=changes)
        p.add_argument("--record", type=Path, default=None, metavar="FILE",
                       help="the cluster record (default: $DLC_CONFIG/cluster.json, the current cluster's)")
        a = p.parse_args(argv)
        record.main([what, *([str(a.record)] if a.record else [])])
    return Command(changes, what, run)


def _module(module: str, *first: str) -> Callable[[list[str]], int | None]:
    """The main(argv) of one of this package's modules, with `first` before the flags given."""
    def run(argv: list[str]) -> int | None:
        import importlib
        main: Callable[[list[str]], int | None] = importlib.import_module(module).main
        return main([*first, *argv])
    return run


def _unquarantine(argv: list[str]) -> None:
    from dlcluster import doctor
    p = argparse.ArgumentParser(prog="dlcluster unquarantine", description=COMMANDS["unquarantine"].changes)
    p.add_argument("node", metavar="NODE", nargs="?", default=os.environ.get("NODE", ""),
                   help="the quarantined node, as the cluster record names it (default: $NODE)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the cluster record (default: $DLC_CONFIG/cluster.json, the current cluster's)")
    a = p.parse_args(argv)
    if not a.node:
        p.exit(2, "unquarantine: error: name the node: make unquarantine NODE=<name in the cluster record>\n")
    doctor.main(["--unquarantine", a.node, *(["--config", a.config] if a.config else [])])


def _submit(argv: list[str]) -> int:
    from dlcluster import submit
    return submit.submit_main(argv)


def _resume(argv: list[str]) -> int:
    from dlcluster import submit
    return submit.resume_main(argv)


def _team(name: str) -> Callable[[list[str]], int | None]:
    def run(argv: list[str]) -> None:
        from dlcluster import team
        getattr(team, f"{name}_main")(argv)
    return run


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
    "token": _record("token", "changes nothing: prints the current cluster's Ray token to the terminal"),
    "grafana-password": _record("grafana-password", "changes nothing: prints the current cluster's Grafana "
                                "admin password to the terminal"),
    "tracking-password": _record("tracking-password", "changes nothing: prints the run history's URL, user "
                                 "and password to the terminal"),
    "runs": Command("changes nothing: the last runs from the cluster's run history (--run NAME: its "
                    "metrics per epoch)", "runs", _module("dlcluster.runs")),
    "submit": Command("starts a job: `ray job submit` of jobs/JOB.py and its flags to the current cluster, "
                      "uploading what git tracks and UPLOAD; the submission is kept for resume", "submit",
                      _submit),
    "resume": Command("starts a job: run RUN submitted again as it first was (same job, flags, --name), "
                      "going on from its last checkpoint", "resume", _resume),
    "user": Command("admins: `user add NAME --team T` makes a person's credential (printed once), "
                    "`user list`, `user revoke NAME` (refused at once)", "users", _team("user")),
    "jobs": Command("changes nothing: every job the gateway keeps (those from before a head restart too), "
                    "with its owner, team, state and run", "jobs", _team("jobs")),
    "logs": Command("changes nothing: job ID's driver log as the gateway kept it (also after a head restart)",
                    "logs", _team("logs")),
    "audit": Command("changes nothing: the audit trail (who submitted, stopped, deleted, was refused, added "
                     "or revoked whom), and whether its chain holds", "audit", _team("audit")),
    "smoke": Command("runs short jobs, changes no setting: the nodes, all-reduce bandwidth, perf against "
                     "the baseline, the trainers, the way in", "smoke", _module("dlcluster.smoke.run")),
    "baseline": Command("writes the cluster's performance baseline (no job may run): per node step time "
                        "and storage, per link iperf3, all-reduce busbw", "baseline",
                        _module("dlcluster.smoke.run", "--record-baseline"), "smoke"),
    "doctor": Command("changes nothing, unless --quarantine: then each worker with a finding is taken out "
                      "of Ray (a quarantine file, its Ray stopped)", "doctor", _module("dlcluster.doctor")),
    "unquarantine": Command("puts the quarantined node NODE back into Ray (its quarantine file removed, "
                            "Ray started)", "unquarantine", _unquarantine, "doctor"),
    "bench": Command("runs jobs on the current cluster, changes no setting: Ray Train against each job's "
                     "own launcher; writes bench.json and plots under --out", "bench",
                     _module("dlcluster.bench.bench")),
    "bench-ae": Command("runs jobs on the current cluster, changes no setting: the autoencoder at workers "
                        "1, 2 x batch 64, 128", "bench-ae", _module("dlcluster.bench.bench_autoencoder"),
                        "bench"),
    "bench-gateway": Command("starts a Ray head and a gateway of its own on this machine, then stops them: "
                             "what the gateway adds to each job API call and to a followed log, side by "
                             "side; bench-gateway.json and .png under --out", "bench-gateway",
                             _module("dlcluster.bench.gateway"), "bench"),
    "bench-queue": Command("changes nothing: the queue's policy replayed over a synthetic month of a 4-team, "
                           "8-GPU cluster in its simulator, fair share beside FIFO; fairshare.json and .png "
                           "under --out", "bench-queue", _module("gateway.simulate"), "bench"),
    "image-report": Command("changes nothing: the image's size per layer group and its build times",
                            "image-report", _module("dlcluster.image_report")),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlcluster", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The operator's command for a Ray cluster of GPU servers behind an SSH bastion "
                    "(each command is a Make target's: `make help`). Each command's flags default to the "
                    "Makefile's variables of the same names (INVENTORY, DLC_CONFIG, NODE, ...).",
        epilog="`dlcluster COMMAND --help`: what it changes, then its flags.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, c in COMMANDS.items():
        sub.add_parser(name, help=c.changes, add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser().parse_args(argv)  # the help, or one line naming the unknown command and the known ones
    command, rest = argv[0], argv[1:]  # the rest is the command's own flags
    c = COMMANDS[command]
    prog = c.prog or command
    if rest[:1] in (["-h"], ["--help"]):
        print(f"dlcluster {command} (make {c.target}): {c.changes}\n", flush=True)
    try:
        code = c.run(rest)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a UserError: one line (also one raised on a Ray worker, which Ray wraps)
        cause = find_user_error(e)
        if cause is None:
            raise
        print(f"{prog}: error: {cause}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    sys.exit(code or 0)
