"""The embedded cluster: separate `ray start` nodes, token auth, loopback-only dashboard, and a
`down` that stops only its own processes."""

import json
import os
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, start_cluster, stop_cluster

from dlcluster import record


def ray_list_nodes(env, port):
    return subprocess.run([str(BIN / "ray"), "list", "nodes", "--address",
                           f"http://127.0.0.1:{port}", "--format", "json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def alive_node_ids(cluster) -> list[str]:
    """The ids of the nodes Ray's state API lists as alive, asked with the record's token."""
    ok = ray_list_nodes(cluster.client_env(), cluster.dashboard_port)
    assert ok.returncode == 0, ok.stderr
    nodes = json.loads(next(line for line in ok.stdout.splitlines() if line.startswith("[")))
    return sorted(n["node_id"] for n in nodes if n["state"] == "ALIVE")


def http_get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """The dashboard's answer to a GET, as (HTTP status, body); no proxy between."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers),
                         timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_nodes_joined_and_token_is_required(cluster):
    nodes = alive_node_ids(cluster)
    assert len(nodes) == 2, nodes
    # the gateway's check on the dashboard and job API: no credential 401, a wrong one 403, the
    # record's token 200; and behind it, Ray's own on its own port (the same answers, Ray's words)
    token = Path(record.load(cluster.config / record.RECORD).token_path).read_text().strip()
    assert http_get(cluster.dashboard_port, "/api/v0/nodes") == (
        401, "Unauthorized: Missing authentication token: put your credential where Ray's client reads its "
             "token (export RAY_AUTH_TOKEN_PATH=<its file>)\n")
    assert http_get(cluster.dashboard_port, "/api/v0/nodes", "0" * len(token)) == (
        403, "Forbidden: unknown credential: ask an admin for yours (dlcluster user add)\n")
    status, body = http_get(cluster.dashboard_port, "/api/v0/nodes", token)
    assert status == 200 and all(node in body for node in nodes), (status, body[:2000])
    ray_port = ray_dashboard_port(cluster.config)
    assert ray_port != cluster.dashboard_port
    assert http_get(ray_port, "/api/v0/nodes") == (401, "Unauthorized: Missing authentication token")
    assert http_get(ray_port, "/api/v0/nodes", "0" * len(token)) == (
        403, "Forbidden: Invalid authentication token")
    # and the CLI without the record's env (or a token file to fall back on) is refused with it
    no_token = {k: v for k, v in cluster.client_env().items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = str(cluster.config)  # no ~/.ray/auth_token to fall back on
    denied = ray_list_nodes(no_token, cluster.dashboard_port)
    assert denied.returncode != 0
    assert "Authentication required: Unauthorized: Missing authentication token" in denied.stderr, (
        denied.stdout + denied.stderr)  # Ray's message for the 401


def temp_root_of(config) -> str:
    """The local cluster's temp folder, as its state file records it."""
    return json.loads((config / "clusters" / "local" / "state.json").read_text())["temp_root"]


def ray_dashboard_port(config) -> int:
    """The port of Ray's own dashboard, behind the gateway, as the state file records it."""
    return int(json.loads((config / "clusters" / "local" / "state.json").read_text())["ray_dashboard"]
               .rsplit(":", 1)[1])


def test_token_and_folders_are_private_and_outside_the_repo(cluster):
    token = cluster.config / "clusters" / "local" / "ray_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    temp_root = temp_root_of(cluster.config)
    assert stat.S_IMODE(os.stat(temp_root).st_mode) == 0o700
    # a name no other local user can guess and make first
    assert re.fullmatch(r"/tmp/dlc-6390-[A-Za-z0-9_]{8}", temp_root), temp_root
    assert len(token.read_text()) == 64
    assert not token.resolve().is_relative_to(REPO)


def test_each_nodes_log_monitor_looks_for_new_files_every_half_second(cluster):
    """Ray's log monitor (the workers' output to the jobs' logs) runs with the cluster's setting: a
    search of its node's log folder every 0.5 s, not on each 0.1 s pass (its CPU, halved)."""
    temp_root = temp_root_of(cluster.config)
    monitors = [p for p in psutil.process_iter(["cmdline"])
                if any("log_monitor.py" in part for part in p.info["cmdline"] or [])
                and any(temp_root in part for part in p.info["cmdline"] or [])]
    assert len(monitors) == 2, monitors  # the head's and the other node's
    for proc in monitors:
        assert proc.environ().get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD") == "0", proc


def listening_addresses(port):
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def test_dashboard_and_job_api_listen_on_loopback_only(cluster):
    for port in (cluster.dashboard_port, ray_dashboard_port(cluster.config)):  # the gateway's, Ray's own
        addrs = listening_addresses(port)
        assert addrs and all(a == "0100007F" for a in addrs), (port, addrs)  # 127.0.0.1


def test_status_prints_nodes_and_resources(cluster):
    """`make cluster-status`: where the cluster answers and how to authenticate, then `ray status`:
    a line for each node Ray's state API lists as alive, by its id, and the cluster's CPUs and
    object store (NODES x CPUS_PER_NODE, NODES x OBJECT_STORE_MB)."""
    out = cluster.script("status").stdout
    assert out.splitlines()[0] == (f"dashboard / job API: http://127.0.0.1:{cluster.dashboard_port}   "
                                   f"GCS: {cluster.gcs}   auth: token ({cluster.config / record.CLIENT_ENV})")
    assert "Node status" in out and "Resources" in out, out
    assert sorted(re.findall(r"^ 1 node_([0-9a-f]{56})$", out, re.M)) == alive_node_ids(cluster), out
    nodes = int(cluster.env["NODES"])
    cpus = float(nodes * int(cluster.env["CPUS_PER_NODE"]))
    used = re.search(rf"^ (\d+\.\d+)/{re.escape(str(cpus))} CPU$", out, re.M)
    assert used and float(used.group(1)) <= cpus, out
    mib = nodes * int(cluster.env.get("OBJECT_STORE_MB") or 512)
    total = f"{mib / 1024:.2f}GiB" if mib >= 1024 else f"{mib:.2f}MiB"  # as Ray shows sizes
    assert re.search(rf"^ \S+/{re.escape(total)} object_store_memory$", out, re.M), out


def test_down_stops_only_its_own_cluster(cluster, tmp_path):
    from dlcluster.local_cluster import cluster_pids

    main_pids = cluster_pids(temp_root_of(cluster.config), 6390)
    other = start_cluster(tmp_path, 6395, 8295, nodes=1)
    try:
        assert record.load(tmp_path / "cluster.json").job_api == "http://127.0.0.1:8295"
        other_root = temp_root_of(tmp_path)
        other_pids = cluster_pids(other_root, 6395)
        assert other_pids and not set(other_pids) & set(main_pids)
        gateway = json.loads((tmp_path / "clusters/local/state.json").read_text())["gateway_pid"]
        assert os.path.exists(f"/proc/{gateway}")
        assert "stopped" in other.script("down").stdout
        assert not os.path.exists(f"/proc/{gateway}")  # its gateway too
        assert not (tmp_path / "cluster.json").exists()  # its record goes with it
        assert (cluster.config / "cluster.json").exists()
        assert cluster_pids(other_root, 6395) == []  # Ray Client server too
        assert not os.path.exists(other_root)
        for pid in main_pids:
            assert os.path.exists(f"/proc/{pid}"), f"down of another cluster killed {pid}"
    finally:
        stop_cluster(other)  # a failed assertion above leaves no second cluster running
    assert "nothing to stop" in other.script("down").stdout


@pytest.mark.parametrize("variables,line", [
    ({"NODES": "abc"}, "NODES=abc is not a whole number"),
    ({"NODES": "0"}, "NODES=0 must be from 1 to 64"),
    ({"RAY_PORT": "70000"}, "RAY_PORT=70000 must be from 1024 to 65535"),
    ({"RAY_PORT": "8299", "DASHBOARD_PORT": "8299"}, "RAY_PORT and DASHBOARD_PORT are both 8299"),
    ({"OBJECT_STORE_MB": "1"}, "OBJECT_STORE_MB=1 must be at least 78"),
])
def test_bad_make_variables_are_one_line(tmp_path, variables, line):
    env = {**os.environ, "DLC_CONFIG": str(tmp_path), **variables}
    proc = subprocess.run([sys.executable, "-m", "dlcluster.local_cluster", "up"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("local_cluster: error: ") and line in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
