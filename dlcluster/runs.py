"""`make runs`: the cluster's run history from its MLflow tracking server, in the terminal.

    dlcluster runs [--last N]     # the last runs: run, job, commit, epochs, final validation
                                           # metric, restarts, model sha256, state
    dlcluster runs --run NAME     # one run's metrics per epoch

The server and its credentials are found as the jobs find them (trainkit.tracking): --tracking,
else DLC_TRACKING_URL, else the current cluster record.
"""

from __future__ import annotations

import argparse
import sys

from trainkit import tracking
from trainkit.errors import UserError, run_main

# per-epoch columns shown first, in this order; the job's own metrics follow
FIRST = ("loss", "val_loss")
LAST = ("samples_per_s", "epoch_s", "dataflow_s", "processing_s", "allreduce_s", "validation_s")


def connect(flag: str | None):
    url, how = tracking.setting(flag)
    if url is None:
        raise UserError(f"{how}; bring a cluster up (make cluster-up), or set DLC_TRACKING_URL=http://HOST:PORT")
    return url, tracking.client(url)


def final_metric(metrics: dict) -> str:
    """The run's validation result: its accuracy where it has one, else its loss."""
    val = sorted(k for k in metrics if k.startswith("val_"))
    pick = next((k for k in val if k != "val_loss"), "val_loss" if "val_loss" in val else None)
    return f"{pick} {metrics[pick]:.4f}" if pick else "-"


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [head, *rows])


def last_runs(url: str, mlflow, last: int) -> str:
    experiments = mlflow.search_experiments()
    found = mlflow.search_runs([e.experiment_id for e in experiments], max_results=last,
                               order_by=["attributes.start_time DESC"]) if experiments else []
    if not found:
        return f"no runs at {url} yet: a job's run appears here when it starts"
    rows = []
    for r in found:
        t, m = r.data.tags, r.data.metrics
        rows.append([r.info.run_name, t.get("dlc.owner", "-"), t.get("dlc.job", "-"),
                     t.get("dlc.commit", "-")[:12],
                     str(int(m["epoch"])) if "epoch" in m else "0", final_metric(m),
                     t.get("dlc.restarts", "-"), t.get("dlc.model_sha256", "-")[:12],
                     r.info.status.lower()])
    return table(rows, ["run", "owner", "job", "commit", "epochs", "validation", "restarts", "model sha256",
                        "state"])


def one_run(url: str, mlflow, name: str) -> str:
    experiments = mlflow.search_experiments()
    found = mlflow.search_runs([e.experiment_id for e in experiments], f"attributes.run_name = '{name}'",
                               max_results=1) if experiments else []
    if not found:
        raise UserError(f"no run named {name} at {url}; make runs lists the last ones")
    r = found[0]
    keys = [k for k in FIRST if k in r.data.metrics] + sorted(
        k for k in r.data.metrics if k not in (*FIRST, *LAST, "epoch", "world_size", "tracking_s")) + \
        [k for k in LAST if k in r.data.metrics]
    by_epoch: dict[int, dict[str, float]] = {}
    for k in keys:
        for point in mlflow.get_metric_history(r.info.run_id, k):
            by_epoch.setdefault(point.step, {})[k] = point.value
    rows = [[str(e), *(f"{by_epoch[e][k]:.4g}" if k in by_epoch[e] else "-" for k in keys)]
            for e in sorted(by_epoch)]
    t = r.data.tags
    head = (f"run {name} ({t.get('dlc.job', '-')} of {t.get('dlc.owner', '-')}, "
            f"commit {t.get('dlc.commit', '-')[:12]}, "
            f"{t.get('dlc.launcher', '-')} x{t.get('dlc.world_size', '-')}, {r.info.status.lower()}, "
            f"restarts {t.get('dlc.restarts', '-')}, model sha256 {t.get('dlc.model_sha256', '-')[:12]})\n"
            f"page: {tracking.run_page(url, r.info.experiment_id, r.info.run_id)}\n")
    return head + table(rows, ["epoch", *keys]) if rows else head + "no epoch logged yet"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="make runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="", help="one run's metrics per epoch (its --name)")
    p.add_argument("--last", type=int, default=20, help="how many of the last runs (default 20)")
    p.add_argument("--tracking", default="auto", help="the tracking server's URL (default: the cluster's)")
    a = p.parse_args(argv)
    url, mlflow = connect(a.tracking)
    try:
        text = one_run(url, mlflow, a.run) if a.run else last_runs(url, mlflow, a.last)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot read the run history at {url}: {tracking.why(e)}") from None
    print(text)


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]), "runs")
