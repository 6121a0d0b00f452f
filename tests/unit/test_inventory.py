"""Bad inventories, each one line naming the host, the variable and the fix, before any host is
touched. The inventories are real files parsed by Ansible (`ansible-inventory --list`); the checks
are the filter the inventory_checks role runs (ansible/filter_plugins/dlc_inventory.py); two of them go
through `make cluster-up`'s script end to end. Bad Make variables of the local cluster are in
tests/cluster/test_local_cluster.py."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DLCLUSTER = str(Path(sys.executable).parent / "dlcluster")  # the installed command (make setup)
ANSIBLE = REPO / "ansible"
sys.path.insert(0, str(ANSIBLE / "filter_plugins"))

import dlc_inventory  # noqa: E402

EXAMPLE = (ANSIBLE / "inventories/example/hosts.yml").read_text()
NODE2 = "          ansible_host: 10.0.0.12\n"
NODE3 = "          ansible_host: 10.0.0.13\n"
VARS = "    dlc_shared_storage_path: /srv/dlcluster\n"
BASTION = "          ip: 10.0.0.10\n"
DCGM_TAG = "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless"


def on(anchor: str, extra: str):
    return lambda t: t.replace(anchor, anchor + extra)


BAD = [
    ("address-out-of-range", lambda t: t.replace(NODE2, "          ansible_host: 10.0.0.300\n"),
     "gpu-node-2: its private address '10.0.0.300' (`ip`, else ansible_host) is not an IPv4 address"),
    ("address-a-name", lambda t: t.replace(NODE2, "          ansible_host: gpu2.lab\n"),
     "gpu-node-2: its private address 'gpu2.lab'"),
    ("two-nodes-one-address", lambda t: t.replace(NODE3, NODE2),
     "gpu-node-3: its private address 10.0.0.12 is also gpu-node-2's: give each node its own `ip`"),
    ("runtime-unknown", lambda t: t.replace("dlc_ray_runtime: docker", "dlc_ray_runtime: podman"),
     "gpu-node-1, gpu-node-2, gpu-node-3: dlc_ray_runtime is 'podman': set docker (Ray in"),
    ("runtime-per-host", on(NODE3, "          dlc_ray_runtime: Docker\n"),
     "gpu-node-3: dlc_ray_runtime is 'Docker'"),
    ("image-from-unknown", on(NODE3, "          docker_image_from: scp\n"),
     "gpu-node-3: docker_image_from is 'scp': set bastion (pushed once to a registry"),
    ("image-archive-missing",
     on(NODE2, "          docker_image_from: archive\n          docker_image_archive: ''\n"),
     "gpu-node-2: docker_image_from is archive but docker_image_archive is empty"),
    ("storage-unknown", lambda t: t.replace("dlc_shared_storage: nfs", "dlc_shared_storage: ceph"),
     "gpu-node-1, gpu-node-2, gpu-node-3: dlc_shared_storage is 'ceph': set nfs"),
    ("storage-path-relative", lambda t: t.replace(VARS, "    dlc_shared_storage_path: srv/dlcluster\n"),
     "gpu-node-1, gpu-node-2, gpu-node-3: dlc_shared_storage_path is 'srv/dlcluster', not an absolute path"),
    ("venv-relative", on(VARS, "    dlc_venv: venv\n"), "dlc_venv is 'venv', not an absolute path"),
    ("state-dir-relative", on(NODE2, "          ray_state_dir: ~/ray\n"),
     "gpu-node-2: ray_state_dir is '~/ray', not an absolute path"),
    ("gpus-a-word", on(NODE3, "          ray_num_gpus: two\n"),
     "gpu-node-3: ray_num_gpus is 'two': it must be a whole number of at least 0"),
    ("gpus-negative", on(NODE3, "          ray_num_gpus: -1\n"), "gpu-node-3: ray_num_gpus is '-1'"),
    ("cpus-fraction", on(NODE2, "          ray_num_cpus: 1.5\n"), "gpu-node-2: ray_num_cpus is '1.5'"),
    ("object-store-tiny", on(VARS, "    ray_object_store_memory: 1000\n"),
     "ray_object_store_memory is '1000': it must be a whole number of at least 78643200"),
    ("uid-root", on(VARS, "    dlc_ray_user_uid: 0\n"), "dlc_ray_user_uid is '0'"),
    ("gcs-port-too-big", on(VARS, "    dlc_ray_gcs_port: 70000\n"),
     "dlc_ray_gcs_port is '70000': a port is a whole number from 1 to 65535"),
    ("dashboard-port-a-word", on(VARS, "    dlc_ray_dashboard_port: http\n"),
     "dlc_ray_dashboard_port is 'http'"),
    ("node-ssh-port-zero", on(NODE2, "          ansible_port: 0\n"), "gpu-node-2: ansible_port is '0'"),
    ("bastion-ssh-port", on(BASTION, "          ansible_port: 99999\n"),
     "bastion: ansible_port is '99999': a port is a whole number from 1 to 65535"),
    ("bastion-ip", lambda t: t.replace(BASTION, "          ip: 10.0.0.999\n"),
     "bastion: its private address '10.0.0.999' (`ip`) is not an IPv4 address"),
    ("worker-ports-reversed", on(VARS, "    ray_min_worker_port: 20000\n"),
     "ray_min_worker_port 20000 is not below ray_max_worker_port 19999"),
    ("metrics-port-junk", on(VARS, "    ray_metrics_export_port: 8080x\n"),
     "ray_metrics_export_port is '8080x'"),
    ("proxy-port-a-word", on(VARS, "    dlc_apt_proxy_port: three\n"), "dlc_apt_proxy_port is 'three'"),
    ("user-injects-ssh-directive", on(NODE2, '          ansible_user: "ops\\n  ProxyCommand sh -c id"\n'),
     "gpu-node-2: ansible_user is 'ops\\n  ProxyCommand sh -c id': it goes into the ssh config"),
    ("bastion-host-with-space", on(BASTION, "          ansible_host: bastion.example.org -v\n"),
     "bastion: ansible_host is 'bastion.example.org -v'"),
    ("key-path-with-quote", on(VARS, "    dlc_ssh_key: ~/.ssh/id'x\n"), "dlc_ssh_key is \"~/.ssh/id'x\""),
    ("ray-user-upper-case", on(VARS, "    dlc_ray_user: Ray Svc\n"),
     "dlc_ray_user is 'Ray Svc': an account name is lower case letters"),
    ("tracking-runs-as-ray", on(VARS, "    dlc_ray_user: ray\n    tracking_service_user: ray\n"),
     "tracking_service_user is ray, Ray's account (dlc_ray_user): the run history needs an account"),
    ("tracking-jobs-are-admin", on(VARS, "    dlc_tracking_user: ops\n    dlc_tracking_jobs_user: ops\n"),
     "dlc_tracking_jobs_user is ops, the run history's administrator (dlc_tracking_user)"),
    ("tracking-account-injects", on(VARS, "    tracking_service_user: \"x; id\"\n"),
     "tracking_service_user is 'x; id': an account name is lower case letters"),
    # the firewall's network: a network, not all of IPv4, holding every node
    ("cidr-prefix-33", on(VARS, "    firewall_private_cidr: 10.0.0.0/33\n"),
     "gpu-node-1, gpu-node-2, gpu-node-3: firewall_private_cidr is '10.0.0.0/33', not an IPv4 network"),
    ("cidr-everything", on(VARS, "    firewall_private_cidr: 0.0.0.0/0\n"),
     "gpu-node-1, gpu-node-2, gpu-node-3: firewall_private_cidr is '0.0.0.0/0': that lets 4,294,967,296"),
    # each goes into the firewall's rules (a root shell script): an address, nothing else
    ("extra-source-network", on(VARS, "    firewall_private_extra_sources: [10.0.0.0/24]\n"),
     "gpu-node-1, gpu-node-2, gpu-node-3: firewall_private_extra_sources holds '10.0.0.0/24', not an IPv4 "
     "address"),
    ("extra-source-shell", on(VARS, "    firewall_private_extra_sources: ['10.0.0.5; reboot']\n"),
     "firewall_private_extra_sources holds '10.0.0.5; reboot', not an IPv4 address"),
    ("extra-source-string", on(VARS, "    firewall_private_extra_sources: 10.0.0.5\n"),
     "firewall_private_extra_sources is '10.0.0.5', not a list"),
    ("cidr-host-bits", on(VARS, "    firewall_private_cidr: 10.0.0.11/24\n"),
     "firewall_private_cidr is '10.0.0.11/24', an address, not a network: did you mean 10.0.0.0/24?"),
    ("cidr-misses-a-node", on(VARS, "    firewall_private_cidr: 10.0.0.0/29\n"),
     "firewall_private_cidr 10.0.0.0/29 leaves out gpu-node-1 (10.0.0.11), gpu-node-2 (10.0.0.12)"),
    # paths go into unit files and shell commands as one word
    ("storage-path-with-space", lambda t: t.replace(VARS, '    dlc_shared_storage_path: "/srv/dl cluster"\n'),
     "gpu-node-1, gpu-node-2, gpu-node-3: dlc_shared_storage_path is '/srv/dl cluster': it goes into unit"),
    ("state-dir-with-semicolon", on(NODE2, "          ray_state_dir: /var/lib/dlc;reboot\n"),
     "gpu-node-2: ray_state_dir is '/var/lib/dlc;reboot'"),
    ("registry-dir-with-dollar", on(VARS, "    dlc_registry_dir: /var/lib/$HOME\n"),
     "dlc_registry_dir is '/var/lib/$HOME'"),
    # Ray's extra flags: a list, each item quoted where used
    ("extra-args-a-string", on(VARS, "    ray_start_extra_args: \"--resources '{\\\"nvme\\\": 1}'\"\n"),
     "ray_start_extra_args is '--resources \\'{\"nvme\": 1}\\'': give a list with one item per argument"),
    ("extra-args-dollar", on(VARS, "    ray_start_extra_args: [--labels, '$(id)']\n"),
     "ray_start_extra_args item '$(id)' holds a quote, $, %, backslash or line break"),
    ("registry-port-zero", on(VARS, "    dlc_registry_port: 0\n"), "dlc_registry_port is '0': a port"),
    ("push-port-too-big", on(VARS, "    docker_push_port: 70000\n"), "docker_push_port is '70000'"),
    ("registry-push-port-word", on(VARS, "    dlc_registry_push_port: five\n"),
     "dlc_registry_push_port is 'five': a port"),
    ("registry-keep-zero", on(VARS, "    dlc_registry_keep: 0\n"),
     "dlc_registry_keep is '0': it must be a whole number of at least 1"),
    ("tls-days-zero", on(VARS, "    ray_tls_days: 0\n"), "ray_tls_days is '0': it must be a whole number"),
    ("ship-poll-zero", on(VARS, "    docker_ship_poll_s: 0\n"),
     "docker_ship_poll_s is '0': it must be a whole number of at least 1"),
    ("drain-timeout-a-word", on(VARS, "    ray_upgrade_drain_timeout: soon\n"),
     "ray_upgrade_drain_timeout is 'soon': it must be a whole number of at least 1"),
    ("tls-renew-after-the-end", on(VARS, "    ray_tls_days: 30\n    ray_tls_renew_days: 30\n"),
     "ray_tls_renew_days 30 is not below ray_tls_days 30"),
    ("blacklist-a-string", on(VARS, "    nvidia_unattended_upgrades_blacklist: nvidia\n"),
     "nvidia_unattended_upgrades_blacklist is 'nvidia': give a list of package name patterns"),
    ("blacklist-with-a-quote", on(VARS, "    nvidia_unattended_upgrades_blacklist: ['nv\"; };']\n"),
     "nvidia_unattended_upgrades_blacklist is ['nv\"; };']"),
    ("tls-a-string", on(VARS, "    ray_tls: 'no'\n"), "ray_tls is 'no': give true or false"),
    ("tracking-without-tls", on(VARS, "    ray_tls: false\n"),
     "ray_tls is false, and the run history (dlc_tracking) takes its TLS certificate from the "
     "cluster's CA, which ray_tls makes: set ray_tls: true, or dlc_tracking: false"),
    ("tls-dir-relative", on(VARS, "    ray_tls_dir: etc/tls\n"),
     "ray_tls_dir is 'etc/tls', not an absolute path"),
    ("public-ports-not-a-list", on(VARS, "    firewall_public_tcp_ports: 22\n"),
     "firewall_public_tcp_ports is 22: give a list of ports from 1 to 65535"),
    ("public-port-out-of-range", on(VARS, "    firewall_public_tcp_ports: [22, 65536]\n"),
     "firewall_public_tcp_ports is [22, 65536]"),
    ("archive-with-space", on(NODE3, "          docker_image_archive: /tmp/my image.tar\n"),
     "gpu-node-3: docker_image_archive is '/tmp/my image.tar'"),
    # security review N9: what reaches a root shell, a Python string or SQL; the newest ports
    ("node-name-a-command", lambda t: t.replace("        gpu-node-3:\n", "        w$(touch${IFS}/tmp/p):\n"),
     "'w$(touch${IFS}/tmp/p)': a server's name in the inventory goes into its certificate"),
    ("tracking-user-a-quote", on(VARS, "    dlc_tracking_user: \"dlc'); import os #\"\n"),
     "dlc_tracking_user is \"dlc'); import os #\": an account name is lower case letters"),
    ("tracking-db-sql", on(VARS, "    tracking_db: 'mlflow; DROP DATABASE postgres'\n"),
     "tracking_db is 'mlflow; DROP DATABASE postgres': PostgreSQL takes it unquoted"),
    ("tracking-port-too-big", on(VARS, "    dlc_tracking_port: 70000\n"),
     "dlc_tracking_port is '70000': a port"),
    ("grafana-port-word", on(VARS, "    dlc_grafana_port: grafana\n"),
     "dlc_grafana_port is 'grafana': a port"),
    ("dcgm-port-zero", on(VARS, "    metrics_dcgm_exporter_port: 0\n"), "metrics_dcgm_exporter_port is '0'"),
    # security review N7: an image run as root with the GPUs, pulled by a tag that can be pushed again
    ("dcgm-image-by-tag", on(VARS, f"    metrics_dcgm_exporter_image: {DCGM_TAG}\n"),
     f"metrics_dcgm_exporter_image is '{DCGM_TAG}': pin it by digest"),
    ("dcgm-image-short-digest", on(VARS, "    metrics_dcgm_exporter_image: dcgm-exporter@sha256:60d3b00a\n"),
     "metrics_dcgm_exporter_image is 'dcgm-exporter@sha256:60d3b00a': pin it by digest"),
    # a line of every node's ray.env: a second line would set any variable of Ray's processes
    ("page-url-two-lines", on(VARS, '    dlc_tracking_page_url: "http://127.0.0.1:5000\\nRAY_AUTH_MODE=disabled"\n'),
     "dlc_tracking_page_url is 'http://127.0.0.1:5000\\nRAY_AUTH_MODE=disabled': a URL such as"),
    ("page-url-no-scheme", on(VARS, "    dlc_tracking_page_url: 127.0.0.1:5000\n"),
     "dlc_tracking_page_url is '127.0.0.1:5000': a URL such as http://127.0.0.1:5000"),
]

# Values only the play resolves (checked once, as `all`): the cluster's name and the config folder
CLUSTER_BAD = [
    ({"dlc_cluster_name": "team/lab"}, "all: the cluster's name is 'team/lab'"),
    ({"dlc_cluster_name": "../lab"}, "all: the cluster's name is '../lab'"),
    ({"dlc_config": "/home/me/my config"}, "all: DLC_CONFIG is '/home/me/my config'"),
    ({"dlc_tracking_name": "Run History"}, "all: dlc_tracking_name is 'Run History': the run history's name"),
    ({"dlc_tracking_name": "gpu-node-2"}, "all: dlc_tracking_name is 'gpu-node-2': the run history's name"),
]


def test_the_run_historys_name_is_no_servers():
    """A server's certificate names the server (roles/ray), and its key is its jobs': the run
    history's name may not be one; the default passes."""
    servers = ["gpu-1.lab.example", "bastion"]
    assert dlc_inventory.tracking_name_problems("run-history.dlcluster.internal", servers) == []
    (line,) = dlc_inventory.tracking_name_problems("gpu-1.lab.example", servers)
    assert line.startswith("all: dlc_tracking_name is 'gpu-1.lab.example', a server's name"), line
    assert "choose a name no server has" in line


def parsed(tmp_path: Path, text: str) -> dict:
    (tmp_path / "hosts.yml").write_text(text)
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-inventory"), "-i",
                           str(tmp_path / "hosts.yml"), "--list"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def problems(inv: dict) -> list[str]:
    nodes = [*inv["ray_head"]["hosts"], *inv["ray_workers"]["hosts"]]
    return dlc_inventory.inventory_problems(nodes, inv["_meta"]["hostvars"], inv["bastions"]["hosts"][0])


def test_the_example_inventory_has_no_problem(tmp_path):
    assert problems(parsed(tmp_path, EXAMPLE)) == []


@pytest.mark.parametrize("name,edit,expect", BAD, ids=[b[0] for b in BAD])
def test_a_bad_inventory_is_one_line_naming_host_variable_and_fix(tmp_path, name, edit, expect):
    text = edit(EXAMPLE)
    assert text != EXAMPLE
    found = problems(parsed(tmp_path, text))
    assert found and any(expect in line for line in found), found
    assert all("\n" not in line for line in found)


@pytest.mark.parametrize("cluster,expect", CLUSTER_BAD)
def test_the_cluster_name_and_config_folder_are_one_word(tmp_path, cluster, expect):
    inv = parsed(tmp_path, EXAMPLE)
    nodes = [*inv["ray_head"]["hosts"], *inv["ray_workers"]["hosts"]]
    found = dlc_inventory.inventory_problems(nodes, inv["_meta"]["hostvars"], inv["bastions"]["hosts"][0],
                                             {"dlc_cluster_name": "lab", "dlc_config": "/home/me/.config/dlc",
                                              **cluster})
    assert len(found) == 1 and found[0].startswith(expect), found


def test_the_jobs_given_the_administrators_default_name_are_refused(tmp_path):
    """The administrator's name left to its default (`dlc`, a role default the play resolves) and the
    jobs' set to it: the role would set the administrator's password to the jobs'."""
    inv = parsed(tmp_path, on(VARS, "    dlc_tracking_jobs_user: dlc\n")(EXAMPLE))
    nodes = [*inv["ray_head"]["hosts"], *inv["ray_workers"]["hosts"]]
    resolved = {"dlc_tracking_user": "dlc", "dlc_tracking_jobs_user": "dlc", "dlc_ray_user": "ray"}
    found = dlc_inventory.inventory_problems(nodes, inv["_meta"]["hostvars"], inv["bastions"]["hosts"][0],
                                             resolved)
    assert len(found) == 1, found
    assert "dlc_tracking_jobs_user is dlc, the run history's administrator" in found[0], found
    assert problems(inv) == []  # the inventory alone does not say what the administrator is called


def test_json_in_extra_args_and_a_firewall_network_that_holds_every_node_pass(tmp_path):
    text = on(VARS, "    ray_start_extra_args: [\"--resources\", '{\"nvme\": 1, \"a_b\": 2}']\n"
                    "    firewall_private_cidr: 10.0.0.0/24\n")(EXAMPLE)
    assert problems(parsed(tmp_path, text)) == []


@pytest.mark.parametrize("edit,expect", [
    (lambda t: t.replace(NODE2, "          ansible_host: 10.0.0.300\n"),
     "cluster-up: error: gpu-node-2: its private address '10.0.0.300'"),
    (lambda t: t.replace(BASTION, ""),
     "cluster-up: error: bastion: no private IPv4 address (`ip`) for the package proxy"),
])
def test_cluster_up_stops_on_the_first_check_before_any_connection(tmp_path, edit, expect):
    folder = tmp_path / "lab"
    folder.mkdir()
    # a key that does not exist: had the checks passed, the run would stop there, still offline
    (folder / "hosts.yml").write_text(edit(EXAMPLE).replace("~/.ssh/id_ed25519", str(tmp_path / "no-key")))
    env = {**os.environ, "DLC_CONFIG": str(tmp_path / "config"), "INVENTORY": str(folder / "hosts.yml")}
    proc = subprocess.run([DLCLUSTER, "up"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(expect), last
    assert "Log in to the bastion" not in proc.stdout


@pytest.mark.parametrize("folder,config,expect", [
    ("my lab", "config", "cluster-up: error: the cluster's name is its inventory's folder, 'my lab': rename"),
    ("lab", "my config", "cluster-up: error: DLC_CONFIG is "),
])
def test_a_cluster_name_or_config_folder_not_one_word_is_refused_first(tmp_path, folder, config, expect):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "hosts.yml").write_text(EXAMPLE)
    env = {**os.environ, "DLC_CONFIG": str(tmp_path / config),
           "INVENTORY": str(tmp_path / folder / "hosts.yml")}
    proc = subprocess.run([DLCLUSTER, "up"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expect), proc.stderr
    assert not (tmp_path / config / "clusters").exists()  # nothing written


@pytest.mark.parametrize("ports,expect", [
    ({"GRAFANA_PORT": "80"}, "cluster-up: error: GRAFANA_PORT=80: the tunnel's local end must be a port from "
                             "1024 to 65535"),
    ({"METRICS_PORT": "9o90"}, "cluster-up: error: METRICS_PORT=9o90: the tunnel's local end must be a port"),
    ({"GRAFANA_PORT": "8265"}, "cluster-up: error: GRAFANA_PORT and DASHBOARD_PORT are both 8265: give each "
                               "end of the tunnel its own port"),
    ({"TRACKING_PORT": "9090"}, "cluster-up: error: TRACKING_PORT and METRICS_PORT are both 9090: give each "
                                "end of the tunnel its own port"),
])
def test_the_tunnels_local_ends_are_checked_first(tmp_path, ports, expect):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "hosts.yml").write_text(EXAMPLE)
    env = {**os.environ, "DLC_CONFIG": str(tmp_path / "config"),
           "INVENTORY": str(tmp_path / "lab" / "hosts.yml"), **ports}
    for name in ("DASHBOARD_PORT", "METRICS_PORT", "GRAFANA_PORT", "TRACKING_PORT"):
        if name not in ports:
            env.pop(name, None)  # make's defaults: 8265, 9090, 3000, 5000
    proc = subprocess.run([DLCLUSTER, "up"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expect), proc.stderr
    assert not (tmp_path / "config").exists()  # nothing written


@pytest.mark.parametrize("config", ["cfg", ".", "ansible/inventories"])
def test_a_config_folder_inside_the_checkout_is_refused_before_anything_runs(config):
    proc = subprocess.run(["make", "--no-print-directory", "help", f"DLC_CONFIG={config}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith("Makefile:") and "\n" not in line
    assert line.split(" *** ", 1)[1] == (
        f"DLC_CONFIG={config} is inside the checkout {REPO}, whose files travel with every job; set "
        f"it outside, e.g. DLC_CONFIG={os.environ['HOME']}/.config/dlcluster.  Stop.")


def test_a_held_tunnel_port_is_named_with_its_holder(tmp_path):
    """roles/control_host's check before any server is touched (files/held_ports.py, as the play runs
    it): a port a process listens on is named with that process and what it most likely is; a free
    one is not named."""
    script = ANSIBLE / "roles/control_host/files/held_ports.py"
    # a process whose command line names MLflow, as the local cluster's run history's does
    holder = subprocess.Popen([sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
                               "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                               "time.sleep(60)", "mlflow"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        proc = subprocess.run([str(REPO / ".venv-ansible/bin/python"), str(script), f"{port}=TRACKING_PORT",
                               f"{free}=DASHBOARD_PORT"], capture_output=True, text=True, timeout=60)
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{port} TRACKING_PORT {Path(sys.executable).name} (pid {holder.pid}, user "
        f"{pwd.getpwuid(os.getuid()).pw_name}): the local cluster's run history; "
        "make cluster-down stops the local cluster"], proc.stdout
