"""Bad inventories, each one line naming the host, the variable and the fix, before any host is
touched. The inventories are real files parsed by Ansible (`ansible-inventory --list`); the checks
are the filter the inventory_checks role runs (ansible/filter_plugins/dlc_inventory.py); two of them go
through `make cluster-up`'s script end to end. Bad Make variables of the local cluster are in
tests/cluster/test_local_cluster.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
sys.path.insert(0, str(ANSIBLE / "filter_plugins"))

import dlc_inventory  # noqa: E402

EXAMPLE = (ANSIBLE / "inventories/example/hosts.yml").read_text()
NODE2 = "          ansible_host: 10.0.0.12\n"
NODE3 = "          ansible_host: 10.0.0.13\n"
VARS = "    dlc_shared_storage_path: /srv/dlcluster\n"
BASTION = "          ip: 10.0.0.10\n"


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
     "gpu-node-1: dlc_ray_runtime is 'podman': set docker (Ray in the project's image) or host"),
    ("runtime-per-host", on(NODE3, "          dlc_ray_runtime: Docker\n"),
     "gpu-node-3: dlc_ray_runtime is 'Docker'"),
    ("image-from-unknown", on(NODE3, "          docker_image_from: scp\n"),
     "gpu-node-3: docker_image_from is 'scp': set bastion (pushed once to a registry"),
    ("image-archive-missing",
     on(NODE2, "          docker_image_from: archive\n          docker_image_archive: ''\n"),
     "gpu-node-2: docker_image_from is archive but docker_image_archive is empty"),
    ("storage-unknown", lambda t: t.replace("dlc_shared_storage: nfs", "dlc_shared_storage: ceph"),
     "gpu-node-1: dlc_shared_storage is 'ceph': set nfs"),
    ("storage-path-relative", lambda t: t.replace(VARS, "    dlc_shared_storage_path: srv/dlcluster\n"),
     "gpu-node-1: dlc_shared_storage_path is 'srv/dlcluster', not an absolute path"),
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
]


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
    proc = subprocess.run(["scripts/cluster.sh", "up"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(expect), last
    assert "Log in to the bastion" not in proc.stdout


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
