"""The one rule for anything that would restart Ray: never under a running job unless asked.

Used by every path that restarts Ray (roles/ray: its settings; roles/docker_engine: the engine;
roles/firewall: turned off; roles/nvidia: the reboot for the driver; cluster-down; rotate-token);
tests/unit/test_ansible.py covers each case.
  restart_refusal: "" when the restart may go ahead, else the one line that stops it: the node,
                   what would restart, the jobs the head named before any role ran (roles/control,
                   tasks/jobs.yml), what the restart does to them, and the way on.
"""

HEAD = ("on the head it ends every job: their drivers run there and no --max-failures brings them "
        "back (submit each again with the same --name: it continues from its last checkpoint)")
WORKER = ("on a worker it stops the job's workers there: a job with --max-failures restarts from its "
          "last checkpoint (with --num-workers MIN-MAX on the nodes left), any other job fails")


def restart_refusal(control: dict, host: str, what: str, is_head: bool, forced) -> str:
    """`control`: hostvars['localhost'], where roles/control keeps control_running_jobs."""
    if str(forced).lower() in ("true", "yes", "1"):
        return ""
    jobs = control.get("control_running_jobs")
    if jobs is None:  # the check did not run (a --limit without localhost): fail closed
        return (f"{host}: {what}, but this run did not ask the head which jobs run (the control "
                f"host's play was left out, e.g. by --limit: add localhost to it); nothing was restarted")
    if not jobs:
        return ""
    return (f"{host}: {what}, but {len(jobs)} job(s) run on the cluster ({', '.join(jobs)}), so "
            f"nothing was restarted: {HEAD if is_head else WORKER}; run again when they have ended, "
            f"or set dlc_restart_running_jobs: true to restart now")


class FilterModule:
    def filters(self):
        return {"dlc_restart_refusal": restart_refusal}
