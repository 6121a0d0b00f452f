"""A team on the emulated cluster, through the tunnel and the head's job gateway (roles/gateway): two
people of two teams and an admin, each with a credential of their own in the unchanged Ray CLI;
owners, the 403s, revocation and expiry; the cluster's token on no person's side; the dashboard
signed in with a person's credential in a real browser; the audit trail, and a tampered entry named
by make doctor."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DLCLUSTER, PORT, REPO

JOB = """\
import os, sys, time
print("owner", os.environ.get("DLC_JOB_OWNER"), "team", os.environ.get("DLC_JOB_TEAM"), flush=True)
time.sleep(float(sys.argv[1]))
print("done", flush=True)
"""
ADDRESS = f"http://127.0.0.1:{PORT}"


def person_env(emulated, home: Path, credential: str) -> dict:
    """What a person has on their machine: their credential in a file of their own (0600) and Ray's
    client pointed at the tunnel; no cluster token, no record, no ssh config of the cluster's."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "credential"
    path.write_text(credential + "\n")
    path.chmod(0o600)
    return {"PATH": emulated.env["PATH"], "HOME": str(home), "DLC_CONFIG": str(home / "config"),
            "RAY_ADDRESS": ADDRESS, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def ray(env: dict, verb: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(DLCLUSTER).parent / "ray"), "job", verb, "--address", ADDRESS, *args],
                          cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)


def dlcluster(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DLCLUSTER, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def add(emulated, name: str, team: str, *flags: str) -> str:
    made = dlcluster(emulated.env, "user", "add", name, "--team", team, *flags)
    assert made.returncode == 0, made.stdout + made.stderr
    (credential,) = re.findall(r"^    (dlcu_\S+)$", made.stdout, re.M)
    return credential


def status(env: dict, job: str) -> str:
    got = ray(env, "status", job)
    found = re.search(r"Job '\S+' (succeeded|failed|was stopped)|Status for job '\S+': (\w+)", got.stdout)
    return (found.group(1) or found.group(2)) if found else got.stdout[-300:]


@pytest.mark.timeout(1800)
def test_a_team_shares_the_cluster_through_the_gateway(emulated, tmp_path):
    alice = person_env(emulated, tmp_path / "alice", add(emulated, "alice", "vision"))
    bob = person_env(emulated, tmp_path / "bob", add(emulated, "bob", "nlp"))
    root = person_env(emulated, tmp_path / "root", add(emulated, "root", "ops", "--admin"))
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(JOB)
    submitted = ray(alice, "submit", "--no-wait", "--working-dir", ".", "--metadata-json",
                    json.dumps({"dlc_owner": "bob"}), "--", "python", "job.py", "120", cwd=work)
    assert submitted.returncode == 0, submitted.stdout[-3000:]
    (job,) = set(re.findall(r"raysubmit_\w+", submitted.stdout))
    deadline = time.time() + 180
    while "RUNNING" not in (now := status(alice, job)) and time.time() < deadline:
        time.sleep(2)
    assert "RUNNING" in now, now
    # the 403 matrix: bob may neither stop nor delete alice's job, nor use an admin's route
    for verb in ("stop", "delete"):
        refused = ray(bob, verb, job)
        said = f"the job belongs to alice (team vision); only alice or an admin may {verb} it"
        assert refused.returncode != 0 and said in refused.stdout, refused.stdout[-3000:]
    for who in (alice, bob):
        credential = Path(who["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        code = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                               f"Authorization: Bearer {credential}", f"{ADDRESS}/worker/traceback?pid=1"],
                              capture_output=True, text=True).stdout
        assert code == "403", code
    listed = ray(bob, "list")
    assert listed.returncode == 0 and "'dlc_owner': 'alice'" in listed.stdout, listed.stdout[-3000:]
    assert "RUNNING" in status(alice, job)  # nothing refused changed anything
    # the dashboard, signed in with bob's credential in a real browser through the tunnel, lists it
    dashboard(Path(bob["RAY_AUTH_TOKEN_PATH"]).read_text().strip(), job, tmp_path)
    # the admin may stop it; its log says whose it was
    assert ray(root, "stop", job).returncode == 0
    assert "owner alice team vision" in ray(alice, "logs", job).stdout
    # revoked and expired: refused at once, each in one line naming the fix
    assert dlcluster(emulated.env, "user", "revoke", "bob").returncode == 0
    gone = ray(bob, "list")
    assert gone.returncode != 0 and "bob's credential was revoked on" in gone.stdout, gone.stdout[-2000:]
    brief = person_env(emulated, tmp_path / "carol", add(emulated, "carol", "vision", "--expires", "1m"))
    assert ray(brief, "list").returncode == 0
    time.sleep(61)
    late = ray(brief, "list")
    assert late.returncode != 0 and "carol's credential expired on" in late.stdout, late.stdout[-2000:]
    # the cluster's token is on no person's side
    token = emulated.token()
    for home in ("alice", "bob", "root", "carol"):
        for f in (tmp_path / home).rglob("*"):
            assert not f.is_file() or token not in f.read_text(errors="ignore"), f
    # the audit trail names each step's person; the chain holds
    trail = dlcluster(root, "audit", "--last", "0")
    assert trail.returncode == 0 and "the chain holds" in trail.stdout, trail.stdout + trail.stderr
    for step in [r"operator\s+user add\s+alice", rf"alice\s+submit\s+{job}\s+done",
                 rf"bob\s+stop\s+{job}\s+refused", rf"bob\s+delete\s+{job}\s+refused",
                 rf"root\s+stop\s+{job}\s+done",
                 r"alice\s+GET /worker/traceback\s+refused", r"bob\s+sign-in\s+dashboard",
                 r"operator\s+user revoke\s+bob", r"bob\s+GET /api/\S+\s+refused",
                 r"carol\s+GET /api/\S+\s+refused"]:
        assert re.search(step, trail.stdout), (step, trail.stdout[-4000:])
    assert "uid " in trail.stdout and "on the head" in trail.stdout  # from where: the tunnel's account
    # alice's submission's entry changed below the gateway, on the head: make doctor names it
    (seq,) = re.findall(rf"^(\d+)\s+\S+ \S+\s+alice\s+submit\s+{job}\s", trail.stdout, re.M)
    below_the_gateway(emulated, f"UPDATE audit SET actor = 'mallory' WHERE seq = {seq}")
    try:
        deadline = time.time() + 60
        while dlcluster(root, "jobs").returncode != 0 and time.time() < deadline:
            time.sleep(1)
        doctor = subprocess.run(["make", "--no-print-directory", "doctor"], cwd=REPO, env=emulated.env,
                                capture_output=True, text=True, timeout=600)
        said = doctor.stdout + doctor.stderr
        assert doctor.returncode != 0 and "the gateway's audit trail is broken: entry" in said and \
            f"entry {seq} (submit by mallory) was changed after it was written" in said, said[-3000:]
    finally:  # the entry put back as it was (the tests after this one read a healthy cluster's doctor)
        below_the_gateway(emulated, f"UPDATE audit SET actor = 'alice' WHERE seq = {seq}")
    deadline = time.time() + 60
    while dlcluster(root, "jobs").returncode != 0 and time.time() < deadline:
        time.sleep(1)
    assert "the chain holds" in dlcluster(root, "audit").stdout


def below_the_gateway(emulated, sql: str) -> None:
    """Change the gateway's database on the head as someone with root there could: the gateway
    stopped, its append-only trigger dropped, the change made; the gateway started again (it makes
    its triggers again)."""
    db = "/var/lib/dlc-gateway/gateway.db"
    emulated.ssh("node-1", "sudo", "systemctl", "stop", "dlc-gateway").check_returncode()
    try:
        change = (f"import sqlite3; d = sqlite3.connect('{db}'); "
                  "d.executescript('DROP TRIGGER IF EXISTS audit_no_update'); "
                  f"d.execute({sql!r}); d.commit()\n")
        script = base64.b64encode(change.encode()).decode()  # through ssh's remote shell unquoted
        emulated.ssh("node-1", f"echo {script} | base64 -d | sudo /opt/venv/bin/python -").check_returncode()
    finally:
        emulated.ssh("node-1", "sudo", "systemctl", "start", "dlc-gateway").check_returncode()


def dashboard(credential: str, job: str, tmp_path: Path) -> None:
    """Ray's dashboard through the tunnel in the distribution's Chromium: its sign-in dialog takes the
    person's credential and the jobs page lists the job (its screenshot under the test's folder)."""
    from tests.browser import LAUNCH_ARGS, chromium

    browser = chromium()
    assert browser, "no Chromium: apt-get install chromium"
    from playwright.sync_api import sync_playwright

    field = 'input[placeholder="Enter your authentication token"]'
    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=browser, args=LAUNCH_ARGS)
        try:
            page = chrome.new_page(viewport={"width": 1280, "height": 720})
            page.goto(f"{ADDRESS}/")
            page.wait_for_selector(field, timeout=60_000)
            page.fill(field, credential)
            page.keyboard.press("Enter")
            page.wait_for_selector(field, state="detached", timeout=60_000)
            page.goto(f"{ADDRESS}/#/jobs")
            page.wait_for_selector(f"text={job}", timeout=120_000)
            assert page.query_selector(field) is None  # no view sent the dialog back
            page.screenshot(path=str(tmp_path / "dashboard-signed-in-as-a-person.png"))
            print(f"screenshot: {tmp_path / 'dashboard-signed-in-as-a-person.png'}")
        finally:
            chrome.close()
