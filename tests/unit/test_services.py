"""The services reached through the tunnel, declared once (roles/cluster_defaults's `dlc_services`): every
consumer agrees with the list, and a fifth service added to the list alone reaches the control
role's tunnel and held-port check and the lifecycle's arguments (dlcluster/lifecycle.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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
    Make variable or tunnel variable itself (the record's probes, one per service, may)."""
    cluster_sh = (REPO / "dlcluster/lifecycle.py").read_text()
    tunnel = (ANSIBLE / "roles/control_host/tasks/tunnel.yml").read_text()
    held = (ANSIBLE / "roles/control_host/tasks/checks.yml").read_text()
    for s in services.services():
        assert s.make_var not in cluster_sh and s.local_port not in cluster_sh, s.make_var
        assert s.make_var not in held, s.make_var
        if s.local_port != "dlc_tunnel_port":  # the job API's: the tunnel's own, named in its task names
            assert s.local_port not in tunnel, s.local_port


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
    assert forwards(ANSIBLE / "roles", tmp_path) == [
        f"127.0.0.1:8265:{head}:8265", f"127.0.0.1:9090:{head}:9090", f"127.0.0.1:3000:{head}:3000",
        "127.0.0.1:5000:/run/dlc-mlflow/server.sock"]  # the run history listens on its socket (head_socket)
    # Grafana needs the metrics stack: off with either; the run history off alone
    assert forwards(ANSIBLE / "roles", tmp_path, "-e", "dlc_metrics=false", "-e", "dlc_tracking=false") == [
        f"127.0.0.1:8265:{head}:8265"]
    assert forwards(ANSIBLE / "roles", tmp_path, "-e", "dlc_grafana=false", "-e",
                    "dlc_tunnel_port=18265") == [
        f"127.0.0.1:18265:{head}:8265", f"127.0.0.1:9090:{head}:9090",
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
