"""A throwaway local Ray cluster (2 nodes, its own ports, token and temp dirs) for the job tests.

It is started with the same script as `make cluster-up`, and every job reaches it the way a user's
does: `ray job submit --working-dir <repo> -- python jobs/<job>.py ...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainkit import record

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@dataclass
class LocalCluster:
    config: Path
    dashboard_port: int
    gcs: str
    env: dict

    def script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "ray/local_cluster.py", *args], cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 or not check, f"local_cluster {args}: {proc.stdout}{proc.stderr}"
        return proc

    def client_env(self) -> dict:
        """The environment a client gets from the cluster record (as `make submit` does)."""
        return {**self.env, **record.load(self.config / record.RECORD).client_env()}

    def submit(self, job: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        """`ray job submit` as the README shows it; output is stdout + stderr together."""
        cmd = [str(BIN / "ray"), "job", "submit", "--address",
               f"http://127.0.0.1:{self.dashboard_port}", "--working-dir", ".", "--",
               "python", f"jobs/{job}.py", *args]
        proc = subprocess.run(cmd, cwd=REPO, env=self.client_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        print(proc.stdout[-6000:])
        return proc


def start_cluster(config: Path, port: int, dashboard_port: int, nodes: int) -> LocalCluster:
    env = {**os.environ, "DLC_CONFIG": str(config), "RAY_PORT": str(port),
           "DASHBOARD_PORT": str(dashboard_port), "NODES": str(nodes), "CPUS_PER_NODE": "1"}
    env.pop("RAY_ADDRESS", None)
    c = LocalCluster(config, dashboard_port, f"127.0.0.1:{port}", env)
    c.script("up")
    return c


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory.mktemp("dlc-config"), 6390, 8290, nodes=2)
    yield c
    c.script("down", check=False)


def read_manifest(output: Path) -> dict:
    return json.loads((output / "manifest.json").read_text())
