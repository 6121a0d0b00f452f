"""The gateway's rules without a cluster: credentials kept only as hashes, expiry and revocation, the
owner fields a client sends overwritten, the allow-list of Ray's routes, the audit trail's chain;
and the real server (python -m gateway) answering people before Ray is ever asked. The job API
through it, owners and a head's restart: tests/cluster/test_gateway.py and the emulated tier."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gateway import policy
from gateway.app import owned_submission
from gateway.policy import Caller, Kind
from gateway.store import Store, verify

REPO = Path(__file__).resolve().parents[2]


def test_a_credential_is_kept_only_as_its_hash(tmp_path):
    store = Store(tmp_path)
    made = store.add_user("alice", "vision", False, None)
    assert made.startswith("dlcu_") and len(made) > 40
    assert store.user_by_credential(made).name == "alice"
    assert store.user_by_credential(made + "x") is None
    store.db.execute("PRAGMA wal_checkpoint(FULL)")
    for f in tmp_path.iterdir():
        if f.is_file():
            assert made.encode() not in f.read_bytes(), f
    assert (tmp_path / "gateway.db").stat().st_mode & 0o777 == 0o600
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    # one live credential per person: a second is refused until the first is revoked
    with pytest.raises(ValueError, match="alice already has a credential .*dlcluster user revoke alice"):
        store.add_user("alice", "vision", False, None)
    store.revoke("alice")
    again = store.add_user("alice", "nlp", True, None)
    assert store.user_by_credential(made) is None and store.user_by_credential(again).team == "nlp"


@pytest.mark.parametrize("text,seconds", [("90d", 90 * 86400), ("12h", 43200), ("30m", 1800),
                                          ("never", None)])
def test_a_lifetime(text, seconds):
    assert policy.lifetime(text) == seconds


@pytest.mark.parametrize("text", ["", "0d", "90", "1y", "-1d", "1.5d"])
def test_a_wrong_lifetime_is_one_line_naming_the_forms(text):
    with pytest.raises(ValueError, match=r"give a number of days, hours or minutes \(90d, 12h, 30m\) or "):
        policy.lifetime(text)


def test_the_owner_a_client_sends_is_overwritten():
    alice = Caller("alice", "vision", False)
    sent = owned_submission({"entrypoint": "python x.py", "submission_id": "mine",
                             "metadata": {"dlc_owner": "mallory", "dlc_team": "ops", "note": "kept"},
                             "runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip",
                                             "env_vars": {"DLC_JOB_OWNER": "mallory", "A": "1"}}}, alice)
    assert sent["metadata"] == {"dlc_owner": "alice", "dlc_team": "vision", "note": "kept"}
    assert sent["runtime_env"] == {"working_dir": "gcs://_ray_pkg_x.zip", "env_vars": {
        "DLC_JOB_OWNER": "alice", "DLC_JOB_TEAM": "vision", "A": "1"}}
    assert sent["submission_id"] == "mine" and sent["entrypoint"] == "python x.py"
    bare = owned_submission({"entrypoint": "python x.py", "runtime_env": None}, alice)
    assert bare["submission_id"].startswith("raysubmit_") and len(bare["submission_id"]) == 26
    assert bare["runtime_env"]["env_vars"]["DLC_JOB_OWNER"] == "alice"


@pytest.mark.parametrize("method,path,kind,job", [
    # the job API: every person's; stop and delete the owner's
    ("POST", "/api/jobs/", Kind.SUBMIT, None),
    ("GET", "/api/jobs/", Kind.JOBS, None),
    ("GET", "/api/jobs/raysubmit_a1", Kind.JOB_READ, "raysubmit_a1"),
    ("GET", "/api/jobs/raysubmit_a1/logs", Kind.JOB_READ, "raysubmit_a1"),
    ("GET", "/api/jobs/raysubmit_a1/logs/tail", Kind.JOB_READ, "raysubmit_a1"),
    ("POST", "/api/jobs/raysubmit_a1/stop", Kind.OWNED, "raysubmit_a1"),
    ("DELETE", "/api/jobs/raysubmit_a1", Kind.OWNED, "raysubmit_a1"),
    ("PUT", "/api/packages/gcs/_ray_pkg_0a1b.zip", Kind.READ, None),
    ("GET", "/api/version", Kind.READ, None),
    # the dashboard: its shell open, its views every person's
    ("GET", "/", Kind.OPEN, None),
    ("GET", "/static/js/main.js", Kind.OPEN, None),
    ("POST", "/api/authenticate", Kind.SIGN_IN, None),
    ("GET", "/nodes", Kind.READ, None),
    ("GET", "/api/v0/tasks/summarize", Kind.READ, None),
    ("HEAD", "/api/v0/platform_events", Kind.READ, None),
    ("HEAD", "/api/jobs/", Kind.JOBS, None),
    ("GET", "/api/serve/applications/", Kind.READ, None),
    # anything else Ray serves is for admins: profiling, tracebacks, Serve's writes, the state API's
    # other routes, the job agent's own API, a route a newer Ray adds, a method other than listed
    ("GET", "/worker/cpu_profile", Kind.ADMIN, None),
    ("GET", "/worker/traceback", Kind.ADMIN, None),
    ("GET", "/task/cpu_profile", Kind.ADMIN, None),
    ("GET", "/memory_profile", Kind.ADMIN, None),
    ("PUT", "/api/serve/applications/", Kind.ADMIN, None),
    ("DELETE", "/api/serve/applications/", Kind.ADMIN, None),
    ("GET", "/api/v0/delay/5", Kind.ADMIN, None),
    ("POST", "/api/job_agent/jobs/", Kind.ADMIN, None),
    ("GET", "/api/actors/kill", Kind.ADMIN, None),
    ("POST", "/api/jobs/raysubmit_a1/restart", Kind.ADMIN, None),
    ("PATCH", "/api/jobs/raysubmit_a1", Kind.ADMIN, None),
    ("GET", "/api/jobs/a/b/c", Kind.ADMIN, None),
    ("GET", "/static", Kind.ADMIN, None),
    ("GET", "/gateway/users", Kind.GATEWAY, None),
])
def test_the_allow_list(method, path, kind, job):
    assert policy.classify(method, path) == (kind, job)


def test_only_the_owner_or_an_admin_may_change_a_job():
    alice, bob = Caller("alice", "vision", False), Caller("bob", "nlp", False)
    root = Caller("root", "ops", True)
    assert policy.may_change(alice, "alice") and policy.may_change(root, "alice")
    assert not policy.may_change(bob, "alice") and not policy.may_change(bob, "nobody known")
    assert policy.not_yours(bob, "stop", "raysubmit_1", "alice", "vision") == (
        "stop raysubmit_1: refused for bob: the job belongs to alice (team vision); only alice or an admin "
        "may stop it")


def test_the_audit_trail_is_a_chain_that_names_where_it_breaks(tmp_path):
    store = Store(tmp_path)
    for i in range(5):
        store.audit("alice", "submit", f"raysubmit_{i}", "python x.py", "127.0.0.1:1")
    assert verify(store.trail()) is None
    # the database refuses changing or removing an entry
    for sql in ("UPDATE audit SET actor = 'bob' WHERE seq = 2", "DELETE FROM audit WHERE seq = 2"):
        with pytest.raises(sqlite3.IntegrityError, match="the audit trail is append-only"):
            store.db.execute(sql)
    # below the triggers (the file edited by hand): the changed entry is named, then a removed one
    raw = sqlite3.connect(tmp_path / "gateway.db")
    raw.executescript("DROP TRIGGER audit_no_update; DROP TRIGGER audit_no_delete;")
    raw.execute("UPDATE audit SET actor = 'bob' WHERE seq = 3")
    raw.commit()
    assert verify(store.trail()) == "entry 3 (submit by bob) was changed after it was written"
    raw.execute("UPDATE audit SET actor = 'alice' WHERE seq = 3")
    raw.execute("DELETE FROM audit WHERE seq = 2")
    raw.commit()
    assert verify(store.trail()) == "entry 2 is missing (the next is 3): removed from the audit trail"
    # an entry and its digest rewritten together: the next entry no longer follows it
    trail = store.trail()
    trail = [{**e, "seq": i + 1} for i, e in enumerate(trail)]
    assert verify(trail) == "entry 2 does not follow entry 1: one of them was changed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gateway(tmp_path):
    """The real server, in front of a port where no Ray listens: what it refuses never reaches Ray."""
    token = tmp_path / "ray_token"
    token.write_text("ab" * 32 + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--listen", f"127.0.0.1:{port}",
                             "--upstream", f"http://127.0.0.1:{free_port()}", "--token-file", str(token),
                             "--data", str(tmp_path / "data")], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield url, "ab" * 32, tmp_path / "data"
    proc.terminate()
    proc.wait(timeout=20)


def ask(url: str, method: str, path: str, credential: str | None = None, body: dict | None = None,
        cookie: str | None = None) -> tuple[int, str, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if credential:
        headers["Authorization"] = f"Bearer {credential}"
    if cookie:
        headers["Cookie"] = f"ray-authentication-token={cookie}"
    request = urllib.request.Request(url + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def test_the_server_signs_people_in_and_refuses_the_rest_before_ray(gateway):
    url, token, data = gateway
    status, text, _ = ask(url, "POST", "/gateway/users", token, {"name": "alice", "team": "vision"})
    assert status == 200, text
    alice = json.loads(text)["credential"]
    status, text, _ = ask(url, "POST", "/gateway/users", token,
                          {"name": "bob", "team": "nlp", "expires": "1m"})
    bob = json.loads(text)["credential"]
    # who they are; no credential, an unknown one, a person on an admin's route
    assert json.loads(ask(url, "GET", "/gateway/whoami", alice)[1]) == {"name": "alice", "team": "vision",
                                                                        "admin": False}
    assert json.loads(ask(url, "GET", "/gateway/whoami", token)[1])["name"] == "operator"
    status, text, _ = ask(url, "GET", "/api/jobs/")
    assert status == 401 and "Missing authentication token" in text and "RAY_AUTH_TOKEN_PATH" in text
    status, text, _ = ask(url, "GET", "/api/jobs/", "dlcu_guess")
    assert (status, text) == (
        403, "Forbidden: unknown credential: ask an admin for yours (dlcluster user add)\n")
    for path in ("/worker/cpu_profile?pid=1", "/api/v0/delay/1"):
        status, text, _ = ask(url, "GET", path, alice)
        assert status == 403, text
        assert text.startswith(f"GET {path.split('?')[0]}: refused for alice: only admins"), text
    status, text, _ = ask(url, "POST", "/gateway/users", alice, {"name": "eve", "team": "vision"})
    assert status == 403 and "for admins only" in text
    status, text, _ = ask(url, "POST", "/gateway/users", token,
                          {"name": "carol", "team": "x", "expires": "1y"})
    assert status == 400 and "--expires 1y: give a number of days" in text
    # the dashboard's sign-in: answered here, the cookie the person's own credential, which then works
    status, text, headers = ask(url, "POST", "/api/authenticate", alice)
    assert status == 200 and json.loads(text)["status"] == "authenticated"
    cookie = headers["Set-Cookie"]
    assert f"ray-authentication-token={alice}" in cookie and "HttpOnly" in cookie
    assert json.loads(ask(url, "GET", "/gateway/whoami", cookie=alice)[1])["name"] == "alice"
    assert ask(url, "POST", "/api/authenticate", "dlcu_guess")[0] == 403
    # revoked: refused at once, in one line naming the fix
    status, _, _ = ask(url, "DELETE", "/gateway/users/alice", token)
    assert status == 200
    status, text, _ = ask(url, "GET", "/api/jobs/", alice)
    assert status == 403 and text.startswith("Forbidden: alice's credential was revoked on ")
    assert text.rstrip().endswith("ask an admin for a new one (dlcluster user add alice --team vision)")
    # expired: refused, in one line naming the fix
    store = Store(data)
    store.db.execute("UPDATE users SET expires = ? WHERE name = 'bob'", (time.time() - 60,))
    status, text, _ = ask(url, "GET", "/api/jobs/", bob)
    assert status == 403 and "Forbidden: bob's credential expired on " in text and "user revoke bob" in text
    # the trail: each change and each refusal, by whom, no secret in it; the chain holds
    status, text, _ = ask(url, "GET", "/gateway/audit", token)
    got = json.loads(text)
    assert got["broken"] is None
    rows = [(e["actor"], e["action"], e["outcome"]) for e in got["entries"]]
    assert rows == [
        ("operator", "user add", "done"), ("operator", "user add", "done"),
        ("unknown", "GET /api/jobs/", "refused"), ("unknown", "GET /api/jobs/", "refused"),
        ("alice", "GET /worker/cpu_profile", "refused"), ("alice", "GET /api/v0/delay/1", "refused"),
        ("alice", "POST /gateway/users", "refused"), ("operator", "POST /gateway/users", "refused"),
        ("alice", "sign-in", "done"), ("unknown", "POST /api/authenticate", "refused"),
        ("operator", "user revoke", "done"), ("alice", "GET /api/jobs/", "refused"),
        ("bob", "GET /api/jobs/", "refused")], rows
    assert all(e["source"].startswith("127.0.0.1:") for e in got["entries"])
    assert not any(secret in text for secret in (alice, bob, token))
