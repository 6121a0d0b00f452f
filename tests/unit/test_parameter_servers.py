"""ParameterServerStrategy's roles without a cluster: their TF_CONFIGs, the checks that refuse a
run before anything starts (one line each, nothing written), and what the chief makes of the
coordinator's news about its workers."""

import json
import logging
from pathlib import Path

import pytest

from trainkit import parameter_servers as ps
from trainkit.errors import UserError


def test_local_tf_configs_give_each_role_its_own_address_in_one_cluster():
    configs = [json.loads(c) for c in ps.local_tf_configs(workers=2, ps=1)]
    assert [(c["task"]["type"], c["task"]["index"]) for c in configs] == [
        ("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    cluster = configs[0]["cluster"]
    assert all(c["cluster"] == cluster for c in configs)
    addresses = [a for role in ps.ROLES for a in cluster[role]]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    found = [ps.read_tf_config({"TF_CONFIG": json.dumps(c)}) for c in configs]
    assert [(role, i) for _, role, i in found] == [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    assert ps.roles_of(cluster) == {"chief": 1, "ps": 1, "worker": 2}


def test_a_tf_config_without_parameter_servers_is_not_theirs():
    mwms = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
    assert ps.read_tf_config({"TF_CONFIG": json.dumps(mwms)}) is None
    assert ps.read_tf_config({}) is None


@pytest.mark.parametrize("spec,message", [
    ("{not json", "TF_CONFIG is malformed"),
    ('{"cluster": {"ps": ["a:1"], "worker": ["b:1"]}, "task": {"type": "worker", "index": 0}}',
     "a parameter-server run needs one chief, parameter servers and workers"),
    ('{"cluster": {"chief": ["c:1"], "ps": ["a:1"], "worker": ["b:1"]}, '
     '"task": {"type": "worker", "index": 3}}',
     "TF_CONFIG's task worker 3 is not in its cluster"),
])
def test_a_bad_parameter_server_tf_config_is_one_line(spec, message):
    with pytest.raises(UserError, match=message):
        ps.read_tf_config({"TF_CONFIG": spec})


def test_more_parameter_servers_than_nodes_is_refused():
    ps.check_roles(num_ps=2, nodes=2)
    with pytest.raises(UserError, match=r"--num-ps 3 is more than the cluster's 2 node\(s\).*<= 2"):
        ps.check_roles(num_ps=3, nodes=2)


MWMS_TF_CONFIG = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                             "task": {"type": "worker", "index": 0}})
BAD = [
    ([], {}, "--strategy ps needs several processes: submit to Ray, or start its roles with `python -m "
             "trainkit.parameter_servers -- python <job> --strategy ps`; or use --strategy mirrored"),
    (["--num-ps", "0"], {}, "argument --num-ps: 0 must be at least 1; see --help"),
    ([], {"TF_CONFIG": MWMS_TF_CONFIG}, "--strategy ps but TF_CONFIG names no parameter servers"),
    (["--strategy", "multiworker"], {"TF_CONFIG": ps.local_tf_configs(2, 1)[0]},
     "--strategy multiworker but TF_CONFIG names parameter servers (ps tasks): use --strategy ps or auto"),
]


@pytest.mark.parametrize("args,env,line", BAD, ids=["alone", "num-ps 0", "tf_config without ps",
                                                    "multiworker with ps"])
def test_a_parameter_server_run_that_cannot_start_is_one_line_and_writes_nothing(
        tmp_path, monkeypatch, capsys, args, env, line):
    from tf_cnn import TFCNN

    from trainkit.job import run_from_command_line

    monkeypatch.setenv("DLC_HOME", str(tmp_path))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        run_from_command_line(TFCNN(), ["--strategy", "ps", "--per-class", "8", *args])
    assert exited.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"tf_cnn: error: {line}"] or (len(errors) == 1 and line in errors[0]), errors
    assert list(tmp_path.iterdir()) == []


def coordinator_says(msg: str, device: str, where: str = "/tf/coordinator/cluster_coordinator.py"):
    return logging.LogRecord("tensorflow", logging.ERROR, where, 1, msg, (device, "e", "e"), None)


def test_the_chief_records_each_lost_and_returning_worker_once(capfd):
    cluster = ps.cluster_spec("h:1", ["h:2"], ["h:3", "h:4"])
    events = ps.WorkerEvents("tf_cnn", cluster)
    events.epoch = 2
    lost = coordinator_says("Worker %s failed with %r:%s", "/job:worker/replica:0/task:1")
    assert events.filter(lost) is False and events.filter(lost) is False  # said once, TF's line dropped
    events.epoch = 4
    back = coordinator_says("Worker %s has been recovered.", "/job:worker/replica:0/task:1")
    assert events.filter(back) is False
    assert events.filter(coordinator_says("Remote function on worker %s failed with", "x")) is False
    assert events.filter(coordinator_says("Cluster successfully recovered.", "")) is False
    assert events.filter(coordinator_says("Anything else", "", where="/tf/keras/callbacks.py")) is True
    assert [(e["worker"], e["event"], e["epoch"]) for e in events.events] == [(1, "lost", 2), (1, "back", 4)]
    assert capfd.readouterr().out.splitlines() == [
        "[tf_cnn] worker 1 (h:4) lost in epoch 2: its steps go to the other workers",
        "[tf_cnn] worker 1 (h:4) back in epoch 4: it takes steps again"]


def test_the_coordinators_words_are_those_the_chief_listens_for():
    """TF's cluster coordinator logs these, to TF's logger; a TensorFlow that words them otherwise
    fails here, not silently in a run whose lost workers go unrecorded. (Read, not imported: this
    process holds torch, which TensorFlow is kept apart from.)"""
    import importlib.util

    tf = Path(importlib.util.find_spec("tensorflow").submodule_search_locations[0])
    source = (tf / "python/distribute/coordinator" / ps.WorkerEvents.COORDINATOR).read_text()
    assert f'"{ps.WorkerEvents.LOST}' in source and f'"{ps.WorkerEvents.BACK}' in source
    assert "from tensorflow.python.platform import tf_logging as logging" in source
    assert f"getLogger('{ps.TF_LOGGER}')" in (tf / "python/platform/tf_logging.py").read_text()
