"""Run history: every run's flags, per-epoch metrics, tags and published model in the cluster's
MLflow tracking server, from the harness (no job file logs anything itself).

Where the server is: `--tracking URL|off`; by default ("auto") DLC_TRACKING_URL, which the
cluster's nodes give every Ray process (job drivers and workers inherit it; `off` there turns
it off), else the current cluster record's `tracking_url` (a plain launcher on the client), else
off. The credentials
(MLflow's basic auth) come the same way: the file DLC_TRACKING_AUTH names, else the record's
`tracking_auth_path`; one line `user:password`, mode 0600, never in the run's upload or its log.

What rank 0 logs (and only rank 0):
- at the start (`start`: Ray's job driver, or rank 0 of a plain launcher): the experiment named
  for the job, the run named `--name` (a resumed run, same name, continues its MLflow run), the
  flags as params, and tags: job, commit, uploaded package, cluster, launcher, world size;
- after each epoch's checkpoint (`log_epoch`): the loss, validation metrics, samples/s and phase
  seconds at step = epoch;
- at publishing (`check`, then `log_model`): the ONNX model and its manifest as artifacts under
  `model/<publication>/` (a resumed run's each publication its own), a version of the registered
  model named for the job (tag `model_sha256`), the
  restarts, and the run ended.

Tracking never costs training: every call has a short timeout and no retries. A server that is
down or refuses the credentials at the start is one warning line and the run is untracked; a
failure later stops the logging with one line. The manifest's `tracking` says which, and why,
from what the server holds when the run publishes: every trained epoch has its point, or the run
is untracked.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .contract import Target, run_page  # noqa: F401 - run_page: a run's page, as runs.py and the tests ask tracking for it
from .progress import COUNTERS, say

if TYPE_CHECKING:
    from .contract import C, Job, Run, W
    from .flags import RunFlags
    from .onnx_export import Published

URL_ENV, AUTH_ENV = "DLC_TRACKING_URL", "DLC_TRACKING_AUTH"
# The server as the operator's browser reaches it (the tunnel's end on the operator's machine),
# where DLC_TRACKING_URL is its address on the cluster's network: the links a run prints
PAGE_ENV = "DLC_TRACKING_PAGE_URL"
TIMEOUT_S = 5
ARTIFACTS = "model"  # the run's artifact folder for its publications (ONNX model and manifest)
# the harness's own numbers an epoch logs beside the job's metrics (the rest of COUNTERS are text
# or counts of no interest)
LOGGED_COUNTERS = ("epoch", "samples_per_s", "dataflow_s", "processing_s", "allreduce_s", "validation_s",
                   "epoch_s", "world_size", "gpu_memory_peak_mb")


def page_url(url: str, how: str) -> str | None:
    """Where the operator's browser reaches the server at `url`: PAGE_ENV (set on every node by
    cluster-up, or by make submit from the submitting operator's record) when `url` is the nodes'
    (DLC_TRACKING_URL); None (the url itself) when a flag or this machine's record gave it."""
    page = os.environ.get(PAGE_ENV, "").strip().rstrip("/")
    return page if how == URL_ENV and page.startswith(("http://", "https://")) else None


def setting(flag: str | None) -> tuple[str | None, str]:
    """(the server's URL or None, how it was found or why there is none)."""
    if flag == "off":
        return None, "--tracking off"
    if flag and flag != "auto":
        return flag.rstrip("/"), "--tracking"
    if os.environ.get(URL_ENV) == "off":  # everything started from this environment
        return None, f"{URL_ENV}=off"
    from .flags import tracking

    url, how = os.environ.get(URL_ENV), URL_ENV
    if not url:
        rec = _record()
        url, how = (rec.tracking_url, f"cluster {rec.name}'s record") if rec is not None else (None, "")
    if not url:
        return None, "no tracking server: none in the environment or the cluster record"
    try:  # the flag's own check: a URL with credentials in it is refused, never echoed
        return tracking(url).rstrip("/"), how
    except argparse.ArgumentTypeError as e:
        return None, f"{how} {e}" if how == URL_ENV else f"{how}: {e}"


class _Current(NamedTuple):
    name: str
    tracking_url: str | None
    tracking_auth_path: str | None


def _record() -> _Current | None:
    """What the harness takes from the operator's current cluster record (a plain launcher on the
    client): read as data, `$DLC_CONFIG/cluster.json`, whose model and checks are the operator's
    (dlcluster/record.py, which wrote it); None where there is none or it is not a record."""
    from .flags import config_dir

    path = config_dir() / "cluster.json"
    try:
        data = json.loads(path.read_text())
        found = _Current(data["name"], data.get("tracking_url"), data.get("tracking_auth_path"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    ok = isinstance(found.name, str) and all(v is None or isinstance(v, str) for v in found[1:])
    return found if ok else None


def credentials() -> tuple[str, str] | None:
    """(user, password) from DLC_TRACKING_AUTH's file or the record's; None where there are none."""
    where = os.environ.get(AUTH_ENV)
    if not where:
        rec = _record()
        where = rec.tracking_auth_path if rec is not None else None
    if not where:
        return None
    try:
        user, _, password = Path(where).read_text().strip().partition(":")
    except OSError:
        return None
    return (user, password) if user and password else None


@functools.cache
def client(url: str) -> Any:
    """An MLflow client for `url`: no retries, a short timeout, this process's credentials."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"  # the harness says where, once
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(TIMEOUT_S)
    found = credentials()
    if found is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = found
    logging.getLogger("mlflow").setLevel(logging.ERROR)  # its own retry and deprecation notices
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=url, registry_uri=url)


# HTTP statuses MLflow's client reports by name (mlflow.exceptions.get_error_code)
STATUS_OF_ERROR_CODE = {"UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403}


def why(e: Exception) -> str:
    """An MLflow or HTTP error in one short line. A request that got no answer is named first: its
    message carries the request's URL, and a run id in it may hold any digits (one with "401" in
    it was once read as a refused sign-in)."""
    text = " ".join(str(e).split())
    if re.search(r"NewConnectionError|Connection refused|Failed to establish a new connection", text):
        return "the server is not reachable (connection refused)"
    if re.search(r"timed out|ReadTimeout|ConnectTimeout", text, re.IGNORECASE):
        return f"the server did not answer within {TIMEOUT_S} s"
    status = STATUS_OF_ERROR_CODE.get(str(getattr(e, "error_code", "")))
    answered = re.search(r"error code (\d{3})\b|\b(\d{3}) (?:Unauthorized|Forbidden)\b", text)
    if status is None and answered:
        status = int(answered.group(1) or answered.group(2))
    if status == 401:
        return "the server refused the credentials (401)"
    if status == 403:
        return "the server refused this user (403)"
    if "Max retries" in text:  # another failure of the connection itself
        return "the server is not reachable (connection refused)"
    return text[:200]


# ------------------------------------------------------------------ the start
def start(job: Job[W, C], settings: RunFlags, own: dict[str, str], run: Run, world_size: int | str,
          cluster: str | None = None) -> Run:
    """The run's MLflow run made (or found again, for a resumed --name) with its params and tags;
    `run` with its Target, or as it was (one warning line) where tracking is off or fails."""
    from dataclasses import replace

    url, how = setting(settings.tracking)
    if url is None:
        if how.startswith(f"{URL_ENV} "):  # set, and refused
            say(job.name, f"warning: run {run.name} is not tracked: {how}")
        return replace(run, tracking_off=how)
    try:
        params = dict(sorted({**own, **settings.params()}.items()))  # every flag, the job's own too
        target = _start(url, job, params, run, world_size, cluster, page_url(url, how))
    except Exception as e:  # noqa: BLE001  (tracking never costs the run)
        reason = why(e)
        say(job.name, f"warning: run {run.name} is not tracked: {url}: {reason}; it trains and "
                      f"publishes as before (its manifest says so)")
        return replace(run, tracking_off=f"{url}: {reason}")
    say(job.name, f"run history: {target.pages()}")
    return replace(run, tracking=target)


def _start(url: str, job: Job[W, C], params: dict[str, str], run: Run, world_size: int | str,
           cluster: str | None, page: str | None = None) -> Target:
    from mlflow.entities import Param, RunTag

    mlflow = client(url)
    experiment = mlflow.get_experiment_by_name(job.name)
    experiment_id = experiment.experiment_id if experiment else mlflow.create_experiment(job.name)
    found = mlflow.search_runs([experiment_id], f"attributes.run_name = '{run.name}'", max_results=1)
    if found:
        mlrun = found[0]
        mlflow.update_run(mlrun.info.run_id, status="RUNNING")
    else:
        mlrun = mlflow.create_run(experiment_id, run_name=run.name)
    had = mlrun.data.params
    changed = [f"{k} {had[k]} -> {v}" for k, v in params.items() if k in had and had[k] != v]
    tags = {"dlc.job": job.name, "dlc.run": run.name, "dlc.launcher": run.launcher,
            "dlc.world_size": str(world_size), "dlc.cluster": cluster or _cluster_name(),
            "dlc.commit": _commit(), "mlflow.source.git.commit": _commit().removesuffix("-dirty"),
            "dlc.package": _package()}
    for field in ("owner", "team"):  # whose run: the gateway sets them from the submitter's credential
        if value := os.environ.get(f"DLC_JOB_{field.upper()}"):
            tags[f"dlc.{field}"] = value
    if found:
        tags["dlc.resumed"] = str(int(mlrun.data.tags.get("dlc.resumed", "0")) + 1)
    if changed:  # params cannot change in MLflow: a resumed run with other flags says so
        tags["dlc.changed_flags"] = "; ".join(changed)[:5000]
    mlflow.log_batch(mlrun.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()],
                     params=[Param(k, v[:6000]) for k, v in params.items() if k not in had])
    return Target(url, experiment_id, mlrun.info.run_id, page)


def _commit() -> str:
    from .onnx_export import git_commit

    return git_commit()


def _package() -> str:
    """The package the run's code came in: Ray's working_dir URI of the job, else 'checkout'."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().runtime_env.get("working_dir") or "checkout"
    except Exception:  # noqa: BLE001
        pass
    return "checkout"


def _cluster_name() -> str:
    """DLC_CLUSTER_NAME on a cluster's nodes, else the current record's name."""
    rec = None if os.environ.get("DLC_CLUSTER_NAME") else _record()
    return os.environ.get("DLC_CLUSTER_NAME") or (rec.name if rec is not None else "none")


@contextlib.contextmanager
def ended_if_failed(run: Run) -> Iterator[None]:
    """Training and publishing inside: where they raise, the MLflow run is ended FAILED (KILLED
    for an interrupt), not left RUNNING."""
    try:
        yield
    except BaseException as e:
        if run.tracking is not None:
            status = "KILLED" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "FAILED"
            with contextlib.suppress(Exception):
                client(run.tracking.url).set_terminated(run.tracking.run_id, status)
        raise


# ------------------------------------------------------------------ every epoch
_stopped: dict[str, str] = {}  # run id -> why its logging stopped (the first reason) in this process
_seconds: dict[str, float] = {}  # run id -> how long its last epoch's logging took here


def log_epoch(job: str, run: Run, metrics: dict) -> None:
    """Rank 0, after an epoch's checkpoint: its metrics at step = epoch (one request), and
    `tracking_s`, the seconds the previous epoch's request took (make bench compares it with the
    epoch's)."""
    target = run.tracking
    if target is None or target.run_id in _stopped:
        return
    from mlflow.entities import Metric

    t0 = time.perf_counter()
    at = int(time.time() * 1000)
    step = int(metrics["epoch"])
    values = [Metric(k, float(v), at, step) for k, v in metrics.items()
              if (k not in COUNTERS or k in LOGGED_COUNTERS) and isinstance(v, (int, float))
              and not isinstance(v, bool)]
    if target.run_id in _seconds:
        values.append(Metric("tracking_s", _seconds[target.run_id], at, step))
    try:
        client(target.url).log_batch(target.run_id, metrics=values)
    except Exception as e:  # noqa: BLE001  (tracking never costs the run)
        stopped(run, f"logging stopped at epoch {step}: {why(e)}")
        say(job, f"warning: run {run.name}: epoch {step} not tracked ({why(e)}); logging stops, "
                 "the run trains on")
    _seconds[target.run_id] = time.perf_counter() - t0


def stopped(run: Run, reason: str) -> None:
    """The run's logging stopped for `reason`; the first reason is kept, here and, on Ray, in the
    run's Attempts actor, whose reasons the driver hands back (`stopped_on_workers`) before it
    publishes: the manifest names the cause, not what the server answered later."""
    if run.tracking is not None:
        _stopped.setdefault(run.tracking.run_id, reason)
    if run.attempts is not None:
        with contextlib.suppress(Exception):
            run.attempts.tracking_stopped.remote(reason)


def stopped_on_workers(run: Run, reasons: list[str]) -> None:
    """The driver: the reasons its workers' logging stopped for (the Attempts actor's), first first."""
    if run.tracking is not None and reasons:
        _stopped.setdefault(run.tracking.run_id, reasons[0])


# ------------------------------------------------------------------ publishing
def check(run: Run, epochs_trained: int) -> dict:
    """The manifest's `tracking`: what the server holds of this run, asked before publishing; where
    the logging stopped on the way, untracked and the first reason it stopped for."""
    target = run.tracking
    if target is None:
        return {"state": "off" if run.tracking_off.startswith(("--tracking off", "no tracking", URL_ENV))
                else "untracked", "why": run.tracking_off}
    record = {"url": target.url, "run_id": target.run_id, **target.manifest()}
    if target.run_id in _stopped:
        return {**record, "state": "untracked", "why": f"{target.url}: {_stopped[target.run_id]}"}
    try:
        mlflow = client(target.url)
        names = mlflow.get_run(target.run_id).data.metrics
        key = "samples_per_s" if "samples_per_s" in names else next(iter(names), None)
        steps = {m.step for m in mlflow.get_metric_history(target.run_id, key)} if key else set()
    except Exception as e:  # noqa: BLE001
        return {**record, "state": "untracked", "why": f"{target.url}: {why(e)}"}
    missing = sorted(set(range(1, epochs_trained + 1)) - steps)
    if missing:
        return {**record, "state": "untracked",
                "why": f"epoch(s) {', '.join(map(str, missing))} of {epochs_trained} were not logged"}
    return {**record, "state": "tracked", "epochs_logged": epochs_trained}


def log_model(job: str, run: Run, published: Published, restarts: int) -> str | None:
    """The published model and manifest as the run's artifacts, a registered model version named
    for the job, the run ended: the version ("name/N"), or None (one warning line) on failure."""
    target = run.tracking
    if target is None or published.manifest.get("tracking", {}).get("state") != "tracked":
        return None
    sha = published.manifest["model_sha256"]
    try:
        mlflow = client(target.url)
        for path in (published.model, published.manifest_path):
            mlflow.log_artifact(target.run_id, str(path), f"{ARTIFACTS}/{published.model.parent.name}")
        mlflow.set_tag(target.run_id, "dlc.restarts", str(restarts))
        mlflow.set_tag(target.run_id, "dlc.model_sha256", sha)
        from mlflow.exceptions import MlflowException

        try:
            mlflow.create_registered_model(job)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = mlflow.create_model_version(
            job, f"runs:/{target.run_id}/{ARTIFACTS}/{published.model.parent.name}", run_id=target.run_id,
            tags={"model_sha256": sha, "run": run.name})
        mlflow.set_terminated(target.run_id, "FINISHED")
    except Exception as e:  # noqa: BLE001
        say(job, f"warning: run {run.name}: the model was published but not logged to {target.url} "
                 f"({why(e)})")
        return None
    say(job, f"registered model: {job} version {version.version} (run history: {target.pages()})")
    return f"{job}/{version.version}"

