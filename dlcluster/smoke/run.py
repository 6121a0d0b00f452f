"""Multi-node smoke tests against any running cluster, read from its cluster record.

    dlcluster smoke [--config FILE] [--only nodes,allreduce,trainers,proxyjump]   (make smoke)
                    [--sizes 1,4,16,64,256 | --max-mib N] [--json PATH]

Steps, in this order (each with a time limit, a progress line, and a result in the report):

  nodes      every node joined with the CPUs and GPUs the cluster record lists, its dashboard
             agent registered, and a task pinned to it runs
  allreduce  Ray Train's TorchTrainer (Train V2), one worker per node (STRICT_SPREAD; a node with
             no CPU is left out), gloo on CPU, NCCL when every such node has a GPU: all-reduce of
             1-256 MiB float32, every element checked, time per op, algbw and busbw as
             nccl-tests defines them
  perf       (servers from an inventory, with a baseline) each node's step time on a fixed batch
             and its shared storage's throughput, each pair's link (iperf3 through the bastion),
             the allreduce step's bus bandwidth, against the cluster's baseline
             (dlcluster/baseline.py): one line per figure past its threshold, a table, a plot;
             --record-baseline records one instead (make baseline: allreduce and perf only)
  trainers   jobs/ddp_autoencoder.py, jobs/horovod_mnist.py, jobs/tf_cnn.py and jobs/finetune_lm.py
             (its model sharded over the nodes; --trainers: some of them), one tiny epoch with one
             worker per node; each must succeed and leave an ONNX
             model that a check job on the cluster loads in onnxruntime, runs on zeros and checks
             against its manifest
  proxyjump  (only with ssh_config and bastion) every node with an ip refuses a direct TCP
             connection to port 22 from here, and `ssh -F ssh_config NODE hostname` gets through
             the bastion

The steps are a pytest suite, dlcluster/smoke/suite/test_steps.py, which this script runs (pytest.main)
after checking its input; dlcluster/smoke/report.py is the plugin that prints the lines below and
writes the report. Everything but proxyjump runs as a Ray job submitted over HTTP to the cluster
record's job_api (ray.job_submission.JobSubmissionClient, token auth), with this repository as
the working dir; the job side is ray/smoke_checks.py, which prints one `SMOKE_JSON {...}` line
read back from the job's logs. The client never joins the cluster (no ray.init), so its Python
may differ from the nodes' in the patch release.

Writes a JSON report (default $DLC_CONFIG/smoke/<name>-<UTC time>.json) and prints one line per
step. Exit status: 0 when every step that ran passed, 1 when one failed, 2 when the cluster record
is missing or bad, or nothing answers on its job API (one line saying what to do, before any step
runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from dlcluster import baseline, record
from dlcluster.smoke.lib import (
    CONTEXT,
    DEFAULT_SIZES_MIB,
    HARD_STOP_AFTER,
    PROG,
    STEPS,
    TIMEOUTS,
    TRAINERS,
    Context,
    Jobs,
    check_job_api,
    check_token,
    log,
    snapshot,
)
from dlcluster.smoke.report import SmokeReport
from trainkit.errors import EXIT_USER_ERROR, UserError
from trainkit.smoke_protocol import MIB

REPO = Path(__file__).resolve().parents[2]
SUITE = Path(__file__).parent / "suite"  # the steps, a pytest suite (the job side: ray/smoke_checks.py)
# pytest's own output is silenced (the plugin prints the steps' lines), its capture off (the
# progress lines appear as they happen), and no ini file nor cache: the suite has no settings
# but these, whatever the checkout's pyproject.toml sets for tests/.
PYTEST_ARGS = ["-qq", "--no-header", "--no-summary", "-s", "-p", "no:cacheprovider",
               "-c", os.devnull, "--rootdir", str(SUITE)]


def load_record(path: Path) -> record.ClusterRecord:
    """The cluster record (dlcluster/record.py); a missing or bad one is a one-line UserError."""
    return record.load(path)


def sizes_bytes(args: argparse.Namespace) -> list[int]:
    sizes = [int(float(s) * MIB) // 4 * 4 for s in args.sizes.split(",") if s.strip()]
    return sorted({s for s in sizes if s > 0 and (args.max_mib is None or s <= args.max_mib * MIB)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="The cluster record's fields: python -m dlcluster.record schema",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="the cluster record (default: $DLC_CONFIG/cluster.json)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated steps to run, of {','.join(STEPS)} (default: all; with "
                        "--record-baseline: allreduce,perf)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES_MIB)),
                   help="all-reduce message sizes in MiB (float32), comma-separated")
    p.add_argument("--max-mib", type=float, default=None, help="leave out sizes above this")
    p.add_argument("--json", default=None,
                   help="report path (default: $DLC_CONFIG/smoke/<name>-<UTC time>.json)")
    p.add_argument("--storage-path", default=None,
                   help="--storage-path for the cluster's jobs (default: theirs, $DLC_STORAGE_PATH "
                        "or ~/dlcluster/runs on the nodes)")
    p.add_argument("--models-dir", default=None,
                   help="parent of the trainers' --output (default: theirs, $DLC_MODELS on the nodes)")
    p.add_argument("--clean", action="store_true",
                   help="remove the trainers' models and runs (smoke-* folders) once verified")
    p.add_argument("--timeout-factor", type=float, default=1.0,
                   help="multiply every step's time limit ("
                        + ", ".join(f"{k} {v} s" for k, v in TIMEOUTS.items()) + ")")
    p.add_argument("--record-baseline", action="store_true",
                   help="record this measurement as the cluster's performance baseline (make baseline); "
                        "only with no job running")
    p.add_argument("--nodes", default=None,
                   help="perf: measure and compare only these nodes (comma-separated names of the "
                        "cluster record), and the links between them (make upgrade: the node it upgraded)")
    p.add_argument("--trainers", default=",".join(TRAINERS),
                   help=f"trainers: comma-separated jobs to train, of {','.join(TRAINERS)} (default: all)")
    p.add_argument("--quarantine", action="store_true",
                   help="take each node the perf step names out of Ray, as make doctor QUARANTINE=1")
    for name, f in baseline.Thresholds.model_fields.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=f.default,
                       help=f"perf: {f.description} [{f.default}]")
    a = p.parse_args(argv)
    if a.only is None:
        a.only = "allreduce,perf" if a.record_baseline else ",".join(STEPS)
    a.steps = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in a.steps if s not in STEPS]
    if unknown or not a.steps:
        raise UserError(f"--only {a.only!r}: unknown step(s) {', '.join(unknown) or '(none given)'}; "
                        f"use some of {','.join(STEPS)}")
    try:
        a.sizes_bytes = sizes_bytes(a)
    except ValueError:
        raise UserError(f"--sizes {a.sizes!r} must be numbers of MiB, e.g. 1,4,16") from None
    if not a.sizes_bytes:
        raise UserError(f"no all-reduce size left from --sizes {a.sizes} with --max-mib {a.max_mib:g}; "
                        f"raise --max-mib")
    if a.timeout_factor <= 0:
        raise UserError(f"--timeout-factor {a.timeout_factor} must be above 0")
    try:
        a.thresholds = baseline.Thresholds(**{k: getattr(a, k) for k in baseline.Thresholds.model_fields})
    except ValidationError as e:
        raise UserError("bad threshold: " + record.problems(e)) from None
    a.trainers = [t.strip() for t in a.trainers.split(",") if t.strip()]
    unknown = [t for t in a.trainers if t not in TRAINERS]
    if unknown or not a.trainers:
        raise UserError(f"--trainers {','.join(a.trainers) or repr('')}: unknown job(s) "
                        f"{', '.join(unknown) or '(none given)'}; use some of {','.join(TRAINERS)}")
    a.trainers = [t for t in TRAINERS if t in a.trainers]  # the report's order, each once
    a.nodes = [n.strip() for n in a.nodes.split(",") if n.strip()] if a.nodes is not None else None
    if a.nodes is not None and not a.nodes:
        raise UserError("--nodes is empty: name one or more nodes of the cluster record, e.g. --nodes node-2")
    if a.record_baseline and a.nodes:
        raise UserError(f"--record-baseline with --nodes {','.join(a.nodes)}: a baseline measures every "
                        "node and link; leave --nodes out")
    if a.record_baseline and "perf" not in a.steps:
        raise UserError(f"--record-baseline with --only {a.only}: the baseline is the perf step's; "
                        "list perf (and allreduce) in --only, or leave --only out")
    return a


def report_path(a: argparse.Namespace, rec: record.ClusterRecord, started: dt.datetime) -> Path:
    if a.json:
        return Path(a.json).expanduser()
    return (record.config_dir() / "smoke" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', rec.name)}-"
                                            f"{started.strftime('%Y%m%dT%H%M%SZ')}.json")


def refuse_busy(jobs: Jobs) -> None:
    """A baseline is measured on an idle cluster: a running job would slow what it measures."""
    try:
        busy = [j.submission_id or j.job_id for j in jobs.client.list_jobs()
                if str(j.status).rsplit(".", 1)[-1] in ("PENDING", "RUNNING")]
    except Exception as e:
        raise UserError(f"cannot ask the job API which jobs run ({e}); nothing was recorded") from None
    if busy:
        raise UserError(f"job(s) {', '.join(busy)} running: a baseline measured now would be slowed "
                        "by them; make baseline once they have ended (ray job list); nothing was recorded")


def run_suite(ctx: Context, plugin: SmokeReport, suite: Path = SUITE / "test_steps.py") -> int:
    """pytest.main on the suite with `ctx` in its config's stash; pytest's exit code."""

    class Handover:
        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(self, config: pytest.Config) -> None:
            config.stash[CONTEXT] = ctx

    return int(pytest.main([*PYTEST_ARGS, str(suite)], plugins=[Handover(), plugin]))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):  # an outer pytest's (the test tiers') settings
        os.environ.pop(var, None)
    config = Path(a.config).expanduser() if a.config else record.config_dir() / "cluster.json"
    rec = load_record(config)
    check_token(rec, config)
    unknown = sorted(set(a.nodes or []) - {n.name for n in rec.nodes})
    if unknown:
        raise UserError(f"--nodes: no node {', '.join(unknown)} in cluster {rec.name}; its nodes: "
                        f"{', '.join(n.name for n in rec.nodes)}")
    os.environ.update(rec.client_env())
    started, t0 = dt.datetime.now(dt.UTC), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dlc-smoke-") as tmp:
        jobs = None
        if any(s != "proxyjump" for s in a.steps):
            check_job_api(rec.job_api)
            jobs = Jobs(rec.job_api, snapshot(REPO, Path(tmp) / "dlcluster"))
            if a.record_baseline:
                refuse_busy(jobs)
        log(f"cluster {rec.name} ({rec.kind}, {len(rec.nodes)} node(s)) at "
            f"{rec.job_api}; steps: {', '.join(s for s in STEPS if s in a.steps)}")
        a.report = report_path(a, rec, started)
        plugin = SmokeReport(rec, config, a.report, steps=a.steps,
                             limits={k: v * a.timeout_factor for k, v in TIMEOUTS.items()},
                             hard_after=HARD_STOP_AFTER, started=started, t0=t0)
        code = run_suite(Context(rec, a, jobs), plugin)
    if plugin.interrupted:
        raise KeyboardInterrupt
    if plugin.report is None:
        print(f"{PROG}: error: pytest ended with exit code {code} before the report "
              f"(its messages are above)", file=sys.stderr, flush=True)
        return 1
    if not plugin.printed:
        print("\n".join(plugin.summary_lines()), flush=True)
    return 0 if plugin.report["ok"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        sys.exit(130)
