"""The cluster's performance baseline: what each node, link and the all-reduce did when the cluster
was healthy, and today's figures compared with it (`make baseline` records, `make smoke`'s perf
step compares). Versioned beside the cluster record: $DLC_CONFIG/clusters/<name>/baselines/
<UTC time>.json, the newest being the reference.

Per node: seconds per step of one fixed synthetic batch on its CPUs and on each GPU, and the
shared storage's write and read throughput as the node sees it (ray/smoke_checks.py perf, a task
holding the whole node, one node after the other). Per pair of nodes: the link's bandwidth,
iperf3 (the distribution's) between their private addresses through the bastion. Across all
nodes: the all-reduce's bus bandwidth at the largest size (the smoke's allreduce step).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from dlcluster import record
from dlcluster.doctor import Finding, ssh

FORMAT: Final = "dlcluster-baseline/1"
IPERF_PORT = 5201  # iperf3's own; the firewall lets the cluster's nodes reach any port


class NodePerf(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu_step_s: float = Field(gt=0, description="seconds per step of the fixed batch on its CPUs (the "
                                                "lower quartile of 40)")
    gpu_step_s: list[float] = Field(default_factory=list, description="the same on each GPU")
    storage_write_mbps: float | None = Field(
        default=None,
        description="shared storage, MB/s written (fsync included)")
    storage_read_mbps: float | None = Field(
        default=None,
        description="shared storage, MB/s read (cache dropped)")


class Allreduce(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: str
    bytes: int
    busbw_gbps: float = Field(description="bus bandwidth, GB/s (nccl-tests' definition)")


class Perf(BaseModel):
    """One measurement; a baseline is one with its provenance filled in."""
    model_config = ConfigDict(extra="forbid")
    format: Literal["dlcluster-baseline/1"] = FORMAT
    cluster: str
    recorded: str = Field(description="UTC time of the measurement")
    commit: str | None = Field(default=None, description="this checkout's commit when it was measured")
    inventory_digest: str | None = Field(
        default=None,
        description="sha256 of the inventory it was provisioned from")
    nodes: dict[str, NodePerf]
    links: dict[str, float] = Field(default_factory=dict, description='"a~b": GB/s (1e9 bytes/s)')
    allreduce: Allreduce | None = None

    @property
    def link_peak(self) -> float | None:
        """The slowest link: a ring all-reduce crosses every one of them."""
        return min(self.links.values()) if self.links else None


class Thresholds(BaseModel):
    max_step_slowdown: float = Field(0.25, gt=0,
                                     description="a node's step this much slower than its baseline")
    min_link_fraction: float = Field(0.7, gt=0, le=1,
                                     description="a link below this fraction of its baseline")
    min_busbw_fraction: float = Field(0.8, gt=0, le=1,
                                      description="bus bandwidth below this fraction of link peak x factor")
    min_storage_fraction: float = Field(0.5, gt=0, le=1,
                                        description="storage throughput below this fraction of its baseline")


def pair(a: str, b: str) -> str:
    return "~".join(sorted((a, b)))


# ---- measuring

def from_payload(rec: record.ClusterRecord, payload: dict) -> tuple[dict[str, NodePerf], list[Finding]]:
    """The perf job's answer (ray/smoke_checks.py perf) by the record's node names."""
    by_ip = {n.ip: n.name for n in rec.nodes}
    nodes, found = {}, []
    for m in payload.get("nodes", []):
        name = by_ip.get(m["ip"], m["ip"])
        st = m.get("storage") or {}
        if "error" in st:
            found.append(Finding(node=name, what=f"the shared storage could not be measured ({st['error']})",
                                 fix="make doctor (it checks the mount and Ray's account's access)"))
        nodes[name] = NodePerf(cpu_step_s=m["cpu"]["step_s"], gpu_step_s=[g["step_s"] for g in m["gpus"]],
                               storage_write_mbps=st.get("write_mbps"), storage_read_mbps=st.get("read_mbps"))
    for p in payload.get("problems", []):
        found.append(Finding(node=by_ip.get(p["ip"], p["ip"]), what=f"no measurement ({p['error']})",
                             fix="make doctor (is its Ray up and idle?)"))
    return nodes, found


def iperf(rec: record.ClusterRecord, client: record.Node, server: record.Node, seconds: int = 2,
          tries: int = 10) -> float:
    """GB/s from `client` to `server`'s private address: a one-off iperf3 server there (ends after
    one test, or after 30 s), then iperf3's client here, its JSON read."""
    if server.ip is None:
        raise RuntimeError(f"{server.name} has no private address in the cluster's record: make cluster-up")
    started = ssh(rec, server.name, "sh", "-c", f"command -v iperf3 >/dev/null || exit 7; "
                  f"nohup timeout 30 iperf3 -s -1 -p {IPERF_PORT} >/dev/null 2>&1 </dev/null &", timeout=60)
    if started.returncode == 7:
        raise RuntimeError(f"iperf3 is not installed on {server.name}: run make cluster-up again "
                           "(base_packages installs it)")
    if started.returncode != 0:
        raise RuntimeError(f"iperf3's server did not start on {server.name}: {started.stderr.strip()[-200:]}")
    said = ""
    for _ in range(tries):
        p = ssh(rec, client.name, "iperf3", "-c", server.ip, "-p", str(IPERF_PORT), "-t", str(seconds),
                "-J", timeout=60 + seconds)
        try:
            out = json.loads(p.stdout)
        except ValueError:
            out = {"error": (p.stderr or p.stdout).strip()[-200:] or f"exit {p.returncode}"}
        if "error" not in out:
            return out["end"]["sum_received"]["bits_per_second"] / 8e9
        said = out["error"]
        if "refused" not in said:  # the server not listening yet: try again
            break
        time.sleep(0.5)
    raise RuntimeError(f"iperf3 from {client.name} to {server.name} ({server.ip}): {said}")


def links(rec: record.ClusterRecord, note=print,
          only: list[record.Node] | None = None) -> tuple[dict[str, float], list[Finding]]:
    """Every pair of nodes (of `only`, when given), one pair after the other (each measured alone)."""
    measured, found = {}, []
    nodes = [n for n in (only or rec.nodes) if n.ip]
    for a, b in itertools.combinations(nodes, 2):
        try:
            measured[pair(a.name, b.name)] = gbps = iperf(rec, a, b)
            note(f"link {a.name} -> {b.name}: {gbps:.2f} GB/s")
        except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
            found.append(Finding(node=pair(a.name, b.name), what=f"the link could not be measured ({e})",
                                 fix="make doctor; ssh -F <ssh_config> to both and try iperf3 by hand"))
    return measured, found


def allreduce(details: dict | None) -> Allreduce | None:
    """The largest size's row of the smoke's allreduce step (None when it did not run or failed)."""
    if not details or not details.get("rows") or details.get("error"):
        return None
    rows = details["rows"]
    top = max(rows, key=lambda r: r["bytes"])
    return Allreduce(backend=details["backend"], bytes=top["bytes"], busbw_gbps=top["busbw_gbs"])


def inventory_digest(path: str | None) -> str | None:
    if not path or not Path(path).exists():
        return None
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def commit(repo: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- keeping them

def folder(cluster: str) -> Path:
    return record.config_dir() / "clusters" / cluster / "baselines"


def save(perf: Perf) -> Path:
    d = folder(perf.cluster)
    d.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.fromisoformat(perf.recorded).strftime("%Y%m%dT%H%M%SZ")
    path = d / f"{stamp}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(perf.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
    return path


def latest(cluster: str) -> tuple[Path, Perf] | None:
    """The newest baseline of `cluster`, or None."""
    found = sorted(folder(cluster).glob("*.json"))
    if not found:
        return None
    return found[-1], Perf.model_validate_json(found[-1].read_text())


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


# ---- comparing: pure functions of two measurements

def factor(base: Perf | None, now: Perf) -> float | None:
    """What fraction of the link peak the all-reduce's bus bandwidth should reach. NCCL's ring
    moves bus bandwidth at link speed (1.0). Gloo reduces on the CPU, which bounds it before the
    link does: its fraction is the one the baseline measured. None: no figure to hold it to."""
    if now.allreduce is None:
        return None
    if now.allreduce.backend == "nccl":
        return 1.0
    if base and base.allreduce and base.link_peak and base.allreduce.backend == now.allreduce.backend:
        return min(1.0, base.allreduce.busbw_gbps / base.link_peak)
    return None


def outliers(ratios: dict, limit: float) -> tuple[list, float]:
    """Which of `ratios` (now against the baseline, above 1 is worse) exceed `limit` against
    their own baseline and against the cluster's pace: the median of them all (the lower one of
    two; 1 with a single one, which has no peers). A node is at fault when it falls behind the
    others; when the median falls behind too, the cause is shared (new versions, the storage
    server, load beside every node) and no node is to blame. Returns the keys named and the pace."""
    pace = statistics.median_low(ratios.values()) if len(ratios) > 1 else 1.0
    return [k for k, r in ratios.items() if r / max(pace, 1.0) > limit], pace


def shared(headline: str, limit: str, ratios: dict, show, fix: str) -> Finding:
    """One finding for a slowdown the median node shares, with each one's figure, worst first. It
    names the cluster, not a node: quarantine takes none out for it."""
    each = ", ".join(f"{k if isinstance(k, str) else f'{k[0]} GPU {k[1]}'} {show(r)}"
                     for k, r in sorted(ratios.items(), key=lambda kv: -kv[1]))
    return Finding(node="the cluster", what=f"{headline} ({limit}; each: {each})", fix=fix)


def compare(base: Perf | None, now: Perf, th: Thresholds) -> list[Finding]:
    """One finding per node, link or all-reduce worse than its baseline by more than the threshold
    (base None: only what needs no baseline, NCCL's bus bandwidth against the links). A node's
    step and storage are held to its baseline and to the other nodes' (`outliers`): what every
    node shares is one finding for all of them, which names no node to quarantine."""
    found: list[Finding] = []
    slow_fix = ("a CPU limit, throttling or another tenant on it? make doctor; make smoke "
                "SMOKE_ARGS=--quarantine takes it out of Ray")
    shared_fix = ("a cause the nodes share (new versions of torch or the images, load beside all of "
                  "them), no node to quarantine; make baseline records a new baseline once this is the norm")
    if base:
        common = [name for name in base.nodes if name in now.nodes]  # unmeasured: the job's finding
        step_limit, storage_limit = 1 + th.max_step_slowdown, 1 / th.min_storage_fraction
        cpu = {k: now.nodes[k].cpu_step_s / base.nodes[k].cpu_step_s for k in common}
        gpu = {(k, i): ng / bg for k in common
               for i, (bg, ng) in enumerate(zip(base.nodes[k].gpu_step_s, now.nodes[k].gpu_step_s,
                                                strict=False))}
        storage = {what: {k: (bv / nv if nv else float("inf")) for k in common
                          if (bv := getattr(base.nodes[k], f"storage_{attr}_mbps"))
                          and (nv := getattr(now.nodes[k], f"storage_{attr}_mbps")) is not None}
                   for what, attr in (("writes", "write"), ("reads", "read"))}
        cpu_named, cpu_pace = outliers(cpu, step_limit)
        gpu_named, gpu_pace = outliers(gpu, step_limit)
        storage_named = {what: outliers(r, storage_limit) for what, r in storage.items()}
        for name in common:
            b, n = base.nodes[name], now.nodes[name]
            if name in cpu_named:
                found.append(Finding(node=name, what=(
                    f"a step of the fixed batch takes {n.cpu_step_s * 1e3:.1f} ms on its CPUs, "
                    f"{n.cpu_step_s / b.cpu_step_s:.2f}x its baseline {b.cpu_step_s * 1e3:.1f} ms "
                    f"(more than {th.max_step_slowdown:.0%} slower)"), fix=slow_fix))
            for i, (bg, ng) in enumerate(zip(b.gpu_step_s, n.gpu_step_s, strict=False)):
                if (name, i) in gpu_named:
                    found.append(Finding(node=name, what=(
                        f"GPU {i}: a step takes {ng * 1e3:.2f} ms, {ng / bg:.2f}x its baseline "
                        f"{bg * 1e3:.2f} ms (more than {th.max_step_slowdown:.0%} slower)"),
                        fix="nvidia-smi -q -d PERFORMANCE,CLOCK on it (throttling, clocks, power cap)"))
            if len(n.gpu_step_s) < len(b.gpu_step_s):
                found.append(Finding(node=name, what=f"{len(n.gpu_step_s)} GPU(s) measured, its "
                                     f"baseline has {len(b.gpu_step_s)}", fix="make doctor (GPUs Ray sees)"))
            for what, bv, nv in (("writes", b.storage_write_mbps, n.storage_write_mbps),
                                 ("reads", b.storage_read_mbps, n.storage_read_mbps)):
                if bv and nv is not None and name in storage_named[what][0]:
                    found.append(Finding(node=name, what=(
                        f"{what} the shared storage at {nv:.0f} MB/s, {nv / bv:.0%} of its baseline "
                        f"{bv:.0f} MB/s (below {th.min_storage_fraction:.0%})"),
                        fix="its network to the storage server (ip -s link; make doctor checks the mount)"))
        slower = f"more than {th.max_step_slowdown:.0%} slower"
        if cpu_pace > step_limit:
            found.append(shared(f"a step of the fixed batch on its CPUs takes {cpu_pace:.2f}x its "
                                "baseline on the median node", slower, cpu,
                                lambda r: f"{r:.2f}x", shared_fix))
        if gpu_pace > step_limit:
            found.append(shared(f"a step takes {gpu_pace:.2f}x its baseline on the median GPU",
                                slower, gpu, lambda r: f"{r:.2f}x",
                                "nvidia-smi -q -d PERFORMANCE,CLOCK on each (a driver, clocks, power "
                                "caps); " + shared_fix))
        for what, (_, pace) in storage_named.items():
            if pace > storage_limit:
                found.append(shared(f"the shared storage: {what} at {1 / pace:.0%} of their baseline on "
                                    "the median node", f"below {th.min_storage_fraction:.0%}", storage[what],
                                    lambda r: f"{1 / r:.0%}", "the storage server's disks or its network "
                                    "(make doctor checks the mount)"))
        for key, bv in base.links.items():
            nv = now.links.get(key)
            if nv is not None and nv < bv * th.min_link_fraction:
                found.append(Finding(node=key, what=(
                    f"the link carries {nv:.2f} GB/s, {nv / bv:.0%} of its baseline {bv:.2f} GB/s "
                    f"(below {th.min_link_fraction:.0%})"),
                    fix="the NICs, cables or switch between the two (ip -s link on both; iperf3 by hand)"))
    f = factor(base, now)
    ar = now.allreduce
    if ar and f is not None and now.link_peak:
        want = th.min_busbw_fraction * f * now.link_peak
        if ar.busbw_gbps < want:
            found.append(Finding(node="all-reduce", what=(
                f"{ar.backend} bus bandwidth {ar.busbw_gbps:.2f} GB/s at {ar.bytes >> 20} MiB is below "
                f"{th.min_busbw_fraction:.0%} of the link peak {now.link_peak:.2f} GB/s x the "
                f"algorithm's factor {f:.2f} ({want:.2f} GB/s)"),
                fix="the collective interface (make doctor) or a slow node (named above)"))
    elif ar and base and base.allreduce and not now.link_peak and base.allreduce.backend == ar.backend:
        if ar.busbw_gbps < th.min_busbw_fraction * base.allreduce.busbw_gbps:
            found.append(Finding(node="all-reduce", what=(
                f"{ar.backend} bus bandwidth {ar.busbw_gbps:.2f} GB/s, "
                f"{ar.busbw_gbps / base.allreduce.busbw_gbps:.0%} of its baseline "
                f"{base.allreduce.busbw_gbps:.2f} GB/s (below {th.min_busbw_fraction:.0%})"),
                fix="the collective interface (make doctor) or a slow node (named above)"))
    return found


def rows(base: Perf | None, now: Perf) -> list[dict]:
    """The comparison, one row per figure: what, unit, baseline, now, and `speed` (now against
    the baseline, higher is better: baseline/now for times, now/baseline for rates)."""
    out = []

    def add(who, what, unit, b, n, time_like):
        speed = None
        if b and n:
            speed = b / n if time_like else n / b
        out.append({"who": who, "what": what, "unit": unit, "baseline": b, "now": n, "speed": speed})

    for name in sorted(set(now.nodes) | set(base.nodes if base else {})):
        n, b = now.nodes.get(name), (base.nodes.get(name) if base else None)
        add(name, "CPU step", "ms", b and b.cpu_step_s * 1e3, n and n.cpu_step_s * 1e3, True)
        for i in range(max(len(n.gpu_step_s) if n else 0, len(b.gpu_step_s) if b else 0)):
            bg = b.gpu_step_s[i] * 1e3 if b and i < len(b.gpu_step_s) else None
            ng = n.gpu_step_s[i] * 1e3 if n and i < len(n.gpu_step_s) else None
            add(name, f"GPU {i} step", "ms", bg, ng, True)
        add(name, "storage write", "MB/s", b and b.storage_write_mbps, n and n.storage_write_mbps, False)
        add(name, "storage read", "MB/s", b and b.storage_read_mbps, n and n.storage_read_mbps, False)
    for key in sorted(set(now.links) | set(base.links if base else {})):
        add(key, "link", "GB/s", base.links.get(key) if base else None, now.links.get(key), False)
    if now.allreduce or (base and base.allreduce):
        add("all-reduce", "bus bandwidth", "GB/s", base and base.allreduce and base.allreduce.busbw_gbps,
            now.allreduce and now.allreduce.busbw_gbps, False)
    return out


def table(base: Perf | None, now: Perf) -> list[str]:
    def fmt(v):
        return "-" if v is None else f"{v:.3g}" if v < 100 else f"{v:.0f}"

    lines = [f"{'':<16} {'':<14} {'unit':>5} {'baseline':>9} {'now':>9} {'speed':>6}"]
    for r in rows(base, now):
        speed = "-" if r["speed"] is None else f"{r['speed']:.2f}"
        lines.append(f"{r['who']:<16} {r['what']:<14} {r['unit']:>5} {fmt(r['baseline']):>9} "
                     f"{fmt(r['now']):>9} {speed:>6}")
    return lines


def plot(base: Perf, now: Perf, th: Thresholds, path: Path, pyplot) -> Path:
    """One panel per node (and one for the links and the all-reduce): each figure's speed against
    its baseline (1.0: as fast; below the dashed line: named as a finding; the bus bandwidth's line
    is its own threshold against the baseline's, where the finding holds it to the links')."""
    groups: dict[str, list[dict]] = {}
    for r in rows(base, now):
        if r["speed"] is None:  # not measured now, or new since the baseline: in the table only
            continue
        who = r["who"] if r["who"] in now.nodes or (r["who"] in base.nodes) else "links, all-reduce"
        groups.setdefault(who, []).append(r)
    limit = {"link": th.min_link_fraction, "bus bandwidth": th.min_busbw_fraction,
             "storage write": th.min_storage_fraction, "storage read": th.min_storage_fraction}
    if not groups:
        raise ValueError("no figure was measured both in the baseline and now")
    fig, axes = pyplot.subplots(1, len(groups), figsize=(3.2 * len(groups) + 1, 3.8), squeeze=False,
                                sharey=True)
    top = max([1.3] + [1.15 * r["speed"] for rs in groups.values() for r in rs])
    for ax, (who, rs) in zip(axes[0], groups.items(), strict=True):
        labels = [r["what"] if who != "links, all-reduce" else (r["who"] if r["what"] == "link" else "bus bw")
                  for r in rs]
        speeds = [r["speed"] for r in rs]
        lims = [limit.get(r["what"], 1 / (1 + th.max_step_slowdown)) for r in rs]
        colors = ["tab:red" if s < lim else "tab:green" for s, lim in zip(speeds, lims, strict=True)]
        bars = ax.bar(range(len(rs)), speeds, color=colors)
        ax.bar_label(bars, labels=[f"{s:.2f}" for s in speeds], fontsize=7)
        for i, lim in enumerate(lims):
            ax.hlines(lim, i - 0.4, i + 0.4, colors="black", linestyles="dashed", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.6)
        ax.set_xticks(range(len(rs)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_title(who, fontsize=9)
        ax.set_ylim(0, top)
    axes[0][0].set_ylabel("against the baseline (higher is better)")
    fig.suptitle(f"{now.cluster}: {now.recorded} against the baseline of {base.recorded} "
                 "(dashed: the threshold)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot.close(fig)
    return path
