"""make upgrade's question about the jobs running now, answered with the harness's own parser:
how often each restarts its workers from its checkpoint (--max-failures, and its default).

    python -m dlcluster.jobs_plan < ANSWER.json   # the head's answer (roles/control_host/files/
                                                  # running_jobs.py)

prints the same answer with `max_failures` on each job: a number for `python jobs/<job>.py ...`,
null for anything else (unknown). The control_host role runs it on the control host (the project's
Python) and the dlc_upgrade_refusal filter reads it, so Ansible's own environment never imports
the harness.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from trainkit import flags


def max_failures(entrypoint: str) -> int | None:
    """How often a job restarts its workers from its checkpoint: its --max-failures (the harness's
    own parser and default) for `python jobs/<job>.py ...`; None for anything else (unknown)."""
    try:
        argv = shlex.split(entrypoint)
    except ValueError:
        return None
    at = next((i for i, w in enumerate(argv) if w.startswith("jobs/") and w.endswith(".py")), None)
    if at is None:
        return None
    p = flags.parser(Path(argv[at]).stem, "", batch_size=1, epochs=1, lr=0.1, launchers=flags.LAUNCHERS)
    try:
        return p.parse_known_args(argv[at + 1:])[0].max_failures
    except SystemExit:  # a flag the job itself would refuse: it is not running long
        return None


def plan(answer: dict) -> dict:
    """The head's answer with each running job's max_failures."""
    jobs = [{**job, "max_failures": max_failures(job["entrypoint"])} for job in answer.get("jobs") or []]
    return {**answer, "jobs": jobs} if "jobs" in answer else answer


if __name__ == "__main__":
    print(json.dumps(plan(json.load(sys.stdin))))
