"""The gateway's state on the head's disk: one SQLite database (people, jobs, the audit trail) and
a folder of job logs, both in the gateway's data folder (dlc-gateway's StateDirectory on a
cluster, the local cluster's folder on this machine).

A credential is stored only as its SHA-256 digest: it is 32 random bytes (`dlcu_` + URL-safe
base64), so a digest cannot be reversed by guessing, and no slow hash is needed (as GitHub's and
dstack's tokens). The audit trail is append-only (triggers refuse UPDATE and DELETE) and
tamper-evident: each entry's digest covers its fields and the digest before it, so an entry
changed or removed below the database's triggers breaks the chain from there (verify()).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "dlcu_"  # a person's credential; the cluster's Ray token is 64 hex digits
GENESIS = "0" * 64

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY, team TEXT NOT NULL, admin INTEGER NOT NULL, digest TEXT UNIQUE,
    created REAL NOT NULL, expires REAL, revoked REAL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, team TEXT NOT NULL, entrypoint TEXT NOT NULL,
    submitted REAL NOT NULL, status TEXT NOT NULL, states TEXT NOT NULL, message TEXT,
    ended REAL, exit_code INTEGER, run_url TEXT, details TEXT);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY, time REAL NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
    target TEXT NOT NULL, detail TEXT NOT NULL, source TEXT NOT NULL, outcome TEXT NOT NULL,
    prev TEXT NOT NULL, digest TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END;
"""

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
AUDIT_FIELDS = ("seq", "time", "actor", "action", "target", "detail", "source", "outcome")


def digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


def new_credential() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def entry_digest(prev: str, entry: dict[str, Any]) -> str:
    body = json.dumps({k: entry[k] for k in AUDIT_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256((prev + body).encode()).hexdigest()


def verify(entries: list[dict[str, Any]]) -> str | None:
    """The first break of an audit chain (entries in order, as `audit` gives them), in one line;
    None where every entry's digest covers its fields and the one before."""
    prev = GENESIS
    for i, e in enumerate(entries):
        if e["seq"] != i + 1:
            return f"entry {i + 1} is missing (the next is {e['seq']}): removed from the audit trail"
        if e["prev"] != prev:
            return f"entry {e['seq']} does not follow entry {e['seq'] - 1}: one of them was changed"
        if entry_digest(prev, e) != e["digest"]:
            return f"entry {e['seq']} ({e['action']} by {e['actor']}) was changed after it was written"
        prev = e["digest"]
    return None


@dataclass(frozen=True)
class User:
    name: str
    team: str
    admin: bool
    created: float
    expires: float | None
    revoked: float | None

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "team": self.team, "admin": self.admin, "created": self.created,
                "expires": self.expires, "revoked": self.revoked}


class Store:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.logs = folder / "logs"
        self.logs.mkdir(mode=0o700, exist_ok=True)
        self.db = sqlite3.connect(folder / "gateway.db", isolation_level=None)
        os.chmod(folder / "gateway.db", 0o600)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # WAL's NORMAL: a transaction committed survives the gateway's crash or kill; an OS crash or a
        # power cut may lose the last ones (FULL would fsync each: 10-60 ms a submission on these disks)
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    # ---- people
    def add_user(self, name: str, team: str, admin: bool, expires: float | None) -> str:
        """A new credential for `name` (printed once by the caller; only its digest is kept). A
        person who holds a live one must be revoked first (ValueError)."""
        old = self.user(name)
        if old and not old.revoked:
            raise ValueError(f"{name} already has a credential (team {old.team}): revoke it first "
                             f"(dlcluster user revoke {name})")
        credential = new_credential()
        self.db.execute("INSERT OR REPLACE INTO users VALUES (?, ?, ?, ?, ?, ?, NULL)",
                        (name, team, int(admin), digest(credential), time.time(), expires))
        return credential

    def revoke(self, name: str) -> User:
        user = self.user(name)
        if user is None or user.revoked:
            raise KeyError(name)
        self.db.execute("UPDATE users SET revoked = ? WHERE name = ?", (time.time(), name))
        return user

    def user(self, name: str) -> User | None:
        row = self.db.execute("SELECT * FROM users WHERE name = ?", (name,)).fetchone()
        return _user(row) if row else None

    def user_by_credential(self, credential: str) -> User | None:
        row = self.db.execute("SELECT * FROM users WHERE digest = ?", (digest(credential),)).fetchone()
        return _user(row) if row else None

    def users(self) -> list[User]:
        return [_user(r) for r in self.db.execute("SELECT * FROM users ORDER BY team, name")]

    # ---- jobs
    def add_job(self, job_id: str, owner: str, team: str, entrypoint: str) -> None:
        now = time.time()
        self.db.execute("INSERT OR IGNORE INTO jobs (id, owner, team, entrypoint, submitted, status, states) "
                        "VALUES (?, ?, ?, ?, ?, 'PENDING', ?)",
                        (job_id, owner, team, entrypoint, now, json.dumps([["PENDING", now]])))

    def job(self, job_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def jobs(self) -> list[dict[str, Any]]:
        return [_job(r) for r in self.db.execute("SELECT * FROM jobs ORDER BY submitted")]

    def update_job(self, job_id: str, details: dict[str, Any]) -> bool:
        """Ray's JobDetails of a job kept: its status (a new one appended to its states with its
        time), message, end and exit; True where the status changed."""
        job = self.job(job_id)
        if job is None:
            return False
        status = details.get("status") or job["status"]
        states = job["states"]
        changed = status != job["status"]
        if changed:
            states.append([status, time.time()])
        end = details.get("end_time")
        self.db.execute(
            "UPDATE jobs SET status = ?, states = ?, message = ?, ended = ?, exit_code = ?, details = ? "
            "WHERE id = ?",
            (status, json.dumps(states), details.get("message"), end / 1000 if end else job["ended"],
             details.get("driver_exit_code"), json.dumps(details), job_id))
        return changed

    def forget_job(self, job_id: str) -> None:
        """A job's record and log gone (Ray refused it, or its owner deleted it)."""
        self.log_path(job_id).unlink(missing_ok=True)
        self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def set_run_url(self, job_id: str, url: str) -> None:
        self.db.execute("UPDATE jobs SET run_url = ? WHERE id = ?", (url, job_id))

    def log_path(self, job_id: str) -> Path:
        return self.logs / f"{hashlib.sha256(job_id.encode()).hexdigest()[:32]}.log"

    def prune(self, older_than_days: float) -> list[str]:
        """Jobs that ended more than `older_than_days` ago forgotten, with their logs; their ids."""
        cutoff = time.time() - older_than_days * 86400
        gone = [r["id"] for r in self.db.execute("SELECT id FROM jobs WHERE ended IS NOT NULL AND ended < ?",
                                                 (cutoff,))]
        for job_id in gone:
            self.forget_job(job_id)
        return gone

    # ---- the audit trail
    def audit(self, actor: str, action: str, target: str = "", detail: str = "", source: str = "",
              outcome: str = "done") -> dict[str, Any]:
        """One entry appended, its digest over its fields and the previous entry's digest. Callers
        never pass a secret (a credential, a token) in any field."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            last = self.db.execute("SELECT seq, digest FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
            prev = last["digest"] if last else GENESIS
            entry = {"seq": (last["seq"] if last else 0) + 1, "time": time.time(), "actor": actor,
                     "action": action, "target": target, "detail": detail, "source": source,
                     "outcome": outcome, "prev": prev}
            entry["digest"] = entry_digest(prev, entry)
            self.db.execute("INSERT INTO audit VALUES (:seq, :time, :actor, :action, :target, :detail, "
                            ":source, :outcome, :prev, :digest)", entry)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return entry

    def trail(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.db.execute("SELECT * FROM audit ORDER BY seq")]


def _user(row: sqlite3.Row) -> User:
    return User(row["name"], row["team"], bool(row["admin"]), row["created"], row["expires"], row["revoked"])


def _job(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    out["states"] = json.loads(out["states"])
    out["details"] = json.loads(out["details"]) if out["details"] else None
    return out
