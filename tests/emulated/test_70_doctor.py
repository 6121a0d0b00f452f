"""make doctor and the run lock: one run name held between the head and a worker, a healthy
cluster, six faults each named on its node, quarantine and release, a node slowed against its
baseline."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    BIN,
    INVENTORY,
    NODES,
    PORT,
    REPO,
    run,
)
from helpers import TLS

pytestmark = pytest.mark.timeout(1800)


def doctor(emulated) -> tuple[subprocess.CompletedProcess, dict, list[str]]:
    """make doctor on the cluster: its run, its report and its finding lines."""
    proc = run([str(BIN / "python"), "-m", "dlcluster.doctor"], emulated.env, timeout=300)
    report = json.loads((emulated.cluster_dir / "doctor.json").read_text())
    lines = [line for line in proc.stdout.splitlines()
             if re.match(r"doctor: node-\d: ", line) and not re.search(r" answered \([\d.]+ s\)$", line)]
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    return proc, report, lines


# one rank of a run, as the harness holds its run's folder (trainkit/store.py's hold_run, the
# checkout's, copied to the node): held until its stdin closes, or the one line of a refusal
LOCKER = ("import sys\n"
          "sys.path.insert(0, '/tmp/dlc-lock')\n"
          "from trainkit.errors import UserError\n"
          "from trainkit.store import hold_run\n"
          "try:\n"
          "    with hold_run('/srv/dlcluster/runs', sys.argv[1]):\n"
          "        print('held', flush=True)\n"
          "        sys.stdin.read()\n"
          "except UserError as e:\n"
          "    print(e, flush=True)\n")


def test_one_run_name_is_held_between_the_head_and_a_worker(emulated):
    """Two runs of one --name, a rank on the head and one on node-2, on the shared storage:
    whichever holds the run's folder first, the other is refused with the one line naming the
    holder, so the two never train and publish under one name. (The emulated nodes share a docker
    volume, not NFS, where an flock on the head never saw a worker's lock: the unit tier's
    test_run_lock.py holds the folder with the POSIX lock an NFS server takes for its clients.)"""
    docker, name = "/usr/bin/docker", f"lock-{int(time.time())}"
    for node in ("node-1", "node-2"):
        run([docker, "exec", f"dlc-emu-{node}", "sh", "-c", "rm -rf /tmp/dlc-lock && mkdir /tmp/dlc-lock"],
            emulated.env, check=True)
        run([docker, "cp", str(REPO / "trainkit"), f"dlc-emu-{node}:/tmp/dlc-lock/trainkit"], emulated.env,
            check=True)

    # as Ray's account (the inventory's dlc_ray_user), the owner of the runs folder
    account = run([docker, "exec", "dlc-emu-node-1", "stat", "-c", "%U", "/srv/dlcluster/runs"], emulated.env,
                  check=True).stdout.strip()

    def rank(node: str, *flags: str) -> list[str]:
        return [docker, "exec", *flags, "-u", account, f"dlc-emu-{node}", "/opt/venv/bin/python", "-c",
                LOCKER, name]

    try:
        for first, second in (("node-1", "node-2"), ("node-2", "node-1")):
            holder = subprocess.Popen(rank(first, "-i"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
            try:
                assert holder.stdout.readline().strip() == "held", f"{first} did not get the run's folder"
                said = run(rank(second), emulated.env, timeout=120)
                host = emulated.ssh(first, "hostname").stdout.strip()
                assert re.fullmatch(rf"run {name} is running already \({re.escape(host)} pid \d+ since "
                                    r"\S+Z\): wait for it to end, or give this one another --name",
                                    said.stdout.strip()), f"{second}: {said.stdout}{said.stderr}"
            finally:
                holder.stdin.close()  # the holder leaves: the lock goes with it
                holder.wait(timeout=60)
    finally:
        run([docker, "exec", "dlc-emu-node-1", "rm", "-rf", f"/srv/dlcluster/runs/{name}"], emulated.env)
        for node in ("node-1", "node-2"):
            run([docker, "exec", f"dlc-emu-{node}", "rm", "-rf", "/tmp/dlc-lock"], emulated.env)


def test_doctor_finds_nothing_on_the_healthy_cluster(emulated):
    proc, report, lines = doctor(emulated)
    assert proc.returncode == 0 and lines == [] and report["findings"] == [], proc.stdout + proc.stderr
    answered = [line.split()[1] for line in proc.stdout.splitlines() if " answered (" in line]
    assert sorted(answered) == sorted(NODES) and set(report["nodes"]) == set(NODES)
    assert report["seconds"] < 60
    assert proc.stdout.splitlines()[-1].startswith("doctor: 3 nodes, 0 finding(s) in ")


ANOTHER_RAY = "2.58.0"  # not the lock's


def test_doctor_names_each_fault_on_its_node(emulated, tmp_path):
    """Injected for real: on node-2 Ray's service stopped, its environment's Ray distribution
    saying it is another version (its METADATA's `Version:`, what the probe reads, as after an
    install of another Ray; nothing fetched from PyPI), the shared storage unmounted; on node-3 the
    collective interface set to one it lacks, the token made world-readable and Ray's TLS
    certificate replaced by a self-signed one. One run names each on its node, nothing on node-1;
    put back, the next run finds nothing."""
    def as_root(node: str, script: str):
        return emulated.ssh(node, f"sudo sh -c {shlex.quote(script)}", timeout=300)
    meta = as_root("node-2", "/opt/venv/bin/python -c 'from importlib.metadata import distribution as d; "
                   "print(next(f.locate() for f in d(\"ray\").files if f.name == \"METADATA\"))'"
                   ).stdout.strip()
    assert meta.startswith("/opt/venv/") and meta.endswith(".dist-info/METADATA"), meta
    keep, iface = "/var/tmp/doctor-keep", "s/^GLOO_SOCKET_IFNAME=.*/GLOO_SOCKET_IFNAME={}/"
    try:
        as_root("node-2", f"systemctl stop dlc-ray && mkdir -p {keep}/mnt && cp -p {meta} {keep}/METADATA && "
                f"sed -i 's/^Version: .*/Version: {ANOTHER_RAY}/' {meta} && "
                f"mount --bind /srv/dlcluster {keep}/mnt && umount -l /srv/dlcluster").check_returncode()
        # ray.env and the certificate are kept with their times: put back, they are not newer than
        # Ray's start, which would ask the next cluster-up for a restart
        as_root("node-3", f"cp -p /etc/dlcluster/ray.env {keep}-ray.env && "
                f"sed -i '{iface.format('eth9')}' /etc/dlcluster/ray.env && "
                "chmod 0644 /etc/dlcluster/ray_token && "
                # a certificate of no CA of the cluster's
                f"cp -p {TLS}/node.crt {keep}-node.crt && openssl req -x509 -newkey ec -pkeyopt "
                f"ec_paramgen_curve:P-256 -nodes -days 30 -subj /CN=node-3 -keyout /dev/null "
                f"-out {TLS}/node.crt 2>/dev/null").check_returncode()
        proc, report, lines = doctor(emulated)
    finally:
        as_root("node-2", f"cp -p {keep}/METADATA {meta}; "
                f"mountpoint -q /srv/dlcluster || mount --bind {keep}/mnt /srv/dlcluster; "
                f"umount {keep}/mnt; rm -rf {keep}; systemctl start dlc-ray")
        as_root("node-3", f"mv {keep}-ray.env /etc/dlcluster/ray.env && "
                f"chmod 0640 /etc/dlcluster/ray_token && mv {keep}-node.crt {TLS}/node.crt")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fix = "run make cluster-up again"
    assert lines[:2] == [
        "doctor: node-2: Ray's service dlc-ray is inactive: sudo systemctl restart dlc-ray on node-2 "
        "(journalctl -u dlc-ray says why it stopped)",
        f"doctor: node-2: ray {ANOTHER_RAY}, the head runs 2.60.0: {fix} (it installs the lock's "
        "versions everywhere)"], lines
    assert lines[2].startswith("doctor: node-2: the shared storage is not there: /srv/dlcluster/runs "
                               "(findmnt: / "), lines
    assert lines[3:] == [
        "doctor: node-3: the Ray token is root:raysvc 0644, not root-owned 0640: run make cluster-up "
        "again (it sets owner and mode)",
        "doctor: node-3: Ray's TLS certificate is not the cluster CA's (error 18 at 0 depth lookup: "
        "self-signed certificate): run make cluster-up again (it makes the node a certificate of the "
        "head's CA and restarts Ray there when no job runs)",
        "doctor: node-3: GLOO_SOCKET_IFNAME=eth9 in /etc/dlcluster/ray.env, but its private address "
        f"172.31.251.13 is on eth0: {fix} (it writes the interface holding the private address and "
        "restarts Ray when no job runs)"], lines
    assert {f["node"] for f in report["findings"]} == {"node-2", "node-3"}
    assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())
    proc, report, lines = doctor(emulated)
    assert proc.returncode == 0 and lines == [], proc.stdout


def unit_state(emulated, node: str) -> dict[str, str]:
    """systemd's view of dlc-ray on `node`: its state, and when and how it last checked its condition."""
    shown = emulated.ssh(node, "systemctl show -p ActiveState -p ConditionResult "
                               "-p ConditionTimestampMonotonic dlc-ray").stdout
    return dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)


SPREAD_PROBE = """
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init()
group = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
ray.get(group.ready(), timeout=120)
where = ray.remote(num_cpus=1)(lambda: ray.util.get_node_ip_address())
ips = ray.get([where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
               for i in range(2)])
print("ran on:", " ".join(sorted(ips)))
"""


def test_a_quarantined_node_gets_no_new_job_until_released(emulated):
    """node-2 told to run collectives over an interface it lacks (its Ray keeps running): make
    doctor QUARANTINE=1 names it and takes it out of Ray: the head drains it, it leaves Ray (idle),
    its Ray is stopped and stays down (also when told to start); a job submitted then runs its
    work on node-1 and node-3. Fixed, make unquarantine NODE=node-2 puts it back, and make doctor
    finds nothing."""
    fault = "s/^GLOO_SOCKET_IFNAME=.*/GLOO_SOCKET_IFNAME={}/"
    emulated.ssh("node-2", f"sudo sed -i '{fault.format('eth9')}' /etc/dlcluster/ray.env").check_returncode()
    try:
        proc = run([str(BIN / "python"), "-m", "dlcluster.doctor", "--quarantine"], emulated.env, timeout=300)
        print(proc.stdout[-3000:], proc.stderr[-2000:])
        assert proc.returncode == 1
        assert ("doctor: node-2: quarantined: out of Ray, its Ray stopped and kept down; make unquarantine "
                "NODE=node-2 once it is fixed") in proc.stdout.splitlines()
        alive = emulated.wait_for_nodes(2, timeout=120)
        assert alive == [NODES["node-1"], NODES["node-3"]], alive
        # told to start, systemd checks its unit's condition (ConditionPathExists=!/etc/dlcluster/
        # quarantine): false, so Ray stays down
        checked = unit_state(emulated, "node-2").get("ConditionTimestampMonotonic")
        emulated.ssh("node-2", "sudo systemctl start dlc-ray").check_returncode()
        deadline = time.time() + 60
        while (state := unit_state(emulated, "node-2")).get("ConditionTimestampMonotonic") == checked:
            assert time.time() < deadline, f"systemd did not check dlc-ray's start within 60 s: {state}"
            time.sleep(1)
        assert state.get("ConditionResult") == "no" and state.get("ActiveState") == "inactive", state
        _, report, lines = doctor(emulated)
        assert lines[0].startswith("doctor: node-2: quarantined (make doctor at "), lines
        # make cluster-status asks each node's systemd and the head's Ray: node-2's down, two nodes
        status = run(["make", "-s", "--no-print-directory", "cluster-status"],
                     {**emulated.env, "INVENTORY": str(INVENTORY), "MAKEFLAGS": ""}, timeout=300)
        said = " ".join(status.stdout.split())
        assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-2000:]
        assert all(re.search(f"msg: '?{n}: dlc-ray {state} since ", said) for n, state in (
            ("node-1", "active"), ("node-2", "inactive"), ("node-3", "active"))), said[-3000:]
        assert len(re.findall(r"\b1 node_\w+", said)) == 2, said[-3000:]  # the head's ray status
        # new work lands on the nodes left: a job whose two tasks must run on two nodes
        # (STRICT_SPREAD) runs them on node-1 and node-3 (a training job there proves no more)
        out = run([str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{PORT}", "--",
                   "python", "-c", SPREAD_PROBE], emulated.client_env(), timeout=300).stdout
        print(out[-2000:])
        assert f"ran on: {' '.join(sorted([NODES['node-1'], NODES['node-3']]))}" in out.splitlines() \
            and "succeeded" in out, out[-3000:]
    finally:  # fixed and released also when the test failed: node-2 is not left out of Ray
        emulated.ssh("node-2", f"sudo sed -i '{fault.format('eth0')}' /etc/dlcluster/ray.env")
        proc = run([str(BIN / "python"), "-m", "dlcluster.doctor", "--unquarantine", "node-2"], emulated.env,
                   timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == (
        "doctor: node-2 released: back in Ray (3 of 3 nodes alive)"), proc.stdout + proc.stderr
    pid = emulated.ssh("node-2", "systemctl show -p MainPID --value dlc-ray").stdout.strip()
    again = run([str(BIN / "python"), "-m", "dlcluster.doctor", "--unquarantine", "node-2"], emulated.env,
                timeout=300)  # not quarantined any more: one line, its Ray untouched
    assert again.returncode == 2 and again.stderr == (
        "doctor: error: node-2: it is not quarantined; nothing changed (make doctor lists "
        "quarantined nodes)\n"), again.stdout + again.stderr
    assert emulated.ssh("node-2", "systemctl show -p MainPID --value dlc-ray").stdout.strip() == pid
    proc, report, lines = doctor(emulated)
    assert proc.returncode == 0 and lines == [], proc.stdout


def test_a_slowed_node_is_named_against_its_baseline_quarantined_and_released(emulated, tmp_path):
    """node-2's container gets 0.2 of a CPU (its cgroup's limit, as a noisy neighbour or a
    throttled machine would): make smoke's perf step names it against the baseline the first
    cluster-up recorded (no other node: its links, and the cluster as a whole when the other
    nodes are slowed alike by the tier beside this one), and with --quarantine takes it, and
    only it, out of Ray (as make doctor QUARANTINE=1 does, whose test trains a job on the nodes
    left). Its CPUs given back and released, it rejoins."""
    before = run(["docker", "inspect", "-f", "{{.HostConfig.NanoCpus}}", "dlc-emu-node-2"],
                 emulated.env, check=True).stdout.strip()
    report = tmp_path / "smoke.json"
    # 0.2, not 0.4: the baseline is recorded by the tier's first cluster-up, beside the cluster
    # tier, up to 3.7 times an idle node's step (2026-11-28: 192 ms against 62 ms idle); 0.4 of a
    # CPU made node-2's step 306 ms, under 2x that baseline, and named nothing
    run(["docker", "update", "--cpus", "0.2", "dlc-emu-node-2"], emulated.env, check=True)
    try:
        # a slowdown of 2x, not 25 %, and links at a quarter of their baseline, not 70 %: the other
        # nodes share this machine's 2 cores with the test (CI once saw a link between two others
        # below 70 % of its baseline)
        proc = run([str(BIN / "python"), "-m", "dlcluster.smoke.run", "--only", "perf", "--quarantine",
                    "--json", str(report), "--max-step-slowdown", "1", "--min-storage-fraction", "0.1",
                    "--min-link-fraction", "0.25"], emulated.env, timeout=600)
        print(proc.stdout[-5000:], proc.stderr[-2000:])
        assert proc.returncode == 1
        details = json.loads(report.read_text())["steps"][0]["details"]
        named = [f["node"] for f in details["findings"]]
        # node-1 and node-3 share this machine with the cluster tier's benches: when both were
        # slowed alike (CI saw node-3 at 2.00x its baseline) it is the cluster's finding, not theirs
        assert named[0] == "node-2" and all("node-2" in n or n == "the cluster" for n in named), \
            details["findings"]
        assert details["findings"][0]["what"].startswith("a step of the fixed batch takes "), named
        assert "[smoke] perf: node-2: a step of the fixed batch takes " in proc.stdout
        assert details["quarantine"] == [
            "node-2: quarantined: out of Ray, its Ray stopped and kept down; "
            "make unquarantine NODE=node-2 once it is fixed"], details["quarantine"]
        assert Path(details["plot"]).read_bytes()[:4] == b"\x89PNG"
        # out of Ray as doctor --quarantine takes a node out (the test before this one trains a
        # job on the two left)
        assert emulated.wait_for_nodes(2, timeout=120) == [NODES["node-1"], NODES["node-3"]]
        assert emulated.ssh("node-2", "sudo test -e /etc/dlcluster/quarantine").returncode == 0
    finally:
        try:  # 0: no limit, which docker update takes as "unchanged": every core is the same
            cpus = int(before) / 1e9 if int(before) else os.cpu_count()
            run(["docker", "update", "--cpus", str(cpus), "dlc-emu-node-2"], emulated.env, check=True)
        finally:  # released also when the test failed: node-2 is not left out of Ray
            proc = run([str(BIN / "python"), "-m", "dlcluster.doctor", "--unquarantine", "node-2"],
                       emulated.env, timeout=300)
            for other in ("node-1", "node-3"):  # a wrong quarantine fails this test, not the next ones
                if emulated.ssh(other, "sudo test -e /etc/dlcluster/quarantine").returncode == 0:
                    run([str(BIN / "python"), "-m", "dlcluster.doctor", "--unquarantine", other],
                        emulated.env, timeout=300)
    assert proc.returncode == 0 and "back in Ray (3 of 3 nodes alive)" in proc.stdout, \
        proc.stdout + proc.stderr
    # the later cluster-ups (same servers, other config folders too) recorded no other baseline
    assert len(list((emulated.cluster_dir / "baselines").glob("*.json"))) == 1


