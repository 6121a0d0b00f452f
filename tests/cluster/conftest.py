"""A throwaway local Ray cluster (2 nodes, its own ports, token and temp dirs) for the job tests.

It is started with the same script as `make cluster-up`, and every job reaches it the way a user's
does: `ray job submit --working-dir <repo> -- python jobs/<job>.py ...`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlcluster import record
from trainkit.versions import cache_dir

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


# What Ray prints that a user cannot act on, turned off by the harness (the report dumps, the
# preemption watcher) and by ray-client.env (the ignore-file notices, the venv warnings)
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")  # a job's status once it has ended
RAY_NOISE = ("Reporting training result", "PreemptionWatcher", "Ignoring upload to cluster",
             "is now ignored by default")


def ray_noise(output: str) -> list[str]:
    """The lines of a job's log that are Ray's noise (none, in a quiet log)."""
    return [line for line in output.splitlines() if any(n in line for n in RAY_NOISE)]


@dataclass
class LocalCluster:
    config: Path
    dashboard_port: int
    gcs: str
    env: dict

    def script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "dlcluster.local_cluster", *args], cwd=REPO,
                              env=self.env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 or not check, f"local_cluster {args}: {proc.stdout}{proc.stderr}"
        return proc

    def client_env(self) -> dict:
        """The environment a client gets from the cluster record (as `make submit` does)."""
        return {**self.env, **record.load(self.config / record.RECORD).client_env()}

    def submit(self, job: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        """`ray job submit` as the README shows it; output is stdout + stderr together."""
        address = f"http://127.0.0.1:{self.dashboard_port}"
        submission = f"test-{job}-{uuid.uuid4().hex[:12]}"
        cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--submission-id", submission,
               "--working-dir", ".", "--", "python", f"jobs/{job}.py", *args]
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=self.client_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            # only the client died: stop the job too, or it keeps the shared cluster's CPUs and
            # the tests after this one fail for want of them
            subprocess.run([str(BIN / "ray"), "job", "stop", "--address", address, submission],
                           cwd=REPO, env=self.client_env(), capture_output=True, timeout=120)
            raise
        print(proc.stdout[-6000:])
        return proc

    def jobs(self) -> dict[str, str]:
        """Every job the job API lists: submission id -> status ({} when it does not answer)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.dashboard_port}/api/jobs/")
        token = Path(self.client_env()["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                listed = json.loads(r.read())
            return {j["submission_id"]: j["status"] for j in listed if j.get("submission_id")}
        except OSError:
            return {}

    def submit_all(self, job: str, cases: dict[str, list[str]], timeout: int = 240,
                   ) -> dict[str, subprocess.CompletedProcess]:
        """One `ray job submit` per case, all at once: for bad input, which the driver refuses
        before any worker (or CPU) is reserved, so the submissions need not wait for each other."""
        with ThreadPoolExecutor(len(cases)) as pool:
            procs = pool.map(lambda args: self.submit(job, *args, timeout=timeout), cases.values())
            return dict(zip(cases, procs, strict=True))


def plain_env(tmp_path: Path) -> dict:
    """A plain launcher's environment (torchrun, horovodrun, TF_CONFIG): the project's virtualenv
    on PATH, a home of the test's own, no Ray address."""
    return {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "DLC_HOME": str(tmp_path)}


def prometheus_bin_dir() -> str | None:
    """The folder of the distribution's prometheus binary (scripts/promtool.sh unpacks it), put on
    the local cluster's PATH so that it runs one; None where it cannot be had."""
    proc = subprocess.run([str(REPO / "scripts/promtool.sh"), "--bin-dir"], capture_output=True,
                          text=True, timeout=300)
    return proc.stdout.strip() if proc.returncode == 0 else None


# The tier's clusters while they run, one file each (its DLC_CONFIG), so that a run killed before
# its clusters were stopped (CI's time limit, ^C) leaves nothing the next run trips over.
STARTED = cache_dir() / "test-state" / "cluster-tier"


def cluster_env(config: Path, port: int, dashboard_port: int, nodes: int) -> dict:
    env = {**os.environ, "DLC_CONFIG": str(config), "RAY_PORT": str(port),
           "DASHBOARD_PORT": str(dashboard_port), "NODES": str(nodes), "CPUS_PER_NODE": "1",
           "METRICS_PORT": str(dashboard_port + 1000), "TRACKING_PORT": str(dashboard_port + 2000)}
    env.pop("RAY_ADDRESS", None)
    return env


def start_cluster(config: Path, port: int, dashboard_port: int, nodes: int) -> LocalCluster:
    env = cluster_env(config, port, dashboard_port, nodes)
    if prometheus := prometheus_bin_dir():
        env["PATH"] = f"{prometheus}:{env['PATH']}"
    c = LocalCluster(config, dashboard_port, f"127.0.0.1:{port}", env)
    STARTED.mkdir(parents=True, exist_ok=True)
    (STARTED / f"{port}-{dashboard_port}").write_text(f"{config}\n")
    c.script("up")
    return c


def stop_cluster(c: LocalCluster) -> None:
    """`down`, and the cluster no longer recorded as the tier's."""
    c.script("down", check=False)
    port = c.gcs.rsplit(":", 1)[1]
    (STARTED / f"{port}-{c.dashboard_port}").unlink(missing_ok=True)


# the run-history servers a test starts alone (test_tracking.py), a file each named for its pid
SERVERS = STARTED / "mlflow"


def stop_server(pidfile: Path) -> None:
    """The run-history server `pidfile` names, its whole process group, killed if it is still that
    server (a pid reused since is left alone); the file removed."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text())
        if "mlflow" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="ignore"):
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def stop_leftovers() -> list[str]:
    """Each cluster an earlier run of the tier started and did not stop (killed): stopped with
    its own `down`; each run-history server a test started alone, killed. What was stopped, for
    the log."""
    stopped = []
    for left in sorted(SERVERS.glob("*")) if SERVERS.is_dir() else []:
        stop_server(left)
        stopped.append(f"a run-history server a killed run left ({left.name})")
    for left in sorted(STARTED.glob("*-*")) if STARTED.is_dir() else []:
        port, dashboard_port = map(int, left.name.split("-"))
        config = Path(left.read_text().strip())
        if config.is_dir():
            stop_cluster(LocalCluster(config, dashboard_port, f"127.0.0.1:{port}",
                                      cluster_env(config, port, dashboard_port, 1)))
            stopped.append(f"127.0.0.1:{port} ({config})")
        left.unlink(missing_ok=True)
    return stopped


def held(port: int) -> str | None:
    """Who listens on 127.0.0.1:port (ss's line), or None where no one does."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) != 0:
            return None
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    return " ".join(out.split()) or "a process this user cannot see"


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    for line in stop_leftovers():
        print(f"stopped a local cluster an earlier, killed run of the tier left: {line}")
    ports = (6390, 8290, 9290, 10290)  # GCS, dashboard, Prometheus, MLflow
    if busy := {p: who for p in ports if (who := held(p))}:
        pytest.exit(f"the cluster tier's ports are held: {busy}; stop what holds them (a local cluster: "
                    "DLC_CONFIG=<its config> make cluster-down)", returncode=3)
    c = start_cluster(tmp_path_factory.mktemp("dlc-config"), 6390, 8290, nodes=2)
    yield c
    stop_cluster(c)


@pytest.fixture(autouse=True)
def jobs_end_with_their_test(request):
    """A job a test of the shared cluster submitted that has not ended when the test does (it failed,
    or its client was killed) is stopped with ray job stop and waited for: the tests after it find
    the cluster's CPUs free."""
    if "cluster" not in request.fixturenames:
        yield
        return
    c = request.getfixturevalue("cluster")
    before = set(c.jobs())
    yield
    left = [i for i, status in c.jobs().items() if i not in before and status not in ENDED]
    for job_id in left:
        subprocess.run([str(BIN / "ray"), "job", "stop", "--address", f"http://127.0.0.1:{c.dashboard_port}",
                        job_id], cwd=REPO, env=c.client_env(), capture_output=True, timeout=120)
    deadline = time.time() + 120
    while left and time.time() < deadline and any(c.jobs().get(i) not in ENDED for i in left):
        time.sleep(1)
    if left:
        print(f"stopped the job(s) the test left running: {', '.join(left)}")


def read_manifest(output: Path) -> dict:
    return json.loads((output / "manifest.json").read_text())
