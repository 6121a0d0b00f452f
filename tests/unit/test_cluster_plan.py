"""Worker planning: fail fast, with one line, on what the cluster can't run."""

import pytest

from trainkit.cluster import check_batch, check_storage, plan_workers, worker_python
from trainkit.errors import UserError


def test_cpu_plan():
    p = plan_workers(2, "auto", {"CPU": 2.0}, nodes=2)
    assert (p.num_workers, p.use_gpu) == (2, False)


def test_gpu_auto_needs_one_gpu_per_worker():
    assert plan_workers(2, "auto", {"CPU": 8, "GPU": 2}, nodes=2).use_gpu
    assert not plan_workers(3, "auto", {"CPU": 8, "GPU": 2}, nodes=2).use_gpu
    assert not plan_workers(2, "false", {"CPU": 8, "GPU": 2}, nodes=2).use_gpu


def test_more_workers_than_cpus():
    with pytest.raises(UserError, match=r"--num-workers 8 needs 8 CPUs .* has 2 in all "
                                        r"\(2 node\(s\)\); use --num-workers <= 2"):
        plan_workers(8, "auto", {"CPU": 2.0}, nodes=2)


def test_gpu_requested_but_missing():
    with pytest.raises(UserError, match="needs 2 GPUs but the Ray cluster has 0"):
        plan_workers(2, "true", {"CPU": 2.0}, nodes=1)


def test_batch_larger_than_a_workers_share():
    assert check_batch(64, 5825, 2) == 2912
    with pytest.raises(UserError, match=r"--batch-size 64 is larger than each worker's share "
                                        r"of the training set \(25 samples.*<= 25"):
        check_batch(64, 50, 2)


def test_strict_spread_needs_a_node_per_worker():
    plan = plan_workers(3, "false", {"CPU": 6}, nodes=3, placement="STRICT_SPREAD")
    assert plan.placement == "STRICT_SPREAD"
    with pytest.raises(UserError, match=r"STRICT_SPREAD .* --num-workers 4 is more than the cluster's "
                                        r"3 node\(s\); use --num-workers <= 3"):
        plan_workers(4, "false", {"CPU": 8}, nodes=3, placement="STRICT_SPREAD")


def test_auto_workers_train_across_the_whole_cluster():
    assert plan_workers(0, "auto", {"CPU": 6}, nodes=3).num_workers == 3
    assert plan_workers(0, "auto", {"CPU": 2}, nodes=3).num_workers == 2
    gpu = plan_workers(0, "auto", {"CPU": 48, "GPU": 8}, nodes=2)
    assert (gpu.num_workers, gpu.use_gpu) == (8, True)
    assert plan_workers(0, "false", {"CPU": 48, "GPU": 8}, nodes=2).num_workers == 2


def test_elastic_workers_need_room_for_the_fewest():
    plan = plan_workers((1, 3), "false", {"CPU": 2}, nodes=2)
    assert (plan.min_workers, plan.num_workers) == (1, 3)
    assert plan.describe() == "1-3 (elastic) worker(s) on CPU"
    with pytest.raises(UserError, match="--num-workers 4 needs 4 CPUs"):
        plan_workers((4, 6), "false", {"CPU": 2}, nodes=2)
    with pytest.raises(UserError, match=r"cannot change its number of workers \(Ray Train V1\)"):
        plan_workers((1, 2), "false", {"CPU": 2}, nodes=2, elastic=False)


# Ray's own worker start (RuntimeEnvContext.exec_worker: `bash -c "exec <py_executable> ..."`) with the
# py_executable a TF job sets: the node's $DLC_TF_PYTHON, else the driver's interpreter
RAY_EXEC = """import sys
from ray._private.runtime_env.context import RuntimeEnvContext
from ray.core.generated.common_pb2 import Language
RuntimeEnvContext(py_executable=sys.argv[1]).exec_worker(["-c", "import sys; print(sys.executable)"],
                                                        Language.PYTHON)
"""


def worker_interpreter(py_executable: str, env: dict) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DLC_TF_PYTHON"} | env
    proc = subprocess.run([sys.executable, "-c", RAY_EXEC, py_executable], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return proc.stdout.strip().splitlines()[-1]


def test_tf_workers_run_the_interpreter_their_node_names(tmp_path, monkeypatch):
    import sys

    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    runtime_env = worker_python("DLC_TF_PYTHON")
    other = tmp_path / "tf venv" / "python"  # another interpreter, in a path with a space
    other.parent.mkdir()
    other.symlink_to(sys.executable)
    assert worker_interpreter(runtime_env["py_executable"], {"DLC_TF_PYTHON": str(other)}) == str(other)
    assert worker_interpreter(runtime_env["py_executable"], {}) == sys.executable  # not set on the node
    assert worker_python(None) is None
    # a job submitted with its own py_executable keeps it
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"py_executable": "python -X dev"}}')
    assert worker_python("DLC_TF_PYTHON") is None


def test_a_node_gone_after_the_storage_check_listed_it_is_not_named_blind(tmp_path, monkeypatch):
    """check_storage lists the alive nodes, then probes each: a node that leaves Ray in between (here
    really removed from a real two-node Ray, the listing taken before) is no reason to fail the run
    (it did: Ray's TaskUnschedulableError, once in the emulated tier after a node was taken away)."""
    import ray.cluster_utils

    # no dashboard: it would take 8265 when free, the port make demo's cluster (or the emulated tier's
    # stand-in for it, beside this tier in make test) is known by
    cluster = ray.cluster_utils.Cluster(initialize_head=True,
                                        head_node_args={"num_cpus": 1, "include_dashboard": False})
    gone = cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        listed = ray.nodes()
        assert sum(n["Alive"] for n in listed) == 2
        cluster.remove_node(gone)
        monkeypatch.setattr(ray, "nodes", lambda: listed)  # the moment between listing and probing
        check_storage(str(tmp_path / "runs"), timeout=30)  # the head sees it: nothing to name
    finally:
        ray.shutdown()
        cluster.shutdown()
