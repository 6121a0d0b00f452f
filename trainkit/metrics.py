"""Training metrics as Prometheus series, through Ray's metrics API.

Rank 0 of a run on Ray sets, after each epoch, gauges that Ray's metrics agent on its node exports
(port `ray_metrics_export_port`, 8080 on an Ansible cluster) and the head's Prometheus scrapes.
Ray prefixes each name with `ray_`; every series carries the run's name and its job's (as
`dlc_job`: Prometheus' own `job` label names the scrape job):

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
_first_seen: set[str] = set()


def on_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def export_epoch(job: str, run: str, metrics: dict, attempts=None) -> bool:
    """Set the run's gauges from one epoch's metrics (rank 0); `attempts`: the run's Attempts actor
    (trainkit.on_ray), for the number of starts. False where nothing was exported."""
    global _gauges
    if not on_ray():
        return False
    try:
        if _gauges is None:
            _gauges = _Gauges()
        tags = {"run": run, "dlc_job": job}
        g = _gauges
        g.samples.set(float(metrics["samples_per_s"]), tags)
        if run not in _first_seen:
            _first_seen.add(run)
            g.first.set(float(metrics["samples_per_s"]), tags)
        for phase in PHASES:
            if phase in metrics:
                g.phase.set(float(metrics[phase]), {**tags, "phase": phase.removesuffix("_s")})
        for name, v in metrics.items():
            if name not in COUNTERS and isinstance(v, (int, float)):
                g.value.set(float(v), {**tags, "metric": name})
        g.epoch.set(float(metrics["epoch"]), tags)
        if attempts is not None:
            import ray

            g.starts.set(float(len(ray.get(attempts.all.remote(), timeout=10))), tags)
        return True
    except Exception as e:  # noqa: BLE001  (metrics must never cost the run)
        log.warning("training metrics not exported: %s", e)
        return False
