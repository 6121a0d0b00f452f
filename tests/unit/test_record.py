"""The cluster record: its model, its one-line errors, its two writers (the local cluster and the
Ansible control_host role's template), and the client env made from it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from dlcluster import record
from trainkit.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def remote(**changes) -> dict:
    nodes = [{"name": "node-1", "ip": "172.31.251.11", "role": "head", "cpus": 8, "gpus": 1,
              "runtime": "host"},
             {"name": "node-2", "ip": "172.31.251.12", "role": "worker", "cpus": 8, "gpus": 1,
              "runtime": "host"},
             {"name": "node-3", "ip": "172.31.251.13", "role": "worker", "cpus": 16, "gpus": 2,
              "runtime": "docker"}]
    return {"format": record.FORMAT, "name": "lab", "kind": "ansible",
            "job_api": "http://127.0.0.1:8265",
            "token_path": "/home/u/.config/dlcluster/clusters/lab/ray_token", "nodes": nodes,
            "ssh_config": "/home/u/.config/dlcluster/clusters/lab/ssh_config", "bastion": "bastion",
            "storage": "/srv/dlcluster", "inventory": "/x/hosts.yml", **changes}


def with_node(i: int, **changes) -> dict:
    r = remote()
    r["nodes"][i] = {**r["nodes"][i], **changes}
    return r


BAD = [
    (remote(kind="cloud"), "kind: Input should be 'local' or 'ansible'"),
    (remote(job_api="127.0.0.1:8265"), "job_api: Value error, must look like http://HOST:PORT"),
    (remote(job_api="http://127.0.0.1"), "job_api: Value error, must look like http://HOST:PORT"),
    (remote(token_path="ray_token"), "token_path: Value error, must be an absolute path"),
    # credentials in a URL would reach every line and manifest that names it: refused, never echoed
    (remote(tracking_url="http://dlc:s3cret@127.0.0.1:5000"),
     "tracking_url: Value error, holds credentials (http://***@127.0.0.1:5000): give "
     "http(s)://HOST:PORT alone"),
    (remote(name=""), "name: String should have at least 1 character"),
    (remote(name="a/b"), "name: String should match pattern"),
    (remote(nodes=[]), "nodes: List should have at least 1 item"),
    (remote(bastion=None), "ssh_config and bastion are set together"),
    (remote(ssh_config="ssh_config"), "ssh_config: Value error, must be an absolute path"),
    (with_node(2, runtime="podman"), "nodes.2.runtime: Input should be 'host' or 'docker'"),
    (remote(runtime="docker"), "runtime: Extra inputs are not permitted"),
    (remote(colour="blue"), "colour: Extra inputs are not permitted"),
    (with_node(1, cpus=1.5), "nodes.1.cpus: Input should be a valid integer"),
    (with_node(2, gpus=-1), "nodes.2.gpus: Input should be greater than or equal to 0"),
    (with_node(2, ip="not-an-ip"), "nodes.2.ip: Value error"),
    (with_node(2, name="node-1"), "node name 'node-1' appear(s) more than once"),
    (with_node(1, ip="172.31.251.11"), "ip 172.31.251.11 appear(s) more than once"),
    (with_node(1, role="head"), "exactly one node has role head, found 2"),
]


@pytest.mark.parametrize("data,message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_record_is_one_line_naming_the_file_and_the_fix(tmp_path, data, message):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        record.load(path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"bad cluster record {path}: ")
    assert message in line and line.endswith("rerun make cluster-up to rewrite it"), line
    assert "s3cret" not in line


def test_missing_truncated_and_foreign_records(tmp_path):
    path = tmp_path / "cluster.json"
    with pytest.raises(UserError, match=r"no cluster record at .*cluster.json: no cluster is up"):
        record.load(path)
    path.write_text(json.dumps(remote())[:100])
    with pytest.raises(UserError, match=r"cannot read the cluster record .*; rerun make cluster-up"):
        record.load(path)
    path.write_text(json.dumps({"name": "x", "kind": "local"}))  # an older or another tool's file
    with pytest.raises(UserError, match="is not a dlcluster cluster record"):
        record.load(path)


def test_write_makes_the_cluster_current_with_its_client_env(tmp_path):
    r = record.ClusterRecord.model_validate(remote())
    written = r.write(tmp_path)
    assert written == tmp_path / "clusters" / "lab" / "cluster.json"
    assert (tmp_path / "clusters" / "lab").stat().st_mode & 0o777 == 0o700
    assert record.load(written) == record.load(tmp_path / "cluster.json") == r
    env = (tmp_path / "ray-client.env").read_text().splitlines()
    assert env == ["export RAY_ADDRESS=http://127.0.0.1:8265", "export RAY_AUTH_MODE=token",
                   f"export RAY_AUTH_TOKEN_PATH={r.token_path}",
                   "export RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES=''", "export RAY_LOGGER_LEVEL=warning"]


def ansible_template(inventory: str, out: Path, cases: dict[str, dict]) -> dict[str, dict]:
    """The control_host role's cluster.json.j2 written by Ansible itself (ansible-playbook, the
    ansible.builtin.template task record.yml runs, on this machine), its filters Ansible's own and
    `groups` and `ansible_inventory_sources` those of the shipped inventory: one play per case of
    variables, all in one run. The records it wrote, by case."""
    template = REPO / "ansible/roles/control_host/templates/cluster.json.j2"
    roles = REPO / "ansible/roles"
    plays = [{"name": case, "hosts": "localhost", "connection": "local", "gather_facts": False,
              # the services as declared, and which of them this cluster runs (control_running)
              "vars_files": [str(roles / "cluster_defaults/defaults/main.yml"),
                             str(roles / "control_host/vars/main.yml")],
              "tasks": [{"ansible.builtin.set_fact": facts},  # above vars_files, as the play's own are
                        {"ansible.builtin.template": {"src": str(template), "dest": str(out / f"{case}.json"),
                                                      "mode": "0600"}}]}
             for case, facts in cases.items()]
    playbook = out / "record.yml"
    playbook.write_text(json.dumps(plays, indent=1))  # JSON is YAML
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
           "HOME": str(Path.home()), "DLC_CONFIG": str(out),
           # the template renders on the control host under either strategy: Ansible's own starts faster
           "ANSIBLE_STRATEGY": "linear"}
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i",
                           str(REPO / f"ansible/inventories/{inventory}/hosts.yml"), str(playbook)],
                          cwd=REPO / "ansible", capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return {case: json.loads((out / f"{case}.json").read_text()) for case in cases}


@pytest.mark.parametrize("inventory", ["example", "emulated"])
def test_the_ansible_template_writes_a_valid_record(inventory, tmp_path):
    """Both writers produce records of one schema: the template, rendered by Ansible with the facts
    of each shipped inventory, validates against the model's exported JSON Schema and the model; and
    its `bool` reads settings given as strings (`-e dlc_metrics=false`) as Ansible does: "false" is
    false."""
    import yaml

    source = REPO / f"ansible/inventories/{inventory}/hosts.yml"
    hosts = yaml.safe_load(source.read_text())["all"]
    groups = {g: list(v.get("hosts", {})) for g, v in hosts["children"].items()}
    all_hosts = {h: v or {} for g in hosts["children"].values() for h, v in (g.get("hosts") or {}).items()}
    nodes = [{"name": h, "ip": all_hosts[h].get("ip") or all_hosts[h]["ansible_host"],
              "role": "head" if h in groups["ray_head"] else "worker", "cpus": 8, "gpus": 0,
              "runtime": (all_hosts[h].get("dlc_ray_runtime")
                          or hosts["vars"].get("dlc_ray_runtime", "docker"))}
             for h in groups["ray_head"] + groups["ray_workers"]]
    cluster_dir = f"{tmp_path}/clusters/{inventory}"
    facts = dict(dlc_cluster_name=inventory, dlc_tunnel_port=8265, dlc_metrics_tunnel_port=9090,
                 dlc_grafana_tunnel_port=3000, dlc_tracking_tunnel_port=5000, dlc_cluster_dir=cluster_dir,
                 dlc_ssh_config=f"{cluster_dir}/ssh_config", dlc_shared_storage_path="/srv/dlcluster",
                 control_nodes_record=nodes)
    # what write_record.yml found (control_serving, by the record's field)
    everything_answered = {"control_serving": {"metrics_url": True, "grafana_url": True,
                                               "tracking_url": True}}
    records = ansible_template(inventory, tmp_path, {
        # what cluster-up found: Prometheus and the run history answered on the emulated cluster,
        # Grafana on the example's
        "found": {**facts, "dlc_metrics": True, "control_serving": {
            "metrics_url": inventory == "emulated", "grafana_url": inventory == "example",
            "tracking_url": inventory == "emulated"}},
        # everything answered, the settings strings as `-e` gives them: off (a service the cluster
        # does not run names no URL, whatever answered), then on
        "off": {**facts, **everything_answered, "dlc_metrics": "false", "dlc_tracking": "false"},
        "on": {**facts, **everything_answered, "dlc_metrics": "yes", "dlc_grafana": "True",
               "dlc_tracking": "on"},
        # Grafana off alone: the metrics stay
        "no-grafana": {**facts, **everything_answered, "dlc_grafana": "false"},
    })
    urls = {}
    for case, data in records.items():
        jsonschema.validate(data, record.ClusterRecord.model_json_schema())
        r = record.ClusterRecord.model_validate(data)
        assert (r.kind, r.name, r.inventory, r.bastion) == (
            "ansible", inventory, str(source), groups["bastions"][0]), case
        assert (data["nodes"], r.token_path) == (nodes, f"{cluster_dir}/ray_token"), case
        urls[case] = (r.metrics_url, (r.grafana_url, r.grafana_password_path),
                      (r.tracking_url, r.tracking_auth_path))
    # each service's URL (and its files) where the cluster runs it and it answered as it should
    metrics = "http://127.0.0.1:9090"
    grafana = ("http://127.0.0.1:3000", f"{cluster_dir}/grafana_password")
    tracking = ("http://127.0.0.1:5000", f"{cluster_dir}/tracking_auth")
    none = (None, None)
    found = (metrics, none, tracking) if inventory == "emulated" else (None, grafana, none)
    assert urls == {"found": found, "off": (None, none, none), "on": (metrics, grafana, tracking),
                    "no-grafana": (metrics, none, tracking)}


def test_the_command_line(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(remote()))
    run = [sys.executable, "-m", "dlcluster.record"]
    ok = subprocess.run([*run, "check", str(path)], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0 and "cluster lab (ansible, 3 node(s)) at http://127.0.0.1:8265" in ok.stdout
    env = subprocess.run([*run, "env", str(path)], cwd=REPO, capture_output=True, text=True)
    assert "export RAY_ADDRESS=http://127.0.0.1:8265\n" in env.stdout
    bad = subprocess.run([*run, "env", str(tmp_path / "none.json")], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("record: error: no cluster record at ")
    # the token for the dashboard's sign-in dialog, read from where the record says
    token = tmp_path / "ray_token"
    path.write_text(json.dumps(remote(token_path=str(token))))
    missing = subprocess.run([*run, "token", str(path)], cwd=REPO, capture_output=True, text=True)
    assert missing.returncode == 2 and f"no token at {token}: make cluster-up" in missing.stderr
    token.write_text("abc123\n")
    shown = subprocess.run([*run, "token", str(path)], cwd=REPO, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == "abc123\n"
    # Grafana's admin password for its sign-in page, only where the record names a Grafana
    none = subprocess.run([*run, "grafana-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert none.returncode == 2 and "cluster lab has no Grafana: make cluster-up" in none.stderr
    secret = tmp_path / "grafana_password"
    path.write_text(json.dumps(remote(token_path=str(token), grafana_url="http://127.0.0.1:3000",
                                      grafana_password_path=str(secret))))
    gone = subprocess.run([*run, "grafana-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert gone.returncode == 2 and f"no Grafana password at {secret}: make cluster-up" in gone.stderr
    secret.write_text("s3cret\n")
    shown = subprocess.run([*run, "grafana-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == "s3cret\n"
    # the run history's URL, user and password for its sign-in, only where the record names one
    none = subprocess.run([*run, "tracking-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert none.returncode == 2 and "cluster lab has no tracking server: make cluster-up" in none.stderr
    auth = tmp_path / "tracking_auth"
    path.write_text(json.dumps(remote(token_path=str(token), tracking_url="http://127.0.0.1:5000",
                                      tracking_auth_path=str(auth))))
    gone = subprocess.run([*run, "tracking-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert gone.returncode == 2 and f"no run history credentials at {auth}: make cluster-up" in gone.stderr
    auth.write_text("dlc:pw-1\n")
    shown = subprocess.run([*run, "tracking-password", str(path)], cwd=REPO, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout == "http://127.0.0.1:5000  user dlc  password pw-1\n"
    schema = json.loads(subprocess.run([*run, "schema"], cwd=REPO, capture_output=True, text=True).stdout)
    assert set(schema["required"]) >= {"name", "kind", "job_api", "token_path", "nodes"}


def test_the_client_env_is_read_as_data_never_run(tmp_path):
    """A value with shell syntax in it (here a token path) reaches `ray job submit` as it is:
    `source ray-client.env` and dlcluster submit both read it as data, and nothing it names runs."""
    import shlex
    import subprocess

    marker = tmp_path / "ran"
    odd = f"/tmp/a dir/$(touch {marker})/`touch {marker}`/ray_token"
    r = record.ClusterRecord.model_validate(remote(token_path=odd, job_api="http://127.0.0.1:9"))
    r.write(tmp_path)
    text = (tmp_path / "ray-client.env").read_text()
    assert f"export RAY_AUTH_TOKEN_PATH={shlex.quote(odd)}\n" in text
    script = f"source {tmp_path}/ray-client.env && printf %s \"$RAY_AUTH_TOKEN_PATH\""
    sourced = subprocess.run(["bash", "-c", script],
                             capture_output=True, text=True, check=True).stdout
    assert sourced == odd and not marker.exists()
    # make submit: the env parsed, then one line (nothing answers on port 9), nothing run
    proc = subprocess.run([str(Path(sys.executable).parent / "dlcluster"), "submit", "ddp_autoencoder"],
                          cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "DLC_CONFIG": str(tmp_path)}, timeout=120)
    assert proc.returncode == 2 and not marker.exists(), proc.stderr
    assert proc.stderr.strip() == ("submit: error: nothing answers on the job API http://127.0.0.1:9 of "
                                   "the cluster record; run make cluster-up (for a remote cluster: it "
                                   "reopens the tunnel)")
