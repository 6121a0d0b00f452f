"""The harness's training metrics: exported through a real Ray's metrics agent, and nothing (and
no error) outside Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EPOCH = {"samples_per_s": 123.5, "epoch": 2, "loss": 0.25, "val_loss": 0.5, "world_size": 2,
         "dataflow_s": 1.5, "processing_s": 3.0, "epoch_s": 5.0, "device": "cpu"}


def test_outside_ray_nothing_is_exported_and_training_goes_on():
    code = ("import sys; from trainkit.metrics import export_epoch; "
            f"sys.exit(0 if export_epoch('ddp_autoencoder', 'r', {EPOCH!r}) is False else 1)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def series(text: str, name: str) -> dict[tuple, float]:
    """{(sorted label pairs without Ray's own): value} of one metric in Prometheus' text format."""
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        ours = ("run", "dlc_job", "phase", "metric")
        out[tuple(sorted((k, v) for k, v in labels.items() if k in ours))] = float(m.group(2))
    return out


def test_an_epochs_metrics_reach_rays_metrics_agent():
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        @ray.remote
        def epoch():
            from trainkit.metrics import export_epoch

            return export_epoch("ddp_autoencoder", "run-1", EPOCH)

        assert ray.get(epoch.options(runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}).remote())
        port = ray.nodes()[0]["MetricsExportPort"]
        deadline, text = time.time() + 60, ""
        while time.time() < deadline and "ray_dlc_train_phase_seconds" not in text:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            time.sleep(1)
    finally:
        ray.shutdown()
    run = (("dlc_job", "ddp_autoencoder"), ("run", "run-1"))
    assert series(text, "ray_dlc_train_samples_per_second") == {run: 123.5}, text[-2000:]
    assert series(text, "ray_dlc_train_first_epoch_samples_per_second") == {run: 123.5}
    assert series(text, "ray_dlc_train_epoch") == {run: 2.0}
    # the job's own metrics by name; the harness's counters (world_size, device) are not among them
    assert series(text, "ray_dlc_train_value") == {
        tuple(sorted((*run, ("metric", "loss")))): 0.25, tuple(sorted((*run, ("metric", "val_loss")))): 0.5}
    assert series(text, "ray_dlc_train_phase_seconds") == {
        tuple(sorted((*run, ("phase", p)))): v for p, v in
        (("dataflow", 1.5), ("processing", 3.0), ("epoch", 5.0))}


def test_a_runs_series_outlive_its_workers_until_the_last_epoch_is_exported():
    """On Ray, rank 0 hands each epoch to the run's Attempts actor on the driver's node: the
    series come from it (with the starts counted), stay after the worker that trained is gone,
    and the driver's hold returns once this node's agent exports the last epoch."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        from trainkit.cluster import on_this_node
        from trainkit.metrics import hold_until_exported
        from trainkit.on_ray import Attempts

        attempts = on_this_node(Attempts)

        @ray.remote(max_calls=1)  # the worker process ends after its task, as a run's workers do
        def rank0(attempts):
            import os

            from trainkit.metrics import export_epoch

            attempts.start.remote(0, 2, 0.0)
            for epoch in (1, 2):
                assert export_epoch("ddp_autoencoder", "run-2", {**EPOCH, "epoch": epoch}, attempts)
            return os.getpid()

        worker = ray.get(rank0.remote(attempts))
        # the worker's export calls and this one come from two callers: Ray orders neither after
        # the other, so the actor may not have taken epoch 2 yet (a run's driver holds on the
        # agent's /metrics, not on this)
        deadline = time.time() + 30
        while ray.get(attempts.last_exported.remote()) != 2 and time.time() < deadline:
            time.sleep(0.1)
        assert ray.get(attempts.last_exported.remote()) == 2
        deadline = time.time() + 30
        while psutil.pid_exists(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not psutil.pid_exists(worker), "the worker that trained did not end"
        waited = hold_until_exported("run-2", 2, timeout=30)
        assert waited is not None and waited < 30
        port = ray.nodes()[0]["MetricsExportPort"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        # a run that never exported this epoch is not waited on past the timeout, and says so
        assert hold_until_exported("run-2", 3, timeout=1) is None
    finally:
        ray.shutdown()
    run = (("dlc_job", "ddp_autoencoder"), ("run", "run-2"))
    assert series(text, "ray_dlc_train_epoch") == {run: 2.0}, text[-2000:]
    assert series(text, "ray_dlc_train_starts") == {run: 1.0}
    assert series(text, "ray_dlc_train_first_epoch_samples_per_second") == {run: 123.5}


# ---- the metrics role's Prometheus configuration and alert rules, rendered by Ansible itself

ANSIBLE = REPO / "ansible"
RENDER_PLAY = """
- hosts: ray_nodes
  connection: local
  gather_facts: false
  vars_files: [{a}/roles/cluster_defaults/defaults/main.yml, {a}/roles/ray/defaults/main.yml,
               {a}/roles/ray/vars/main.yml, {a}/roles/metrics/defaults/main.yml,
               {a}/roles/grafana/defaults/main.yml]
  tasks:
    - ansible.builtin.set_fact:
        dlc_node_ip: "{{{{ dlc_node_ip }}}}"
        dlc_node_iface: eth0
        # the first worker has two GPUs (roles/nvidia's count), the others none
        nvidia_gpu_count: "{{{{ 2 if inventory_hostname == groups['ray_workers'][0] else 0 }}}}"
    - ansible.builtin.template:
        src: {a}/roles/metrics/templates/{{{{ item }}}}.j2
        dest: "{out}/{{{{ item }}}}"
        mode: "0644"
      loop: [prometheus.yml, dlc-alerts.yml]
      when: inventory_hostname == groups['ray_head'][0]
    - ansible.builtin.template:
        src: {a}/roles/grafana/templates/{{{{ item }}}}.j2
        dest: "{out}/{{{{ item }}}}"
        mode: "0644"
      loop: [datasources.yml, dashboards.yml, grafana-server.conf]
      when: inventory_hostname == groups['ray_head'][0]
    - ansible.builtin.file:
        path: "{out}/{{{{ inventory_hostname }}}}"
        state: directory
        mode: "0755"
    - ansible.builtin.template:
        src: "{{{{ item }}}}.j2"
        dest: "{out}/{{{{ inventory_hostname }}}}/{{{{ item | basename }}}}"
        mode: "0644"
      loop: [{a}/roles/metrics/templates/dlc-dcgm-exporter.service,
             {a}/roles/metrics/templates/nvidia-dcgm-exporter.conf,
             {a}/roles/ray/templates/ray.env]
"""


def render(inventory: str, out: Path) -> None:
    play = out / "render.yml"
    play.write_text(RENDER_PLAY.format(a=ANSIBLE, out=out))
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home()),
           "DLC_CONFIG": str(out),
           # the play is not beside ansible/'s playbooks: ray.env's head address needs their filters
           "ANSIBLE_FILTER_PLUGINS": str(ANSIBLE / "filter_plugins")}
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i",
                           str(ANSIBLE / "inventories" / inventory / "hosts.yml"), str(play)],
                          cwd=ANSIBLE, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "scripts/promtool.sh"), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for inventory in ("example", "emulated"):
        out[inventory] = tmp_path_factory.mktemp(inventory)
        render(inventory, out[inventory])
    return out


@pytest.mark.parametrize("inventory", ["example", "emulated"])
def test_the_scrape_configuration_and_rules_pass_prometheus_own_checker(rendered, inventory):
    checked = promtool("check", "config", str(rendered[inventory] / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 8 rules found" in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    config = yaml.safe_load((rendered[inventory] / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["static_configs"] for j in config["scrape_configs"]}
    hosts = yaml.safe_load((ANSIBLE / "inventories" / inventory / "hosts.yml").read_text())["all"]
    nodes = [h for g in ("ray_head", "ray_workers") for h in hosts["children"][g]["hosts"]]
    # every node's exporter and Ray metrics, each labelled with the node's name
    for job, port in (("node", 9100), ("ray", 8080)):
        assert [c["labels"]["node"] for c in jobs[job]] == nodes
        assert all(c["targets"][0].endswith(f":{port}") for c in jobs[job])
    # NVIDIA's DCGM exporter only on the node with GPUs
    gpu = hosts["children"]["ray_workers"]["hosts"]
    gpu_node = next(iter(gpu))
    dcgm = [(c["labels"]["node"], c["targets"][0].rsplit(":", 1)[1]) for c in jobs["dcgm"]]
    assert dcgm == [(gpu_node, "9400")]


ALERT_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{{job="node", node="node-2"}}'
        values: '1 0 0 0 0'
      - series: 'up{{job="node", node="node-1"}}'
        values: '1 1 1 1 1'
      - series: 'node_filesystem_size_bytes{{node="node-1", mountpoint="{storage}", fstype="nfs"}}'
        values: '100 100 100 100 100'
      - series: 'ray_dlc_train_samples_per_second{{{run}}}'
        values: '100 100 40 40 40 40 40 40 40'
      - series: 'ray_dlc_train_first_epoch_samples_per_second{{{run}}}'
        values: '100 100 100 100 100 100 100 100 100'
    alert_rule_test:
      - eval_time: 4m
        alertname: NodeExporterDown
        exp_alerts:
          - exp_labels: {{severity: critical, job: node, node: node-2}}
            exp_annotations:
              summary: "node-2: its node exporter does not answer (the node is down, or the exporter is)"
      - eval_time: 4m
        alertname: SharedStorageUnreachable
        exp_alerts: []
      - eval_time: 8m
        alertname: RunSlowedDown
        exp_alerts:
          - exp_labels: {{severity: warning, run: r, dlc_job: ddp_autoencoder, job: ray, node: node-1}}
            exp_annotations:
              summary: "run r (ddp_autoencoder): 40 samples/s, under 50 % of its first epoch's"
      - eval_time: 8m
        alertname: DiskAlmostFull
        exp_alerts: []
"""


def test_the_alert_rules_fire_on_what_they_name_and_not_otherwise(rendered, tmp_path):
    """promtool's rule tests: a node's exporter gone for 2 minutes, a run at 40 % of its first
    epoch's samples/s for 5; the shared storage mounted and no disk full: nothing."""
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(ALERT_TESTS.format(rules=rendered["emulated"] / "dlc-alerts.yml",
                                        storage="/srv/dlcluster",
                                        run='run="r", dlc_job="ddp_autoencoder", job="ray", node="node-1"'))
    checked = promtool("test", "rules", str(tests))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# ---- NVIDIA's DCGM exporter on a GPU node, for each runtime; Grafana's provisioning and dashboard


def node_ip(inventory: str, role: str) -> tuple[str, str]:
    hosts = yaml.safe_load((ANSIBLE / "inventories" / inventory / "hosts.yml").read_text())["all"]
    name, h = next(iter(hosts["children"][role]["hosts"].items()))
    return name, (h or {}).get("ip") or h["ansible_host"]


@pytest.mark.parametrize("inventory", ["example", "emulated"])
def test_a_gpu_nodes_dcgm_exporter_answers_its_private_address_under_either_runtime(rendered, inventory):
    name, ip = node_ip(inventory, "ray_workers")
    # docker nodes: NVIDIA's container, every GPU through the container toolkit
    unit = (rendered[inventory] / name / "dlc-dcgm-exporter.service").read_text()
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert start.split() == ["ExecStart=/usr/bin/docker", "run", "--rm", "--name", "dlc-dcgm-exporter",
                             "--gpus", "all", "--cap-add", "SYS_ADMIN", "--network", "host",
                             "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless@sha256:"
                             "60d3b00ac80b4ae77f94dae2f943685605585ad9e92fdccda3154d009ae317cc",
                             "-a", f"{ip}:9400"]  # pinned by digest: what runs as root cannot change
    # host nodes: NVIDIA's package, its unit's command replaced by one with the private address
    dropin = (rendered[inventory] / name / "nvidia-dcgm-exporter.conf").read_text().splitlines()
    i = dropin.index("ExecStart=")
    assert dropin[i + 1] == ("ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/default-counters.csv "
                             f"-a {ip}:9400")


PANEL_RULES = """
groups:
  - name: panels
    rules:
{rules}
"""
# Grafana's own variables, as Grafana substitutes them before Prometheus sees a query
GRAFANA_VARS = {"$__rate_interval": "1m", "$run": ".*", "$node": ".*"}


def parses(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Prometheus' own parser on each expression: as a recording rule, through promtool."""
    rules = "\n".join(f"      - record: panel_{i}\n        expr: {json.dumps(e)}"
                      for i, e in enumerate(exprs))
    path = tmp_path / "panels.yml"
    path.write_text(PANEL_RULES.format(rules=rules))
    return promtool("check", "rules", str(path))


def test_grafanas_dashboard_queries_parse_and_name_only_the_provisioned_data_source(rendered, tmp_path):
    provisioned = yaml.safe_load((rendered["emulated"] / "datasources.yml").read_text())["datasources"]
    _, head_ip = node_ip("emulated", "ray_head")
    assert [(d["uid"], d["type"], d["url"], d["isDefault"]) for d in provisioned] == [
        ("prometheus", "prometheus", f"http://{head_ip}:9090", True)]
    providers = yaml.safe_load((rendered["emulated"] / "dashboards.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == ["/var/lib/grafana/dashboards/dlcluster",
                                                         "/var/lib/grafana/dashboards/ray"]
    dashboard = json.loads((ANSIBLE / "roles/grafana/files/dlc-cluster.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    uids = {d["uid"] for d in provisioned}
    exprs = []
    for panel in panels:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in uids, panel["title"]
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{panel['title']}: a variable the dashboard does not define: {expr}"
            exprs.append(expr)
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] in uids
        metric = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["query"])
        assert metric, var["query"]
        exprs.append(metric.group(1))
    titles = {p["title"] for p in panels}
    assert {"Samples/s", "GPU utilisation", "GPU memory used", "GPU power", "Network", "Disk", "CPU busy",
            "Seconds per phase, last epoch"} <= titles
    checked = parses(exprs, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in checked.stdout + checked.stderr
    # the same check refuses a query Prometheus cannot parse
    broken = parses(["sum by (node) (rate(node_cpu_seconds_total[1m])"], tmp_path)
    assert broken.returncode != 0


def test_grafana_asks_for_a_login_and_ray_embeds_it_from_the_tunnel(rendered):
    _, head_ip = node_ip("emulated", "ray_head")
    settings = dict(line.removeprefix("Environment=").split("=", 1)
                    for line in (rendered["emulated"] / "grafana-server.conf").read_text().splitlines()
                    if line.startswith("Environment="))
    assert settings["GF_SERVER_HTTP_ADDR"] == head_ip and settings["GF_SERVER_HTTP_PORT"] == "3000"
    assert settings["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and settings["GF_USERS_ALLOW_SIGN_UP"] == "false"
    # the password comes from a file on the head, never from the settings
    assert settings["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/etc/grafana/dlc-admin-password"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in settings
    head, _ = node_ip("emulated", "ray_head")
    worker, _ = node_ip("emulated", "ray_workers")
    lines = (rendered["emulated"] / head / "ray.env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    assert (env["RAY_GRAFANA_HOST"], env["RAY_GRAFANA_IFRAME_HOST"], env["RAY_PROMETHEUS_HOST"]) == (
        f"http://{head_ip}:3000", "http://127.0.0.1:3000", f"http://{head_ip}:9090")
    # the workers run no dashboard
    assert "RAY_GRAFANA_HOST" not in (rendered["emulated"] / worker / "ray.env").read_text()
