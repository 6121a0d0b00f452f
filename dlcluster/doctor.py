"""make doctor: a bad node told from a bad job. Every node of the current cluster (its record) is
asked at once, through the bastion, what dlcluster/doctor_probe.py reads there; the answers are
compared with the head's and with the record, and each problem is one line: the node, what is
wrong, the fix. Exit 1 on any finding; the whole report is clusters/<name>/doctor.json.

    dlcluster doctor [--min-free-gb 2] [--max-clock-offset 1.0] [--quarantine]
    dlcluster doctor --node NODE   (one node's findings only: make upgrade's check)
    dlcluster doctor --unquarantine NODE
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from dlcluster import record
from trainkit.errors import EXIT_USER_ERROR, UserError

PROBE = Path(__file__).with_name("doctor_probe.py")
REPORT = "doctor.json"
PACKAGES = ("ray", "torch", "horovod", "tensorflow")


class Finding(BaseModel):
    node: str
    what: str
    fix: str

    def line(self) -> str:
        return " ".join(f"{self.node}: {self.what}: {self.fix}".split())  # one line, always


class Clock(BaseModel):
    """A node's clock against this machine's: offset ± uncertainty (half the round trip), seconds."""
    offset: float
    uncertainty: float


# ---- a node's answer (dlcluster/doctor_probe.py's check), typed where it is read

class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")  # the probe and this model change together


class Firewall(_Part):
    load: str | None
    active: str | None
    chain: bool


class TokenFile(_Part):
    owner: str | None = None
    group: str | None = None
    mode: str | None = None
    error: str | None = None  # the file cannot be read


class Tls(_Part):
    verified: bool
    problem: str = ""
    days_left: float | None = None
    for_address: bool = False


class Interface(_Part):
    name: str
    mtu: int | None = None


class Collective(_Part):
    file: dict[str, str | None]  # NCCL_/GLOO_SOCKET_IFNAME in /etc/dlcluster/ray.env
    running: dict[str, str | None] | None  # ... in the raylet's environment (None: no raylet)


class Storage(_Part):
    path: str
    exists: bool | None = None
    mount: str | None = None
    stale: str | None = None  # the probe's child hung: a stale mount
    error: str | None = None
    marker: str | None = None
    write_error: str = ""
    free: float = 0


class Free(_Part):
    tmp: float | None
    docker: float | None


class NodeClock(_Part):
    container: str | None = None
    synchronized: str | None = None


class Ran(_Part):
    rc: int
    out: str = ""


class Gpu(_Part):
    module: str | None = None
    library: str | None = None
    nvml: Ran | None = None
    container: Ran | None = None


class Answer(_Part):
    """What a node answered: all of it, or only `error` (no answer through the bastion)."""
    error: str | None = None
    quarantine: str | None = None
    service: str = ""
    raylet: bool = False
    firewall: Firewall | None = None
    token: TokenFile | None = None
    tls: Tls | None = None
    interface: Interface | None = None
    collective: Collective | None = None
    versions: dict[str, str | None] = {}
    storage: Storage | None = None
    free: Free | None = None
    clock: NodeClock | None = None
    gpu: Gpu | None = None
    expected_marker: str | None = None  # the head's marker, which the doctor wrote (not the node)

    @classmethod
    def read(cls, data: dict) -> Answer:
        """The answer as the node gave it, or one that says it could not be read."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            return cls(error=f"an answer the doctor cannot read ({e.error_count()} problem(s), first: "
                             f"{'.'.join(map(str, e.errors()[0]['loc']))}: {e.errors()[0]['msg']})")


# ---- the comparisons: pure functions of the answers, tested from recorded answers

def examine(rec: record.ClusterRecord, answers: dict[str, Answer], ray_nodes: list[dict] | None,
            clocks: dict[str, Clock], min_free_gb: float = 2.0,
            max_clock_offset: float = 1.0, min_cert_days: float = 30,
            only: str | None = None) -> list[Finding]:
    """Every finding, or with `only` that node's alone, its image not compared with the other
    docker nodes' (make upgrade checks a node that runs the new image while the others do not yet)."""
    head = next(n for n in rec.nodes if n.role == "head")
    ref = answers.get(head.name) or Answer(error="not asked")
    found: list[Finding] = []

    def say(node: str, what: str, fix: str) -> None:
        found.append(Finding(node=node, what=what, fix=fix))

    docker_ref = next((answers[n.name].versions.get("image") for n in rec.nodes
                       if n.runtime == "docker" and n.name in answers and answers[n.name].error is None
                       and (only is None or n.name == only)), None)
    listed = {n.get("node_ip"): n for n in (ray_nodes or []) if n.get("state") == "ALIVE"}
    for node in rec.nodes:
        a = answers.get(node.name)
        if a is None or a.error is not None or a.firewall is None or a.token is None:
            say(node.name, f"no answer through the bastion ({a.error if a and a.error else 'not asked'})",
                f"check the machine is up and reachable: ssh -F {rec.ssh_config} {node.name}")
            continue
        if a.quarantine:
            say(node.name, f"quarantined ({a.quarantine}): Ray stays down there",
                f"once it is fixed: make unquarantine NODE={node.name}")
        elif a.service != "active":
            say(node.name, f"Ray's service dlc-ray is {a.service}",
                f"sudo systemctl restart dlc-ray on {node.name} (journalctl -u dlc-ray says why it stopped)")
        elif ray_nodes is not None:
            r = listed.get(node.ip)
            if r is None:
                say(node.name, f"its Ray service runs but the head does not list {node.ip} alive",
                    f"journalctl -u dlc-ray on {node.name} (a firewall or the GCS port between them?)")
            else:
                res = r.get("resources_total") or {}
                cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
                if (cpus, gpus) != (node.cpus, node.gpus):
                    say(node.name, f"Ray offers {cpus} CPUs and {gpus} GPUs, the cluster record "
                        f"{node.cpus} and {node.gpus}", "run make cluster-up again (it restarts Ray "
                        "with the inventory's resources)")
        fw = a.firewall
        if fw.load == "loaded" and (fw.active != "active" or not fw.chain):
            say(node.name, f"the firewall service is {fw.active} and its rules "
                f"{'are' if fw.chain else 'are not'} in INPUT",
                f"sudo systemctl restart dlc-firewall on {node.name} (then dlc-ray, which requires it)")
        tok = a.token
        if tok.error is not None:
            say(node.name, f"no Ray token ({tok.error})", "run make cluster-up again")
        elif tok.owner != "root" or tok.mode != "0640":
            say(node.name, f"the Ray token is {tok.owner}:{tok.group} {tok.mode}, not "
                "root-owned 0640", "run make cluster-up again (it sets owner and mode)")
        found += _tls(node, a.tls, min_cert_days)
        found += _network(node, a, ref)
        found += _versions(node, a, ref, head.name, docker_ref)
        found += _storage(node, a, min_free_gb)
        for where, free in (a.free.model_dump() if a.free else {}).items():
            if free is not None and free < min_free_gb * 1e9:
                say(node.name, f"{free / 1e9:.1f} GB free under "
                    f"{'/tmp' if where == 'tmp' else 'Docker data root'}, below {min_free_gb} GB",
                    "free space there (docker image prune, old Ray logs under its temp dir)")
        found += _clock(node, a, clocks, head.name, max_clock_offset)
        if node.gpus:
            found += _gpu(node, a)
    return [f for f in found if only is None or f.node == only]


def _tls(node: record.Node, tls: Tls | None, min_cert_days: float) -> list[Finding]:
    """Ray's TLS certificate (None: the node runs Ray without TLS, ray_tls: false)."""
    if tls is None:
        return []
    fix = ("run make cluster-up again (it makes the node a certificate of the head's CA and restarts "
           "Ray there when no job runs)")
    if not tls.verified:
        return [Finding(node=node.name, fix=fix,
                        what=f"Ray's TLS certificate is not the cluster CA's ({tls.problem})")]
    if not tls.for_address:
        return [Finding(node=node.name, fix=fix,
                        what=f"Ray's TLS certificate is not for its private address {node.ip}")]
    if tls.days_left is not None and tls.days_left < min_cert_days:
        return [Finding(node=node.name, what=f"Ray's TLS certificate ends in {tls.days_left:.0f} days",
                        fix=fix)]
    return []


def _network(node: record.Node, a: Answer, ref: Answer) -> list[Finding]:
    out = []
    iface = a.interface
    if iface is None:
        return [Finding(node=node.name, what=f"no interface holds its private address {node.ip}",
                        fix="fix the node's network or its `ip` in the inventory, then make cluster-up")]
    ref_mtu = ref.interface.mtu if ref.interface else None
    if ref_mtu and iface.mtu != ref_mtu:
        out.append(Finding(node=node.name, what=f"MTU {iface.mtu} on {iface.name}, the head's "
                           f"private interface has {ref_mtu}",
                           fix="set the same MTU on every node's private interface (a mismatch "
                               "stalls large all-reduce messages)"))
    collective = a.collective or Collective(file={}, running=None)
    for where, settings in (("/etc/dlcluster/ray.env", collective.file),
                            ("Ray's running processes", collective.running)):
        for key, value in (settings or {}).items():
            if value != iface.name:
                out.append(Finding(
                    node=node.name, what=f"{key}={value} in {where}, but its private address "
                    f"{node.ip} is on {iface.name}",
                    fix="run make cluster-up again (it writes the interface holding the private "
                        "address and restarts Ray when no job runs)"))
    return out


def _versions(node: record.Node, a: Answer, ref: Answer, head_name: str,
              docker_ref: str | None) -> list[Finding]:
    v, rv = a.versions, ref.versions
    if "error" in v:
        return [Finding(node=node.name, what=f"its Python environment does not answer ({v['error']})",
                        fix="run make cluster-up again (it installs the environment)")]
    out = []
    fix = "run make cluster-up again (it installs the lock's versions everywhere)"
    if node.name != head_name:
        def minor(version: str | None) -> str:  # Ray's match level
            return ".".join((version or "?").split(".")[:2])

        if minor(v.get("python")) != minor(rv.get("python")):
            out.append(Finding(node=node.name, what=f"Python {v.get('python')}, the head runs "
                               f"{rv.get('python')} (Ray needs the same minor version)", fix=fix))
        for p in PACKAGES:
            if v.get(p) != rv.get(p):
                out.append(Finding(node=node.name, what=f"{p} {v.get(p) or 'missing'}, the head "
                                   f"runs {rv.get(p) or 'none'}", fix=fix))
    if node.runtime == "docker" and v.get("image") != docker_ref:
        out.append(Finding(node=node.name, what=f"Ray runs image {str(v.get('image'))[:19]}, the "
                           f"other docker nodes {str(docker_ref)[:19]}", fix=fix))
    return out


def _storage(node: record.Node, a: Answer, min_free_gb: float) -> list[Finding]:
    s = a.storage
    if s is None or not s.path:
        return []
    path = s.path

    def f(what: str, fix: str) -> list[Finding]:
        return [Finding(node=node.name, what=what, fix=fix)]
    mount = f"{path} (findmnt: {s.mount or 'nothing'})"
    if s.stale is not None:
        return f(f"the shared storage {path} hangs ({s.stale}): a stale mount",
                 f"sudo umount -l {path} && sudo mount {path} on {node.name}; then restart dlc-ray")
    remount = (f"mount the shared storage on {node.name} (make cluster-up mounts NFS; a `path` "
               "storage is the site's to mount), then sudo systemctl restart dlc-ray there")
    if not s.exists:
        return f(f"the shared storage is not there: {mount}: {s.error or ''}", remount)
    out = []
    if s.marker != a.expected_marker:
        out += f(f"the shared storage is not shared: the head's marker is not in {mount}", remount)
    if s.write_error:
        out += f(f"Ray's account cannot write to {path} ({s.write_error})",
                 f"give Ray's account write access to {path} (make cluster-up sets its owner)")
    if s.free < min_free_gb * 1e9:
        out += f(f"{s.free / 1e9:.1f} GB free on the shared storage {path}, below {min_free_gb} GB",
                 "free space there (old runs' checkpoints under runs/, old models)")
    return out


def _clock(node: record.Node, a: Answer, clocks: dict[str, Clock], head_name: str,
           max_offset: float) -> list[Finding]:
    out = []
    c = a.clock or NodeClock()
    if not c.container and c.synchronized != "yes":
        out.append(Finding(node=node.name, what=f"its clock is not synchronised (timedatectl: "
                           f"NTPSynchronized={c.synchronized})",
                           fix="enable time sync (sudo apt install chrony, or systemd-timesyncd)"))
    mine, head = clocks.get(node.name), clocks.get(head_name)
    if mine and head and node.name != head_name:
        apart = abs(mine.offset - head.offset)
        if apart - mine.uncertainty - head.uncertainty > max_offset:
            out.append(Finding(node=node.name, what=f"its clock is {apart:.1f} s from the head's "
                               f"(more than {max_offset} s)",
                               fix="enable time sync on every node (chrony or systemd-timesyncd)"))
    return out


def _gpu(node: record.Node, a: Answer) -> list[Finding]:
    g = a.gpu or Gpu()

    def say(what: str, fix: str) -> Finding:
        return Finding(node=node.name, what=what, fix=fix)
    if not g.module:
        return [say("no NVIDIA kernel module is loaded",
                    "reboot the node after the driver install (or sudo modprobe nvidia)")]
    out = []
    if g.library and g.library != g.module:
        out.append(say(f"the driver library is {g.library} but the loaded kernel module is "
                       f"{g.module} (upgraded under the running module)",
                       "drain the node (make doctor QUARANTINE=1 when it exists) and reboot it; "
                       "hold the driver packages against unattended upgrades"))
    nvml = g.nvml or Ran(rc=0)
    if nvml.rc:
        first = next((line for line in nvml.out.splitlines() if line.strip()), "?")
        out.append(say(f"nvidia-smi fails (exit {nvml.rc}): {first[:150]}",
                       "reboot the node; if it persists, reinstall the driver (make cluster-up)"))
    else:
        gpus = len([line for line in nvml.out.splitlines() if line.strip()])
        if gpus != node.gpus:
            out.append(say(f"nvidia-smi lists {gpus} GPUs, the cluster record {node.gpus}",
                           "check the GPUs (nvidia-smi -q) or set ray_num_gpus in the inventory"))
    ctr = g.container
    if ctr and ctr.rc:
        out.append(say(f"a GPU container does not start ({ctr.out[-150:]})",
                       "run make cluster-up again (it configures the NVIDIA container toolkit)"))
    return out


# ---- asking the nodes

def ssh(rec: record.ClusterRecord, host: str, *cmd: str, stdin: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    if rec.ssh_config is None:
        raise ValueError(f"cluster {rec.name} has no ssh config: it is not reached through a bastion")
    return subprocess.run(["ssh", "-F", rec.ssh_config, "-o", "BatchMode=yes", host,
                           " ".join(shlex.quote(c) for c in cmd)], input=stdin, text=True,
                          capture_output=True, timeout=timeout)


def ask(rec: record.ClusterRecord, node: record.Node, query: dict, timeout: float = 120) -> dict:
    try:
        p = ssh(rec, node.name, "sudo", "-n", "python3", "-", json.dumps(query),
                stdin=PROBE.read_text(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {timeout:.0f} s"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}"}


def clock(rec: record.ClusterRecord, node: record.Node) -> Clock | None:
    t0 = time.time()
    try:
        p = ssh(rec, node.name, "date", "+%s.%N", timeout=30)
        t1 = time.time()
        return Clock(offset=float(p.stdout.strip()) - (t0 + t1) / 2, uncertainty=(t1 - t0) / 2)
    except (subprocess.TimeoutExpired, ValueError):
        return None


def alive(seen: list[dict] | None) -> dict[str | None, str | None]:
    """Node ip -> Ray's node id, of the nodes the head lists alive (an ip may also have dead entries)."""
    return {n.get("node_ip"): n.get("node_id") for n in seen or [] if n.get("state") == "ALIVE"}


def wait_until(rec: record.ClusterRecord, node: record.Node, listed: bool, timeout: float) -> bool:
    """Whether the head lists `node` alive (listed) or no longer does (not listed) within `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = ray_nodes(rec)
        if seen is not None and (node.ip in alive(seen)) == listed:
            return True
        time.sleep(2)
    return False


def ray_nodes(rec: record.ClusterRecord) -> list[dict] | None:
    req = urllib.request.Request(f"{rec.job_api}/api/v0/nodes?limit=1000&detail=true")
    req.add_header("Authorization", f"Bearer {Path(rec.token_path).read_text().strip()}")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return json.loads(r.read())["data"]["result"]["result"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None


def audit_chain(rec: record.ClusterRecord, head: str) -> list[Finding]:
    """The gateway's audit trail, read through the job API (the gateway's) and its chain checked here,
    not taken on the gateway's word: an entry changed or removed below the gateway is named."""
    from gateway.store import verify

    req = urllib.request.Request(f"{rec.job_api}/gateway/audit")
    req.add_header("Authorization", f"Bearer {Path(rec.token_path).read_text().strip()}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            entries = json.loads(r.read())["entries"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return [Finding(node=head, what=f"the job API at {rec.job_api} is Ray's own, not the job "
                                            f"gateway's", fix="make cluster-up (it installs the gateway on "
                                                              "the head and ends the tunnel on it)")]
        return []  # the gateway answers, refusing: the job API's own check names it
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return []  # no answer: named once, with the job API
    broken = verify(entries)
    if broken is None:
        return []
    return [Finding(node=head, what=f"the gateway's audit trail is broken: {broken}",
                    fix="someone changed the gateway's database on the head below the gateway "
                        "(gateway_data_dir/gateway.db): find who (the file's times, the head's logins, "
                        "journalctl); the trail is left as it is, as evidence")]


def doctor(rec: record.ClusterRecord, min_free_gb: float, max_clock_offset: float,
           min_cert_days: float = 30, only: str | None = None) -> tuple[list[Finding], dict]:
    started = time.time()
    head = next(n for n in rec.nodes if n.role == "head")
    marker = f".dlc-doctor-{secrets.token_hex(6)}"
    text = secrets.token_hex(16)
    # the runs folder: where Ray's account writes checkpoints (the storage's root is root's)
    base = {"storage": f"{rec.storage}/runs" if rec.storage else None, "marker": marker}
    if rec.storage:
        wrote = ask(rec, head, {**base, "do": "mark", "text": text}, timeout=60)
        if wrote.get("rc"):
            print(f"doctor: the head could not write its marker under {rec.storage}: {wrote['out']}",
                  flush=True)
    answers: dict[str, Answer] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(rec.nodes))) as pool:
        futures = {pool.submit(ask, rec, n, {**base, "do": "check", "runtime": n.runtime, "ip": n.ip,
                                             "name": n.name, "gpus": n.gpus}): n for n in rec.nodes}
        for f in as_completed(futures):
            n = futures[f]
            answers[n.name] = Answer.read({**f.result(), "expected_marker": text})
            print(f"doctor: {n.name} answered ({time.time() - started:.1f} s)", flush=True)
        clocks = {n.name: c for n, c in zip(rec.nodes, pool.map(lambda n: clock(rec, n), rec.nodes),
                                             strict=True)}
    if rec.storage:
        ask(rec, head, {**base, "do": "mark", "text": ""}, timeout=60)
    seen = ray_nodes(rec)
    found = examine(rec, answers, seen, {k: v for k, v in clocks.items() if v}, min_free_gb,
                    max_clock_offset, min_cert_days, only)
    if seen is None:
        found.append(Finding(node=head.name, what=f"the job API at {rec.job_api} does not answer",
                             fix="make attach INVENTORY=... (it opens the tunnel), or make cluster-up"))
    elif only is None or only == head.name:
        found += audit_chain(rec, head.name)
    report = {"cluster": rec.name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.time() - started, 1),
              "findings": [f.model_dump() for f in found],
              "nodes": {k: a.model_dump(exclude_unset=True) for k, a in answers.items()},
              "clocks": {k: v.model_dump() if v else None for k, v in clocks.items()},
              "ray_nodes": seen}
    return found, report


def quarantine(rec: record.ClusterRecord, found: list[Finding], report: dict,
               drain_wait: float = 60) -> list[str]:
    """Each node with a finding taken out of Ray: its quarantine file written (Ray's unit will not
    start there) and the head's GCS told to drain it (no new work lands there); once it has left
    (idle: at once; busy: when its work has ended, on a later run) its Ray is stopped. The head is
    never taken out: every job's driver runs there."""
    head = next(n for n in rec.nodes if n.role == "head")
    ids = alive(report.get("ray_nodes"))
    lines = []
    for node in rec.nodes:
        mine = [f for f in found if f.node == node.name]
        a = Answer.read(report["nodes"].get(node.name) or {"error": "not asked"})
        if a.quarantine:  # an earlier quarantine: its Ray stopped once its work has ended
            if a.service == "active" and not a.raylet:
                ask(rec, node, {"do": "stop"}, timeout=180)
                lines.append(f"{node.name}: quarantined: the work it was drained of has ended; "
                             f"its Ray stopped; make unquarantine NODE={node.name} once it is fixed")
            continue
        if not mine:
            continue
        if node.role == "head":
            lines.append(f"{node.name}: not quarantined: the head runs Ray's GCS and every job's "
                         "driver; fix what is named above and run make doctor again")
            continue
        reason = (f"make doctor at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: "
                  f"{mine[0].what}")[:300]
        wrote = ask(rec, node, {"do": "quarantine", "reason": reason}, timeout=60)
        if wrote.get("rc") != 0:
            lines.append(f"{node.name}: not quarantined: its quarantine file could not be written "
                         f"({wrote.get('error') or wrote.get('out')})")
            continue
        back = f"make unquarantine NODE={node.name} once it is fixed"
        if node.ip in ids:
            drained = ask(rec, head, {"do": "drain", "node_id": ids[node.ip], "reason": reason,
                                      "runtime": head.runtime}, timeout=120)
            if drained.get("rc") != 0:
                lines.append(f"{node.name}: quarantined, but Ray did not drain it "
                             f"({drained.get('error') or drained.get('out')}): its Ray keeps "
                             f"running until stopped (sudo systemctl stop dlc-ray there); {back}")
                continue
            if not wait_until(rec, node, listed=False, timeout=drain_wait):  # busy: its work first
                lines.append(f"{node.name}: quarantined: drained, no new work lands there; what "
                             "runs there finishes first (make doctor QUARANTINE=1 then stops its "
                             f"Ray); {back}")
                continue
        stopped = ask(rec, node, {"do": "stop"}, timeout=180)
        if stopped.get("rc") != 0:
            lines.append(f"{node.name}: quarantined, but its Ray did not stop "
                         f"({stopped.get('error') or stopped.get('out')}); {back}")
            continue
        lines.append(f"{node.name}: quarantined: out of Ray, its Ray stopped and kept down; {back}")
    return lines


def unquarantine(rec: record.ClusterRecord, name: str, timeout: float = 180) -> str:
    """The quarantine file removed and Ray started on `name`; back once the head lists it alive."""
    node = next((n for n in rec.nodes if n.name == name), None)
    if node is None:
        raise UserError(f"no node {name!r} in the cluster {rec.name}; NODE is one of "
                        f"{', '.join(n.name for n in rec.nodes)}")
    done = ask(rec, node, {"do": "release"}, timeout=180)
    if done.get("rc") == 4:
        raise UserError(f"{name}: {done['out']}; nothing changed (make doctor lists quarantined nodes)")
    if done.get("rc") == 3:
        raise UserError(f"{name}: {done['out']}: release it when that work has ended (ray job "
                        "list); nothing changed")
    if done.get("rc") != 0:
        raise UserError(f"{name}: Ray did not start ({done.get('error') or done.get('out')}): see "
                        f"journalctl -u dlc-ray on {name}")
    if wait_until(rec, node, listed=True, timeout=timeout):
        return (f"{name} released: back in Ray ({len(alive(ray_nodes(rec)))} of {len(rec.nodes)} "
                "nodes alive)")
    raise UserError(f"{name}: released, but the head does not list it alive after {timeout:.0f} s: "
                    f"see journalctl -u dlc-ray on {name}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-free-gb", type=float, default=2.0,
                    help="least free space on the shared storage, /tmp and Docker's data root [2]")
    ap.add_argument("--max-clock-offset", type=float, default=1.0,
                    help="seconds two nodes' clocks may be apart [1.0]")
    ap.add_argument("--min-cert-days", type=float, default=30,
                    help="least days left on a node's TLS certificate for Ray (ray_tls_renew_days) [30]")
    ap.add_argument("--quarantine", action="store_true",
                    help="take each worker with a finding out of Ray (make doctor QUARANTINE=1)")
    ap.add_argument("--config", default=None,
                    help="the cluster record (default: $DLC_CONFIG/cluster.json, the current cluster)")
    ap.add_argument("--node", metavar="NODE",
                    help="name only this node's findings (all nodes are still asked: the head's "
                         "answers are the reference); its image is not compared with the others'")
    ap.add_argument("--unquarantine", metavar="NODE",
                    help="put a quarantined node back into Ray, then stop (make unquarantine NODE=...)")
    args = ap.parse_args(argv)
    try:
        rec = record.load(Path(args.config).expanduser() if args.config else None)
        if rec.kind != "ansible" or not rec.ssh_config:
            raise UserError(f"the current cluster {rec.name!r} is a local one: make doctor checks "
                            "servers brought up from an inventory (make cluster-up INVENTORY=...)")
        if args.unquarantine:
            print(f"doctor: {unquarantine(rec, args.unquarantine)}")
            return
        if args.node and args.node not in {n.name for n in rec.nodes}:
            raise UserError(f"--node {args.node}: no such node in the cluster {rec.name}; one of "
                            f"{', '.join(n.name for n in rec.nodes)}")
    except UserError as e:
        print(f"doctor: error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    print(f"doctor: asking the {len(rec.nodes)} nodes of {rec.name} through {rec.bastion}", flush=True)
    found, report = doctor(rec, args.min_free_gb, args.max_clock_offset, args.min_cert_days, args.node)
    path = record.config_dir() / "clusters" / rec.name / REPORT
    path.write_text(json.dumps(report, indent=2) + "\n")
    for f in found:
        print(f"doctor: {f.line()}")
    if args.quarantine:
        for line in quarantine(rec, found, report):
            print(f"doctor: {line}")
    asked = args.node or f"{len(rec.nodes)} nodes"
    print(f"doctor: {asked}, {len(found)} finding(s) in {report['seconds']} s; report: {path}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
