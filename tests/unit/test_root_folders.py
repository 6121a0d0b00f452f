"""No job leads root's file tasks out of the project's folders (issue: a job renamed a folder root
manages and left a link in its place; the next cluster-up made the link's target Ray's). The nodes
play's refusal of a link at any of roles/cluster_defaults' dlc_root_folders, run by ansible-playbook
on this machine; every root file task in a folder Ray's account can write refuses to follow one."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"


LINK_TASKS = ("Look for links where root makes a folder",
              "Look there on every later node too, before the first one changes",
              "Refuse a link there before anything is changed")


def link_refusal(tmp_path: Path, folders: list[str], hosts: str = "localhost", serial: int = 0,
                 ) -> subprocess.CompletedProcess:
    """plays/nodes.yml's tasks that find the links and refuse one, as the play has them, run by
    ansible-playbook on this machine with dlc_root_folders = `folders`, on `hosts` (each this
    machine), `serial` at a time, then a task that stands for the roles' changes (it writes a file)."""
    play = yaml.safe_load((ANSIBLE / "plays/nodes.yml").read_text())[0]
    tasks = [t for t in play["pre_tasks"] if t["name"] in LINK_TASKS]
    assert len(tasks) == len(LINK_TASKS)
    changed = tmp_path / "changed"
    echo = f"echo {{{{ inventory_hostname }}}} >> {changed}"
    tasks.append({"name": "A change", "ansible.builtin.shell": echo})
    (tmp_path / "play.yml").write_text(json.dumps([{
        "hosts": "all", "serial": serial, "gather_facts": False, "any_errors_fatal": True,
        "vars": {"dlc_root_folders": folders, "ansible_connection": "local",
                 "ansible_python_interpreter": sys.executable}, "tasks": tasks}]))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
           "ANSIBLE_STRATEGY": "linear", "ANSIBLE_LOCALHOST_WARNING": "false",
           "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}
    return subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i", hosts + ",",
                           str(tmp_path / "play.yml")], cwd=ANSIBLE, capture_output=True, text=True,
                          timeout=120, env=env)


def test_a_link_where_root_makes_a_folder_stops_the_play_in_one_line(tmp_path):
    storage, etc = tmp_path / "storage", tmp_path / "etc"
    (storage / "runs").mkdir(parents=True)
    etc.mkdir(mode=0o700)
    folders = [str(storage / "runs"), str(storage / "models"), str(tmp_path / "state/home")]
    passed = link_refusal(tmp_path, folders)  # folders and absent ones: nothing to refuse
    assert passed.returncode == 0, passed.stdout[-2000:]
    (tmp_path / "changed").unlink()  # the play went on to its change
    (storage / "models").symlink_to(etc)  # as a job would leave it
    refused = link_refusal(tmp_path, folders)
    assert refused.returncode != 0
    said = " ".join(refused.stdout.split())  # the message as one line (Ansible wraps its YAML output)
    assert (f"msg: 'localhost: {storage}/models is a link to {etc}; root makes that folder and would hand "
            "the link''s target to Ray''s account, which every job runs as: find out who left it (a job "
            "could), remove the link, and run again; nothing was changed'") in said, said[-2000:]
    assert f"{storage}/runs is" not in said and "state/home is" not in said
    assert (etc.stat().st_mode & 0o777, etc.stat().st_uid) == (0o700, os.getuid())
    assert not (tmp_path / "changed").exists()


def test_make_upgrade_looks_on_every_node_before_its_first_one_changes(tmp_path):
    """make upgrade takes one node at a time, the head last: its first node also looks on every
    later one, so a link there stops the run before the first node changes (three nodes, one at a
    time; each is this machine, so each names the same link: every node is named in the one line)."""
    storage, etc = tmp_path / "storage", tmp_path / "etc"
    storage.mkdir()
    etc.mkdir(mode=0o700)
    folders = [str(storage / "runs"), str(storage / "models")]
    passed = link_refusal(tmp_path, folders, "node-3,node-2,node-1", serial=1)
    assert passed.returncode == 0, passed.stdout[-2000:]
    assert (tmp_path / "changed").read_text().split() == ["node-3", "node-2", "node-1"]
    (tmp_path / "changed").unlink()
    (storage / "models").symlink_to(etc)
    refused = link_refusal(tmp_path, folders, "node-3,node-2,node-1", serial=1)
    said = " ".join(refused.stdout.split())
    assert refused.returncode != 0, said[-2000:]
    link = f"{storage}/models is a link to {etc}"
    assert f"msg: 'node-3: {link}; node-2: {link}; node-1: {link}; root makes that" in said, said[-2000:]
    assert "nothing was changed'" in said and not (tmp_path / "changed").exists()


def test_every_root_file_task_in_rays_folders_refuses_to_follow_a_link():
    """The roles that make folders on the shared storage, in Ray's state folder and the run
    history's artifacts: each `file` task that sets an owner or mode says follow: false (Ansible
    follows a link by default and changes its target)."""
    found = {}
    for role in ("shared_storage", "ray", "tracking", "node_image"):
        for path in sorted((ANSIBLE / "roles" / role / "tasks").glob("*.yml")):
            for task in walk(yaml.safe_load(path.read_text()) or []):
                args = task.get("ansible.builtin.file")
                if args and ({"owner", "mode", "group"} & set(args)) and args.get("state") != "absent":
                    found[f"{role}/{path.name}: {task['name']}"] = args.get("follow")
    assert len(found) >= 8, found
    assert {k: v for k, v in found.items() if v is not False} == {}


def test_each_root_folder_is_a_roles_default():
    """dlc_root_folders names folders through the roles' own defaults (one place for each path)."""
    derived = yaml.safe_load((ANSIBLE / "roles/cluster_defaults/vars/main.yml").read_text())
    folders = derived["dlc_root_folders"]
    defaults = {}
    for path in (ANSIBLE / "roles").glob("*/defaults/main.yml"):
        defaults.update(yaml.safe_load(path.read_text()) or {})
    for folder in folders:
        names = re.findall(r"\{\{ (\w+) \}\}", folder)
        assert names and all(n in defaults for n in names), folder
    assert {"{{ ray_home }}", "{{ ray_temp_dir }}", "{{ tracking_artifacts_dir }}", "{{ docker_image_dir }}",
            "{{ dlc_shared_storage_path }}/runs",
            "{{ dlc_shared_storage_path }}/mlflow-artifacts"} <= set(folders)


def walk(tasks: list) -> list[dict]:
    """Every task, those in blocks too."""
    out = []
    for task in tasks:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out.extend(walk(task.get(key) or []))
    return out


def test_the_folders_above_rays_are_roots():
    """The NFS storage's root (which the emulated tier, with a `path` storage, never makes) and Ray's
    state folder are made root's: Ray's account cannot rename the folders below them."""
    storage = walk(yaml.safe_load((ANSIBLE / "roles/shared_storage/tasks/main.yml").read_text()))
    (nfs,) = [t["ansible.builtin.file"] for t in storage
              if t.get("name") == "Make the shared folder on the head (NFS)"]
    assert (nfs["owner"], nfs["mode"]) == ("root", "0755"), nfs
    ray = walk(yaml.safe_load((ANSIBLE / "roles/ray/tasks/main.yml").read_text()))
    (folders,) = [t for t in ray if t.get("name") == "Make Ray's folders"]
    owners = {item["path"]: (item["owner"], item["mode"]) for item in folders["loop"]}
    assert owners["{{ ray_state_dir }}"] == ("root", "0750"), owners
    assert owners["{{ ray_home }}"][0] == owners["{{ ray_temp_dir }}"][0] == "{{ dlc_ray_user }}", owners
