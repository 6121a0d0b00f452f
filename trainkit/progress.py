"""Progress lines from the jobs, printed once.

Ray Train V2 patches `print` on its workers and, when stdout is redirected (as on a Ray
worker), both prints and logs each line, so every line shows up twice in the job's log.
Writing to the process's own stdout sidesteps the patch.
"""

import sys


def say(job: str, message: str) -> None:
    print(f"[{job}] {message}", file=sys.__stdout__, flush=True)
