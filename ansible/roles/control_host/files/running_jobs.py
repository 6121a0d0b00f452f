"""On the head, as root: which Ray jobs are running? One JSON line on stdout.

usage: sudo python3 - URL TOKEN_FILE WAIT_S < running_jobs.py

  {"ray": "down"}                                Ray's service is not running here: no job is
  {"ray": "up", "running": ["id (entrypoint)"],  the job API's clean answer (maybe no job), with
   "jobs": [{"id", "entrypoint"}],               each running job's whole entrypoint (make upgrade
   "ray_version": "2.60.0"}                      asks whether it restarts) and the head's Ray
  {"error": "..."}                               anything else: the caller stops (fails closed)

The token is read here, on the head, and never leaves it. While the service is up but its job
API does not answer yet (Ray starting), the question is asked again for up to WAIT_S seconds.
"""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request


def main() -> dict:
    url, token_file, wait_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    state = subprocess.run(["systemctl", "is-active", "dlc-ray"], capture_output=True, text=True)
    state = state.stdout.strip()
    if state != "active":  # no Ray on the head: no job can be running anywhere on the cluster
        return {"ray": "down", "state": state}
    try:
        with open(token_file) as f:
            token = f.read().strip()
    except OSError as e:
        return {"error": f"Ray runs but its token {token_file} cannot be read ({e.strerror})"}
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    deadline = time.time() + wait_s
    while True:
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                jobs = json.loads(r.read())
            break
        except urllib.error.HTTPError as e:  # refused (a token other than Ray's), or broken
            hint = (f": Ray runs with a token other than {token_file} (the file was replaced under it?)"
                    if e.code in (401, 403) else "")
            return {"error": f"the job API at {url} answered HTTP {e.code} {e.reason}{hint}"}
        except (urllib.error.URLError, OSError, ValueError) as e:
            if time.time() > deadline:
                return {"error": f"the job API at {url} did not answer within {wait_s:.0f} s "
                                 f"({getattr(e, 'reason', e)})"}
            time.sleep(2)
    if not isinstance(jobs, list):
        return {"error": f"the job API at {url} answered something other than a list of jobs"}
    running, whole = [], []
    for j in jobs:
        if j.get("status") in ("PENDING", "RUNNING"):
            job_id, entrypoint = j.get("submission_id") or j.get("job_id"), str(j.get("entrypoint", ""))
            running.append(f"{job_id} ({' '.join(entrypoint.split())[:60]})")
            whole.append({"id": job_id, "entrypoint": entrypoint})
    version = None
    try:  # the dashboard's own version: what every node must run (Ray joins no other)
        with urllib.request.urlopen(urllib.request.Request(url.replace("/api/jobs/", "/api/version"),
                                                           headers=req.headers), timeout=10) as r:
            version = json.loads(r.read()).get("ray_version")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        pass
    return {"ray": "up", "running": running, "jobs": whole, "ray_version": version}


if __name__ == "__main__":
    print(json.dumps(main()))
