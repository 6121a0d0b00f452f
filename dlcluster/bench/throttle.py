"""Cut one training worker's CPU share while its run trains (make bench's slowed worker).

Submitted as a Ray job beside the run (so it reaches any cluster through its job API): it finds
the worker among the cluster's live actors (a Ray Train worker, or a parameter-server run's
worker 1), then a task on that worker's node stops and continues the process in turn (SIGSTOP,
SIGCONT every --period seconds, as cpulimit does) so that it runs --share of the time, until the
worker ends. The process is always left running.

    python dlcluster/bench/throttle.py --class-name RayTrainWorker --share 0.5
    python dlcluster/bench/throttle.py --class-name Role --repr "worker 1" --share 0.5
"""

from __future__ import annotations

import argparse
import os
import signal
import time


def throttle(pid: int, share: float, period: float) -> float:
    """Until `pid` ends: the seconds it was held stopped."""
    held = 0.0
    try:
        while True:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(period * (1 - share))
            held += period * (1 - share)
            os.kill(pid, signal.SIGCONT)
            time.sleep(period * share)
    except ProcessLookupError:
        return held
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def find(class_name: str, repr_name: str | None, timeout: float):
    """The live actor to slow: (pid, node id); the newest of its class, or the one of that repr."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [a for a in list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
                                        detail=True)
                 if a.pid and (repr_name is None or a.repr_name == repr_name)]
        if found:
            newest = max(found, key=lambda a: a.pid)
            return newest.pid, newest.node_id
        time.sleep(1)
    raise SystemExit(f"throttle: no live {class_name} {repr_name or ''} actor within {timeout:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--class-name", required=True, help="the worker actor's class")
    p.add_argument("--repr", default=None, help="the worker actor's repr, where its class has several")
    p.add_argument("--share", type=float, default=0.5, help="the share of the time it may run")
    p.add_argument("--period", type=float, default=0.1, help="seconds of one stop + run cycle")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the worker")
    a = p.parse_args()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    ray.init()
    pid, node = find(a.class_name, a.repr, a.timeout)
    print(f"[throttle] {a.class_name} {a.repr or ''} pid {pid}: running {a.share:.0%} of the time",
          flush=True)
    task = ray.remote(num_cpus=0)(throttle).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    held = ray.get(task.remote(pid, a.share, a.period))
    print(f"[throttle] pid {pid} ended; held stopped {held:.1f} s in all", flush=True)


if __name__ == "__main__":
    main()
