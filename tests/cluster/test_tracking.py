"""Run history: the local cluster's MLflow tracking server (basic auth on) holds every run, logged by
the harness from rank 0 under Ray and under a plain launcher; a resumed run continues its MLflow
run; a server stopped mid-run or refusing the credentials costs the run nothing but its history,
and its manifest says why; `make runs` lists it; a real browser signs in and draws its loss."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, SERVERS, plain_env, read_manifest, stop_server
from test_fault_tolerance import Running, kill, ray_train_workers

from dlcluster import local_cluster, record
from tests.browser import chromium, mlflow_chart_points, signed_in
from trainkit import contract

TINY = ["--image-size", "40x60", "--batch-size", "8"]


@pytest.fixture(scope="module")
def mlflow(cluster):
    """An MLflow client signed in with the cluster's credentials (read as a client reads them)."""
    r = record.load(cluster.config / record.RECORD)
    assert r.tracking_url and r.tracking_auth_path, r
    assert oct(os.stat(r.tracking_auth_path).st_mode & 0o777) == "0o600"
    user, password = open(r.tracking_auth_path).read().strip().split(":", 1)
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as env:  # the credentials leave with the module's tests
        for k, v in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password),
                     ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")):
            env.setenv(k, v)
        yield MlflowClient(r.tracking_url, registry_uri=r.tracking_url)


def find(mlflow, name: str):
    runs = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()],
                              f"attributes.run_name = '{name}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def steps(mlflow, run_id: str, key: str = "loss") -> list[int]:
    return sorted(m.step for m in mlflow.get_metric_history(run_id, key))


def submit(cluster, tmp_path, name: str, *args: str, **kw):
    return cluster.submit("ddp_autoencoder", *TINY, "--num-workers", "2", "--storage-path",
                          str(tmp_path / "runs"), "--name", name, "--output", str(tmp_path / name),
                          *args, **kw)


def make_runs(cluster, *args: str) -> str:
    proc = subprocess.run(["make", "-s", "runs", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**cluster.env, "MAKEFLAGS": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()  # after make setup's own lines
    return "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith(("run ", "run\t"))):])


@pytest.fixture(scope="module")
def tracked(cluster, mlflow, tmp_path_factory):
    """A Ray run of 2 epochs, then resumed to 3 by the same --name."""
    tmp = tmp_path_factory.mktemp("tracked")
    first = submit(cluster, tmp, "tracked", "--limit", "240", "--epochs", "2")
    assert first.returncode == 0, first.stdout[-3000:]
    m1 = read_manifest(tmp / "tracked")
    run_id = find(mlflow, "tracked").info.run_id
    second = submit(cluster, tmp, "tracked", "--limit", "240", "--epochs", "3")
    assert second.returncode == 0, second.stdout[-3000:]
    return {"tmp": tmp, "first": m1, "last": read_manifest(tmp / "tracked"), "run_id": run_id,
            "log": first.stdout + second.stdout}


def test_a_ray_run_is_tracked_with_its_flags_metrics_and_registered_model(mlflow, tracked):
    m, run_id = tracked["first"], tracked["run_id"]
    assert m["tracking"]["state"] == "tracked" and m["tracking"]["run_id"] == run_id, m["tracking"]
    assert m["tracking"]["epochs_logged"] == 2
    assert f"run history: {m['tracking']['page']}" in tracked["log"]
    r = mlflow.get_run(run_id)
    # the flags as params, as the driver parsed them
    p = r.data.params
    assert (p["epochs"], p["batch_size"], p["image_size"], p["num_workers"], p["name"], p["limit"]) == \
        ("2", "8", "40x60", "2", "tracked", "240"), p
    t = r.data.tags
    assert (t["dlc.job"], t["dlc.launcher"], t["dlc.world_size"], t["dlc.cluster"]) == \
        ("ddp_autoencoder", "ray", "2", "local"), t
    assert t["dlc.commit"] == m["git_commit"] and t["dlc.package"].startswith("gcs://"), t
    # the first publication: its ONNX file on the server is the manifest's, byte for byte
    artifacts = [f.path for f in mlflow.list_artifacts(run_id, "model")]
    assert len(artifacts) == 2, artifacts  # one folder per publication (the resume's second)
    first_folder = sorted(artifacts)[0]
    local = mlflow.download_artifacts(run_id, f"{first_folder}/model.onnx")
    assert hashlib.sha256(open(local, "rb").read()).hexdigest() == m["model_sha256"]
    manifest = json.load(open(mlflow.download_artifacts(run_id, f"{first_folder}/manifest.json")))
    assert manifest["model_sha256"] == m["model_sha256"]
    # registered under the job's name, each version with its model's sha256
    versions = {v.tags["model_sha256"]: v for v in mlflow.search_model_versions("name = 'ddp_autoencoder'")
                if v.run_id == run_id}
    assert set(versions) == {m["model_sha256"], tracked["last"]["model_sha256"]}, versions


def test_a_resumed_run_continues_its_mlflow_run(mlflow, tracked):
    m, run_id = tracked["last"], tracked["run_id"]
    assert m["tracking"]["run_id"] == run_id and m["tracking"]["state"] == "tracked"
    # one point per epoch, the resumed epoch 3 after the first run's 1 and 2
    assert steps(mlflow, run_id) == [1, 2, 3] == steps(mlflow, run_id, "val_loss")
    assert steps(mlflow, run_id, "samples_per_s") == [1, 2, 3]
    r = mlflow.get_run(run_id)
    assert r.info.status == "FINISHED" and r.data.tags["dlc.resumed"] == "1"
    assert r.data.tags["dlc.changed_flags"] == "epochs 2 -> 3", r.data.tags
    assert r.data.tags["dlc.model_sha256"] == m["model_sha256"] and r.data.tags["dlc.restarts"] == "0"


def test_make_runs_lists_the_run_and_its_epochs(cluster, tracked):
    listing = make_runs(cluster)
    head, *rows = listing.splitlines()
    assert head.split()[:5] == ["run", "owner", "job", "commit", "epochs"], listing
    row = next(r for r in rows if r.split()[0] == "tracked").split()
    # submitted with the cluster's token: the gateway's operator owns it
    assert row[1:5] == ["operator", "ddp_autoencoder", tracked["last"]["git_commit"][:12], "3"], row
    assert row[-2:] == [tracked["last"]["model_sha256"][:12], "finished"], row
    per_epoch = make_runs(cluster, "RUN=tracked")
    table = per_epoch.splitlines()[2:]  # after the run's line and its page
    assert table[0].split()[:3] == ["epoch", "loss", "val_loss"], per_epoch
    assert [line.split()[0] for line in table[1:]] == ["1", "2", "3"], per_epoch


def test_server_stopped_mid_run_costs_only_the_history(cluster, mlflow, tmp_path):
    """The tracking server is killed after the run's first epoch reached it: the job trains on,
    publishes a verified model, and its manifest says why the run is untracked."""
    state = json.loads((cluster.config / "clusters" / "local" / "state.json").read_text())
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(
        proc=submit(cluster, tmp_path, "unheard", "--epochs", "4", timeout=600)))
    job.start()
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if steps(mlflow, find(mlflow, "unheard").info.run_id):
                    break
            except AssertionError:  # the run is not on the server yet
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the run's first epoch never reached the tracking server")
        os.killpg(state["tracking_pid"], signal.SIGKILL)
        job.join(600)
    finally:
        job.join(600)
        healed = cluster.script("up")  # cluster-up starts a dead tracking server again
        assert "tracking: MLflow at" in healed.stdout, healed.stdout
    proc = result["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "not tracked (the server is not reachable" in proc.stdout, proc.stdout[-3000:]
    m = read_manifest(tmp_path / "unheard")
    assert m["parity"]["max_abs_diff"] <= m["parity"]["tolerance"]
    assert m["tracking"]["state"] == "untracked", m["tracking"]
    assert m["tracking"]["why"].endswith("the server is not reachable (connection refused)"), m["tracking"]
    assert m["run"]["epochs_trained"] == 4
    # the server is back with what it held: the run's first epoch(s)
    assert steps(mlflow, find(mlflow, "unheard").info.run_id)[0] == 1


def test_a_run_that_fails_is_ended_failed_not_left_running(cluster, mlflow, tmp_path):
    """A worker killed with no restarts left (--max-failures 0): the job fails, and its MLflow run
    says FAILED with the epochs it logged."""
    running = Running(cluster, "ddp_autoencoder", *TINY, "--num-workers", "2", "--limit", "1200",
                      "--epochs", "20", "--max-failures", "0", "--name", "doomed",
                      "--storage-path", str(tmp_path / "runs"), "--output", str(tmp_path / "doomed"))
    running.wait_for("epoch 2/20: ")
    kill(ray_train_workers(cluster)[-1:])
    running.proc.wait(timeout=300)
    running.reader.join(timeout=30)
    assert running.proc.returncode != 0, "".join(running.lines)[-3000:]
    r = mlflow.get_run(find(mlflow, "doomed").info.run_id)
    assert r.info.status == "FAILED", r.info
    # the epochs it logged, from the first: rank 0 logs an epoch after the driver prints it, so on a
    # loaded machine the kill after "epoch 2" once came before epoch 2 reached the server ([1])
    logged = steps(mlflow, r.info.run_id)
    assert logged and logged == list(range(1, len(logged) + 1)) and not (tmp_path / "doomed").exists(), logged


def wrong_credentials(tmp_path):
    bad = tmp_path / "bad_auth"
    bad.write_text("dlc:not-the-password\n")
    bad.chmod(0o600)
    return bad


@pytest.mark.parametrize("credentials", ["right", "wrong"])
def test_torchrun_is_tracked_from_rank_0_or_says_why_not(cluster, mlflow, tmp_path, credentials):
    """Two torchrun processes: rank 0 alone logs (one point per epoch); with credentials the
    server refuses, one warning line at the start and the run publishes untracked."""
    name = f"torchrun-{credentials}"
    env = {**plain_env(tmp_path), "DLC_CONFIG": str(cluster.config)}  # the record: URL, credentials
    if credentials == "wrong":
        env["DLC_TRACKING_AUTH"] = str(wrong_credentials(tmp_path))
    proc = subprocess.run(
        [str(REPO / ".venv/bin/torchrun"), "--nproc-per-node", "2", "jobs/ddp_autoencoder.py", *TINY,
         "--limit", "60", "--epochs", "2", "--name", name], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    m = read_manifest(tmp_path / "models" / name)
    if credentials == "right":
        assert m["tracking"]["state"] == "tracked", m["tracking"]
        run_id = find(mlflow, name).info.run_id
        assert steps(mlflow, run_id) == [1, 2]  # rank 0 only
        assert mlflow.get_run(run_id).data.tags["dlc.launcher"] == "torchrun"
    else:
        warning = [line for line in proc.stdout.splitlines() if "is not tracked" in line]
        assert len(warning) == 1 and "refused the credentials (401)" in warning[0], proc.stdout[-3000:]
        assert m["tracking"]["state"] == "untracked" and "401" in m["tracking"]["why"], m["tracking"]
        assert m["parity"]["max_abs_diff"] <= m["parity"]["tolerance"]


START_SERVER = """
import sys
from pathlib import Path
from dlcluster import local_cluster as lc
port = int(sys.argv[1])
proc = lc.start_tracking(port)
Path(sys.argv[2]).write_text(str(proc.pid))  # before it answers: a killed run's server is found
print(proc.pid, lc.tracking_ready(proc, port))
"""


def signed_in_status(url: str, user: str, password: str) -> int:
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", headers={
        "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_restarted_server_takes_the_clusters_password_as_it_is_now(tmp_path):
    """MLflow sets its admin's password only when it first makes the account: a local cluster's
    password file made anew (deleted, restored from elsewhere) left every job refused (401) after
    the server's next start. The server starts with the auth database in step with the file."""
    env = {**os.environ, "DLC_CONFIG": str(tmp_path / "config")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    # each server in the tier's state folder while it runs: the next run stops what a killed one left
    SERVERS.mkdir(parents=True, exist_ok=True)
    pidfiles = [SERVERS / f"{os.getpid()}-{n}" for n in range(2)]

    def start(pidfile: Path) -> tuple[int, str]:
        out = subprocess.run([str(REPO / ".venv/bin/python"), "-c", START_SERVER, str(port), str(pidfile)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
        pid, url = out.stdout.split()[-2:]
        assert url.startswith("http://"), out.stdout + out.stderr
        return int(pid), url

    auth = tmp_path / "config" / "clusters" / "local" / "tracking_auth"
    try:
        pid, url = start(pidfiles[0])
        first = auth.read_text().strip().split(":", 1)
        assert signed_in_status(url, *first) == 200
        os.killpg(pid, signal.SIGKILL)
        # its socket closes once its last process has ended: on a busy machine not yet at the next
        # start, which would say the port is taken (once in a full run, 2026-11-29)
        deadline = time.time() + 60
        while local_cluster.port_in_use(port):
            assert time.time() < deadline, f"port {port} still answers 60 s after the server was killed"
            time.sleep(0.2)
        auth.write_text("dlc:a-password-made-anew-0123456789\n")
        pid, url = start(pidfiles[1])
        assert signed_in_status(url, "dlc", "a-password-made-anew-0123456789") == 200
        assert signed_in_status(url, *first) == 401  # the old one no longer signs in
        assert "set to the cluster's" in (tmp_path / "config/clusters/local/mlflow/server.log").read_text()
    finally:
        for pidfile in pidfiles:  # both, even when the second start failed after it began
            stop_server(pidfile)


def test_the_server_asks_for_credentials(cluster):
    url = record.load(cluster.config / record.RECORD).tracking_url
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert e.value.code == 401



def test_a_browser_signs_in_and_draws_the_runs_loss(cluster, tracked, tmp_path):
    """MLflow's run page in a real browser, signed in with the cluster's credentials: the loss and
    validation loss charts draw one point per epoch (a chart without points fails). (docs/run-history.png
    is the emulated tier's: a run on the cluster through the tunnel.)"""
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium, and this is not root with apt-get to install Debian's")
    r = record.load(cluster.config / record.RECORD)
    user, password = open(r.tracking_auth_path).read().strip().split(":", 1)
    run_page = tracked["last"]["tracking"]["page"]  # in MLflow's model-training view
    assert run_page.endswith(contract.TRAINING_VIEW), run_page
    png = tmp_path / "run-history.png"
    with signed_in(browser, user, password) as page:
        page.goto(run_page.replace("?", "/model-metrics?", 1))
        assert mlflow_chart_points(page, "loss", 3) == 3
        # for the picture: the assistant's panel closed, charts no longer refreshed, the loss alone
        page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]').click()
        page.get_by_role("button", name="Auto-refresh").click()
        page.get_by_placeholder("Search metric charts").fill("loss")
        page.wait_for_function("() => !document.querySelector('h4[title=\"epoch\"]')", timeout=30_000)
        assert [mlflow_chart_points(page, t, 3) for t in ("loss", "val_loss")] == [3, 3]
        assert page.get_by_label(f"Account menu for {user}").count() == 1  # signed in as the cluster's user
        page.wait_for_timeout(1000)  # the last chart's fade-in
        assert [mlflow_chart_points(page, t, 3) for t in ("loss", "val_loss")] == [3, 3]
        page.screenshot(path=str(png))
    print(f"screenshot: {png}")
