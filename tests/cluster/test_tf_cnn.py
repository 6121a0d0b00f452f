"""The TensorFlow CNN: MirroredStrategy alone, bad data. MultiWorkerMirroredStrategy across both nodes
through `ray job submit` is test_fault_tolerance.py's TensorFlow run (a worker killed mid-run),
whose model check_model() checks too."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, read_manifest
from PIL import Image

JOB = "tf_cnn"
TINY = ["--per-class", "24", "--epochs", "1", "--batch-size", "8"]


def check_model(out, world, strategy):
    m = read_manifest(out)
    assert m["framework"] == "tensorflow" and m["strategy"] == strategy
    assert m["world_size"] == world and m["replicas_in_sync"] is True
    assert len(m["replica_digests"]) == world and len(set(m["replica_digests"])) == 1
    assert m["parity"]["max_abs_diff"] <= 1e-4
    assert m["inputs"][0]["shape"][1:] == [150, 150, 3] and m["outputs"][0]["shape"][1:] == [1]
    assert m["classes"] == ["china", "flower"]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(m["metrics"])


def test_mirrored_in_one_process(tmp_path):
    out = tmp_path / "model"
    proc = subprocess.run([sys.executable, "jobs/tf_cnn.py", "--strategy", "mirrored", *TINY,
                           "--name", "tfm", "--output", str(out),
                           "--storage-path", str(tmp_path / "runs")], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "DLC_TRACKING_URL": "off"})  # not in make demo's run history
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_model(out, 1, "mirrored")


@pytest.fixture(scope="module")
def refused(cluster, tmp_path_factory):
    """The three bad data folders and more parameter servers than nodes, submitted at once:
    {case: process}."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    (tmp / "one class" / "cats").mkdir(parents=True)
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(tmp / "one class" / "cats" / "a.png")
    cases = {case: ["--data", str(tmp / case), "--storage-path", str(tmp / "runs")]
             for case in ("missing", "empty", "one class")}
    cases["parameter servers"] = ["--strategy", "ps", "--num-ps", "3", "--num-workers", "2",
                                  "--name", "three-ps", "--storage-path", str(tmp / "runs")]
    return cluster.submit_all(JOB, cases)


@pytest.mark.parametrize("case", ["missing", "empty", "one class"])
def test_bad_data(refused, case):
    proc = refused[case]
    assert proc.returncode != 0
    assert "failed with exit code 2" in proc.stdout, proc.stdout[-2000:]  # the job's one-line error
    message = {"missing": "does not exist", "empty": "no class folders",
               "one class": "exactly 2 class folders"}[case]
    assert any(line.startswith(f"{JOB}: error: ") and message in line
               for line in proc.stdout.splitlines()), proc.stdout[-2000:]


def test_more_parameter_servers_than_nodes_is_one_line_before_any_role_starts(refused):
    proc = refused["parameter servers"]
    assert proc.returncode != 0 and "failed with exit code 2" in proc.stdout, proc.stdout[-2000:]
    errors = {line for line in proc.stdout.splitlines() if line.startswith(f"{JOB}: error: ")}
    assert errors == {f"{JOB}: error: --num-ps 3 is more than the cluster's 2 node(s), and each parameter "
                      "server takes a node of its own; use --num-ps <= 2"}, proc.stdout[-2000:]
    assert "roles:" not in proc.stdout and "Role" not in proc.stdout  # no actor was started
