"""The one rule for anything that would restart Ray: never under a running job unless asked.

Used by every path that restarts Ray (roles/ray: its settings; roles/docker_engine: the engine;
roles/firewall: turned off; roles/nvidia: the reboot for the driver; cluster-down; rotate-token),
and by the run history's restart (roles/tracking: a job on the head could take its port meanwhile);
tests/unit/test_ansible.py covers each case.
  restart_refusal: "" when the restart may go ahead, else the one line that stops it: the node,
                   what would restart, the jobs the head named before any role ran (roles/control_host,
                   tasks/jobs.yml), what the restart does to them, and the way on.
  upgrade_refusal: make upgrade's question before any change: "" when a rolling upgrade may go
                   ahead under the jobs running now (each restarts from its checkpoint when its
                   workers' node restarts), else the one line that stops it. Each job's
                   max_failures comes with the answer (dlcluster/jobs_plan.py read it with the
                   harness's own parser, on the project's Python): this plugin imports nothing of
                   the project.
"""

HEAD = ("on the head it ends every job: their drivers run there and no --max-failures brings them "
        "back (submit each again with the same --name: it continues from its last checkpoint)")
WORKER = ("on a worker it stops the job's workers there: a job with --max-failures restarts from its "
          "last checkpoint (with --num-workers MIN-MAX on the nodes left), any other job fails")


def restart_refusal(control: dict, host: str, what: str, is_head: bool, forced, effect: str = "") -> str:
    """`control`: hostvars['localhost'], where roles/control_host keeps control_running_jobs;
    `effect`: what the restart does to the running jobs, where it is not Ray's (HEAD, WORKER)."""
    if _forced(forced):
        return ""
    jobs = control.get("control_running_jobs")
    if jobs is None:  # the check did not run (a --limit without localhost): fail closed
        return (f"{host}: {what}, but this run did not ask the head which jobs run (the control "
                f"host's play was left out, e.g. by --limit: add localhost to it); nothing was restarted")
    if not jobs:
        return ""
    effect = effect or (HEAD if is_head else WORKER)
    return (f"{host}: {what}, but {len(jobs)} job(s) run on the cluster ({', '.join(jobs)}), so "
            f"nothing was restarted: {effect}; run again when they have ended, "
            f"or set dlc_restart_running_jobs: true to restart now")


def _forced(value) -> bool:
    return str(value).lower() in ("true", "yes", "1")


def upgrade_refusal(answer: dict, ray_version: str, forced) -> str:
    """`answer`: what the head said (roles/control_host/files/running_jobs.py), each job with its
    max_failures (dlcluster/jobs_plan.py; a job without one is unknown). A newer Ray cannot roll
    (Ray's nodes all run one version); a job that would not restart from its checkpoint when Ray
    restarts on one of its workers' nodes stops the upgrade unless forced."""
    running = answer.get("ray_version")
    if answer.get("ray") == "up" and running and running != ray_version:
        return (f"the cluster runs Ray {running} and this checkout pins {ray_version}: Ray's nodes must "
                "all run one version, so it cannot be upgraded one node at a time; with no job running, "
                "make cluster-up restarts every node on the new Ray at once; nothing was changed")
    if _forced(forced):
        return ""
    stuck = []
    for job in answer.get("jobs") or []:
        n = job.get("max_failures")
        brief = " ".join(job["entrypoint"].split())[:60]
        if n is None:
            stuck.append(f"{job['id']} ({brief}: not python jobs/<job>.py, whether it restarts is unknown)")
        elif n == 0:
            stuck.append(f"{job['id']} ({brief}: --max-failures 0)")
    if not stuck:
        return ""
    return (f"make upgrade restarts Ray on each worker in turn, which stops the workers of the jobs there, "
            f"and {len(stuck)} running job(s) would not restart from a checkpoint: {'; '.join(stuck)}; "
            "nothing was changed: run it when they have ended, or set dlc_restart_running_jobs: true")


class FilterModule:
    def filters(self):
        return {"dlc_restart_refusal": restart_refusal, "dlc_upgrade_refusal": upgrade_refusal}
