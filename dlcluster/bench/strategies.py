"""make bench's strategy comparison, the TensorFlow tutorial's claim measured: a
ParameterServerStrategy run (asynchronous: each worker pushes its gradients to the parameter server
and takes its next batch without waiting) against MultiWorkerMirroredStrategy (synchronous: every
step waits for the slowest worker), on the same data and 2 workers on Ray (plus 1 parameter server
and a chief), each with both workers at full speed and with worker 1's CPU share cut
(dlcluster/bench/throttle.py, beside the run). Reported per run from its manifest: the last epoch's
training seconds and the validation accuracy after the same number of epochs; per strategy, the
epoch's slowed / full-speed ratio."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from dlcluster import plots
from trainkit.errors import UserError

STRATEGIES = {"multiworker": "MultiWorkerMirrored", "ps": "ParameterServer"}
SLOWED = {"multiworker": ["--class-name", "RayTrainWorker"],  # either worker: each step waits for both
          "ps": ["--class-name", "Role", "--repr", "worker 1"]}


def run(strategy: str, share: float | None, args: list[str], submit: Callable, work: Path) -> dict:
    """One run of tf_cnn under `strategy` on Ray; with `share`, worker 1 runs that share of the time."""
    name = f"bench-tf-{strategy}-{'slowed' if share else 'full'}-{time.strftime('%H%M%S')}"
    out = work / "models" / name
    t0 = time.time()
    (proc,) = submit(["jobs/tf_cnn.py", "--num-workers", "2", "--strategy", strategy, *args, "--name", name,
                      "--storage-path", str(work / "runs"), "--output", str(out)])
    throttle = None
    if share:  # beside the run: it waits for the worker to start, and ends with it
        (throttle,) = submit(["dlcluster/bench/throttle.py", *SLOWED[strategy], "--share", str(share)])
    log = proc.communicate()[0]
    wall = time.time() - t0
    held = throttle.communicate(timeout=300)[0] if throttle else ""
    if proc.returncode or (throttle and throttle.returncode):
        raise UserError(f"tf_cnn --strategy {strategy} failed:\n{log[-2000:]}\n{held[-1000:]}")
    m = json.loads((out / "manifest.json").read_text())
    metrics = m["metrics"]
    return {"strategy": strategy, "slowed_share": share, "epochs": metrics["epoch"],
            "train_epoch_s": metrics["dataflow_s"] + metrics["processing_s"],
            "val_accuracy": metrics["val_accuracy"], "val_loss": metrics["val_loss"],
            "samples_per_s": metrics["samples_per_s"],
            "wall_s": wall, "workers": m["world_size"], "roles": m.get("roles"),
            "throttled": [line for line in held.splitlines() if line.startswith("[throttle]")]}


RUNS = ("multiworker:full", "ps:full", "multiworker:slowed", "ps:slowed")  # make bench's four, in order


def parse_runs(text: str) -> list[tuple[str, bool]]:
    """`--strategy-runs`: comma-separated STRATEGY:full|slowed -> [(strategy, slowed)]."""
    runs = []
    for item in filter(None, text.split(",")):
        strategy, _, speed = item.partition(":")
        if strategy not in STRATEGIES or speed not in ("full", "slowed"):
            raise UserError(f"--strategy-runs {text!r}: {item!r} is not STRATEGY:full|slowed with "
                            f"STRATEGY one of {', '.join(STRATEGIES)}; e.g. --strategy-runs {','.join(RUNS)}")
        runs.append((strategy, speed == "slowed"))
    if not runs:
        raise UserError("--strategy-runs names no run; leave it out for all four, or give "
                        "--strategy-epochs 0 for none")
    return runs


def compare(args: list[str], share: float, submit: Callable, work: Path,
            which: list[tuple[str, bool]] | None = None) -> dict:
    """The runs asked for (default: both strategies, full speed then slowed), in turn; the ratios of
    the strategies run both ways."""
    runs = []
    for strategy, slowed in which or parse_runs(",".join(RUNS)):
        print(f"[bench] tf_cnn --strategy {strategy}, worker 1 at "
              f"{f'{share:.0%} of the CPU' if slowed else 'full speed'} ...", flush=True)
        r = run(strategy, share if slowed else None, args, submit, work)
        print(f"[bench]   epoch {r['train_epoch_s']:.1f} s, val accuracy {r['val_accuracy']:.3f}, "
              f"val loss {r['val_loss']:.4f}", flush=True)
        runs.append(r)
    by = {(r["strategy"], bool(r["slowed_share"])): r for r in runs}
    ratios = {s: by[s, True]["train_epoch_s"] / by[s, False]["train_epoch_s"] for s in STRATEGIES
              if (s, True) in by and (s, False) in by}
    return {"share": share, "runs": runs, "slowed_over_full": ratios}


def table(result: dict) -> str:
    lines = ["| strategy | worker 1 | epoch (s) | val accuracy | val loss | samples/s | slowed / full |",
             "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        slowed = r["slowed_share"]
        speed = f"{slowed:.0%} of the CPU" if slowed else "full speed"
        lines.append(f"| {STRATEGIES[r['strategy']]} | {speed} | {r['train_epoch_s']:.1f} | "
                     f"{r['val_accuracy']:.3f} | {r['val_loss']:.4f} | {r['samples_per_s']:.1f} | "
                     + (f"{result['slowed_over_full'][r['strategy']]:.2f}x |"
                        if slowed and r["strategy"] in result["slowed_over_full"] else "- |"))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Epoch seconds, validation accuracy and loss, per strategy, full speed beside slowed."""
    plt = plots.pyplot()
    fig, (left, right, loss) = plt.subplots(1, 3, figsize=(13, 4))
    names = list(STRATEGIES)
    for offset, slowed, label in ((-0.2, False, "full speed"),
                                  (0.2, True, f"worker 1 at {result['share']:.0%} of the CPU")):
        rs = {r["strategy"]: r for r in result["runs"] if bool(r["slowed_share"]) == slowed}
        ran = [s for s in names if s in rs]  # a bench asked for some of the four runs draws those
        if not ran:
            continue
        xs = [names.index(s) + offset for s in ran]
        for ax, key, fmt in ((left, "train_epoch_s", "{:.1f}"), (right, "val_accuracy", "{:.3f}"),
                             (loss, "val_loss", "{:.4f}")):
            bars = ax.bar(xs, [rs[s][key] for s in ran], 0.4, label=label)
            ax.bar_label(bars, labels=[fmt.format(rs[s][key]) for s in ran], fontsize=8, padding=2)
    for ax, title in ((left, "seconds per epoch (last epoch)"), (right, "validation accuracy"),
                      (loss, "validation loss")):
        ax.set_xticks(range(len(names)), [STRATEGIES[s] for s in names])
        ax.set_title(title)
    right.set_ylim(0, 1.1)
    left.legend(fontsize=8)
    epochs = result["runs"][0]["epochs"]
    fig.suptitle(f"TensorFlow strategies on Ray: 2 workers (+1 parameter server), {epochs} epochs, same data")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


