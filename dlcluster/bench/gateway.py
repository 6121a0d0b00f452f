"""What the job gateway adds to each job API call and to a followed log, measured side by side.

    make bench-gateway                     # ARGS="--calls 400 --log-lines 50000" to change

On this machine it starts a Ray head of its own (one CPU, token auth, its own temp folder and free
ports) and the gateway in front of it (python -m gateway, its own data folder), makes a person,
then asks the same calls of Ray's dashboard directly (the cluster's token) and through the gateway
(the person's credential), interleaved call by call so both see the same machine: the version,
the job list, one job's record, one job's whole log, and a submission. Then a job that prints
`--log-lines` lines is followed to its end (`ray job logs -f`'s websocket) both ways. It prints
each call's median and 95th percentile, what the gateway adds and the ratio, writes
bench-gateway.json and bench-gateway.png under --out, and stops what it started. Goal (issue 70):
at most 5 ms added to a call's median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

RAY = str(Path(sys.executable).parent / "ray")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def call(url: str, credential: str, method: str = "GET", body: dict | None = None) -> tuple[float, bytes]:
    """Milliseconds of one HTTP request, and its answer; an error answer is an error here."""
    req = urllib.request.Request(url, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Bearer {credential}",
                                          "Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        data = r.read()
    return (time.perf_counter() - t0) * 1000, data


async def follow(base: str, credential: str, job: str) -> tuple[float, int]:
    """Seconds to follow a job's log to its end through Ray's websocket, and the bytes it gave."""
    import aiohttp

    t0 = time.perf_counter()
    got = 0
    async with aiohttp.ClientSession() as session, session.ws_connect(
            f"{base}/api/jobs/{job}/logs/tail", headers={"Authorization": f"Bearer {credential}"}) as ws:
        async for msg in ws:
            got += len(msg.data)
    return time.perf_counter() - t0, got


def wait_for(url: str, credential: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            call(url, credential)
            return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"bench-gateway: {url} did not answer within {timeout:.0f} s")


def ended(base: str, token: str, job: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = json.loads(call(f"{base}/api/jobs/{job}", token)[1])
        if info["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            return info
        time.sleep(0.5)
    raise SystemExit(f"bench-gateway: job {job} did not end within {timeout:.0f} s")


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"median": statistics.median(ordered), "p95": ordered[int(0.95 * (len(ordered) - 1))],
            "n": len(ordered)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench-gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="requests of each kind, each way (default 200)")
    p.add_argument("--submissions", type=int, default=5, help="submissions each way (default 5)")
    p.add_argument("--log-lines", type=int, default=20000, help="lines of the followed job's log")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("DLC_CONFIG", "~/.config/dlcluster"))
                   .expanduser() / "bench", help="where bench-gateway.json and .png go")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dlc-bench-gateway-"))
    token = secrets.token_hex(32)
    (work / "ray_token").write_text(token + "\n")
    os.chmod(work / "ray_token", 0o600)
    gcs, dash, front = free_port(), free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(work / "ray_token")}
    env.pop("RAY_ADDRESS", None)
    direct, gated = f"http://{HOST}:{dash}", f"http://{HOST}:{front}"
    gateway: subprocess.Popen | None = None
    try:
        print(f"bench-gateway: a Ray head on {HOST}:{gcs} (dashboard {dash}) and the gateway on {front}",
              flush=True)
        subprocess.run([RAY, "start", "--head", "--port", str(gcs), "--dashboard-host", HOST,
                        "--dashboard-port", str(dash), "--include-dashboard", "true", "--num-cpus", "1",
                        "--disable-usage-stats", "--temp-dir", str(work / "ray"), "--ray-client-server-port",
                        str(free_port()), "--dashboard-agent-listen-port", "0", "--node-ip-address", HOST],
                       env=env, check=True, capture_output=True)
        gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--listen", f"{HOST}:{front}",
                                    "--upstream", direct, "--token-file", str(work / "ray_token"),
                                    "--data", str(work / "data")], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(f"{direct}/api/version", token)
        wait_for(f"{gated}/gateway/whoami", token)
        person = json.loads(call(f"{gated}/gateway/users", token, "POST",
                                 {"name": "bench", "team": "bench"})[1])["credential"]
        results = measure(a, direct, gated, token, person)
    finally:
        if gateway:
            os.killpg(gateway.pid, signal.SIGTERM)
        stop_ray(work)
    report(results, a.out)


def measure(a: argparse.Namespace, direct: str, gated: str, token: str, person: str) -> dict[str, Any]:
    ways = {"direct": (direct, token), "gateway": (gated, person)}
    job = json.loads(call(f"{direct}/api/jobs/", token, "POST",
                          {"entrypoint": "echo hello"})[1])["submission_id"]
    ended(direct, token, job)
    kinds = {"version": ("GET", "/api/version"), "job list": ("GET", "/api/jobs/"),
             "a job": ("GET", f"/api/jobs/{job}"), "its log": ("GET", f"/api/jobs/{job}/logs")}
    out: dict[str, Any] = {"calls": {}, "follow": {}}
    print(f"bench-gateway: {a.calls} calls of each kind, each way, interleaved", flush=True)
    for kind, (method, path) in kinds.items():
        times: dict[str, list[float]] = {"direct": [], "gateway": []}
        for _ in range(a.calls):
            for way, (base, cred) in ways.items():
                times[way].append(call(base + path, cred, method)[0])
        out["calls"][kind] = {way: summary(ms) for way, ms in times.items()}
    times = {"direct": [], "gateway": []}
    for _ in range(a.submissions):
        for way, (base, cred) in ways.items():
            ms, data = call(f"{base}/api/jobs/", cred, "POST", {"entrypoint": "true"})
            times[way].append(ms)
            ended(direct, token, json.loads(data)["submission_id"])
    out["calls"]["a submission"] = {way: summary(ms) for way, ms in times.items()}
    printer = (f"python -c 'import sys; sys.stdout.writelines(f\"line {{i}} of the log\\n\" "
               f"for i in range({a.log_lines}))'")
    for way, (base, cred) in ways.items():
        submitted = json.loads(call(f"{base}/api/jobs/", cred, "POST",
                                    {"entrypoint": printer})[1])["submission_id"]
        seconds, got = asyncio.run(follow(base, cred, submitted))
        out["follow"][way] = {"seconds": seconds, "bytes": got}
    return out


def stop_ray(work: Path) -> None:
    """Every process of the head this started (found by its temp folder), never another cluster's."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"])
            if any(str(work) in c for c in p.info["cmdline"] or [])]
    for proc in mine:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(mine, timeout=15)
    for proc in alive:
        proc.kill()


def report(results: dict[str, Any], out: Path) -> None:
    rows = []
    print(f"\n{'call':<14}{'direct ms':>12}{'gateway ms':>12}{'added ms':>10}{'ratio':>8}   (median; p95)")
    for kind, r in results["calls"].items():
        d, g = r["direct"], r["gateway"]
        added = g["median"] - d["median"]
        rows.append((kind, d["median"], g["median"]))
        print(f"{kind:<14}{d['median']:>12.2f}{g['median']:>12.2f}{added:>10.2f}"
              f"{g['median'] / d['median']:>8.2f}   (p95 {d['p95']:.2f} / {g['p95']:.2f})")
    f = results["follow"]
    ratio = f["gateway"]["seconds"] / f["direct"]["seconds"]
    print(f"\nray job logs -f of {f['direct']['bytes']} bytes: direct {f['direct']['seconds']:.2f} s, "
          f"through the gateway {f['gateway']['seconds']:.2f} s (ratio {ratio:.2f})")
    worst = max(r["gateway"]["median"] - r["direct"]["median"] for r in results["calls"].values())
    print(f"the most the gateway adds to a call's median: {worst:.2f} ms (goal: at most 5 ms)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-gateway.json").write_text(json.dumps(results, indent=2) + "\n")
    from dlcluster.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.4, label="Ray directly (cluster token)")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in rows], 0.4, label="through the gateway (a person)")
    ax.set_xticks(list(xs), [r[0] for r in rows])
    ax.set_ylabel("median ms per call")
    ax.set_title("What the job gateway adds to a job API call")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench-gateway.png", dpi=110)
    print(f"wrote {out / 'bench-gateway.json'} and {out / 'bench-gateway.png'}")


if __name__ == "__main__":
    main()
