"""The same job files under their frameworks' own launchers, without Ray: torchrun (plain DDP, the
baseline the PyTorch DDP tutorial shows) and MultiWorkerMirroredStrategy from a TF_CONFIG per
process. Each publishes a verified model whose manifest has the same fields as the Ray path's."""

import os
import subprocess
import sys

from conftest import BIN, REPO, read_manifest

from trainkit import launch

AE_TINY = ["--image-size", "40x60", "--batch-size", "8", "--limit", "60"]


def plain_env(tmp_path) -> dict:
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "DLC_HOME": str(tmp_path)}
    return env


def test_torchrun_two_processes_train_publish_and_resume(cluster, tmp_path):
    """`torchrun --nproc_per_node 2 jobs/ddp_autoencoder.py`; a second run resumes; the manifest
    has every field the Ray path's has."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "jobs/ddp_autoencoder.py", *AE_TINY,
           "--name", "tr"]
    first = subprocess.run([*cmd, "--epochs", "1"], cwd=REPO, env=plain_env(tmp_path),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "models" / "tr"
    m = read_manifest(out)
    assert m["launcher"] == "torchrun" and m["world_size"] == 2 and m["metrics"]["world_size"] == 2
    assert m["replicas_in_sync"] is True and len(m["replica_digests"]) == 2
    assert (m["metrics"]["train_iters"], m["metrics"]["val_iters"]) == (4, 1)  # as on Ray
    assert m["metrics"]["allreduce_s"] > 0  # the DDP comm hook saw the gradient all-reduce
    second = subprocess.run([*cmd, "--epochs", "2"], cwd=REPO, env=plain_env(tmp_path),
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming after epoch 1" in second.stdout and read_manifest(out)["metrics"]["epoch"] == 2

    # the same job on Ray: the same manifest fields, down to the metrics
    on_ray = tmp_path / "ray-model"
    proc = cluster.submit("ddp_autoencoder", *AE_TINY, "--num-workers", "2", "--epochs", "1",
                          "--storage-path", str(tmp_path / "ray-runs"), "--name", "tr",
                          "--output", str(on_ray))
    assert proc.returncode == 0
    r = read_manifest(on_ray)
    assert set(r) == set(m) and set(r["metrics"]) == set(m["metrics"]) and set(r["run"]) == set(m["run"])
    assert r["launcher"] == "ray"


def start_tf_workers(tmp_path, name: str) -> list[subprocess.Popen]:
    procs = []
    for tf_config in launch.local_tf_configs(2):
        env = {**plain_env(tmp_path), "TF_CONFIG": tf_config}
        procs.append(subprocess.Popen(
            [sys.executable, "jobs/tf_cnn.py", "--per-class", "24", "--epochs", "1",
             "--batch-size", "8", "--name", name], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_tf_config_two_workers_without_ray(tmp_path):
    """MultiWorkerMirroredStrategy from TF_CONFIG, one process per worker, as TF's docs start it.

    The ports are picked free and then handed to TF, so another process (the fixture cluster's
    Ray opens many) can take one in between, and the workers' rendezvous then waits for ever:
    a rendezvous stuck for 5 minutes is killed and tried once more on fresh ports, and said."""
    for attempt in (1, 2):
        procs = start_tf_workers(tmp_path, "tfc")
        try:
            outs = [p.communicate(timeout=300)[0] for p in procs]
            break
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.communicate()
            assert attempt == 1, "the two TF_CONFIG workers hung twice"
            print("the TF_CONFIG workers' rendezvous hung; trying again on fresh ports")
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    m = read_manifest(tmp_path / "models" / "tfc")
    assert m["launcher"] == "tf_config" and m["strategy"] == "multiworker" and m["world_size"] == 2
    assert m["replicas_in_sync"] is True and len(set(m["replica_digests"])) == 1
    assert m["parity"]["max_abs_diff"] <= 1e-4
    assert not os.path.exists(tmp_path / "models" / "tfc" / "model.rejected.onnx")
