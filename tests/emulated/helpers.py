"""What the emulated tier's modules share: the job API's jobs and how a test's jobs are stopped,
submissions and their published models, the tunnel and second operators, inventories edited
for a test, the images. A helper one module alone uses lives in that module."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from conftest import (
    BIN,
    INVENTORY,
    NODES,
    PORT,
    REPO,
    recap,
    run,
)

ENDED = ("STOPPED", "FAILED", "SUCCEEDED")
# Whether the servers run what the emulated inventory says, as the fixture's cluster-up left them:
# the jump-host and changed-setting tests take them from it (the second, with rotate-token, back);
# the second operator's test, whose full run must change nothing, converges them first when not
CONVERGED = {"servers": True}


def jobs(emulated) -> dict[str, dict]:
    """The jobs the cluster's job API lists, by submission id ({} when it does not answer, as after
    cluster-down)."""
    try:
        token = emulated.token()
    except OSError:
        return {}
    code, body = emulated.api("/api/jobs/", token)
    if code != 200 or not isinstance(body, list):
        return {}
    return {j["submission_id"]: j for j in body if j.get("submission_id")}


def stop_jobs(emulated, ids) -> None:
    """ray job stop for each (through the tunnel, with the token), then waited for until it ended."""
    for job_id in ids:
        run([str(BIN / "ray"), "job", "stop", job_id], emulated.client_env(), timeout=120)
    deadline = time.time() + 120
    for job_id in ids:
        while job_status(emulated, job_id) not in ENDED:
            assert time.time() < deadline, f"{job_id} is {job_status(emulated, job_id)} after ray job stop"
            time.sleep(1)


def running_jobs_of(emulated, name: str) -> list[str]:
    """The jobs of run `name` (its --name) that have not ended."""
    return [i for i, j in jobs(emulated).items() if j.get("status") not in ENDED
            and re.search(rf"--name {re.escape(name)}(\s|$)", j.get("entrypoint") or "")]


def stop_run(emulated, name: str, client: subprocess.Popen) -> None:
    """Run `name` stopped as an operator stops it (ray job stop: killing its client alone leaves the
    job running), then its client, which follows the job's log, waited for (killed if it stays)."""
    stop_jobs(emulated, running_jobs_of(emulated, name))
    try:
        client.wait(timeout=120)
    except subprocess.TimeoutExpired:
        client.kill()


TLS = "/etc/dlcluster/tls"  # a node's key and certificates for Ray's TLS (roles/ray: ray_tls_dir)
def ray_pids(emulated) -> dict[str, str]:
    return {n: emulated.ssh(n, "systemctl", "show", "-p", "MainPID", "--value", "dlc-ray").stdout.strip()
            for n in NODES}


def job_status(emulated, job_id: str, token: str | None = None) -> str:
    code, body = emulated.api(f"/api/jobs/{job_id}", token or emulated.token())
    return body["status"] if code == 200 else f"HTTP {code}"


def operator(emulated, tmp_path: Path, name: str, port: int) -> dict:
    """A second operator: a config folder of their own (empty but for the same ssh key), their
    own tunnel port."""
    config = tmp_path / name
    shutil.copytree(emulated.config / "emulated", config / "emulated")  # the key the inventory names
    return {**emulated.env, "DLC_CONFIG": str(config), "DASHBOARD_PORT": str(port),
            "METRICS_PORT": str(port + 1000), "GRAFANA_PORT": str(port + 2000),
            "TRACKING_PORT": str(port + 3000), "INVENTORY": str(INVENTORY)}


def submit(emulated, *args: str, background: bool = False):
    """The README's `ray job submit` through the tunnel, with the job's flags."""
    cmd = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{PORT}",
           "--working-dir", ".", "--", "python", "jobs/ddp_autoencoder.py", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=emulated.client_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if background:
        return proc
    out = proc.communicate(timeout=1200)[0]
    print(out[-5000:])
    assert proc.returncode == 0 and "succeeded" in out, out[-3000:]
    return out


def published(emulated, name: str) -> dict:
    record = json.loads(emulated.ssh("node-2", "cat", f"/srv/dlcluster/runs/{name}/published.json").stdout)
    return json.loads(emulated.ssh("node-2", "cat", record["manifest"]).stdout)


def registered(emulated, name: str) -> bool:
    """Whether Ray Train's controller has registered a checkpoint of run `name` (shared storage)."""
    found = emulated.ssh("node-1", "find", f"/srv/dlcluster/runs/{name}", "-name",
                         "checkpoint_manager_snapshot.json").stdout.split()
    for path in found:
        try:
            if json.loads(emulated.ssh("node-1", "cat", path).stdout).get("checkpoint_results"):
                return True
        except ValueError:
            pass  # being rewritten: read again
    return False


def elastic_run(emulated, name: str, epochs: int, limit: int = 1500,
                *flags: str) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """The README's job as an elastic run (2-3 workers) in the background, its output collected in
    `lines` by `reader` as it comes."""
    proc = submit(emulated, "--name", name, "--num-workers", "2-3", "--epochs", str(epochs),
                  "--limit", str(limit), "--image-size", "60x80", "--batch-size", "16", *flags,
                  background=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    return proc, lines, reader


PROBE = (Path(__file__).parent / "probe.py").read_text()

STRANGER = (Path(__file__).parent / "stranger.py").read_text()
# the head's GCS, Ray Client server, dashboard (job API), dashboard agent and metrics (roles/ray)
PORTS_OF_THE_HEAD = ["6379", "10001", "8265", "52365", "8080"]


def tracking_status(url: str, creds: str) -> int:
    """The run history's HTTP status for `url` (through the tunnel) with `user:password`."""
    basic = base64.b64encode(creds.encode()).decode()
    ask = urllib.request.Request(url, headers={"Authorization": f"Basic {basic}"})
    try:
        return urllib.request.urlopen(ask, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def member_certs(node: str, dest: Path) -> Path:
    """A copy of `node`'s TLS folder (its key, its certificate, the CA's), as its Ray has them,
    readable by a probing container's user."""
    subprocess.run(["docker", "cp", f"dlc-emu-{node}:{TLS}", str(dest)], check=True)
    dest.chmod(0o755)
    for f in dest.iterdir():
        f.chmod(0o644)
    return dest


def ask_ray(emulated, token: str | None, certs: Path | None, ip: int, *only: str) -> dict:
    """stranger.py from a container of the project's image at 172.31.251.<ip> on the private
    network: what the head's Ray services answer with that token (None: none) and those
    certificates (None: no TLS)."""
    env = {**emulated.env, **({"RAY_AUTH_TOKEN": token} if token else {})}
    auth = ["-e", "RAY_AUTH_MODE=token", "-e", "RAY_AUTH_TOKEN"] if token else []  # not in argv
    tls = ["-v", f"{certs}:/tls:ro", "-e", "RAY_USE_TLS=1", "-e", "RAY_TLS_SERVER_CERT=/tls/node.crt",
           "-e", "RAY_TLS_SERVER_KEY=/tls/node.key", "-e", "RAY_TLS_CA_CERT=/tls/ca.crt"] if certs else []
    proc = subprocess.run(["docker", "run", "--rm", "-i", "--network", "dlc-emu-private", "--ip",
                           f"172.31.251.{ip}", *auth, *tls, "--entrypoint", "python",
                           "dlcluster:cpu", "-", NODES["node-1"], *PORTS_OF_THE_HEAD, *only],
                          input=STRANGER, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def untouched(proc: subprocess.CompletedProcess) -> bool:
    """No node (nor the bastion) in the run's PLAY RECAP with a change: nothing was changed on
    any server (the control host's own files, e.g. its ssh config, may be)."""
    changed = {h: v["changed"] for h, v in recap(proc.stdout).items() if h != "localhost" and v["changed"]}
    assert not changed, f"changed on {changed}: {proc.stdout[-2000:]}"
    return True


def _inventory(tmp_path: Path, name: str, text: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "hosts.yml").write_text(text)
    return folder / "hosts.yml"


EMULATED = (REPO / "ansible/inventories/emulated/hosts.yml").read_text()


# The bastion as another team runs it: sshd on 2222, a `jump` login with no sudo, reached through
# an outer gateway (emulate.sh). The inventory's folder is `emulated` too: the same cluster (its
# known_hosts, record, tunnel), so the nodes see no change.
JUMP = EMULATED.replace("""        bastion:
          ansible_host: 172.31.250.10
""", """        bastion:
          ansible_host: 172.31.250.10
          ansible_port: 2222
          ansible_user: jump
""").replace("    ray_object_store_memory:", """    dlc_ssh_gateway: jump@172.31.250.20:2222
    ray_object_store_memory:""")


def _jump_inventory(tmp_path: Path, settings: str, registry: bool = False) -> Path:
    """A jump host only (no sudo): node-3's image streamed from here, unless `registry`."""
    text = JUMP.replace("    ray_object_store_memory:", settings + "    ray_object_store_memory:")
    if not registry:
        text = text.replace("docker_image_from: bastion", "docker_image_from: control")
    assert "ansible_port: 2222" in text and "ansible_user: jump" in text
    return _inventory(tmp_path, "emulated", text)


@contextmanager
def held_job(emulated):
    """A job that holds the cluster (it sleeps: what is proved is that running jobs are waited
    for, not training), stopped at the end."""
    ray, job_id = [str(BIN / "ray"), "job"], f"held-{time.time_ns()}"
    run([*ray, "submit", "--no-wait", "--submission-id", job_id, "--", "sleep", "600"],
        emulated.client_env(), timeout=120, check=True)
    deadline = time.time() + 120
    while job_status(emulated, job_id) != "RUNNING":
        assert time.time() < deadline, f"the sleeping job is {job_status(emulated, job_id)} after 120 s"
        time.sleep(1)
    try:
        yield job_id
    finally:
        run([*ray, "stop", job_id], emulated.client_env(), timeout=120)
        deadline = time.time() + 120
        while job_status(emulated, job_id) not in ("STOPPED", "FAILED", "SUCCEEDED"):
            assert time.time() < deadline, f"{job_id} is {job_status(emulated, job_id)} after ray job stop"
            time.sleep(1)
