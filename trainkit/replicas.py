"""The check every job makes after each epoch: all ranks hold the same parameters. Each rank
describes itself (`describe_rank`), the world gathers the descriptions, and
`check_replicas_agree` compares them (the manifest records what it returns)."""

from __future__ import annotations

import hashlib
import os
import socket

import numpy as np


def parameter_digest(arrays) -> str:
    """sha256 over a model's parameter arrays: equal on every rank when the replicas agree."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def describe_rank(arrays) -> str:
    """This rank's part of the replica check: its host, how Ray runs there (DLC_RAY_RUNTIME, set by
    the node's dlc-ray service: docker or host; "-" elsewhere) and its parameters' digest."""
    return f"{socket.gethostname()} {os.environ.get('DLC_RAY_RUNTIME') or '-'} {parameter_digest(arrays)}"


def record_shards(described: list[str]) -> dict:
    """Sharded ranks (FSDP) each hold their own part: what the manifest records of them, from
    `describe_rank()` of each rank's part gathered over the world (nothing to agree on)."""
    hosts, runtimes, digests = zip(*(d.split(" ", 2) for d in described), strict=True)
    return {"sharded": True, "shard_digests": list(digests), "replica_hosts": list(hosts),
            "replica_runtimes": list(runtimes)}


def check_replicas_agree(described: list[str]) -> dict:
    """All ranks hold the same parameters, else a RuntimeError. `described`: each rank's
    "<host> <runtime> <digest>" (rank order), from `describe_rank()` gathered over the world."""
    hosts, runtimes, digests = zip(*(d.split(" ", 2) for d in described), strict=True)
    in_sync = len(set(digests)) == 1
    if not in_sync:
        raise RuntimeError(f"ranks ended the epoch with different parameters: {list(digests)}")
    return {"replicas_in_sync": in_sync, "replica_digests": list(digests), "replica_hosts": list(hosts),
            "replica_runtimes": list(runtimes)}
