"""Every role's variables declared once with their types (its meta/argument_specs.yml): in step
with the role's defaults, passed by Ansible's own check (the one it runs when a role starts) for
both shipped inventories, and a wrong type of any of them, set by an inventory, refused in one
line before any host is touched (roles/inventory_checks, through dlc_inventory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
ROLES = sorted(p.name for p in (ANSIBLE / "roles").iterdir() if p.is_dir())
sys.path.insert(0, str(ANSIBLE / "filter_plugins"))

import dlc_inventory  # noqa: E402

TYPES = {"str", "int", "float", "bool", "list", "dict", "raw"}
# a value of the wrong type for each declared type the inventory check knows
WRONG = {"int": "12x", "float": "fast", "bool": "maybe", "list": "a b", "dict": "k=v"}


def options(role: str) -> dict:
    spec = yaml.safe_load((ANSIBLE / "roles" / role / "meta/argument_specs.yml").read_text())
    return spec["argument_specs"]["main"].get("options") or {}


@pytest.mark.parametrize("role", ROLES)
def test_every_role_declares_each_variable_its_defaults_set(role):
    """Each variable a role defaults to a value (not to a template of others, which Ansible would
    resolve before the facts it reads exist) is declared with a type and a description, and
    nothing else is."""
    path = ANSIBLE / "roles" / role / "defaults/main.yml"
    defaults = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    literal = {k for k, v in defaults.items() if not (isinstance(v, str) and "{{" in v)}
    declared = options(role)
    assert set(declared) == literal, (role, set(declared) ^ literal)
    for name, option in declared.items():
        assert option["type"] in TYPES and str(option.get("description", "")).strip(), (role, name)
        if option["type"] == "list":
            assert option.get("elements") in TYPES, (role, name)


def test_each_variable_is_described_once_in_its_defaults():
    """A variable's description is the comment above it in its role's defaults/main.yml (where
    kubespray-style readers look); its spec's description (what ansible-doc and Ansible's own check
    read) is generated from it by scripts/role_docs.py, so a hand edit of either side alone fails."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts/role_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout + proc.stderr, proc.stdout + proc.stderr


# a role's variables start with its name, except where operators' inventories already used a prefix
# the role's new name no longer carries (ansible/.ansible-lint: the rule this replaces)
PREFIX = {"cluster_defaults": "dlc_", "node_image": "docker_", "control_host": "control_"}


def _names(tasks) -> set[str]:
    """The variables tasks define: registered results, set_fact keys, task and block vars."""
    found: set[str] = set()
    for task in tasks or []:
        if not isinstance(task, dict):
            continue
        found |= {task["register"]} if "register" in task else set()
        found |= set(task.get("vars") or {})
        found |= {k for k in (task.get("ansible.builtin.set_fact") or {}) if k != "cacheable"}
        for key in ("block", "rescue", "always"):
            found |= _names(task.get(key))
    return found


@pytest.mark.parametrize("role", ROLES)
def test_every_variable_a_role_defines_starts_with_its_prefix(role):
    folder = ANSIBLE / "roles" / role
    names: set[str] = set()
    excused = set()  # a name whose line says why it keeps another's (a noqa for var-naming[no-role-prefix])
    for path in folder.rglob("*.yml"):
        excused |= set(re.findall(r"^\s*(?:register:\s*)?(\w+):?.*# noqa: var-naming\[no-role-prefix\]",
                                  path.read_text(), re.M))
    for sub in ("defaults", "vars"):
        if (folder / sub / "main.yml").exists():
            names |= set(yaml.safe_load((folder / sub / "main.yml").read_text()) or {})
    for sub in ("tasks", "handlers"):
        for path in sorted((folder / sub).glob("*.yml")):
            names |= _names(yaml.safe_load(path.read_text()))
    prefix = PREFIX.get(role, f"{role}_")
    # ansible_*: Ansible's own (connection) variables, which a role may set for its hosts
    others = sorted(n for n in names - excused if not n.startswith((prefix, "ansible_")))
    assert names and not others, (role, prefix, others)


VALIDATE_PLAY = """\
- hosts: all
  connection: local
  gather_facts: false
  vars_files: {defaults}
  tasks:
{tasks}
"""
VALIDATE_TASK = """\
    - name: roles/{role}'s variables, as Ansible checks them when the role starts
      ansible.builtin.validate_argument_spec:
        argument_spec: >-
          {{{{ (lookup('ansible.builtin.file', '{spec}') | from_yaml).argument_specs.main.options }}}}
"""


@pytest.mark.parametrize("inventory", ["example", "emulated"])
def test_ansible_itself_accepts_every_role_with_each_shipped_inventory(inventory, tmp_path):
    """The check Ansible prepends to a role (validate_argument_spec over the variables in scope),
    for every role on every host of the inventory, the roles' defaults loaded: so a declaration
    that disagrees with what an inventory or a default gives fails here, not in a cluster-up."""
    roles = [r for r in ROLES if options(r)]
    defaults = [str(ANSIBLE / "roles" / r / "defaults/main.yml") for r in roles]
    tasks = "".join(VALIDATE_TASK.format(role=r, spec=ANSIBLE / "roles" / r / "meta/argument_specs.yml")
                    for r in roles)
    play = tmp_path / "validate.yml"
    play.write_text(VALIDATE_PLAY.format(defaults=defaults, tasks=tasks))
    env = {"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "HOME": str(Path.home()),
           "DLC_CONFIG": str(tmp_path), "ANSIBLE_STRATEGY": "linear"}
    proc = subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i",
                           str(ANSIBLE / "inventories" / inventory / "hosts.yml"), str(play)],
                          cwd=ANSIBLE, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    hosts = yaml.safe_load((ANSIBLE / "inventories" / inventory / "hosts.yml").read_text())
    assert f"ok={len(roles)} " in proc.stdout and "failed=0" in proc.stdout, proc.stdout[-2000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-2000:]  # no value converted to another type
    assert hosts


def test_a_host_with_nothing_wrong_has_no_problem():
    assert dlc_inventory.host_problems("node-1", {"ansible_host": "10.0.0.5"}) == []


TYPED = sorted(n for n, (_, o) in dlc_inventory.declared().items() if o["type"] in WRONG or "choices" in o)


@pytest.mark.parametrize("name", TYPED)
def test_a_wrong_type_of_any_declared_variable_is_one_line(name):
    """Every int, float, bool, list or dict a role declares, and every variable with choices: an
    inventory's value of another kind is one line naming the host and the variable (before any
    host is touched: roles/inventory_checks stops on it)."""
    _, option = dlc_inventory.declared()[name]
    value = WRONG.get(option["type"], "elsewhere")
    lines = dlc_inventory.host_problems("node-1", {"ansible_host": "10.0.0.5", name: value})
    assert len(lines) == 1 and lines[0].startswith(f"node-1: {name} is "), lines


def test_the_ports_are_every_declared_int_named_port():
    """The inventory check's ports come from the declarations: a new *_port variable is range-checked
    without a list to keep."""
    declared = dlc_inventory.declared()
    ports = dlc_inventory.port_names()
    assert "ray_metrics_export_port" in ports and "ansible_port" in ports
    assert all(declared[p][1]["type"] == "int" for p in ports if p != "ansible_port")
    line = dlc_inventory.host_problems("node-1", {"ansible_host": "10.0.0.5",
                                                  "metrics_node_exporter_port": 70000})
    assert line == ["node-1: metrics_node_exporter_port is '70000': a port is a whole number from 1 to 65535"]
