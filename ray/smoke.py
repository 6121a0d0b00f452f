"""Multi-node smoke tests against any running cluster, read from its description file.

    .venv/bin/python ray/smoke.py [--config FILE] [--only nodes,allreduce,trainers,proxyjump]
                                  [--sizes 1,4,16,64,256 | --max-mib N] [--json PATH]

Steps, in this order (each with a time limit, a progress line, and a result in the report):

  nodes      every node joined with the CPUs and GPUs the description lists, its dashboard agent
             registered, and a task pinned to it runs
  allreduce  Ray Train's TorchTrainer (Train V2), one worker per node (STRICT_SPREAD; a node with
             no CPU is left out), gloo on CPU, NCCL when every such node has a GPU: all-reduce of
             1-256 MiB float32, every element checked, time per op, algbw and busbw as
             nccl-tests defines them
  trainers   jobs/ddp_autoencoder.py, jobs/horovod_mnist.py and jobs/tf_cnn.py, one tiny epoch with
             one worker per node; each must succeed and leave an ONNX model that a check job on the
             cluster loads in onnxruntime, runs on zeros and checks against its manifest
  proxyjump  (only with ssh_config and bastion) every node with an ip refuses a direct TCP
             connection to port 22 from here, and `ssh -F ssh_config NODE hostname` gets through
             the bastion

Everything but proxyjump runs as a Ray job submitted over HTTP to the description's job_api
(ray.job_submission.JobSubmissionClient, token auth), with this repository as the working dir;
the job side is ray/smoke_checks.py, which prints one `SMOKE_JSON {...}` line read back from
the job's logs. The client never joins the cluster (no ray.init), so its Python may differ from
the nodes' in the patch release.

Writes a JSON report (default $DLC_CONFIG/smoke/<name>-<UTC time>.json) and prints one line per
step. Exit status: 0 when every step that ran passed, 1 when one failed, 2 when the description
is missing or bad, or nothing answers on its job API (one line saying what to do).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import logging
import os
import platform
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # trainkit
sys.path.insert(0, str(Path(__file__).resolve().parent))  # smoke_checks, also when imported

from smoke_checks import MARKER, MIB  # noqa: E402

from trainkit import record  # noqa: E402
from trainkit.errors import EXIT_USER_ERROR, UserError  # noqa: E402

PROG = "smoke"
STEPS = ("nodes", "allreduce", "trainers", "proxyjump")
TIMEOUTS = {"nodes": 180, "allreduce": 600, "trainers": 2700, "proxyjump": 120}  # seconds
TRAINERS = ("ddp_autoencoder", "horovod_mnist", "tf_cnn")
DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256)
EXCLUDES = list(record.EXCLUDES)  # as ray-client.env sets them: .git travels, for the manifest
LOG_TAIL = 30
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its log prefixes


def log(message: str) -> None:
    print(f"[{PROG}] {message}", flush=True)


# ------------------------------------------------------------------ the cluster record
def load_description(path: Path) -> dict:
    """The cluster record (trainkit/record.py) as a dict; a bad one is a one-line UserError."""
    return record.load(path).model_dump()


def check_token(desc: dict, path: Path) -> None:
    token = Path(desc["token_path"])
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
def match_nodes(expected: list[dict], actual: list[dict]) -> list[str]:
    """Problems between the described nodes and Ray's alive ones (empty: they match).

    `actual` items: {"ip", "cpus", "gpus", "head": bool, ...}. Described nodes with an ip are
    matched to the Ray node with that address; the others (ip null, the local cluster) are
    compared with the remaining Ray nodes as multisets of (CPUs, GPUs).
    """
    problems = []
    if len(actual) != len(expected):
        problems.append(f"{len(actual)} Ray node(s) alive, the description lists {len(expected)}")
    rest = list(actual)
    by_resources = []
    for e in expected:
        if e.get("ip") is None:
            by_resources.append(e)
            continue
        found = next((a for a in rest if a.get("ip") == e["ip"]), None)
        if found is None:
            problems.append(f"node {e['name']} ({e['ip']}) has not joined")
            continue
        rest.remove(found)
        if (found["cpus"], found["gpus"]) != (e["cpus"], e["gpus"]):
            problems.append(f"node {e['name']} ({e['ip']}) offers {found['cpus']} CPU(s) and "
                            f"{found['gpus']} GPU(s), the description says {e['cpus']} and {e['gpus']}")
        if found.get("head") != (e["role"] == "head"):
            problems.append(f"node {e['name']} ({e['ip']}) is {'the' if found.get('head') else 'not the'} "
                            f"Ray head, the description says {e['role']}")
    want = Counter((e["cpus"], e["gpus"]) for e in by_resources)
    have = Counter((a["cpus"], a["gpus"]) for a in rest)
    for (cpus, gpus), k in sorted((want - have).items()):
        problems.append(f"{k} node(s) with {cpus} CPU(s) and {gpus} GPU(s) described but not found")
    for (cpus, gpus), k in sorted((have - want).items()):
        ips = sorted({str(a.get("ip")) for a in rest if (a["cpus"], a["gpus"]) == (cpus, gpus)})
        problems.append(f"{k} Ray node(s) with {cpus} CPU(s) and {gpus} GPU(s) not in the "
                        f"description (at {', '.join(ips)})")
    heads = [a for a in actual if a.get("head")]
    if len(heads) != 1:
        problems.append(f"{len(heads)} alive Ray node(s) are the head, not 1")
    return problems


def node_problems(payload: dict, expected: list[dict]) -> list[str]:
    """match_nodes, plus every node's dashboard agent and pinned task."""
    nodes = payload["nodes"]
    problems = match_nodes(expected, nodes)
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
    raise ValueError(job)


# ------------------------------------------------------------------ proxyjump
def proxyjump_skip_reason(desc: dict) -> str | None:
    if not desc.get("ssh_config") or not desc.get("bastion"):
        return (f"the description has no ssh_config and bastion (kind {desc.get('kind')}): "
                f"no node sits behind a bastion")
    if not any(n.get("ip") for n in desc["nodes"]):
        return "no node in the description has an ip to try directly"
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


def check_node_proxyjump(node: dict, ssh_config: str, bastion: str, *, port: int = 22,
                         ssh: str = "ssh", tcp_timeout: float = 3.0, ssh_timeout: float = 60) -> dict:
    """One node: a direct connection to ip:port must fail, ssh_config must route the node
    through the bastion, and `ssh -F ssh_config NAME hostname` must succeed."""
    name, ip = node["name"], node["ip"]
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
            problems.append(f"{ssh_config} sends {name} to {target}, the description says {ip}")
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

        for name in ("ray", "ray.dashboard.modules.dashboard_sdk"):  # chatter on every submission
            logging.getLogger(name).setLevel(logging.WARNING)

        try:
            self.client = JobSubmissionClient(address)
        except Exception as e:  # connection refused, 401/403, an old or odd server
            text = " ".join(str(e).split())
            if any(w in text.lower() for w in ("401", "403", "unauthorized", "forbidden", "token")):
                why = next((w for w in ("Missing authentication token", "Invalid authentication token")
                            if w.lower() in text.lower()), text[:200])
                raise UserError(f"the job API {address} refused the token in "
                                f"{os.environ.get('RAY_AUTH_TOKEN_PATH')} ({why}); check token_path "
                                f"in the description, or rerun make cluster-up") from None
            text = text[:300]
            raise UserError(f"the job API {address} does not answer as Ray's ({text}); run make "
                            f"cluster-up first (for a remote cluster: open its tunnel)") from None

    def run(self, label: str, argv: list[str], deadline: float, note: Callable[[str], None] = log,
            every: float = 30) -> JobRun:
        job_id = f"smoke-{label}-{time.strftime('%H%M%S')}-{secrets.token_hex(3)}"
        t0 = time.monotonic()
        note(f"{label}: submitting {shlex.join(argv)} (job {job_id})")
        self.client.submit_job(entrypoint=shlex.join(argv), submission_id=job_id,
                               runtime_env={"working_dir": str(self.working_dir), "excludes": EXCLUDES})
        last = t0
        while True:
            status = str(self.client.get_job_status(job_id)).rsplit(".", 1)[-1]
            if status in self.TERMINAL:
                break
            now = time.monotonic()
            if now >= deadline:
                note(f"{label}: no result after {now - t0:.0f} s; stopping job {job_id}")
                self.client.stop_job(job_id)
                stop_by = time.monotonic() + 30
                while (time.monotonic() < stop_by and str(self.client.get_job_status(job_id))
                       .rsplit(".", 1)[-1] not in self.TERMINAL):
                    time.sleep(1)
                status = "TIMEOUT"
                break
            if now - last >= every:
                note(f"{label}: {status.lower()} ({now - t0:.0f} s)")
                last = now
            time.sleep(1)
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


# ------------------------------------------------------------------ steps
class StepFailed(Exception):
    def __init__(self, message: str, **details):
        super().__init__(message)
        self.details = details


class StepSkipped(Exception):
    pass


@dataclass
class Context:
    desc: dict
    args: argparse.Namespace
    jobs: Jobs | None
    deadline: float = 0.0
    stamp: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S"))

    @property
    def worker_nodes(self) -> list[dict]:
        """The nodes that take one training worker each: all with a CPU (a head started with
        --num-cpus 0 schedules nothing and is left out)."""
        return [n for n in self.desc["nodes"] if n["cpus"] >= 1]

    @property
    def workers(self) -> int:
        return len(self.worker_nodes)

    @property
    def left_out(self) -> list[str]:
        return [n["name"] for n in self.desc["nodes"] if n["cpus"] < 1]

    @property
    def use_gpu(self) -> bool:
        """GPUs (NCCL) when every worker node has one, else CPUs (gloo)."""
        return bool(self.worker_nodes) and all(n["gpus"] > 0 for n in self.worker_nodes)

    def need_workers(self) -> None:
        if not self.worker_nodes:
            raise StepFailed("no node in the description offers a CPU: no training worker can run")


def failed_job(what: str, run: JobRun) -> StepFailed:
    verb = {"TIMEOUT": "ran past the step's time limit and was stopped",
            "STOPPED": "was stopped"}.get(run.status, run.status.lower())
    return StepFailed(f"{what} {verb} after {run.seconds:.0f} s"
                      + (f": {run.message.strip().splitlines()[-1]}" if run.message.strip() else ""),
                      job=run.summary(), log_tail=run.tail())


def job_payload(ctx: Context, label: str, argv: list[str], what: str) -> tuple[dict, JobRun]:
    run = ctx.jobs.run(label, argv, ctx.deadline)
    if not run.ok:
        raise failed_job(what, run)
    payload = run.payload()
    if payload is None:
        raise StepFailed(f"{what} printed no {MARKER.strip()} line", job=run.summary(),
                         log_tail=run.tail())
    return payload, run


def step_nodes(ctx: Context) -> dict:
    payload, run = job_payload(ctx, "nodes", ["python", "ray/smoke_checks.py", "nodes"],
                               "the nodes job")
    expected = ctx.desc["nodes"]
    problems = node_problems(payload, expected)
    nodes = payload["nodes"]
    details = {
        "expected": len(expected), "alive": len(nodes), "dead": payload.get("dead", 0),
        "agents": sum(1 for n in nodes if n.get("agent")),
        "cpus": sorted(n["cpus"] for n in nodes), "gpus": sorted(n["gpus"] for n in nodes),
        "nodes": nodes, "driver": payload.get("driver"), "job": run.summary(),
    }
    if problems:
        raise StepFailed("; ".join(problems), problems=problems, **details)
    return details


def sizes_bytes(args: argparse.Namespace) -> list[int]:
    sizes = [int(float(s) * MIB) // 4 * 4 for s in args.sizes.split(",") if s.strip()]
    return sorted({s for s in sizes if s > 0 and (args.max_mib is None or s <= args.max_mib * MIB)})


def step_allreduce(ctx: Context) -> dict:
    ctx.need_workers()
    argv = ["python", "ray/smoke_checks.py", "allreduce", "--num-workers", str(ctx.workers),
            "--sizes", ",".join(map(str, ctx.args.sizes_bytes)),
            "--name", f"smoke-allreduce-{ctx.stamp}"]
    if ctx.use_gpu:
        argv.append("--use-gpu")
    if ctx.args.storage_path:
        argv += ["--storage-path", ctx.args.storage_path]
    payload, run = job_payload(ctx, "allreduce", argv, "the allreduce job")
    if "error" in payload:
        raise StepFailed(payload["error"], job=run.summary())
    rows = payload["rows"]
    details = {"backend": payload["backend"], "world_size": payload["world_size"],
               "nodes_used": payload["nodes_used"], "placement_strategy": payload["placement_strategy"],
               "rows": rows, "ranks": payload["ranks"], "fit_s": payload.get("fit_s"),
               "left_out": ctx.left_out, "job": run.summary()}
    problems = []
    if payload["world_size"] != ctx.workers or payload["nodes_used"] != ctx.workers:
        problems.append(f"{payload['world_size']} ranks on {payload['nodes_used']} node(s), "
                        f"expected one on each of {ctx.workers}")
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        problems.append(f"{wrong} wrong element(s): " + ", ".join(
            f"{r['bytes']} B: {r['wrong']}" for r in rows if r["wrong"]))
    if [r["bytes"] for r in rows] != ctx.args.sizes_bytes:
        problems.append("the job measured other sizes than asked")
    if problems:
        raise StepFailed("; ".join(problems), problems=problems, **details)
    return details


def step_trainers(ctx: Context) -> dict:
    ctx.need_workers()
    results: dict[str, dict] = {}
    models = []
    for job in TRAINERS:
        name = f"smoke-{job.replace('_', '-')}-{ctx.stamp}"
        argv = ["python", f"jobs/{job}.py", *trainer_args(job, ctx.workers, ctx.use_gpu), "--name", name]
        if ctx.args.storage_path:
            argv += ["--storage-path", ctx.args.storage_path]
        if ctx.args.models_dir:
            argv += ["--output", str(Path(ctx.args.models_dir) / name)]
        if time.monotonic() >= ctx.deadline:
            results[job] = {"name": name, "ok": False, "error": f"{job}: no time left in the step"}
            continue
        run = ctx.jobs.run(job, argv, ctx.deadline)
        results[job] = {"name": name, **run.summary()}
        if not run.ok:
            results[job].update(ok=False, error=str(failed_job(job, run)), log_tail=run.tail())
            log(f"{job}: {run.status} after {run.seconds:.0f} s; the job's last {len(run.tail())} lines:")
            for line in run.tail():
                print(f"    {line}", flush=True)
        else:
            log(f"{job}: succeeded in {run.seconds:.0f} s")
            # the check job finds the model through the run's record (published.json)
            models.append({"job": job, "name": name, "storage_path": ctx.args.storage_path})
    if models:
        argv = ["python", "ray/smoke_checks.py", "models", "--world-size", str(ctx.workers),
                "--runs", json.dumps(models)]
        if ctx.args.clean:
            argv.append("--clean")
        run = ctx.jobs.run("models", argv, max(ctx.deadline, time.monotonic() + 300))
        payload = run.payload() if run.ok else None
        checked = {m["job"]: m for m in (payload or {}).get("models", [])}
        for m in models:
            r = results[m["job"]]
            got = checked.get(m["job"])
            if got is None:
                r.update(ok=False, error=f"{m['job']}: the model check job {run.status.lower()} "
                         f"without a verdict", check_job=run.summary(), log_tail=run.tail())
                continue
            r.update(ok=got["ok"], verified=got["ok"], check=got, model=got.get("model"),
                     manifest=got.get("manifest"))
            if not got["ok"]:
                r["error"] = f"{m['job']}: model check: " + "; ".join(got["problems"])
    failed = [j for j, r in results.items() if not r.get("ok")]
    details = {"jobs": results, "workers": ctx.workers, "left_out": ctx.left_out}
    if failed:
        raise StepFailed("; ".join(str(results[j].get("error")) for j in failed), **details)
    return details


def step_proxyjump(ctx: Context) -> dict:
    reason = proxyjump_skip_reason(ctx.desc)
    if reason:
        raise StepSkipped(reason)
    cfg, bastion = ctx.desc["ssh_config"], ctx.desc["bastion"]
    if not Path(cfg).is_file():
        raise StepFailed(f"the ssh config {cfg} does not exist on this machine")
    nodes = [n for n in ctx.desc["nodes"] if n.get("ip")]
    with ThreadPoolExecutor(max_workers=min(8, len(nodes))) as pool:
        checked = list(pool.map(lambda n: check_node_proxyjump(n, cfg, bastion), nodes))
    details = {"bastion": bastion, "ssh_config": cfg, "nodes": checked,
               "not_checked": [n["name"] for n in ctx.desc["nodes"] if not n.get("ip")]}
    problems = [f"{c['name']}: {p}" for c in checked for p in c["problems"]]
    if problems:
        raise StepFailed("; ".join(problems), **details)
    return details


STEP_FUNCS = {"nodes": step_nodes, "allreduce": step_allreduce, "trainers": step_trainers,
              "proxyjump": step_proxyjump}


def run_step(name: str, ctx: Context, func: Callable[[Context], dict] | None = None) -> dict:
    """One step with its time limit: {name, ok, skipped, seconds, details}; never raises."""
    func = func or STEP_FUNCS[name]
    limit = TIMEOUTS[name] * ctx.args.timeout_factor
    ctx.deadline = time.monotonic() + limit
    log(f"{name}: starting (limit {limit:.0f} s)")
    t0 = time.monotonic()
    ok, skipped = True, False
    try:
        details = func(ctx)
    except StepSkipped as e:
        skipped, details = True, {"reason": str(e)}
    except StepFailed as e:
        ok, details = False, {"error": str(e), **e.details}
    except Exception as e:  # a bug or an unexpected answer: the step fails, the others still run
        ok, details = False, {"error": f"{type(e).__name__}: {e}"}
    result = {"name": name, "ok": ok and not skipped, "skipped": skipped,
              "seconds": round(time.monotonic() - t0, 1), "details": details}
    log(step_line(result))
    if not ok and details.get("log_tail"):
        log(f"{name}: the job's last {len(details['log_tail'])} log lines:")
        for line in details["log_tail"]:
            print(f"    {line}", flush=True)
    return result


# ------------------------------------------------------------------ report
def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def key_numbers(result: dict) -> str:
    d, name = result["details"], result["name"]
    if result["skipped"]:
        return d.get("reason", "")
    if not result["ok"]:
        return d.get("error", "")
    if name == "nodes":
        return (f"{d['alive']}/{d['expected']} nodes alive, {d['agents']} agents, CPUs {d['cpus']}, "
                f"GPUs {d['gpus']}")
    if name == "allreduce":
        big = max(d["rows"], key=lambda r: r["bytes"])
        return (f"{d['backend']}, {d['world_size']} ranks on {d['nodes_used']} nodes; "
                f"{fmt_bytes(big['bytes'])}: {big['time_us']:.0f} us, algbw {big['algbw_gbs']:.3f} "
                f"GB/s, busbw {big['busbw_gbs']:.3f} GB/s; #wrong {sum(r['wrong'] for r in d['rows'])}")
    if name == "trainers":
        return ", ".join(f"{j} {r['seconds']:.0f} s (parity {r['check']['parity']['max_abs_diff']:.1e})"
                         for j, r in d["jobs"].items())
    if name == "proxyjump":
        return (f"{len(d['nodes'])} node(s): direct :22 blocked, ssh through {d['bastion']} ok"
                + (f"; not checked (no ip): {', '.join(d['not_checked'])}" if d["not_checked"] else ""))
    return ""


def step_line(result: dict) -> str:
    verdict = "SKIP" if result["skipped"] else "PASS" if result["ok"] else "FAIL"
    try:
        numbers = key_numbers(result)
    except (KeyError, TypeError, ValueError) as e:  # an odd payload must not cost the report
        numbers = f"(details incomplete: {type(e).__name__} {e})"
    return f"{verdict} {result['name']:<10} {result['seconds']:7.1f} s  {numbers}"


def allreduce_table(details: dict) -> list[str]:
    """nccl-tests' columns (in place): size, count, type, redop, time, algbw, busbw, #wrong."""
    lines = [f"all-reduce: {details['backend']}, {details['world_size']} ranks on "
             f"{details['nodes_used']} nodes ({details['placement_strategy']}), in place; time: "
             f"mean over ranks; busbw = algbw * 2(n-1)/n",
             f"{'size (B)':>12} {'count':>10} {'type':>6} {'redop':>6} {'time (us)':>11} "
             f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}"]
    for r in details["rows"]:
        lines.append(f"{r['bytes']:>12} {r['count']:>10} {r['type']:>6} {r['redop']:>6} "
                     f"{r['time_us']:>11.1f} {r['algbw_gbs']:>13.3f} {r['busbw_gbs']:>13.3f} "
                     f"{r['wrong']:>7}")
    return lines


def build_report(desc: dict, config: Path, steps: list[dict], started: dt.datetime,
                 seconds: float) -> dict:
    ran = [s for s in steps if not s["skipped"]]
    return {
        "cluster": desc["name"], "kind": desc["kind"], "description": str(config),
        "job_api": desc["job_api"], "nodes": len(desc["nodes"]),
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "ok": all(s["ok"] for s in ran),
        "passed": sum(1 for s in ran if s["ok"]), "failed": sum(1 for s in ran if not s["ok"]),
        "skipped": sum(1 for s in steps if s["skipped"]),
        "client": {"python": platform.python_version(), "hostname": socket.gethostname()},
        "steps": steps,
    }


def summary(report: dict, path: Path | None = None) -> list[str]:
    lines = [f"smoke tests of cluster {report['cluster']} ({report['kind']}, {report['nodes']} "
             f"node(s), job API {report['job_api']}):"]
    lines += ["  " + step_line(s) for s in report["steps"]]
    for s in report["steps"]:
        if s["name"] == "allreduce" and s["details"].get("rows"):
            lines += ["  " + line for line in allreduce_table(s["details"])]
    verdict = "PASS" if report["ok"] else "FAIL"
    lines.append(f"smoke: {verdict}: {report['passed']} passed, {report['failed']} failed, "
                 f"{report['skipped']} skipped in {report['seconds']:.0f} s"
                 + (f"; report {path}" if path else ""))
    return lines


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="The cluster record's fields: python -m trainkit.record schema",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="the cluster description (default: $DLC_CONFIG/cluster.json)")
    p.add_argument("--only", default=",".join(STEPS),
                   help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MIB)),
                   help="all-reduce message sizes in MiB (float32), comma-separated")
    p.add_argument("--max-mib", type=float, default=None, help="leave out sizes above this")
    p.add_argument("--json", default=None,
                   help="report path (default: $DLC_CONFIG/smoke/<name>-<UTC time>.json)")
    p.add_argument("--storage-path", default=None,
                   help="--storage-path for the cluster's jobs (default: theirs, $DLC_STORAGE_PATH "
                        "or ~/dlcluster/runs on the nodes)")
    p.add_argument("--models-dir", default=None,
                   help="parent of the trainers' --output (default: theirs, $DLC_MODELS on the nodes)")
    p.add_argument("--clean", action="store_true",
                   help="remove the trainers' models and runs (smoke-* folders) once verified")
    p.add_argument("--timeout-factor", type=float, default=1.0,
                   help="multiply every step's time limit ("
                        + ", ".join(f"{k} {v} s" for k, v in TIMEOUTS.items()) + ")")
    a = p.parse_args(argv)
    a.steps = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in a.steps if s not in STEPS]
    if unknown or not a.steps:
        raise UserError(f"--only {a.only!r}: unknown step(s) {', '.join(unknown) or '(none given)'}; "
                        f"use some of {','.join(STEPS)}")
    try:
        a.sizes_bytes = sizes_bytes(a)
    except ValueError:
        raise UserError(f"--sizes {a.sizes!r} must be numbers of MiB, e.g. 1,4,16") from None
    if not a.sizes_bytes:
        raise UserError(f"no all-reduce size left from --sizes {a.sizes} with --max-mib {a.max_mib:g}; "
                        f"raise --max-mib")
    if a.timeout_factor <= 0:
        raise UserError(f"--timeout-factor {a.timeout_factor} must be above 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    config = Path(a.config).expanduser() if a.config else record.config_dir() / "cluster.json"
    desc = load_description(config)
    check_token(desc, config)
    os.environ.update(record.load(config).client_env())
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dlc-smoke-") as tmp:
        jobs = None
        if any(s != "proxyjump" for s in a.steps):
            check_job_api(desc["job_api"])
            jobs = Jobs(desc["job_api"], snapshot(REPO, Path(tmp) / "dlcluster"))
        ctx = Context(desc, a, jobs)
        log(f"cluster {desc['name']} ({desc['kind']}, {len(desc['nodes'])} node(s)) at "
            f"{desc['job_api']}; steps: {', '.join(s for s in STEPS if s in a.steps)}")
        steps = [run_step(name, ctx) for name in STEPS if name in a.steps]
    report = build_report(desc, config, steps, started, time.monotonic() - t0)
    path = Path(a.json).expanduser() if a.json else (
        record.config_dir() / "smoke" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', desc['name'])}-"
                                 f"{started.strftime('%Y%m%dT%H%M%SZ')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("\n".join(summary(report, path)), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
