"""Someone on the cluster's private network tries each of the head's Ray services the firewall
lets that network reach: without the token and a certificate of the cluster's CA (a stranger), or
with one or both (RAY_AUTH_TOKEN set; RAY_USE_TLS with RAY_TLS_* naming a node's key and
certificates: the controls, showing each refusal is the token's or TLS's doing). Runs in a
throwaway container of the project's image (Ray's own client code) on that network; prints one
JSON object: service -> what happened. Used by tests/emulated/test_20_stranger.py.

usage: python - HEAD_IP GCS_PORT CLIENT_PORT DASHBOARD_PORT AGENT_PORT METRICS_PORT [gcs-only] < stranger.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

head, gcs, client, dashboard, agent, metrics = sys.argv[1], *map(int, sys.argv[2:7])
gcs_only = sys.argv[7:] == ["gcs-only"]
token = os.environ.get("RAY_AUTH_TOKEN")
seen = {}


def http(name: str, url: str) -> None:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            seen[name] = r.status
    except urllib.error.HTTPError as e:
        seen[name] = e.code
    except OSError as e:
        seen[name] = f"error: {e}"[:200]


def gcs_nodes() -> None:
    """The GCS's node table, through Ray's own GCS client (what every raylet and driver uses)."""
    from ray._raylet import GcsClient

    try:
        seen["GCS"] = f"{len(GcsClient(address=f'{head}:{gcs}').get_all_node_info(timeout=10))} nodes"
    except Exception as e:  # noqa: BLE001 - Ray's errors: whatever it raises is the answer
        seen["GCS"] = f"{type(e).__name__}: {e}"[:200]


def ray_client() -> None:
    """A Ray Client session (ray://), in a process of its own: a refused one retries until it
    gives up (its three tries waiting 2, 4 and 4 s rather than Ray's 5, 10 and 15: the answer is the
    same, sooner)."""
    code = f"import ray; ray.init('ray://{head}:{client}'); print('NODES', len(ray.nodes()))"
    waits = {"RAY_CLIENT_INITIAL_CONNECTION_TIMEOUT_S": "2", "RAY_CLIENT_MAX_CONNECTION_TIMEOUT_S": "4"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **waits})
        out = (proc.stdout + proc.stderr).strip().splitlines()
        nodes = [line for line in out if line.startswith("NODES ")]
        seen["Ray Client"] = nodes[0].split()[1] + " nodes" if nodes else (out[-1] if out else "")[:200]
    except subprocess.TimeoutExpired:
        seen["Ray Client"] = "timed out"


if not gcs_only:
    http("job API", f"http://{head}:{dashboard}/api/jobs/")
    # the agent's own job API, which the head's dashboard uses to start a job's driver on a node (a
    # job that does not exist: the control, with the token, starts nothing)
    http("agent's job API", f"http://{head}:{agent}/api/job_agent/jobs/no-such-job/logs")
    http("agent's health", f"http://{head}:{agent}/api/healthz")
    http("metrics", f"http://{head}:{metrics}/metrics")
gcs_nodes()
if not gcs_only:
    ray_client()
print(json.dumps(seen))
