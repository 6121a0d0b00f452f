"""A stranger on the cluster's private network, without the token, tries each of the head's Ray
services the firewall lets the private network reach. Runs in a throwaway container of the
project's image (Ray's own client code) on that network; prints one JSON object: service -> what
happened. Used by tests/emulated/test_emulated.py.

usage: python3 - HEAD_IP GCS_PORT CLIENT_PORT DASHBOARD_PORT AGENT_PORT METRICS_PORT < stranger.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

head, gcs, client, dashboard, agent, metrics = sys.argv[1], *map(int, sys.argv[2:7])
seen = {}


def http(name: str, url: str) -> None:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            seen[name] = {"status": r.status, "body": r.read(200).decode(errors="replace")}
    except urllib.error.HTTPError as e:
        seen[name] = {"status": e.code}
    except OSError as e:
        seen[name] = {"error": str(e)[:200]}


def ray_call(name: str, code: str) -> None:
    """Ray's own client, in a process of its own (a refusal may hang until its timeout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=90)
        out = (proc.stdout + proc.stderr).strip().splitlines()
        seen[name] = {"rc": proc.returncode, "last": out[-1][:300] if out else ""}
    except subprocess.TimeoutExpired:
        seen[name] = {"rc": None, "last": "timed out"}


http("job API", f"http://{head}:{dashboard}/api/jobs/")
http("dashboard agent", f"http://{head}:{agent}/api/local_raylet_healthz")
http("metrics", f"http://{head}:{metrics}/metrics")
ray_call("GCS", f"import ray; ray.init(address='{head}:{gcs}', log_to_driver=False); "
                "print('NODES', len(ray.nodes()))")
ray_call("Ray Client", f"import ray; ray.init('ray://{head}:{client}'); print('NODES', len(ray.nodes()))")
print(json.dumps(seen))
