"""The emulated cluster, provisioned like real servers, for the tests in this folder.

`tests/emulated/emulate.sh up` starts a bastion and three node containers behind it (systemd,
sshd, a private network the host cannot reach), then `dlcluster up` (= make cluster-up
INVENTORY=ansible/inventories/emulated/hosts.yml) provisions them through the bastion with the
real playbooks. Everything runs with its own DLC_CONFIG, so a user's clusters and keys are not
touched; the session ends with cluster-down and emulate-down, and removes the images its tests
built. It starts by removing what a killed earlier run left (its ssh tunnels on the tier's ports,
containers, networks, iptables rules, test images), or stops with one line naming a program of
someone else's on one of its ports.

The tests, by concern, in this order (each also runs alone with -k; a test's jobs, nodes, rules
and files are put back when it fails too): test_10_provision (cluster-up, the first baseline,
the registry, the bastion's services, the firewall, the ways in), test_20_stranger,
test_30_readme_job (the README's job, Prometheus and the run history in a browser, the language
model sharded), test_40_operators (attach, the running-jobs guard, the engine restarted under
Ray, a jump host without sudo, a changed setting and an interrupted run, a second operator, a
node down), test_50_faults (an unchanged Ray Train script, the head's Ray restarted, make
resume, a node killed), test_55_host_keys, test_60_bad_input, test_70_doctor (healthy, six
faults, quarantine, a slowed node), test_80_lifecycle (a node added and removed, make upgrade),
test_90_last (no secret printed, cluster-down). What several share is helpers.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from dlcluster import record
from trainkit.versions import cache_dir

REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "ansible/inventories/emulated/hosts.yml"
BIN = Path(sys.executable).parent
DLCLUSTER = str(BIN / "dlcluster")  # the operator's command, installed by make setup
# The tier's own tunnel port: `make demo`'s local cluster keeps the README's 127.0.0.1:8265, so the
# quick start's two commands (make demo, then make test) run in that order, the demo still up.
PORT = 8275
METRICS_PORT = 9275  # Prometheus' local end of the tunnel (make cluster-up's METRICS_PORT)
# Grafana's (GRAFANA_PORT): the emulated head has none (its package source is unreachable)
GRAFANA_PORT = 10275  # PORT + 2000, as a second operator's (helpers.operator)
TRACKING_PORT = 11275  # the run history's local end (make cluster-up's TRACKING_PORT), PORT + 3000
DEMO_PORT = 8265
DEMO_RAY_PORT = 6379
# every local tunnel end the tier opens: its own, and its second operators' (helpers.operator:
# 8276-8280), each with its Prometheus, Grafana and run-history ends (+1000, +2000, +3000)
TUNNEL_PORTS = [base + k for base in (PORT, *range(8276, 8281)) for k in (0, 1000, 2000, 3000)]
# images the tests build on this machine (make upgrade's test; the registry test's probe): not the
# project's current image, but each keeps the dlcluster:cpu it was built on alive (7 GB per stale one)
TEST_IMAGES = ("dlcluster:cpu-next", "dlcluster:cpu-broken", "dlc-gc-probe:latest")
NODES = {"node-1": "172.31.251.11", "node-2": "172.31.251.12", "node-3": "172.31.251.13"}
# the bastion container's address on the private network, as the emulated inventory names it
BASTION_PRIVATE = (yaml.safe_load(INVENTORY.read_text())["all"]["children"]["bastions"]["hosts"]
                   ["bastion"]["ip"])


# every Ray token this tier's tests read (Emulated.token: the fixture's cluster-up, rotate-token's,
# remove-node's re-key), each of which saw jobs, faults and smoke: test_90 searches for all of them
TOKENS_SEEN: set[str] = set()


def run_within(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """`cmd` as run() runs it, but one still running after `timeout` seconds is stopped with all it
    started (its process group) and comes back failed, its last line saying so and naming the last
    task it began (the fixture's cluster-up: one cause for the tier, not an error per test)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        tasks = re.findall(r"^TASK \[([^\]]+)\]", out, re.M)
        said = f"{' '.join(cmd)}: stopped after {timeout} s, in its task {tasks[-1] if tasks else '(none)'}"
        return subprocess.CompletedProcess(cmd, 124, out, err + said + "\n")


def run(cmd: list[str], env: dict, timeout: int = 900, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, \
            f"{cmd}: rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def get_json(port: int, path: str, token: str | None = None) -> tuple[int, object]:
    """GET 127.0.0.1:port/path (with the token as Ray's job API takes it): its HTTP status and JSON
    body (None for an error); (0, None) when nothing answers."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):  # e.g. the head restarting
        return 0, None


def _listeners(ports: list[int]) -> dict[int, int | None]:
    """port -> the pid listening on it (None: one this user cannot see), for those of `ports` taken."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports}


def close_leftover_tunnels(stop_on_others: bool) -> None:
    """The ssh tunnels into an emulated cluster (their -F is a clusters/emulated/ssh_config) that
    hold one of the tier's ports: left by a run that was killed, or whose cluster-down failed.
    emulate.sh down removes the containers they lead to, so they are ended. Anything else on the
    tier's own ports (not its second operators') stops the session with one line, when asked."""
    for port, pid in sorted(_listeners(TUNNEL_PORTS).items()):
        try:
            proc = psutil.Process(pid) if pid else None
            name, cmdline = (proc.name(), proc.cmdline()) if proc else ("", [])
            if name == "ssh" and any(a.endswith("/clusters/emulated/ssh_config") for a in cmdline):
                proc.terminate()
                if psutil.wait_procs([proc], timeout=10)[1]:
                    proc.kill()
                print(f"emulated: ended an ssh tunnel into an emulated cluster left on 127.0.0.1:{port} "
                      f"(pid {pid})")
                continue
        except psutil.Error:  # it ended meanwhile
            continue
        if stop_on_others and port in (PORT, METRICS_PORT, GRAFANA_PORT, TRACKING_PORT):
            command = " ".join(" ".join(cmdline).split())[:200]  # one line
            if proc:
                holder = f"pid {pid} ({command}), not a tunnel of an earlier run of it: stop it (kill {pid})"
            else:
                holder = "a process this user cannot see (as root: ss -ltnp): stop it"
            pytest.exit(f"emulated: error: 127.0.0.1:{port}, a port of this tier's tunnel, is held by "
                        f"{holder}, then run the tier again", returncode=2)


def remove_test_images(env: dict) -> None:
    for image in TEST_IMAGES:  # untagged; gone with its last tag, unless a container still uses it
        if run(["docker", "image", "inspect", image], env).returncode == 0:
            run(["docker", "image", "rm", image], env)


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

    def cluster(self, action: str, inventory: Path | None = None, timeout: int = 900,
                port: int | None = None):
        """dlcluster ACTION with `inventory`; `port`: the tunnel's local ends of a cluster of
        another name (DASHBOARD_PORT, METRICS_PORT, GRAFANA_PORT, TRACKING_PORT: port, +100, +200, +300), as
        its operator would give it: this cluster's tunnel holds the tier's, and cluster-up names a
        held port before anything else."""
        env = {**self.env, "INVENTORY": str(inventory or INVENTORY)}
        if port is not None:
            env.update(DASHBOARD_PORT=str(port), METRICS_PORT=str(port + 100), GRAFANA_PORT=str(port + 200),
                       TRACKING_PORT=str(port + 300))
        return run([DLCLUSTER, action], env, timeout=timeout)

    def client_env(self) -> dict:
        """The environment a client gets from the cluster record (as `make submit` does)."""
        return {**self.env, **record.load(self.config / record.RECORD).client_env()}

    def token(self) -> str:
        """The cluster's token now; every one read is kept (TOKENS_SEEN) for test_90's search."""
        token = (self.cluster_dir / "ray_token").read_text().strip()
        TOKENS_SEEN.add(token)
        return token

    def api(self, path: str, token: str | None = None) -> tuple[int, object]:
        return get_json(PORT, path, token)

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

    def token(self) -> str | None:
        """This tier's own demo cluster's token (its record); None for the user's, whose it does not read."""
        if self.env is None:
            return None
        desc = record.load(Path(self.env["DLC_CONFIG"]) / record.RECORD)
        return Path(desc.token_path).read_text().strip()

    def down(self) -> None:
        if self.env is not None:
            run([DLCLUSTER, "down"], self.env, timeout=300)
            self.env = None


# the demo stand-in's DLC_CONFIG while it runs: a killed run's is stopped by the next run, not
# taken for the user's own `make demo`
STAND_IN = cache_dir() / "test-state" / "emulated-demo-stand-in"


def stand_in_env(config: Path) -> dict:
    """`make demo`'s cluster as the tier stands it in: one node (what the tier needs of it is a
    second cluster answering beside its own; a second node would idle on the 2 cores for the whole
    tier)."""
    env = {**os.environ, "DLC_CONFIG": str(config), "RAY_PORT": str(DEMO_RAY_PORT),
           "DASHBOARD_PORT": str(DEMO_PORT), "NODES": "1", "CPUS_PER_NODE": "0"}
    for name in ("RAY_ADDRESS", "INVENTORY"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    if STAND_IN.is_file():  # a killed earlier run's stand-in: not the user's demo, stopped
        left = Path(STAND_IN.read_text().strip())
        if left.is_dir():
            print(f"stopping the demo stand-in a killed earlier run left ({left})")
            run([DLCLUSTER, "down"], stand_in_env(left), timeout=300)
        STAND_IN.unlink()
    with socket.socket() as s:
        busy = s.connect_ex(("127.0.0.1", DEMO_PORT)) == 0
    if busy:
        print(f"a cluster already answers on 127.0.0.1:{DEMO_PORT} (make demo's?): the tier runs beside it")
        yield Demo(None)
        return
    config = tmp_path_factory.mktemp("demo-config")
    env = stand_in_env(config)
    STAND_IN.parent.mkdir(parents=True, exist_ok=True)
    STAND_IN.write_text(f"{config}\n")
    run([DLCLUSTER, "up"], env, timeout=300, check=True)
    d = Demo(env)
    try:
        yield d
    finally:
        d.down()
        STAND_IN.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def emulated(tmp_path_factory, demo):
    config = tmp_path_factory.mktemp("dlc-config")
    env = {**os.environ, "DLC_CONFIG": str(config), "DASHBOARD_PORT": str(PORT),
           "METRICS_PORT": str(METRICS_PORT), "GRAFANA_PORT": str(GRAFANA_PORT),
           "TRACKING_PORT": str(TRACKING_PORT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("INVENTORY", None)
    # a fresh start: what a killed run left (its tunnels, containers, networks, iptables rules, a
    # fourth node, test images) gone; new machines, new host keys
    close_leftover_tunnels(stop_on_others=True)
    remove_test_images(env)
    run(["tests/emulated/emulate.sh", "down"], env)
    up = run(["tests/emulated/emulate.sh", "up"], env, timeout=600)  # (its failure: cluster_up_passed)
    if up.returncode == 0:
        started = time.time()
        # a fresh machine's first push of the 7 GB image to the bastion's registry, and node-3's
        # pull, beside the other lane: 3.35 GB compressed at 3-4 MB/s, over 800 s (2026-12-01); on a
        # slower machine the push alone took 21 minutes and the whole cluster-up passed 2400 s in its
        # last task (2026-12-02): the limit stops a hung run, not a slow one
        up = run_within([DLCLUSTER, "up"], {**env, "INVENTORY": str(INVENTORY)}, timeout=3600)
        print(f"cluster-up through the bastion: {time.time() - started:.0f} s")
    print(up.stdout[-3000:], up.stderr[-2000:])
    yield Emulated(env, config, up, demo)
    try:
        if (config / "cluster.json").exists():  # the last test's cluster-down did not run, or failed
            run([DLCLUSTER, "down"], {**env, "INVENTORY": str(INVENTORY)}, timeout=300)
    finally:
        try:
            run(["tests/emulated/emulate.sh", "down"], env, timeout=300)
        finally:  # a tunnel a failed cluster-down (or a second operator's test) left; the test images
            close_leftover_tunnels(stop_on_others=False)
            remove_test_images(env)


FIRST_FAILURE: list[str] = []  # the tier's failed cluster-up, once reported


@pytest.fixture(autouse=True)
def cluster_up_passed(emulated):
    """A tier whose machines or cluster-up failed shows one cause, not a failure per test: the first
    test fails with the failed command's last line, every later one is skipped with it."""
    if emulated.up.returncode == 0:
        return
    said = (emulated.up.stderr.strip() or emulated.up.stdout.strip() or "no output").splitlines()[-1]
    cause = f"{' '.join(emulated.up.args[:2])} failed (exit {emulated.up.returncode}): {said}"
    if FIRST_FAILURE:
        pytest.skip(f"(the tier's cluster failed to come up) {cause}")
    FIRST_FAILURE.append(cause)
    pytest.fail(cause)


@pytest.fixture(autouse=True)
def jobs_end_with_their_test(emulated, cluster_up_passed):
    """A job a test submitted that has not ended when the test does (it failed, or stopped only its
    client) is stopped with ray job stop: the next test finds the CPUs free and cluster-down no job."""
    from helpers import ENDED, jobs, stop_jobs  # (helpers imports this module's names)

    before = set(jobs(emulated))
    yield
    stop_jobs(emulated, [i for i, j in jobs(emulated).items()
                         if i not in before and j.get("status") not in ENDED])


def pytest_configure(config):
    config.addinivalue_line("markers", "ends_the_tier: runs after every other test of the tier")


def pytest_collection_modifyitems(items):
    """cluster-down last, whatever was selected (-k) and in whatever order: the others need the cluster."""
    items.sort(key=lambda item: item.get_closest_marker("ends_the_tier") is not None)  # stable: file order
