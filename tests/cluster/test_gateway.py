"""The team's cluster on the local cluster: people reach Ray only through its gateway, with the
unchanged Ray CLI and a credential each; jobs have owners; the audit trail says who did what; the
gateway's records and logs outlive its own restart. (The same server on a cluster's head, behind
the tunnel, and a head restart: the emulated tier.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, REPO

JOB = """\
import os, sys, time
print("owner", os.environ.get("DLC_JOB_OWNER"), "team", os.environ.get("DLC_JOB_TEAM"), flush=True)
print("run history: http://127.0.0.1:5000/#/experiments/1/runs/abc", flush=True)
time.sleep(float(sys.argv[1]))
print("done", flush=True)
"""


def dlcluster(cluster, *args: str, credential: Path | None = None) -> subprocess.CompletedProcess:
    env = {**cluster.env, **({"RAY_AUTH_TOKEN_PATH": str(credential)} if credential else {})}
    return subprocess.run([str(BIN / "dlcluster"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def ray(cluster, credential: Path, verb: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The unchanged Ray CLI, as a person runs it: their credential where Ray's client reads its token."""
    env = {**cluster.client_env(), "RAY_AUTH_TOKEN_PATH": str(credential)}
    address = f"http://127.0.0.1:{cluster.dashboard_port}"
    return subprocess.run([str(BIN / "ray"), "job", verb, "--address", address, *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)


def person(cluster, tmp_path: Path, name: str, team: str, *flags: str) -> Path:
    made = dlcluster(cluster, "user", "add", name, "--team", team, *flags)
    assert made.returncode == 0, made.stdout + made.stderr
    (credential,) = re.findall(r"^    (dlcu_\S+)$", made.stdout, re.M)
    path = tmp_path / name
    path.write_text(credential + "\n")
    path.chmod(0o600)
    return path


def status(cluster, job: str) -> str:
    return cluster.jobs().get(job, "unknown")


def wait_for(cluster, job: str, states: set[str], timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while (now := status(cluster, job)) not in states and time.time() < deadline:
        time.sleep(0.5)
    return now


def test_people_owners_and_the_audit_trail_through_the_gateway(cluster, tmp_path):
    alice = person(cluster, tmp_path, "alice", "vision")
    bob = person(cluster, tmp_path, "bob", "nlp")
    root = person(cluster, tmp_path, "root", "ops", "--admin")
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    # alice submits, claiming to be bob in the metadata: the gateway makes her the owner
    submitted = ray(cluster, alice, "submit", "--no-wait", "--working-dir", ".", "--metadata-json",
                    json.dumps({"dlc_owner": "bob", "dlc_team": "nlp"}), "--", "python", "job.py", "60",
                    cwd=work)
    assert submitted.returncode == 0, submitted.stdout[-3000:]
    (job,) = set(re.findall(r"raysubmit_\w+", submitted.stdout))
    assert wait_for(cluster, job, {"RUNNING"}) == "RUNNING"
    # bob sees it, with its owner, and may neither stop nor delete it
    listed = ray(cluster, bob, "list")
    assert listed.returncode == 0 and job in listed.stdout, listed.stdout[-3000:]
    assert "'dlc_owner': 'alice', 'dlc_team': 'vision'" in listed.stdout
    for verb in ("stop", "delete"):
        refused = ray(cluster, bob, verb, job)
        assert refused.returncode != 0 and (
            f"{verb} {job}: refused for bob: the job belongs to alice (team vision); only alice or an admin "
            f"may {verb} it") in refused.stdout, refused.stdout[-3000:]
    assert status(cluster, job) == "RUNNING"  # a refused call changed nothing
    # an admin may; the job's log says whose it was
    stopped = ray(cluster, root, "stop", job)
    assert stopped.returncode == 0, stopped.stdout[-3000:]
    assert wait_for(cluster, job, {"STOPPED"}) == "STOPPED"
    logs = ray(cluster, alice, "logs", job)
    assert "owner alice team vision" in logs.stdout, logs.stdout[-3000:]
    # a person's own job: submitted, followed to its end, stopped and deleted by its owner
    own = ray(cluster, bob, "submit", "--working-dir", ".", "--", "python", "job.py", "1", cwd=work)
    assert own.returncode == 0 and "owner bob team nlp" in own.stdout, own.stdout[-3000:]
    assert "done" in own.stdout, own.stdout[-3000:]
    # revoked: refused at once
    assert dlcluster(cluster, "user", "revoke", "bob").returncode == 0
    gone = ray(cluster, bob, "list")
    assert gone.returncode != 0 and "bob's credential was revoked on" in gone.stdout, gone.stdout[-3000:]
    # the gateway's records: every job with its owner, state and run page, its log kept
    deadline = time.time() + 30
    while time.time() < deadline:
        kept = {j["id"]: j for j in json.loads(jobs_json(cluster))}
        if kept.get(job, {}).get("run_url") and kept[job]["status"] == "STOPPED":
            break
        time.sleep(0.5)
    assert (kept[job]["owner"], kept[job]["team"], kept[job]["status"]) == ("alice", "vision", "STOPPED")
    assert [s for s, _ in kept[job]["states"]][-2:] == ["RUNNING", "STOPPED"]
    assert kept[job]["run_url"] == "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    table = dlcluster(cluster, "jobs", credential=alice)
    assert re.search(rf"{job}\s+alice\s+vision\s+STOPPED", table.stdout), table.stdout + table.stderr
    # the audit trail names each step's person; only admins read it
    assert dlcluster(cluster, "audit", credential=alice).returncode != 0
    trail = dlcluster(cluster, "audit", "--last", "0", credential=root)
    assert trail.returncode == 0 and "the chain holds" in trail.stdout, trail.stdout + trail.stderr
    for step in [r"operator\s+user add\s+alice\s+done", rf"alice\s+submit\s+{job}\s+done",
                 rf"bob\s+stop\s+{job}\s+refused", rf"bob\s+delete\s+{job}\s+refused",
                 rf"root\s+stop\s+{job}\s+done", r"operator\s+user revoke\s+bob\s+done",
                 r"bob\s+GET /api/\S+\s+refused\s+Forbidden: bob's credential was revoked"]:
        assert re.search(step, trail.stdout), (step, trail.stdout)
    # the gateway killed, then started again by cluster-up: nothing lost
    state = json.loads((cluster.config / "clusters/local/state.json").read_text())
    os.killpg(state["gateway_pid"], signal.SIGKILL)
    again = cluster.script("up")
    assert "already running" in again.stdout
    after = {j["id"]: j for j in json.loads(jobs_json(cluster))}
    assert after[job]["owner"] == "alice" and after[job]["status"] == "STOPPED"
    log = dlcluster(cluster, "logs", job, credential=alice)
    assert "owner alice team vision" in log.stdout, log.stdout + log.stderr
    assert "the chain holds" in dlcluster(cluster, "audit", credential=root).stdout


def jobs_json(cluster) -> str:
    import urllib.request

    token = Path(cluster.client_env()["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.dashboard_port}/gateway/jobs",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def test_the_dashboard_takes_a_persons_credential_in_a_browser(cluster, tmp_path):
    """Ray's dashboard through the local cluster's gateway, in the distribution's Chromium: its sign-in
    dialog takes a person's own credential, the jobs view lists their job, and no view of the ones a
    person opens sends the dialog back (a view the allow-list refused would: the dashboard reads a
    403 as a wrong token)."""
    from tests.browser import LAUNCH_ARGS, chromium

    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium here and no apt-get as root to install the distribution's")
    from playwright.sync_api import sync_playwright

    dana = person(cluster, tmp_path, "dana", "vision")
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    done = ray(cluster, dana, "submit", "--working-dir", ".", "--", "python", "job.py", "0", cwd=work)
    (job,) = set(re.findall(r"raysubmit_\w+", done.stdout))
    field = 'input[placeholder="Enter your authentication token"]'
    base = f"http://127.0.0.1:{cluster.dashboard_port}"
    png = tmp_path / "dashboard-signed-in-as-a-person.png"
    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=browser, args=LAUNCH_ARGS)
        try:
            page = chrome.new_page(viewport={"width": 1280, "height": 720})
            refused = []
            page.on("response", lambda r: refused.append(r.url) if r.status == 403 else None)
            page.goto(f"{base}/")
            page.wait_for_selector(field, timeout=60_000)
            page.fill(field, dana.read_text().strip())
            page.keyboard.press("Enter")
            page.wait_for_selector(field, state="detached", timeout=60_000)
            page.goto(f"{base}/#/jobs")
            page.wait_for_selector(f"text={job}", timeout=120_000)
            page.screenshot(path=str(png))
            for view in ("#/overview", "#/cluster", "#/actors", "#/logs"):
                page.goto(f"{base}/{view}")
                page.wait_for_load_state("networkidle", timeout=60_000)
                assert page.query_selector(field) is None, view
        finally:
            chrome.close()
    print(f"screenshot: {png}")
    assert refused == [], refused
