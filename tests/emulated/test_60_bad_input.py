"""Bad input is one line and touches no node: bad inventories, a bastion without sudo asked for a
service, nodes without a package source."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import INVENTORY, run
from helpers import EMULATED, _inventory, _jump_inventory, untouched

pytestmark = pytest.mark.timeout(1800)


def _set(line: str):
    """An edit that sets one more cluster-wide variable."""
    return lambda t: t.replace("    ray_object_store_memory:", f"    {line}\n    ray_object_store_memory:")


BAD_INVENTORIES = {  # name -> (edit of the emulated inventory, what the one line says)
    "no-bastion": (lambda t: re.sub(r"    bastions:\n      hosts:\n        bastion:\n.*\n.*\n", "", t),
                   "names 0 bastions"),
    "bastion-unreachable": (lambda t: t.replace("ansible_host: 172.31.250.10", "ansible_host: 172.31.250.99"),
                            "bastion"),
    "wrong-key": (None, "is not accepted"),
    "missing-key": (lambda t: t.replace('"{{ dlc_config }}/emulated/id_ed25519"', "/nonexistent/id_ed25519"),
                    "does not exist"),
    "unparsable": (lambda t: t.replace("  children:", "  children: [", 1), "inventory"),
    # as on Ubuntu's cloud images, whose `ubuntu` login holds uid 1000: here `ops` holds 1001
    "uid-taken": (lambda t: t.replace("    dlc_ray_user: raysvc\n    dlc_ray_user_uid: 1002\n",
                                      "    dlc_ray_user: opsray\n    dlc_ray_user_uid: 1001\n"),
                  "node-1: uid 1001 belongs to ops; node-2: uid 1001 belongs to ops; "
                  "node-3: uid 1001 belongs to ops"),
    # every value that reaches a root shell, a unit file or the firewall, checked first: each such
    # check is in the unit tier (tests/unit/test_inventory.py, the same filter); three of them here,
    # end to end through cluster-up on the servers
    "cidr-prefix-33": (_set("firewall_private_cidr: 172.31.251.0/33"),
                       "node-1, node-2, node-3: firewall_private_cidr is '172.31.251.0/33', not an IPv4"),
    "cidr-misses-nodes": (_set("firewall_private_cidr: 172.31.251.8/30"),
                          "firewall_private_cidr 172.31.251.8/30 leaves out node-2 (172.31.251.12), "
                          "node-3 (172.31.251.13)"),
    # asked of the nodes (their interfaces' networks are /24), before any change
    "cidr-wider-than-nodes": (_set("firewall_private_cidr: 172.31.0.0/16"),
                              "node-1, node-2, node-3: firewall_private_cidr 172.31.0.0/16 is wider than "
                              "the nodes' private "
                              "network 172.31.251.0/24"),
    "address-on-no-interface": (lambda t: t.replace("          ansible_host: 172.31.251.12\n",
                                                    "          ansible_host: 172.31.251.12\n"
                                                    "          ip: 172.31.251.99\n"),
                                "node-2: no interface has the address 172.31.251.99"),
    "shared-path-missing": (lambda t: t.replace("dlc_shared_storage_path: /srv/dlcluster",
                                                "dlc_shared_storage_path: /srv/nowhere"),
                            "node-1, node-2, node-3: dlc_shared_storage_path /srv/nowhere does not exist"),
    "extra-args-dollar": (lambda t: re.sub(r"    ray_start_extra_args: .*\n",
                                           "    ray_start_extra_args: [--labels, '$(reboot)']\n", t),
                          "ray_start_extra_args item '$(reboot)' holds a quote, $"),
}


@pytest.fixture(scope="module")
def bad_inventory_runs(emulated, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """cluster-up with each bad inventory, all at once: each is a cluster of its own name (its own
    folder and lock) and stops before any change, so none waits for another."""
    tmp = tmp_path_factory.mktemp("bad-inventories")
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "wrong")], emulated.env, check=True)

    def up(name: str) -> subprocess.CompletedProcess:
        edit = BAD_INVENTORIES[name][0]
        if name == "wrong-key":
            text = EMULATED.replace('"{{ dlc_config }}/emulated/id_ed25519"', str(tmp / "wrong"))
        else:
            text = edit(EMULATED)
        assert text != EMULATED
        # a cluster of its own name: its own tunnel ports (8400-8411 and +100, +200, +300)
        return emulated.cluster("up", _inventory(tmp, name, text), timeout=300,
                                port=8400 + list(BAD_INVENTORIES).index(name))

    with ThreadPoolExecutor(len(BAD_INVENTORIES)) as pool:
        return dict(zip(BAD_INVENTORIES, pool.map(up, BAD_INVENTORIES), strict=True))


@pytest.mark.parametrize("name", list(BAD_INVENTORIES))
def test_bad_input_is_one_line_and_touches_no_node(bad_inventory_runs, name):
    proc, expect = bad_inventory_runs[name], BAD_INVENTORIES[name][1]
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert last.startswith("cluster-up: error:") and expect in last, proc.stderr[-2000:]
    assert "PLAY [Nodes" not in proc.stdout
    assert untouched(proc)
    if name == "bastion-unreachable":
        assert "unreachable" in last and "172.31.250.99" in last


def test_a_service_asked_of_a_bastion_without_sudo_is_one_line_first(emulated, tmp_path):
    proc = emulated.cluster("up", _jump_inventory(tmp_path, ""), timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert last.startswith("cluster-up: error: bastion: the package proxy on the bastion "
                           "(dlc_bastion_apt_proxy: true) needs root there, but jump has no sudo"), last
    assert "dlc_bastion_apt_proxy: false" in last and "dlc_apt_proxy" in last
    assert "PLAY [Bastion" not in proc.stdout and "PLAY [Nodes" not in proc.stdout
    # the registry asked of it too: both named, with the way to do without each
    (tmp_path / "registry").mkdir()
    proc = emulated.cluster("up", _jump_inventory(tmp_path / "registry", "", registry=True), timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "PLAY [Nodes" not in proc.stdout
    assert "and the image registry on the bastion (docker_image_from: bastion) need root" in last, last
    assert "set docker_image_from: control" in last, last


def test_nodes_without_a_package_source_are_named_before_any_change(emulated, tmp_path):
    """No proxy anywhere, and the private network has no route out."""
    proc = emulated.cluster("up", _jump_inventory(tmp_path, "    dlc_bastion_apt_proxy: false\n"),
                            timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    print(last)
    assert last.startswith("cluster-up: error: node-1, node-2, node-3 cannot reach their package "
                           "mirrors directly (no proxy is set) (node-1, node-2, node-3: direct to "
                           "deb.debian.org:80: "), last
    assert "set dlc_bastion_apt_proxy: true" in last and "; nothing was changed on any node" in last
    assert "PLAY [Nodes" not in proc.stdout
    # the proxy an earlier run set is still in place: nothing on the nodes was touched
    assert emulated.ssh("node-2", "test", "-f", "/etc/apt/apt.conf.d/01dlcluster-proxy").returncode == 0




def test_a_link_where_root_makes_a_folder_is_refused_and_followed_nowhere(emulated):
    """A job (Ray's account) cannot rename a folder root manages and leave a link in its place: the
    shared storage's root, Ray's state folder and the run history's artifacts' parent are root's.
    A link left there before they were (root plants one here, as a job could on a cluster made
    before) makes cluster-up stop in one line before any change, and its target keeps its owner and
    mode; a link among the run history's artifacts keeps the server from starting."""
    for node, cmd in (("node-2", "mv /srv/dlcluster/runs /srv/dlcluster/runs.x"),
                      ("node-1", "mv /var/lib/dlcluster/home /var/lib/dlcluster/home.x"),
                      ("node-1", "ln -s /etc /var/lib/dlc-mlflow-artifacts/etc"),
                      ("node-1", "ln -s /etc /var/lib/dlc-mlflow-artifacts.new")):
        denied = emulated.ssh(node, f"sudo -u raysvc {cmd}")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, (node, cmd, denied.stderr)
    head = "node-1"
    emulated.ssh(head, "sudo install -d -m 0700 -o root -g root /opt/decoy", timeout=30)
    planted = emulated.ssh(head, "sudo sh -c 'mv /srv/dlcluster/models /srv/dlcluster/models.kept && "
                                 "ln -s /opt/decoy /srv/dlcluster/models'")
    assert planted.returncode == 0, planted.stderr
    try:
        proc = emulated.cluster("up", INVENTORY, timeout=600)
        last = proc.stderr.strip().splitlines()[-1]
        print(last)
        assert proc.returncode != 0 and "/srv/dlcluster/models is a link to /opt/decoy" in last, \
            proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "remove the link, and run again; nothing was changed" in last, last
        assert untouched(proc)
        assert emulated.ssh(head, "stat -c '%a %U %G' /opt/decoy").stdout.split() == ["700", "root", "root"]
    finally:
        emulated.ssh(head, "sudo sh -c 'rm /srv/dlcluster/models && mv /srv/dlcluster/models.kept "
                           "/srv/dlcluster/models && rmdir /opt/decoy'")
    # make upgrade takes one node at a time, the workers first: a link on the head (the last) alone
    # stops it before the first worker changes
    home = "/var/lib/dlcluster/home"
    planted = emulated.ssh(head, f"sudo sh -c 'install -d -m 0700 /opt/decoy && mv {home} {home}.kept && "
                                 f"ln -s /opt/decoy {home}'")
    assert planted.returncode == 0, planted.stderr
    try:
        proc = emulated.cluster("upgrade", INVENTORY, timeout=600)
        last = proc.stderr.strip().splitlines()[-1]
        print(last)
        assert proc.returncode != 0 and f"{head}: {home} is a link to /opt/decoy; root makes" in last, \
            proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "nothing was changed" in last and untouched(proc)
        # the nodes' play stopped in its checks, before any of its roles (the bastion's play runs base)
        nodes_play = proc.stdout[proc.stdout.rindex("PLAY [Nodes, with GPUs"):]
        roles = r"^TASK \[(cluster_defaults|base|firewall|ray) "
        assert not re.search(roles, nodes_play, re.M), nodes_play[-3000:]
    finally:
        emulated.ssh(head, f"sudo sh -c 'rm {home} && mv {home}.kept {home} && rmdir /opt/decoy'")
    # the run history's server refuses to start on a link among its artifacts
    emulated.ssh(head, "sudo ln -s /etc/dlcluster /var/lib/dlc-mlflow-artifacts/leak")
    try:
        refused = emulated.ssh(head, "sudo systemctl restart dlc-mlflow", timeout=120)
        said = emulated.ssh(head, "sudo journalctl -u dlc-mlflow -n 20 --no-pager").stdout
        assert refused.returncode != 0, said
        assert "dlc-mlflow: /var/lib/dlc-mlflow-artifacts/leak is a link among the artifacts it serves" \
            in said, said
    finally:
        emulated.ssh(head, "sudo rm -f /var/lib/dlc-mlflow-artifacts/leak")
        emulated.ssh(head, "sudo systemctl restart dlc-mlflow", timeout=120)
    up = emulated.ssh(head, "for i in $(seq 120); do sudo curl -sf --unix-socket /run/dlc-mlflow/server.sock "
                            "http://localhost/health && exit 0; sleep 1; done; exit 1", timeout=180)
    assert up.returncode == 0, up.stderr
