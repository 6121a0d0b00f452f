"""What operators do with a running cluster: attach, the running-jobs check failing closed, the
engine restarted under Ray, a jump host without sudo, a changed setting and an interrupted run,
a second operator, a node that is down."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import (
    BASTION_PRIVATE,
    BIN,
    DLCLUSTER,
    INVENTORY,
    NODES,
    REPO,
    TOKENS_SEEN,
    recap,
    run,
)
from helpers import (
    CONVERGED,
    EMULATED,
    TLS,
    _inventory,
    _jump_inventory,
    held_job,
    job_status,
    operator,
    ray_pids,
    tracking_status,
    untouched,
)

from dlcluster import record

pytestmark = pytest.mark.timeout(1800)


def close_tunnel(env: dict) -> None:
    """What cluster-down does on the client side only (roles/control_host: release.yml), for a second
    operator's tunnel: their cluster-down would stop Ray."""
    folder = Path(env["DLC_CONFIG"]) / "clusters/emulated"
    digest = hashlib.sha1(str(folder).encode()).hexdigest()[:12]  # roles/control_host: control_tunnel_socket
    socket_path = Path(f"~/.ssh/dlc-tunnel-{digest}").expanduser()
    run(["ssh", "-F", str(folder / "ssh_config"), "-S", str(socket_path), "-O", "exit", "node-1"], env)


def tunnel_api(port: int, path: str, token: str) -> tuple[int, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None


def test_attach_uses_a_running_cluster_and_changes_no_server(emulated, tmp_path):
    d = operator(emulated, tmp_path, "d", 8278)
    with held_job(emulated) as job:
        try:
            proc = run([DLCLUSTER, "attach"], d, timeout=300)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
            assert set(recap(proc.stdout)) == {"localhost"}  # no play ran on a server
            folder = Path(d["DLC_CONFIG"])
            mine = json.loads((emulated.config / "cluster.json").read_text())
            theirs = json.loads((folder / "cluster.json").read_text())
            assert theirs["nodes"] == mine["nodes"] and theirs["job_api"] == "http://127.0.0.1:8278"
            assert theirs["token_path"] == str(folder / "clusters/emulated/ray_token")
            token = Path(theirs["token_path"]).read_text().strip()
            assert token == emulated.token()
            env = {**d, **record.load(folder / record.RECORD).client_env()}
            status = run([str(BIN / "ray"), "job", "status", job], env, timeout=120)
            assert status.returncode == 0, status.stderr[-2000:]
            assert "RUNNING" in status.stdout + status.stderr, status.stderr[-2000:]
        finally:
            close_tunnel(d)


def test_the_running_jobs_check_fails_closed(emulated, tmp_path):
    """The job API answers with an error (here: the head's token file no longer the one Ray runs
    with, as an older cluster-up from a second laptop left it): the run stops before any role,
    naming the error, and nothing changes."""
    e = operator(emulated, tmp_path, "e", 8279)
    token = "/etc/dlcluster/ray_token"
    emulated.ssh("node-1", f"sudo cp -p {token} /root/ray_token.saved && "
                           f"echo 0000 | sudo tee {token} >/dev/null").check_returncode()
    try:
        proc = run([DLCLUSTER, "up"], e, timeout=300)
    finally:  # the same bytes and time stamp: nothing for the next run to restart
        emulated.ssh("node-1", f"sudo cp -p /root/ray_token.saved {token}").check_returncode()
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert proc.returncode != 0 and last.startswith(
        "cluster-up: error: could not tell whether jobs run on cluster emulated (node-1: the job API at "
        f"http://{NODES['node-1']}:8265/api/jobs/ answered HTTP 40"), last
    assert "Ray runs with a token other than /etc/dlcluster/ray_token" in last, last
    assert "nothing was changed" in last
    assert "PLAY [Nodes" not in proc.stdout and untouched(proc)


def test_the_engine_restarts_under_ray_and_ray_goes_on(emulated):
    """node-3 runs Ray in the image: its engine restarted (an upgrade, a runtime added) keeps
    Ray's container (live-restore), and the service follows it instead of replacing it."""
    inspect = ["sudo", "docker", "inspect", "-f", "{{.Id}} {{.State.StartedAt}} {{.State.Pid}}", "dlc-ray"]
    live = emulated.ssh("node-3", "sudo", "docker", "info", "--format", "{{.LiveRestoreEnabled}}").stdout
    assert live.strip() == "true"
    before = emulated.ssh("node-3", *inspect).stdout.strip()

    def service_pid() -> str:
        return emulated.ssh("node-3", "systemctl", "show", "-p", "MainPID", "--value",
                            "dlc-ray").stdout.strip()

    service = service_pid()
    assert before and service not in ("", "0")
    emulated.ssh("node-3", "sudo", "systemctl", "restart", "docker", timeout=120).check_returncode()
    deadline = time.time() + 60
    while service_pid() in ("", "0", service):
        assert time.time() < deadline, "dlc-ray did not start again after the engine restarted"
        time.sleep(1)
    assert emulated.ssh("node-3", *inspect).stdout.strip() == before  # the same container, same process
    journal = emulated.ssh("node-3", "sudo", "journalctl", "-u", "dlc-ray", "--no-pager", "-n", "50").stdout
    assert "following Ray's running container (the engine restarted)" in journal, journal[-2000:]
    assert sorted(emulated.wait_for_nodes(3, timeout=60)) == sorted(NODES.values())


def test_a_jump_host_without_sudo_on_another_port_is_only_passed_through(emulated, tmp_path):
    """No service asked of the bastion: cluster-up runs nothing on it (no facts, no become), only
    connects through it, here through an outer gateway too, while this machine cannot open a
    connection to the bastion itself. The nodes take their packages from a site proxy (here: the
    proxy the default inventory runs on the bastion). (A second run that changes nothing is the
    second operator's test's, on the servers.)"""
    inventory = _jump_inventory(tmp_path, "    dlc_bastion_apt_proxy: false\n"
                                          f"    dlc_apt_proxy: http://{BASTION_PRIVATE}:3142\n")
    # what the run rewrites on this machine (the ssh config: through the gateway, as jump; the
    # record: this inventory), put back after it, so the tests after it (alone too) go in through
    # the bastion as the default inventory says
    written = [emulated.ssh_config, *(folder / name for folder in (emulated.cluster_dir, emulated.config)
                                      for name in ("cluster.json", "ray-client.env"))]
    kept = {path: path.read_bytes() for path in written if path.exists()}
    CONVERGED["servers"] = False  # the nodes take their settings from this inventory now
    # (emulate.sh down removes this rule too, for a run killed here: keep the two the same)
    block = ["OUTPUT", "-d", "172.31.250.10", "-p", "tcp", "-m", "conntrack", "--ctstate", "NEW",
             "-j", "REJECT"]
    run(["iptables", "-I", *block], emulated.env, check=True)
    try:
        first = emulated.cluster("up", inventory)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
        hosts = recap(first.stdout)
        assert set(hosts) == {"localhost", *NODES}, hosts  # the bastion is not in any play
        assert "skipping: no hosts matched" in first.stdout
        config = emulated.ssh_config.read_text()
        assert "Port 2222" in config and "User jump" in config and "ProxyJump 172.31.250.20" in config
        # the gateway's host key recorded at first contact (the bastion's was already known)
        assert "[172.31.250.20]:2222 " in (emulated.cluster_dir / "known_hosts").read_text()
        assert sorted(emulated.alive_nodes()) == sorted(NODES.values())
    finally:
        run(["iptables", "-D", *block], emulated.env)
        for path, content in kept.items():
            path.write_bytes(content)


def test_a_changed_setting_waits_for_running_jobs_and_an_interrupted_run_converges(emulated, tmp_path):
    """A cluster-up that would restart Ray while a job runs stops with one line and leaves Ray (and
    the job) alone; its written files are not forgotten: the next run, stopped mid-way by a signal,
    then run again, converges (the next test: a further full run changes nothing on any server).
    The run again is make rotate-token (cluster-up with a new token, the same playbook): the new
    token is on every node and the control host, the old one is refused, and an operator who still
    has the old one is told in one line to attach, which fetches the new one.
    The job that holds the cluster sleeps: what is proved is that a running job is waited for, not
    training. The changed inventory also renews Ray's TLS certificates (every one is within its
    900 renewal days): each node gets a new one of the same CA, which Ray takes up when it restarts.
    rotate-token then gives Ray's TLS a new CA: every node a new certificate of it, and Ray takes
    them up (a certificate of the old CA refused by the GCS: test_80's remove-node, which re-keys
    with the same tasks)."""
    before = ray_pids(emulated)
    serials = tls_serials(emulated)
    changed = _inventory(tmp_path, "emulated", EMULATED.replace(
        "ray_object_store_memory: 536870912",
        "ray_object_store_memory: 600000000\n    ray_tls_days: 1000\n    ray_tls_renew_days: 900"))
    CONVERGED["servers"] = False  # the refused run writes the changed inventory's files
    with held_job(emulated) as job:
        refused = emulated.cluster("up", changed)
        last = refused.stderr.strip().splitlines()[-1]
        print(last)
        assert refused.returncode != 0 and f"1 job(s) run on the cluster ({job} (sleep 600))" in last, \
            refused.stdout[-3000:]
        # the unit (host runtime) or the container script (docker runtime) carries ray start's flags
        assert re.search(r"Ray runs with settings older than (/etc/systemd/system/dlc-ray\.service|"
                         r"/usr/local/sbin/dlc-ray-container)", last), last
        assert "dlc_restart_running_jobs: true" in last and ray_pids(emulated) == before
        # the truth about what the restart would have done: the head's refusal (every job lost) is
        # among the run's (the line names the last host Ansible reported, a worker's or the head's)
        assert "on the head it ends every job" in " ".join(refused.stdout.split()), refused.stdout[-3000:]
        assert "on the head it ends every job" in last or "on a worker it stops the job's workers" in last, \
            last
        assert job_status(emulated, job) == "RUNNING"  # the job was left alone, not only Ray's processes
        # remove-node (it re-keys the cluster: rotate-token's own check, before the node is touched)
        # and cluster-down go through the same check: refused, nothing changed
        for action in ("remove-node", "down"):
            proc = run([DLCLUSTER, action], {**emulated.env, "INVENTORY": str(INVENTORY),
                                                        "NODE": "node-2"})
            last = proc.stderr.strip().splitlines()[-1]
            print(last)
            assert proc.returncode != 0 and f"({job} (sleep 600))" in last, last
            assert "nothing was restarted" in last, last
            if action == "remove-node":
                assert "removing node-2 re-keys the cluster" in last, last
                assert "dlc_remove_node_rekey: false" in last, last
            assert untouched(proc) and ray_pids(emulated) == before and job_status(emulated, job) == "RUNNING"
        assert emulated.api("/api/jobs/", emulated.token())[0] == 200  # the tunnel is still open too
    # the default inventory again, stopped by SIGTERM once it has changed something on a node,
    # then run again
    log = emulated.cluster_dir / "up.log"
    log.unlink(missing_ok=True)  # the refused run's log has changes of its own

    def log_text() -> str:
        return log.read_text() if log.exists() else ""

    env = {**emulated.env, "INVENTORY": str(REPO / "ansible/inventories/emulated/hosts.yml")}
    stopped = subprocess.Popen([DLCLUSTER, "up"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not re.search(r"^changed: \[node-", log_text(), re.M):
            assert time.time() < deadline and stopped.poll() is None, \
                f"no change on a node to interrupt (rc {stopped.poll()}): {log_text()[-3000:]}"
            time.sleep(0.2)
        print("interrupted after: " + re.findall(r"^TASK \[[^\]]+\]", log_text(), re.M)[-1])
    finally:  # (also when the wait failed: no run of it goes on beside the next test's)
        if stopped.poll() is None:
            os.killpg(stopped.pid, signal.SIGTERM)
        stopped.communicate(timeout=120)
    assert stopped.returncode != 0
    old = emulated.token()
    jobs_old = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth").stdout.strip()
    stale = operator(emulated, tmp_path, "stale", 8280)  # a second operator with the old token
    folder = Path(stale["DLC_CONFIG"]) / "clusters/emulated"
    folder.mkdir(parents=True)
    (folder / "ray_token").write_text(old + "\n")
    (folder / "ray_token").chmod(0o600)
    admin_old = (emulated.cluster_dir / "tracking_auth").read_text().strip()
    # renewed by the refused run: new certificates of 1000 days, which the default inventory's
    # interrupted run after it kept (valid, far from their end)
    renewed = tls_serials(emulated)
    assert all(renewed[n][0] != serials[n][0] for n in NODES), (serials, renewed)
    assert all(renewed[n][1] > serials[n][1] + 100 * 86400 for n in NODES), (serials, renewed)
    old_ca = emulated.ssh("node-2", "sudo", "cat", f"{TLS}/ca.crt").stdout
    # a link where root makes a folder on a worker (as a job could leave one on a cluster made
    # before): rotate-token stops in one line before any node changes, and this folder keeps the
    # cluster's token; the new one waits in pending/ until every node has it, so the next run drops
    # it (the head never took it)
    home = "/var/lib/dlcluster/home"
    planted = emulated.ssh("node-2", f"sudo sh -c 'install -d -m 0700 /opt/decoy && mv {home} {home}.kept && "
                                     f"ln -s /opt/decoy {home}'")
    assert planted.returncode == 0, planted.stderr
    try:
        stopped = emulated.cluster("rotate-token")
        last = stopped.stderr.strip().splitlines()[-1]
        print(last)
        assert stopped.returncode != 0 and f"node-2: {home} is a link to /opt/decoy; root makes" in last, \
            stopped.stdout[-3000:] + stopped.stderr[-2000:]
        assert "nothing was changed" in last and untouched(stopped)
        pending = (emulated.cluster_dir / "pending/ray_token").read_text().strip()
        TOKENS_SEEN.add(pending)
        assert emulated.token() == old != pending
        assert emulated.api("/api/jobs/", old)[0] == 200
    finally:
        emulated.ssh("node-2", f"sudo sh -c 'rm {home} && mv {home}.kept {home} && rmdir /opt/decoy'")
    again = emulated.cluster("rotate-token")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "an earlier make rotate-token stopped before the head took its new token: this folder keeps " \
           "the cluster''s" in " ".join(again.stdout.split()), again.stdout[-3000:]
    assert not (emulated.cluster_dir / "pending").exists()
    CONVERGED["servers"] = True  # the default inventory's full run (checked below)
    for node in NODES:  # Ray runs with the inventory's setting again, on every node
        args = emulated.ssh(node, "pgrep", "-af", "raylet/raylet").stdout
        assert "--object_store_memory=536870912" in args, (node, args[:300])
    assert ray_pids(emulated) != before
    # a new CA: every node a new certificate of it (the inventory's 825 days again), Ray restarted
    # with them (the GCS answers); node-2's certificate from before is refused, the new one taken
    rotated = tls_serials(emulated)
    assert all(rotated[n][0] != renewed[n][0] and rotated[n][1] < renewed[n][1] for n in NODES), \
        (renewed, rotated)
    new_ca = emulated.ssh("node-2", "sudo", "cat", f"{TLS}/ca.crt").stdout
    assert "BEGIN CERTIFICATE" in old_ca and new_ca != old_ca
    assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())  # every node took up its new one
    # the new token everywhere, never printed; the old one refused
    new = emulated.token()
    assert new not in (old, pending) and re.fullmatch(r"[0-9a-f]{64}", new)
    assert new not in again.stdout + again.stderr
    assert emulated.api("/api/jobs/", old)[0] == 403 and emulated.api("/api/jobs/", new)[0] == 200
    for node in NODES:
        assert emulated.ssh(node, "sudo", "cat", "/etc/dlcluster/ray_token").stdout.strip() == new
    # the jobs' run-history password (every node holds it) renewed with it: the old one refused
    jobs_new = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth").stdout.strip()
    assert jobs_new != jobs_old and jobs_new.startswith("dlc-jobs:")
    assert jobs_new.split(":")[1] not in again.stdout + again.stderr
    tracking_url = record.load(emulated.config / record.RECORD).tracking_url

    def answer(path: str, creds: str) -> int:
        return tracking_status(f"{tracking_url}{path}", creds)

    for creds, code in ((jobs_old, 401), (jobs_new, 200)):
        assert answer("/api/2.0/mlflow/experiments/search?max_results=1", creds) == code, creds.split(":")[0]
    # the operators' administrator password renewed too (the server first, then the head's copy,
    # root's alone, and this folder's); never printed; the old one refused an administrator's request
    admin_new = (emulated.cluster_dir / "tracking_auth").read_text().strip()
    assert admin_new != admin_old and admin_new.split(":")[0] == admin_old.split(":")[0]
    assert admin_new.split(":", 1)[1] not in again.stdout + again.stderr
    on_head = emulated.ssh("node-1", "sudo", "cat", "/etc/dlcluster/tracking_admin_auth").stdout.strip()
    assert on_head == admin_new
    for creds, code in ((admin_old, 401), (admin_new, 200)):  # another account's details: administrators'
        assert answer(f"/api/2.0/mlflow/users/get?username={jobs_new.split(':')[0]}", creds) == code
    # the operator who still has the old token: one line, nothing changed; attach fetches the new one
    refused = run([DLCLUSTER, "up"], stale, timeout=300)
    last = refused.stderr.strip().splitlines()[-1]
    print(last)
    assert refused.returncode != 0 and "is not the one cluster emulated runs with" in last, last
    assert "run make attach INVENTORY=" in last and untouched(refused)
    attached = run([DLCLUSTER, "attach"], stale, timeout=300)
    close_tunnel(stale)
    assert attached.returncode == 0, attached.stdout[-3000:] + attached.stderr[-2000:]
    assert (folder / "ray_token").read_text().strip() == new


def tls_serials(emulated) -> dict[str, tuple[str, float]]:
    """Each node's Ray TLS certificate: its serial and its end (seconds since the epoch)."""
    out = {}
    for node in NODES:
        text = emulated.ssh(node, f"sudo openssl x509 -in {TLS}/node.crt -noout -serial -enddate").stdout
        fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        out[node] = (fields["serial"], ssl.cert_time_to_seconds(fields["notAfter"]))
    return out


def test_a_second_operator_gets_the_clusters_token_and_a_second_run_names_the_holder(emulated, tmp_path):
    """Operator B (an empty config folder, the same key) runs cluster-up while A's job runs: B gets
    the cluster's token from the head, nothing restarts, A's job and A's token go on, and B's full
    run changes nothing on any server (after the previous test's interrupted run converged).
    Operator C starts while B's run holds the head's lock: one line naming B's run, nothing
    changed."""
    if not CONVERGED["servers"]:  # left on another inventory's settings (by a test that failed, or
        # with the changed-setting test not run after the jump host's: -k): the default's run first
        up = emulated.cluster("up")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-2000:]
        CONVERGED["servers"] = True
    before = ray_pids(emulated)
    b, c = operator(emulated, tmp_path, "b", 8276), operator(emulated, tmp_path, "c", 8277)
    b_log = Path(b["DLC_CONFIG"]) / "clusters/emulated/up.log"
    with held_job(emulated) as job:
        b_run = subprocess.Popen([DLCLUSTER, "up"], cwd=REPO, env=b, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            locked = r"Take the cluster's lock on the head \(held until this run ends\)\] \**\nok:"
            deadline = time.time() + 300
            while not re.search(locked, b_log.read_text() if b_log.exists() else ""):
                assert time.time() < deadline and b_run.poll() is None, b_log.read_text()[-3000:]
                time.sleep(0.5)
            c_run = run([DLCLUSTER, "up"], c, timeout=300)
            b_out, b_err = b_run.communicate(timeout=900)
            assert b_run.returncode == 0, b_out[-3000:] + b_err[-2000:]
            assert {h: v["changed"] for h, v in recap(b_out).items() if h != "localhost"} == \
                {h: 0 for h in ("bastion", *NODES)}, b_out[-2000:]
            token_file = Path(b["DLC_CONFIG"]) / "clusters/emulated/ray_token"
            token_b = token_file.read_text().strip()
            assert token_b == emulated.token()  # the cluster's, fetched; never a second one
            assert oct(token_file.stat().st_mode & 0o777) == "0o600"
            assert token_b not in b_out + b_err  # never printed
            assert ray_pids(emulated) == before and job_status(emulated, job) == "RUNNING"
            assert tunnel_api(8276, f"/api/jobs/{job}", token_b)[1]["status"] == "RUNNING"  # B sees A's job
        finally:  # B's run over (stopped, when the test failed before it ended) and its tunnel closed
            if b_run.poll() is None:
                os.killpg(b_run.pid, signal.SIGTERM)
                b_run.communicate(timeout=120)
            close_tunnel(b)
        last = c_run.stderr.strip().splitlines()[-1]
        print(last)
        assert c_run.returncode != 0 and last.startswith("cluster-up: error: another run is changing cluster "
                                                         "emulated: "), last
        assert re.search(r": \S+@\S+ pid \d+ \(cluster-up\) since \d{4}-\d\d-\d\d [\d:]+ \S+ holds its lock "
                         r"on node-1; wait for it to end", last) and "nothing was changed" in last, last
        assert "PLAY [Nodes" not in c_run.stdout and untouched(c_run)
        assert job_status(emulated, job) == "RUNNING"
        assert emulated.api("/api/jobs/", emulated.token())[0] == 200


def test_a_node_that_is_down_is_named_and_nothing_is_changed(emulated):
    docker = "/usr/bin/docker"
    run([docker, "stop", "dlc-emu-node-3"], emulated.env, check=True)
    try:
        proc = emulated.cluster("up")
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("cluster-up: error:") and "node-3" in last and "unreachable" in last, last
        assert "nothing was changed" in last
        assert "PLAY [Nodes" not in proc.stdout
    finally:
        run([docker, "start", "dlc-emu-node-3"], emulated.env, check=True)
    # the node boots, systemd starts dlc-ray, and it joins the head again without any help
    assert sorted(emulated.wait_for_nodes(3)) == sorted(NODES.values())


