"""make rotate-token's new secrets wait in pending/ until every node has them: the tasks that
settle what a stopped run left (roles/control_host/tasks/token.yml) and keep them once the nodes
play ended well (tasks/record.yml), run by ansible-playbook on this machine on a cluster folder of
files; the folder the nodes' roles read them from (dlc_secrets_dir) as Ansible renders it."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
TASKS = ANSIBLE / "roles/control_host/tasks"
SETTLE = ("Look for the new secrets of a make rotate-token that stopped",
          "Keep them when the head took the new token, else drop them", "Say what became of them")
KEEP = "Keep rotate-token's new secrets here (every node has them)"
OLD, NEW = "a" * 64, "b" * 64
ENV = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
       "ANSIBLE_STRATEGY": "linear", "ANSIBLE_LOCALHOST_WARNING": "false",
       "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}


def play(tmp_path: Path, tasks: list[dict], **variables) -> subprocess.CompletedProcess:
    (tmp_path / "play.yml").write_text(json.dumps([{
        "hosts": "localhost", "connection": "local", "gather_facts": False, "vars": variables,
        "tasks": tasks}]))
    return subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i", "localhost,",
                           str(tmp_path / "play.yml")], cwd=ANSIBLE, capture_output=True, text=True,
                          timeout=120, env=ENV)


def tasks(path: Path, names: tuple[str, ...]) -> list[dict]:
    found = [t for t in yaml.safe_load(path.read_text()) if t.get("name") in names]
    assert [t["name"] for t in found] == list(names)
    return found


def cluster_folder(tmp_path: Path) -> Path:
    """A control host's folder for a cluster whose rotate-token stopped: its token and jobs'
    password, and the new ones in pending/."""
    folder = tmp_path / "cluster"
    (folder / "pending").mkdir(parents=True)
    for name, old, new in (("ray_token", OLD, NEW), ("tracking_jobs_auth", "dlc-jobs:old", "dlc-jobs:new")):
        (folder / name).write_text(old + "\n")
        (folder / "pending" / name).write_text(new + "\n")
        (folder / "pending" / name).chmod(0o600)
    return folder


@pytest.mark.parametrize("head", ["took the new token", "kept the old one"])
def test_a_stopped_rotate_tokens_secrets_are_kept_when_the_head_took_them_else_dropped(tmp_path, head):
    folder = cluster_folder(tmp_path)
    took = head == "took the new token"
    proc = play(tmp_path, tasks(TASKS / "token.yml", SETTLE), dlc_cluster_dir=str(folder),
                control_head_token={"rc": 0, "stdout_lines": ["TOKEN", NEW if took else OLD]})
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 0, said[-2000:]
    assert not (folder / "pending").exists()
    assert (folder / "ray_token").read_text().strip() == (NEW if took else OLD)
    assert (folder / "tracking_jobs_auth").read_text().strip() == ("dlc-jobs:new" if took else "dlc-jobs:old")
    if took:
        assert ("an earlier make rotate-token stopped after the head took its new token: this folder keeps "
                "it (make cluster-up gives it to the nodes that missed it)") in said, said[-2000:]
    else:
        assert ("an earlier make rotate-token stopped before the head took its new token: this folder keeps "
                "the cluster''s (make rotate-token again makes a new one)") in said, said[-2000:]
    again = play(tmp_path, tasks(TASKS / "token.yml", SETTLE), dlc_cluster_dir=str(folder),
                 control_head_token={"rc": 0, "stdout_lines": ["TOKEN", NEW]})
    assert again.returncode == 0 and "an earlier make rotate-token" not in again.stdout  # nothing pending


def test_the_record_play_keeps_the_new_secrets_once_every_node_has_them(tmp_path):
    folder = cluster_folder(tmp_path)
    keep = tasks(TASKS / "record.yml", (KEEP,))
    proc = play(tmp_path, keep, dlc_cluster_dir=str(folder), control_action="up")  # not a rotation
    assert proc.returncode == 0 and (folder / "pending/ray_token").exists()
    proc = play(tmp_path, keep, dlc_cluster_dir=str(folder), control_action="rotate-token")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert not (folder / "pending").exists()
    kept = [(folder / n).read_text().strip() for n in ("ray_token", "tracking_jobs_auth")]
    assert kept == [NEW, "dlc-jobs:new"]
    assert (folder / "ray_token").stat().st_mode & 0o777 == 0o600  # as pending/ had it


@pytest.mark.parametrize(("action", "folder"), [("rotate-token", "/c/pending"), ("up", "/c"), (None, "/c")])
def test_the_nodes_read_the_secrets_from_pending_only_under_rotate_token(tmp_path, action, folder):
    defaults = yaml.safe_load((ANSIBLE / "roles/cluster_defaults/vars/main.yml").read_text())
    variables = {"dlc_cluster_dir": "/c", **({"control_action": action} if action else {})}
    proc = play(tmp_path, [{"ansible.builtin.debug": {"msg": defaults["dlc_secrets_dir"]}}], **variables)
    assert proc.returncode == 0 and f"msg: {folder}\n" in proc.stdout, proc.stdout[-2000:]
