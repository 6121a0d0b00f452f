"""Worker planning: fail fast, with one line, on what the cluster can't run."""

import pytest

from trainkit.cluster import check_batch, plan_workers
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
