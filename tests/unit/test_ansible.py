"""The Ansible side without servers: the one-line ssh diagnoses, the failure line of a playbook
log, the playbooks' syntax against both inventories, and docs/servers.md naming every variable."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from dlcluster import ansible_failure, jobs_plan

REPO = Path(__file__).resolve().parents[2]
DLCLUSTER = str(Path(sys.executable).parent / "dlcluster")  # the installed command (make setup)
ANSIBLE = REPO / "ansible"
sys.path.insert(0, str(ANSIBLE / "filter_plugins"))

import dlc_gpu  # noqa: E402
import dlc_jobs  # noqa: E402
import dlc_preflight  # noqa: E402
import dlc_ssh  # noqa: E402

KEY, KH = "/home/u/.ssh/id_ed25519", "/home/u/.config/dlcluster/clusters/lab/known_hosts"


@pytest.mark.parametrize(
    "stderr,expect",
    [
        (
            "ops@10.0.0.1: Permission denied (publickey).\n",
            "the key /home/u/.ssh/id_ed25519 is not accepted for ops",
        ),
        (
            "@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n@@@@\n"
            "Host key verification failed.\n",
            "ssh-keygen -R 10.0.0.1 -f " + KH,
        ),
        (
            "ssh: connect to host 10.0.0.1 port 22: Connection timed out\n",
            "unreachable (ssh: connect to host",
        ),
        (
            "channel 0: open failed: connect failed: No route to host\nstdio forwarding failed\n"
            "Connection closed by UNKNOWN port 65535\n",
            "unreachable (channel 0: open failed: connect failed: No route to host)",
        ),
        ("ssh: Could not resolve hostname gpu-x: Name or service not known\n", "the name does not resolve"),
        ("something odd\n", "ssh failed: something odd"),
    ],
)
def test_ssh_problem_names_host_problem_and_fix(stderr, expect):
    line = dlc_ssh.ssh_problem(stderr, "gpu-node-3", "10.0.0.1", "ops", KEY, KH, via="bastion")
    assert line.startswith("gpu-node-3 (ops@10.0.0.1, through bastion): ")
    assert expect in line and "\n" not in line


@pytest.mark.parametrize("stderr,expect", [
    ("No ED25519 host key is known for 10.0.0.1 and you have requested strict checking.\n"
     "Host key verification failed.\n", "dlc_known_hosts pins no host key for it"),
    ("@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n@@@@\n"
     "Host key verification failed.\n", "not the one dlc_known_hosts pins"),
])
def test_pinned_host_keys_name_the_pin(stderr, expect):
    line = dlc_ssh.ssh_problem(stderr, "gpu-node-3", "10.0.0.1", "ops", KEY, KH, "bastion", True)
    assert line.startswith("gpu-node-3 (ops@10.0.0.1, through bastion): ") and expect in line
    assert "ssh-keygen -R" not in line  # a pinned key is never forgotten on the operator's behalf


def test_ssh_problems_lists_only_failed_nodes():
    results = [
        {"item": "n1", "rc": 0, "stderr": ""},
        {"item": "n2", "rc": 255, "stderr": "ssh: connect to host 10.0.0.2 port 22: Connection refused"},
    ]
    hostvars = {"n1": {"ansible_host": "10.0.0.1"}, "n2": {"ansible_host": "10.0.0.2", "ansible_user": "ops"}}
    out = dlc_ssh.ssh_problems(results, hostvars, KEY, KH, "bastion", "me")
    assert len(out) == 1 and out[0].startswith("n2 (ops@10.0.0.2, through bastion): unreachable")


def test_failure_line_takes_the_last_fatal_msg():
    log = """TASK [x] ***
fatal: [node-2]: FAILED! =>
    changed: false
    msg: 'node-2: dlc_shared_storage_path /srv/x does not exist: mount
        it'

PLAY RECAP ***
"""
    assert (
        ansible_failure.failure(log)
        == "node-2: dlc_shared_storage_path /srv/x does not exist: mount it"  # the host named once
    )
    log2 = "fatal: [localhost]: FAILED! => \n    changed: false\n    msg: the ssh key /k does not exist\n"
    assert ansible_failure.failure(log2) == "the ssh key /k does not exist"
    log3 = "[ERROR]: Completely failed to parse inventory source /x/hosts.yml\n"
    assert ansible_failure.failure(log3).startswith(
        "Completely failed to parse inventory source /x/hosts.yml; "
    )


def _run_playbook_check(inventory: str, playbook: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / ".venv-ansible/bin/ansible-playbook"), "--syntax-check", "-i", inventory, playbook],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
            "HOME": str(Path.home()),
        },
    )


ORDER_PLAY = """\
- hosts: ray_nodes
  gather_facts: false
  vars_files: [{ansible}/roles/cluster_defaults/defaults/main.yml,
               {ansible}/roles/shared_storage/vars/main.yml, {ansible}/roles/firewall/vars/main.yml]
  tasks:
    - ansible.builtin.set_fact:
        dlc_node_ip: "{{{{ dlc_node_ip }}}}"
    - run_once: true
      ansible.builtin.debug:
        msg: "NODES={{{{ dlc_nodes | join(',') }}}} CLIENTS={{{{ shared_storage_clients | join(',') }}}}
              SOURCES={{{{ firewall_private_sources | join(',') }}}}"
"""


def test_the_node_lists_keep_the_inventorys_order_whatever_the_hash_seed(tmp_path):
    """dlc_nodes (the record, /etc/hosts, the proxy's clients), the NFS clients and the addresses
    every node's firewall admits come out in the inventory's order in every run: Ansible's
    `difference` goes through a set, whose order changes with Python's hash seed from one run to
    the next (a record that differed between cluster-up and attach; files rewritten by every run).
    The firewall admits the nodes, the bastion and the inventory's extra address; not a node
    make remove-node takes out."""
    play = tmp_path / "order.yml"
    play.write_text(ORDER_PLAY.format(ansible=ANSIBLE))
    inventory = str(ANSIBLE / "inventories/emulated/hosts.yml")
    seen = set()
    for seed in ("1", "3"):
        env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
               "HOME": str(Path.home()), "PYTHONHASHSEED": seed, "DLC_CONFIG": str(tmp_path)}
        for extra in ([], ["-e", "dlc_remove_node=node-2"]):
            argv = [str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i", inventory, str(play), *extra]
            proc = subprocess.run(argv, cwd=ANSIBLE, capture_output=True, text=True, timeout=120, env=env)
            found = re.search(r"NODES=(\S*) CLIENTS=(\S*)\s+SOURCES=(\S*)", proc.stdout)
            assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
            seen.add(found.groups())
    # the bastion, then the inventory's extra addresses
    others = "172.31.251.10," + ",".join(f"172.31.251.{n}" for n in (51, 52, 53, 54, 57))
    assert seen == {("node-1,node-2,node-3", "172.31.251.12,172.31.251.13",
                     f"172.31.251.11,172.31.251.12,172.31.251.13,{others}"),
                    ("node-1,node-3", "172.31.251.13", f"172.31.251.11,172.31.251.13,{others}")}


@pytest.mark.parametrize("inventory", ["inventories/example/hosts.yml", "inventories/emulated/hosts.yml"])
@pytest.mark.parametrize("playbook", sorted(p.name for p in ANSIBLE.glob("cluster-*.yml")))
def test_playbooks_parse_with_each_inventory(inventory, playbook):
    proc = _run_playbook_check(inventory, playbook)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_inventories_have_the_groups_cluster_up_needs():
    for inv in ("example", "emulated"):
        data = yaml.safe_load((ANSIBLE / "inventories" / inv / "hosts.yml").read_text())
        groups = data["all"]["children"]
        assert len(groups["bastions"]["hosts"]) == 1
        assert len(groups["ray_head"]["hosts"]) == 1
        assert set(groups["ray_nodes"]["children"]) == {"ray_head", "ray_workers"}


def _first_steps(play: dict) -> list[str]:
    """The roles a play runs first, in order: its `roles:`, else its tasks' import_role names."""
    if play.get("roles"):
        return [r if isinstance(r, str) else r["role"] for r in play["roles"]]
    return [t["ansible.builtin.import_role"]["name"] for t in play.get("tasks", [])
            if "ansible.builtin.import_role" in t]


def _plays(path: Path) -> list[dict]:
    """A playbook's plays in order, its imports (plays/*.yml, cluster-up.yml) expanded."""
    out = []
    for play in yaml.safe_load(path.read_text()):
        imported = play.get("ansible.builtin.import_playbook")
        out += _plays(path.parent / imported) if imported else [play]
    return out


@pytest.mark.parametrize("playbook", sorted(p.name for p in ANSIBLE.glob("cluster-*.yml")))
def test_every_playbook_checks_the_inventory_first(playbook):
    """roles/inventory_checks runs first (after the defaults), on the control host, before any play
    or role that changes or contacts anything."""
    plays = _plays(ANSIBLE / playbook)
    assert plays[0]["hosts"] == "localhost" and plays[0]["connection"] == "local"
    assert _first_steps(plays[0])[:2] == ["cluster_defaults", "inventory_checks"], _first_steps(plays[0])
    assert all("inventory_checks" not in _first_steps(p) for p in plays[1:])



def test_every_role_is_tagged_and_the_checks_run_whatever_the_tags():
    """`ANSIBLE_ARGS="--tags ray"` runs one role on the nodes: each role in the lifecycle plays
    carries its name as a tag; the plays that check, lock and record (and the defaults) are tagged
    always, so no --tags leaves them out."""
    always = []
    for path in sorted((ANSIBLE / "plays").glob("*.yml")):
        for play in yaml.safe_load(path.read_text()):
            if play.get("tags") == ["always"]:
                always.append(path.stem)
                continue
            for role in play["roles"]:
                assert isinstance(role, dict), (path.name, role)
                want = ["always"] if role["role"] == "cluster_defaults" else [role["role"]]
                assert role["tags"] == want, (path.name, role)
    assert sorted(always) == ["facts", "preflight", "record", "remove"]
    roles = {r["role"] for p in yaml.safe_load((ANSIBLE / "plays/nodes.yml").read_text()) for r in p["roles"]}
    assert {"base", "firewall", "ray", "tracking", "metrics"} <= roles


def test_the_image_role_has_a_task_file_per_way_of_shipping():
    """roles/node_image's main.yml includes tasks/<docker_image_from>.yml: one file for each value the
    inventory check accepts."""
    import dlc_inventory

    files = {p.stem for p in (ANSIBLE / "roles/node_image/tasks").glob("*.yml")}
    assert set(dlc_inventory.IMAGE_SOURCES) <= files
    main = yaml.safe_load((ANSIBLE / "roles/node_image/tasks/main.yml").read_text())
    assert any(t.get("ansible.builtin.include_tasks") == "{{ docker_image_from }}.yml" for t in main)


def test_ray_version_default_is_the_projects_pin():
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ray_pin = next(p for p in pins if p.startswith("ray[")).split("==")[1]
    defaults = yaml.safe_load((ANSIBLE / "roles/cluster_defaults/defaults/main.yml").read_text())
    assert defaults["dlc_ray_version"] == ray_pin


def test_the_docs_name_every_ansible_variable():
    readme = (REPO / "docs/servers.md").read_text()
    missing = []
    for f in sorted(ANSIBLE.glob("roles/*/defaults/main.yml")):
        for name in yaml.safe_load(f.read_text()) or {}:
            if name.startswith("ansible_"):
                continue
            # a row may name a range: `ray_object_manager_port` .. `ray_metrics_export_port`
            if f"`{name}`" not in readme and not _in_range_row(readme, name, f):
                missing.append(f"{name} ({f.relative_to(REPO)})")
    assert not missing, "docs/servers.md's Ansible variables table lacks: " + ", ".join(missing)


def _in_range_row(readme: str, name: str, defaults: Path) -> bool:
    names = list(yaml.safe_load(defaults.read_text()))
    for m in re.finditer(r"`(\w+)` \.\. `(\w+)`", readme):
        if m.group(1) in names and m.group(2) in names:
            i, j = names.index(m.group(1)), names.index(m.group(2))
            if i <= names.index(name) <= j:
                return True
    return False


def test_failure_line_names_servers_already_changed():
    log = """fatal: [node-2]: FAILED! =>
    msg: boom
PLAY RECAP ***
localhost                  : ok=17   changed=2    unreachable=0    failed=0
node-1                     : ok=20   changed=5    unreachable=0    failed=0
node-2                     : ok=9    changed=0    unreachable=0    failed=1
"""
    assert ansible_failure.changed_hosts(log) == {"node-1": 5}


def ansible_bool(value) -> bool:
    """Ansible's `bool` filter (ansible.plugins.filter.core.to_bool), for templates rendered here:
    Ansible hands them strings too (an -e value, ray_tls_new_ca's "False"), where Python's bool
    would call "False" true."""
    text = str(value).lower()
    if text in ("yes", "on", "true", "1"):
        return True
    if text in ("no", "off", "false", "0"):
        return False
    return value == 1


def test_ray_unit_requires_the_shared_storage_mount():
    """The dlc-ray unit, rendered for a docker-runtime worker with NFS storage: systemd starts
    Ray only once the storage is mounted, and the container gets the same path."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "ansible/roles/ray/templates"),
                             undefined=jinja2.StrictUndefined)
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no  # Ansible's filters
    env.filters["bool"] = ansible_bool
    env.filters["quote"] = shlex.quote  # Ansible's quote
    node = dict(ansible_managed="managed", ray_is_head=False, dlc_cluster_name="c", dlc_ray_runtime="docker",
                dlc_shared_storage="nfs", shared_storage_unit="srv-data.mount", firewall_enabled=True,
                dlc_shared_storage_path="/srv/data", ray_shm_size="8g", ray_num_gpus_effective=2,
                dlc_ray_user="ray", dlc_ray_user_uid=1500, ray_temp_dir="/var/tmp/ray",
                ray_home="/var/lib/ray", dlc_image="dlcluster:gpu", ray_tls=True, ray_tls_dir="/etc/dlc/tls",
                dlc_tracking=True, dlc_tracking_name="run-history.dlcluster.internal", ray_head_ip="10.0.0.1",
                ray_start_args=["--address=10.0.0.1:6379", "--resources", '{"nvme": 1, "ssd": 2}'])
    unit = env.get_template("dlc-ray.service.j2").render(**node)
    lines = unit.splitlines()
    assert "RequiresMountsFor=/srv/data" in lines
    assert "Requires=dlc-firewall.service" in lines and "After=dlc-firewall.service" in lines
    assert any(line.startswith("After=") and "srv-data.mount" in line for line in lines)
    # Wants, not Requires, docker: an engine restart (live-restore) must not stop Ray
    assert "Wants=docker.service" in lines and "Requires=docker.service" not in lines
    assert "ExecStart=/usr/local/sbin/dlc-ray-container run" in lines
    assert "ExecStop=/usr/local/sbin/dlc-ray-container stop" in lines
    # the run history's name back in /etc/hosts before Ray starts (as root), and in its container's
    assert "ExecStartPre=+/usr/local/sbin/dlc-hosts run-history.dlcluster.internal 10.0.0.1" in lines
    script = env.get_template("dlc-ray-container.j2").render(**node)
    start = next(line.strip() for line in script.splitlines() if line.strip().startswith("exec docker run"))
    assert "-v /srv/data:/srv/data" in start and "--gpus all" in start and "--shm-size 8g" in start
    assert "--add-host run-history.dlcluster.internal:10.0.0.1" in start
    # Ray's uid and its group: the token (root:Ray's group, 0640) is readable whatever the image's
    # own user is (an operator's dlc_ray_user_uid other than its 1000 has no entry there)
    assert "--user 1500:1500" in start
    # the shell reads the JSON resources as one argument
    assert shlex.split(start)[-4:] == ["--block", "--address=10.0.0.1:6379", "--resources",
                                       '{"nvme": 1, "ssd": 2}']
    host = env.get_template("dlc-ray.service.j2").render(**{**node, "dlc_ray_runtime": "host",
                                                            "dlc_venv": "/opt/venv"})
    exec_start = next(line for line in host.splitlines() if line.startswith("ExecStart="))
    # systemd splits ExecStart as a shell would for single quotes (no $, %, backslash: the
    # inventory check refuses them in ray_start_extra_args)
    assert shlex.split(exec_start)[-2:] == ["--resources", '{"nvme": 1, "ssd": 2}'], exec_start
    assert "--network host" in start and "-v /etc/dlcluster/ray_token:/etc/dlcluster/ray_token:ro" in start
    # the node's TLS key and certificates (ray.env names them) reach Ray in its container
    assert "-v /etc/dlc/tls:/etc/dlc/tls:ro" in start
    # and the run history's credentials, for the jobs' rank 0 (ray.env's DLC_TRACKING_AUTH)
    assert "-v /etc/dlcluster/tracking_auth:/etc/dlcluster/tracking_auth:ro" in start
    # the container still running after an engine restart is followed, not replaced
    assert "exec docker attach --no-stdin --sig-proxy=false dlc-ray" in script
    assert '[ -n "${MAINPID:-}" ] || exit 0' in script
    # the same node without GPUs: no --gpus (docker refuses it where no NVIDIA runtime exists)
    cpu_node = env.get_template("dlc-ray-container.j2").render(**{**node, "ray_num_gpus_effective": 0,
                                                                 "dlc_image": "dlcluster:cpu"})
    start = next(line.strip() for line in cpu_node.splitlines() if line.strip().startswith("exec docker run"))
    assert "--gpus" not in start and "dlcluster:cpu ray start --block" in start
    # Ansible's strings (an -e value): "false" turns the run history off, as Ansible's bool reads it
    off = {**node, "dlc_tracking": "false"}
    start = next(line.strip() for line in env.get_template("dlc-ray-container.j2").render(**off).splitlines()
                 if line.strip().startswith("exec docker run"))
    assert "tracking_auth" not in start and "--add-host" not in start, start
    assert "dlc-hosts" not in env.get_template("dlc-ray.service.j2").render(**off)
    no_tls = env.get_template("dlc-ray-container.j2").render(**{**node, "ray_tls": False})
    assert "/etc/dlc/tls" not in no_tls


def slurped(text: str | None, msg: str = "") -> dict:
    """What ansible.builtin.slurp returns (with failed_when: false) for a file holding text, or none."""
    import base64

    if text is None:
        return {"failed": False, "msg": msg or "file not found: /etc/docker/daemon.json"}
    return {"content": base64.b64encode(text.encode()).decode(), "encoding": "base64", "failed": False}


@pytest.mark.parametrize("text, needs", [
    (None, True),                                                      # no file: nvidia-ctk writes it
    ('{"log-driver": "journald", "data-root": "/data/docker"}', True),  # a site's own: merged in
    ('{"runtimes": {"nvidia": {"path": "nvidia-container-runtime"}}}', False),
    ("", True),
])
def test_gpu_node_gets_the_nvidia_runtime_even_with_its_own_daemon_json(text, needs):
    """The engine's settings get the NVIDIA runtime wherever they lack it; an existing daemon.json
    no longer skips it (the role used `creates:`)."""
    assert dlc_gpu.needs_nvidia_runtime(slurped(text)) is needs
    assert dlc_gpu.daemon_json_problem(slurped(text), "gpu-node-1") == ""


@pytest.mark.parametrize("result", [slurped('{"log-driver": "journald",'), slurped("[1, 2]"),
                                    slurped(None, "Permission denied")])
def test_unreadable_daemon_json_is_one_line_and_nothing_changes(result):
    line = dlc_gpu.daemon_json_problem(result, "gpu-node-1")
    assert line.startswith("gpu-node-1: /etc/docker/daemon.json cannot be read as the engine's settings (")
    assert line.endswith("fix or move it away, then run again (nothing was changed on gpu-node-1)")
    assert "\n" not in line and not dlc_gpu.needs_nvidia_runtime(result)


def test_gpu_nodes_keep_nvml_after_a_daemon_reload():
    """NVIDIA's fix for containers losing NVML (nvidia-container-toolkit#48) is in the role: the
    udev rule making /dev/char links whenever the driver loads, and the links made now."""
    tasks = yaml.safe_load((ANSIBLE / "roles/nvidia/tasks/main.yml").read_text())
    block = next(t for t in tasks if t.get("name") == "Driver and container toolkit")["block"]
    rule = next(t for t in block if t["name"] == "Make the /dev/char links whenever the driver loads")
    assert rule["ansible.builtin.copy"]["dest"] == "/lib/udev/rules.d/71-nvidia-dev-char.rules"
    assert ('ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", RUN+="/usr/bin/nvidia-ctk system '
            'create-dev-char-symlinks --create-all"') in rule["ansible.builtin.copy"]["content"]
    now = next(t for t in block if t["name"] == "Make the /dev/char links now")
    assert now["ansible.builtin.command"] == "nvidia-ctk system create-dev-char-symlinks --create-all"


@pytest.mark.skipif(os.geteuid() != 0, reason="iptables-restore --test needs root")
def test_firewall_rules_are_what_iptables_accepts():
    """The node firewall's script, rendered as for a node: iptables-restore and ip6tables-restore
    check its rules (--test: nothing is applied here); ssh is the only port open to anyone. Root
    without iptables gets Debian's (as lint gets shellcheck): this check is never skipped as root."""
    import jinja2

    if not shutil.which("iptables-restore") and shutil.which("apt-get"):
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables",
                       shell=True, capture_output=True, timeout=600)
    assert shutil.which("iptables-restore"), "no iptables-restore, and apt-get could not install iptables"

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "ansible/roles/firewall/templates"),
                             undefined=jinja2.StrictUndefined, trim_blocks=True)
    script = env.get_template("dlc-firewall.j2").render(
        ansible_managed="managed", inventory_hostname="node-1", firewall_private_cidr_effective="10.0.0.0/24",
        firewall_private_sources=["10.0.0.1", "10.0.0.2", "10.0.0.9"], firewall_public_tcp_ports=[22, 2222])
    printed = subprocess.run(["sh", "-c", script, "dlc-firewall", "print"], capture_output=True,
                             text=True, check=True).stdout
    v4, v6 = printed.split("# ip6tables\n") if "# ip6tables" in printed else (printed, "")
    # the cluster's own addresses, one by one, not the private network: no other machine there
    # (a removed server among them) reaches more than ssh
    assert v4.startswith("# iptables\n") and "10.0.0.0/24" not in v4
    assert [line for line in v4.splitlines() if " -s " in line] == [
        f"-A DLC-INPUT -s 10.0.0.{n}/32 -j RETURN" for n in (1, 2, 9)]
    for port in (22, 2222):
        assert f"-A DLC-INPUT -p tcp --dport {port} -j RETURN" in v4
    for tool, rules in (("iptables-restore", v4), ("ip6tables-restore", v6)):
        if rules:
            assert "10.0.0." not in rules or tool == "iptables-restore"
            checked = subprocess.run([tool, "--test", "--noflush"], input=rules, capture_output=True,
                                     text=True)
            assert checked.returncode == 0, (tool, checked.stderr, rules)
    bad = subprocess.run(["iptables-restore", "--test", "--noflush"],
                         input=v4.replace("--dport", "--dprot"), capture_output=True, text=True)
    assert bad.returncode != 0  # the check can fail


def _probe():
    """The package-source probe cluster-up runs on every node (roles/control_host/files)."""
    path = ANSIBLE / "roles/control_host/files/package_source.py"
    spec = importlib.util.spec_from_file_location("package_source", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_reads_every_kind_of_apt_source_and_the_sites_proxy(tmp_path):
    probe = _probe()
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "apt.conf.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb http://deb.debian.org/debian bookworm main\n"
        "deb [signed-by=/k.gpg] https://download.docker.com/linux/debian bookworm stable\n"
        "deb-src http://deb.debian.org/debian bookworm main\ndeb cdrom:[Debian]/ bookworm main\n")
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://security.debian.org/debian-security http://mirror.lab:8080/d\n")
    assert probe.mirrors(str(tmp_path)) == [("deb.debian.org", 80), ("download.docker.com", 443),
                                            ("security.debian.org", 80), ("mirror.lab", 8080)]
    # cluster-up's own proxy file is not the site's (the run replaces or removes it)
    (tmp_path / "apt.conf.d/01dlcluster-proxy").write_text('Acquire::http::Proxy "http://bastion.lab:3142";\n')
    assert probe.site_proxy(str(tmp_path)) is None
    (tmp_path / "apt.conf.d/80site").write_text('// the site\nAcquire::http::Proxy "http://proxy.lab:3128";\n')
    assert probe.site_proxy(str(tmp_path)) == "http://proxy.lab:3128"


def test_probe_tells_an_answering_port_from_a_refused_and_an_unknown_one(tmp_path):
    probe = _probe()
    server = socket.create_server(("127.0.0.1", 0))
    open_port = server.getsockname()[1]
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        assert probe.check(f"http://127.0.0.1:{open_port}", False, str(tmp_path)) is None
        assert probe.check(f"http://127.0.0.1:{closed_port}", False, str(tmp_path)) == \
            f"proxy 127.0.0.1:{closed_port}: connection refused"
        # the bastion's own proxy is installed later in the same run: a refusal means "reachable"
        assert probe.check(f"http://127.0.0.1:{closed_port}", True, str(tmp_path)) is None
        assert probe.check("http://no-such-host.invalid:3142", False, str(tmp_path)) == \
            "proxy no-such-host.invalid:3142: the name does not resolve"
        assert probe.check(None, False, str(tmp_path)) == \
            f"no http(s) package source in {tmp_path}/sources.list*"
        (tmp_path / "sources.list").write_text(f"deb http://127.0.0.1:{open_port}/debian bookworm main\n"
                                               f"deb http://127.0.0.1:{closed_port}/x bookworm main\n")
        assert probe.check(None, False, str(tmp_path)) == \
            f"direct to 127.0.0.1:{closed_port}: connection refused"
    finally:
        server.close()


def test_bastion_problem_names_the_missing_prerequisite_and_the_variable():
    assert dlc_preflight.bastion_problem({"skipped": True}, "bastion", "jump") == ""
    assert dlc_preflight.bastion_problem({"rc": 0}, "bastion", "jump") == ""
    nosudo = {"rc": 1, "stdout": "NOSUDO"}
    only_registry = dlc_preflight.bastion_problem(nosudo, "bastion", "jump", False, True)
    assert only_registry.startswith("bastion: the image registry on the bastion (docker_image_from: bastion) "
                                    "needs root there, but jump has no sudo"), only_registry
    assert "dlc_bastion_apt_proxy" not in only_registry and "docker_image_from: control" in only_registry
    line = dlc_preflight.bastion_problem({"rc": 1, "stdout": "NOSUDO"}, "bastion", "jump")
    assert line.startswith("bastion: the package proxy on the bastion (dlc_bastion_apt_proxy: true)")
    assert "jump has no sudo without a password" in line and "dlc_bastion_apt_proxy: false" in line
    assert "dlc_apt_proxy: http://host:port" in line
    assert "no python3" in dlc_preflight.bastion_problem({"rc": 1, "stdout": "NOPYTHON"}, "b", "u")


def test_package_problem_groups_nodes_by_reason_and_names_the_fix():
    ok = {"item": "n1", "rc": 0, "stdout": ""}
    assert dlc_preflight.package_problem([ok], "", False, "10.0.0.10") == ""
    res = [ok, {"item": "n2", "rc": 1, "stdout": "direct to deb.debian.org:80: the name does not resolve"},
           {"item": "n3", "rc": 1, "stdout": "direct to deb.debian.org:80: the name does not resolve"},
           {"item": "n4", "rc": 127, "stderr": "bash: python3: command not found"}]
    line = dlc_preflight.package_problem(res, "", False, "10.0.0.10")
    assert line.startswith("n2, n3, n4 cannot reach their package mirrors directly (no proxy is set)")
    assert "n2, n3: direct to deb.debian.org:80: the name does not resolve" in line
    assert "n4: no python3 on the node" in line
    assert "dlc_bastion_apt_proxy: true" in line and line.endswith("nothing was changed on any node")
    site = dlc_preflight.package_problem(res[1:2], "http://p:3128", False, "bastion.lab")
    assert "the package proxy http://p:3128 (dlc_apt_proxy)" in site
    ours = dlc_preflight.package_problem(res[1:2], "http://bastion.lab:3142", True, "bastion.lab")
    assert "must reach the bastion at bastion.lab" in ours


def test_a_second_cluster_up_of_the_same_cluster_is_one_line_naming_the_holder(tmp_path):
    import os
    import time

    folder = tmp_path / "clusters" / "example"
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.write_text("pid 4242: cluster-up since 2026-11-22 10:00:00\n")
    holder = subprocess.Popen(["flock", str(lock), "sleep", "120"])  # a run under way
    try:
        deadline = time.time() + 10
        while subprocess.run(["flock", "-n", str(lock), "true"]).returncode == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        env = {**os.environ, "DLC_CONFIG": str(tmp_path),
               "INVENTORY": str(ANSIBLE / "inventories/example/hosts.yml")}
        proc = subprocess.run([DLCLUSTER, "up"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr == (
            "cluster-up: error: another run (cluster-up, cluster-down, rotate-token, attach) of cluster "
            "example is running (pid 4242: cluster-up since 2026-11-22 10:00:00); wait for it to end, "
            "or stop that process\n")
        assert not (folder / "up.log").exists()  # no playbook ran
    finally:
        holder.kill()
        holder.wait()


IP_ADDR = """1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eth0    inet {addr}/24 brd 172.31.251.255 scope global eth0\\       valid_lft forever preferred_lft forever
3: eth1    inet 172.31.252.11/24 brd 172.31.252.255 scope global eth1\\       valid_lft forever
storage {storage}
"""


@pytest.mark.parametrize("addr,storage,cidr,expect", [
    ("172.31.251.11", "yes", "", ""),
    ("172.31.251.11", "yes", "172.31.251.0/24", ""),
    ("172.31.251.11", "yes", "172.31.251.0/25", ""),  # narrower: the inventory check wants every node in it
    ("172.31.251.11", "yes", "172.31.0.0/16",
     "node-1: firewall_private_cidr 172.31.0.0/16 is wider than the nodes' private network 172.31.251.0/24"),
    ("172.31.251.99", "yes", "", "node-1: no interface has the address 172.31.251.11 (it has 127.0.0.1, "
                                 "172.31.251.99, 172.31.252.11): set `ip` on this host"),
    ("172.31.251.11", "no", "", "node-1: dlc_shared_storage_path /srv/dlcluster does not exist: mount"),
])
def test_network_problem_names_the_address_the_firewalls_network_and_the_shared_path(addr, storage, cidr,
                                                                                     expect):
    """What `ip -o -4 addr show` says on a node (its real format), against the inventory."""
    results = [{"item": "node-1", "rc": 0, "stdout": IP_ADDR.format(addr=addr, storage=storage)}]
    settings = {"node-1": {"cidr": cidr, "storage": "path", "path": "/srv/dlcluster"}}
    line = dlc_preflight.network_problem(results, {"node-1": "172.31.251.11"}, settings)
    assert line.startswith(expect) and (expect or line == ""), line


def test_network_problem_takes_the_span_of_nodes_on_two_subnets():
    """Nodes on two routed subnets: the firewall's network may span both, no more."""
    results = [{"item": f"n{i}", "rc": 0, "stdout": f"2: eth0    inet 10.0.{i}.5/24 brd x\nstorage yes\n"}
               for i in (0, 1)]
    addrs = {"n0": "10.0.0.5", "n1": "10.0.1.5"}
    ok = {h: {"cidr": "10.0.0.0/23", "storage": "nfs", "path": "/srv"} for h in addrs}
    wide = {h: {"cidr": "10.0.0.0/22", "storage": "nfs", "path": "/srv"} for h in addrs}
    assert dlc_preflight.network_problem(results, addrs, ok) == ""
    line = dlc_preflight.network_problem(results, addrs, wide)
    assert "wider than the nodes' private network 10.0.0.0/23" in line, line


@pytest.mark.parametrize("stdout,expect", [
    ("\n\n\n", ""),                      # a fresh node: the account is made
    ("dlc\ndlc\n1000\n", ""),            # already Ray's account: nothing to do
    ("ubuntu\nubuntu\n\n", "node-2: uid 1000 belongs to ubuntu"),
    ("\nlxd\n\n", "node-2: gid 1000 belongs to the group lxd"),
    ("ubuntu\nubuntu\n1001\n", "node-2: dlc already exists with uid 1001"),
])
def test_account_problem_names_the_node_and_the_owner(stdout, expect):
    ok = {"item": "node-1", "rc": 0, "stdout": "\n\n\n"}
    line = dlc_preflight.account_problem([ok, {"item": "node-2", "rc": 0, "stdout": stdout}], "dlc", 1000)
    if not expect:
        assert line == ""
        return
    assert expect in line and "node-1" not in line and "\n" not in line
    assert "set dlc_ray_user_uid" in line and line.endswith("nothing was changed on any node")


def test_account_probe_reads_this_machines_accounts():
    """The probe cluster-up sends, run here for real: root has uid and gid 0."""
    out = subprocess.run(["sh", "-c", dlc_preflight.ACCOUNT_PROBE, "sh", "0", "root"], capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines()[:3] == ["root", "root", "0"]
    assert dlc_preflight.account_problem([{"item": "here", "rc": 0, "stdout": out}], "root", 0) == ""
    assert "uid 0 belongs to root" in dlc_preflight.account_problem(
        [{"item": "here", "rc": 0, "stdout": out}], "dlc", 0)


def test_a_restart_under_running_jobs_is_one_line_that_tells_what_it_does():
    jobs = {"control_running_jobs": ["held-1 (sleep 600)", "raysubmit_x (python jobs/ddp_autoencoder.py)"]}
    what = "Ray runs with settings older than /etc/dlcluster/ray.env"
    head = dlc_jobs.restart_refusal(jobs, "node-1", what, True, False)
    assert head.startswith("node-1: Ray runs with settings older than /etc/dlcluster/ray.env, but 2 job(s)")
    assert "held-1 (sleep 600), raysubmit_x" in head and "nothing was restarted" in head
    # the truth about the head: its restart ends every job; --max-failures cannot bring them back
    assert "ends every job" in head and "same --name" in head and "dlc_restart_running_jobs: true" in head
    worker = dlc_jobs.restart_refusal(jobs, "node-2", "x", False, "false")
    assert "--max-failures restarts from its last checkpoint" in worker and "ends every job" not in worker
    # asked to, or nothing runs: no refusal
    assert dlc_jobs.restart_refusal(jobs, "node-1", "x", True, True) == ""
    assert dlc_jobs.restart_refusal(jobs, "node-1", "x", True, "True") == ""
    assert dlc_jobs.restart_refusal({"control_running_jobs": []}, "node-1", "x", True, False) == ""
    # the run history's restart says what it does, not Ray's
    history = dlc_jobs.restart_refusal(jobs, "node-1", "the run history runs with settings older than x",
                                       True, False, "a job on the head could take its port")
    assert history.endswith("nothing was restarted: a job on the head could take its port; run again when "
                            "they have ended, or set dlc_restart_running_jobs: true to restart now"), history
    # the head was never asked (a --limit left the control host's play out): closed, not open
    closed = dlc_jobs.restart_refusal({}, "node-3", "x", False, False)
    assert "did not ask the head which jobs run" in closed and "nothing was restarted" in closed


def test_an_upgrade_under_jobs_that_would_not_restart_is_one_line_first():
    """make upgrade asks before any change: every running job must restart from its checkpoint
    when its workers' node restarts (the harness's --max-failures, default 3), and the head's Ray
    must be the pinned one (Ray's nodes all run one version: a new Ray cannot roll)."""
    ok = {"ray": "up", "ray_version": "2.60.0", "jobs": [
        {"id": "a", "entrypoint": "python jobs/ddp_autoencoder.py --num-workers 2-3 --epochs 8"},
        {"id": "b", "entrypoint": "python  jobs/tf_cnn.py --max-failures=-1"}]}
    assert jobs_plan.max_failures(ok["jobs"][0]["entrypoint"]) == 3  # the harness's own default
    # what the control_host role hands the filter: the answer with each job's max_failures, read on the
    # project's Python by the same command the role runs
    proc = subprocess.run([sys.executable, "-m", "dlcluster.jobs_plan"], input=json.dumps(ok), cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=60)
    assert [j["max_failures"] for j in json.loads(proc.stdout)["jobs"]] == [3, -1]
    ok = jobs_plan.plan(ok)
    assert dlc_jobs.upgrade_refusal(ok, "2.60.0", False) == ""
    assert dlc_jobs.upgrade_refusal({"ray": "down", "state": "inactive"}, "2.60.0", False) == ""
    stuck = jobs_plan.plan({**ok, "jobs": [*ok["jobs"], {"id": "c", "entrypoint": "sleep 600"},
                            {"id": "d", "entrypoint": "python jobs/horovod_mnist.py --max-failures 0"}]})
    line = dlc_jobs.upgrade_refusal(stuck, "2.60.0", False)
    assert "2 running job(s) would not restart from a checkpoint" in line, line
    assert "c (sleep 600: not python jobs/<job>.py" in line and "d (python jobs/horovod_mnist.py " \
        "--max-failures 0: --max-failures 0)" in line and "nothing was changed" in line
    assert "\n" not in line and dlc_jobs.upgrade_refusal(stuck, "2.60.0", "true") == ""
    newer = dlc_jobs.upgrade_refusal(ok, "2.61.0", True)  # forced or not: it cannot roll
    assert newer.startswith("the cluster runs Ray 2.60.0 and this checkout pins 2.61.0") and \
        "make cluster-up restarts every node on the new Ray at once" in newer


def test_the_nfs_export_names_each_worker_and_no_one_else():
    """The head's export (roles/shared_storage), rendered: the path to each worker's private
    address with the options, nothing to a wildcard, a network or everyone. (The emulated nodes
    share a path instead: a kernel NFS server cannot run in their containers.)"""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "ansible/roles/shared_storage/templates"),
                             undefined=jinja2.StrictUndefined)
    text = env.get_template("exports.j2").render(
        ansible_managed="managed", dlc_shared_storage_path="/srv/dlcluster",
        shared_storage_clients=["10.0.0.12", "10.0.0.13"],
        shared_storage_nfs_options="rw,sync,no_subtree_check,root_squash")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1
    path, *clients = lines[0].split()
    assert path == "/srv/dlcluster"
    assert clients == ["10.0.0.12(rw,sync,no_subtree_check,root_squash)",
                       "10.0.0.13(rw,sync,no_subtree_check,root_squash)"]
    defaults = (REPO / "ansible/roles/shared_storage/defaults/main.yml").read_text()
    assert "root_squash" in defaults and "no_root_squash" not in defaults and "insecure" not in defaults
    # a head-only cluster exports nothing (an exports line without a client exports to everyone)
    tasks = (REPO / "ansible/roles/shared_storage/tasks/main.yml").read_text()
    assert "and shared_storage_clients | length > 0" in tasks


ARITHMETIC = re.compile(r"\b([a-z_][a-z0-9_.]*)\s*[/*+]\s*\d")


def arithmetic_on_uncast_variables(text: str) -> list[str]:
    """Jinja expressions that divide, multiply or add a variable and a number without casting the
    variable first (`| int`, `| float`): `-e name=45` on the command line gives a string there."""
    found = []
    for expr in re.findall(r"\{\{(.*?)\}\}", text, re.S):
        expr = re.sub(r"'[^']*'|\"[^\"]*\"", "''", expr)  # not inside string literals
        found += [m.group(0) for m in ARITHMETIC.finditer(expr) if m.group(1) not in ("int", "float")]
    return found


def test_numbers_given_on_the_command_line_are_cast_before_arithmetic():
    """make upgrade ANSIBLE_ARGS="-e ray_join_timeout=45" once failed in its rollback, on
    `(ray_join_timeout / 3) | int`: a variable from -e is a string. Every such expression in the
    playbooks and templates casts first."""
    assert arithmetic_on_uncast_variables('retries: "{{ (ray_join_timeout / 3) | int }}"') == \
        ["ray_join_timeout / 3"]
    assert arithmetic_on_uncast_variables('retries: "{{ (ray_join_timeout | int / 3) | int }}"') == []
    found = {str(p.relative_to(ANSIBLE)): arithmetic_on_uncast_variables(p.read_text())
             for p in sorted(ANSIBLE.rglob("*")) if p.suffix in (".yml", ".j2") and p.is_file()}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_run_history_service_listens_on_its_socket_and_keeps_its_secrets_in_files(tmp_path, monkeypatch):
    """roles/tracking's units, rendered for both runtimes: MLflow's basic-auth app on its own
    socket, in a folder made anew at each start for its account and the group of its fronts; its
    database URI (a password) only in the 0640 environment file, never on the command line `ps`
    shows; the docker runtime's container reads the same files. Its TLS end (stunnel, as the
    server's account, never without the firewall) takes the private address to the socket with the
    CA's certificate."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "ansible/roles/tracking/templates"),
                             undefined=jinja2.StrictUndefined)
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no
    env.filters["bool"] = ansible_bool
    env.filters["quote"] = shlex.quote
    env.filters["dirname"] = os.path.dirname
    head = dict(ansible_managed="managed", dlc_cluster_name="c", dlc_ray_runtime="host",
                firewall_enabled=True, dlc_shared_storage_path="/srv/data", dlc_ray_user="ray",
                dlc_ray_user_uid=1500,
                dlc_venv="/opt/venv", dlc_node_ip="10.0.0.1", dlc_tracking_port=5000, tracking_workers=2,
                tracking_artifacts_dir="/var/lib/dlc-mlflow-artifacts", dlc_image="dlcluster:gpu",
                tracking_db_user="mlflow", tracking_db="mlflow", tracking_auth_db="mlflow_auth",
                tracking_db_password="dbpw", tracking_session_key="key", dlc_tracking_user="dlc",
                tracking_password="pw", tracking_service_user="dlc-mlflow", tracking_account={"uid": 998},
                tracking_group={"gid": 997}, dlc_tracking_socket="/run/dlc-mlflow/server.sock",
                tracking_front_group="dlc-mlflow-front", tracking_allowed_hosts="h:5000,localhost",
                tracking_auth_module_dir=yaml.safe_load(
                    (REPO / "ansible/roles/tracking/vars/main.yml").read_text())["tracking_auth_module_dir"],
                tracking_auth_cache_seconds=yaml.safe_load(
                    (REPO / "ansible/roles/tracking/defaults/main.yml").read_text()
                )["tracking_auth_cache_seconds"])
    for runtime in ("host", "docker"):
        unit = env.get_template("dlc-mlflow.service.j2").render(**{**head, "dlc_ray_runtime": runtime})
        lines = unit.splitlines()
        start = next(line for line in lines if line.startswith("ExecStart="))
        assert "--app-name basic-auth --host 127.0.0.1 --port 5000 --uvicorn-opts '--uds " \
               "/run/dlc-mlflow/server.sock' --allowed-hosts h:5000,localhost" in start, start
        assert "ExecStartPre=+/bin/sh -c 'rm -rf \"$$0\" && install -d -o dlc-mlflow -g dlc-mlflow-front " \
               "-m 0750 \"$$0\"' /run/dlc-mlflow" in lines, lines
        assert "dbpw" not in unit and "pw" not in shlex.split(start)
        assert "Requires=postgresql.service" in lines
        assert "RequiresMountsFor=/var/lib/dlc-mlflow-artifacts" in lines
        assert "Requires=dlc-firewall.service" in lines
        assert refuses_a_link(unit, tmp_path / runtime), runtime
        if runtime == "host":
            assert "User=dlc-mlflow" in lines and "EnvironmentFile=/etc/dlcluster/mlflow.env" in lines
            assert "Group=dlc-mlflow" in lines and "User=ray" not in lines  # its own account, not Ray's
            assert start.startswith("ExecStart=/opt/venv/bin/mlflow server")
            # the project's sign-in rule (ini: dlc_mlflow_auth:authenticate) where it imports it
            assert "Environment=PYTHONPATH=/usr/local/lib/dlc-mlflow" in lines
        else:
            assert "--env-file /etc/dlcluster/mlflow.env" in start and "--user 998:997" in start
            assert "-v /etc/dlcluster/mlflow-auth.ini:/etc/dlcluster/mlflow-auth.ini:ro" in start
            module = "/usr/local/lib/dlc-mlflow"
            assert f"-v {module}:{module}:ro -e PYTHONPATH={module}" in start
            assert "-v /run/dlc-mlflow:/run/dlc-mlflow " in start
    tls_unit = env.get_template("dlc-mlflow-tls.service.j2").render(**head).splitlines()
    assert "ExecStart=/usr/bin/stunnel4 /etc/dlcluster/mlflow-tls.conf" in tls_unit
    assert "User=dlc-mlflow" in tls_unit and "Requires=dlc-firewall.service" in tls_unit
    tls = env.get_template("mlflow-tls.conf.j2").render(**head, tracking_tls_dir="/etc/t").splitlines()
    assert ["accept = 10.0.0.1:5000", "connect = /run/dlc-mlflow/server.sock", "cert = /etc/t/server.crt",
            "key = /etc/t/server.key", "sslVersionMin = TLSv1.2"] == [
        line for line in tls if line.split(" ")[0] in ("accept", "connect", "cert", "key", "sslVersionMin")]
    settings = env.get_template("mlflow.env.j2").render(**head)
    assert "MLFLOW_BACKEND_STORE_URI=postgresql+psycopg2://mlflow:dbpw@127.0.0.1:5432/mlflow" in settings
    assert "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in settings
    ini = env.get_template("mlflow-auth.ini.j2").render(**head)
    assert "admin_username = dlc" in ini and "admin_password = pw" in ini
    assert "database_uri = postgresql+psycopg2://mlflow:dbpw@127.0.0.1:5432/mlflow_auth" in ini
    assert "default_permission = EDIT" in ini  # the jobs' account: log and register, not delete or administer
    # each worker trusts a checked password for the role's default, as MLflow itself reads the file
    assert auth_cache_seconds(ini, tmp_path, monkeypatch) == head["tracking_auth_cache_seconds"] == 60


def refuses_a_link(unit: str, tmp_path: Path) -> bool:
    """The unit's check before MLflow starts, run by a shell as systemd runs it ($$ is a $), on a
    folder of artifacts: it passes on plain files, and stops in one line on a link at any depth."""
    (pre,) = [line.split("=", 1)[1] for line in unit.splitlines()
              if line.startswith("ExecStartPre=") and "find" in line]
    argv = shlex.split(pre.replace("$$", "$"))
    assert argv[-1] == "/var/lib/dlc-mlflow-artifacts", argv
    artifacts = tmp_path / "artifacts"
    (artifacts / "1/run/artifacts").mkdir(parents=True)
    (artifacts / "1/run/artifacts/model.onnx").write_bytes(b"onnx")
    ok = subprocess.run([*argv[:-1], str(artifacts)], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    (artifacts / "1/run/artifacts/leak").symlink_to("/etc")
    refused = subprocess.run([*argv[:-1], str(artifacts)], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and refused.stderr.strip() == (
        f"dlc-mlflow: {artifacts}/1/run/artifacts/leak is a link among the artifacts it serves: find out "
        "who left it, remove it, then systemctl restart dlc-mlflow"), refused.stderr
    (artifacts / "1/run/artifacts/leak").unlink()
    artifacts.rename(tmp_path / "elsewhere")
    artifacts.symlink_to(tmp_path / "elsewhere")  # the folder itself swapped for a link
    refused = subprocess.run([*argv[:-1], str(artifacts)], capture_output=True, text=True, timeout=30)
    return refused.returncode == 1 and f"dlc-mlflow: {artifacts} is a link" in refused.stderr


def auth_cache_seconds(ini: str, tmp_path, monkeypatch) -> int:
    """MLflow's own reading of a basic-auth settings file: how long a checked password is trusted."""
    from mlflow.server.auth.config import read_auth_config

    (tmp_path / "auth.ini").write_text(ini)
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(tmp_path / "auth.ini"))
    return read_auth_config().auth_cache_ttl_seconds


def test_the_local_clusters_tracking_server_trusts_a_checked_password_for_a_minute(tmp_path, monkeypatch):
    """Without MLflow's credential cache every request to the server pays a scrypt check."""
    from dlcluster import local_cluster

    ini = local_cluster.TRACKING_AUTH_INI.format(db=tmp_path / "a.db", user="dlc", password="pw")
    assert auth_cache_seconds(ini, tmp_path, monkeypatch) == 60


# ---- package repositories' signing keys, against their pins (ansible/filter_plugins/dlc_keys.py)
KEYRINGS = sorted([*Path("/etc/apt/trusted.gpg.d").glob("*.asc"),
                   *Path("/usr/share/keyrings").glob("debian-*.gpg")])


def gpg_fingerprints(path: Path, home: Path) -> list[str]:
    """gpg's own fingerprints of the primary keys in a key file (the first fpr after each pub)."""
    out = subprocess.run(["gpg", "--show-keys", "--with-colons", str(path)], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin", "GNUPGHOME": str(home)}).stdout
    found, wanted = [], False
    for fields in (line.split(":") for line in out.splitlines()):
        if fields[0] in ("pub", "sub"):
            wanted = fields[0] == "pub"
        elif fields[0] == "fpr" and wanted:
            found.append(fields[9])
            wanted = False
    return found


@pytest.mark.skipif(not KEYRINGS or not shutil.which("gpg"),
                    reason="no Debian keyrings or gpg on this machine")
def test_the_fingerprints_are_gpgs_for_real_keyrings_armored_and_binary(tmp_path):
    import dlc_keys

    tmp_path.chmod(0o700)
    seen = 0
    for path in KEYRINGS:
        text = path.read_text() if path.suffix == ".asc" else path.read_bytes()
        want = gpg_fingerprints(path, tmp_path)
        assert dlc_keys.openpgp_fingerprints(text) == want, path
        seen += len(want)
    assert seen > len(KEYRINGS)  # some hold several keys (Debian's archive keyring: 9)


@pytest.mark.skipif(not KEYRINGS, reason="no Debian keyrings on this machine")
def test_a_key_that_is_not_pinned_is_one_line_and_a_pinned_one_passes():
    import dlc_keys

    armored = sorted(p for p in KEYRINGS if p.suffix == ".asc" and p.name.endswith("-stable.asc"))
    mine, stranger = armored[0].read_text(), armored[-1].read_text()
    (pin,), (other,) = dlc_keys.openpgp_fingerprints(mine), dlc_keys.openpgp_fingerprints(stranger)
    url, var = "https://apt.example.org/gpg.key", "grafana_key_fingerprints"
    spaced = " ".join(pin[i:i + 4] for i in range(0, 40, 4)).lower()  # as gpg prints it, any case
    assert dlc_keys.signing_key_problem(mine, url, [spaced], "node-1", var) == ""
    both = mine + "\n" + stranger  # a file holding the pinned key and another: apt would trust both
    for text, pins, expect in [
        (stranger, [pin], f"node-1: the signing key from {url} has fingerprint {other}, not one pinned in "
                          f"{var} ({pin}): something in between sent its own key, or the repository rotated"),
        (both, [pin], f"has fingerprint {other}, not one pinned in {var}"),
        (mine, [], f"node-1: {var} is empty: pin the fingerprint of the key at {url}"),
        ("<html>proxy error</html>", [pin],
         f"node-1: {url} did not send a readable OpenPGP key (no PGP PUBLIC KEY BLOCK in it): a proxy or "
         "mirror in between?"),
    ]:
        line = dlc_keys.signing_key_problem(text, url, pins, "node-1", var)
        assert expect in line and "\n" not in line, line
        assert "apt trusts nothing from it" in line, line  # what it did not do, whatever it says first
    assert dlc_keys.signing_key_problem(both, url, [pin, other], "node-1", var) == ""


def _tasks(items: list) -> list[dict]:
    """The tasks of a task file in order, blocks flattened."""
    out = []
    for task in items or []:
        for part in ("block", "rescue", "always"):
            out += _tasks(task.get(part, []))
        if not any(part in task for part in ("block", "rescue", "always")):
            out.append(task)
    return out


def test_every_apt_key_is_checked_against_its_pin():
    """Every task that writes into /etc/apt/keyrings writes a fetched key's content, and an earlier
    task of its file fails with that content's signing_key_problem (so apt trusts nothing unpinned)."""
    kept = 0
    for path in sorted(ANSIBLE.glob("roles/*/tasks/*.yml")):
        tasks = _tasks(yaml.safe_load(path.read_text()))
        for i, task in enumerate(tasks):
            module = next((task[k] for k in task
                           if k.startswith("ansible.builtin.") and isinstance(task[k], dict)), {})
            dest = str(module.get("dest", ""))
            if not dest.startswith("/etc/apt/keyrings/"):
                continue
            kept += 1
            assert "ansible.builtin.copy" in task, f"{path.name}: {task['name']}: a key kept unchecked"
            fetched = re.fullmatch(r"\{\{ (\w+)\.content \}\}", module["content"]).group(1)
            checks = [t for t in tasks[:i] if "ansible.builtin.fail" in t
                      and f"{fetched}.content | signing_key_problem(" in yaml.safe_dump(t.get("vars", {}))]
            assert checks, f"{path.name}: {task['name']}: no signing_key_problem check of {fetched} before it"
    assert kept == 3  # Grafana's, NVIDIA's container toolkit, the CUDA repository


def test_ansible_finds_the_key_check_by_name(tmp_path):
    """The filter as the roles call it, through Ansible itself (its plugin path, its Jinja)."""
    key = next((p for p in KEYRINGS if p.suffix == ".asc"), None)
    if key is None:
        pytest.skip("no armored Debian keyring on this machine")
    expr = ("{{ lookup('file', '" + str(key) + "')"
            " | signing_key_problem('https://k', ['00' * 20], 'node-1', 'v') }}")
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home()),
           "ANSIBLE_FILTER_PLUGINS": str(ANSIBLE / "filter_plugins")}  # a playbook finds them beside it
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible"), "localhost", "-i", "localhost,",
                           "-c", "local", "-m", "ansible.builtin.debug", "-a", f"msg={json.dumps(expr)}"],
                          cwd=ANSIBLE, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "node-1: the signing key from https://k has fingerprint " in proc.stdout, proc.stdout[-2000:]


DLC_CERT = REPO / "ansible/roles/ray/files/dlc-cert"


def _task(path: str, name: str, **values) -> dict:
    """A task of `path` with its strings rendered (Jinja, the few filters they use), dlc-cert this
    checkout's."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["bool"] = ansible_bool  # Ansible's filters
    env.filters["ternary"] = lambda cond, yes, no: yes if cond else no

    def render(v):
        if isinstance(v, str):
            return env.from_string(v).render(**values).replace("/usr/local/sbin/dlc-cert", str(DLC_CERT))
        return [render(x) for x in v] if isinstance(v, list) else v
    task = next(t for t in _tasks(yaml.safe_load((REPO / path).read_text())) if t["name"].startswith(name))
    module = next(k for k in task if k.startswith("ansible.builtin."))
    return {k: render(v) for k, v in task[module].items() if k != "stdin"}  # stdin: the test's own


def _ca_script(ca_dir: Path, new: bool) -> str:
    """The ray role's CA task's script as the head runs it (tasks/tls.yml, rendered)."""
    task = _task("ansible/roles/ray/tasks/tls.yml", "Make the cluster's CA on the head",
                 ray_tls_ca_dir=str(ca_dir), ray_tls_new_ca=new, ray_tls_ca_days=10, dlc_cluster_name="c")
    return task["cmd"]


@pytest.mark.parametrize("rekey,action,new_ca", [
    (None, "rotate-token", "True"), ("true", "rotate-token", "True"), ("false", "up", "False")])
def test_remove_node_re_keys_unless_told_not_to(rekey, action, new_ca):
    """cluster-remove-node.yml's plays run as rotate-token's (a new token and CA: the removed
    server's copies refused) by default, and as a plain cluster-up's with dlc_remove_node_rekey:
    false, as Ansible itself renders them (an -e value is a string)."""
    plays = yaml.safe_load((ANSIBLE / "cluster-remove-node.yml").read_text())
    shared = plays[0]["vars"]
    assert all(p.get("vars", {}).get("control_action") == shared["control_action"] for p in plays
               if "remove.yml" not in p["ansible.builtin.import_playbook"])  # every play but the node's own
    expr = f"{shared['control_action']}|{shared['ray_tls_new_ca']}"
    extra = ["-e", f"dlc_remove_node_rekey={rekey}"] if rekey else []
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home())}
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible"), "localhost", "-i", "localhost,", "-c",
                           "local", *extra, "-m", "ansible.builtin.debug", "-a", f"msg={json.dumps(expr)}"],
                          cwd=ANSIBLE, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"msg: {action}|{new_ca}\n" in proc.stdout, proc.stdout[-2000:]  # (the YAML result format)


def handshake(crt: Path, key: Path, ca: Path, name: str) -> str:
    """A real TLS handshake on a local socket: a server with crt/key, a client that checks it
    against `ca` for `name` (as Python's ssl does for requests). "ok", or the client's error."""
    import socket
    import ssl
    import threading

    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(crt, key)
    checking = ssl.create_default_context(cafile=str(ca))
    a, b = socket.socketpair()
    with a, b:
        def serve():
            with contextlib.suppress(ssl.SSLError, OSError):
                serving.wrap_socket(a, server_side=True).close()
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            checking.wrap_socket(b, server_hostname=name).close()
            return "ok"
        except ssl.SSLCertVerificationError as e:
            return str(e)
        finally:
            b.close()
            thread.join(timeout=10)


@pytest.mark.skipif(not shutil.which("openssl"), reason="no openssl on this machine")
def test_one_script_makes_the_nodes_and_the_run_historys_certificates_as_their_tasks_call_it(tmp_path):
    """dlc-cert, run as roles/ray's tasks (request on the node, sign on the head, install) and
    roles/tracking's (all on the head) call it: a certificate of the CA for the address (the run
    history's: its name alone), kept while valid, made again for another address or name or a new
    CA. A client that checks the run history's name refuses a node's certificate."""
    import grp

    ca, node, server = tmp_path / "ca", tmp_path / "tls", tmp_path / "tracking"
    node.mkdir()
    server.mkdir()
    subprocess.run(["sh", "-c", _ca_script(ca, False)], check=True, capture_output=True)
    shutil.copy(ca / "ca.crt", node / "ca.crt")
    group = grp.getgrgid(os.getgid()).gr_name
    values = dict(ray_tls_dir=str(node), ray_tls_ca_dir=str(ca), ray_tls_days=30, ray_tls_renew_days=5,
                  dlc_ray_user=group, inventory_hostname="node-2", dlc_node_ip="10.0.0.12",
                  tracking_tls_dir=str(server), tracking_service_user=group, dlc_cluster_name="c",
                  dlc_tracking_name="run-history.dlcluster.internal")

    def node_run(**more) -> str:
        v = {**values, **more}
        request = _task("ansible/roles/ray/tasks/tls.yml", "Check the node's certificate", **v)
        csr = subprocess.run(["sh", "-c", request["cmd"]], capture_output=True, text=True, check=True).stdout
        if csr:
            sign = _task("ansible/roles/ray/tasks/tls.yml", "Sign the node's certificate", **v)
            crt = subprocess.run(sign["argv"], input=csr, capture_output=True, text=True, check=True).stdout
            install = _task("ansible/roles/ray/tasks/tls.yml", "Install the node's new key", **v)
            subprocess.run(install["argv"], input=crt, capture_output=True, text=True, check=True)
        return csr

    def server_run(**more) -> str:
        task = _task("ansible/roles/tracking/tasks/server.yml", "Give the TLS end a certificate",
                     **{**values, **more})
        return subprocess.run([task["executable"], "-c", task["cmd"]], capture_output=True, text=True,
                              check=True).stdout.strip()

    def text(crt: Path) -> str:
        return subprocess.run(["openssl", "x509", "-in", str(crt), "-noout", "-text"], capture_output=True,
                              text=True, check=True).stdout

    assert "CERTIFICATE REQUEST" in node_run()
    first = (node / "node.crt").read_text()
    assert "IP Address:10.0.0.12" in text(node / "node.crt") and "TLS Web Client Authentication" in text(
        node / "node.crt")
    assert oct((node / "node.key").stat().st_mode & 0o777) == "0o640"
    assert node_run() == "" and (node / "node.crt").read_text() == first  # valid: kept
    assert node_run(dlc_node_ip="10.0.0.1") and (node / "node.crt").read_text() != first  # a prefix of .12
    assert server_run() == "made"
    names = text(server / "server.crt").split("Subject Alternative Name:")[1].split("\n")[1].strip()
    assert names == "DNS:run-history.dlcluster.internal", names  # its name alone: no address, no node's
    assert server_run() == ""
    assert server_run(dlc_tracking_name="history.other.internal") == "made"  # another name: made again
    server_run(dlc_tracking_name="run-history.dlcluster.internal")
    # a client as the nodes' (MLflow's requests: the CA, the name in DLC_TRACKING_URL) takes the run
    # history's certificate, and refuses a node's, whose key a job on that node reads
    assert handshake(server / "server.crt", server / "server.key", ca / "ca.crt",
                     "run-history.dlcluster.internal") == "ok"
    refused = handshake(node / "node.crt", node / "node.key", ca / "ca.crt", "run-history.dlcluster.internal")
    assert "Hostname mismatch" in refused, refused
    assert handshake(node / "node.crt", node / "node.key", ca / "ca.crt", "10.0.0.1") == "ok"  # (the control)
    subprocess.run(["sh", "-c", _ca_script(ca, True)], check=True, capture_output=True)  # rotate-token's CA
    assert server_run() == "made"
    subprocess.run(["openssl", "verify", "-CAfile", str(ca / "ca.crt"), str(server / "server.crt")],
                   check=True, capture_output=True)


@pytest.mark.skipif(not shutil.which("openssl"), reason="no openssl on this machine")
def test_the_ca_is_made_once_anew_only_when_asked_and_a_torn_pair_is_made_again(tmp_path):
    """The real openssl script: made once, kept by a later run (a second operator's), replaced by
    rotate-token's (ray_tls_new_ca), and made again when its key and certificate do not match (a
    renewal torn between its two renames), which keeping would leave signing nothing Ray trusts."""
    ca = tmp_path / "ca"

    def run_ca(new: bool) -> tuple[str, str]:
        out = subprocess.run(["sh", "-c", _ca_script(ca, new)], capture_output=True, text=True, check=True)
        return out.stdout.strip(), (ca / "ca.crt").read_text()

    made, first = run_ca(False)
    assert made == "made" and oct((ca / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert run_ca(False) == ("", first)  # kept
    assert run_ca("False") == ("", first)  # kept: the string Ansible renders for cluster-up's false
    rotated, second = run_ca(True)
    assert rotated == "made" and second != first
    (ca / "ca.crt").write_text(first)  # the new key beside the old certificate
    torn, third = run_ca(False)
    assert torn == "made" and third not in (first, second)
    key = subprocess.run(["openssl", "pkey", "-in", str(ca / "ca.key"), "-pubout"], capture_output=True,
                         text=True, check=True).stdout
    cert = subprocess.run(["openssl", "x509", "-in", str(ca / "ca.crt"), "-noout", "-pubkey"],
                          capture_output=True, text=True, check=True).stdout
    assert key == cert
