"""The run history's accounts (security review M1): every node holds the jobs' account, so what one
job may do, every job may. A real MLflow server (its basic-auth app, SQLite here in place of the
head's PostgreSQL) started with roles/tracking's own mlflow-auth.ini and sign-in rule
(files/dlc_mlflow_auth.py): the jobs' account logs a run and registers a model as the README's
job does, and is refused (403) changing its password, deleting or renaming what was made, and
changing permissions; the administrator may."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import jinja2
import pytest

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "ansible/roles/tracking"
ADMIN, JOBS = ("dlc", "admin-password-0123456789"), ("dlc-jobs", "jobs-password-0123456789")


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run-history")
    (tmp / "auth.ini").write_text(rendered_ini(tmp / "auth.db"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(tmp / "auth.ini"),
           "PYTHONPATH": str(ROLE / "files"),
           "MLFLOW_FLASK_SERVER_SECRET_KEY": "k" * 32, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp / "server.log", "wb")  # noqa: SIM115  (the server's, for its whole life)
    mlflow = str(Path(sys.executable).parent / "mlflow")
    proc = subprocess.Popen([mlflow, "server", "--app-name", "basic-auth",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (tmp / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        assert ask(url, ADMIN, "POST", "users/create", username=JOBS[0], password=JOBS[1])[0] == 200
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def ask(url: str, who: tuple[str, str], method: str, route: str, **body) -> tuple[int, dict | str]:
    """One REST call of MLflow's (/api/2.0/mlflow/<route>, or a full path) as `who`."""
    path = route if route.startswith("/") else f"/api/2.0/mlflow/{route}"
    data = json.dumps(body).encode() if body else None
    basic = base64.b64encode(":".join(who).encode()).decode()
    headers = {"Authorization": f"Basic {basic}", "Content-Type": "application/json"}
    req = urllib.request.Request(f"{url}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text.strip().startswith("{") else text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_jobs_account_logs_and_registers_but_manages_no_account_and_deletes_nothing(server):
    # what a job's rank 0 does (trainkit/tracking.py): an experiment, a run, its artifact, a model
    code, made = ask(server, JOBS, "POST", "experiments/create", name="ddp_autoencoder")
    assert code == 200, made
    experiment = made["experiment_id"]
    code, made = ask(server, JOBS, "POST", "runs/create", experiment_id=experiment, run_name="r1")
    assert code == 200, made
    run = made["run"]["info"]["run_id"]
    artifact = f"/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/model.onnx"
    put = urllib.request.Request(f"{server}{artifact}", data=b"onnx", method="PUT", headers={
        "Authorization": "Basic " + base64.b64encode(":".join(JOBS).encode()).decode()})
    with urllib.request.urlopen(put, timeout=30) as r:
        assert r.status == 200
    assert ask(server, JOBS, "POST", "runs/update", run_id=run, status="FINISHED")[0] == 200
    assert ask(server, JOBS, "POST", "registered-models/create", name="ddp_autoencoder")[0] == 200
    assert ask(server, JOBS, "POST", "model-versions/create", name="ddp_autoencoder", run_id=run,
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
        code, said = ask(server, JOBS, method, route, **body)
        assert code == 403, (what, code, said)
    assert "dlc-jobs is not an administrator of the run history" in ask(
        server, JOBS, "PATCH", "users/update-password", username=JOBS[0], password="n" * 24,
        current_password=JOBS[1])[1]
    # all of it still there, the password unchanged
    code, got = ask(server, JOBS, "GET", "registered-models/get?name=ddp_autoencoder")
    assert code == 200 and got["registered_model"]["name"] == "ddp_autoencoder"
    code, got = ask(server, JOBS, "GET", f"runs/get?run_id={run}")
    assert code == 200 and got["run"]["info"]["lifecycle_stage"] == "active"
    # the administrator may (after which the old password is refused)
    assert ask(server, ADMIN, "DELETE", "registered-models/delete", name="ddp_autoencoder")[0] == 200
    assert ask(server, ADMIN, "PATCH", "users/update-password", username=JOBS[0], password="n" * 24)[0] == 200
    assert ask(server, ("dlc-jobs", "n" * 24), "GET", f"runs/get?run_id={run}")[0] == 200
