"""make bench: each job on Ray Train against its framework's own launcher, side by side.

For each job, interleaved and repeated (the order alternates every repeat), the same model, data,
workers (2) and threads per worker (1) run once under the plain launcher and once through
`ray job submit` to the current cluster (its record):

    ddp_autoencoder   torchrun --nproc_per_node 2          vs  TorchTrainer
    horovod_mnist     horovodrun -np 2 --gloo               vs  HorovodTrainer (Train V1)
    tf_cnn            2 processes with a TF_CONFIG each     vs  TensorflowTrainer

Each run reports (from its manifest; the launch time is taken here): launch to first step,
the last epoch's training pass (epochs 2 and on; epoch 1 warms up), its validation, export +
verify, and the whole run's wall time. Printed: min/median/max per launcher and the ratios of
the medians (Ray / plain); written: a JSON file and a PNG plot.

    dlcluster bench [--jobs ddp_autoencoder,...] [--repeats 3] [--epochs 2] [--out DIR]
                    [--mnist-train 60000] [--tf-per-class 512] [--folder-scale 100000]

Epochs are long enough to judge a per-epoch ratio: Horovod trains on an MNIST-sized set (the
built-in digits, shifted, to --mnist-train images, written once under $DLC_HOME), TensorFlow on
--tf-per-class built-in crops per class (0 for either: the jobs' own small defaults).

--folder-scale N also measures a folder of N small JPEGs (made once, cached) against the built-in
frames: the driver's check of it alone (seconds, peak memory) and the autoencoder's submit to
first step on Ray with it (one epoch at 60x80 over at most N frames, the built-in ones too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dlcluster import plots, record
from dlcluster.bench import fsdp, strategies
from trainkit import launch
from trainkit.errors import UserError, run_main

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PHASES = ("launch_to_first_step_s", "train_epoch_s", "validation_s", "export_verify_s", "wall_s")
JOBS = {  # the job's flags for a short run of each (the same under both launchers)
    "ddp_autoencoder": ["--batch-size", "128"],
    "horovod_mnist": ["--batch-size", "64"],
    "tf_cnn": ["--batch-size", "8", "--per-class", "64"],
}
# launch to first step, in four: the launcher starts the process that checks the data, until it
# reaches the harness (Ray: job submission, the job's runtime env and driver), it checks flags
# and data (and imports the trainer), the workers start
# (Ray: the worker group's actors, process group; all: model built, checkpoint restored), the
# first step
STARTUP = ("to_process", "prepare", "to_workers", "to_first_step")
ENV = {"OMP_NUM_THREADS": "1"}  # one thread per worker, as Ray gives each of its workers


def plain(job: str, args: list[str], home: Path) -> list[subprocess.Popen]:
    env = {**os.environ, **ENV, "DLC_HOME": str(home)}
    env.pop("RAY_ADDRESS", None)

    def start(cmd, extra=None):
        return subprocess.Popen(cmd, cwd=REPO, env={**env, **(extra or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    if job == "ddp_autoencoder":
        return [start([str(BIN / "torchrun"), "--nproc_per_node", "2", f"jobs/{job}.py", *args])]
    if job == "horovod_mnist":
        return [start([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                       sys.executable, f"jobs/{job}.py", *args])]
    return [start([sys.executable, f"jobs/{job}.py", *args], {"TF_CONFIG": tf_config})
            for tf_config in launch.local_tf_configs(2)]


def ray_job(argv: list[str], current: record.ClusterRecord) -> list[subprocess.Popen]:
    """`ray job submit` of a script of the checkout and its flags to the current cluster."""
    cmd = [str(BIN / "ray"), "job", "submit", "--address", current.job_api, "--working-dir", ".",
           "--", "python", *argv]
    return [subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **current.client_env()},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]


def on_ray(job: str, args: list[str], current: record.ClusterRecord) -> list[subprocess.Popen]:
    return ray_job([f"jobs/{job}.py", "--num-workers", "2", *args], current)


def excerpt(log: str) -> str:
    """A failed run's log, short: the lines that name a cause (a C++ abort's "terminate called ...
    what(): ...", a Python error), wherever they are, then its last 2000 characters."""
    causes = [line for line in log[:-2000].splitlines()
              if re.search(r"terminate called|what\(\)|Error|Exception|error:|Signal \d+", line)]
    return "\n".join([*causes[:20], "...", log[-2000:]] if causes else [log[-2000:]])


def measure(job: str, launcher: str, a, current, work: Path, i: int,
            job_args: list[str] | None = None) -> dict:
    name = f"bench-{job.replace('_', '-')}-{launcher}-{i}-{time.strftime('%H%M%S')}"
    out = work / "models" / name
    args = [*(JOBS[job] if job_args is None else job_args), "--epochs", str(a.epochs), "--name", name,
            "--storage-path", str(work / "runs"), "--output", str(out)]
    t0 = time.time()
    procs = plain(job, args, work) if launcher == "plain" else on_ray(job, args, current)
    logs = [p.communicate()[0] for p in procs]
    wall = time.time() - t0
    if any(p.returncode for p in procs):
        raise UserError(f"{job} under {launcher} failed:\n" + "\n".join(map(excerpt, logs)))
    m = json.loads((out / "manifest.json").read_text())
    metrics, tl = m["metrics"], m["timeline"]
    marks = [t0, tl.get("imported_at"), tl.get("prepared_at"), tl.get("workers_started_at"),
             tl["first_step_at"]]
    # where launch to first step went (None where a mark is missing)
    split = {f"{k}_s": (b - a if a and b else None) for k, a, b in zip(
        STARTUP, marks[:-1], marks[1:], strict=True)}
    return {**split, "launch_to_first_step_s": tl["first_step_at"] - t0,
            "train_epoch_s": metrics["dataflow_s"] + metrics["processing_s"],
            "validation_s": metrics["validation_s"],
            "export_verify_s": m["timeline"]["export_s"] + m["parity"]["seconds"],
            "wall_s": wall, "samples_per_s": metrics["samples_per_s"],
            "world_size": m["world_size"], "launcher": m["launcher"], "name": name,
            "tracking": m.get("tracking", {}).get("state")}


def tracking_cost(runs: dict) -> dict | None:
    """What logging each epoch to the run history cost the Ray runs, from the server itself: the
    seconds each epoch's request took on rank 0 (`tracking_s`, logged with the next epoch) against
    the epoch's own seconds; None where no run was tracked."""
    from trainkit import tracking

    url, _ = tracking.setting("auto")
    tracked = [r for by in runs.values() for r in by["ray"] if r.get("tracking") == "tracked"]
    if url is None or not tracked:
        return None
    mlflow = tracking.client(url)
    out = {}
    for job, by in runs.items():
        logging_s, epoch_s = [], []
        for r in by["ray"]:
            found = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()],
                                       f"attributes.run_name = '{r['name']}'", max_results=1)
            if not found:
                continue
            history = {k: {m.step: m.value for m in mlflow.get_metric_history(found[0].info.run_id, k)}
                       for k in ("tracking_s", "epoch_s")}
            for step, seconds in history["tracking_s"].items():  # the request of epoch step - 1
                logging_s.append(seconds)
                epoch_s.append(history["epoch_s"][step - 1])
        if logging_s:
            out[job] = {"requests": len(logging_s), "logging_s_median": statistics.median(logging_s),
                        "epoch_s_median": statistics.median(epoch_s),
                        "share": statistics.median(t / e for t, e in zip(logging_s, epoch_s, strict=True))}
    return out or None


def tracking_table(cost: dict) -> str:
    rows = [f"{'job':<17}{'requests':>9}{'logging an epoch':>18}{'epoch':>9}{'share':>8}"]
    rows += [f"{job:<17}{c['requests']:>9}{c['logging_s_median'] * 1000:>15.0f} ms"
             f"{c['epoch_s_median']:>7.1f} s{c['share'] * 100:>7.2f}%" for job, c in cost.items()]
    return "\n".join(rows)


def frames_folder(n: int) -> Path:
    """n JPEGs of 60x80 (the built-in frames, cycled and shifted so no two files are alike), in
    100 subfolders, made once under $DLC_HOME."""
    import numpy as np
    from PIL import Image

    from trainkit import data

    root = Path(os.environ.get("DLC_HOME", "~/dlcluster")).expanduser() / f"bench-frames-{n}"
    if (root / ".complete").exists():
        return root
    frames = data.builtin_frames(size=(60, 80))
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name, dir=root.parent))
    for i in range(n):
        if i % 10000 == 0:
            print(f"[bench] writing frame {i} of {n} into {root}", flush=True)
        img = np.roll(frames[i % len(frames)], i // len(frames), axis=1)
        (tmp / f"{i % 100:02d}").mkdir(exist_ok=True)
        Image.fromarray(img).save(tmp / f"{i % 100:02d}" / f"{i:06d}.jpg", quality=90)
    (tmp / ".complete").touch()
    tmp.rename(root)
    return root


def mnist_folder(n: int) -> Path:
    """An MNIST-format set (what --data-dir reads) of n training digits: the built-in ones cycled,
    each copy shifted by up to 2 pixels so no two are alike; the test set is the built-in one.
    Made once under $DLC_HOME."""
    import numpy as np

    from trainkit import mnist

    root = Path(os.environ.get("DLC_HOME", "~/dlcluster")).expanduser() / f"bench-mnist-{n}"
    raw = root / "MNIST" / "raw"
    if (root / ".complete").exists():
        return root
    split = mnist.builtin_split()
    images, labels = split[True]
    rng = np.random.default_rng(n)
    idx = np.arange(n) % len(images)
    shifts = rng.integers(-2, 3, size=(n, 2))
    out = np.stack([np.roll(images[i], tuple(s), axis=(0, 1)) for i, s in zip(idx, shifts, strict=True)])
    raw.mkdir(parents=True, exist_ok=True)
    mnist.write_idx(raw / mnist.FILES[True][0], out)
    mnist.write_idx(raw / mnist.FILES[True][1], labels[idx])
    for f, array in zip(mnist.FILES[False], split[False], strict=True):
        mnist.write_idx(raw / f, array)
    (root / ".complete").touch()
    print(f"[bench] wrote {n} MNIST-format training digits under {root}", flush=True)
    return root


CHECK = """import resource, sys, time
from trainkit import data
t = time.perf_counter()
src = data.inspect_frames(sys.argv[1] or None, (60, 80))
print(src.count, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def folder_scale(n: int, a, current, work: Path) -> dict:
    """The driver's check alone (a fresh process: seconds, peak MiB), then submit to first step on
    Ray, for the built-in frames and for a folder of n JPEGs (each run one epoch of at most n)."""
    folder = frames_folder(n)
    out: dict[str, Any] = {"files": n}
    for label, where in (("builtin", ""), ("folder", str(folder))):
        count, secs, peak = subprocess.run([sys.executable, "-c", CHECK, where], cwd=REPO, check=True,
                                           capture_output=True, text=True).stdout.split()
        # both train on at most n frames: the epoch after the first step is not what is compared
        job_args = ["--batch-size", "128", "--image-size", "60x80", "--limit", str(n),
                    *(["--data", where] if where else [])]
        r = measure("ddp_autoencoder", "ray", argparse.Namespace(epochs=1), current, work, 0, job_args)
        out[label] = {"frames": int(count), "driver_check_s": float(secs), "driver_peak_mib": float(peak),
                      "launch_to_first_step_s": r["launch_to_first_step_s"], "wall_s": r["wall_s"]}
        print(f"[bench] {label}: {count} frames, driver check {float(secs):.1f} s (peak {float(peak):.0f} "
              f"MiB), submit to first step {r['launch_to_first_step_s']:.1f} s", flush=True)
    first = {k: out[k]["launch_to_first_step_s"] for k in ("builtin", "folder")}
    out["first_step_ratio"] = first["folder"] / first["builtin"]
    print(f"[bench] {n} JPEGs against the built-in frames: submit to first step "
          f"{out['first_step_ratio']:.2f}x (target <= 2x)", flush=True)
    return out


def startup_table(runs: dict) -> str:
    """Medians of the four parts of launch to first step, per job and launcher."""
    head = " | ".join(k.replace("_", " ") for k in STARTUP)
    lines = [f"| job | launcher | {head} | launch to first step |", "|---|---|" + "---|" * (len(STARTUP) + 1)]
    for job, by in runs.items():
        for launcher, rs in by.items():
            cells = []
            for k in (*STARTUP, "launch_to_first_step"):
                vals = [r[f"{k}_s"] for r in rs if r.get(f"{k}_s") is not None]
                cells.append(f"{statistics.median(vals):.1f}" if vals else "-")
            lines.append(f"| {job} | {launcher} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(runs: dict) -> dict:
    out = {}
    for job, by_launcher in runs.items():
        stats = {launcher: {k: {"min": min(r[k] for r in rs), "median": statistics.median(r[k] for r in rs),
                                "max": max(r[k] for r in rs)} for k in PHASES}
                 for launcher, rs in by_launcher.items()}
        ratios = {k: stats["ray"][k]["median"] / stats["plain"][k]["median"] for k in PHASES}
        out[job] = {"stats": stats, "ratio_ray_over_plain": ratios, "repeats": len(by_launcher["ray"])}
    return out


def table(summary: dict) -> str:
    plain_name = {"ddp_autoencoder": "torchrun", "horovod_mnist": "horovodrun", "tf_cnn": "TF_CONFIG"}
    lines = ["| job | measure | plain launcher (min / median / max s) | Ray Train (min / median / max s) "
             "| Ray / plain |", "|---|---|---|---|---|"]
    for job, s in summary.items():
        for k in PHASES:
            p, r = s["stats"]["plain"][k], s["stats"]["ray"][k]
            lines.append(f"| {job} ({plain_name[job]}) | {k[:-2]} | {p['min']:.1f} / {p['median']:.1f} / "
                         f"{p['max']:.1f} | {r['min']:.1f} / {r['median']:.1f} / {r['max']:.1f} | "
                         f"{s['ratio_ray_over_plain'][k]:.2f}x |")
    return "\n".join(lines)


TARGETS = {"launch_to_first_step_s": 1.5, "train_epoch_s": 1.05, "wall_s": 1.3}  # the autoencoder's


def plot(summary: dict, path: Path) -> None:
    """Ray / plain per measure and job: the median's ratio, with the range the repeats allow."""
    plt = plots.pyplot()

    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(summary)
    for j, (job, s) in enumerate(summary.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(PHASES))]
        plain, ray = s["stats"]["plain"], s["stats"]["ray"]
        mid = [s["ratio_ray_over_plain"][k] for k in PHASES]
        low = [m - ray[k]["min"] / plain[k]["max"] for m, k in zip(mid, PHASES, strict=True)]
        high = [ray[k]["max"] / plain[k]["min"] - m for m, k in zip(mid, PHASES, strict=True)]
        bars = ax.bar(xs, mid, width, yerr=[low, high], capsize=3, label=f"{job} ({s['repeats']} repeats)")
        ax.bar_label(bars, labels=[f"{m:.2f}" for m in mid], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    for i, k in enumerate(PHASES):
        if k in TARGETS:
            ax.hlines(TARGETS[k], i - 0.45, i + 0.45, colors="red", linestyles="dashed", linewidth=1)
    ax.plot([], [], "r--", linewidth=1, label="target (autoencoder)")
    ax.set_xticks(range(len(PHASES)), [k[:-2].replace("_", " ") for k in PHASES])
    ax.set_ylabel("Ray Train / plain launcher (median; bars: range)")
    ax.set_title("Ray Train against each job's own launcher: same model, data, 2 workers x 1 thread")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine() -> dict:
    """The CPU the figures were measured on (ratios hold across machines, seconds do not)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default=",".join(JOBS), help="comma-separated jobs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="epochs per run; the last one is reported")
    p.add_argument("--limit", type=int, default=None, help="autoencoder frames (default: all 6472)")
    p.add_argument("--mnist-train", type=int, default=60000, metavar="N",
                   help="Horovod: an MNIST-format set of N training digits (0: the built-in 1500)")
    p.add_argument("--tf-per-class", type=int, default=512, metavar="N",
                   help="TensorFlow: N built-in images per class (0: the bench's 64)")
    p.add_argument("--folder-scale", type=int, default=0, metavar="N",
                   help="also time a folder of N JPEGs against the built-in frames (0: skip)")
    p.add_argument("--strategy-epochs", type=int, default=3, metavar="N",
                   help="TensorFlow: MultiWorkerMirrored against ParameterServer on Ray, N epochs each, "
                        "worker 1 at full speed and slowed (0: skip)")
    p.add_argument("--lm-epochs", type=int, default=2, metavar="N",
                   help="epochs of each finetune_lm run (FSDP2 against DDP, 2 workers on Ray); 0: none")
    p.add_argument("--lm-size", default="small", choices=("tiny", "small"),
                   help="the model finetune_lm builds for the comparison")
    p.add_argument("--lm-limit", type=int, default=200000, metavar="N",
                   help="tokens of the built-in corpus the finetune_lm runs train on")
    p.add_argument("--strategy-runs", default=",".join(strategies.RUNS), metavar="S:SPEED,...",
                   help="which of the strategy comparison's runs (STRATEGY:full|slowed, comma-separated; "
                        "default: all four)")
    p.add_argument("--slow-share", type=float, default=0.5,
                   help="the share of the time the slowed worker may run")
    p.add_argument("--out", default=None, help="folder for bench.json and bench.png "
                                               "(default: $DLC_HOME/bench/<date-time>)")
    a = p.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    unknown = set(jobs) - set(JOBS)
    if unknown or a.repeats < 1 or a.epochs < 1 or min(a.folder_scale, a.mnist_train, a.tf_per_class,
                                                        a.strategy_epochs, a.lm_epochs) < 0 \
            or not 0 < a.slow_share < 1:
        raise UserError(f"--jobs must name some of {', '.join(JOBS)}, --repeats/--epochs be >= 1, "
                        "--mnist-train/--tf-per-class/--folder-scale/--strategy-epochs/--lm-epochs >= 0 and "
                        "--slow-share between 0 and 1")
    strategy_runs = strategies.parse_runs(a.strategy_runs)  # a bad one: one line, before any run
    if a.limit:
        JOBS["ddp_autoencoder"] = [*JOBS["ddp_autoencoder"], "--limit", str(a.limit)]
    if a.mnist_train and "horovod_mnist" in jobs:
        JOBS["horovod_mnist"] = [*JOBS["horovod_mnist"], "--data-dir", str(mnist_folder(a.mnist_train))]
    if a.tf_per_class:
        JOBS["tf_cnn"] = [*JOBS["tf_cnn"], "--per-class", str(a.tf_per_class)]
    current = record.load()  # the cluster `make cluster-up` brought up, wherever its job API is
    out = Path(a.out) if a.out else (Path(os.environ.get("DLC_HOME", "~/dlcluster")).expanduser()
                                     / "bench" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    runs: dict = {job: {"plain": [], "ray": []} for job in jobs}
    host = machine()
    print(f"[bench] {host['cpu']}, {host['cores']} cores; cluster {current.name}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dlc-bench-") as tmp:
        for i in range(a.repeats):
            for job in jobs:
                order = ("plain", "ray") if i % 2 == 0 else ("ray", "plain")
                for launcher in order:
                    print(f"[bench] repeat {i + 1}/{a.repeats}: {job} under {launcher} ...", flush=True)
                    r = measure(job, launcher, a, current, Path(tmp), i)
                    runs[job][launcher].append(r)
                    print(f"[bench]   first step after {r['launch_to_first_step_s']:.1f} s, epoch "
                          f"{r['train_epoch_s']:.1f} s, wall {r['wall_s']:.1f} s", flush=True)
        scale = folder_scale(a.folder_scale, a, current, Path(tmp)) if a.folder_scale else None
        compared = None
        if a.strategy_epochs:
            compared = strategies.compare([*JOBS["tf_cnn"], "--epochs", str(a.strategy_epochs)], a.slow_share,
                                          lambda argv: ray_job(argv, current), Path(tmp), strategy_runs)
        sharded = None
        if a.lm_epochs:
            lm_args = ["--size", a.lm_size, "--limit", str(a.lm_limit), "--batch-size", "8", "--epochs",
                       str(a.lm_epochs)]
            sharded = fsdp.compare(lm_args, lambda argv: ray_job(argv, current), Path(tmp))
    summary = summarize(runs) if jobs else {}
    cost = tracking_cost(runs) if jobs else None
    if summary:
        print("\n" + table(summary))
    if cost:
        print("\nthe run history's cost on Ray (rank 0's request per epoch, medians; the target is "
              "under 2 %):\n" + tracking_table(cost))
    if runs:
        print("\nlaunch to first step, median seconds per part:\n" + startup_table(runs))
    if compared:
        print("\nTensorFlow's strategies, worker 1 at full speed and slowed:\n" + strategies.table(compared))
    if sharded:
        print("\nthe language model, FSDP2 against DDP:\n" + fsdp.table(sharded))
    (out / "bench.json").write_text(json.dumps({"cluster": current.name, "machine": host,
                                                "epochs": a.epochs, "summary": summary, "runs": runs,
                                                "folder_scale": scale, "strategies": compared,
                                                "sharding": sharded,
                                                "tracking": cost},
                                               indent=2) + "\n")
    if summary:
        plot(summary, out / "bench.png")
        print(f"\n[bench] {out / 'bench.png'}")
    if compared:
        strategies.plot(compared, out / "strategies.png")
        print(f"[bench] {out / 'strategies.png'}")
    if sharded:
        fsdp.plot(sharded, out / "fsdp.png")
        print(f"[bench] {out / 'fsdp.png'}")
    print(f"[bench] {out / 'bench.json'}")


if __name__ == "__main__":
    run_main(main, "bench")
