"""The node_image role's estimate of the disk a node needs for an image (ansible/filter_plugins/dlc_image.py),
on the layers and history sizes of a real dlcluster:cpu (2026-11-29) and the images an emulated node held;
and the role's refusal when the image does not fit, its task run by ansible-playbook on those figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ansible/filter_plugins"))
import dlc_image  # noqa: E402

# `docker image inspect --format '{{range .RootFS.Layers}}{{.}},{{end}}'` (shortened ids) and
# `docker history --no-trunc --human=false --format '{{.Size}}'` of that image
LAYERS = ["3f00e8866fa7", "901d9709a488", "79906dfe80b0", "d982bad43608", "9f816abab9f9", "ee68bfdb978f",
          "82378095e8f4", "ff5c4d122cdb", "4b3ed8bcb4f0", "0ce268e7dde6", "19e860367267"]
HISTORY = ("0 0 0 0 0 0 593790 29279 214423 4112 0 0 0 0 0 65883697 0 3496619619 3565914382 0 161079327 "
           "0 0 0 0 125646255").split()
WHOLE = sum(map(int, HISTORY))
# the node's previous image: the same base, torch, stack and runtime layers, then other code
PREVIOUS = ",".join(LAYERS[:8] + ["de1ba9a06ffe", "acf3da82d2e0", "8a90f5ac0f49"]) + ","
# an image of an older stack: the base and torch layers only
OLDER = ",".join(LAYERS[:3] + ["7792f1fa6efe", "afbaf62a7023", "87aa2c2e73ef"]) + ","


@pytest.mark.parametrize("node,needed", [
    ([], WHOLE),  # an empty engine: every layer
    ([",".join(LAYERS)], 0),  # the image is there
    ([PREVIOUS], 214423 + 29279 + 593790),  # the code's three layers, not 7.4 GB
    # three layers shared, of which two may be the empty ones: only the oldest sized entry is sure
    ([OLDER], WHOLE - 125646255),
    ([OLDER, PREVIOUS], 214423 + 29279 + 593790),  # the longest shared prefix counts
    ([",".join(["x", *LAYERS[1:]])], WHOLE),  # a layer shared out of its chain is not one docker reuses
])
def test_the_node_needs_only_the_layers_past_what_it_shares(node, needed):
    got = dlc_image.image_bytes_needed(LAYERS, HISTORY, node)
    assert got == needed
    assert got <= WHOLE  # never more than the image


def test_it_never_underestimates_where_the_empty_layers_are_unknown():
    """Two of the 11 layers are empty, but history does not say which: sharing 9 layers (both empty
    ones among them, at worst) leaves at most the two newest sized entries to come."""
    assert dlc_image.image_bytes_needed(LAYERS, HISTORY, [",".join(LAYERS[:9])]) == 29279 + 593790
    # a history with more sized entries than layers is not this image's: counted whole
    assert dlc_image.image_bytes_needed(LAYERS[:2], HISTORY, [",".join(LAYERS[:2])]) == 0
    assert dlc_image.image_bytes_needed(LAYERS[:3], HISTORY, [LAYERS[0]]) == WHOLE


def refusal_task() -> dict:
    """needs.yml's "Stop when the image does not fit", as the role has it."""
    import yaml

    tasks = yaml.safe_load((REPO / "ansible/roles/node_image/tasks/needs.yml").read_text())
    block = next(t for t in tasks if t.get("name") == "Check the node's Docker disk has room for the image")
    return next(t for t in block["block"] if t.get("name") == "Stop when the image does not fit")


def run_refusal(tmp_path: Path, free: int, node: list[str], image_from: str = "bastion",
                archive_bytes: int = 0) -> subprocess.CompletedProcess:
    """That task run by ansible-playbook on this machine (its `when`, filter and message Ansible's
    own), with what the tasks before it register on a node: the free bytes and the node's layer
    chains (docker_free), the control host's history sizes and layers."""
    facts = {"dlc_image": "dlcluster:cpu", "docker_image_from": image_from,
             "docker_image_bytes": archive_bytes, "docker_image_layers": ",".join(LAYERS) + ",",
             "docker_control_history": {"stdout_lines": HISTORY},
             "docker_free": {"stdout_lines": [str(free), *node]}}
    play = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "vars": facts,
             "tasks": [refusal_task()]}]
    (tmp_path / "refusal.yml").write_text(json.dumps(play))  # JSON is YAML
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "ANSIBLE_CONFIG": str(REPO / "ansible/ansible.cfg"),
           "ANSIBLE_FILTER_PLUGINS": str(REPO / "ansible/filter_plugins"), "ANSIBLE_STRATEGY": "linear",
           "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false"}
    return subprocess.run([str(REPO / ".venv-ansible/bin/ansible-playbook"), "-i", "localhost,",
                           str(tmp_path / "refusal.yml")], cwd=REPO / "ansible", capture_output=True,
                          text=True, timeout=120, env=env)


def test_a_node_without_room_is_refused_in_one_line_that_names_the_fix_and_one_with_room_is_not(tmp_path):
    """Session 41's node-3: 6.9 GB free, its previous image sharing all but the code's three layers
    (0.8 MB to come): it fits. An empty engine with the same space lacks the whole 7.4 GB image: the
    line names the node, the free and the needed space, where the image comes from and what to do."""
    free = 6_900_000_000
    fits = run_refusal(tmp_path, free, [PREVIOUS])
    assert fits.returncode == 0 and "skipping: [localhost]" in fits.stdout, fits.stdout[-2000:]
    refused = run_refusal(tmp_path, free, [])
    said = " ".join(refused.stdout.split())  # the message as one line (Ansible wraps its YAML output)
    assert refused.returncode != 0, refused.stdout[-2000:]
    assert ("localhost: Docker's disk has 6.9 GB free but dlcluster:cpu needs 7.4 GB more "
            "(docker_image_from: bastion): free space there or move Docker's data-root to a larger disk; "
            "nothing was shipped") in said, said[-2000:]
    # an archive counts whole (2.5x a compressed file's size once loaded, worked out before this task)
    archive = run_refusal(tmp_path, free, [",".join(LAYERS)], "archive", 8_000_000_000)
    said = " ".join(archive.stdout.split())
    assert archive.returncode != 0 and "needs 8.0 GB more (docker_image_from: archive)" in said, said[-2000:]
