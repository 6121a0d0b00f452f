"""make leftovers: what the test tiers left on this machine, one line each; exit 1 when anything.

A finished `make test` leaves nothing but what it keeps on purpose (the images, the emulated
nodes' data disks, the caches in $DLC_CACHE, the Docker engine it started); a killed one may leave
more, which the next run of each tier removes at its start (docs/testing.md, "A run that was
killed"). This names what is there now, by what the tiers make:
- the tiers' fixed ports listening: the cluster tier's clusters (GCS, dashboard, Prometheus and
  run history at 6390/8290/9290/10290 and 6395/8295/...), the emulated tier's tunnels (8275-8280,
  each +1000/+2000/+3000) and its image push (35000), the demo stand-in's 6379/8265 while its
  state file says the tier started it;
- the tiers' state files (--state, $DLC_CACHE/test-state: a cluster a killed cluster tier left, a run-history
  server a test started alone, the emulated tier's demo stand-in);
- the image tier's containers and network (`dlcluster-test`, which all its containers run on);
- the emulated tier's containers, networks and shared volume (`dlc-emu-*`; not its `dlc-emu-disk-*`
  data disks, kept on purpose) and its iptables rules;
- in the checkout: the upload test's planted files (keys and credentials by their usual names,
  known by their one line), and, for make test, every file git shows new or changed since the run
  started (its git status then: a user's own edits are not leftovers).

    python scripts/leftovers.py --state $DLC_CACHE/test-state     # make leftovers
    (scripts/test_suite.py --state ... runs it after its lanes: make test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
# the cluster tier's (tests/cluster/conftest.py: the shared cluster, a second one for the port test;
# each GCS, dashboard, dashboard+1000 Prometheus, dashboard+2000 run history)
CLUSTER_PORTS = [p for gcs, dash in ((6390, 8290), (6395, 8295))
                 for p in (gcs, dash, dash + 1000, dash + 2000)]
# the emulated tier's (tests/emulated/conftest.py TUNNEL_PORTS; node_image's docker_push_port)
EMULATED_PORTS = [base + k for base in range(8275, 8281) for k in (0, 1000, 2000, 3000)] + [35000]
DEMO_PORTS = [6379, 8265]
DOCKER = "/usr/bin/docker"
IMAGE_NETWORK = "dlcluster-test"  # tests/container/test_image.py's NETWORK
TEST_TMP = "/pytest-of-"  # in the path of every temporary folder pytest makes (tmp_path, tmp_path_factory)
TIERS = ("cluster", "image", "emulated")  # the tiers that leave things behind when killed
MARKER = b"# a secret that must not leave this machine\n"  # tests/cluster/test_upload.py's SECRET


def listening(ports: list[int]) -> dict[int, str]:
    """port -> who listens on it (pid and command, or '?'), for those of `ports` taken on any address."""
    taken: dict[int, str] = {}
    try:
        conns = psutil.net_connections("tcp")
    except psutil.AccessDenied:
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports:
            who = "?"
            if c.pid:
                try:
                    p = psutil.Process(c.pid)
                    who = f"pid {c.pid} {' '.join(p.cmdline())[:80]}"
                except psutil.Error:
                    who = f"pid {c.pid}"
            taken.setdefault(c.laddr.port, who)
    return taken


def under_pytest(p: psutil.Process) -> bool:
    """Whether a pytest runs above `p` (its parents): then it is a running test's, not left over."""
    try:
        return any("pytest" in " ".join(a.cmdline()) for a in p.parents())
    except psutil.Error:
        return False


def processes() -> list[str]:
    """Processes a test started and nothing stopped: their command line names a folder of pytest's
    temporary ones (a test's DLC_CONFIG: its Ray cluster, run-history server, ssh tunnel...), with no
    pytest above them."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if TEST_TMP in cmd and "pytest" not in (p.info["cmdline"] or [""])[0] and not under_pytest(p):
            found.append(f"process {p.info['pid']} ({cmd[:100]}): a test's, still running")
    return found


def state_files(state: Path, tier: str) -> list[str]:
    files = ([state / "emulated-demo-stand-in"] if tier == "emulated"
             else sorted((state / "cluster-tier").rglob("*")))
    return [f"{p}: the {tier} tier's state file (a killed run's; the tier's next run removes what it names)"
            for p in files if p.is_file()]


def docker_lines(*args: str) -> list[str]:
    if not (os.path.exists(DOCKER) and shutil.which("docker")):
        return []
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=60)
    return proc.stdout.split() if proc.returncode == 0 else []


def image() -> list[str]:
    """The image tier's: its containers all run on its own network (tests/container/test_image.py)."""
    found = [f"container {n}: the image tier's, on its network {IMAGE_NETWORK} (docker rm -f {n})"
             for n in docker_lines("ps", "-a", "--filter", f"network={IMAGE_NETWORK}", "--format",
                                   "{{.Names}}")]
    found += [f"docker network {n}: the image tier's (docker network rm {n}; its next run removes it too)"
              for n in docker_lines("network", "ls", "--filter", f"name=^{IMAGE_NETWORK}$", "--format",
                                    "{{.Name}}")]
    return found


def emulated() -> list[str]:
    found = [f"container {n}: the emulated tier's (make emulate-down)"
             for n in docker_lines("ps", "-a", "--filter", "name=^dlc-emu-", "--format", "{{.Names}}")]
    found += [f"docker network {n}: the emulated tier's (make emulate-down)"
              for n in docker_lines("network", "ls", "--filter", "name=^dlc-emu-", "--format", "{{.Name}}")]
    found += [f"docker volume {n}: the emulated tier's (make emulate-down)"
              for n in docker_lines("volume", "ls", "--filter", "name=^dlc-emu-", "--format", "{{.Name}}")
              if not n.startswith("dlc-emu-disk-")]  # the nodes' data disks: kept on purpose
    if shutil.which("iptables") and os.geteuid() == 0:
        rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, timeout=60).stdout
        found += [f"iptables rule '{r}': the emulated tier's (make emulate-down)" for r in rules.splitlines()
                  if "dlc-emu-" in r or "172.31.25" in r]
    return found


def git_status() -> set[str]:
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return set(proc.stdout.splitlines()) if proc.returncode == 0 else set()


def planted() -> list[str]:
    """Files git ignores that hold only the upload test's marker (tests/cluster/test_upload.py's
    SECRET: keys and credentials by their usual names, which .gitignore keeps out of git status)."""
    proc = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "-z"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    found = []
    for name in proc.stdout.split("\0"):
        path = REPO / name
        if name and path.is_file() and not path.is_symlink() and path.stat().st_size == len(MARKER):
            if path.read_bytes() == MARKER:
                found.append(f"in the checkout: {name} (the upload test's planted file; it removes it "
                             "when it runs again)")
    return found


def checkout(before: set[str] | None) -> list[str]:
    found = planted()
    if before is not None:
        found += [f"in the checkout: {line.strip()} (written during the run; git status)"
                  for line in sorted(git_status() - before)]
    return found


def find(state: Path, tiers: list[str], before: set[str] | None) -> list[str]:
    """A line for each thing left behind: by the tiers in `tiers` (of TIERS; their state files under
    `state`), and in the checkout (beyond `before`, git status as a run found it, when given)."""
    found = []
    if "cluster" in tiers:
        found += [f"port {port} listening ({who}): the cluster tier's"
                  for port, who in sorted(listening(CLUSTER_PORTS).items())]
        found += state_files(state, "cluster")
    if "emulated" in tiers:
        stand_in = (state / "emulated-demo-stand-in").is_file()
        ports = EMULATED_PORTS + (DEMO_PORTS if stand_in else [])
        found += [f"port {port} listening ({who}): the emulated tier's"
                  for port, who in sorted(listening(ports).items())]
        found += state_files(state, "emulated") + emulated()
    if "image" in tiers:
        found += image()
    if tiers:
        found += processes()
    return found + checkout(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--state", type=Path, required=True,
                    help="the tiers' state folder ($DLC_CACHE/test-state)")
    ap.add_argument("--tiers", default=",".join(TIERS),
                    help="whose ports, state files, containers and rules to look for (default: the three; "
                         "the checkout is looked at always)")
    a = ap.parse_args(argv)
    tiers = [t for t in a.tiers.split(",") if t]
    if unknown := set(tiers) - set(TIERS):
        print(f"leftovers: error: --tiers {a.tiers}: no leftovers are known for "
              f"{', '.join(sorted(unknown))}; name cluster, image and/or emulated (the other tiers leave "
              "nothing but files in the checkout)",
              file=sys.stderr)
        return 2
    found = find(a.state, tiers, None)  # the checkout: the planted files (no status from before)
    for line in found:
        print(f"left behind: {line}")
    if not found:
        looked = {"cluster": "the cluster tier's ports and state", "image": "the image tier's containers",
                  "emulated": "the emulated tier's ports, state, containers, networks and rules"}
        print(f"left behind: nothing ({'; '.join([*(looked[t] for t in tiers), 'the checkout'])})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
