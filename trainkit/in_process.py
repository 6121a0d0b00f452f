"""The plain launchers: torchrun, horovodrun, TF_CONFIG, or none (`local`). This process is one
rank of the run (or the only one) and trains itself; rank 0 then publishes. (`launch` finds which
launcher started the process; this module is what happens under each but Ray.)"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from . import cluster, flags, tracking
from .contract import C, Job, Run, Timeline, W
from .onnx_export import Published
from .progress import say
from .publish import publish
from .store import hold_run


def train_in_process(job: Job[W, C], settings: flags.RunFlags, prepare: Callable[[], C], launcher: str,
                     own: dict[str, str]) -> Published | None:
    """This process is one rank of a plain launcher (or the only one): train, then rank 0 publishes.
    `prepare`: the job's config from its own flags (`own`: them as the run history records them)."""
    world = job.world(launcher, settings.use_gpu)
    published = _train_then_publish(job, settings, prepare, launcher, own, world)
    # Every rank leaves together, after rank 0 has published (a rank that tore its group down
    # while rank 0 was still exporting could abort). A failed rank skips this: it raises at once
    # and the launcher stops the others, where a barrier could only hang.
    world.shutdown()
    return published


def _train_then_publish(job: Job[W, C], settings: flags.RunFlags, prepare: Callable[[], C], launcher: str,
                        own: dict[str, str], world: W) -> Published | None:
    # one name on every rank
    settings = settings.resolved(job.name, world.agree(settings.name or flags.default_name(job.name)))
    config = prepare()
    cluster.check_batch(settings.batch_size, job.train_size(config), world.size)
    timeline = Timeline()
    run = Run.from_flags(job, settings, launcher, world.use_gpu, timeline=timeline)
    timeline.mark_prepared()
    if world.rank == 0:
        who = world.describe() if hasattr(world, "describe") else f"{world.size} process(es)"
        say(job.name, f"run {run.name} under {launcher}: {job.describe(config)}; {who} "
                      f"on {world.device_kind}, batch {run.batch_size} per process, "
                      f"{run.epochs} epoch(s); storage {run.storage_path}")
    # rank 0 holds the run's folder: a second run of this --name is one line (its ranks then stop)
    with hold_run(run.storage_path, run.name) if world.rank == 0 else contextlib.nullcontext():
        if world.rank == 0:
            run = tracking.start(job, settings, own, run, world.size)
        with tracking.ended_if_failed(run):
            job.fit(run, config, world)
            if world.rank != 0:
                return None
            store = job.store(run, config, world)
            with store.latest() as last:
                if last is None:
                    raise RuntimeError(f"run {run.name} finished without a checkpoint")
                # torchrun restarts its processes itself (--max-restarts) and says how often
                count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
                return publish(job, run, config, last.folder, last.where, {"count": count}, timeline)
