"""make bench's sharding comparison: the language model (jobs/finetune_lm.py) fine-tuned with FSDP2
against DDP, the same model, data and 2 workers on Ray. Reported per run from its manifest: what one
rank held for training (parameters, gradients, optimizer state: measured on every rank from the
tensors' storages, the largest), samples/s, and launch to the first step; FSDP / DDP ratios beside
them. The sharded part is expected near 1/N of a replica's."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from dlcluster import plots
from trainkit.errors import UserError

STRATEGIES = {"fsdp": "FSDP2 (sharded)", "ddp": "DDP (replicas)"}
WORKERS = 2


def run(strategy: str, args: list[str], submit: Callable, work: Path) -> dict:
    name = f"bench-lm-{strategy}-{time.strftime('%H%M%S')}"
    out = work / "models" / name
    t0 = time.time()
    (proc,) = submit(["jobs/finetune_lm.py", "--num-workers", str(WORKERS), "--strategy", strategy, *args,
                      "--samples", "0", "--name", name, "--storage-path", str(work / "runs"),
                      "--output", str(out)])
    log = proc.communicate()[0]
    if proc.returncode:
        raise UserError(f"finetune_lm --strategy {strategy} failed:\n{log[-2000:]}")
    m = json.loads((out / "manifest.json").read_text())
    metrics = m["metrics"]
    return {"strategy": strategy, "workers": m["world_size"], "epochs": metrics["epoch"],
            "held_mib_per_rank": metrics["held_mib_per_rank"], "samples_per_s": metrics["samples_per_s"],
            "launch_to_first_step_s": m["timeline"]["first_step_at"] - t0,
            "train_epoch_s": metrics["dataflow_s"] + metrics["processing_s"],
            "val_loss": metrics["val_loss"], "model": m["run"]["data"]}


def compare(args: list[str], submit: Callable, work: Path) -> dict:
    """FSDP2, then DDP; the ratios FSDP / DDP."""
    runs = []
    for strategy in STRATEGIES:
        print(f"[bench] finetune_lm --strategy {strategy} on {WORKERS} workers ...", flush=True)
        r = run(strategy, args, submit, work)
        print(f"[bench]   {r['held_mib_per_rank']:.1f} MiB held per rank, "
              f"{r['samples_per_s']:.1f} samples/s, first step after "
              f"{r['launch_to_first_step_s']:.1f} s", flush=True)
        runs.append(r)
    return summarize(runs)


def summarize(runs: list[dict]) -> dict:
    by = {r["strategy"]: r for r in runs}
    keys = ("held_mib_per_rank", "samples_per_s", "launch_to_first_step_s")
    ratios = {k: by["fsdp"][k] / by["ddp"][k] for k in keys} if {"fsdp", "ddp"} <= set(by) else {}
    return {"workers": WORKERS, "runs": runs, "fsdp_over_ddp": ratios}


def table(result: dict) -> str:
    lines = ["| strategy | held per rank (MiB) | samples/s | launch to first step (s) | val loss |",
             "|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {STRATEGIES[r['strategy']]} | {r['held_mib_per_rank']:.1f} | "
                     f"{r['samples_per_s']:.1f} | {r['launch_to_first_step_s']:.1f} | {r['val_loss']:.4f} |")
    ratio = result["fsdp_over_ddp"]
    if ratio:
        lines.append(f"| FSDP / DDP | {ratio['held_mib_per_rank']:.2f}x (1/{result['workers']} = "
                     f"{1 / result['workers']:.2f}) | {ratio['samples_per_s']:.2f}x | "
                     f"{ratio['launch_to_first_step_s']:.2f}x | |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Held memory per rank, samples/s and launch to first step, FSDP2 beside DDP."""
    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["strategy"] for r in result["runs"]]
    for ax, key, title, fmt in zip(axes, ("held_mib_per_rank", "samples_per_s", "launch_to_first_step_s"),
                                   ("MiB held per rank (params + grads + optimizer)", "samples/s",
                                    "launch to first step (s)"), ("{:.1f}", "{:.1f}", "{:.1f}"), strict=True):
        values = [r[key] for r in result["runs"]]
        bars = ax.bar(range(len(names)), values, 0.6, color=["tab:blue", "tab:orange"][: len(names)])
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8, padding=2)
        ax.set_xticks(range(len(names)), [STRATEGIES[n] for n in names])
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"finetune_lm on Ray, {result['workers']} workers: FSDP2 against DDP, same model and data")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
