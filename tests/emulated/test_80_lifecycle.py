"""The cluster's life: a node added and removed, make upgrade under a job (a broken image rolled
back)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    INVENTORY,
    NODES,
    run,
)
from helpers import (
    EMULATED,
    PROBE,
    TLS,
    _inventory,
    ask_ray,
    elastic_run,
    held_job,
    job_status,
    member_certs,
    published,
    ray_pids,
    registered,
    stop_run,
    tracking_status,
)

from dlcluster import record

pytestmark = pytest.mark.timeout(1800)


NODE4 = "172.31.251.14"


def test_a_node_added_joins_without_restarting_the_others_and_remove_node_takes_it_out(emulated, tmp_path):
    """A fourth server (a container like the others) added to the inventory: cluster-up provisions it
    and it joins while a job runs; Ray on the three others is not restarted. make remove-node
    NODE=node-4 drains it, stops and disables its Ray, removes the cluster's secrets from it (token,
    TLS key, run-history credentials), and leaves it out of every node's /etc/hosts, the bastion's
    client list and the cluster record; it re-keys the cluster (dlc_remove_node_rekey): a new token
    and CA, Ray restarted on the three, so node-4's token and its certificate and key from before (a
    copy an intruder may have taken) are refused by the GCS. Bad NODE values are one line each
    before anything changes. The same cluster-up forgets node-3's rollback record that names an
    image the node no longer has (left by a ship that failed after its prune), so a failed upgrade
    finds nothing to go back to. (A re-key refused under a running job: test_40's changed-setting
    test.)"""
    make = ["make", "--no-print-directory", "remove-node"]
    for node, says in (("node-1", "NODE=node-1: the head runs Ray's GCS and every job's driver, it "
                                  "cannot be removed"),
                       ("node-9", "NODE=node-9: no worker of that name in "),
                       ("", "remove-node: error: NODE='': name the worker to take out")):
        bad = run([*make, f"NODE={node}"], {**emulated.env, "INVENTORY": str(INVENTORY)}, timeout=300)
        # make's own error line is "make: ***" or, under another make (make test), "make[2]: ***"
        last = [line for line in bad.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)][-1]
        assert bad.returncode != 0 and says in last, bad.stderr[-2000:]
    env = {**emulated.env, "EMULATE_NODES": "node-1 node-2 node-3 node-4"}
    listed = gone = False
    try:
        run(["tests/emulated/emulate.sh", "up"], env, timeout=600, check=True)
        text = EMULATED.replace("          docker_image_from: bastion\n",
                                "          docker_image_from: bastion\n"
                                f"        node-4:\n          ansible_host: {NODE4}\n", 1)
        assert text != EMULATED
        inventory = _inventory(tmp_path, "emulated", text)  # the same cluster (its folder's name)
        pids = ray_pids(emulated)
        # node-3's rollback record as a ship that failed after its prune leaves it: the id of an image
        # the node no longer has (this cluster-up, which ships nothing to node-3, forgets it)
        gone_image = "sha256:" + "0" * 64
        planted = emulated.ssh("node-3", f"echo {gone_image} | sudo tee /etc/dlcluster/image.previous")
        assert planted.returncode == 0, planted.stderr
        listed = True  # from here node-4 may be in the nodes' /etc/hosts, the bastion's list, the record
        with held_job(emulated) as job:  # a node is added while jobs run: nothing restarts under them
            up = emulated.cluster("up", inventory, timeout=1200)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-2000:]
            assert job_status(emulated, job) == "RUNNING"
        assert emulated.ssh("node-3", "sudo test -e /etc/dlcluster/image.previous").returncode != 0
        assert ray_pids(emulated) == pids  # the three went on as they were
        assert sorted(emulated.wait_for_nodes(4)) == sorted([*NODES.values(), NODE4])
        desc = json.loads((emulated.config / "cluster.json").read_text())
        assert "node-4" in [n["name"] for n in desc["nodes"]]
        assert NODE4 in emulated.ssh("node-1", "getent hosts node-4").stdout
        assert NODE4 in emulated.ssh("bastion", "sudo /usr/local/sbin/dlc-proxy-acl print").stdout
        old_certs, old_token = member_certs("node-4", tmp_path / "node-4-tls"), emulated.token()
        jobs_old = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth").stdout.strip()
        # a member reaches the others' ports (the GCS on the head among them)
        reached = probe_from_node4()
        assert f"{NODES['node-1']}:6379" in reached and f"{NODES['node-2']}:22" in reached, reached
        proc = run([*make, "NODE=node-4"], {**emulated.env, "INVENTORY": str(inventory)}, timeout=900)
        print(proc.stdout[-3000:], proc.stderr[-2000:])
        assert proc.returncode == 0
        assert ("remove-node: node-4 is out of cluster emulated: drained, its Ray stopped and disabled, "
                "left out of every node list and the cluster record; the cluster re-keyed (a new token, "
                "run-history credentials and CA; Ray restarted on every node): its token and certificate, "
                f"or copies of them, are refused; now delete it from {inventory}") in proc.stdout
        after = ray_pids(emulated)
        assert all(after[n] != pids[n] for n in NODES), (pids, after)
        assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())
        new_token = emulated.token()
        assert new_token != old_token and emulated.api("/api/jobs/", old_token)[0] == 403
        # node-4's certificate and key, with the new token: TLS refuses them (a new CA); the control
        # at once, from the same address: node-2's new certificate with that token is answered
        new_certs = member_certs("node-2", tmp_path / "node-2-tls")
        control = ask_ray(emulated, new_token, new_certs, 57, "gcs-only")
        asked = ask_ray(emulated, new_token, old_certs, 57, "gcs-only")
        print("node-4's certificate after the re-key:", asked, "node-2's:", control)
        assert control["GCS"] == "3 nodes", control
        assert not asked["GCS"].endswith(" nodes") and "InvalidAuthToken" not in asked["GCS"], asked
        # the run history's jobs' password re-keyed too: the old one (node-4 held it) refused
        jobs_new = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth").stdout.strip()
        assert jobs_new != jobs_old and jobs_new.startswith("dlc-jobs:"), jobs_new.split(":")[0]
        url = record.load(emulated.config / record.RECORD).tracking_url
        for creds, code in ((jobs_old, 401), (jobs_new, 200)):
            assert tracking_status(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", creds) == code
        desc = json.loads((emulated.config / "cluster.json").read_text())
        assert sorted(n["name"] for n in desc["nodes"]) == sorted(NODES)
        state = emulated.ssh("node-4", "systemctl is-active dlc-ray; systemctl is-enabled dlc-ray; "
                             "test -e /etc/dlcluster/quarantine && echo quarantined; "
                             "for f in /etc/dlcluster/ray_token /etc/dlcluster/tracking_auth "
                             f"{TLS}; do sudo test -e $f && echo kept:$f; done").stdout.split()
        assert state == ["inactive", "disabled"], state  # no secret of the cluster kept there
        for node in NODES:
            assert "node-4" not in emulated.ssh(node, "cat /etc/hosts").stdout, node
        assert NODE4 not in emulated.ssh("bastion", "sudo /usr/local/sbin/dlc-proxy-acl print").stdout
        # and the removed server's address reaches no port of any node but ssh (every node's firewall
        # admits the cluster's own addresses only, rewritten by remove-node's run)
        reached = probe_from_node4()
        print("node-4 reaches after its removal:", reached)
        assert sorted(reached) == sorted(f"{ip}:22" for ip in NODES.values()), reached
        gone = True
    finally:
        run(["docker", "rm", "-f", "dlc-emu-node-4"], emulated.env, timeout=120)
        if listed and not gone:  # the test stopped before node-4 was out of every list: the default
            # inventory's cluster-up writes them (every node's /etc/hosts, the bastion's client list,
            # the record) for the three alone
            back = emulated.cluster("up")
            print(f"node-4 left out of every list again by the default inventory's cluster-up: exit "
                  f"{back.returncode}", back.stderr[-2000:])


# what a node offers on the private network: ssh, Ray's GCS, node manager and object manager, the
# dashboard agent, the job API, the node exporter and the run history's TLS end (the head)
PORTS = ["22", "6379", "8076", "8077", "52365", "8265", "9100", "5000"]


def probe_from_node4() -> list[str]:
    """Which of PORTS answer node-4 (its container, on the private network) at each other node."""
    argv = ["docker", "exec", "-i", "dlc-emu-node-4", "python3", "-", ",".join(NODES.values()), *PORTS]
    proc = subprocess.run(argv, input=PROBE, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def image_id(tag: str) -> str:
    return run(["/usr/bin/docker", "image", "inspect", "--format", "{{.Id}}", tag], dict(os.environ),
               check=True).stdout.strip()


def build_image(tag: str, dockerfile: str) -> None:
    """A small image on top of the project's, built from a Dockerfile on stdin (FROM a local image:
    nothing is pulled)."""
    subprocess.run(["/usr/bin/docker", "build", "-q", "-t", tag, "-"], input=dockerfile, text=True,
                   env={**os.environ, "DOCKER_BUILDKIT": "0"}, check=True, capture_output=True, timeout=300)


def train_worker_nodes(emulated) -> list[str]:
    """The addresses of the nodes where Ray Train's workers run now (its alive worker actors)."""
    token = emulated.token()
    status, actors = emulated.api("/api/v0/actors?limit=1000&detail=false&filter_keys=state"
                                  "&filter_predicates=%3D&filter_values=ALIVE", token)
    status_n, nodes = emulated.api("/api/v0/nodes?limit=100&detail=false", token)
    if status != 200 or status_n != 200:
        return []
    ips = {n["node_id"]: n["node_ip"] for n in nodes["data"]["result"]["result"]}
    return sorted(ips.get(a["node_id"], "?") for a in actors["data"]["result"]["result"]
                  if "TrainWorker" in a["class_name"])


def node3_image(emulated) -> tuple[str, str]:
    """What node-3 records as the image Ray runs, and the image of Ray's running container."""
    recorded = emulated.ssh("node-3", "cat", "/etc/dlcluster/image").stdout.strip()
    running = emulated.ssh("node-3", "sudo", "docker", "inspect", "--format", "{{.Image}}", "dlc-ray")
    return recorded, running.stdout.strip()


def labelled_images(emulated) -> set[str]:
    """The ids of node-3's images that carry the project's label (docker/Dockerfile)."""
    return set(emulated.ssh("node-3", "sudo", "docker", "images", "-q", "--no-trunc", "--filter",
                            "label=org.opencontainers.image.title=dlcluster").stdout.split())


def import_image(emulated, tag: str, label: bool) -> str:
    """An empty image made on node-3 (docker import), with the project's label or without: its id."""
    change = "--change 'LABEL org.opencontainers.image.title=dlcluster' " if label else ""
    proc = emulated.ssh("node-3", f"tar cf - -T /dev/null | sudo docker import {change}- {tag}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_make_upgrade_rolls_a_new_image_on_and_a_broken_one_back_under_a_running_job(emulated, tmp_path):
    """make upgrade to an image built from a later commit: only node-3 (the docker node) changes: it
    is drained, restarted on the new image, checked (make doctor for it, the perf step against its
    baseline) and let back in; node-1 and node-2 keep their Ray processes. Before the new image comes,
    node-3 keeps of the project's images only the one it runs (the previous one after the upgrade):
    a stale one goes, another team's image stays. Then, while an elastic
    job runs with a worker on each node, an image whose `ray` cannot start: node-3 is drained (its
    worker stopped), does not rejoin, goes back to the previous image by id and rejoins, the run
    stops with one line, and the job finishes from its checkpoint with a verified model."""
    build_image("dlcluster:cpu-next", f"FROM dlcluster:cpu\nLABEL dlc.upgrade={time.time_ns()}\n")
    build_image("dlcluster:cpu-broken", "FROM dlcluster:cpu\nUSER root\nRUN printf '#!/bin/sh\\n"
                "echo broken on purpose >&2\\nexit 1\\n' > /opt/venv/bin/ray\nUSER 1000\n")

    def inventory(tag: str) -> Path:
        """The emulated inventory with node-3's image `tag`, node-3 listed before node-2: the workers
        are upgraded in the inventory's order, so the broken image's run stops at its first node
        (no walk over node-2 before it, which a job would have to outlast)."""
        text = EMULATED.replace("          dlc_image: dlcluster:cpu\n", f"          dlc_image: {tag}\n", 1)
        node2 = "        node-2:\n          ansible_host: 172.31.251.12\n"
        text = text.replace(node2, "", 1).replace("    ray_nodes:\n", node2 + "    ray_nodes:\n", 1)
        assert text != EMULATED and text.index("        node-3:\n") < text.index(node2)
        folder = tmp_path / tag.replace(":", "-")
        folder.mkdir()
        return _inventory(folder, "emulated", text)  # the same cluster (its folder's name)

    def upgrade(inv: Path, *, smoke: str = "", ansible: str = "") -> subprocess.CompletedProcess:
        env = {**emulated.env, "INVENTORY": str(inv), "SMOKE_ARGS": smoke, "ANSIBLE_ARGS": ansible}
        t0 = time.time()
        proc = run(["make", "--no-print-directory", "upgrade"], env, timeout=1500)
        print(f"make upgrade with {inv}: {time.time() - t0:.0f} s, exit {proc.returncode}")
        print(proc.stdout[-3000:], proc.stderr[-2000:])
        return proc

    old = node3_image(emulated)
    assert old[0] == old[1] == image_id("dlcluster:cpu")
    stale = import_image(emulated, "dlc-stale:probe", True)
    theirs = import_image(emulated, "site-tool:probe", False)
    assert stale in labelled_images(emulated)
    pids = ray_pids(emulated)
    # a later image, no job running: node-3 measured against the baseline too (its CPU step; this
    # machine's 2 cores are shared by all three nodes)
    proc = upgrade(inventory("dlcluster:cpu-next"), smoke="--max-step-slowdown 2 --min-storage-fraction 0.05")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "upgrade: cluster emulated runs what" in proc.stdout
    said = " ".join(proc.stdout.split())  # Ansible's YAML output wraps long lines
    assert re.search(r"node-3: checked after its restart: back in Ray, make doctor found nothing on it; "
                     r"perf step: PASS perf [\d.]+ s 1 nodes, \d+ links measured; against ", said), \
        proc.stdout[-3000:]
    new = image_id("dlcluster:cpu-next")
    assert node3_image(emulated) == (new, new) and new != old[0]
    assert labelled_images(emulated) == {new, old[0]}  # the stale one gone, the previous kept
    kept = emulated.ssh("node-3", "sudo", "docker", "image", "inspect", "--format", "{{.Id}}",
                        "site-tool:probe")
    assert kept.stdout.strip() == theirs, kept.stderr  # another team's image: not the project's to remove
    emulated.ssh("node-3", "sudo", "docker", "rmi", "site-tool:probe")
    after = ray_pids(emulated)
    assert {n: after[n] for n in ("node-1", "node-2")} == {n: pids[n] for n in ("node-1", "node-2")}
    assert after["node-3"] != pids["node-3"]
    assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())

    # an image whose Ray cannot start, under a job with a worker on each node (STRICT_SPREAD, so
    # node-3 runs one when it is drained: with SPREAD, three runs put none there); long enough to
    # outlast the upgrade's checks and node-3's roles up to its drain (node-3 is the first node now:
    # its drain came after epoch 16 of 16 on this 2-core machine, 2026-11-27, too close; once the
    # image's push and pull were polled every 2 s, not 10, after epoch 8 to 12 of 24: 20 leaves
    # room, and each epoch more is one the job trains after the upgrade returned)
    pids = ray_pids(emulated)
    name = f"upgraded-{int(time.time())}"
    epochs = 20
    job, lines, reader = elastic_run(emulated, name, epochs, 6000, "--placement", "STRICT_SPREAD")
    deadline = time.time() + 600
    while not registered(emulated, name):  # a checkpoint to go on from when node-3's worker stops
        assert time.time() < deadline and job.poll() is None, "".join(lines[-40:])
        time.sleep(1)
    workers = train_worker_nodes(emulated)
    print(f"the job's workers before the upgrade: {workers}")
    assert NODES["node-3"] in workers, workers
    try:
        # the job's worker on node-3 gets 10 s to end, then restarts from the checkpoint
        proc = upgrade(inventory("dlcluster:cpu-broken"),
                       ansible="-e ray_join_timeout=25 -e ray_upgrade_drain_timeout=10")
        print("the job when the upgrade returned:",
              next((line.strip() for line in reversed(lines) if "epoch " in line), "no epoch yet"))
        job.wait(timeout=1200)
    finally:  # a job that outlived the test's wait stopped as an operator would (ray job stop), not its
        # client alone, which would leave it training (and cluster-down refusing after it)
        if job.poll() is None:
            stop_run(emulated, name, job)
    # make's own error line is "make: ***" or, under another make (make test), "make[1]: ***"
    last = [line for line in proc.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)][-1]
    assert proc.returncode != 0
    assert ("node-3: upgraded, then its check failed (its Ray did not join the head within 25 s after the "
            f"restart): rolled back to its previous image {new[:19]}, back in Ray; the nodes after it were "
            "not upgraded") in last, proc.stderr[-3000:]
    assert "node-3 still runs work after 10 s: its Ray restarts now" in " ".join(proc.stdout.split())
    assert node3_image(emulated) == (new, new)
    after = ray_pids(emulated)
    assert {n: after[n] for n in ("node-1", "node-2")} == {n: pids[n] for n in ("node-1", "node-2")}
    assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())
    reader.join(timeout=30)
    out = "".join(lines)
    assert job.returncode == 0 and "succeeded" in out, out[-3000:]
    m = published(emulated, name)
    print(f"the job under the upgrade: {m['restarts']}, world size {m['world_size']}")
    assert m["metrics"]["epoch"] == epochs and m["parity"]["max_abs_diff"] <= 1e-4, m
    assert m["restarts"]["count"] >= 1 and m["restarts"]["resumed_after_epochs"][0] >= 1, m["restarts"]


