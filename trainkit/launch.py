"""Which launcher started this process, so one job file runs unchanged under each of them.

Like PyTorch-Ignite's `idist`, the choice is read from the environment the launcher leaves:

| launcher   | found by                                   | who runs the training                  |
|------------|--------------------------------------------|----------------------------------------|
| ray        | a Ray job's driver (`ray job submit`) or   | Ray Train workers on the cluster; this |
|            | RAY_ADDRESS naming a GCS (host:port/auto)  | process is the driver and publishes    |
| torchrun   | torchrun's RANK, WORLD_SIZE, LOCAL_RANK    | this process is one DDP rank           |
| horovodrun | horovodrun's HOROVOD_RANK, HOROVOD_SIZE    | this process is one Horovod rank       |
| tf_config  | TF_CONFIG (MultiWorkerMirroredStrategy)    | this process is one TF worker          |
| local      | none of the above                          | this one process                       |

`--launcher` forces one (`--launcher ray` with no cluster starts a throwaway local Ray).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from .errors import UserError

RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for every job driver


def detect(given: Mapping[str, str] | None = None) -> str:
    env = os.environ if given is None else given
    if "HOROVOD_RANK" in env:
        return "horovodrun"
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= env.keys():
        return "torchrun"
    if env.get("TF_CONFIG"):
        return "tf_config"
    address = env.get("RAY_ADDRESS", "")
    if RAY_JOB_ENV in env or (address and not address.startswith(("http://", "https://"))):
        return "ray"
    return "local"


def choose(flag: str, allowed: tuple[str, ...], job: str, env: Mapping[str, str] | None = None) -> str:
    """The launcher to use: --launcher, or what the environment shows; one a job cannot run under
    is a one-line error."""
    found = detect(env) if flag == "auto" else flag
    if found not in allowed:
        how = "forced by --launcher" if flag != "auto" else "found in the environment"
        raise UserError(f"{job} cannot run under {found} ({how}); it runs under "
                        f"{', '.join(allowed)}; use --launcher with one of those")
    return found


def world_from_env(launcher: str, given: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) a plain launcher gave this process."""
    env = os.environ if given is None else given
    try:
        if launcher == "torchrun":
            return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        if launcher == "horovodrun":
            return (int(env["HOROVOD_RANK"]), int(env["HOROVOD_SIZE"]),
                    int(env.get("HOROVOD_LOCAL_RANK", 0)))
        if launcher == "tf_config":
            spec = json.loads(env["TF_CONFIG"])
            task, cluster = spec["task"], spec["cluster"]
            roles = [r for r in ("chief", "worker") if r in cluster]
            order = [(r, i) for r in roles for i in range(len(cluster[r]))]
            return order.index((task["type"], int(task["index"]))), len(order), 0
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise UserError(f"{launcher}'s environment is incomplete or malformed ({e!r}); start the "
                        f"job with {launcher} itself, or pass --launcher local") from None
    return 0, 1, 0


def loopback_addresses(n: int) -> list[str]:
    """`n` distinct free ports on 127.0.0.1 as host:port (all held open at once while picked, so
    none is handed out twice)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    hosts = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    return hosts


def local_tf_configs(workers: int) -> list[str]:
    """A TF_CONFIG for each of `workers` processes on this machine (free loopback ports): what
    MultiWorkerMirroredStrategy needs to train across them without Ray."""
    hosts = loopback_addresses(workers)
    return [json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": i}})
            for i in range(workers)]
