"""What the smoke suite's tests and dlcluster/smoke/run.py share: the steps and their time limits, the
checks of the cluster record, node matching, the trainers' flags, the ProxyJump checks, and
the jobs (submitted over HTTP to the record's job API, a snapshot of this checkout as the
working dir; the job side is ray/smoke_checks.py)."""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

import pytest

from dlcluster import baseline, record
from trainkit.errors import UserError
from trainkit.smoke_protocol import MARKER

REPO = Path(__file__).resolve().parents[2]
PROG = "smoke"
STEPS = ("nodes", "allreduce", "perf", "trainers", "proxyjump")  # the suite's tests, test_<step>, in order
TIMEOUTS = {"nodes": 180, "allreduce": 600, "perf": 600, "trainers": 2700, "proxyjump": 120}  # seconds
# A job past its step's limit is stopped by the test itself (Jobs.run's deadline), which then fails
# with the job's last lines; pytest-timeout stops a test this much later whatever it waits on (the
# trainers' model check may run 300 s past the limit, a stopped job takes up to 30 s to end).
HARD_STOP_AFTER = 360
TRAINERS = ("ddp_autoencoder", "horovod_mnist", "tf_cnn", "finetune_lm")
DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256)
EXCLUDES = list(record.EXCLUDES)  # what the ignore files leave behind: .git travels, for the manifest
LOG_TAIL = 30
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its log prefixes


def log(message: str) -> None:
    print(f"[{PROG}] {message}", flush=True)


# ------------------------------------------------------------------ the cluster record
def check_token(rec: record.ClusterRecord, path: Path) -> None:
    token = Path(rec.token_path)
    if not token.is_file():
        raise UserError(f"the Ray token {token} (token_path in {path}) does not exist; run make "
                        f"cluster-up first, or fix token_path")
    if not os.access(token, os.R_OK):
        raise UserError(f"the Ray token {token} (token_path in {path}) is not readable by this "
                        f"user; fix its owner or run make smoke as the user who ran cluster-up")


def check_job_api(url: str, timeout: float = 5) -> None:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=timeout):
            pass
    except OSError as e:
        raise UserError(f"nothing answers on the job API {url} ({e.strerror or e}); run make "
                        f"cluster-up first (for a remote cluster: open its tunnel)") from None


# ------------------------------------------------------------------ node matching
def match_nodes(expected: list[record.Node], actual: list[dict]) -> list[str]:
    """Problems between the cluster record's nodes and Ray's alive ones (empty: they match).

    `actual` items: {"ip", "cpus", "gpus", "head": bool, ...}. The record's nodes with an ip are
    matched to the Ray node with that address; the others (ip null, the local cluster) are
    compared with the remaining Ray nodes as multisets of (CPUs, GPUs).
    """
    problems = []
    if len(actual) != len(expected):
        problems.append(f"{len(actual)} Ray node(s) alive, the cluster record lists {len(expected)}")
    rest = list(actual)
    by_resources = []
    for e in expected:
        if e.ip is None:
            by_resources.append(e)
            continue
        found = next((a for a in rest if a.get("ip") == e.ip), None)
        if found is None:
            problems.append(f"node {e.name} ({e.ip}) has not joined")
            continue
        rest.remove(found)
        if (found["cpus"], found["gpus"]) != (e.cpus, e.gpus):
            problems.append(f"node {e.name} ({e.ip}) offers {found['cpus']} CPU(s) and "
                            f"{found['gpus']} GPU(s), the cluster record says {e.cpus} and {e.gpus}")
        if found.get("head") != (e.role == "head"):
            problems.append(f"node {e.name} ({e.ip}) is {'the' if found.get('head') else 'not the'} "
                            f"Ray head, the cluster record says {e.role}")
    want = Counter((e.cpus, e.gpus) for e in by_resources)
    have = Counter((a["cpus"], a["gpus"]) for a in rest)
    for (cpus, gpus), k in sorted((want - have).items()):
        problems.append(f"{k} node(s) with {cpus} CPU(s) and {gpus} GPU(s) in the cluster record but "
                        f"not found")
    for (cpus, gpus), k in sorted((have - want).items()):
        ips = sorted({str(a.get("ip")) for a in rest if (a["cpus"], a["gpus"]) == (cpus, gpus)})
        problems.append(f"{k} Ray node(s) with {cpus} CPU(s) and {gpus} GPU(s) not in the "
                        f"cluster record (at {', '.join(ips)})")
    heads = [a for a in actual if a.get("head")]
    if len(heads) != 1:
        problems.append(f"{len(heads)} alive Ray node(s) are the head, not 1")
    return problems


def stale_harness(where: dict) -> str | None:
    """Why a process ran a harness other than its job's upload (an installed copy shadowing it), or None."""
    harness, upload = where.get("harness"), where.get("working_dir")
    if harness is None or upload is None or Path(harness).is_relative_to(upload):
        return None
    return (f"it imported the harness from {harness}, not from the job's upload ({upload}): an installed "
            "copy shadows the code submitted (PYTHONPATH, or a .pth file before it)")


def node_problems(payload: dict, expected: list[record.Node]) -> list[str]:
    """match_nodes, plus every node's dashboard agent, pinned task and the harness it ran."""
    nodes = payload["nodes"]
    problems = match_nodes(expected, nodes)
    if stale := stale_harness(payload.get("driver") or {}):
        problems.append(f"the driver: {stale}")
    for n in nodes:
        who = f"Ray node {n.get('hostname')} ({n.get('ip')}, {str(n.get('node_id'))[:8]})"
        if not n.get("agent"):
            problems.append(f"{who}: its dashboard agent has not registered (it cannot take jobs)")
        task = n.get("task")
        if task is None:
            problems.append(f"{who}: a task pinned to it did not finish within "
                            f"{payload.get('probe_timeout_s', '?')} s")
        elif "error" in task:
            problems.append(f"{who}: a task pinned to it failed: {task['error']}")
        elif stale := stale_harness(task):
            problems.append(f"{who}: {stale}")
    return problems


# ------------------------------------------------------------------ trainers' flags
def trainer_args(job: str, workers: int, use_gpu: bool) -> list[str]:
    """Flags for one tiny epoch with `workers` workers; the data grows with the worker count so
    each worker's share still holds a whole batch (the jobs' check_batch)."""
    # one worker on each node: the tiny epoch really crosses the nodes
    common = ["--num-workers", str(workers), "--epochs", "1", "--use-gpu", "true" if use_gpu else "false",
              "--placement", "STRICT_SPREAD"]
    if job == "ddp_autoencoder":
        return [*common, "--limit", str(max(256, 20 * workers)), "--batch-size", "16"]
    if job == "horovod_mnist":  # 1500 built-in training digits
        return [*common, "--batch-size", str(max(1, min(64, 1500 // workers)))]
    if job == "tf_cnn":
        return [*common, "--per-class", str(max(24, 6 * workers)), "--batch-size", "4"]
    if job == "finetune_lm":  # the tiny model sharded over the workers (FSDP2), blocks of 128 tokens
        return [*common, "--limit", str(128 * max(24, 6 * workers)), "--batch-size", "4", "--samples", "1"]
    raise ValueError(job)


# ------------------------------------------------------------------ perf
def perf_skip_reason(rec: record.ClusterRecord, recording: bool) -> str | None:
    """Why the perf step cannot compare (or record) on this cluster, or None."""
    if rec.kind != "ansible" or not rec.ssh_config:
        return (f"cluster {rec.name} is a local one: its nodes share this machine, a per-node "
                "baseline means nothing there (make baseline is for servers from an inventory)")
    if not recording and baseline.latest(rec.name) is None:
        return (f"no performance baseline for cluster {rec.name} yet "
                f"({baseline.folder(rec.name)}): make baseline, with no job running")
    return None


# ------------------------------------------------------------------ proxyjump
def proxyjump_skip_reason(rec: record.ClusterRecord) -> str | None:
    if not rec.ssh_config or not rec.bastion:
        return (f"the cluster record has no ssh_config and bastion (kind {rec.kind}): "
                f"no node sits behind a bastion")
    if not any(n.ip for n in rec.nodes):
        return "no node in the cluster record has an ip to try directly"
    return None


def direct_tcp(ip: str, port: int = 22, timeout: float = 3.0) -> tuple[bool, str]:
    """(connected, how): a direct TCP connection from this machine to ip:port."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True, "connected"
    except TimeoutError:
        return False, f"timed out after {timeout:g} s"
    except OSError as e:
        return False, e.strerror or type(e).__name__


def ssh_route(ssh_config: str, host: str, bastion: str, ssh: str = "ssh") -> tuple[bool, dict]:
    """Does ssh_config send `host` through the bastion? `ssh -G` prints the effective options
    without connecting: ProxyJump's first hop (or a ProxyCommand word) must be the bastion."""
    proc = subprocess.run([ssh, "-G", "-F", ssh_config, host], capture_output=True, text=True,
                          timeout=15)
    if proc.returncode != 0:
        return False, {"error": f"ssh -G failed: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    opts: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        opts.setdefault(key.lower(), value.strip())
    info = {"hostname": opts.get("hostname"), "proxyjump": opts.get("proxyjump"),
            "proxycommand": opts.get("proxycommand")}
    jump = opts.get("proxyjump")
    if jump and jump != "none":
        first = jump.split(",")[0].removeprefix("ssh://").rsplit("@", 1)[-1]
        first = first.rsplit(":", 1)[0] if first.count(":") == 1 else first
        return first == bastion, info
    command = opts.get("proxycommand")
    if command and command != "none":
        return bastion in command.split(), info
    return False, info


def check_node_proxyjump(node: record.Node, ssh_config: str, bastion: str, *, port: int = 22,
                         ssh: str = "ssh", tcp_timeout: float = 3.0, ssh_timeout: float = 60) -> dict:
    """One node with an ip: a direct connection to ip:port must fail, ssh_config must route the
    node through the bastion, and `ssh -F ssh_config NAME hostname` must succeed."""
    name, ip = node.name, node.ip
    if ip is None:  # the step checks only the nodes with an ip (the others are its not_checked)
        raise ValueError(f"node {name} has no ip to try directly")
    problems = []
    connected, how = direct_tcp(ip, port, tcp_timeout)
    if connected:
        problems.append(f"{ip}:{port} accepts a direct connection from here: the bastion is not "
                        f"the only way in")
    routed, route = ssh_route(ssh_config, name, bastion, ssh)
    if not routed:
        problems.append(route.get("error") or f"{ssh_config} does not send {name} through "
                        f"{bastion} (proxyjump {route.get('proxyjump')}, proxycommand "
                        f"{route.get('proxycommand')})")
    target = route.get("hostname")
    try:
        if target and ipaddress.ip_address(target) != ipaddress.ip_address(ip):
            problems.append(f"{ssh_config} sends {name} to {target}, the cluster record says {ip}")
    except ValueError:
        pass  # a DNS name: the bastion resolves it
    cmd = [ssh, "-F", ssh_config, "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", name, "hostname"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ssh_timeout,
                              stdin=subprocess.DEVNULL)
        ssh_ok, said = proc.returncode == 0, (proc.stdout.strip() or proc.stderr.strip())[-300:]
    except subprocess.TimeoutExpired:
        ssh_ok, said = False, f"no answer within {ssh_timeout:g} s"
    if not ssh_ok:
        problems.append(f"`{shlex.join(cmd)}` failed: {said}")
    return {"name": name, "ip": ip, "direct": {"port": port, "connected": connected, "how": how},
            "route": route, "ssh": {"ok": ssh_ok, "output": said}, "ok": not problems,
            "problems": problems}


# ------------------------------------------------------------------ running jobs
@dataclass
class JobRun:
    job_id: str
    status: str
    seconds: float
    logs: str
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"

    def tail(self, lines: int = LOG_TAIL) -> list[str]:
        return ANSI.sub("", self.logs).rstrip().splitlines()[-lines:]

    def payload(self) -> dict | None:
        return parse_payload(self.logs)

    def summary(self) -> dict:
        return {"job_id": self.job_id, "status": self.status, "seconds": round(self.seconds, 1),
                **({"message": self.message} if self.message and not self.ok else {})}


def parse_payload(logs: str) -> dict | None:
    """The last `SMOKE_JSON {...}` line of a job's logs (wherever it starts in the line)."""
    for line in reversed(logs.splitlines()):
        _, sep, rest = line.partition(MARKER)
        if sep:
            try:
                return json.loads(rest)
            except json.JSONDecodeError:
                return None
    return None


def snapshot(repo: Path, dest: Path) -> Path:
    """A frozen copy of the checkout for every job of one smoke run: the files git tracks or
    would track (not what .gitignore leaves out) plus .git, so manifests still name the commit.

    Ray hashes the working dir once to name its package and again to upload it: a file edited
    in between (someone working in the checkout) gives the job a package that was never
    uploaded ("Failed to download runtime_env file package"). A copy cannot change, and every
    step runs the same code. Without git the checkout itself is used.
    """
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return repo
    dest.mkdir(parents=True, exist_ok=True)
    for rel in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        src = repo / rel
        if src.is_file() and not any(part in EXCLUDES for part in Path(rel).parts):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel, follow_symlinks=False)
    if (repo / ".git").is_dir():
        shutil.copytree(repo / ".git", dest / ".git", symlinks=True,
                        ignore=shutil.ignore_patterns("*.lock"))
    return dest


class Jobs:
    """Submits entrypoints with a snapshot of this checkout as the working dir and waits."""

    TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

    def __init__(self, address: str, working_dir: Path = REPO):
        from ray.job_submission import JobSubmissionClient

        self.working_dir = working_dir
        self.running: set[str] = set()  # submitted, not yet seen ended (stop_all's)

        for name in ("ray", "ray.dashboard.modules.dashboard_sdk"):  # chatter on every submission
            logging.getLogger(name).setLevel(logging.WARNING)

        try:
            self.client = JobSubmissionClient(address)
        except Exception as e:  # connection refused, 401/403, an old or odd server
            text = " ".join(str(e).split())
            if any(w in text.lower() for w in ("401", "403", "unauthorized", "forbidden", "token")):
                why = next((w for w in ("Missing authentication token", "Invalid authentication token",
                                        "unknown credential")
                            if w.lower() in text.lower()), text[:200])
                raise UserError(f"the job API {address} refused the token in "
                                f"{os.environ.get('RAY_AUTH_TOKEN_PATH')} ({why}); check token_path "
                                f"in the cluster record, or rerun make cluster-up") from None
            text = text[:300]
            raise UserError(f"the job API {address} does not answer as Ray's ({text}); run make "
                            f"cluster-up first (for a remote cluster: open its tunnel)") from None

    def run(self, label: str, argv: list[str], deadline: float, note: Callable[[str], None] = log,
            every: float = 30) -> JobRun:
        job_id = f"smoke-{label}-{time.strftime('%H%M%S')}-{secrets.token_hex(3)}"
        t0 = time.monotonic()
        note(f"{label}: submitting {shlex.join(argv)} (job {job_id})")
        self.running.add(job_id)
        self.client.submit_job(entrypoint=shlex.join(argv), submission_id=job_id,
                               runtime_env={"working_dir": str(self.working_dir), "excludes": EXCLUDES})
        try:
            status = self._wait(label, job_id, t0, deadline, note, every)
        except BaseException:  # pytest-timeout's hard stop, Ctrl-C: the job must not outlive the wait
            note(f"{label}: interrupted; stopping job {job_id}")
            self._stop(job_id)
            raise
        finally:
            self.running.discard(job_id)
        seconds = time.monotonic() - t0
        try:
            logs = self.client.get_job_logs(job_id)
        except Exception as e:
            logs = f"(could not fetch the logs: {e})"
        message = ""
        if status != "SUCCEEDED":
            try:
                message = self.client.get_job_info(job_id).message or ""
            except Exception:
                pass
        return JobRun(job_id, status, seconds, logs, message)

    def stop_all(self) -> None:
        """Stop every job still running (the waits of other threads, when the main one is interrupted)."""
        for job_id in list(self.running):
            self._stop(job_id)

    def _status(self, job_id: str) -> str:
        return str(self.client.get_job_status(job_id)).rsplit(".", 1)[-1]

    def _wait(self, label: str, job_id: str, t0: float, deadline: float, note: Callable[[str], None],
              every: float) -> str:
        """The job's terminal status, or TIMEOUT once `deadline` passed (the job stopped)."""
        last = t0
        while True:
            status = self._status(job_id)
            if status in self.TERMINAL:
                return status
            now = time.monotonic()
            if now >= deadline:
                note(f"{label}: no result after {now - t0:.0f} s; stopping job {job_id}")
                self._stop(job_id)
                return "TIMEOUT"
            if now - last >= every:
                note(f"{label}: {status.lower()} ({now - t0:.0f} s)")
                last = now
            time.sleep(1)

    def _stop(self, job_id: str, wait: float = 30) -> None:
        try:
            self.client.stop_job(job_id)
            stop_by = time.monotonic() + wait
            while time.monotonic() < stop_by and self._status(job_id) not in self.TERMINAL:
                time.sleep(1)
        except Exception:  # stopping is best effort; the wait's own error says more
            pass


# ------------------------------------------------------------------ the steps' context
@dataclass
class Context:
    """What every step reads: the cluster record, the command line, the job client, and the
    running step's deadline (set by the suite's `ctx` fixture from TIMEOUTS)."""

    rec: record.ClusterRecord
    args: argparse.Namespace
    jobs: Jobs | None
    deadline: float = 0.0
    results: dict = field(default_factory=dict)  # step -> its details, for the steps after it
    stamp: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S"))

    @property
    def client(self) -> Jobs:
        """The job client: every step has one but the proxyjump step (smoke/run.py)."""
        if self.jobs is None:
            raise RuntimeError("this step runs jobs, but the suite opened no job client (--only proxyjump?)")
        return self.jobs

    @property
    def worker_nodes(self) -> list[record.Node]:
        """The nodes that take one training worker each: all with a CPU (a head started with
        --num-cpus 0 schedules nothing and is left out)."""
        return [n for n in self.rec.nodes if n.cpus >= 1]

    @property
    def workers(self) -> int:
        return len(self.worker_nodes)

    @property
    def left_out(self) -> list[str]:
        return [n.name for n in self.rec.nodes if n.cpus < 1]

    @property
    def use_gpu(self) -> bool:
        """GPUs (NCCL) when every worker node has one, else CPUs (gloo)."""
        return bool(self.worker_nodes) and all(n.gpus > 0 for n in self.worker_nodes)

    @property
    def trainers_at_once(self) -> int:
        """How many of the trainers fit the cluster together: each puts one worker on every worker
        node (a CPU each, or a GPU each when training on GPUs), so as many as the smallest node holds."""
        if not self.worker_nodes:
            return 1
        per_node = min(n.gpus if self.use_gpu else n.cpus for n in self.worker_nodes)
        return max(1, min(len(self.trainers), per_node))

    @property
    def trainers(self) -> list[str]:
        """The trainers this run trains (--trainers: all of TRAINERS by default)."""
        return self.args.trainers

    def need_workers(self) -> None:
        if not self.worker_nodes:
            pytest.fail("no node in the cluster record offers a CPU: no training worker can run")


CONTEXT = pytest.StashKey[Context]()  # run.py puts the run's Context in the config's stash


def fail(details: dict, message: str, **more) -> NoReturn:
    """Fail the running step: `message` is its error, `more` joins what `details` holds (the
    report's details of a failed step: {"error": message, **details})."""
    details.update(more)
    pytest.fail(message, pytrace=False)


def job_error(what: str, run: JobRun) -> str:
    verb = {"TIMEOUT": "ran past the step's time limit and was stopped",
            "STOPPED": "was stopped"}.get(run.status, run.status.lower())
    return (f"{what} {verb} after {run.seconds:.0f} s"
            + (f": {run.message.strip().splitlines()[-1]}" if run.message.strip() else ""))


def failed_job(details: dict, what: str, run: JobRun) -> NoReturn:
    fail(details, job_error(what, run), job=run.summary(), log_tail=run.tail())


def job_payload(ctx: Context, details: dict, label: str, argv: list[str], what: str) -> tuple[dict, JobRun]:
    run = ctx.client.run(label, argv, ctx.deadline)
    if not run.ok:
        failed_job(details, what, run)
    payload = run.payload()
    if payload is None:
        fail(details, f"{what} printed no {MARKER.strip()} line", job=run.summary(), log_tail=run.tail())
    return payload, run


