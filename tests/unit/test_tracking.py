"""Where a run's history goes and what its manifest says when it cannot (trainkit.tracking); the
server itself is the cluster tier's (tests/cluster/test_tracking.py)."""

from __future__ import annotations

import socket

import pytest

from dlcluster import record
from trainkit import tracking
from trainkit.contract import Run


def a_record(tmp_path, **fields) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    record.ClusterRecord(name="local", kind="local", job_api="http://127.0.0.1:8265", token_path=str(token),
                         nodes=[record.Node(name="head", ip=None, role="head", cpus=1, gpus=0)],
                         **fields).write(tmp_path)


@pytest.fixture
def clean(monkeypatch, tmp_path):
    for name in (tracking.URL_ENV, tracking.AUTH_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DLC_CONFIG", str(tmp_path))
    return monkeypatch


def test_the_flag_then_the_nodes_environment_then_the_record(clean, tmp_path):
    assert tracking.setting("off") == (None, "--tracking off")
    assert tracking.setting("http://127.0.0.9:5000/") == ("http://127.0.0.9:5000", "--tracking")
    assert tracking.setting("auto")[0] is None  # no record, no environment: off, and why
    a_record(tmp_path, tracking_url="http://127.0.0.1:5001", tracking_auth_path=str(tmp_path / "auth"))
    assert tracking.setting("auto") == ("http://127.0.0.1:5001", "cluster local's record")
    clean.setenv(tracking.URL_ENV, "http://127.0.0.10:5000")  # a Ray process on a cluster's node
    assert tracking.setting("auto") == ("http://127.0.0.10:5000", tracking.URL_ENV)
    clean.setenv(tracking.URL_ENV, "off")  # off for everything started from here (the unit tier)
    assert tracking.setting("auto") == (None, f"{tracking.URL_ENV}=off")
    assert tracking.check(a_run(tracking_off=f"{tracking.URL_ENV}=off"), 1)["state"] == "off"


def test_the_harness_reads_the_record_as_data_and_checks_its_url(clean, tmp_path):
    """The harness reads the current record as a file (its model is the operator's package, which
    the harness never imports): a record edited by hand is held to the flag's own check, and a file
    that is no record is no server."""
    import json

    a_record(tmp_path, tracking_url="http://127.0.0.1:5001")
    data = json.loads((tmp_path / "cluster.json").read_text())
    (tmp_path / "cluster.json").write_text(json.dumps({**data, "tracking_url": "http://u:secret@10.0.0.1:5000"}))
    url, why = tracking.setting("auto")
    assert url is None and why.startswith("cluster local's record: ") and "secret" not in why, why
    for text in ("[]", "{", json.dumps({"tracking_url": "http://127.0.0.1:5001"}),
                 json.dumps({**data, "tracking_url": 5001})):
        (tmp_path / "cluster.json").write_text(text)
        assert tracking.setting("auto") == (None, "no tracking server: none in the environment or the "
                                                  "cluster record"), text


def test_credentials_from_the_nodes_file_else_the_records(clean, tmp_path):
    assert tracking.credentials() is None
    (tmp_path / "auth").write_text("dlc:from-record\n")
    a_record(tmp_path, tracking_url="http://127.0.0.1:5001", tracking_auth_path=str(tmp_path / "auth"))
    assert tracking.credentials() == ("dlc", "from-record")
    (tmp_path / "node_auth").write_text("dlc:from-node")
    clean.setenv(tracking.AUTH_ENV, str(tmp_path / "node_auth"))
    assert tracking.credentials() == ("dlc", "from-node")
    (tmp_path / "node_auth").write_text("no-colon")
    assert tracking.credentials() is None


def test_the_record_takes_only_a_url_and_an_absolute_credentials_path(tmp_path):
    with pytest.raises(ValueError, match="must look like http://HOST:PORT"):
        a_record(tmp_path, tracking_url="127.0.0.1:5000")
    with pytest.raises(ValueError, match="must be an absolute path"):
        a_record(tmp_path, tracking_url="http://127.0.0.1:5000", tracking_auth_path="auth")


def a_run(**kw) -> Run:
    return Run("ddp_autoencoder", "r", "local", "/tmp/s", "/tmp/o", 2, 8, 1e-3, False, **kw)


def test_the_manifest_says_off_or_untracked_and_why():
    off = tracking.check(a_run(tracking_off="--tracking off"), 2)
    assert off == {"state": "off", "why": "--tracking off"}
    refused = "http://127.0.0.1:5000: the server refused the credentials (401)"
    assert tracking.check(a_run(tracking_off=refused), 2) == {"state": "untracked", "why": refused}


def test_a_server_that_is_down_is_one_reason_not_a_stack(clean):
    """A real connection to a port nothing listens on: the client fails at once (no retries) and
    the reason is a few words."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the request: nothing listens there
    # a run id with "401" in it: the failed request's URL carries it (issue 53: read as a 401)
    for run_id in ("abc", "a401b4010000401f"):
        target = tracking.Target(f"http://127.0.0.1:{port}", "1", run_id)
        m = tracking.check(a_run(tracking=target), 2)
        assert m["state"] == "untracked" and m["why"] == \
            f"http://127.0.0.1:{port}: the server is not reachable (connection refused)", m
    assert tracking.why(Exception("API request failed: 401 Unauthorized")) == \
        "the server refused the credentials (401)"


def test_the_manifest_names_the_first_reason_logging_stopped_not_a_later_answer(clean):
    """Logging stopped at epoch 2 (the server refused the connection); by publishing time the server
    answers again: the manifest says why the run is untracked, without asking again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = tracking.Target(f"http://127.0.0.1:{port}", "1", "c0ffee401")
    run = a_run(tracking=target)
    tracking.log_epoch("ddp_autoencoder", run, {"epoch": 2, "loss": 0.5})  # a real refused request
    first = "logging stopped at epoch 2: the server is not reachable (connection refused)"
    assert tracking._stopped[target.run_id] == first
    tracking.stopped_on_workers(run, ["logging stopped at epoch 3: a later reason"])  # kept: the first
    assert tracking.check(run, 4) == {"url": target.url, "run_id": target.run_id, "page": target.page(),
                                      "state": "untracked", "why": f"{target.url}: {first}"}
    # on Ray the driver learns it from the workers' Attempts actor: the first reason they sent
    other = a_run(tracking=tracking.Target(target.url, "1", "beef"))
    tracking.stopped_on_workers(other, [
        "logging stopped at epoch 1: the server refused the credentials (401)",
        "logging stopped at epoch 2: the server is not reachable"])
    assert tracking.check(other, 2)["why"].endswith("epoch 1: the server refused the credentials (401)")


def test_statuses_are_read_from_the_answer_not_from_digits_anywhere():
    from mlflow.exceptions import MlflowException

    refused = MlflowException("API request to endpoint /api/2.0/mlflow/runs/get failed with error code "
                              "401 != 200. Response body: 'You are not authenticated'",
                              error_code="UNAUTHENTICATED")
    assert tracking.why(refused) == "the server refused the credentials (401)"
    denied = MlflowException("failed with error code 403 != 200", error_code="PERMISSION_DENIED")
    assert tracking.why(denied) == "the server refused this user (403)"
    assert tracking.why(Exception("run 4010 not found (error code 404 != 200)")) == \
        "run 4010 not found (error code 404 != 200)"


def test_a_run_links_to_the_page_the_operator_opens_and_keeps_the_nodes_beside_it(clean, tmp_path):
    """On a node DLC_TRACKING_URL is the head's private address, which the operator's browser cannot
    reach; DLC_TRACKING_PAGE_URL (cluster-up's ray.env, or make submit from the submitting
    operator's record) is the tunnel's end: the printed link and the manifest's `page` use it, the
    nodes' address is kept beside it. A flag or this machine's own record is the page itself."""
    clean.setenv(tracking.PAGE_ENV, "http://127.0.0.1:5300/")
    assert tracking.page_url("http://node-1:5000", tracking.URL_ENV) == "http://127.0.0.1:5300"
    assert tracking.page_url("http://mlflow.lab:5000", "--tracking") is None
    assert tracking.page_url("http://127.0.0.1:5001", "cluster local's record") is None
    clean.setenv(tracking.PAGE_ENV, "127.0.0.1:5300")  # not a URL: the server's own address serves
    assert tracking.page_url("http://node-1:5000", tracking.URL_ENV) is None
    target = tracking.Target("http://node-1:5000", "3", "abc", "http://127.0.0.1:5300")
    view = "?workflowType=machine_learning"  # MLflow's model-training view, not its GenAI one
    assert target.page() == f"http://127.0.0.1:5300/#/experiments/3/runs/abc{view}"
    assert target.pages() == (f"http://127.0.0.1:5300/#/experiments/3/runs/abc{view} (on the cluster's "
                              f"network: http://node-1:5000/#/experiments/3/runs/abc{view})")
    assert target.manifest() == {"page": f"http://127.0.0.1:5300/#/experiments/3/runs/abc{view}",
                                 "node_page": f"http://node-1:5000/#/experiments/3/runs/abc{view}"}
    assert tracking.run_page("http://h:5000", "3", "abc", "model-metrics") == \
        f"http://h:5000/#/experiments/3/runs/abc/model-metrics{view}"
    same = tracking.Target("http://127.0.0.1:5001", "3", "abc")
    assert same.pages() == same.page() and same.manifest() == {"page": same.page()}
    # make submit's runtime env carries the submitting operator's tunnel end (and the commit)
    token = tmp_path / "token"
    token.write_text("t")
    r = record.ClusterRecord(name="emulated", kind="ansible", job_api="http://127.0.0.1:8275",
                             token_path=str(token), tracking_url="http://127.0.0.1:5300",
                             nodes=[record.Node(name="node-1", ip="127.0.0.11", role="head", cpus=1,
                                                gpus=0)])
    assert r.runtime_env("c0ffee-dirty") == {"env_vars": {"DLC_SUBMIT_COMMIT": "c0ffee-dirty",
                                                          tracking.PAGE_ENV: "http://127.0.0.1:5300"}}
    assert r.model_copy(update={"tracking_url": None}).runtime_env(None) == {"env_vars": {}}


def test_credentials_in_the_environments_url_turn_tracking_off_and_are_never_echoed(clean):
    """DLC_TRACKING_URL gets the --tracking flag's check: a URL with user:password in it would land
    in the run's log line and manifest; the run goes on untracked, its reason naming the host only."""
    clean.setenv(tracking.URL_ENV, "https://dlc-jobs:s3cret@127.0.0.1:5000/")
    url, how = tracking.setting("auto")
    assert url is None and "s3cret" not in how and "dlc-jobs" not in how
    assert how.startswith(f"{tracking.URL_ENV} 'https://***@127.0.0.1:5000' holds credentials"), how
    clean.setenv(tracking.URL_ENV, "https://127.0.0.1:5000/")
    assert tracking.setting("auto") == ("https://127.0.0.1:5000", tracking.URL_ENV)
