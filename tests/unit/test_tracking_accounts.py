"""The run history's accounts (security review M1) and its front (M2). Every node holds the jobs'
account, so what one job may do, every job may. A real MLflow server (its basic-auth app, SQLite
here in place of the head's PostgreSQL) started as roles/tracking's unit starts it (its ExecStart:
its own socket, the names it answers to) with the role's own mlflow-auth.ini and sign-in rule
(files/dlc_mlflow_auth.py): the jobs' account logs a run and registers a model as the README's
job does, and is refused (403) changing its password, deleting or renaming what was made, and
changing permissions; the administrator may. It listens on no port, answers only to its name and
the loopback's, and takes rotate-token's new administrator password on its socket."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jinja2
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible/roles/tracking"
ADMIN, JOBS = ("dlc", "admin-password-0123456789"), ("dlc-jobs", "jobs-password-0123456789")
NAME = "run-history.dlcluster.internal:5000"  # as the nodes ask for it (through its TLS end)


def rendered_ini(db: Path) -> str:
    """mlflow-auth.ini as the role writes it, its database a SQLite file here."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"),
                             undefined=jinja2.StrictUndefined)
    text = env.get_template("mlflow-auth.ini.j2").render(
        ansible_managed="managed", tracking_db_user="mlflow", tracking_db_password="x", tracking_auth_db="a",
        dlc_tracking_user=ADMIN[0], tracking_password=ADMIN[1], tracking_auth_cache_seconds=60)
    assert "authorization_function = dlc_mlflow_auth:authenticate" in text.splitlines()
    return "\n".join(f"database_uri = sqlite:///{db}" if line.startswith("database_uri") else line
                     for line in text.splitlines()) + "\n"


def unit_argv(sock: Path, port: int) -> list[str]:
    """The server's command line as roles/tracking's unit (host runtime) renders it with the role's
    own defaults and vars, this checkout's MLflow, its socket `sock`."""
    role = {**yaml.safe_load((ROLE / "defaults/main.yml").read_text()),
            **yaml.safe_load((ROLE / "vars/main.yml").read_text())}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"),
                             undefined=jinja2.StrictUndefined)
    env.filters.update(bool=bool, quote=shlex.quote, dirname=os.path.dirname,
                       ternary=lambda cond, yes, no: yes if cond else no)
    values = dict(dlc_tracking_name=NAME.split(":")[0], dlc_tracking_port=5000, dlc_tracking_socket=str(sock))
    allowed = env.from_string(role["tracking_allowed_hosts"]).render(**values)
    unit = env.get_template("dlc-mlflow.service.j2").render(
        **{**role, "tracking_allowed_hosts": allowed}, **values, ansible_managed="m", dlc_cluster_name="c",
        dlc_ray_runtime="host", firewall_enabled=False, dlc_venv=str(Path(sys.executable).parent.parent))
    (start,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart=")]
    argv = shlex.split(start)
    assert argv[argv.index("--port") + 1] == "5000"
    argv[argv.index("--port") + 1] = str(port)  # a free one here: the server must not take it
    return [str(Path(sys.executable).parent / "mlflow"), *argv[1:]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run-history")
    (tmp / "auth.ini").write_text(rendered_ini(tmp / "auth.db"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = tmp / "front/server.sock"
    sock.parent.mkdir(mode=0o750)
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(tmp / "auth.ini"),
           "PYTHONPATH": str(ROLE / "files"), "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           "MLFLOW_ARTIFACTS_DESTINATION": str(tmp / "artifacts"),
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "k" * 32, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp / "server.log", "wb")  # noqa: SIM115  (the server's, for its whole life)
    argv = unit_argv(sock, port)
    proc = subprocess.Popen([*argv[:-2], "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=tmp)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
            try:
                if ask(sock, None, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        assert ask(sock, ADMIN, "POST", "users/create", username=JOBS[0], password=JOBS[1])[0] == 200
        yield {"socket": sock, "port": port, "tmp": tmp}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path):
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(self.path))


def ask(sock: Path, who: tuple[str, str] | None, method: str, route: str, raw: bytes | None = None,
        host: str = NAME, **body) -> tuple[int, dict | str]:
    """One REST call of MLflow's (/api/2.0/mlflow/<route>, or a full path) as `who`, on the server's
    socket, for the name `host` (the Host header its TLS end passes on)."""
    path = route if route.startswith("/") else f"/api/2.0/mlflow/{route}"
    headers = {"Host": host, "Content-Type": "application/json"}
    if who is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(who).encode()).decode()
    conn = _Unix(sock)
    try:
        conn.request(method, path, body=raw if raw is not None else (json.dumps(body) if body else None),
                     headers=headers)
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, json.loads(text) if text.strip().startswith("{") else text
    finally:
        conn.close()


def test_the_jobs_account_logs_and_registers_but_manages_no_account_and_deletes_nothing(server):
    sock = server["socket"]
    # what a job's rank 0 does (trainkit/tracking.py): an experiment, a run, its artifact, a model
    code, made = ask(sock, JOBS, "POST", "experiments/create", name="ddp_autoencoder")
    assert code == 200, made
    experiment = made["experiment_id"]
    code, made = ask(sock, JOBS, "POST", "runs/create", experiment_id=experiment, run_name="r1")
    assert code == 200, made
    run = made["run"]["info"]["run_id"]
    artifact = f"/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/model.onnx"
    assert ask(sock, JOBS, "PUT", artifact, raw=b"onnx")[0] == 200
    assert ask(sock, JOBS, "POST", "runs/update", run_id=run, status="FINISHED")[0] == 200
    assert ask(sock, JOBS, "POST", "registered-models/create", name="ddp_autoencoder")[0] == 200
    assert ask(sock, JOBS, "POST", "model-versions/create", name="ddp_autoencoder", run_id=run,
               source=f"mlflow-artifacts:/{experiment}/{run}/artifacts")[0] == 200
    # what would lock the other jobs out, or remove or rename what another job made
    refused = {
        "its own password": ("PATCH", "users/update-password",
                             {"username": JOBS[0], "password": "n" * 24, "current_password": JOBS[1]}),
        "an account": ("POST", "users/create", {"username": "intruder", "password": "p" * 24}),
        "the model": ("DELETE", "registered-models/delete", {"name": "ddp_autoencoder"}),
        "its version": ("DELETE", "model-versions/delete", {"name": "ddp_autoencoder", "version": "1"}),
        "the model's name": ("POST", "registered-models/rename",
                             {"name": "ddp_autoencoder", "new_name": "x"}),
        "the run": ("POST", "runs/delete", {"run_id": run}),
        "the experiment": ("POST", "experiments/delete", {"experiment_id": experiment}),
        "the experiment's name": ("POST", "experiments/update",
                                  {"experiment_id": experiment, "new_name": "x"}),
        "a permission": ("POST", "registered-models/permissions/create",
                         {"name": "ddp_autoencoder", "username": JOBS[0], "permission": "READ"}),
        "the artifact": ("DELETE", artifact, {}),
    }
    for what, (method, route, body) in refused.items():
        code, said = ask(sock, JOBS, method, route, **body)
        assert code == 403, (what, code, said)
    assert "dlc-jobs is not an administrator of the run history" in ask(
        sock, JOBS, "PATCH", "users/update-password", username=JOBS[0], password="n" * 24,
        current_password=JOBS[1])[1]
    # all of it still there, the password unchanged
    code, got = ask(sock, JOBS, "GET", "registered-models/get?name=ddp_autoencoder")
    assert code == 200 and got["registered_model"]["name"] == "ddp_autoencoder"
    code, got = ask(sock, JOBS, "GET", f"runs/get?run_id={run}")
    assert code == 200 and got["run"]["info"]["lifecycle_stage"] == "active"
    # the administrator may (after which the old password is refused)
    assert ask(sock, ADMIN, "DELETE", "registered-models/delete", name="ddp_autoencoder")[0] == 200
    assert ask(sock, ADMIN, "PATCH", "users/update-password", username=JOBS[0], password="n" * 24)[0] == 200
    assert ask(sock, ("dlc-jobs", "n" * 24), "GET", f"runs/get?run_id={run}")[0] == 200


def test_the_server_answers_on_its_socket_alone_to_its_names_and_takes_a_new_password_there(server):
    """M2: no job can reach the server past its TLS end or take its place: it listens on its socket
    (its folder the server's and its fronts', roles/tracking), on no port, so none is free while it
    restarts; it answers the names the nodes and the tunnel ask for, not the head's address.
    rotate-token's script (roles/control_host: control_tracking_rotate_py) sets the administrator's
    new password through that socket."""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", server["port"])) != 0  # the unit's --port: not taken
    sock = server["socket"]
    for host in (NAME, "localhost", "127.0.0.1:5000"):  # the nodes', the head's own checks', the tunnel's
        assert ask(sock, ADMIN, "GET", "experiments/search?max_results=1", host=host)[0] == 200, host
    for host in ("10.0.0.1:5000", "evil.example:5000"):  # the head's address: not a name it has
        assert ask(sock, ADMIN, "GET", "experiments/search?max_results=1", host=host)[0] == 403, host
    script = yaml.safe_load((REPO / "ansible/roles/control_host/vars/main.yml").read_text())[
        "control_tracking_rotate_py"].replace("/etc/dlcluster/", f"{server['tmp']}/")  # the head's, here
    new = ("dlc", "rotated-password-0123456789")

    def rotate() -> subprocess.CompletedProcess:  # stdin: the password now, then the new one
        return subprocess.run([sys.executable, "-c", script, str(sock)], capture_output=True, text=True,
                              input=f"{':'.join(ADMIN)}\n{':'.join(new)}\n", timeout=60)
    done = rotate()
    assert (done.returncode, done.stdout.strip()) == (0, "rotated"), done.stdout + done.stderr
    assert (server["tmp"] / "tracking_admin_auth").read_text() == ":".join(new) + "\n"
    assert ask(sock, new, "GET", "experiments/search?max_results=1")[0] == 200
    again = rotate()  # the old password: refused
    assert (again.returncode, again.stdout.strip()) == (1, "the server answered 401"), again.stdout
