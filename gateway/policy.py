"""Who may do what through the gateway, as pure functions over a request's method and path.

An allow-list of Ray's routes: what Ray serves without a token (its page's shell, health checks)
stays open; the job API is every person's (submitting, listing, reading logs; stopping and
deleting only one's own job, or any as an admin); the dashboard's read-only views are every
person's; anything else Ray serves (killing actors, profiling a worker, Serve's deployments, the
state API's writes, routes a newer Ray adds) is for admins only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Kind(Enum):
    OPEN = "open"  # Ray's own public routes: forwarded without a credential
    SIGN_IN = "sign-in"  # the dashboard's sign-in (the gateway answers it)
    READ = "read"  # any person
    SUBMIT = "submit"  # any person; the gateway sets the job's owner
    OWNED = "owned"  # the job's owner or an admin
    JOB_READ = "job-read"  # any person: a job's record or log (Ray's, else the gateway's)
    JOBS = "jobs"  # the job list: Ray's, with the gateway's records of jobs Ray forgot
    GATEWAY = "gateway"  # the gateway's own API (/gateway/...): its handlers check who may
    ADMIN = "admin"  # everything not listed


JOB = r"(?P<job>[^/]+)"
RULES: list[tuple[set[str], re.Pattern[str], Kind]] = [(set(m.split()), re.compile(p), k) for m, p, k in [
    # Ray's public routes (its page loads, then asks for a token)
    ("GET", r"/|/favicon\.ico|/static/.+|/api/authentication_mode|/api/healthz|/api/gcs_healthz"
                 r"|/api/local_raylet_healthz|/-/healthz", Kind.OPEN),
    ("POST", r"/api/authenticate", Kind.SIGN_IN),
    # the job API (ray job submit / list / status / logs / stop / delete)
    ("GET", r"/api/version", Kind.READ),
    ("GET", r"/api/packages/[^/]+/[^/]+", Kind.READ),
    ("PUT", r"/api/packages/[^/]+/[^/]+", Kind.READ),  # a working dir's upload (content-addressed)
    ("POST", r"/api/jobs/", Kind.SUBMIT),
    ("GET", r"/api/jobs/", Kind.JOBS),
    ("GET", rf"/api/jobs/{JOB}(/logs(/tail)?)?", Kind.JOB_READ),
    ("POST", rf"/api/jobs/{JOB}/stop", Kind.OWNED),
    ("DELETE", rf"/api/jobs/{JOB}", Kind.OWNED),
    # the dashboard's read-only views
    ("GET", r"/api/v0/(actors|jobs|nodes|placement_groups|workers|tasks|objects|runtime_envs|cluster_events"
            r"|platform_events|cluster_metadata|runtime_env_redaction|logs|logs/[^/]+|tasks/summarize"
            r"|actors/summarize|objects/summarize|tasks/timeline)", Kind.READ),
    ("GET", r"/api/cluster_status|/nodes|/nodes/[^/]+|/logical/actors|/logical/actors/[^/]+|/events"
            r"|/api/component_activities|/api/grafana_health|/api/prometheus_health|/timezone"
            r"|/api/serve/applications/|/api/data/datasets/[^/]+|/api/train/v2/runs|/api/profiling_enabled"
            r"|/usage_stats_enabled|/cluster_id|/api/ray/version", Kind.READ),
    # the gateway's own
    ("GET POST DELETE", r"/gateway/.*", Kind.GATEWAY),
]]


def classify(method: str, path: str) -> tuple[Kind, str | None]:
    """The kind of a request, and the job it names (stop, delete, a job's record or log). HEAD is
    GET without the body (the dashboard asks it of some views)."""
    method = "GET" if method == "HEAD" else method
    for methods, pattern, kind in RULES:
        if method in methods and (m := pattern.fullmatch(path)):
            return kind, m.groupdict().get("job")
    return Kind.ADMIN, None


@dataclass(frozen=True)
class Caller:
    name: str
    team: str
    admin: bool

    def describe(self) -> str:
        return f"{self.name} (team {self.team}{', admin' if self.admin else ''})"


OPERATOR = Caller("operator", "operators", True)  # the holder of the cluster's Ray token


def may_change(caller: Caller, owner: str) -> bool:
    return caller.admin or caller.name == owner


def not_yours(caller: Caller, action: str, job_id: str, owner: str, team: str) -> str:
    return (f"{action} {job_id}: refused for {caller.name}: the job belongs to {owner} (team {team}); "
            f"only {owner} or an admin may {action} it")


UNITS = {"d": 86400, "h": 3600, "m": 60}


def lifetime(text: str) -> float | None:
    """`90d`, `12h`, `30m` in seconds; `never` None; anything else a ValueError naming the form."""
    if text == "never":
        return None
    if (m := re.fullmatch(r"([1-9][0-9]*)([dhm])", text)) is None:
        raise ValueError(f"--expires {text}: give a number of days, hours or minutes (90d, 12h, 30m) "
                         f"or never")
    return int(m.group(1)) * UNITS[m.group(2)]
