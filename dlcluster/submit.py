"""`dlcluster submit JOB [job flags...]` and `dlcluster resume RUN` (make submit, demo, resume).

`ray job submit` of jobs/JOB.py to the current cluster: the README's line, plus the checkout's commit
as data (DLC_SUBMIT_COMMIT), with the job API's address and token from the cluster record
($DLC_CONFIG/cluster.json, dlcluster/record.py). What travels is what git tracks, and the files
--upload names, staged in a private folder (dlcluster/upload.py): nothing else. Each submission is
kept ($DLC_CONFIG/clusters/<cluster>/runs/<run>.json, dlcluster/submissions.py) with its run name
(--name; one is chosen here when the flags have none), so that `dlcluster resume RUN` submits the
same job and flags again after the head lost its driver. The last step is the unchanged Ray CLI,
run in this process's place.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from dlcluster import record, submissions, upload
from trainkit.errors import UserError
from trainkit.onnx_export import checkout_commit

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose jobs/ and tracked files travel


def jobs() -> list[str]:
    return sorted(p.stem for p in (ROOT / "jobs").glob("*.py"))


def reachable(api: str) -> bool:
    url = urlsplit(api)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=5):
            return True
    except OSError:
        return False


def submit(job: str, flags: list[str], named: list[str]) -> int:
    """Stage, keep and submit jobs/JOB.py with its flags; ends in `ray job submit` (exec)."""
    if not (ROOT / "jobs" / f"{job}.py").is_file():
        raise UserError(f"no jobs/{job}.py; JOB is one of: {' '.join(jobs())}")
    rec = record.load()  # one line on a bad record
    if not reachable(rec.job_api):
        raise UserError(f"nothing answers on the job API {rec.job_api} of the cluster record; run make "
                        "cluster-up (for a remote cluster: it reopens the tunnel)")
    # The commit travels as data; so does where this operator's browser reaches the run history (the
    # record's tunnel end): the links the run prints.
    at = checkout_commit(ROOT)  # "-dirty" when tracked files changed (the upload carries no history)
    env_json = json.dumps(rec.runtime_env(at))
    stage = tempfile.mkdtemp(prefix="dlc-upload.")  # 0700, a name nobody can guess
    try:
        files = upload.stage(ROOT, Path(stage), named)
        upload.say(ROOT, Path(stage), files, named)
        # kept under the run's name (--name, added when the flags have none): its submission id and flags
        submission, flags = submissions.keep(at or "unknown", job, flags)
        env = {**os.environ, **rec.client_env(), "RAY_RUNTIME_ENV_IGNORE_GITIGNORE": "1"}
        ray = str(Path(sys.executable).parent / "ray")
        return subprocess.run([ray, "job", "submit", "--address", rec.job_api, "--submission-id", submission,
                               "--working-dir", stage, "--runtime-env-json", env_json, "--",
                               "python", f"jobs/{job}.py", *flags], env=env).returncode
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def submit_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dlcluster submit", description="`ray job submit` of jobs/JOB.py and its flags to the current "
        "cluster, uploading what git tracks and --upload; the submission is kept for resume")
    p.add_argument("--upload", default=os.environ.get("UPLOAD", ""), metavar="PATHS",
                   help="files or folders of the checkout to upload beside what git tracks, space-separated "
                        "(default: $UPLOAD)")
    p.add_argument("job", metavar="JOB", help=f"one of jobs/*.py: {', '.join(jobs())}")
    p.add_argument("flags", nargs=argparse.REMAINDER, metavar="FLAGS", help="the job's own flags")
    a = p.parse_args(argv)  # everything after JOB is the job's, untouched
    try:
        return submit(a.job, a.flags, shlex.split(a.upload))
    except UserError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2


def resume_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dlcluster resume", description="run RUN submitted again as it first was (same job, flags, "
        "--name), going on from its last checkpoint")
    p.add_argument("run", metavar="RUN", nargs="?", default=os.environ.get("RUN", ""),
                   help="the run's name (its --name; default: $RUN)")
    a = p.parse_args(argv)
    if not a.run:
        print("resume: error: name the run: make resume RUN=<the run's name>", file=sys.stderr)
        return 2
    try:
        job, flags = submissions.resume(a.run)
    except UserError as e:
        print(f"resume: error: {e}", file=sys.stderr)
        return 2
    print(f"resume: run {a.run} again, from its last checkpoint: jobs/{job}.py {' '.join(flags)}", flush=True)
    try:
        return submit(job, flags, [])
    except UserError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
