"""The services reached through the tunnel, declared once (roles/cluster_defaults's `dlc_services`): every
consumer agrees with the list, and a fifth service added to the list alone reaches the control
role's tunnel and held-port check and the lifecycle's arguments (dlcluster/lifecycle.py)."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from dlcluster import record, services

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"


def role_defaults() -> dict:
    out = {}
    for f in sorted(ANSIBLE.glob("roles/*/defaults/main.yml")):
        out.update(yaml.safe_load(f.read_text()) or {})
    return out


def test_each_service_names_variables_that_exist_and_a_record_field():
    defaults = role_defaults()
    listed = services.services()
    assert [s.make_var for s in listed] == ["DASHBOARD_PORT", "METRICS_PORT", "GRAFANA_PORT", "TRACKING_PORT"]
    for s in listed:
        assert isinstance(defaults[s.local_port], int) and isinstance(defaults[s.head_port], int), s
        assert all(isinstance(defaults[v], bool) for v in s.enabled), s
        assert s.record in record.ClusterRecord.model_fields, s
        assert s.name and s.credential, s
    assert len({s.default for s in listed}) == len(listed)


def test_the_makefile_and_the_readme_give_each_service_its_default():
    makefile = (REPO / "Makefile").read_text()
    readme = (REPO / "README.md").read_text()
    exported = re.search(r"^export (.*(?:\\\n.*)*)", makefile, re.M).group(1).split()
    for s in services.services():
        assert re.search(rf"^{s.make_var}\s+\?= {s.default}$", makefile, re.M), s.make_var
        assert s.make_var in exported, s.make_var
        assert f"| `{s.make_var}` | {s.default} |" in readme, s.make_var


def test_no_consumer_lists_the_services_by_hand():
    """dlcluster's lifecycle and the control_host role's tasks loop over the list: none names a service's
    Make variable or tunnel variable itself; the record's probes, its URL fields and cluster-up's last
    words name no service with a probe (each is its entry's)."""
    cluster_sh = (REPO / "dlcluster/lifecycle.py").read_text()
    tunnel = (ANSIBLE / "roles/control_host/tasks/tunnel.yml").read_text()
    held = (ANSIBLE / "roles/control_host/tasks/checks.yml").read_text()
    said = (ANSIBLE / "roles/control_host/tasks/write_record.yml").read_text()
    template = (ANSIBLE / "roles/control_host/templates/cluster.json.j2").read_text()
    for s in services.services():
        assert s.make_var not in cluster_sh and s.local_port not in cluster_sh, s.make_var
        assert s.make_var not in held, s.make_var
        if s.local_port != "dlc_tunnel_port":  # the job API's: the tunnel's own, named in its task names
            assert s.local_port not in tunnel, s.local_port
            assert s.local_port not in said and s.local_port not in template, s.local_port
            assert s.record not in said and s.record not in template, s.record


@pytest.mark.parametrize("env,expect", [
    ({}, ["dlc_tunnel_port=8265", "dlc_metrics_tunnel_port=9090", "dlc_grafana_tunnel_port=3000",
          "dlc_tracking_tunnel_port=5000"]),
    ({"TRACKING_PORT": "15000", "DASHBOARD_PORT": "18265"},
     ["dlc_tunnel_port=18265", "dlc_metrics_tunnel_port=9090", "dlc_grafana_tunnel_port=3000",
      "dlc_tracking_tunnel_port=15000"]),
])
def test_the_playbook_gets_one_tunnel_end_per_service(env, expect, monkeypatch):
    for k in [k for k in os.environ if k.endswith("_PORT")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert [f"{var}={port}" for var, port in services.tunnel_ends().items()] == expect


FIFTH = """\
  - name: a fifth service
    make_var: FIFTH_PORT
    local_port: dlc_fifth_tunnel_port
    head_port: dlc_fifth_port
    enabled: [dlc_fifth]
    record: fifth_url
    credential: none
dlc_fifth_tunnel_port: 7777
dlc_fifth_port: 7070
dlc_fifth: true
"""

FORWARDS_PLAY = """\
- hosts: localhost
  gather_facts: false
  vars_files: [{roles}/cluster_defaults/defaults/main.yml, {roles}/cluster_defaults/vars/main.yml,
               {roles}/control_host/vars/main.yml]
  tasks:
    - ansible.builtin.debug:
        msg: "FORWARDS={{{{ control_forwards | map(attribute='forward') | join(',') }}}}"
"""


def forwards(roles: Path, tmp_path: Path, *extra: str) -> list[str]:
    play = tmp_path / "forwards.yml"
    play.write_text(FORWARDS_PLAY.format(roles=roles))
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home()),
           "DLC_CONFIG": str(tmp_path), "ANSIBLE_FILTER_PLUGINS": str(ANSIBLE / "filter_plugins"),
           "ANSIBLE_STRATEGY": "linear"}
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i",
                           str(ANSIBLE / "inventories/emulated/hosts.yml"), str(play), *extra],
                          cwd=ANSIBLE, capture_output=True, text=True, timeout=120, env=env)
    found = re.search(r"FORWARDS=([^\"\n]*)", proc.stdout)
    assert proc.returncode == 0 and found, proc.stdout[-2000:] + proc.stderr[-2000:]
    return found.group(1).split(",")


def test_the_tunnel_forwards_each_service_the_cluster_runs(tmp_path):
    head = "172.31.251.11"
    gateway = "/run/dlc-gateway/gateway.sock"  # the job API's door: the gateway's socket (head_socket)
    assert forwards(ANSIBLE / "roles", tmp_path) == [
        f"127.0.0.1:8265:{gateway}", f"127.0.0.1:9090:{head}:9090", f"127.0.0.1:3000:{head}:3000",
        "127.0.0.1:5000:/run/dlc-mlflow/server.sock"]  # the run history listens on its socket (head_socket)
    # Grafana needs the metrics stack: off with either; the run history off alone
    assert forwards(ANSIBLE / "roles", tmp_path, "-e", "dlc_metrics=false", "-e", "dlc_tracking=false") == [
        f"127.0.0.1:8265:{gateway}"]
    assert forwards(ANSIBLE / "roles", tmp_path, "-e", "dlc_grafana=false", "-e",
                    "dlc_tunnel_port=18265") == [
        f"127.0.0.1:18265:{gateway}", f"127.0.0.1:9090:{head}:9090",
        "127.0.0.1:5000:/run/dlc-mlflow/server.sock"]


def test_a_fifth_service_is_one_entry_in_the_list(tmp_path, monkeypatch):
    """Added to the list (and its variables defaulted), a service is forwarded by the tunnel, asked
    for by cluster.sh's arguments, with its Make variable checked like the others: nothing else
    changed."""
    roles = tmp_path / "roles"
    shutil.copytree(ANSIBLE / "roles/cluster_defaults", roles / "cluster_defaults")
    shutil.copytree(ANSIBLE / "roles/control_host", roles / "control_host")
    defaults = roles / "cluster_defaults/defaults/main.yml"
    text = defaults.read_text()
    anchor = "# Local port of the ssh tunnel to the head's job API"
    defaults.write_text(text.replace(anchor, FIFTH + anchor, 1))
    assert forwards(roles, tmp_path)[-1] == "127.0.0.1:7777:172.31.251.11:7070"
    monkeypatch.setattr(services, "DEFAULTS", defaults)
    assert services.tunnel_ends({})["dlc_fifth_tunnel_port"] == 7777
    with pytest.raises(services.UserError, match="^FIFTH_PORT and DASHBOARD_PORT are both 8265: "):
        services.tunnel_ends({"FIFTH_PORT": "8265"})


PROBE_PLAY = """\
- name: {case}
  hosts: localhost
  gather_facts: false
  vars_files: [{roles}/cluster_defaults/defaults/main.yml]
  tasks:
    - ansible.builtin.set_fact: {facts}
    - ansible.builtin.include_role: {{name: {roles}/control_host, tasks_from: write_record}}
"""


class Services(http.server.BaseHTTPRequestHandler):
    """Prometheus, Grafana and the run history on one port, as they answer on the head (`right`), or
    as a broken head's do: Prometheus not ready, Grafana without a login, the run history open to all."""

    right = True
    login = "Basic " + base64.b64encode(b"dlc:pw-secret").decode()

    def do_GET(self):
        path = self.path.split("?")[0]
        status = {"/-/ready": 200 if self.right else 503,
                  "/api/dashboards/uid/dlcluster": 401 if self.right else 200,
                  "/api/2.0/mlflow/experiments/search":
                      200 if not self.right or self.headers.get("Authorization") == self.login else 401}[path]
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_record_names_each_service_that_answers_through_the_tunnel_as_it_should(tmp_path):
    """tasks/write_record.yml asks each running service its probe (roles/cluster_defaults's dlc_services),
    real HTTP servers answering: where every answer is the expected one the record names the URL and
    its files and cluster-up's last words say how to sign in; where one is not (Prometheus 503,
    Grafana without a login, a run history that answers without its credentials) the record names
    none of them and one warning per service says what it answered against what was expected and
    where to look. The run history's password reaches the server and never the output."""
    servers = {}
    for case, right in (("right", True), ("broken", False)):
        servers[case] = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), type(f"Services{case}", (Services,), {"right": right}))
        threading.Thread(target=servers[case].serve_forever, daemon=True).start()
    plays = []
    for case, server in servers.items():
        port = server.server_address[1]
        folder = tmp_path / case
        folder.mkdir()
        (folder / "tracking_auth").write_text("dlc:pw-secret\n")
        facts = {"dlc_cluster_dir": str(folder), "dlc_project_python": sys.executable,
                 "control_activate": False, "dlc_metrics_tunnel_port": port, "dlc_grafana_tunnel_port": port,
                 "dlc_tracking_tunnel_port": port,
                 "control_probe_retries": 1 if right else 0,
                 "control_nodes_record": [{"name": "node-1", "ip": "172.31.251.11", "role": "head",
                                           "cpus": 2, "gpus": 0, "runtime": "host"}]}
        plays.append(PROBE_PLAY.format(case=case, roles=ANSIBLE / "roles", facts=json.dumps(facts)))
    play = tmp_path / "probes.yml"
    play.write_text("\n".join(plays))
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home()),
           "DLC_CONFIG": str(tmp_path), "ANSIBLE_FILTER_PLUGINS": str(ANSIBLE / "filter_plugins"),
           "ANSIBLE_STRATEGY": "linear", "NO_PROXY": "*"}
    try:  # the head says Grafana serves: it is waited for, and its wrong answer named
        proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i",
                               str(ANSIBLE / "inventories/emulated/hosts.yml"), "-e", "grafana_serving=true",
                               str(play)], cwd=ANSIBLE, capture_output=True, text=True, timeout=180, env=env)
    finally:
        for server in servers.values():
            server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "pw-secret" not in proc.stdout + proc.stderr
    out = re.sub(r"\s+", " ", proc.stdout)  # Ansible's output as one line: its long strings are wrapped
    right, broken = (servers[c].server_address[1] for c in ("right", "broken"))
    found = {case: record.load(tmp_path / case / "cluster.json") for case in servers}
    assert (found["right"].metrics_url, found["right"].grafana_url, found["right"].tracking_url) == (
        f"http://127.0.0.1:{right}",) * 3
    assert (found["right"].grafana_password_path, found["right"].tracking_auth_path) == (
        f"{tmp_path}/right/grafana_password", f"{tmp_path}/right/tracking_auth")
    assert (found["broken"].metrics_url, found["broken"].grafana_url, found["broken"].tracking_url,
            found["broken"].grafana_password_path, found["broken"].tracking_auth_path) == (None,) * 5
    at = f"at http://127.0.0.1:{right}"
    for said in (f"metrics: Prometheus {at} (its graph",
                 f"dashboards: Grafana {at} (user admin, its password: make grafana-password)",
                 f"run history: MLflow {at} (user dlc, its password: make tracking-password",
                 "metrics: none", "dashboards: no Grafana", "run history: none"):
        assert said in out, said
    warnings = [m.replace("''", "'") for m in re.findall(r"msg: '(warning: (?:[^']|'')*)'", out)]
    assert warnings == [
        f"warning: Prometheus on node-1 does not answer through the tunnel at http://127.0.0.1:{broken} as "
        "it should (it answered 503 where 200 was expected): make cluster-up installs it (dlc_metrics); see "
        "journalctl -u prometheus on the head; the record names no metrics_url",
        f"warning: Grafana on node-1 does not answer through the tunnel at http://127.0.0.1:{broken} as it "
        "should (it answered 200 where 401 was expected): see journalctl -u grafana-server on the head; the "
        "record names no grafana_url",
        "warning: the run history (MLflow's tracking server) on node-1 does not answer through the tunnel at "
        f"http://127.0.0.1:{broken} as it should (it answered 200 and 200 where 401 and 200 was expected, "
        "without and with credentials): see journalctl -u dlc-mlflow on the head; runs go untracked; the "
        "record names no tracking_url"], out[-4000:]
