"""Last: no secret printed anywhere after everything above, then cluster-down (after every other
test selected)."""

from __future__ import annotations

import re
import socket
import subprocess

import pytest
from conftest import (
    NODES,
    PORT,
    TOKENS_SEEN,
)

pytestmark = pytest.mark.timeout(1800)


def test_the_token_and_the_push_password_are_never_printed(emulated):
    """After everything above (cluster-up, jobs, faults, smoke, rotate-token, remove-node's re-key,
    doctor): no Ray token the tier had (each it read, TOKENS_SEEN, the current one among them) is in
    a file under the config folder but the current one's own, in a Ray log on any node or in a
    node's journal; the registry's push password is in no file under the config folder and in no
    log on the bastion; the run history's password is in no file under the config folder but its
    own. The servers search with a file of the secrets as the pattern (-f), so none is on a command
    line, which sudo itself would log."""
    emulated.token()  # the current one, among those seen
    tokens = sorted(TOKENS_SEEN)  # the whole tier: the fixture's, rotate-token's, the re-key's
    print(f"searching for {len(tokens)} token(s)")
    push = emulated.ssh("bastion", "sudo", "cat", "/etc/docker/registry/push.password").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", push)
    own = {p.resolve() for p in emulated.config.rglob("ray_token")}  # each operator's token file
    leaked = [str(p) for p in emulated.config.rglob("*") if p.is_file() and p.resolve() not in own and (
        any(t in p.read_text(errors="ignore") for t in tokens) or push in p.read_text(errors="ignore"))]
    assert leaked == [], leaked
    # the run history's password: in its own file only (the cluster-up logs here hold none)
    tracking = (emulated.config / "clusters/emulated/tracking_auth").read_text().strip().split(":", 1)[1]
    leaked = [str(p) for p in emulated.config.rglob("*") if p.is_file() and p.name != "tracking_auth"
              and tracking in p.read_text(errors="ignore")]
    assert leaked == [], leaked

    def search(secret: str, *folders: str) -> str:
        return (f"sudo grep -rlF -f {secret} {' '.join(folders)} --exclude-dir=journal 2>/dev/null; "
                f"sudo journalctl --no-pager -q | sudo grep -cF -f {secret}")
    seen = "/root/.dlc-tokens-seen"  # root's alone, outside every folder searched; removed after
    places = {node: search(seen, "/var/lib/dlcluster", "/srv/dlcluster", "/tmp", "/var/log")
              for node in NODES}
    places["bastion"] = search("/etc/docker/registry/push.password", "/tmp", "/var/log",
                               "/var/lib/docker-registry")
    for host, command in places.items():
        if host in NODES:
            put = subprocess.run(["ssh", "-F", str(emulated.ssh_config), "-o", "BatchMode=yes", host,
                                  f"sudo sh -c 'umask 077 && cat > {seen}'"], input="\n".join(tokens) + "\n",
                                 capture_output=True, text=True, timeout=60, env=emulated.env)
            assert put.returncode == 0, put.stderr
        try:
            out = emulated.ssh(host, command, timeout=300).stdout.split()
        finally:
            if host in NODES:
                emulated.ssh(host, f"sudo rm -f {seen}")
        print(host, out)
        assert out == ["0"], f"{host}: a secret is in {out[:-1]} and {out[-1:]} journal line(s)"


@pytest.mark.ends_the_tier  # (conftest: after every other test selected, whatever their order)
def test_cluster_down_stops_ray_and_closes_the_tunnel(emulated):
    proc = emulated.cluster("down", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for node in NODES:
        assert emulated.ssh(node, "systemctl", "is-active", "dlc-ray").stdout.strip() == "inactive"
    assert not (emulated.config / "cluster.json").exists()
    assert not (emulated.config / "ray-client.env").exists()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", PORT), timeout=3).close()
    # the models stay on the shared storage
    assert emulated.ssh("node-1", "ls", "/srv/dlcluster/models").stdout.strip()
