"""The README's job through the tunnel (one run, shared by the module): across the nodes, in
Prometheus in a browser, in the run history behind its sign-in (the language model sharded across
the three nodes is make smoke's, test_50)."""

from __future__ import annotations

import base64
import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import (
    BIN,
    METRICS_PORT,
    NODES,
    PORT,
    REPO,
    TRACKING_PORT,
    run,
)
from helpers import published, running_jobs_of, stop_jobs

from dlcluster import record
from tests.browser import LAUNCH_ARGS, chromium, mlflow_chart_points, signed_in
from tests.promql import wait_for_query
from trainkit import tracking

pytestmark = pytest.mark.timeout(1800)
# the run history's name on the cluster's network (its certificate's, the nodes' DLC_TRACKING_URL)
TRACKING_NAME = yaml.safe_load((REPO / "ansible/roles/cluster_defaults/defaults/main.yml").read_text()
                               )["dlc_tracking_name"]


@dataclass
class Run:
    """A run submitted through the tunnel: its name, and its client's exit status and output."""
    name: str
    returncode: int
    out: str

    @property
    def succeeded(self) -> bool:
        return self.returncode == 0 and "succeeded" in self.out


@pytest.fixture(scope="module")
def readme_run(emulated) -> Run:
    """The README's line, with the env that make cluster-up wrote (and a run name to find it by),
    submitted once: by the README test, or by the first test that reads its run (the Prometheus
    graph, the run history) when that runs without it (-k run_history). A full run trains it once."""
    name = f"readme-{int(time.time())}"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{PORT}",
           "--working-dir", ".", "--", "python", "jobs/ddp_autoencoder.py", "--name", name]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=emulated.client_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=1200)
    finally:  # a run that outlived its client's time is stopped, not left holding the CPUs
        stop_jobs(emulated, running_jobs_of(emulated, name))
    print(proc.stdout[-5000:])
    return Run(name, proc.returncode, proc.stdout)


def test_readme_job_runs_across_the_nodes_through_the_tunnel(emulated, readme_run):
    name, out = readme_run.name, readme_run.out
    assert readme_run.succeeded, out[-3000:]
    # the run's record on the shared storage says where its model went (DLC_STORAGE_PATH/<name>)
    published = json.loads(emulated.ssh("node-3", "cat", f"/srv/dlcluster/runs/{name}/published.json").stdout)
    model, manifest_path = published["model"], published["manifest"]
    assert model.startswith(f"/srv/dlcluster/models/{name}/publications/") and model.endswith("/model.onnx")
    assert "3 worker(s) on CPU" in out
    # the model is on the shared storage: a worker node sees it
    assert emulated.ssh("node-3", "test", "-s", model).returncode == 0
    manifest = json.loads(emulated.ssh("node-2", "cat", manifest_path).stdout)
    assert manifest["parity"]["max_abs_diff"] <= manifest["parity"]["tolerance"]
    assert manifest["world_size"] == 3
    # --num-workers auto: one rank on each node, as the ranks themselves reported
    assert sorted(manifest["replica_hosts"]) == ["node-1", "node-2", "node-3"], manifest["replica_hosts"]
    # a mixed cluster, as during a migration: node-3's rank ran in the project's image (its
    # dlc-ray service runs Ray in a container there), the others in the nodes' virtualenv
    runtimes = dict(zip(manifest["replica_hosts"], manifest["replica_runtimes"], strict=True))
    assert runtimes == {"node-1": "host", "node-2": "host", "node-3": "docker"}, runtimes
    head = run(["git", "rev-parse", "HEAD"], emulated.env, check=True).stdout.strip()
    assert manifest["git_commit"].startswith(head)  # "-dirty" after it when the tree has changes
    # Prometheus on the head, through the same tunnel (the record names it): every node's exporter
    # and Ray metrics up, and the run's training samples/s there by its name, as the job measured it
    metrics = record.load(emulated.config / record.RECORD).metrics_url
    assert metrics == f"http://127.0.0.1:{METRICS_PORT}"
    up = wait_for_query(metrics, "up", lambda r: len(r) == 7 and all(s["value"][1] == "1" for s in r))
    assert sorted((s["metric"]["job"], s["metric"]["node"]) for s in up) == sorted(
        [("prometheus", "node-1")] + [(job, n) for job in ("node", "ray") for n in NODES])
    measured = manifest["metrics"]["samples_per_s"]
    query = f'max_over_time(ray_dlc_train_samples_per_second{{run="{name}"}}[30m])'
    (series,) = wait_for_query(metrics, query, lambda r: len(r) == 1)
    assert series["metric"]["dlc_job"] == "ddp_autoencoder"
    assert abs(float(series["value"][1]) - measured) <= 0.2 * measured, (series, measured)
    # no Grafana on the emulated head (its nodes reach only the distribution's mirrors): the first
    # cluster-up said so in one line, carried on with Prometheus alone, and the record names none
    said = " ".join(emulated.up.stdout.split())
    grafana = "node-1: no Grafana: its package source https://apt.grafana.com is not reachable"
    assert said.count(grafana) == 1, said[-3000:]
    assert "set dlc_grafana: false to leave Grafana out" in said and "dashboards: no Grafana" in said
    assert record.load(emulated.config / record.RECORD).grafana_url is None


# Prometheus' graph page (the distribution's: its classic UI, where Rickshaw draws each series as an
# SVG path in the graph and lists it in the legend below): the legend's series and, for each path
# of the graph, its data points joined by a line (a series' `d` is "M x,y L x,y ...", moving on with
# "M" past a step without data; the grid's path has no "L")
_PROMETHEUS_GRAPH = """() => ({
  legend: [...document.querySelectorAll('.legend li.line .label')].map(e => e.textContent),
  lines: [...document.querySelectorAll('.graph_area .graph svg path')].map(p => (p.getAttribute('d') || '')
    .split('M').filter(seg => seg.includes('L')).reduce((n, seg) => n + seg.split('L').length, 0)),
  error: [...document.querySelectorAll('.error')].map(e => e.textContent.trim()).join(' '),
})"""


@contextmanager
def browser_page(browser: str, size: tuple[int, int]):
    """A page of a real browser (Playwright driving the distribution's Chromium), closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=browser, args=LAUNCH_ARGS)
        try:
            yield chrome.new_page(viewport={"width": size[0], "height": size[1]})
        finally:
            chrome.close()


def test_prometheus_graphs_the_readme_runs_samples_per_second_in_a_browser(emulated, readme_run, tmp_path):
    """Prometheus' graph page, opened in a real browser through the tunnel, draws the training
    samples/s of the README job's run: its legend names the one series Prometheus' query API holds
    for the run over the graph's range, and the chart drew a line through that series' points. Its
    picture is docs/metrics-prometheus.png."""
    assert readme_run.succeeded, f"the README job's run {readme_run.name} failed: {readme_run.out[-2000:]}"
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium, and this is not root with apt-get to install Debian's")
    metrics = record.load(emulated.config / record.RECORD).metrics_url
    expr = f'ray_dlc_train_samples_per_second{{run="{readme_run.name}"}}'
    # Prometheus' own answer over the graph's range, at the step the page takes (30 min / 250: 7 s);
    # scrapes come every few seconds, so it is waited for
    deadline = time.time() + 90
    while True:
        now = time.time()
        url = f"{metrics}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": expr, "start": now - 1800, "end": now, "step": 7})
        with urllib.request.urlopen(url, timeout=10) as r:
            held = json.loads(r.read())["data"]["result"]
        if (len(held) == 1 and len(held[0]["values"]) >= 2) or time.time() > deadline:
            break
        time.sleep(2)
    assert len(held) == 1 and len(held[0]["values"]) >= 2, \
        f"Prometheus holds no series of two points or more for {expr} in the last 30 minutes: {held}"
    labels = held[0]["metric"]
    # the legend's name of a series: the page's own (its metricToTsName), the labels in the API's order
    series = labels["__name__"] + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()
                                                 if k != "__name__") + "}"
    page_url = (f"{metrics}/graph?" + urllib.parse.urlencode(
        {"g0.expr": expr, "g0.tab": "0", "g0.range_input": "30m"}))
    png = tmp_path / "metrics-prometheus.png"
    with browser_page(browser, (1280, 900)) as page:  # through the tunnel, as an operator
        page.goto(page_url)
        try:  # the page asks Prometheus, then draws
            page.wait_for_function(f"() => ({_PROMETHEUS_GRAPH})().lines.some(n => n >= 2)", timeout=90_000)
        except Exception:  # noqa: BLE001  (what it drew says why)
            pass
        drawn = page.evaluate(_PROMETHEUS_GRAPH)
        page.screenshot(path=str(png))
    print(f"Prometheus holds {len(held[0]['values'])} points of {series}; the page drew {drawn}")
    print(f"screenshot: {png}")
    # the legend names that series alone (not the query typed into the page), and the chart joined
    # two or more of its points with a line
    assert drawn["legend"] == [series], drawn
    assert max(drawn["lines"], default=0) >= 2, drawn


def test_the_run_history_holds_the_readme_run_behind_its_sign_in(emulated, readme_run, tmp_path, monkeypatch):
    """MLflow on the head, through the tunnel (the record names it): 401 without the cluster's
    credentials, 200 with them; the README job's run is there, logged by its rank 0 on a node,
    with its model registered under the job's name (its sha256 the manifest's); a real browser signs
    in and draws the run's loss. Its picture is docs/run-history.png."""
    assert readme_run.succeeded, f"the README job's run {readme_run.name} failed: {readme_run.out[-2000:]}"
    r = record.load(emulated.config / record.RECORD)
    assert r.tracking_url == f"http://127.0.0.1:{TRACKING_PORT}", r.tracking_url
    assert oct(Path(r.tracking_auth_path).stat().st_mode & 0o777) == "0o600"
    said = " ".join(emulated.up.stdout.split())
    assert f"run history: MLflow at http://127.0.0.1:{TRACKING_PORT} (user dlc" in said, said[-3000:]
    search = f"{r.tracking_url}/api/2.0/mlflow/experiments/search?max_results=5"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(search, timeout=10)
    assert refused.value.code == 401
    user, password = Path(r.tracking_auth_path).read_text().strip().split(":", 1)
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    with urllib.request.urlopen(urllib.request.Request(search, headers={"Authorization": f"Basic {basic}"}),
                                timeout=10) as answer:
        assert answer.status == 200 and "ddp_autoencoder" in answer.read().decode()
    # every node's Ray holds the credentials for its jobs' rank 0, readable by Ray's account alone
    for node in NODES:  # (ssh joins its arguments into one command line: the format quoted in it)
        assert emulated.ssh(node, "sudo stat -c '%a %U %G' /etc/dlcluster/tracking_auth"
                            ).stdout.split() == ["640", "root", "raysvc"], node
    # the nodes hold the jobs' account, not the administrator's: it logged the README run above, and
    # may not make an account; the administrator's copy on the head is root's alone
    jobs_user, jobs_password = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth"
                                            ).stdout.strip().split(":", 1)
    assert jobs_user == "dlc-jobs" and jobs_password != password
    make_user = urllib.request.Request(
        f"{r.tracking_url}/api/2.0/mlflow/users/create", method="POST",
        data=json.dumps({"username": "intruder", "password": "p" * 16}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(
            f"{jobs_user}:{jobs_password}".encode()).decode()})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(make_user, timeout=10)
    assert refused.value.code == 403
    # nor change its own password (locking every other job out), nor delete the README run's model,
    # which it registered itself (roles/tracking's sign-in rule, files/dlc_mlflow_auth.py)
    jobs_basic = base64.b64encode(f"{jobs_user}:{jobs_password}".encode()).decode()
    for method, route, body in (
            ("PATCH", "users/update-password", {"username": jobs_user, "password": "n" * 32,
                                                "current_password": jobs_password}),
            ("DELETE", "registered-models/delete", {"name": "ddp_autoencoder"})):
        ask = urllib.request.Request(f"{r.tracking_url}/api/2.0/mlflow/{route}", method=method,
                                     data=json.dumps(body).encode(), headers={
                                         "Content-Type": "application/json",
                                         "Authorization": f"Basic {jobs_basic}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(ask, timeout=10)
        assert refused.value.code == 403, route
        assert "is not an administrator of the run history" in refused.value.read().decode(), route
    assert emulated.ssh("node-1", "sudo stat -c '%a %U %G' /etc/dlcluster/tracking_admin_auth"
                        ).stdout.split() == ["600", "root", "root"]
    assert emulated.ssh("node-1", "sudo", "cat", "/etc/dlcluster/tracking_admin_auth").stdout.strip() == \
        f"{user}:{password}"
    # the server runs as its own account: Ray's (every job's) cannot read its database password, nor
    # write its artifacts, nor signal it
    pid = emulated.ssh("node-1", "systemctl", "show", "-p", "MainPID", "--value", "dlc-mlflow").stdout.strip()
    assert emulated.ssh("node-1", "ps", "-o", "user=", "-p", pid).stdout.split() == ["dlc-mlflow"], pid
    for name in ("mlflow.env", "mlflow-auth.ini"):
        assert emulated.ssh("node-1", f"sudo stat -c '%a %U %G' /etc/dlcluster/{name}"
                            ).stdout.split() == ["640", "root", "dlc-mlflow"], name
        denied = emulated.ssh("node-1", "sudo", "-u", "raysvc", "cat", f"/etc/dlcluster/{name}")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, name
    # its artifacts on the head's own disk, in a root-owned folder: no job renames them and leaves a
    # link (the shared storage's root, where they were, is root's too now)
    for path, owner in (("/var/lib/dlc-mlflow-artifacts", "750 dlc-mlflow dlc-mlflow"),
                        ("/var/lib", "755 root root"), ("/srv/dlcluster", "755 root root"),
                        ("/var/lib/dlcluster", "750 root raysvc")):
        assert emulated.ssh("node-1", f"sudo stat -c '%a %U %G' {path}").stdout.split() == owner.split(), path
    assert emulated.ssh("node-1", "sudo", "-u", "raysvc", "kill", "-0", pid).returncode != 0
    # nor reach it past its TLS end, nor take its place: it listens on its socket, in a folder of its
    # own and of its fronts' group (its TLS end, the operators' ssh account), on no port
    assert emulated.ssh("node-1", "sudo stat -c '%a %U %G' /run/dlc-mlflow").stdout.split() == [
        "750", "dlc-mlflow", "dlc-mlflow-front"]
    connect = ("python3 -c \"import socket; socket.socket(socket.AF_UNIX)"
               ".connect('/run/dlc-mlflow/server.sock')\"")
    past = emulated.ssh("node-1", f"sudo -u raysvc {connect}")
    assert past.returncode != 0 and "PermissionError" in past.stderr, (past.stdout, past.stderr)
    assert emulated.ssh("node-1", f"sudo {connect}").returncode == 0  # (the control: root connects)
    assert emulated.ssh("node-1", "sudo curl -sf --unix-socket /run/dlc-mlflow/server.sock "
                                  "http://localhost/health").stdout == "OK"  # (the control: root may)
    listening = emulated.ssh("node-1", "ss -Hltn").stdout
    assert "127.0.0.1:5000 " not in listening and f"{NODES['node-1']}:5000 " in listening, listening
    # MLflow's client reads its credentials from the environment only: set for this test alone
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(r.tracking_url, registry_uri=r.tracking_url)
    runs = [x for x in mlflow.search_runs([mlflow.get_experiment_by_name("ddp_autoencoder").experiment_id])
            if x.info.run_name == readme_run.name]
    assert len(runs) == 1, [x.info.run_name for x in runs]  # one MLflow run, rank 0's
    run_ = runs[0]
    manifest = published(emulated, run_.info.run_name)
    assert manifest["tracking"]["state"] == "tracked" and manifest["tracking"]["run_id"] == run_.info.run_id
    assert run_.info.status == "FINISHED" and run_.data.tags["dlc.world_size"] == "3"
    assert run_.data.tags["dlc.cluster"] == "emulated" and run_.data.tags["dlc.launcher"] == "ray"
    epochs = manifest["run"]["epochs_trained"]
    logged = sorted(m.step for m in mlflow.get_metric_history(run_.info.run_id, "loss"))
    assert logged == list(range(1, epochs + 1)), logged
    (version,) = [v for v in mlflow.search_model_versions("name = 'ddp_autoencoder'")
                  if v.run_id == run_.info.run_id]
    assert version.tags["model_sha256"] == manifest["model_sha256"]
    # the link the run printed opens through the tunnel, as the operator's browser opens it; the
    # nodes' address (the head's private one) beside it
    experiment, run_id = run_.info.experiment_id, run_.info.run_id
    link = tracking.run_page(r.tracking_url, experiment, run_id)  # in MLflow's model-training view
    node_link = tracking.run_page(f"https://{TRACKING_NAME}:5000", experiment, run_id)  # its TLS end
    assert (manifest["tracking"]["page"], manifest["tracking"]["node_page"]) == (link, node_link)
    assert f"registered model: ddp_autoencoder version {version.version} (run history: {link} (on the " \
           f"cluster's network: {node_link}))" in readme_run.out, readme_run.out[-3000:]
    for url in (link.split("#")[0], f"{r.tracking_url}/api/2.0/mlflow/runs/get?run_id={run_id}"):
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Basic {basic}"}),
                                    timeout=10) as answer:
            body = answer.read().decode()
        assert answer.status == 200 and (readme_run.name in body if "runs/get" in url else "<html" in body)
    # make runs reads it through the tunnel as an operator does: the run's row, then its epochs
    make = ["make", "-s", "--no-print-directory", "runs"]
    env = {**emulated.env, "MAKEFLAGS": ""}
    listing = run(make, env, timeout=300, check=True).stdout.splitlines()
    row = next(line.split() for line in listing if line.split()[:1] == [readme_run.name])
    assert row[2:5] == ["ddp_autoencoder", manifest["git_commit"][:12], str(epochs)], row  # after its owner
    assert row[-2:] == [manifest["model_sha256"][:12], "finished"], row
    per_epoch = run([*make, f"RUN={readme_run.name}"], env, timeout=300, check=True).stdout.splitlines()
    table = per_epoch[per_epoch.index(next(x for x in per_epoch if x.split()[:1] == ["epoch"])):]
    assert [line.split()[0] for line in table[1:]] == [str(e) for e in range(1, epochs + 1)], per_epoch
    # its artifacts are on the head's disk, where its server keeps them
    found = emulated.ssh("node-1", "sudo", "find", "/var/lib/dlc-mlflow-artifacts", "-name", "model.onnx"
                         ).stdout.split()
    assert any(run_.info.run_id in path for path in found), found
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium, and this is not root with apt-get to install Debian's")
    png = tmp_path / "run-history.png"
    with signed_in(browser, user, password) as page:  # through the tunnel, as an operator
        page.goto(manifest["tracking"]["page"].replace("?", "/model-metrics?", 1))  # the printed link
        # at least a point per epoch (plotly draws a run of one epoch's lone point twice)
        assert mlflow_chart_points(page, "loss", epochs) >= epochs
        page.screenshot(path=str(png))
    print(f"screenshot: {png}")


# Every frame to and from the head on the private network, read in the head's network namespace
# (AF_PACKET on its private interface) until the stop file appears: what it saw, as JSON.
SNIFFER = """
import json, os, socket, sys, time
iface, stop, needles = sys.argv[1], sys.argv[2], [n.encode() for n in sys.argv[3:]]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))  # ETH_P_ALL
s.bind((iface, 0))
s.settimeout(0.2)
seen, frames, tls = {n.decode(): 0 for n in needles}, 0, 0
while not os.path.exists(stop):
    try:
        frame = s.recv(65535)
    except socket.timeout:
        continue
    frames += 1
    if frame[12:14] == b"\\x08\\x00" and frame[23] == 6:  # IPv4, TCP: the ports after the IP header
        ports = frame[14 + (frame[14] & 15) * 4:][:4]
        tls += 5000 in (int.from_bytes(ports[:2], "big"), int.from_bytes(ports[2:], "big"))
    for n in needles:
        seen[n.decode()] += n in frame
print(json.dumps({"frames": frames, "port_5000": tls, "seen": seen}))
"""

# A client on the private network, as a node's rank 0 is: MLflow's own client, the jobs' account,
# the run history's URL and CA as every node's ray.env gives them.
CLIENT = """
import os, mlflow
client = mlflow.MlflowClient(os.environ["DLC_TRACKING_URL"])
print(len(client.search_experiments()), "experiment(s)")
"""


def test_the_run_historys_credentials_never_cross_the_network_in_the_clear(emulated, tmp_path):
    """A sniffer in the head's network namespace sees every frame of the private network to and
    from it while a client on that network (the project's image, the jobs' account, the URL and CA
    certificate a node's ray.env names) asks the run history: the request succeeds over TLS, its
    certificate checked against the cluster's CA, and no frame holds the credentials' header or
    the password. The control: a plain HTTP request with a marker header to the head's dashboard
    at the same time is seen, so the sniffer sees what crosses. Without the CA the client refuses
    the server's certificate."""
    env = dict(line.split("=", 1) for line in emulated.ssh("node-2", "cat", "/etc/dlcluster/ray.env"
                                                            ).stdout.splitlines() if "=" in line and
               not line.startswith("#"))
    assert env["DLC_TRACKING_URL"] == f"https://{TRACKING_NAME}:5000", env.get("DLC_TRACKING_URL")
    # the name every node's /etc/hosts gives the head's address (roles/ray: dlc-hosts)
    assert f"{NODES['node-1']} {TRACKING_NAME} # dlcluster" in emulated.ssh("node-2", "cat /etc/hosts").stdout
    jobs_user, jobs_password = emulated.ssh("node-2", "sudo", "cat", "/etc/dlcluster/tracking_auth"
                                            ).stdout.strip().split(":", 1)
    ca = tmp_path / "ca.crt"
    ca.write_text(emulated.ssh("node-2", "sudo", "cat", env["MLFLOW_TRACKING_SERVER_CERT_PATH"]).stdout)
    assert ca.read_text().startswith("-----BEGIN CERTIFICATE-----"), ca.read_text()[:200]
    pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", "dlc-emu-node-1"], emulated.env,
              check=True).stdout.strip()
    addrs = run(["nsenter", "-t", pid, "-n", "ip", "-o", "-4", "addr", "show"], emulated.env,
                check=True).stdout
    (iface,) = [line.split()[1] for line in addrs.splitlines() if f" {NODES['node-1']}/" in line]
    stop = tmp_path / "stop"
    marker = f"dlc-sniff-{time.time_ns()}"
    basic = base64.b64encode(f"{jobs_user}:{jobs_password}".encode()).decode()
    sniffer = subprocess.Popen(["nsenter", "-t", pid, "-n", str(BIN / "python"), "-c", SNIFFER, iface,
                                str(stop), "Authorization: Basic", basic, jobs_password, marker],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def client(cert: Path | None) -> subprocess.CompletedProcess:
        mount = ["-v", f"{ca}:/ca.crt:ro", "-e", "MLFLOW_TRACKING_SERVER_CERT_PATH=/ca.crt"] if cert else []
        argv = ["docker", "run", "--rm", "--network", "dlc-emu-private", "--ip", "172.31.251.57",
                "--add-host", f"{TRACKING_NAME}:{NODES['node-1']}",  # as a node's /etc/hosts names it
                "-e", f"DLC_TRACKING_URL={env['DLC_TRACKING_URL']}", "-e", "MLFLOW_TRACKING_USERNAME",
                "-e", "MLFLOW_TRACKING_PASSWORD", "-e", "MLFLOW_HTTP_REQUEST_MAX_RETRIES=0", *mount,
                "dlcluster:cpu", "python", "-c", CLIENT]  # the credentials from the environment, not argv
        return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              env={**emulated.env, "MLFLOW_TRACKING_USERNAME": jobs_user,
                                   "MLFLOW_TRACKING_PASSWORD": jobs_password})
    try:
        time.sleep(1)  # the socket bound
        asked = client(ca)
        # (ssh joins its arguments into one command line: the header quoted in it)
        control = emulated.ssh("node-2", f"curl -s -o /dev/null -H 'X-Dlc-Sniff: {marker}' "
                                         f"http://{NODES['node-1']}:8265/api/version")
        refused = client(None)  # no CA: the server's certificate is not one it trusts
        time.sleep(1)
    finally:
        stop.touch()
        out, err = sniffer.communicate(timeout=60)
    assert sniffer.returncode == 0, err[-2000:]
    saw = json.loads(out.strip().splitlines()[-1])
    print("the client:", asked.stdout.strip(), asked.stderr[-300:], "| the sniffer:", saw)
    assert asked.returncode == 0 and "experiment(s)" in asked.stdout, asked.stderr[-3000:]
    assert control.returncode == 0 and saw["seen"][marker] >= 1, (control.stderr, saw)  # it sees what crosses
    assert saw["port_5000"] >= 10, saw  # the client's exchange with the TLS end crossed where it looked
    assert saw["seen"]["Authorization: Basic"] == saw["seen"][basic] == saw["seen"][jobs_password] == 0, saw
    assert refused.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused.stderr[-2000:]

