"""The main job end to end through `ray job submit` on the 2-node cluster: training, ONNX,
manifest, and bad input that fails fast with one line and touches no checkpoint; then the
same job under torchrun, whose manifest has the Ray run's fields."""

import hashlib
import os
import subprocess

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import BIN, REPO, plain_env, ray_noise, read_manifest
from ddp_autoencoder import AutoEncoder
from PIL import Image

from dlcluster import record
from tests.promql import wait_for_query
from trainkit import data

JOB = "ddp_autoencoder"
TINY = ["--image-size", "40x60", "--batch-size", "8", "--num-workers", "2"]
AE_TINY = ["--image-size", "40x60", "--batch-size", "8", "--limit", "60"]  # torchrun: 2 processes


@pytest.fixture(scope="module")
def frames_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frames")
    for i, frame in enumerate(data.builtin_frames(60, (40, 60))):
        Image.fromarray(frame).save(folder / f"frame_{i:04d}.png")
    return folder


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def run(cluster, storage, name, *args):
    return cluster.submit(JOB, *TINY, "--storage-path", str(storage), "--name", name,
                          "--output", str(storage.parent / f"models-{name}"), *args)


@pytest.fixture(scope="module")
def trained(cluster, storage, frames_dir):
    """One epoch on a folder of frames: the run the tests below check and refuse to change (its
    resume by the same --name: the emulated tier's make resume, the torchrun test below)."""
    proc = run(cluster, storage, "e2e", "--data", str(frames_dir), "--epochs", "1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(checkpoints(storage, "e2e")) == 1
    return proc


def test_trains_on_two_nodes_and_exports_verified_onnx(storage, trained):
    proc = trained
    assert "succeeded" in proc.stdout
    assert ray_noise(proc.stdout) == []  # the run line, progress, epochs, the result: no Ray dumps
    out = storage.parent / "models-e2e"
    assert f"ONNX model: {out / 'model.onnx'}" in proc.stdout
    m = read_manifest(out)
    assert m["world_size"] == 2 and m["framework"] == "torch"
    assert m["parity"]["max_abs_diff"] <= 1e-4 and m["parity"]["samples"] == 6
    assert m["metrics"]["world_size"] == 2 and m["metrics"]["epoch"] == 1
    # 54 training frames over 2 workers in batches of 8: 4 iterations each, plus 1 validation
    assert (m["metrics"]["train_iters"], m["metrics"]["val_iters"]) == (4, 1)
    assert m["metrics"]["iters_per_epoch"] == 5
    assert m["metrics"]["samples_per_s"] > 0 and m["metrics"]["epoch_s"] > 0
    assert m["inputs"][0]["shape"] == ["batch", 3, 40, 60]
    sess = ort.InferenceSession(str(out / "model.onnx"))
    x = np.random.rand(3, 3, 40, 60).astype(np.float32)
    y = sess.run(None, {"input": x})[0]
    assert y.shape == (3, 3, 40, 60)
    # the parity the manifest claims, checked here without the code under test: the last
    # checkpoint's weights in a fresh model against onnxruntime on new inputs
    (last,) = checkpoints(storage, "e2e")[-1:]
    model = AutoEncoder().eval()
    model.load_state_dict(torch.load(storage / "e2e" / last / "state.pt", map_location="cpu")["model"])
    with torch.no_grad():
        np.testing.assert_allclose(y, model(torch.from_numpy(x)).numpy(), atol=1e-4)


def test_the_local_clusters_prometheus_has_the_runs_samples_per_second(cluster, trained, storage):
    """make cluster-up ran the distribution's prometheus (the fixture put it on PATH) over every
    node's Ray metrics: both nodes are up as targets, and the run's training samples/s is there
    under its name, as its manifest says."""
    url = record.load(cluster.config / record.RECORD).metrics_url
    if url is None:
        pytest.skip("no prometheus binary (scripts/promtool.sh --bin-dir unpacks the distribution's)")
    assert url == f"http://127.0.0.1:{cluster.dashboard_port + 1000}"
    # the nodes' metrics exporters, from Ray's own service-discovery file (also the dashboard's)
    nodes = wait_for_query(url, 'up{job="ray"}', lambda r: sum(s["value"][1] == "1" for s in r) >= 2)
    assert len({s["metric"]["instance"] for s in nodes}) >= 2
    measured = read_manifest(storage.parent / "models-e2e")["metrics"]["samples_per_s"]
    (series,) = wait_for_query(url, 'max_over_time(ray_dlc_train_samples_per_second{run="e2e"}[30m])',
                               lambda r: len(r) == 1)
    assert series["metric"]["dlc_job"] == "ddp_autoencoder"
    assert float(series["value"][1]) == pytest.approx(measured, rel=0.2)


def checkpoints(storage, name):
    return sorted(p.name for p in (storage / name).glob("checkpoint_*") if p.is_dir())


def fingerprint(storage, name):
    """Every file of a run's checkpoints with its content hash."""
    return {str(p.relative_to(storage)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((storage / name).rglob("*")) if p.is_file()}


def snapshot(models):
    """Every published file with its bytes, and where `current` points."""
    if not models.exists():
        return {}
    files = {str(p.relative_to(models)): p.read_bytes() for p in sorted(models.rglob("*")) if p.is_file()}
    return {**files, "current ->": os.readlink(models / "current")}


def bad_inputs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for i, frame in enumerate(data.builtin_frames(4, (40, 60))):
        Image.fromarray(frame).save(corrupt / f"{i}.jpg")
    (corrupt / "2.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return {
        "missing path": (["--data", str(tmp_path / "nope")], "does not exist"),
        "empty folder": (["--data", str(empty)], "no images"),
        "corrupt image": (["--data", str(corrupt)], f"cannot read image {corrupt / '2.jpg'}"),
        "batch > share": (["--limit", "60", "--batch-size", "64"], "larger than each worker's share"),
        "too many workers": (["--limit", "60", "--num-workers", "8"], "needs 8 CPUs"),
        "other shapes": (["--limit", "60", "--image-size", "60x80"], "run e2e was trained with "
                         "other shapes than asked (image_size [40, 60] -> [60, 80])"),
    }


CASES = ["missing path", "empty folder", "corrupt image", "batch > share", "too many workers", "other shapes"]


@pytest.fixture(scope="module")
def refused(cluster, storage, trained, tmp_path_factory):
    """Every bad input submitted at once against the trained run: (before, after, {case: process})
    where before/after are its checkpoints' and published files' fingerprints."""
    cases = bad_inputs(tmp_path_factory.mktemp("bad"))
    assert list(cases) == CASES
    models = storage.parent / "models-e2e"
    before = fingerprint(storage, "e2e"), snapshot(models)
    procs = cluster.submit_all(JOB, {case: [*TINY, "--storage-path", str(storage), "--name", "e2e",
                                            "--output", str(models), *args]
                                     for case, (args, _) in cases.items()})
    after = fingerprint(storage, "e2e"), snapshot(models)
    return before, after, {case: (procs[case], message) for case, (_, message) in cases.items()}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_fails_fast_with_one_line(refused, case):
    before, after, procs = refused
    proc, message = procs[case]
    assert proc.returncode != 0 and "failed" in proc.stdout
    assert "failed with exit code 2" in proc.stdout, proc.stdout[-2000:]  # the job's one-line error
    errors = [line for line in proc.stdout.splitlines() if line.startswith(f"{JOB}: error: ")]
    assert errors and message in errors[0], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout.split("Status message")[0]
    # no checkpoint and no published file changed (by any of the refused submissions)
    assert after == before


def test_torchrun_two_processes_train_publish_and_resume(storage, trained, tmp_path):
    """`torchrun --nproc_per_node 2 jobs/ddp_autoencoder.py` (plain DDP, the baseline the PyTorch
    DDP tutorial shows, no Ray); a second run resumes; the manifest has every field the Ray path's
    has (the run above, through `ray job submit`), down to the metrics."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "jobs/ddp_autoencoder.py", *AE_TINY,
           "--name", "tr"]
    env = plain_env(tmp_path)
    first = subprocess.run([*cmd, "--epochs", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "models" / "tr"
    m = read_manifest(out)
    assert m["launcher"] == "torchrun" and m["world_size"] == 2 and m["metrics"]["world_size"] == 2
    assert m["replicas_in_sync"] is True and len(m["replica_digests"]) == 2
    assert (m["metrics"]["train_iters"], m["metrics"]["val_iters"]) == (4, 1)  # as on Ray
    assert m["metrics"]["allreduce_s"] > 0  # the DDP comm hook saw the gradient all-reduce
    second = subprocess.run([*cmd, "--epochs", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming after epoch 1" in second.stdout and read_manifest(out)["metrics"]["epoch"] == 2
    r = read_manifest(storage.parent / "models-e2e")
    assert set(r) == set(m) and set(r["metrics"]) == set(m["metrics"]) and set(r["run"]) == set(m["run"])
    assert r["launcher"] == "ray"
