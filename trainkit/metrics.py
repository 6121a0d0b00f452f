"""Training metrics as Prometheus series, through Ray's metrics API.

After each epoch rank 0 of a run on Ray hands its metrics to the run's `Attempts` actor
(trainkit.on_ray), which lives on the driver's node from the run's start to the driver's end: it
sets the gauges, Ray's metrics agent on that node exports them (port `ray_metrics_export_port`,
8080 on an Ansible cluster) and the head's Prometheus scrapes them. One process holds a run's
series whatever its workers do (a restart makes no second series), and before it ends the driver
waits until the agent exports the last epoch (`hold_until_exported`): Ray reports a process's
gauges to its agent every 10 s and drops them when the process is gone, so a short run would
otherwise end before its last epoch, or any, reached Prometheus. Ray prefixes each name with
`ray_`; every series carries the run's name and its job's (as `dlc_job`: Prometheus' own `job`
label names the scrape job):

    ray_dlc_train_samples_per_second{run, dlc_job}          the epoch's training samples/s
    ray_dlc_train_first_epoch_samples_per_second{...}       the same for this start's first epoch
    ray_dlc_train_phase_seconds{run, dlc_job, phase}        dataflow, processing, allreduce, validation, epoch
    ray_dlc_train_value{run, dlc_job, metric}               loss, val_loss, accuracy, ...
    ray_dlc_train_epoch{run, dlc_job}                       the last epoch done
    ray_dlc_train_starts{run, dlc_job}                      starts of the workers so far (1 + restarts)

Outside Ray (torchrun, horovodrun, TF_CONFIG, one process) nothing is exported: there is no
agent to export it. A metric that cannot be set never stops training.
"""

from __future__ import annotations

import logging
import re
import time
import urllib.request

from .progress import COUNTERS

PHASES = ("dataflow_s", "processing_s", "allreduce_s", "validation_s", "epoch_s")
log = logging.getLogger(__name__)


class _Gauges:
    def __init__(self):
        from ray.util.metrics import Gauge

        run = ("run", "dlc_job")
        self.samples = Gauge("dlc_train_samples_per_second", "training samples/s of the last epoch", run)
        self.first = Gauge("dlc_train_first_epoch_samples_per_second",
                           "training samples/s of the first epoch since the workers started", run)
        self.phase = Gauge("dlc_train_phase_seconds", "seconds of the last epoch by phase", (*run, "phase"))
        self.value = Gauge("dlc_train_value", "the job's own metrics of the last epoch", (*run, "metric"))
        self.epoch = Gauge("dlc_train_epoch", "the last epoch done", run)
        self.starts = Gauge("dlc_train_starts", "starts of the run's workers (1 + restarts)", run)


_gauges: _Gauges | None = None
_first_seen: set[tuple[str, int]] = set()


def on_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def set_gauges(job: str, run: str, metrics: dict, starts: int | None = None) -> bool:
    """Set the run's gauges in this process from one epoch's metrics; `starts`: the workers'
    starts so far (the first epoch of each start sets the first-epoch gauge). False where
    nothing was set."""
    global _gauges
    try:
        if _gauges is None:
            _gauges = _Gauges()
        tags = {"run": run, "dlc_job": job}
        g = _gauges
        g.samples.set(float(metrics["samples_per_s"]), tags)
        if (run, starts or 0) not in _first_seen:
            _first_seen.add((run, starts or 0))
            g.first.set(float(metrics["samples_per_s"]), tags)
        for phase in PHASES:
            if phase in metrics:
                g.phase.set(float(metrics[phase]), {**tags, "phase": phase.removesuffix("_s")})
        for name, v in metrics.items():
            if name not in COUNTERS and isinstance(v, (int, float)):
                g.value.set(float(v), {**tags, "metric": name})
        g.epoch.set(float(metrics["epoch"]), tags)
        if starts is not None:
            g.starts.set(float(starts), tags)
        return True
    except Exception as e:  # noqa: BLE001  (metrics must never cost the run)
        log.warning("training metrics not exported: %s", e)
        return False


def export_epoch(job: str, run: str, metrics: dict, attempts=None) -> bool:
    """Rank 0, after an epoch: hand its metrics to `attempts` (the run's Attempts actor, which
    sets the gauges and counts the starts), without waiting; without one, set them in this
    process. False where nothing was exported (outside Ray)."""
    if not on_ray():
        return False
    if attempts is None:
        return set_gauges(job, run, metrics)
    try:
        attempts.export.remote(job, run, metrics)
        return True
    except Exception as e:  # noqa: BLE001
        log.warning("training metrics not exported: %s", e)
        return False


def exported_epoch(text: str, run: str) -> float | None:
    """The run's `ray_dlc_train_epoch` in an agent's Prometheus text, None where absent."""
    for labels, value in re.findall(r"^ray_dlc_train_epoch\{(.*)\} (\S+)$", text, re.M):
        if f'run="{run}"' in labels:
            return float(value)
    return None


def hold_until_exported(run: str, epoch: float, timeout: float = 15.0) -> float | None:
    """The driver, before it ends (and its node's Attempts actor with it): wait until this node's
    Ray metrics agent exports the run's last epoch, so that Prometheus' next scrape finds it (the
    agent keeps a finished process's series about 20 s; Ray reports every 10 s). The seconds
    waited, None where it did not come within `timeout` (said in one line; the run goes on)."""
    if not on_ray():
        return None
    import ray

    t0 = time.monotonic()
    try:
        here = ray.get_runtime_context().get_node_id()
        node = next(n for n in ray.nodes() if n["NodeID"] == here)
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        while True:
            with urllib.request.urlopen(url, timeout=5) as r:
                if exported_epoch(r.read().decode(errors="replace"), run) == epoch:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                break
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001
        log.warning("training metrics: this node's Ray metrics agent not read: %s", e)
        return None
    log.warning("training metrics: epoch %s of run %s not exported within %.0f s", epoch, run, timeout)
    return None
