"""What `make submit` submitted, kept per run, so `make resume RUN=...` can submit it again.

A run whose driver was lost (the head's Ray restarted: every job's driver runs there, and
--max-failures cannot bring a driver back) resumes by being submitted again with the same job,
flags and --name: the harness restores its last checkpoint and trains the missing epochs.

    keep(commit, job, flags)   what is submitted next, kept under its --name (one is added when the
                               flags have none): its submission id (RUN, then RUN-2, ...) and flags
    resume(run)                the job and its flags, or a UserError (an unknown run, one still
                               running or finished); dlcluster/submit.py calls both

Kept as $DLC_CONFIG/clusters/<cluster>/runs/<RUN>.json (the cluster of the current record).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dlcluster import record
from trainkit.errors import UserError
from trainkit.flags import default_name, run_name

LIVE = ("PENDING", "RUNNING")


class Submission(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(description="the run's name (--name): its checkpoints and models")
    job: str = Field(description="jobs/<job>.py")
    flags: list[str] = Field(description="the job's flags as submitted, --name RUN among them")
    submissions: list[str] = Field(description="Ray's submission ids, oldest first")
    commits: list[str] = Field(description="the checkout's commit at each submission (-dirty: changed)")
    times: list[str] = Field(description="when each was submitted (UTC)")


def folder() -> Path:
    rec = record.load()
    return record.config_dir() / "clusters" / rec.name / "runs"


def path_of(run: str) -> Path:
    try:
        run_name(run)  # the jobs' own check of --name
    except argparse.ArgumentTypeError as e:
        raise UserError(str(e)) from None
    return folder() / f"{run}.json"


def name_of(job: str, flags: list[str]) -> tuple[str, list[str]]:
    """The run's name and the flags that carry it (--name added when the flags had none)."""
    for i, flag in enumerate(flags):
        if flag == "--name" and i + 1 < len(flags):
            return flags[i + 1], flags
        if flag.startswith("--name="):
            return flag.split("=", 1)[1], flags
    run = default_name(job)
    return run, [*flags, "--name", run]


def keep(commit: str, job: str, flags: list[str]) -> tuple[str, list[str]]:
    """Keep the submission about to be made, under its run's name: its submission id and flags."""
    run, flags = name_of(job, flags)
    path = path_of(run)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if path.exists():
        old = Submission.model_validate_json(path.read_text())
        submission = f"{run}-{len(old.submissions) + 1}"
        kept = old.model_copy(update={"job": job, "flags": flags,
                                      "submissions": [*old.submissions, submission],
                                      "commits": [*old.commits, commit], "times": [*old.times, now]})
    else:
        submission = run
        kept = Submission(run=run, job=job, flags=flags, submissions=[submission], commits=[commit],
                          times=[now])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(kept.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
    return submission, flags


def status(submission: str) -> str | None:
    """The job's status on the cluster, or None when the cluster does not know it (its head's Ray
    restarted since: the job's record went with it)."""
    os.environ.update(record.load().client_env())  # before Ray's import: it reads RAY_AUTH_MODE then
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(os.environ["RAY_ADDRESS"])
    try:
        return str(client.get_job_status(submission).value)
    except RuntimeError as e:  # the job API's 404: no such job
        if "404" in str(e) or "does not exist" in str(e):
            return None
        raise


def resume(run: str) -> tuple[str, list[str]]:
    """(the job, its flags) for submitting RUN again."""
    path = path_of(run)
    if not path.exists():
        known = sorted(p.stem for p in folder().glob("*.json")) if folder().is_dir() else []
        raise UserError(f"no run {run} was submitted to cluster {record.load().name} from here "
                        f"({path} is missing); runs kept here: {', '.join(known[-5:]) or 'none'}")
    kept = Submission.model_validate_json(path.read_text())
    last = kept.submissions[-1]
    state = status(last)
    if state in LIVE:
        raise UserError(f"run {run} is still {state.lower()} as job {last}: nothing submitted "
                        f"(ray job stop {last} first, to resume it from its checkpoint)")
    if state == "SUCCEEDED":
        raise UserError(f"run {run} finished (job {last} succeeded): nothing to resume")
    return kept.job, kept.flags
