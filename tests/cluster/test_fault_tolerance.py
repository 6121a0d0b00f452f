"""Real failures mid-run: single Ray Train workers killed (a whole node lost: the emulated tier's
`docker kill` of a node mid-run). Each run must finish, resume from its latest checkpoint (not from
scratch) and publish a verified model whose manifest counts the restarts. The recovery time
(failure -> first step after it) is printed. A second run of a running run's name is refused."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import ray_noise, read_manifest


def wait_for(what, predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


class Running:
    """A `ray job submit` in the background whose output is read as it comes."""

    def __init__(self, cluster, job: str, *args: str):
        cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address",
               f"http://127.0.0.1:{cluster.dashboard_port}", "--working-dir", ".", "--",
               "python", f"jobs/{job}.py", *args]
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[2],
                                     env=cluster.client_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, text: str, timeout: float = 600) -> None:
        """Until a line holds `text` (e.g. epoch 2's progress: epoch 1's checkpoint is committed)."""
        wait_for(repr(text), lambda: any(text in line for line in self.lines)
                 or self.proc.poll() is not None, timeout)
        assert any(text in line for line in self.lines), "".join(self.lines[-40:])

    def finish(self, timeout: float = 900) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        out = "".join(self.lines)
        print(out[-6000:])
        assert self.proc.returncode == 0, out[-4000:]
        return out


def wait_registered(storage: Path, timeout: float = 120) -> None:
    """Until Ray Train's controller has registered a checkpoint of the run (Train V2 writes its
    checkpoint manager's snapshot after it commits one). A report returns on the worker before the
    controller has polled it, so a node killed right after epoch 1's report could still restart
    from scratch: seen once in a clean-clone run."""
    def registered() -> bool:
        for snap in storage.rglob("checkpoint_manager_snapshot.json"):
            try:
                if json.loads(snap.read_text()).get("checkpoint_results"):
                    return True
            except (OSError, ValueError):
                pass  # being rewritten
        return False
    wait_for("checkpoint registered by Ray Train's controller", registered, timeout)


def kill(pids) -> float:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return time.time()


def check_recovered(out_dir: Path, killed_at: float, last_epoch: int) -> dict:
    m = read_manifest(out_dir)
    r = m["restarts"]
    assert r["count"] >= 1 and r["resumed_after_epochs"][0] >= 1  # from a checkpoint, not scratch
    assert m["metrics"]["epoch"] == last_epoch and m["parity"]["max_abs_diff"] <= 1e-4
    restart = r["attempts"][1]
    assert "first_step_at" in restart, f"the run had trained every epoch before the kill: {r}"
    recovery = restart["first_step_at"] - killed_at
    print(f"recovery: {recovery:.1f} s from the failure to the first training step after it "
          f"(resumed after epoch {restart['resumed_after_epoch']}, {restart['world_size']} worker(s))")
    assert recovery > 0
    return m


def temp_root(cluster) -> str:
    """The local cluster's own temp root (dlcluster/local_cluster.py records it): its processes name it."""
    return json.loads((cluster.config / "clusters" / "local" / "state.json").read_text())["temp_root"]


def node_pids(temp_dir: str) -> set[int]:
    """A local node's processes: those naming its temp dir (raylet, agents) and their children."""
    roots = [p for p in psutil.process_iter(["cmdline"])
             if any(temp_dir in part for part in (p.info["cmdline"] or []))]
    return {q.pid for p in roots for q in [p, *p.children(recursive=True)]}


def ray_train_workers(cluster) -> list[int]:
    """The Ray Train workers of this cluster only: the emulated tier may train on the same host
    (its node containers' processes are this host's too)."""
    mine = node_pids(temp_root(cluster))
    return sorted(p.pid for p in psutil.process_iter(["cmdline"]) if p.pid in mine
                  and any("RayTrainWorker" in part for part in (p.info["cmdline"] or [])))


# Horovod's epochs over the built-in digits last a third of a second: 20 of them, so the kill
# lands mid-run (with 3, a CI run once killed the worker after the last epoch had trained). The TF
# run is long enough (its restart alone takes half a minute) for a second run of its name to be
# refused meanwhile.
@pytest.mark.parametrize("job,args,epochs", [
    ("horovod_mnist", ["--batch-size", "16"], 20),
    ("tf_cnn", ["--per-class", "96", "--batch-size", "4"], 3),
])
def test_a_killed_worker_restarts_from_the_checkpoint(cluster, tmp_path, job, args, epochs):
    args = [*args, "--epochs", str(epochs), "--num-workers", "2", "--name", "killed",
            "--storage-path", str(tmp_path / "runs")]
    running = Running(cluster, job, *args, "--output", str(tmp_path / "model"))
    second = None
    if job == "tf_cnn":  # its name and storage again while it trains: refused before any worker
        running.wait_for(f"epoch 1/{epochs}: ")
        second = Running(cluster, job, *args, "--output", str(tmp_path / "second"))
    running.wait_for(f"epoch 2/{epochs}: ")  # epoch 1's checkpoint is reported
    if job != "horovod_mnist":  # Train V2; Horovod runs on V1, whose report commits in Tune
        wait_registered(tmp_path / "runs")
    else:  # V1 persists the checkpoint's folder on the storage before the report returns
        wait_for("a persisted checkpoint", lambda: any((tmp_path / "runs").rglob("checkpoint_*")), 120)
    workers = ray_train_workers(cluster)
    assert workers, "no Ray Train worker process found"
    killed_at = kill(workers[-1:])
    if second is not None:
        check_refused(second, running, job, tmp_path / "second")
    output = running.finish()
    m = check_recovered(tmp_path / "model", killed_at, last_epoch=epochs)
    assert ray_noise(output) == []  # quiet across a restart too (a new worker group, a new watcher)
    assert m["world_size"] == 2 and m["replicas_in_sync"] is True
    if job == "tf_cnn":  # the TF job's run across both nodes: MultiWorkerMirrored, its model whole
        from test_tf_cnn import check_model
        check_model(tmp_path / "model", 2, "multiworker")
    else:  # the Horovod job's run across both nodes (HorovodTrainer), its model whole: 750 digits
        # a rank in batches of 16 (47 iterations), 149 test digits (10)
        from test_horovod_mnist import check_model, check_parity_from_checkpoint
        assert check_model(tmp_path / "model", 2, epochs=epochs, iters=(47, 10))["launcher"] == "ray"
        check_parity_from_checkpoint(tmp_path / "runs", tmp_path / "model")


def check_refused(second: Running, first: Running, job: str, output: Path) -> None:
    """A second run of a running run's --name and storage: its driver stopped with one line, before
    any worker started, while the first goes on."""
    second.proc.wait(timeout=300)
    second.reader.join(timeout=30)
    refused = "".join(second.lines)
    assert first.proc.poll() is None, "the first run ended before the second was refused"
    errors = [line for line in refused.splitlines() if line.startswith(f"{job}: error: ")]
    assert second.proc.returncode != 0 and len(set(errors)) == 1, refused[-3000:]  # (the job's
    # log and the CLI's tail of it may both show the line)
    assert re.fullmatch(rf"{job}: error: run killed is running already \(\S+ pid \d+ since "
                        r"\S+\): wait for it to end, or give this one another --name", errors[0]), errors
    assert "RayTrainWorker" not in refused and not output.exists()
