"""The tutorial's table on this cluster, in one run: workers 1 and 2 x batch 64 and 128.

    make cluster-up && make bench-ae            # ARGS="--epochs 3 --limit 2000" to change

Each configuration is a real `ray job submit` of jobs/ddp_autoencoder.py on the built-in 6472
frames. The figures are those of the last epoch (the first also pays for start-up). It prints
iterations per epoch (train + validation, per worker, as the tutorial counts them), epoch seconds,
samples/s and the 2-worker speed-up as ratios measured in this run, and exits non-zero if
iterations per epoch do not halve with 2 workers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dlcluster import record
from trainkit.errors import run_main

REPO = Path(__file__).resolve().parents[2]


def run(workers: int, batch: int, a: argparse.Namespace, work: Path) -> dict:
    name = f"bench-w{workers}-b{batch}-{time.strftime('%H%M%S')}"
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", a.address,
           "--working-dir", ".", "--", "python", "jobs/ddp_autoencoder.py",
           "--num-workers", str(workers), "--batch-size", str(batch), "--epochs", str(a.epochs),
           "--name", name, "--storage-path", str(work / "runs"), "--output", str(work / name)]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    print(f"== {workers} worker(s), batch {batch}: {a.epochs} epoch(s) ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if "[ddp_autoencoder] epoch" in line and "iterations" not in line:
            print("   ", line.split("[ddp_autoencoder] ")[-1], flush=True)
    if proc.returncode != 0:
        sys.exit(f"bench: the run with {workers} worker(s), batch {batch} failed:\n"
                 + proc.stdout[-3000:])
    return json.loads((work / name / "manifest.json").read_text())["metrics"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench-ae", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="job API (default: the cluster record's)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run; the last one is reported")
    p.add_argument("--limit", type=int, default=None, help="frames to use (default: all 6472)")
    a = p.parse_args(argv)
    current = record.load()  # the cluster `make cluster-up` brought up, wherever its job API is
    os.environ.update(current.client_env())
    a.address = a.address or current.job_api
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-ae-") as tmp:
        for batch in (64, 128):
            for workers in (1, 2):
                rows[workers, batch] = run(workers, batch, a, Path(tmp))

    print("\n| workers | batch | iters/epoch (train+val) | epoch s | samples/s |")
    print("|---|---|---|---|---|")
    for (w, b), m in rows.items():
        print(f"| {w} | {b} | {m['iters_per_epoch']} ({m['train_iters']}+{m['val_iters']}) | "
              f"{m['epoch_s']:.1f} | {m['samples_per_s']:.0f} |")
    ok = True
    print()
    for b in (64, 128):
        one, two = rows[1, b], rows[2, b]
        # With 2 workers each pass has ceil(n / 2 / batch) iterations: half, up to rounding.
        halved = all(math.isclose(one[k] / 2, two[k], abs_tol=1) for k in ("train_iters", "val_iters"))
        ok &= halved
        print(f"batch {b}: iterations 1 -> 2 workers {one['iters_per_epoch']} -> "
              f"{two['iters_per_epoch']} (ratio {one['iters_per_epoch'] / two['iters_per_epoch']:.2f}"
              f"{'' if halved else ', NOT HALVED'}); speed-up {one['epoch_s'] / two['epoch_s']:.2f}x "
              f"epoch time, {two['samples_per_s'] / one['samples_per_s']:.2f}x samples/s")
    print(f"(tutorial, 3 V100 vs 1 at batch 128: 102 -> 34 iterations, 55 s -> 33 s = 1.67x; "
          f"this machine has {os.cpu_count()} cores)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    run_main(main, "bench")
