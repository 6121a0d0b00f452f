"""The cluster's lifecycle: `dlcluster up | status | down | attach | rotate-token | remove-node | upgrade`
(make cluster-up, cluster-status, cluster-down, attach, rotate-token, remove-node, upgrade).

No inventory: the embedded local cluster on this machine (dlcluster/local_cluster.py). An inventory:
real (or emulated) servers through their bastion, the playbook ansible/cluster-<action>.yml. Ansible's
output goes to the terminal and to $DLC_CONFIG/clusters/<inventory folder>/<action>.log; a failure ends
with one line naming the host and the problem (dlcluster/ansible_failure.py).

One run that changes a cluster at a time: a second is one line naming the holder of the cluster's
lock, which this process holds until it ends (Python opens it not inheritable, so nothing it starts,
Ray's daemons or the tunnel, keeps it).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, NoReturn

from dlcluster import ansible_failure, services
from trainkit.errors import UserError
from trainkit.flags import config_dir

ROOT = Path(__file__).resolve().parents[1]  # the checkout: its ansible/ playbooks and .venv-ansible
# each action and the name its lines go by (the Make target's)
ACTIONS = {"up": "cluster-up", "status": "cluster-status", "down": "cluster-down", "attach": "attach",
           "rotate-token": "rotate-token", "remove-node": "remove-node", "upgrade": "upgrade"}
SERVERS_ONLY = ("attach", "rotate-token", "remove-node", "upgrade")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
CONFIG_WORD = re.compile(r"[A-Za-z0-9._~/@:+%=,-]+")
_held: list[IO[str]] = []  # the cluster's lock, held until this process ends


def die(what: str, problem: str) -> NoReturn:
    print(f"{what}: error: {problem}", file=sys.stderr)
    raise SystemExit(2)


def parser(action: str, changes: str) -> argparse.ArgumentParser:
    """The action's flags; their defaults are the Make variables of the same names (make exports them)."""
    p = argparse.ArgumentParser(prog=f"dlcluster {action}", description=changes)
    p.add_argument("--inventory", default=os.environ.get("INVENTORY", ""), metavar="PATH",
                   help="the servers' inventory, ansible/inventories/<name>/hosts.yml (default: $INVENTORY; "
                        "empty: the local cluster on this machine)")
    p.add_argument("--config", type=Path, default=None, metavar="DIR",
                   help="where the clusters' records, tokens and logs live (default: $DLC_CONFIG, else "
                        "~/.config/dlcluster)")
    p.add_argument("--ansible-args", default=os.environ.get("ANSIBLE_ARGS", ""), metavar="ARGS",
                   help="extra flags for ansible-playbook, e.g. '--limit node-2 -v' (default: $ANSIBLE_ARGS)")
    if action == "remove-node":
        p.add_argument("node", nargs="?", default=os.environ.get("NODE", ""),
                       help="the worker to take out, as the inventory names it (default: $NODE)")
    return p


def lock(config: Path, cluster: str, action: str) -> None:
    """The cluster's lock for this process's life, or one line naming who holds it."""
    folder = config / "clusters" / cluster
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    f = open(folder / "lock", "a")  # noqa: SIM115 (held until the process ends)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (folder / "lock").read_text().strip()
        die(ACTIONS[action], f"another run (cluster-up, cluster-down, rotate-token, attach) of cluster "
                             f"{cluster} is running ({holder}); wait for it to end, or stop that process")
    f.truncate(0)
    f.write(f"pid {os.getpid()}: cluster-{action} since {time.strftime('%F %T')}\n")
    f.flush()
    _held.append(f)


def cluster_name(inventory: Path) -> str:
    """The cluster's name: its inventory's folder (as roles/cluster_defaults works it out)."""
    return inventory.name if inventory.is_dir() else inventory.parent.name


def run(action: str, argv: list[str] | None = None, changes: str = "") -> int:
    a = parser(action, changes).parse_args(argv)
    what = ACTIONS[action]
    config = a.config or config_dir()
    os.environ["DLC_CONFIG"] = str(config)  # for what runs below: the local cluster, Ansible's roles
    if not a.inventory:
        if action in SERVERS_ONLY:
            die(what, f"{action} is for servers: set INVENTORY=ansible/inventories/<name>/hosts.yml "
                      f"(the local "
                      "cluster has its token here already)")
        if action != "status":
            lock(config, "local", action)
        from dlcluster import local_cluster
        local_cluster.main([action])
        return 0
    return servers(action, a, config)


def servers(action: str, a: argparse.Namespace, config: Path) -> int:
    what = ACTIONS[action]
    if not os.path.exists(a.inventory):
        die(what, f"no inventory {a.inventory}: copy ansible/inventories/example to "
                  f"ansible/inventories/<name> "
                  "and edit it")
    inventory = Path(a.inventory).resolve()
    playbook_bin = ROOT / ".venv-ansible/bin/ansible-playbook"
    if not os.access(playbook_bin, os.X_OK):
        die(what, "no .venv-ansible: run make setup")
    try:  # the tunnel's local ends, one per service of roles/cluster_defaults's dlc_services
        ends = services.tunnel_ends()
        tunnel = [arg for variable, port in ends.items() for arg in ("-e", f"{variable}={port}")]
    except UserError as e:
        die(what, str(e))
    name = cluster_name(inventory)
    if not NAME.fullmatch(name):
        die(what, f"the cluster's name is its inventory's folder, '{name}': rename the folder to "
                  f"letters, digits, "
                  ". _ - (it names the cluster's files and goes into the ssh config)")
    if not CONFIG_WORD.fullmatch(str(config)):
        die(what, f"DLC_CONFIG is '{config}': it goes into the ssh config and commands as one word, so "
                  f"it may "
                  "hold no spaces or quotes: choose another folder")
    folder = config / "clusters" / name
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    log = folder / f"{action}.log"
    if action != "status":
        lock(config, name, action)

    removal: list[str] = []
    if action == "remove-node":  # the worker NODE names (dlc_remove_node)
        if not NODE.fullmatch(a.node or ""):
            die(what, f"NODE='{a.node or ''}': name the worker to take out, as the inventory does: make "
                      f"remove-node NODE=node-2 INVENTORY={a.inventory}")
        removal = ["-e", f"dlc_remove_node={a.node}"]

    # Ansible's own connection sockets, per cluster and config folder: an old connection can never stand
    # in for the generated ssh config (ControlPersist hides a broken config otherwise). In ~/.ssh under a
    # short hash, like the tunnel's socket: a unix socket's path must stay under 108 bytes.
    ssh = Path.home() / ".ssh"
    control = ssh / f"dlc-cp-{hashlib.sha1(str(folder).encode()).hexdigest()[:12]}"
    control.mkdir(parents=True, exist_ok=True)
    ssh.chmod(0o700)
    control.chmod(0o700)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible/ansible.cfg"),
           "ANSIBLE_SSH_CONTROL_PATH_DIR": str(control),
           "DLC_PROGRESS_DIR": str(folder / "progress"),  # image shipping's progress (callback_plugins)
           "ANSIBLE_FORCE_COLOR": os.environ.get("ANSIBLE_FORCE_COLOR", "0"), "PYTHONUNBUFFERED": "1"}
    token = folder / "ray_token"
    token_before = token.read_bytes() if token.is_file() else None  # remove-node: re-keyed?
    cmd = [str(playbook_bin), "-i", str(inventory), *tunnel, *removal, *shlex.split(a.ansible_args),
           f"cluster-{action}.yml"]
    with open(log, "wb") as out:  # to the terminal and the log, as it comes
        proc = subprocess.Popen(cmd, cwd=ROOT / "ansible", env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            out.write(chunk)
        rc = proc.wait()
    if rc != 0:
        print(ansible_failure.summary(log, what), file=sys.stderr)
        return rc

    if action == "upgrade":
        print(f"upgrade: cluster {name} runs what {a.inventory} and this checkout say, every node "
              f"checked after "
              f"its restart (the log: {log})")
    if action == "remove-node":
        if (token.read_bytes() if token.is_file() else None) != token_before:
            keys = ("the cluster re-keyed (a new token, run-history credentials and CA; Ray restarted "
                    "on every "
                    "node): its token and certificate, or copies of them, are refused")
        else:
            keys = ("its secrets are gone from it, and make rotate-token (a new token and CA, Ray "
                    "restarted, no "
                    "job running) refuses copies of them (dlc_remove_node_rekey: false kept the others "
                    "running)")
        print(f"remove-node: {a.node} is out of cluster {name}: drained, its Ray stopped and disabled, "
              f"left out "
              f"of every node list and the cluster record; {keys}; now delete it from {a.inventory} (a "
              "cluster-up that still lists it provisions it again and it rejoins)")

    # The first cluster-up of new servers records their performance baseline (make baseline) while they
    # are idle; a failure there leaves the cluster up, and the note for the next run.
    due = folder / "baseline-due"
    if action == "up" and due.exists():
        print("cluster-up: new servers: recording their performance baseline (make baseline, about a minute)",
              flush=True)
        from dlcluster.smoke import run as smoke
        try:
            recorded = smoke.main(["--record-baseline"]) == 0
        except SystemExit as e:  # its refusals
            recorded = e.code in (0, None)
        if recorded:
            due.unlink(missing_ok=True)
        else:
            print("cluster-up: warning: the cluster is up, but no performance baseline was recorded (above): "
                  "make baseline once that is fixed", file=sys.stderr)
    return 0
