"""The TF job under its framework's own launcher, without Ray: MultiWorkerMirroredStrategy from a
TF_CONFIG per process, as TF's docs start it; it publishes a verified model. (The autoencoder
under torchrun: test_ddp_autoencoder.py.)"""

import os
import subprocess
import sys

from conftest import REPO, plain_env, read_manifest

from trainkit import launch


def start_tf_workers(tmp_path, name: str, config) -> list[subprocess.Popen]:
    procs = []
    for tf_config in launch.local_tf_configs(2):
        env = {**plain_env(tmp_path), "TF_CONFIG": tf_config, "DLC_CONFIG": str(config)}
        procs.append(subprocess.Popen(
            [sys.executable, "jobs/tf_cnn.py", "--per-class", "24", "--epochs", "1",
             "--batch-size", "8", "--name", name], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def test_tf_config_two_workers_without_ray(cluster, tmp_path):
    """MultiWorkerMirroredStrategy from TF_CONFIG, one process per worker, as TF's docs start it.

    The ports are picked free and then handed to TF, so another process (the fixture cluster's
    Ray opens many) can take one in between, and the workers' rendezvous then waits for ever:
    a rendezvous stuck for 5 minutes is killed and tried once more on fresh ports, and said."""
    for attempt in (1, 2):
        procs = start_tf_workers(tmp_path, "tfc", cluster.config)  # the record: the run history
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
    assert m["tracking"]["state"] == "tracked", m["tracking"]  # logged by rank 0, the chief
    assert m["parity"]["max_abs_diff"] <= 1e-4
    assert not os.path.exists(tmp_path / "models" / "tfc" / "model.rejected.onnx")
