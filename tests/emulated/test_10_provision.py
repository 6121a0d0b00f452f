"""cluster-up through the bastion: every node provisioned, the first baseline, beside the local
cluster, the image from the bastion's registry (read-only for the nodes), the bastion's
services and the firewall first, the nodes and the job API reachable only as they should be."""

from __future__ import annotations

import io
import json
import re
import shlex
import socket
import subprocess
import tarfile
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import (
    BASTION_PRIVATE,
    DEMO_PORT,
    DLCLUSTER,
    NODES,
    PORT,
    REPO,
    get_json,
    recap,
    run,
)
from helpers import PROBE, operator, untouched

from dlcluster import baseline, record

# the first test also carries the tier's machines and cluster-up (the fixture: up to 600 + 3600 s)
pytestmark = pytest.mark.timeout(4800)


def test_cluster_up_provisions_every_node_through_the_bastion(emulated):
    assert emulated.up.returncode == 0, emulated.up.stdout[-3000:] + emulated.up.stderr[-2000:]
    hosts = recap(emulated.up.stdout)
    assert set(hosts) == {"localhost", "bastion", *NODES}, hosts
    assert all(h["failed"] == 0 and h["unreachable"] == 0 for h in hosts.values()), hosts
    desc = json.loads((emulated.config / "cluster.json").read_text())
    assert desc["kind"] == "ansible" and desc["job_api"] == f"http://127.0.0.1:{PORT}"
    assert {n["name"]: n["ip"] for n in desc["nodes"]} == NODES
    assert [n["role"] for n in desc["nodes"]].count("head") == 1
    # first contact with each machine recorded: the bastion's and every node's host key
    known = (emulated.cluster_dir / "known_hosts").read_text().split()
    for ip in ["172.31.250.10", *NODES.values()]:
        assert ip in known
    assert oct((emulated.cluster_dir / "ray_token").stat().st_mode & 0o777) == "0o600"
    assert sorted(emulated.alive_nodes()) == sorted(NODES.values())
    # ray_start_extra_args' JSON reached `ray start` whole, through the unit file (host runtime)
    # and the container's shell (node-3)
    status, body = emulated.api("/api/v0/nodes?limit=100&detail=true", emulated.token())
    assert status == 200
    resources = {n["node_ip"]: n["resources_total"] for n in body["data"]["result"]["result"]}
    assert all(r.get("emulated") == 1 for r in resources.values()), resources
    # node-3's container runs as Ray's account, uid and gid 1002, which its image does not know
    # (its `dlc` is 1000): the token, root:raysvc 0640, is readable there
    ids = run(["docker", "exec", "dlc-emu-node-3", "docker", "exec", "dlc-ray", "sh", "-c",
               "id -u; id -g; echo $HOME $USER; head -c 4 /etc/dlcluster/ray_token | wc -c; ulimit -c"],
              emulated.env, check=True).stdout.split()
    # ... and writes no core dump (a crashed worker's memory holds the token); nor do the others
    assert ids == ["1002", "1002", "/var/lib/dlcluster/home", "raysvc", "4", "0"], ids
    for node in ("node-1", "node-2"):
        pid = emulated.ssh(node, "systemctl show -p MainPID --value dlc-ray").stdout.strip()
        limits = emulated.ssh(node, f"sudo cat /proc/{pid}/limits").stdout
        assert re.search(r"^Max core file size\s+0\s+0\s", limits, re.M), limits
    # Ray's log monitor runs with ray.env's setting on every node (host runtime and container): it
    # looks for new log files every 0.5 s, not on each 0.1 s pass
    for node in NODES:
        env = emulated.ssh(node, "sudo cat /proc/$(pgrep -of log_monitor.py)/environ").stdout
        assert "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0" in env.split("\0"), (node, env[-500:])
    # the distribution's unattended upgrades leave the NVIDIA driver and toolkit alone on every
    # node (a CPU node may get a GPU): apt itself reads the setting
    for node in NODES:
        dump = emulated.ssh(node, "apt-config dump").stdout
        for pattern in ("^nvidia-", "^libnvidia-"):
            assert f'Unattended-Upgrade::Package-Blacklist:: "{pattern}";' in dump, (node, dump[-2000:])


def test_the_first_cluster_up_recorded_the_performance_baseline(emulated):
    """New servers (no token on the head): cluster-up ended by recording their baseline, idle, with
    what it was measured from; the note that it was due is gone."""
    assert "cluster-up: new servers: recording their performance baseline" in emulated.up.stdout
    assert not (emulated.cluster_dir / "baseline-due").exists()
    files = sorted((emulated.cluster_dir / "baselines").glob("*.json"))
    assert len(files) == 1, files
    perf = baseline.Perf.model_validate_json(files[0].read_text())
    assert set(perf.nodes) == set(NODES)
    assert set(perf.links) == {"node-1~node-2", "node-1~node-3", "node-2~node-3"}
    assert all(0 < v < 1000 for v in perf.links.values())
    assert all(n.cpu_step_s > 0 for n in perf.nodes.values())
    assert all(n.storage_write_mbps > 0 and n.storage_read_mbps > 0 for n in perf.nodes.values())
    assert perf.allreduce.backend == "gloo" and perf.allreduce.bytes == 256 << 20
    rec = record.load(emulated.config / "cluster.json")
    assert perf.inventory_digest == baseline.inventory_digest(rec.inventory) is not None
    assert perf.commit == run(["git", "rev-parse", "HEAD"], emulated.env, check=True).stdout.strip()


def test_it_runs_beside_the_local_cluster_make_demo_leaves(emulated, tmp_path):
    """The quick start in its order: make demo (a local cluster on 127.0.0.1:8265, its gateway's, left
    running), then make test. The emulated cluster came up beside it on the tier's own tunnel port;
    both answer as Ray's job API does (401 without the token, the jobs with the cluster's own), and the
    demo's port is another cluster (the emulated cluster's token refused there). cluster-up of the
    servers on the default ports, the README's next step, stops first with one line naming the
    port the demo holds and its holder. The local cluster is then stopped, if this tier started
    it, for the CPUs."""
    try:
        assert emulated.up.returncode == 0
        desc = json.loads((emulated.config / "cluster.json").read_text())
        assert desc["job_api"] == f"http://127.0.0.1:{PORT}"
        for port in (PORT, DEMO_PORT):  # (0: nothing answers; a 404 or 502 is some other server)
            status = get_json(port, "/api/jobs/")[0]
            assert status == 401, \
                f"127.0.0.1:{port}/api/jobs/ without the token: HTTP {status}, not Ray's job API's 401"
        status, listed = get_json(PORT, "/api/jobs/", emulated.token())
        assert status == 200 and isinstance(listed, list), (status, listed)
        status = get_json(DEMO_PORT, "/api/jobs/", emulated.token())[0]
        assert status == 403, f"127.0.0.1:{DEMO_PORT} took the emulated cluster's token: HTTP {status}"
        if emulated.demo.env is not None:  # the tier's own stand-in for it: its token lists its jobs
            status, listed = get_json(DEMO_PORT, "/api/jobs/", emulated.demo.token())
            assert status == 200 and isinstance(listed, list), (status, listed)
        # the README's next step with the demo still up: cluster-up of servers on the default ports
        # (an operator of their own here, whose tunnel is not open) stops in seconds, before any
        # server is touched, naming the held port and its holder
        env = operator(emulated, tmp_path, "defaults", 0)
        for name in ("DASHBOARD_PORT", "METRICS_PORT", "GRAFANA_PORT", "TRACKING_PORT"):
            env.pop(name)
        started = time.time()
        proc = run([DLCLUSTER, "up"], env, timeout=300)
        took = time.time() - started
        last = proc.stderr.strip().splitlines()[-1]
        print(f"{took:.0f} s: {last}")
        assert proc.returncode != 0 and untouched(proc) and "PLAY [Nodes" not in proc.stdout
        held = (rf"port {DEMO_PORT} here \(the tunnel's local end, DASHBOARD_PORT\) is held by \S+ \(pid "
                r"\d+, user \S+\): the job gateway \(the local cluster's\?\); make cluster-down stops the "
                r"local cluster, or set DASHBOARD_PORT to a free port")
        assert re.search(held, last), last
        assert "; nothing was changed (log: " in last and took < 120, (took, last)
    finally:
        emulated.demo.down()


def test_the_docker_node_got_the_image_from_the_bastions_registry(emulated):
    """node-3 (docker_image_from: bastion) runs Ray in the very image this machine built, pulled by
    digest from the registry on the bastion's private address; the push crossed the bastion once.
    Its engine unpacks pulled layers with unpigz (the role installs pigz: node-3's pull of the 7 GB
    image alone, 121-144 s against 160-172 s with the engine's own gunzip, 2026-12-02)."""
    ours = run(["docker", "image", "inspect", "--format", "{{.Id}}", "dlcluster:cpu"], emulated.env,
               check=True).stdout.strip()
    fmt = "{{.Id}} {{json .RepoDigests}}"
    node_id, digests = emulated.ssh("node-3", "sudo", "docker", "image", "inspect", "--format",
                                    f"'{fmt}'", "dlcluster:cpu").stdout.split(" ", 1)
    assert node_id == ours
    running = emulated.ssh("node-3", "sudo", "docker", "inspect", "--format", "'{{.Image}}'", "dlc-ray")
    assert running.stdout.strip() == ours
    # the engine looks for unpigz on its PATH (systemd's: /usr/bin among it) at each pull
    unpigz = emulated.ssh("node-3", "command", "-v", "unpigz")
    assert unpigz.stdout.strip() == "/usr/bin/unpigz", unpigz.stdout + unpigz.stderr
    shipped = re.search(r"node-3: dlcluster:cpu \(\d+\.\d+ GB\) pushed in \S+ \((\d+) layer\(s\), "
                        r"([\d.]+) MB through the bastion\), pulled in", " ".join(emulated.up.stdout.split()))
    if shipped:  # its kept disk (emulate.sh) had an older image: cold, every layer; warm, the changed ones
        print(f"first cluster-up: {shipped.group(0)}")
        pulled = f"{BASTION_PRIVATE}:5000/dlcluster@sha256:"
        assert any(d.startswith(pulled) for d in json.loads(digests)), digests
    else:  # the same image from an earlier run of this commit, kept on node-3's disk: nothing to ship
        # (its pull reference may be gone: Docker drops it with the last tag of that repository)
        push = r"TASK \[node_image : Push the image[^\n]*\n(skipping: \[node-\d\]\n)*skipping: \[node-3\]"
        assert re.search(push, emulated.up.stdout), emulated.up.stdout[-3000:]
    # either way the bastion's registry serves this very image under the tag the nodes pull
    manifest = emulated.ssh("node-3", "curl", "-sf", "-H",
                            "'Accept: application/vnd.docker.distribution.manifest.v2+json'",
                            f"http://{BASTION_PRIVATE}:5000/v2/dlcluster/manifests/cpu").stdout
    assert json.loads(manifest)["config"]["digest"] == ours, manifest[:500]


def _probe_image(n: int, env: dict) -> None:
    """dlc-gc-probe:latest, a one-file image of this machine's engine (a different file each n)."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as tar:
        data = f"probe {n} {time.time()}\n".encode()
        info = tarfile.TarInfo("probe")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    subprocess.run(["docker", "import", "-", "dlc-gc-probe:latest"], input=packed.getvalue(),
                   capture_output=True, check=True, env=env)


def test_the_registry_serves_nodes_read_only_and_pushes_need_the_credential(emulated, tmp_path):
    """The nodes' side of the bastion's registry serves pulls and refuses a node's push and delete
    (so a job cannot replace or remove the image); the push side answers on the bastion's loopback
    only, refuses a local user of the bastion and a wrong credential, and takes the cluster's (read
    from the bastion with sudo for each push; no file on this control host, nor in its docker
    config). After pushes, all but the newest dlc_registry_keep (3)
    manifests are forgotten and their layers collected; the image Ray runs is still pulled."""
    registry, at = f"http://{BASTION_PRIVATE}:5000", f"{BASTION_PRIVATE}:5000"
    digest = emulated.ssh("node-3", "curl", "-sfI", "-H",
                          "'Accept: application/vnd.docker.distribution.manifest.v2+json'",
                          f"{registry}/v2/dlcluster/manifests/cpu").stdout
    digest = re.search(r"(?im)^docker-content-digest: (sha256:[0-9a-f]{64})", digest).group(1)
    code = ["curl", "-s", "-o", "/dev/null", "-w", "'%{http_code} '"]
    refused = emulated.ssh("node-3", *code, "-X", "DELETE", f"{registry}/v2/dlcluster/manifests/{digest}",
                           ";", *code, "-X", "POST", f"{registry}/v2/dlcluster/blobs/uploads/").stdout.split()
    assert refused == ["405", "405"], refused  # delete, then the start of an upload
    push = emulated.ssh("node-3", "sudo", "docker", "tag", "dlcluster:cpu", f"{at}/dlcluster:job",
                        "&&", "sudo", "docker", "push", f"{at}/dlcluster:job", timeout=120)
    emulated.ssh("node-3", "sudo", "docker", "rmi", f"{at}/dlcluster:job")
    print(push.stdout[-500:], push.stderr[-500:])
    assert push.returncode != 0
    tags = emulated.ssh("node-3", "curl", "-sf", f"{registry}/v2/dlcluster/tags/list").stdout
    # the refused tag is not there; the image the nodes pull still is (other tags, say an upgrade's
    # next image pushed by cluster-up in an earlier run, may be)
    tags = json.loads(tags)["tags"]
    assert "job" not in tags and "cpu" in tags, tags
    pulled = emulated.ssh("node-3", "sudo", "docker", "pull", "-q", f"{at}/dlcluster@{digest}", timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    # the push side: loopback only; a local user of the bastion can neither read its hash nor push
    ask = ("import urllib.request as u, urllib.error as e\ntry: u.urlopen('http://127.0.0.1:5001/v2/')"
           "\nexcept e.HTTPError as x: print(x.code)")
    local = emulated.ssh("bastion", "sudo", "runuser", "-u", "nobody", "--", "python3", "-c",
                         shlex.quote(ask), ";", "sudo", "runuser", "-u", "nobody", "--", "cat",
                         "/etc/docker/registry/push.htpasswd", ";",
                         "sudo", "ss", "-Hltn", "sport", "=", ":5001")
    print(local.stdout, local.stderr)
    assert local.stdout.splitlines()[0] == "401" and "Permission denied" in local.stderr
    assert [line.split()[3] for line in local.stdout.splitlines()[1:]] == ["127.0.0.1:5001"]
    assert not (emulated.cluster_dir / "registry_password").exists()  # no control host keeps it
    ship = [str(REPO / ".venv-ansible/bin/python"), str(REPO / "ansible/roles/node_image/files/dlc_ship.py"),
            f"--ssh-config={emulated.ssh_config}", f"--progress={tmp_path / 'progress'}", "push",
            "dlc-gc-probe:latest", "--bastion=bastion", f"--registry={at}",
            "--push-to=127.0.0.1:5001", "--local-port=35001"]
    wrong = "/tmp/dlc-wrong-push-password"  # on the bastion, where a push reads its credential
    emulated.ssh("bastion", "echo", "not-the-password", "|", "sudo", "tee", wrong,
                 ">/dev/null").check_returncode()
    docker_config = Path.home() / ".docker/config.json"
    before = docker_config.read_text() if docker_config.exists() else ""
    try:
        _probe_image(0, emulated.env)
        bad = run([*ship, f"--credential-on-bastion={wrong}"], emulated.env)
        assert bad.returncode != 0 and "it refused the login" in bad.stderr and "401" in bad.stderr, \
            bad.stderr
        refs = []
        for n in range(4):  # one more than dlc_registry_keep
            _probe_image(n + 1, emulated.env)
            proc = run([*ship, "--credential-on-bastion=/etc/docker/registry/push.password"], emulated.env,
                       timeout=120)
            assert proc.returncode == 0, proc.stderr
            refs.append(json.loads(proc.stdout)["ref"])
            time.sleep(1.1)  # the manifests' ages are their link files' times
        assert (docker_config.read_text() if docker_config.exists() else "") == before
        gc = emulated.ssh("bastion", "sudo", "/usr/local/sbin/dlc-registry-gc", "/var/lib/docker-registry",
                          "3", "/etc/docker/registry/push.yml", timeout=300)
        print(gc.stdout, gc.stderr)
        # (probes an earlier run of this tier left on the registry's kept disk are forgotten too)
        line = re.search(r"^dlc-gc-probe: forgot \d+ manifest\(s\) older than the newest 3: (.*)$",
                         gc.stdout, re.M)
        assert gc.returncode == 0 and line, gc.stdout + gc.stderr
        forgotten = line.group(1).split(", ")
        assert refs[0].split("@")[1][:19] in forgotten and not {r.split("@")[1][:19] for r in refs[1:]} & \
            set(forgotten), (refs, forgotten)
        assert re.search(r"^[1-9]\d* layer\(s\) and config\(s\) no kept manifest uses were deleted$",
                         gc.stdout, re.M)
        kept = [emulated.ssh("node-3", "sudo", "docker", "pull", "-q", ref, timeout=120).returncode
                for ref in refs]
        assert kept == [1, 0, 0, 0], kept
        assert emulated.ssh("node-3", "sudo", "docker", "pull", "-q", f"{at}/dlcluster@{digest}",
                            timeout=300).returncode == 0
        side = emulated.ssh("bastion", "systemctl", "is-active", "dlc-registry-push").stdout.strip()
        assert side == "active"  # the push side is back after the collection
    finally:
        emulated.ssh("bastion", "sudo", "rm", "-f", wrong)
        run(["docker", "rmi", "dlc-gc-probe:latest"], emulated.env)
        emulated.ssh("node-3", "sudo", "sh", "-c", shlex.quote(
            "docker images -q --filter reference='*/dlc-gc-probe' | xargs -r docker rmi -f"))


def test_the_bastions_services_were_configured_before_their_packages_came(emulated):
    """The proxy and the registry start the moment their packages are installed: their settings
    (private address only) and client lists were on the bastion before that (dpkg's log), so no
    first start ever listened on every interface for every client."""
    proxy, registry = "apt-cacher-ng", "docker-registry"
    before = {"/etc/apt-cacher-ng/zz_dlcluster.conf": [proxy],
              "/etc/systemd/system/apt-cacher-ng.service.d/dlcluster-acl.conf": [proxy],
              "/etc/docker/registry/config.yml": [registry],
              "/etc/docker/registry/push.yml": [registry],
              "/etc/systemd/system/docker-registry.service.d/dlcluster.conf": [registry],
              "/usr/local/sbin/dlc-proxy-acl": [proxy, registry]}
    stat = emulated.ssh("bastion", "sudo", "stat", "-c", "'%Y %n'", *before).stdout
    written = {name: int(mtime) for mtime, name in (line.split(" ", 1) for line in stat.splitlines())}
    installed = {}
    for line in emulated.ssh("bastion", "grep", "-E", f"' install ({proxy}|{registry}):'",
                             "/var/log/dpkg.log").stdout.splitlines():
        day, clock, _, package = line.split()[:4]
        when = datetime.fromisoformat(f"{day}T{clock}+00:00").timestamp()  # the bastion's clock: UTC
        installed.setdefault(package.split(":")[0], when)
    print(written, installed)
    assert set(written) == set(before) and set(installed) == {proxy, registry}, (written, installed)
    for name, packages in before.items():
        assert all(written[name] <= installed[p] for p in packages), (name, written[name], installed)


def test_nfs_rpcbind_and_the_metrics_never_start_without_the_firewall(emulated):
    """The NFS server and rpcbind listen on every interface: like Ray, they require the firewall,
    so a firewall that fails at boot leaves them down. Their packages installed on node-2 here (the
    emulated cluster shares a path instead: a kernel NFS server cannot run in these containers),
    with service starts held back, then systemd asked what each unit requires."""
    install = ("printf '#!/bin/sh\\nexit 101\\n' >/usr/sbin/policy-rc.d && "
               "chmod 755 /usr/sbin/policy-rc.d && "
               "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
               "nfs-kernel-server >/dev/null; rc=$?; rm -f /usr/sbin/policy-rc.d; exit $rc")
    proc = emulated.ssh("node-2", "sudo", "sh", "-c", shlex.quote(install), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    units = ["nfs-server.service", "rpcbind.service", "rpcbind.socket"]
    shown = emulated.ssh("node-2", "systemctl", "show", "-p", "Id", "-p", "LoadState", "-p", "Requires",
                         "-p", "After", *units).stdout
    for block in shown.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines())
        print(props["Id"], props["Requires"])
        assert props["LoadState"] == "loaded", props
        assert "dlc-firewall.service" in props["Requires"].split(), props
        assert "dlc-firewall.service" in props["After"].split(), props
    assert len(shown.strip().split("\n\n")) == 3, shown
    # the metrics exporter on every node and Prometheus on the head, which answer without a login
    # (security review N7), the same way
    for node, unit in (("node-2", "prometheus-node-exporter.service"), ("node-1", "prometheus.service")):
        shown = emulated.ssh(node, "systemctl", "show", "-p", "ActiveState", "-p", "Requires", "-p", "After",
                             unit).stdout
        props = dict(line.split("=", 1) for line in shown.splitlines())
        assert props["ActiveState"] == "active", (node, unit, props)
        assert "dlc-firewall.service" in props["Requires"].split(), (node, unit, props)
        assert "dlc-firewall.service" in props["After"].split(), (node, unit, props)


def test_nodes_are_reachable_only_through_the_bastion(emulated, tmp_path):
    for ip in NODES.values():
        with pytest.raises(OSError):
            socket.create_connection((ip, 22), timeout=3).close()
    assert emulated.ssh("node-2", "hostname").stdout.strip() == "node-2"
    # scp in one hop with the generated config, as the tutorial wanted
    (tmp_path / "hello.txt").write_text("hello node-3\n")
    cp = run(["scp", "-F", str(emulated.ssh_config), "-o", "BatchMode=yes", str(tmp_path / "hello.txt"),
              "node-3:/tmp/hello.txt"], emulated.env, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert emulated.ssh("node-3", "cat", "/tmp/hello.txt").stdout == "hello node-3\n"


def test_job_api_needs_the_token_and_listens_on_the_private_address(emulated):
    assert emulated.api("/api/jobs/")[0] == 401  # the gateway's: missing
    assert emulated.api("/api/jobs/", "0" * 64)[0] == 403  # the gateway's: unknown
    assert emulated.api("/api/jobs/", emulated.token())[0] == 200
    # behind it, on the head, Ray's own check: the head's address without the token, refused
    behind = emulated.ssh("node-1", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          "http://172.31.251.11:8265/api/jobs/").stdout
    assert behind == "401", behind
    listen = emulated.ssh("node-1", "ss", "-ltn").stdout
    dashboard = [line.split()[3] for line in listen.splitlines() if line.split()[3:4]
                 and line.split()[3].endswith(":8265")]
    assert dashboard == ["172.31.251.11:8265"], listen
    # the tunnel is an ssh session with the head (through the bastion): a connection held open
    # through it reaches the job gateway's socket from the head's own sshd, and nothing reaches the
    # job API's port from the bastion, so a credential in its requests crosses the private network
    # inside ssh only
    with socket.create_connection(("127.0.0.1", PORT), timeout=30) as held:
        held.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\n")  # unfinished: the connection stays
        deadline, peers = time.time() + 30, []
        while not peers and time.time() < deadline:
            open_ = emulated.ssh("node-1", "sudo", "ss", "-Hxp")
            # the gateway's accepted ends (its socket's path, then the peer's inode), and whose the
            # peers are: sshd's (netid, state, queues, local path and inode, peer and inode, users)
            rows = [line.split() for line in open_.stdout.splitlines()]
            accepted = {r[7] for r in rows if len(r) > 7 and r[4] == "/run/dlc-gateway/gateway.sock"}
            peers = [r for r in rows if len(r) > 8 and r[5] in accepted and "sshd" in r[8]]
            time.sleep(0.5)
        from_bastion = emulated.ssh("bastion", "ss", "-Htn", "state", "established", "dport", "=",
                                    ":8265").stdout
    assert peers, open_.stdout[-3000:]
    assert from_bastion.strip() == "", from_bastion
    # Ray binds the GCS and the raylet to every interface: the DLC-INPUT chain, first in INPUT,
    # lets only ssh in from outside the private network, IPv4 and IPv6
    for node in NODES:
        rules = emulated.ssh(node, "sudo", "iptables", "-S").stdout
        # first in INPUT: no rule of the site's (or Docker's) is consulted before it
        first = [r for r in rules.splitlines() if r.startswith("-A INPUT ")][0]
        assert first == "-A INPUT -j DLC-INPUT", rules
        # the cluster's own addresses only (its nodes, the bastion, the inventory's extra source),
        # not the private network: no other machine there reaches more than ssh
        admitted = [r for r in rules.splitlines() if r.startswith("-A DLC-INPUT -s ")]
        assert admitted == [f"-A DLC-INPUT -s 172.31.251.{n}/32 -j RETURN"
                            for n in (11, 12, 13, 10, 51, 52, 53, 54, 57)], rules
        assert "-A DLC-INPUT -p tcp -m tcp --dport 22 -j RETURN" in rules, rules
        assert "-A DLC-INPUT -p tcp -j REJECT --reject-with tcp-reset" in rules, rules
        rules6 = emulated.ssh(node, "sudo", "ip6tables", "-S").stdout
        first6 = [r for r in rules6.splitlines() if r.startswith("-A INPUT ")][0]
        assert first6 == "-A INPUT -j DLC-INPUT", rules6
        assert "--dport 22 -j RETURN" in rules6, rules6
        assert "-s 172.31" not in rules6 and "icmp6-port-unreachable" in rules6, rules6
    # the bastion's package proxy and image registry serve the nodes only: a stranger on the
    # private network is refused by both
    stranger = subprocess.run(["docker", "run", "--rm", "-i", "--network", "dlc-emu-private", "--ip",
                               "172.31.251.50", "--entrypoint", "python3", "dlcluster/emu-bastion", "-",
                               BASTION_PRIVATE, "3142", "5000"], input=PROBE, capture_output=True, text=True,
                              timeout=120, check=True).stdout
    assert json.loads(stranger) == []
    # nor does any node answer it but with ssh (every node's firewall admits the cluster's own
    # addresses only), while a node reaches the head's Ray (the probe sees an open port)
    ports = ["22", "6379", "8076", "8077", "52365", "8265", "9100", "5000"]
    addrs = ",".join(NODES.values())
    stranger = subprocess.run(["docker", "run", "--rm", "-i", "--network", "dlc-emu-private", "--ip",
                               "172.31.251.50", "--entrypoint", "python3", "dlcluster/emu-bastion", "-",
                               addrs, *ports], input=PROBE, capture_output=True, text=True,
                              timeout=120, check=True).stdout
    assert sorted(json.loads(stranger)) == sorted(f"{ip}:22" for ip in NODES.values()), stranger
    member = subprocess.run(["docker", "exec", "-i", "dlc-emu-node-2", "python3", "-", addrs, *ports],
                            input=PROBE, capture_output=True, text=True, timeout=120, check=True).stdout
    assert f"{NODES['node-1']}:6379" in json.loads(member), member
    for port in (3142, 5000):
        connect = f"import socket; socket.create_connection(('{BASTION_PRIVATE}', {port}))"
        node = emulated.ssh("node-2", f'python3 -c "{connect}"')  # one word for the remote shell
        assert node.returncode == 0, (port, node.stderr)


