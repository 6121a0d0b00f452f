"""The embedded cluster: separate `ray start` nodes, token auth, loopback-only dashboard, and a
`down` that stops only its own processes."""

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from conftest import BIN, REPO, start_cluster

from trainkit import record


def ray_list_nodes(env, port):
    return subprocess.run([str(BIN / "ray"), "list", "nodes", "--address",
                           f"http://127.0.0.1:{port}", "--format", "json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_nodes_joined_and_token_is_required(cluster):
    ok = ray_list_nodes(cluster.client_env(), cluster.dashboard_port)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count('"ALIVE"') == 2
    no_token = {k: v for k, v in cluster.client_env().items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = str(cluster.config)  # no ~/.ray/auth_token to fall back on
    denied = ray_list_nodes(no_token, cluster.dashboard_port)
    assert denied.returncode != 0
    assert "auth" in (denied.stdout + denied.stderr).lower()


def temp_root_of(config) -> str:
    """The local cluster's temp folder, as its state file records it."""
    return json.loads((config / "clusters" / "local" / "state.json").read_text())["temp_root"]


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
    addrs = listening_addresses(cluster.dashboard_port)
    assert addrs and all(a == "0100007F" for a in addrs), addrs  # 127.0.0.1


def test_status_prints_nodes_and_resources(cluster):
    out = cluster.script("status").stdout
    assert "token" in out and f"127.0.0.1:{cluster.dashboard_port}" in out
    assert "2.0 CPU" in out or "0.0/2.0 CPU" in out


def test_down_stops_only_its_own_cluster(cluster, tmp_path):
    sys.path.insert(0, str(REPO / "ray"))
    from local_cluster import cluster_pids

    main_pids = cluster_pids(temp_root_of(cluster.config), 6390)
    other = start_cluster(tmp_path, 6395, 8295, nodes=1)
    assert record.load(tmp_path / "cluster.json").job_api == "http://127.0.0.1:8295"
    other_root = temp_root_of(tmp_path)
    other_pids = cluster_pids(other_root, 6395)
    assert other_pids and not set(other_pids) & set(main_pids)
    assert "stopped" in other.script("down").stdout
    assert not (tmp_path / "cluster.json").exists()  # its record goes with it
    assert (cluster.config / "cluster.json").exists()
    assert cluster_pids(other_root, 6395) == []  # Ray Client server too
    assert not os.path.exists(other_root)
    for pid in main_pids:
        assert os.path.exists(f"/proc/{pid}"), f"down of another cluster killed {pid}"
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
    proc = subprocess.run([sys.executable, "ray/local_cluster.py", "up"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("local_cluster: error: ") and line in errors[0]
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
