"""The emulated cluster, provisioned like real servers, for the tests in this folder.

`tests/emulated/emulate.sh up` starts a bastion and three node containers behind it (systemd,
sshd, a private network the host cannot reach), then `scripts/cluster.sh up` (= make cluster-up
INVENTORY=ansible/inventories/emulated/hosts.yml) provisions them through the bastion with the
real playbooks. Everything runs with its own DLC_CONFIG, so a user's clusters and keys are not
touched; the session ends with cluster-down and emulate-down.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from trainkit import record

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "ansible/inventories/emulated/hosts.yml"
BIN = Path(sys.executable).parent
# The tier's own tunnel port: `make demo`'s local cluster keeps the README's 127.0.0.1:8265, so the
# quick start's two commands (make demo, then make test) run in that order, the demo still up.
PORT = 8275
METRICS_PORT = 9275  # Prometheus' local end of the tunnel (make cluster-up's METRICS_PORT)
# Grafana's (GRAFANA_PORT): the emulated head has none (its package source is unreachable)
GRAFANA_PORT = 10275  # PORT + 2000, as a second operator's (test_emulated.operator)
TRACKING_PORT = 11275  # the run history's local end (make cluster-up's TRACKING_PORT), PORT + 3000
DEMO_PORT = 8265
NODES = {"node-1": "172.31.251.11", "node-2": "172.31.251.12", "node-3": "172.31.251.13"}
# the bastion container's address on the private network, as the emulated inventory names it
BASTION_PRIVATE = (yaml.safe_load(INVENTORY.read_text())["all"]["children"]["bastions"]["hosts"]
                   ["bastion"]["ip"])


def run(cmd: list[str], env: dict, timeout: int = 900, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, \
            f"{cmd}: rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP of an ansible-playbook run: host -> {ok, changed, unreachable, failed, ...}."""
    hosts = {}
    for m in re.finditer(r"^(\S+)\s+: ((?:\w+=\d+\s*)+)$", output, re.M):
        hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


@dataclass
class Emulated:
    env: dict
    config: Path
    up: subprocess.CompletedProcess
    demo: Demo

    @property
    def cluster_dir(self) -> Path:
        return self.config / "clusters" / "emulated"

    @property
    def ssh_config(self) -> Path:
        return self.cluster_dir / "ssh_config"

    def ssh(self, host: str, *cmd: str, timeout: int = 60) -> subprocess.CompletedProcess:
        return run(["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", host, *cmd],
                   self.env, timeout=timeout)

    def cluster(self, action: str, inventory: Path | None = None, timeout: int = 900):
        env = {**self.env, "INVENTORY": str(inventory or INVENTORY)}
        return run(["scripts/cluster.sh", action], env, timeout=timeout)

    def client_env(self) -> dict:
        """The environment a client gets from the cluster record (as `make submit` does)."""
        return {**self.env, **record.load(self.config / record.RECORD).client_env()}

    def token(self) -> str:
        return (self.cluster_dir / "ray_token").read_text().strip()

    def api(self, path: str, token: str | None = None) -> tuple[int, object]:
        req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, None
        except (urllib.error.URLError, ConnectionError, TimeoutError):  # the head is restarting
            return 0, None

    def alive_nodes(self) -> list[str]:
        status, body = self.api("/api/v0/nodes?limit=100&detail=false", self.token())
        if status != 200:
            return []
        return sorted(n["node_ip"] for n in body["data"]["result"]["result"] if n["state"] == "ALIVE")

    def wait_for_nodes(self, n: int, timeout: float = 180) -> list[str]:
        deadline = time.time() + timeout
        while True:
            alive = self.alive_nodes()
            if len(alive) == n or time.time() > deadline:
                return alive
            time.sleep(3)


@dataclass
class Demo:
    """The local cluster `make demo` leaves running on the default ports: the user's own when one is
    there (env None), else one this tier starts as make demo would."""
    env: dict | None

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{DEMO_PORT}/api/version", timeout=10):
                return True
        except urllib.error.HTTPError:  # 401: token auth, as it should be
            return True
        except (urllib.error.URLError, OSError):
            return False

    def jobs_status(self) -> int:
        """The job API's answer to this tier's own demo cluster's token (its record): 200 when it runs."""
        assert self.env is not None
        desc = record.load(Path(self.env["DLC_CONFIG"]) / record.RECORD)
        req = urllib.request.Request(f"{desc.job_api}/api/jobs/")
        req.add_header("Authorization", f"Bearer {Path(desc.token_path).read_text().strip()}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def down(self) -> None:
        if self.env is not None:
            run(["scripts/cluster.sh", "down"], self.env, timeout=300)
            self.env = None


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    with socket.socket() as s:
        busy = s.connect_ex(("127.0.0.1", DEMO_PORT)) == 0
    if busy:
        print(f"a cluster already answers on 127.0.0.1:{DEMO_PORT} (make demo's?): the tier runs beside it")
        yield Demo(None)
        return
    config = tmp_path_factory.mktemp("demo-config")
    env = {**os.environ, "DLC_CONFIG": str(config), "RAY_PORT": "6379", "DASHBOARD_PORT": str(DEMO_PORT),
           "NODES": "2", "CPUS_PER_NODE": "0"}
    for name in ("RAY_ADDRESS", "INVENTORY"):
        env.pop(name, None)
    run(["scripts/cluster.sh", "up"], env, timeout=300, check=True)
    d = Demo(env)
    yield d
    d.down()


@pytest.fixture(scope="session")
def emulated(tmp_path_factory, demo):
    config = tmp_path_factory.mktemp("dlc-config")
    env = {**os.environ, "DLC_CONFIG": str(config), "DASHBOARD_PORT": str(PORT),
           "METRICS_PORT": str(METRICS_PORT), "GRAFANA_PORT": str(GRAFANA_PORT),
           "TRACKING_PORT": str(TRACKING_PORT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("INVENTORY", None)
    run(["tests/emulated/emulate.sh", "down"], env)  # a fresh start: new machines, new host keys
    run(["tests/emulated/emulate.sh", "up"], env, timeout=600, check=True)
    started = time.time()
    up = run(["scripts/cluster.sh", "up"], {**env, "INVENTORY": str(INVENTORY)}, timeout=1200)
    print(f"cluster-up through the bastion: {time.time() - started:.0f} s")
    print(up.stdout[-3000:], up.stderr[-2000:])
    yield Emulated(env, config, up, demo)
    if (config / "cluster.json").exists():  # the last test's cluster-down did not run, or failed
        run(["scripts/cluster.sh", "down"], {**env, "INVENTORY": str(INVENTORY)}, timeout=300)
    run(["tests/emulated/emulate.sh", "down"], env, timeout=300)
