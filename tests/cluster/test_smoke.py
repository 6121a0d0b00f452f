"""make smoke end to end on the 2-node fixture cluster: the cluster record `up` wrote, the nodes
and all-reduce steps (the pytest suite dlcluster/smoke/suite, run by dlcluster/smoke/run.py)
through the job API, the JSON report, the printed lines, and a cluster record the cluster does not
match. Its trainers
step (the jobs, one tiny epoch each, models verified on the cluster) is asserted in the emulated
tier's smoke run, across 3 nodes (horovod_mnist and tf_cnn; ddp_autoencoder there is the README
run's); this tier's own job tests train the same jobs on this cluster."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from dlcluster import record

N = 2


def smoke(cluster, *argv, timeout=900):
    proc = subprocess.run([str(Path(sys.executable).parent / "dlcluster"), "smoke", *argv], cwd=REPO,
                          env=cluster.env,
                          capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def run(cluster, tmp_path_factory):
    """One smoke run of nodes and allreduce (1 and 4 MiB): (process, report)."""
    tmp = tmp_path_factory.mktemp("smoke")
    report = tmp / "report.json"
    proc = smoke(cluster, "--only", "nodes,allreduce", "--max-mib", "4", "--json", str(report))
    return proc, json.loads(report.read_text())


def test_cluster_up_wrote_the_record(cluster):
    r = record.load(cluster.config / "cluster.json")
    assert (r.name, r.kind, r.job_api) == ("local", "local", "http://127.0.0.1:8290")
    assert r.token_path == str(cluster.config / "clusters" / "local" / "ray_token")
    assert [(n.role, n.ip, n.cpus, n.gpus) for n in r.nodes] == [("head", None, 1, 0), ("worker", None, 1, 0)]
    assert r.ssh_config is None and r.bastion is None
    # the same record in the cluster's own folder, and the client env that goes with it
    assert record.load(cluster.config / "clusters" / "local" / "cluster.json") == r
    env = (cluster.config / "ray-client.env").read_text()
    assert "export RAY_ADDRESS=http://127.0.0.1:8290\n" in env


def test_every_step_passes(run):
    proc, report = run
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["ok"] and report["cluster"] == "local" and report["nodes"] == N
    assert [(s["name"], s["ok"], s["skipped"]) for s in report["steps"]] == \
        [("nodes", True, False), ("allreduce", True, False)]
    assert all(s["seconds"] > 0 for s in report["steps"]) and report["seconds"] > 0
    for name in ("nodes", "allreduce"):
        assert any(line.split()[:2] == ["PASS", name] for line in proc.stdout.splitlines())
    assert "smoke: PASS: 2 passed, 0 failed, 0 skipped" in proc.stdout
    lines = proc.stdout.splitlines()
    # progress as it happens: each step starts with its limit, submits its job, ends with its verdict
    for name, limit in (("nodes", 180), ("allreduce", 600)):
        assert f"[smoke] {name}: starting (limit {limit} s)" in lines
        assert any(line.startswith(f"[smoke] {name}: submitting python ray/smoke_checks.py {name}")
                   for line in lines)
        assert any(line.split()[:3] == ["[smoke]", "PASS", name] for line in lines)
    assert lines[-1].startswith("smoke: PASS: 2 passed, 0 failed, 0 skipped in ")


def test_nodes(run):
    nodes = run[1]["steps"][0]["details"]
    assert (nodes["alive"], nodes["expected"], nodes["agents"]) == (N, N, N)
    assert nodes["cpus"] == [1, 1] and nodes["gpus"] == [0, 0]
    assert sum(n["head"] for n in nodes["nodes"]) == 1
    assert all(n["task"]["ray"] == "2.60.0" for n in nodes["nodes"])
    # as root each local worker node has its own hostname (local_cluster.own_hostname), else
    # all share the host's
    hostnames = {n["task"]["hostname"] for n in nodes["nodes"]}
    assert len(hostnames) == (N if os.geteuid() == 0 else 1), hostnames


def test_the_driver_and_every_node_run_the_uploaded_harness_over_the_installed_one(run):
    """The local cluster runs .venv, where make setup installed this checkout's trainkit: the job's
    driver and its tasks on each node still import the uploaded copy (its working dir)."""
    import trainkit

    installed = Path(trainkit.__file__).resolve().parent
    assert installed == REPO / "trainkit"
    nodes = run[1]["steps"][0]["details"]
    for where in [nodes["driver"], *(n["task"] for n in nodes["nodes"])]:
        harness, upload = Path(where["harness"]), Path(where["working_dir"])
        assert harness == upload / "trainkit" and upload != REPO and "_ray_pkg_" in upload.name, where


def test_allreduce(run):
    proc, report = run
    d = report["steps"][1]["details"]
    assert (d["backend"], d["world_size"], d["nodes_used"]) == ("gloo", N, N)
    assert len({r["node_id"] for r in d["ranks"]}) == N  # STRICT_SPREAD: one rank per node
    rows = d["rows"]
    assert [r["bytes"] for r in rows] == [2**20, 4 * 2**20]
    for r in rows:
        assert r["wrong"] == 0 and r["count"] * 4 == r["bytes"] and r["time_us"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (N - 1) / N)
    assert "all-reduce: gloo, 2 ranks on 2 nodes" in proc.stdout
    table = [line.split() for line in proc.stdout.splitlines()]
    assert ["4194304", "1048576", "float", "sum"] in [cols[:4] for cols in table]


def test_a_third_node_in_the_record_fails_the_nodes_step(cluster, tmp_path):
    rec = json.loads((cluster.config / "cluster.json").read_text())
    rec["nodes"].append({"name": "node2", "ip": None, "role": "worker", "cpus": 1, "gpus": 0})
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(rec))
    report = tmp_path / "report.json"
    proc = smoke(cluster, "--config", str(config), "--only", "nodes", "--json", str(report), timeout=300)
    assert proc.returncode == 1
    step = json.loads(report.read_text())["steps"][0]
    assert not step["ok"] and not json.loads(report.read_text())["ok"]
    assert "2 Ray node(s) alive, the cluster record lists 3" in step["details"]["error"]
    assert any(line.split()[:2] == ["FAIL", "nodes"] for line in proc.stdout.splitlines())
