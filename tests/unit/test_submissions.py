"""What make submit keeps per run, and make resume's one-line refusals that need no cluster (the
resume itself, after a head restart, runs in the emulated tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_record import remote

from dlcluster import record, submissions

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("DLC_CONFIG", str(tmp_path))
    (tmp_path / record.RECORD).write_text(json.dumps(remote()))
    return tmp_path


def test_the_run_is_named_by_its_flags_or_given_a_name():
    assert submissions.name_of("tf_cnn", ["--epochs", "2", "--name", "mine"]) == \
        ("mine", ["--epochs", "2", "--name", "mine"])
    assert submissions.name_of("tf_cnn", ["--name=mine"])[0] == "mine"
    run, flags = submissions.name_of("tf_cnn", ["--epochs", "2"])
    assert run.startswith("tf_cnn-") and flags == ["--epochs", "2", "--name", run]


def test_each_submission_is_kept_under_the_clusters_folder_with_its_own_id(config):
    assert submissions.keep("abc", "ddp_autoencoder", ["--name", "r1"]) == ("r1", ["--name", "r1"])
    assert submissions.keep("def-dirty", "ddp_autoencoder", ["--name", "r1"])[0] == "r1-2"
    kept = json.loads((config / "clusters/lab/runs/r1.json").read_text())
    assert kept["submissions"] == ["r1", "r1-2"] and kept["commits"] == ["abc", "def-dirty"]
    assert kept["job"] == "ddp_autoencoder" and kept["flags"] == ["--name", "r1"] and len(kept["times"]) == 2


def resume(config: Path, run: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "dlcluster"), "resume", run], cwd=REPO,
                          env={**os.environ, "DLC_CONFIG": str(config)}, capture_output=True, text=True)


def test_resuming_an_unknown_or_badly_named_run_is_one_line(config):
    submissions.keep("abc", "ddp_autoencoder", ["--name", "r1"])
    proc = resume(config, "nosuch")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"resume: error: no run nosuch was submitted to cluster lab from here "
                                   f"({config}/clusters/lab/runs/nosuch.json is missing); runs kept here: "
                                   "r1")
    proc = resume(config, "../x")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("resume: error: '../x' is not a plain run name")
    assert not (config / "x.json").exists()


def test_resuming_without_a_cluster_record_is_one_line(tmp_path):
    proc = resume(tmp_path, "r1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "no cluster record" in proc.stderr and "make cluster-up" in proc.stderr


def test_make_resume_without_run_is_one_line():
    env = {k: v for k, v in os.environ.items() if k != "RUN"}
    proc = subprocess.run([str(Path(sys.executable).parent / "dlcluster"), "resume"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "resume: error: name the run: make resume RUN=<the run's name>"
