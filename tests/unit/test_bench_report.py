"""make bench's reports drawn from recorded results (tests/bench/results/, the runs docs/benchmark.md
shows): the launcher comparison's table and plot, and TensorFlow's strategy comparison of all four
runs, its slowed / full ratios, table and plot. The cluster tier runs the bench's code path at tiny
size (tests/cluster/test_bench.py); the drawing of a whole comparison is proved here, without a
cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlcluster.bench import bench, fsdp, strategies
from trainkit.errors import UserError

REPO = Path(__file__).resolve().parents[2]

RESULTS = REPO / "tests" / "bench" / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def test_the_strategy_comparison_of_four_recorded_runs_is_tabled_and_drawn(tmp_path):
    result = json.loads((RESULTS / "strategies.json").read_text())["strategies"]
    table = strategies.table(result).splitlines()
    assert len(table) == 2 + 4, table  # header, rule, one row per run
    by = {(r["strategy"], bool(r["slowed_share"])): r for r in result["runs"]}
    for strategy, name in strategies.STRATEGIES.items():
        full, slowed = by[strategy, False], by[strategy, True]
        ratio = slowed["train_epoch_s"] / full["train_epoch_s"]  # recomputed from the runs themselves
        assert result["slowed_over_full"][strategy] == pytest.approx(ratio)
        row = next(line for line in table if line.startswith(f"| {name} | 50% of the CPU |"))
        assert row.endswith(f"| {ratio:.2f}x |") and f"| {slowed['train_epoch_s']:.1f} |" in row, row
        assert next(line for line in table if line.startswith(f"| {name} | full speed |")).endswith("| - |")
    strategies.plot(result, tmp_path / "strategies.png")
    assert is_png(tmp_path / "strategies.png")


def test_some_of_the_four_runs_are_tabled_and_drawn_without_ratios(tmp_path):
    result = json.loads((RESULTS / "strategies.json").read_text())["strategies"]
    ps_slowed = [r for r in result["runs"] if r["strategy"] == "ps" and r["slowed_share"]]
    one = {"share": result["share"], "runs": ps_slowed, "slowed_over_full": {}}
    (row,) = strategies.table(one).splitlines()[2:]
    assert row.startswith("| ParameterServer | 50% of the CPU |") and row.endswith("| - |"), row
    strategies.plot(one, tmp_path / "one.png")
    assert is_png(tmp_path / "one.png")


def test_the_sharding_comparison_of_two_recorded_runs_is_tabled_and_drawn(tmp_path):
    result = json.loads((RESULTS / "fsdp.json").read_text())["sharding"]
    by = {r["strategy"]: r for r in result["runs"]}
    again = fsdp.summarize(result["runs"])  # the ratios recomputed from the runs themselves
    assert again["fsdp_over_ddp"] == pytest.approx(result["fsdp_over_ddp"])
    held = by["fsdp"]["held_mib_per_rank"] / by["ddp"]["held_mib_per_rank"]
    assert 0.4 < held < 0.6  # 2 workers: a shard holds about half of a replica's state
    table = fsdp.table(result).splitlines()
    assert len(table) == 2 + 2 + 1, table  # header, rule, a row per run, the ratios
    assert table[-1].startswith(f"| FSDP / DDP | {held:.2f}x (1/2 = 0.50) |"), table[-1]
    fsdp.plot(result, tmp_path / "fsdp.png")
    assert is_png(tmp_path / "fsdp.png")


@pytest.mark.parametrize("text", ["ps", "ps:half", "mirrored:full", ","])
def test_a_bad_strategy_run_is_one_line(text):
    with pytest.raises(UserError, match=r"--strategy-runs .*STRATEGY:full\|slowed|names no run"):
        strategies.parse_runs(text)


def test_the_strategy_runs_parse_in_order():
    assert strategies.parse_runs(",".join(strategies.RUNS)) == [
        ("multiworker", False), ("ps", False), ("multiworker", True), ("ps", True)]


def test_the_launcher_comparison_of_recorded_runs_is_tabled_and_drawn(tmp_path):
    recorded = json.loads((RESULTS / "bench.json").read_text())
    summary = bench.summarize(recorded["runs"])  # the summary recomputed from the runs
    for job, s in summary.items():
        for k, ratio in s["ratio_ray_over_plain"].items():
            assert ratio == pytest.approx(recorded["summary"][job]["ratio_ray_over_plain"][k]), (job, k)
    table = bench.table(summary)
    assert "| ddp_autoencoder (torchrun) | wall |" in table and "| tf_cnn (TF_CONFIG) |" in table
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ddp_autoencoder")]
    assert len(rows) == len(bench.PHASES)
    assert "| ddp_autoencoder | ray |" in bench.startup_table(recorded["runs"])
    bench.plot(summary, tmp_path / "bench.png")
    assert is_png(tmp_path / "bench.png")
