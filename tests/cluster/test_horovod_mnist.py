"""The Horovod job on Ray (HorovodTrainer, Train V1) across both nodes, and under horovodrun."""

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import BIN, REPO, plain_env, read_manifest
from horovod_mnist import Net

from trainkit import versions

JOB = "horovod_mnist"


def check_model(out, world, epochs: int = 1, iters: tuple[int, int] = (12, 3)):
    """The published model and its manifest; `iters`: each rank's (training, validation)
    iterations of an epoch (1500 training digits and 297 test digits over `world` ranks: at batch
    64 and 2 ranks, 12 and 3)."""
    m = read_manifest(out)
    assert m["world_size"] == world and m["replicas_in_sync"] is True
    assert len(m["replica_digests"]) == world and len(set(m["replica_digests"])) == 1
    assert m["parity"]["max_abs_diff"] <= 1e-4
    assert m["inputs"][0]["shape"] == ["batch", 1, 28, 28] and m["outputs"][0]["shape"] == ["batch", 10]
    assert m["versions"]["horovod"] == versions.values()["PIN_HOROVOD"]
    assert m["metrics"]["world_size"] == world and m["metrics"]["epoch"] == epochs
    assert (m["metrics"]["train_iters"], m["metrics"]["val_iters"]) == iters
    assert 0 <= m["metrics"]["val_accuracy"] <= 1 and m["metrics"]["val_loss"] > 0
    assert m["metrics"]["allreduce_s"] > 0  # time waiting in optimizer.synchronize()
    return m


def check_parity_from_checkpoint(runs, out) -> None:
    """The parity the manifest claims, checked here without the code under test: the last
    checkpoint's weights in a fresh Net against onnxruntime on new digits."""
    last = sorted(runs.rglob("state.pt"), key=lambda p: p.parent.name)[-1]
    model = Net().eval()
    model.load_state_dict(torch.load(last, map_location="cpu")["model"])
    x = np.random.rand(5, 1, 28, 28).astype(np.float32)
    y = ort.InferenceSession(str(out / "model.onnx")).run(None, {"input": x})[0]
    with torch.no_grad():
        np.testing.assert_allclose(y, model(torch.from_numpy(x)).numpy(), atol=1e-4)


# HorovodTrainer across both nodes: its run is the fault-tolerance test's (test_fault_tolerance.py,
# a worker killed mid-run), which checks its model, manifest and parity with check_model and
# check_parity_from_checkpoint above.


def test_horovodrun_without_ray(cluster, tmp_path):
    """Under horovodrun, and tracked: rank 0 finds the run history in the cluster record."""
    out = tmp_path / "model"
    env = {**plain_env(tmp_path), "DLC_CONFIG": str(cluster.config)}
    proc = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
         "jobs/horovod_mnist.py", "--epochs", "1", "--batch-size", "64", "--name", "hvdrun",
         "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_model(out, 2)
    m = read_manifest(out)
    assert m["launcher"] == "horovodrun"
    assert m["tracking"]["state"] == "tracked" and m["tracking"]["epochs_logged"] == 1, m["tracking"]


@pytest.fixture(scope="module")
def refused(cluster, tmp_path_factory):
    """Both bad data folders submitted at once: {case: process}."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    return cluster.submit_all(JOB, {case: ["--data-dir", str(tmp / case), "--storage-path", str(tmp / "runs")]
                                    for case in ("missing", "empty")})


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_bad_data_dir(refused, case):
    proc = refused[case]
    assert proc.returncode != 0
    assert "failed with exit code 2" in proc.stdout, proc.stdout[-2000:]  # the job's one-line error
    message = "does not exist" if case == "missing" else "no MNIST under"
    assert any(line.startswith(f"{JOB}: error: ") and message in line
               for line in proc.stdout.splitlines()), proc.stdout[-2000:]
