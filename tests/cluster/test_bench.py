"""make bench's code path at tiny size on the fixture cluster (found through its record): both
launchers run, the ratios, the run history's cost, the JSON and the PNG come out; one run of
TensorFlow's strategy comparison (ParameterServer, a worker slowed) with its table and plot (the
comparison of all four runs is drawn in the unit tier from recorded results, as FSDP2 against DDP
is, whose memory claim the FSDP test measures). The real figures are
in docs/benchmark.md."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO


def test_bench_runs_both_launchers_and_writes_its_report(cluster, tmp_path):
    env = {**cluster.env, "DLC_HOME": str(tmp_path)}
    env.pop("DASHBOARD_PORT", None)  # the record says where the job API is
    cmd = [sys.executable, "-m", "dlcluster", "bench", "--jobs", "ddp_autoencoder", "--repeats", "1",
           "--epochs", "2", "--limit", "300", "--folder-scale", "300", "--strategy-epochs", "1",
           "--lm-epochs", "0",
           "--strategy-runs", "ps:slowed",
           "--tf-per-class", "16", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout[-4000:], proc.stderr[-6000:])
    assert proc.returncode == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    s = report["summary"]["ddp_autoencoder"]
    assert s["repeats"] == 1 and report["cluster"] == "local"
    for launcher, want in (("plain", "torchrun"), ("ray", "ray")):
        (run,) = report["runs"]["ddp_autoencoder"][launcher]
        assert run["launcher"] == want and run["world_size"] == 2
        assert 0 < run["launch_to_first_step_s"] < run["wall_s"] and run["train_epoch_s"] > 0
        parts = [run[f"{k}_s"] for k in ("to_process", "prepare", "to_workers", "to_first_step")]
        assert all(p is not None and p >= 0 for p in parts), parts  # four parts, in order
    for k, ratio in s["ratio_ray_over_plain"].items():
        assert ratio > 0, k
    # the run history's cost: rank 0's request for epoch 1, timed and logged with epoch 2
    cost = report["tracking"]["ddp_autoencoder"]
    assert cost["requests"] == 1 and 0 < cost["logging_s_median"] < cost["epoch_s_median"], cost
    assert "the run history's cost on Ray" in proc.stdout
    assert "| ddp_autoencoder (torchrun) | wall |" in proc.stdout
    assert "| ddp_autoencoder | ray |" in proc.stdout  # where launch to first step went
    # a folder of 300 JPEGs against the built-in frames: the driver's check and the first step
    scale = report["folder_scale"]
    assert scale["files"] == 300 and scale["folder"]["frames"] == 300
    assert scale["builtin"]["frames"] == 6472 and scale["folder"]["driver_peak_mib"] > 0
    assert scale["first_step_ratio"] > 0
    # the strategy comparison's code path with one of its four runs: ParameterServer, worker 1
    # slowed (the comparison's table and plot over all four: tests/unit/test_bench_report.py)
    compared = report["strategies"]
    (r,) = compared["runs"]
    assert (r["strategy"], r["slowed_share"]) == ("ps", 0.5)
    assert r["epochs"] == 1 and r["workers"] == 2 and r["train_epoch_s"] > 0
    assert 0 <= r["val_accuracy"] <= 1
    assert r["roles"] == {"chief": 1, "ps": 1, "worker": 2}
    # the throttle found its worker and held it stopped part of the time
    assert "running 50% of the time" in r["throttled"][0], r["throttled"]
    held = re.search(r"held stopped ([\d.]+) s in all", r["throttled"][-1])
    assert held and float(held.group(1)) > 0, r["throttled"]
    assert compared["slowed_over_full"] == {}  # no full-speed run to compare with
    assert "| ParameterServer | 50% of the CPU |" in proc.stdout
    # FSDP2 against DDP (--lm-epochs): their table and plot from recorded runs in the unit tier
    # (test_bench_report.py), a rank's half of a replica measured in test_finetune_lm.py
    assert report["sharding"] is None and not (tmp_path / "out" / "fsdp.png").exists()
    for png in ("bench.png", "strategies.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(tmp_path / "out" / png) > 10_000
