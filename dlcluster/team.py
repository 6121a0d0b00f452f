"""The team's commands, through the cluster's gateway (gateway/ on the head; the local cluster's
own): people and their credentials, the audit trail, every job with its owner, a job's log.

Each call goes where Ray's client goes (RAY_ADDRESS, else the current cluster's job API) with the
credential Ray's client sends (RAY_AUTH_TOKEN_PATH, else the record's: the cluster's token, an
operator's): a person runs these with their own, an operator with the cluster's.

    dlcluster user add alice --team vision [--admin] [--expires 90d]
    dlcluster user list | user revoke alice
    dlcluster jobs | dlcluster logs raysubmit_... | dlcluster audit
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dlcluster import record
from trainkit.errors import UserError


def endpoint() -> tuple[str, str]:
    """The gateway's address and the caller's credential, as Ray's client finds them."""
    address = os.environ.get("RAY_ADDRESS", "")
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    if not address.startswith("http") or not token_path:
        r = record.load()
        address = address if address.startswith("http") else r.job_api
        token_path = token_path or r.token_path
    try:
        credential = Path(token_path).read_text().strip()
    except OSError as e:
        raise UserError(f"cannot read your credential at {token_path} ({e.strerror}): set "
                        f"RAY_AUTH_TOKEN_PATH to the file that holds it") from None
    return address.rstrip("/"), credential


def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    address, credential = endpoint()
    request = urllib.request.Request(
        address + path, method=method, data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {credential}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        line = e.read().decode(errors="replace").strip().splitlines()
        raise UserError(line[0] if line else f"the gateway answered {e.code}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise UserError(f"the gateway at {address} does not answer ({getattr(e, 'reason', e)}): is the "
                        f"cluster up (make cluster-status) and its tunnel open (make attach)?") from None
    return json.loads(text) if text.startswith(("{", "[")) else text


def when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else "-"


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=False)).rstrip()
                     for row in [head, *rows])


def user_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="dlcluster user", description="people and their credentials (admins)")
    sub = p.add_subparsers(dest="what", required=True)
    add = sub.add_parser("add", help="a new person: their credential printed once, here")
    add.add_argument("name")
    add.add_argument("--team", required=True)
    add.add_argument("--admin", action="store_true", help="may stop any job and use every Ray route")
    add.add_argument("--expires", default="90d", help="90d, 12h, 30m or never (default 90d)")
    sub.add_parser("list", help="everyone, their team and whether their credential is live")
    revoke = sub.add_parser("revoke", help="their credential refused from now on")
    revoke.add_argument("name")
    a = p.parse_args(argv)
    if a.what == "add":
        made = call("POST", "/gateway/users", {"name": a.name, "team": a.team, "admin": a.admin,
                                               "expires": a.expires})
        print(f"{made['name']} (team {made['team']}{', admin' if a.admin else ''}) may use the cluster until "
              f"{when(made['expires']) if made['expires'] else 'revoked'}. Their credential, shown this once "
              f"(give it to them alone; the head keeps only its hash):\n\n    {made['credential']}\n\n"
              f"They keep it in a file only they can read and point Ray's client at it:\n"
              f"    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<that file>\n"
              f"then `ray job submit`, `ray job list`, ... through the tunnel as before; the dashboard's "
              f"sign-in takes it too.")
    elif a.what == "list":
        now = time.time()
        rows = [[u["name"], u["team"], "yes" if u["admin"] else "", when(u["created"]),
                 "revoked " + when(u["revoked"]) if u["revoked"]
                 else ("expired " if u["expires"] and u["expires"] < now else "") + when(u["expires"])]
                for u in call("GET", "/gateway/users")]
        print(table(rows, ["NAME", "TEAM", "ADMIN", "ADDED", "EXPIRES"]) if rows else "no one yet: "
              "dlcluster user add NAME --team TEAM")
    else:
        call("DELETE", f"/gateway/users/{a.name}")
        print(f"{a.name}'s credential is refused from now on (their running jobs go on: stop them with "
              f"ray job stop as an admin)")


def jobs_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="dlcluster jobs",
                                description="every job the gateway keeps, with its owner")
    p.parse_args(argv)
    rows = [[j["id"], j["owner"], j["team"], j["status"], when(j["submitted"]), when(j["ended"]),
             j["entrypoint"][:60], j["run_url"] or ""] for j in call("GET", "/gateway/jobs")]
    print(table(rows, ["JOB", "OWNER", "TEAM", "STATUS", "SUBMITTED", "ENDED", "ENTRYPOINT", "RUN"])
          if rows else "no jobs yet")


def logs_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="dlcluster logs",
                                description="a job's driver log, as the gateway kept it")
    p.add_argument("job", metavar="ID", nargs="?", default="",
                   help="its submission id (dlcluster jobs lists them)")
    a = p.parse_args(argv)
    if not a.job:
        p.exit(2, "logs: error: name the job: make logs ID=<its submission id> (make jobs lists them)\n")
    print(call("GET", f"/gateway/jobs/{a.job}/log"), end="")


def audit_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="dlcluster audit", description="the audit trail (admins)")
    p.add_argument("--last", type=int, default=50, help="how many of the last entries (default 50; 0: all)")
    a = p.parse_args(argv)
    got = call("GET", "/gateway/audit")
    entries = got["entries"][-a.last:] if a.last else got["entries"]
    rows = [[str(e["seq"]), when(e["time"]), e["actor"], e["action"], e["target"], e["outcome"],
             e["detail"][:50], e["source"]] for e in entries]
    print(table(rows, ["#", "TIME", "WHO", "WHAT", "ON", "OUTCOME", "DETAIL", "FROM"]))
    print(f"the chain is broken: {got['broken']}" if got["broken"] else
          f"the chain holds ({len(got['entries'])} entries)")
