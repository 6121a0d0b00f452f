"""make smoke without a cluster: the bandwidth arithmetic, the command line and the cluster record
(bad input is one line and exit 2 before any step), node matching, the trainers' flags, the
proxyjump decisions (loopback only), and the report plugin in a real pytest run of a small fake
suite (a pass, a failure, a crash, a skip): its lines, report, summary, selection and limits."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dlcluster import local_cluster, record
from dlcluster.smoke import lib
from dlcluster.smoke import report as smoke_report
from dlcluster.smoke import run as smoke
from trainkit import data, mnist
from trainkit.cluster import check_batch
from trainkit.errors import UserError

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ray"))

import smoke_checks  # noqa: E402


def local_rec(nodes=2, cpus=1, **changes) -> record.ClusterRecord:
    st = {"dashboard": "http://127.0.0.1:8265", "nodes": nodes, "cpus_per_node": cpus}
    return record.ClusterRecord.model_validate({**local_cluster.the_record(st).model_dump(), **changes})


def remote_rec(**changes) -> record.ClusterRecord:
    from test_record import remote

    return record.ClusterRecord.model_validate(remote(**changes))


def a_node(name: str, ip: str | None = "127.0.0.1") -> record.Node:
    return record.Node(name=name, ip=ip, role="worker", cpus=1, gpus=0)


# ------------------------------------------------------------------ all-reduce arithmetic
@pytest.mark.parametrize("ranks, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (3, 4 / 3)])
def test_busbw_is_algbw_times_2_n_minus_1_over_n(ranks, factor):
    algbw, busbw = smoke_checks.bandwidth(256 * 2**20, 0.5, ranks)
    assert algbw == pytest.approx(256 * 2**20 / 0.5 / 1e9)  # GB/s: 1e9 bytes per second
    assert busbw == pytest.approx(algbw * factor)


def test_nccl_tests_example_numbers():
    # nccl-tests: 1 GB in 10 ms on 8 ranks is 100 GB/s algbw and 175 GB/s busbw
    assert smoke_checks.bandwidth(10**9, 0.01, 8) == pytest.approx((100.0, 175.0))


def test_fewer_iterations_for_big_messages():
    mib = smoke_checks.MIB
    assert smoke_checks.iterations(1 * mib) == (2, 20)
    assert smoke_checks.iterations(16 * mib) == (2, 5)
    assert smoke_checks.iterations(256 * mib) == (1, 3)
    timed = [smoke_checks.iterations(s * mib)[1] for s in (1, 4, 16, 64, 256)]
    assert timed == sorted(timed, reverse=True)


def test_sizes_from_flags():
    a = smoke.parse_args([])
    assert a.sizes_bytes == [s * 2**20 for s in (1, 4, 16, 64, 256)]
    assert smoke.parse_args(["--max-mib", "16"]).sizes_bytes == [2**20, 4 * 2**20, 16 * 2**20]
    assert smoke.parse_args(["--sizes", "0.5,2"]).sizes_bytes == [2**19, 2**21]
    with pytest.raises(UserError, match="no all-reduce size left"):
        smoke.parse_args(["--max-mib", "0.5"])
    with pytest.raises(UserError, match="must be numbers of MiB"):
        smoke.parse_args(["--sizes", "big"])
    with pytest.raises(UserError, match=r"unknown step\(s\) gpus; use some of nodes,allreduce"):
        smoke.parse_args(["--only", "nodes,gpus"])
    assert smoke.parse_args(["--only", "trainers, nodes"]).steps == ["trainers", "nodes"]


def test_perf_for_some_nodes_only():
    """make upgrade's check measures the node it upgraded (--nodes); a baseline measures them all."""
    assert smoke.parse_args(["--only", "perf", "--nodes", "node-3, node-2"]).nodes == ["node-3", "node-2"]
    assert smoke.parse_args([]).nodes is None
    with pytest.raises(UserError, match="--nodes is empty"):
        smoke.parse_args(["--nodes", " ,"])
    with pytest.raises(UserError, match="a baseline measures every node and link; leave --nodes out"):
        smoke.parse_args(["--record-baseline", "--nodes", "node-2"])


def args(*argv):
    return smoke.parse_args(list(argv))


def test_flags_and_their_defaults():
    a = args()
    assert a.steps == list(lib.STEPS) == ["nodes", "allreduce", "perf", "trainers", "proxyjump"]
    assert (a.record_baseline, a.quarantine, a.thresholds.max_step_slowdown) == (False, False, 0.25)
    assert args("--record-baseline").steps == ["allreduce", "perf"]
    assert args("--record-baseline", "--only", "nodes,allreduce,perf").steps == ["nodes", "allreduce", "perf"]
    with pytest.raises(UserError, match="--record-baseline with --only nodes: the baseline is the perf"):
        args("--record-baseline", "--only", "nodes")
    with pytest.raises(UserError, match=r"bad threshold: min_link_fraction: Input should be less than or eq"):
        args("--min-link-fraction", "1.5")
    assert (a.config, a.json, a.storage_path, a.models_dir, a.clean, a.timeout_factor) == \
        (None, None, None, None, False, 1.0)
    a = args("--config", "/c/cluster.json", "--json", "/r.json", "--storage-path", "/s", "--models-dir",
             "/m", "--clean", "--timeout-factor", "2.5", "--only", "proxyjump")
    assert (a.config, a.json, a.storage_path, a.models_dir, a.clean, a.timeout_factor, a.steps) == \
        ("/c/cluster.json", "/r.json", "/s", "/m", True, 2.5, ["proxyjump"])
    with pytest.raises(UserError, match="--timeout-factor 0.0 must be above 0"):
        args("--timeout-factor", "0")
    with pytest.raises(UserError, match=r"unknown step\(s\) \(none given\)"):
        args("--only", ",")


def test_reading_the_record(tmp_path):
    path = tmp_path / "cluster.json"
    with pytest.raises(UserError, match=f"no cluster record at {re.escape(str(path))}: no cluster is up"):
        smoke.load_record(path)
    path.write_text(local_rec().model_dump_json())
    r = smoke.load_record(path)
    assert isinstance(r, record.ClusterRecord) and r == local_rec()
    assert (r.name, r.kind, len(r.nodes), r.job_api) == ("local", "local", 2, "http://127.0.0.1:8265")
    path.write_text("{")
    with pytest.raises(UserError, match="cannot read the cluster record"):
        smoke.load_record(path)
    path.write_text(json.dumps({**local_rec().model_dump(), "nodes": "two"}))
    with pytest.raises(UserError, match="bad cluster record"):
        smoke.load_record(path)


def test_token_must_exist(tmp_path):
    r = local_rec(token_path=str(tmp_path / "ray_token"))
    with pytest.raises(UserError, match="does not exist; run make cluster-up first"):
        lib.check_token(r, tmp_path / "cluster.json")
    (tmp_path / "ray_token").write_text("x")
    lib.check_token(r, tmp_path / "cluster.json")


def test_local_cluster_record_lifecycle(tmp_path, monkeypatch):
    monkeypatch.setattr(local_cluster, "CONFIG", tmp_path)
    monkeypatch.setattr(local_cluster, "LOCAL", tmp_path / "clusters" / "local")
    st = {"dashboard": "http://127.0.0.1:8290", "nodes": 2, "cpus_per_node": 1}
    local_cluster.the_record(st).write(tmp_path)
    written = json.loads((tmp_path / "cluster.json").read_text())
    assert written["job_api"] == "http://127.0.0.1:8290"
    assert written["token_path"] == str(tmp_path / "clusters" / "local" / "ray_token")
    local_cluster.forget({**st, "dashboard": "http://127.0.0.1:8265"})  # another one's
    assert (tmp_path / "cluster.json").exists()
    local_cluster.forget(st)
    assert not (tmp_path / "cluster.json").exists() and not (tmp_path / "ray-client.env").exists()
    (tmp_path / "cluster.json").write_text(remote_rec(job_api=st["dashboard"]).model_dump_json())
    local_cluster.forget(st)  # an Ansible cluster's record stays
    assert (tmp_path / "cluster.json").exists()


# ------------------------------------------------------------------ node matching
def ray_node(cpus, gpus, ip="192.0.2.2", head=False, **more):
    return {"ip": ip, "cpus": cpus, "gpus": gpus, "head": head, "hostname": "h", "node_id": "ab" * 28,
            "agent": True, "task": {"hostname": "h"}, **more}


def test_local_nodes_match_as_multisets():
    actual = [ray_node(1, 0, head=True), ray_node(1, 0)]
    assert lib.match_nodes(local_rec().nodes, actual) == []


def test_three_described_two_alive():
    problems = lib.match_nodes(local_rec(nodes=3).nodes, [ray_node(1, 0, head=True), ray_node(1, 0)])
    assert problems == ["2 Ray node(s) alive, the cluster record lists 3",
                        "1 node(s) with 1 CPU(s) and 0 GPU(s) in the cluster record but not found"]


def test_resources_differ_without_ips():
    problems = lib.match_nodes(local_rec().nodes, [ray_node(1, 0, head=True), ray_node(2, 0)])
    assert "1 node(s) with 1 CPU(s) and 0 GPU(s) in the cluster record but not found" in problems
    assert "1 Ray node(s) with 2 CPU(s) and 0 GPU(s) not in the cluster record (at 192.0.2.2)" in problems


def test_nodes_matched_by_ip():
    expected = remote_rec().nodes
    actual = [ray_node(8, 1, "172.31.251.11", head=True), ray_node(8, 1, "172.31.251.12"),
              ray_node(16, 2, "172.31.251.13")]
    assert lib.match_nodes(expected, actual) == []
    actual[2] = ray_node(16, 1, "172.31.251.13")  # a GPU missing
    assert lib.match_nodes(expected, actual) == [
        "node node-3 (172.31.251.13) offers 16 CPU(s) and 1 GPU(s), the cluster record says 16 and 2"]
    actual[2] = ray_node(16, 2, "172.31.251.99")  # another machine joined instead
    assert lib.match_nodes(expected, actual) == [
        "node node-3 (172.31.251.13) has not joined",
        "1 Ray node(s) with 16 CPU(s) and 2 GPU(s) not in the cluster record (at 172.31.251.99)"]


def test_head_must_be_the_described_one():
    expected = remote_rec().nodes
    actual = [ray_node(8, 1, "172.31.251.11"), ray_node(8, 1, "172.31.251.12", head=True),
              ray_node(16, 2, "172.31.251.13")]
    problems = lib.match_nodes(expected, actual)
    assert "node node-1 (172.31.251.11) is not the Ray head, the cluster record says head" in problems
    assert "node node-2 (172.31.251.12) is the Ray head, the cluster record says worker" in problems


def test_agents_and_pinned_tasks():
    nodes = [ray_node(1, 0, head=True), ray_node(1, 0, agent=False, task=None)]
    problems = lib.node_problems({"nodes": nodes, "probe_timeout_s": 60}, local_rec().nodes)
    assert any("dashboard agent has not registered" in p for p in problems)
    assert any("did not finish within 60 s" in p for p in problems)
    nodes[1].update(agent=True, task={"error": "RuntimeError: boom"})
    problems = lib.node_problems({"nodes": nodes}, local_rec().nodes)
    assert problems[0].endswith("a task pinned to it failed: RuntimeError: boom")


def test_a_process_that_ran_an_installed_harness_instead_of_the_upload_is_named():
    upload = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0f1e"
    nodes = [ray_node(1, 0, head=True), ray_node(1, 0)]
    for n in nodes:
        n["task"] = {"harness": f"{upload}/trainkit", "working_dir": upload}
    payload = {"nodes": nodes, "driver": {"harness": f"{upload}/trainkit", "working_dir": upload}}
    assert lib.node_problems(payload, local_rec().nodes) == []
    nodes[1]["task"]["harness"] = "/opt/dlcluster/trainkit"  # the image's copy first on the path
    payload["driver"]["harness"] = "/work/checkout/trainkit"
    (driver, node) = lib.node_problems(payload, local_rec().nodes)
    assert driver == (f"the driver: it imported the harness from /work/checkout/trainkit, not from the "
                      f"job's upload ({upload}): an installed copy shadows the code submitted "
                      "(PYTHONPATH, or a .pth file before it)")
    assert "it imported the harness from /opt/dlcluster/trainkit, not from the job's upload" in node


# ------------------------------------------------------------------ trainers
@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7, 8, 16, 32, 64])
def test_trainer_flags_give_every_worker_a_whole_batch(workers):
    def flag(args, name):
        return int(args[args.index(name) + 1])

    ae = lib.trainer_args("ddp_autoencoder", workers, False)
    train, _ = data.split_indices(flag(ae, "--limit"), 0.1)
    check_batch(flag(ae, "--batch-size"), len(train), workers)
    hvd = lib.trainer_args("horovod_mnist", workers, False)
    check_batch(flag(hvd, "--batch-size"), mnist.BUILTIN_TRAIN, workers)
    tf = lib.trainer_args("tf_cnn", workers, True)
    train, val = data.split_indices(2 * flag(tf, "--per-class"), 0.2)
    check_batch(flag(tf, "--batch-size"), len(train), workers)
    assert len(val) >= workers  # the tf job's own check
    assert flag(tf, "--num-workers") == workers and tf[tf.index("--use-gpu") + 1] == "true"
    lm = lib.trainer_args("finetune_lm", workers, False)
    train, val = data.split_indices(flag(lm, "--limit") // 128, 0.05)  # blocks of --block-size's 128
    check_batch(flag(lm, "--batch-size"), len(train), workers)
    assert flag(ae, "--epochs") == flag(hvd, "--epochs") == flag(tf, "--epochs") == flag(lm, "--epochs") == 1


def test_model_paths_and_payload_from_logs():
    logs = "\n".join([
        "(RayTrainWorker pid=1) [ddp_autoencoder] epoch 1/1: loss 0.1",
        "[ddp_autoencoder] ONNX model: /srv/dlcluster/models/smoke-x/model.onnx",
        "[ddp_autoencoder] manifest:   /srv/dlcluster/models/smoke-x/manifest.json",
        "(pid=2) SMOKE_JSON {\"a\": 1}",
        "SMOKE_JSON {\"a\": 2}",
        "------------------------------------------",
        "Job 'x' succeeded",
    ])
    assert lib.parse_payload(logs) == {"a": 2}
    assert lib.parse_payload("SMOKE_JSON {broken") is None
    assert lib.parse_payload("") is None


# ------------------------------------------------------------------ report and summary
def allreduce_result(n=2):
    rows = []
    for size in (2**20, 2**28):
        algbw, busbw = smoke_checks.bandwidth(size, size / 1e9, n)
        rows.append({"bytes": size, "count": size // 4, "type": "float", "redop": "sum",
                     "time_us": size / 1e3, "algbw_gbs": algbw, "busbw_gbs": busbw, "wrong": 0})
    return {"name": "allreduce", "ok": True, "skipped": False, "seconds": 20.0,
            "details": {"backend": "gloo", "world_size": n, "nodes_used": n,
                        "placement_strategy": "STRICT_SPREAD", "rows": rows}}


def test_report_and_summary():
    steps = [
        {"name": "nodes", "ok": True, "skipped": False, "seconds": 5.0,
         "details": {"alive": 2, "expected": 2, "agents": 2, "cpus": [1, 1], "gpus": [0, 0]}},
        allreduce_result(),
        {"name": "trainers", "ok": False, "skipped": False, "seconds": 90.0,
         "details": {"error": "tf_cnn: failed after 30 s"}},
        {"name": "proxyjump", "ok": False, "skipped": True, "seconds": 0.0,
         "details": {"reason": "no bastion"}},
    ]
    import datetime as dt

    report = smoke_report.build_report(local_rec(), Path("/c/cluster.json"), steps,
                                dt.datetime(2026, 1, 1, tzinfo=dt.UTC), 115.04)
    assert (report["ok"], report["passed"], report["failed"], report["skipped"]) == (False, 2, 1, 1)
    assert report["cluster"] == "local" and report["seconds"] == 115.0 and report["nodes"] == 2
    assert [s["name"] for s in report["steps"]] == ["nodes", "allreduce", "trainers", "proxyjump"]
    json.dumps(report)  # serialisable as it is
    lines = smoke_report.summary(report, Path("/c/smoke/local.json"))
    assert lines[1].split()[:2] == ["PASS", "nodes"] and "2/2 nodes alive" in lines[1]
    assert lines[2].split()[:2] == ["PASS", "allreduce"] and "256 MiB" in lines[2]
    assert lines[3].split()[:2] == ["FAIL", "trainers"] and "tf_cnn: failed" in lines[3]
    assert lines[4].split()[:2] == ["SKIP", "proxyjump"] and "no bastion" in lines[4]
    table = [line for line in lines if line.strip().startswith(("1048576", "268435456"))]
    assert len(table) == 2 and table[1].split()[:4] == ["268435456", "67108864", "float", "sum"]
    assert [float(v) for v in table[1].split()[5:8]] == pytest.approx([1.0, 1.0, 0])  # algbw busbw #wrong
    assert lines[-1] == "smoke: FAIL: 2 passed, 1 failed, 1 skipped in 115 s; report /c/smoke/local.json"
    steps[2] = {**steps[2], "ok": False, "skipped": True}
    assert smoke_report.build_report(local_rec(), Path("x"), steps, dt.datetime.now(dt.UTC), 1)["ok"]


# ------------------------------------------------------------------ proxyjump
def test_proxyjump_skipped_without_bastion():
    assert "the cluster record has no ssh_config and bastion (kind local)" in \
        lib.proxyjump_skip_reason(local_rec())
    r = remote_rec()
    assert lib.proxyjump_skip_reason(r) is None
    no_ips = remote_rec(nodes=[n.model_copy(update={"ip": None}) for n in r.nodes])
    assert "no node in the cluster record has an ip" in lib.proxyjump_skip_reason(no_ips)


@pytest.fixture
def listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_direct_tcp(listener):
    assert lib.direct_tcp("127.0.0.1", listener, 3) == (True, "connected")
    connected, how = lib.direct_tcp("127.0.0.1", closed_port(), 3)
    assert not connected and "refused" in how.lower()


@pytest.fixture
def ssh_config(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("\n".join([
        "Host bastion", "  HostName 127.0.0.1", "  User ops",
        "Host node-1", "  HostName 127.0.0.1", "  ProxyJump bastion",
        "Host node-2", "  HostName 172.31.251.12", "  ProxyJump ops@bastion:2222",
        "Host node-3", "  HostName 172.31.251.13", "  ProxyCommand ssh -F /x -W %h:%p bastion",
        "Host node-4", "  HostName 172.31.251.14",
        "Host node-5", "  HostName 172.31.251.15", "  ProxyJump other",
        "",
    ]))
    return str(cfg)


needs_ssh = pytest.mark.skipif(not shutil.which("ssh"), reason="no ssh client (ssh -G reads the configs)")


@needs_ssh
def test_ssh_route_reads_the_config_without_connecting(ssh_config):
    assert lib.ssh_route(ssh_config, "node-1", "bastion")[0]
    ok, info = lib.ssh_route(ssh_config, "node-2", "bastion")
    assert ok and info["hostname"] == "172.31.251.12"
    assert lib.ssh_route(ssh_config, "node-3", "bastion")[0]
    assert not lib.ssh_route(ssh_config, "node-4", "bastion")[0]  # straight to the node
    assert not lib.ssh_route(ssh_config, "node-5", "bastion")[0]  # through another host


@pytest.fixture
def fake_ssh(tmp_path):
    """`ssh -G` is the real one (it only reads the config); a login prints the host's name."""
    script = tmp_path / "ssh"
    script.write_text('#!/bin/sh\nif [ "$1" = -G ]; then exec ssh "$@"; fi\n'
                      'for last; do :; done\n[ "$last" = hostname ] && echo "$FAKE_SSH_NAME" '
                      '&& exit "${FAKE_SSH_RC:-0}"\nexit 255\n')
    script.chmod(0o755)
    return str(script)


@needs_ssh
def test_node_behind_the_bastion_passes(ssh_config, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_NAME", "node-1")
    r = lib.check_node_proxyjump(a_node("node-1"), ssh_config, "bastion",
                                 port=closed_port(), ssh=fake_ssh)
    assert r["ok"], r["problems"]
    assert not r["direct"]["connected"] and r["ssh"] == {"ok": True, "output": "node-1"}


@needs_ssh
def test_node_reachable_directly_fails(ssh_config, fake_ssh, listener, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_NAME", "node-1")
    r = lib.check_node_proxyjump(a_node("node-1"), ssh_config, "bastion",
                                 port=listener, ssh=fake_ssh)
    assert not r["ok"]
    assert r["problems"] == [f"127.0.0.1:{listener} accepts a direct connection from here: the bastion "
                             f"is not the only way in"]


@needs_ssh
def test_ssh_through_the_bastion_must_work(ssh_config, fake_ssh, monkeypatch):
    monkeypatch.setenv("FAKE_SSH_RC", "255")
    r = lib.check_node_proxyjump(a_node("node-1"), ssh_config, "bastion",
                                 port=closed_port(), ssh=fake_ssh)
    assert not r["ok"] and len(r["problems"]) == 1
    assert "-o BatchMode=yes -o ConnectTimeout=15 node-1 hostname` failed" in r["problems"][0]


@needs_ssh
def test_node_not_routed_through_the_bastion_fails(ssh_config, fake_ssh):
    # The configs' 172.31.x addresses are only read (ssh -G); every connection goes to loopback.
    r = lib.check_node_proxyjump(a_node("node-4"), ssh_config, "bastion",
                                 port=closed_port(), ssh=fake_ssh)
    assert any("does not send node-4 through bastion" in p for p in r["problems"])
    r = lib.check_node_proxyjump(a_node("node-2"), ssh_config, "bastion",
                                 port=closed_port(), ssh=fake_ssh)
    assert "sends node-2 to 172.31.251.12, the cluster record says 127.0.0.1" in " ".join(r["problems"])


# ------------------------------------------------------------------ the command line
def run_smoke(tmp_path, *argv):
    env = {**os.environ, "DLC_CONFIG": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "dlcluster", "smoke", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def nothing_ran(proc, tmp_path) -> bool:
    """No step started: no progress line, no report."""
    return proc.stdout == "" and not (tmp_path / "smoke").exists()


def test_no_record_is_one_line_and_exit_2(tmp_path):
    proc = run_smoke(tmp_path)
    assert proc.returncode == 2 and nothing_ran(proc, tmp_path)
    assert proc.stderr.strip() == (f"smoke: error: no cluster record at {tmp_path / 'cluster.json'}: "
                                   f"no cluster is up from here; run make cluster-up first")


@pytest.mark.parametrize("argv, says", [
    (["--only", "nodes,gpus"], "smoke: error: --only 'nodes,gpus': unknown step(s) gpus; use some of "
                               "nodes,allreduce,perf,trainers,proxyjump"),
    (["--sizes", "big"], "smoke: error: --sizes 'big' must be numbers of MiB, e.g. 1,4,16"),
    (["--max-mib", "0.1"], "smoke: error: no all-reduce size left from --sizes 1,4,16,64,256 with "
                           "--max-mib 0.1; raise --max-mib"),
    (["--timeout-factor", "-1"], "smoke: error: --timeout-factor -1.0 must be above 0"),
])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, argv, says):
    proc = run_smoke(tmp_path, *argv)
    assert (proc.returncode, proc.stderr.strip()) == (2, says) and nothing_ran(proc, tmp_path)


def test_a_bad_record_or_token_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "cluster.json").write_text("{")
    proc = run_smoke(tmp_path)
    assert proc.returncode == 2 and nothing_ran(proc, tmp_path)
    assert proc.stderr.startswith(f"smoke: error: cannot read the cluster record {tmp_path / 'cluster.json'}")
    assert len(proc.stderr.strip().splitlines()) == 1
    r = local_rec(token_path=str(tmp_path / "ray_token"))
    (tmp_path / "cluster.json").write_text(r.model_dump_json())
    proc = run_smoke(tmp_path)
    assert proc.returncode == 2 and nothing_ran(proc, tmp_path)
    assert proc.stderr.strip() == (f"smoke: error: the Ray token {tmp_path / 'ray_token'} (token_path in "
                                   f"{tmp_path / 'cluster.json'}) does not exist; run make cluster-up "
                                   f"first, or fix token_path")


def test_no_job_api_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "ray_token").write_text("t")
    r = local_rec(job_api=f"http://127.0.0.1:{closed_port()}", token_path=str(tmp_path / "ray_token"))
    (tmp_path / "cluster.json").write_text(r.model_dump_json())
    proc = run_smoke(tmp_path, "--only", "nodes")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"nothing answers on the job API {r.job_api}" in proc.stderr
    assert "run make cluster-up first" in proc.stderr
    assert nothing_ran(proc, tmp_path)


def test_proxyjump_alone_needs_no_job_api_and_reports(tmp_path):
    (tmp_path / "ray_token").write_text("t")
    r = local_rec(job_api=f"http://127.0.0.1:{closed_port()}", token_path=str(tmp_path / "ray_token"))
    (tmp_path / "cluster.json").write_text(r.model_dump_json())
    proc = run_smoke(tmp_path, "--only", "proxyjump")
    assert proc.returncode == 0, proc.stderr
    reports = list((tmp_path / "smoke").glob("local-*.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["ok"] and report["skipped"] == 1 and report["steps"][0]["skipped"]
    assert "SKIP proxyjump" in proc.stdout and f"report {reports[0]}" in proc.stdout
    assert any(line.split()[:3] == ["[smoke]", "SKIP", "proxyjump"] and "s  the cluster record has no "
               "ssh_config and bastion (kind local)" in line for line in proc.stdout.splitlines())
    assert proc.stdout.splitlines()[-1].startswith("smoke: PASS: 0 passed, 0 failed, 1 skipped in ")


def test_a_head_without_cpus_takes_no_worker():
    r = remote_rec()
    r.nodes[0].cpus = 0
    ctx = lib.Context(r, args(), None)
    assert (ctx.workers, ctx.left_out, ctx.use_gpu) == (2, ["node-1"], True)
    r.nodes[2].gpus = 0
    assert not ctx.use_gpu  # NCCL only when every worker node has a GPU
    for n in r.nodes:
        n.cpus = 0
    with pytest.raises(pytest.fail.Exception, match="no node in the cluster record offers a CPU"):
        ctx.need_workers()


def test_the_trainers_run_together_as_far_as_the_smallest_node_holds_one_worker_of_each():
    r = remote_rec()
    ctx = lib.Context(r, args(), None)
    for n in r.nodes:  # GPU nodes: a GPU per worker, whatever the CPUs
        n.cpus, n.gpus = 16, 8
    assert ctx.use_gpu and ctx.trainers_at_once == len(lib.TRAINERS)  # all four at once
    r.nodes[1].gpus = 1
    assert ctx.trainers_at_once == 1  # one after the other: a node has room for one worker
    for n in r.nodes:  # CPU nodes (the emulated cluster's: 2 CPUs each): two at once
        n.cpus, n.gpus = 2, 0
    assert not ctx.use_gpu and ctx.trainers_at_once == 2
    r.nodes[0].cpus = 0  # a head that takes no worker does not count
    assert ctx.trainers_at_once == 2
    two = lib.Context(r, args("--trainers", "tf_cnn,horovod_mnist"), None)
    assert two.trainers == ["horovod_mnist", "tf_cnn"] and two.trainers_at_once == 2  # one round
    for n in r.nodes:
        n.cpus = 3
    assert ctx.trainers_at_once == 3 and two.trainers_at_once == 2


def test_trainers_names_some_of_the_four_jobs_or_is_one_line():
    assert args().trainers == list(lib.TRAINERS)
    for bad, said in (("tf_cnn,resnet", "unknown job(s) resnet"), (",", "unknown job(s) (none given)")):
        with pytest.raises(UserError, match=re.escape(said) + ".*use some of ddp_autoencoder,horovod_mnist"):
            args("--trainers", bad)


def test_clean_removes_a_smoke_runs_model_folder_and_run_folder(tmp_path):
    """--clean after a passing check: the smoke run's <output> (with its publications) and its
    Ray Train run folder go; nothing named otherwise is touched."""
    import torch

    from trainkit.onnx_export import export_torch, verify_and_publish

    name = "smoke-ddp-autoencoder-x"
    output, storage = tmp_path / "models" / name, tmp_path / "runs"
    (storage / name).mkdir(parents=True)
    (storage / "other-run").mkdir()
    model = torch.nn.Conv2d(3, 3, 1).eval()
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(x).numpy()
    published = verify_and_publish(
        export_torch(model, x, output), output, job="ddp_autoencoder", framework="torch",
        inputs=x.numpy(), reference=ref, metrics={}, world_size=1,
        extra={"run": {"name": name, "storage_path": str(storage)}})
    out = smoke_checks.check_model("ddp_autoencoder", published.model, published.manifest_path, 1, clean=True)
    assert out["ok"], out["problems"]
    assert sorted(out["removed"]) == sorted([str(output), str(storage / name)])
    assert not output.exists() and not (storage / name).exists() and (storage / "other-run").exists()


# ------------------------------------------------------------------ the report plugin, in a real pytest run
FAKE_SUITE = """
import pytest


def test_nodes(details):
    details.update(alive=2, expected=2, agents=2, cpus=[1, 1], gpus=[0, 0])
    print("nodes: working")


def test_allreduce(details, request):
    details["limit"] = request.node.get_closest_marker("timeout").args[0]
    details["log_tail"] = ["a", "b"]
    pytest.fail("2 wrong elements")


def test_trainers(details):
    details["jobs"] = {}
    raise KeyError("rows")


def test_proxyjump(details):
    details["never"] = "kept"
    pytest.skip("nothing to do")
"""


def fake_run(tmp_path, capsys, steps=None, suite=FAKE_SUITE, name="test_fake_steps"):
    """dlcluster/smoke/run.py's run_suite on a fake suite: (pytest's exit code, the plugin, stdout lines)."""
    path = tmp_path / f"{name}.py"
    path.write_text(suite)
    plugin = smoke_report.SmokeReport(local_rec(), Path("/c/cluster.json"), tmp_path / "out" / "report.json",
                                steps=steps, limits={"nodes": 10, "allreduce": 20}, hard_after=5)
    code = smoke.run_suite(lib.Context(local_rec(), args(), None), plugin, suite=path)
    return code, plugin, capsys.readouterr().out.splitlines()


def test_the_plugin_turns_a_pytest_run_into_the_report(tmp_path, capsys):
    code, plugin, out = fake_run(tmp_path, capsys, name="test_fake_all")
    assert code == 1  # pytest's: a test failed
    steps = {s["name"]: s for s in plugin.results}
    assert list(steps) == ["nodes", "allreduce", "trainers", "proxyjump"]  # the file's order
    for s in steps.values():
        assert set(s) == {"name", "ok", "skipped", "seconds", "details"} and s["seconds"] >= 0
    assert steps["nodes"]["ok"] and not steps["nodes"]["skipped"]
    assert steps["nodes"]["details"] == {"alive": 2, "expected": 2, "agents": 2, "cpus": [1, 1],
                                         "gpus": [0, 0]}
    failed = steps["allreduce"]
    assert not failed["ok"] and not failed["skipped"]
    # the failure's message is the error; what the test put in details stays (pytest-timeout's
    # marker: the step's limit plus hard_after)
    assert failed["details"] == {"error": "2 wrong elements", "limit": 25, "log_tail": ["a", "b"]}
    crashed = steps["trainers"]  # any other exception: its type and text
    assert not crashed["ok"] and crashed["details"] == {"error": "KeyError: 'rows'", "jobs": {}}
    skipped = steps["proxyjump"]
    assert skipped["skipped"] and not skipped["ok"] and skipped["details"] == {"reason": "nothing to do"}

    # the report on disk, as build_report makes it
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert written == plugin.report
    assert (written["ok"], written["passed"], written["failed"], written["skipped"]) == (False, 1, 2, 1)
    assert (written["cluster"], written["description"], written["nodes"]) == ("local", "/c/cluster.json", 2)
    assert written["steps"] == plugin.results

    # the printed lines: progress, each step's verdict as it ends, the job's log tail, the summary
    # (and nothing of pytest's own but one blank line before the summary)
    assert out[:3] == ["[smoke] nodes: starting (limit 10 s)", "nodes: working",
                       out[2]] and out[2].startswith("[smoke] PASS nodes  ")
    assert "2/2 nodes alive, 2 agents, CPUs [1, 1], GPUs [0, 0]" in out[2]
    assert out[3] == "[smoke] allreduce: starting (limit 20 s)"
    assert out[4].split()[:3] == ["[smoke]", "FAIL", "allreduce"] and out[4].endswith("s  2 wrong elements")
    assert out[5:8] == ["[smoke] allreduce: the job's last 2 log lines:", "    a", "    b"]
    assert out[8] == "[smoke] trainers: starting"  # no limit given for it
    assert out[9].split()[:3] == ["[smoke]", "FAIL", "trainers"] and out[9].endswith("KeyError: 'rows'")
    assert out[10] == "[smoke] proxyjump: starting"
    assert out[11].split()[:3] == ["[smoke]", "SKIP", "proxyjump"] and out[11].endswith("nothing to do")
    assert out[12] == ""
    assert out[13] == "smoke tests of cluster local (local, 2 node(s), job API http://127.0.0.1:8265):"
    assert [line.split()[:2] for line in out[14:18]] == [
        ["PASS", "nodes"], ["FAIL", "allreduce"], ["FAIL", "trainers"], ["SKIP", "proxyjump"]]
    assert out[18].startswith("smoke: FAIL: 1 passed, 2 failed, 1 skipped in ")
    assert out[18].endswith(f" s; report {tmp_path / 'out' / 'report.json'}")
    assert len(out) == 19


def test_the_plugin_runs_only_the_chosen_steps_in_the_files_order(tmp_path, capsys):
    code, plugin, out = fake_run(tmp_path, capsys, steps=["proxyjump", "nodes"], name="test_fake_some")
    assert code == 0 and plugin.report["ok"]
    assert [s["name"] for s in plugin.results] == ["nodes", "proxyjump"]
    assert (plugin.report["passed"], plugin.report["failed"], plugin.report["skipped"]) == (1, 0, 1)
    assert out[-1].startswith("smoke: PASS: 1 passed, 0 failed, 1 skipped in ")
    assert not any("allreduce" in line or "trainers" in line for line in out)


def test_a_suite_that_does_not_load_fails_the_run(tmp_path, capsys):
    code, plugin, out = fake_run(tmp_path, capsys, suite="import no_such_module_here\n",
                                 name="test_fake_broken")
    assert code != 0 and plugin.results == [] and not plugin.interrupted
    assert not plugin.report["ok"] and "did not load" in plugin.report["error"]
    assert any("No module named 'no_such_module_here'" in line for line in out)
    assert any(line.startswith("smoke: FAIL: 0 passed, 0 failed, 0 skipped") for line in out)


def test_pytest_timeout_stops_a_step_past_its_limit(tmp_path, capsys):
    suite = "import time\n\n\ndef test_nodes(details):\n    details['waited'] = True\n    time.sleep(30)\n"
    path = tmp_path / "test_fake_slow.py"
    path.write_text(suite)
    plugin = smoke_report.SmokeReport(local_rec(), Path("/c/cluster.json"), tmp_path / "report.json",
                                      limits={"nodes": 0.5}, hard_after=0.5)
    smoke.run_suite(lib.Context(local_rec(), args(), None), plugin, suite=path)
    [step] = plugin.results
    assert not step["ok"] and step["seconds"] < 10
    assert step["details"]["waited"] and "Timeout (>1.0s) from pytest-timeout" in step["details"]["error"]
