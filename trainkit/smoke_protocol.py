"""What make smoke's two sides share: the operator's (dlcluster/smoke/) and the job's
(ray/smoke_checks.py, which runs on the cluster with the checkout as its working dir and imports
this from there). In the harness, which both sides may import (the cluster's side never imports
the operator's package). The standard library only."""

from __future__ import annotations

MARKER = "SMOKE_JSON "  # the one machine-readable line a check prints: MARKER + JSON
MIB = 1 << 20


def bandwidth(nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """nccl-tests' all-reduce figures in GB/s (1e9 bytes/s): algbw = bytes / time per op, and
    busbw = algbw * 2(n-1)/n, the bus bandwidth a ring reaches (each byte crosses 2(n-1)/n links),
    comparable across rank counts. One rank moves nothing: busbw 0."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


def iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iterations for a message size: 20 timed up to 4 MiB, fewer for bigger
    messages (about 80 MiB moved per size), never fewer than 3."""
    timed = max(3, min(20, round(20 * 4 * MIB / max(nbytes, 1))))
    return (2 if nbytes <= 16 * MIB else 1), timed
