"""Host keys: a changed one is refused, pinned ones are checked, not trusted."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import (
    NODES,
    run,
)
from helpers import EMULATED, _inventory, untouched

pytestmark = pytest.mark.timeout(1800)


def test_a_changed_host_key_is_refused(emulated, tmp_path):
    known = emulated.cluster_dir / "known_hosts"
    saved = known.read_text()
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], emulated.env,
        check=True)
    other = (tmp_path / "other.pub").read_text().split()
    lines = [f"{ln.split()[0]} {other[0]} {other[1]}" if ln.startswith("172.31.251.12 ") else ln
             for ln in saved.splitlines()]
    known.write_text("\n".join(lines) + "\n")
    try:
        proc = emulated.cluster("up")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and "node-2" in last and "host key" in last, last
        assert "PLAY [Nodes" not in proc.stdout and untouched(proc)
    finally:
        known.write_text(saved)


def test_pinned_host_keys_are_checked_not_trusted(emulated, tmp_path):
    """dlc_known_hosts pins the keys (here: those recorded so far, as an operator would after
    comparing fingerprints): a host without a pinned key, or with another key, is refused in one
    line before any change. Each variant is a cluster of its own name: the emulated cluster's
    files stay as they are."""
    known = (emulated.cluster_dir / "known_hosts").read_text().splitlines()
    pinned = [ln for ln in known if ln.split()[0] in {"172.31.250.10", *NODES.values()}]
    assert len(pinned) >= 4, known

    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], emulated.env,
        check=True)
    other = (tmp_path / "other.pub").read_text().split()
    variants = {  # name -> (the pinned lines, more settings)
        # every key pinned: the logins pass and the run goes on to its next check (no package source)
        "pinned": (pinned, "    dlc_bastion_apt_proxy: false\n"),
        # node-3 not pinned: not trusted on first contact
        "unpinned": ([ln for ln in pinned if not ln.startswith("172.31.251.13 ")], ""),
        # node-2 pinned with another key: refused
        "swapped": ([f"{ln.split()[0]} {other[0]} {other[1]}" if ln.startswith("172.31.251.12 ") else ln
                     for ln in pinned], ""),
        "garbled": (["172.31.251.11 ssh-ed25519 not-base64!"], ""),
    }

    def up(name: str) -> subprocess.CompletedProcess:
        lines, more = variants[name]
        block = "    dlc_known_hosts: |\n" + "".join(f"      {ln}\n" for ln in lines) + more
        text = EMULATED.replace("    ray_object_store_memory:", block + "    ray_object_store_memory:")
        # a cluster of its own name: its own tunnel ports (8420-8423 and +100, +200, +300)
        return emulated.cluster("up", _inventory(tmp_path, name, text), timeout=300,
                                port=8420 + list(variants).index(name))

    # each variant is a cluster of its own (its own folder and lock), refused before any node is
    # changed: they run at once
    with ThreadPoolExecutor(len(variants)) as pool:
        procs = dict(zip(variants, pool.map(up, variants), strict=True))
    last = {}
    for name, proc in procs.items():
        last[name] = proc.stderr.strip().splitlines()[-1]
        print(f"{name}: {last[name]}")
        assert proc.returncode != 0 and "PLAY [Nodes" not in proc.stdout, proc.stdout[-2000:]
        assert untouched(proc)
    assert "cannot reach their package mirrors" in last["pinned"], last["pinned"]
    prints = (emulated.config / "clusters/pinned/host_fingerprints").read_text().splitlines()
    assert len(prints) == len(pinned) and all("SHA256:" in p for p in prints), prints
    assert prints[0].split()[1] in procs["pinned"].stdout  # shown, for the operator to compare
    config = (emulated.config / "clusters/pinned/ssh_config").read_text()
    assert "StrictHostKeyChecking yes" in config and "accept-new" not in config
    assert "node-3 (" in last["unpinned"] and "dlc_known_hosts pins no host key for it" in last["unpinned"]
    assert "node-2 (" in last["swapped"] and "not the one dlc_known_hosts pins" in last["swapped"]
    assert "dlc_known_hosts is not known_hosts content" in last["garbled"], last["garbled"]


