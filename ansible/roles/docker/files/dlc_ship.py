"""Bring the project's image to a node, from the control host (the docker role runs this there).

  dlc_ship.py stream NODE SOURCE BYTES   SOURCE is image:NAME (this machine's engine, `docker save`)
                                         or an archive file (`docker save` output, gzip allowed):
                                         piped through ssh into the node's `docker load`, no file
                                         on either end
  dlc_ship.py push IMAGE                 push IMAGE to the bastion's registry through an ssh tunnel;
                                         prints {"ref": "<repository>@sha256:..."} for the nodes

Common flags: --ssh-config FILE (the generated one), --progress FILE (a line every few seconds:
how far, how fast, how long left; make cluster-up shows it under the running task).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 1 << 20
EVERY_S = 5.0


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    def __init__(self, path: Path, label: str, total: int):
        self.path, self.label, self.total = path, label, total
        self.start = self.last = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write(f"{label}: starting ({gb(total)})" if total else f"{label}: starting")

    def write(self, line: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(line + "\n")
        tmp.replace(self.path)

    def bytes_done(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last < EVERY_S:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-6)
        line = f"{self.label}: {gb(done)}"
        if self.total:
            left = max(self.total - done, 0) / max(rate, 1)
            line += f" of {gb(self.total)} ({100 * done / self.total:.0f}%), {left:.0f} s left"
        self.write(line + f", {rate / 1e6:.0f} MB/s")

    def done(self, line: str) -> None:
        self.write(f"{self.label}: {line}")


def ssh(config: str, *args: str) -> list[str]:
    return ["ssh", "-F", config, "-o", "BatchMode=yes", *args]


def stream(a) -> int:
    if a.source.startswith("image:"):
        source = subprocess.Popen(["docker", "save", a.source[len("image:"):]], stdout=subprocess.PIPE)
    else:
        source = subprocess.Popen(["cat", "--", a.source], stdout=subprocess.PIPE)
    load = subprocess.Popen(ssh(a.ssh_config, a.node, "sudo -n docker load"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    progress = Progress(a.progress, a.node, a.bytes)
    done, t0 = 0, time.monotonic()
    try:
        while chunk := source.stdout.read(CHUNK):
            load.stdin.write(chunk)
            done += len(chunk)
            progress.bytes_done(done)
    except BrokenPipeError:
        pass
    load.stdin.close()
    out = load.stdout.read().decode(errors="replace").strip()
    if source.wait() != 0 or load.wait() != 0:
        print(f"{a.node}: the image did not arrive ({gb(done)} sent): {out[-500:]}", file=sys.stderr)
        return 1
    s = time.monotonic() - t0
    progress.done(f"{gb(done)} in {s:.0f} s ({done / s / 1e6:.0f} MB/s)")
    print(json.dumps({"bytes": done, "seconds": round(s, 1), "load": out[-300:]}))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def push(a) -> int:
    """docker push through `ssh -L 127.0.0.1:<port>:<registry>` (Docker trusts a loopback registry
    over plain HTTP). The tag and the tunnel are gone afterwards; only layers the registry lacks
    move, and the printed reference is by digest, so the nodes get exactly these bytes."""
    name = a.image.rsplit("/", 1)[-1]
    repository, _, tag = name.partition(":")
    port = a.local_port or free_port()
    local = f"127.0.0.1:{port}/{repository}:{tag or 'latest'}"
    progress = Progress(a.progress, f"{a.registry}", 0)
    sock = Path(tempfile.mkdtemp(prefix="dlc-push-")) / "s"
    tunnel = ssh(a.ssh_config, "-o", "ExitOnForwardFailure=yes", "-M", "-S", str(sock), "-f", "-N",
                 "-L", f"127.0.0.1:{port}:{a.registry}", a.bastion)
    opened = subprocess.run(tunnel, capture_output=True, text=True, timeout=60)
    if opened.returncode != 0:
        print(f"no tunnel to the registry at {a.registry} through {a.bastion}: {opened.stderr.strip()}",
              file=sys.stderr)
        return 1
    t0, lines, digest = time.monotonic(), [], ""
    try:
        subprocess.run(["docker", "tag", a.image, local], check=True, capture_output=True)
        proc = subprocess.Popen(["docker", "push", local], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        state: dict[str, str] = {}
        for line in proc.stdout:
            line = line.strip()
            lines.append(line)
            if m := re.match(r"([0-9a-f]{12}): (.*)", line):
                state[m.group(1)] = m.group(2)
                moved = sum(v == "Pushed" for v in state.values())
                there = sum(v == "Layer already exists" for v in state.values())
                progress.write(f"{a.registry}: {moved + there} of {len(state)} layers done ({there} there "
                               f"already), {time.monotonic() - t0:.0f} s")
            if m := re.search(r"digest: (sha256:[0-9a-f]{64})", line):
                digest = m.group(1)
        if proc.wait() != 0 or not digest:
            print(f"push to the registry at {a.registry} failed: {' / '.join(lines[-5:])}", file=sys.stderr)
            return 1
    finally:
        subprocess.run(["docker", "rmi", local], capture_output=True)
        subprocess.run(ssh(a.ssh_config, "-S", str(sock), "-O", "exit", a.bastion), capture_output=True)
        sock.parent.rmdir() if sock.parent.exists() and not any(sock.parent.iterdir()) else None
    pushed = sum(line.endswith(": Pushed") for line in lines)
    s = time.monotonic() - t0
    progress.done(f"{pushed} layer(s) pushed in {s:.0f} s")
    print(json.dumps({"ref": f"{a.registry}/{repository}@{digest}", "layers_pushed": pushed,
                      "seconds": round(s, 1)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ssh-config", required=True)
    p.add_argument("--progress", type=Path, required=True)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stream")
    s.add_argument("node")
    s.add_argument("source")
    s.add_argument("bytes", type=int)
    u = sub.add_parser("push")
    u.add_argument("image")
    u.add_argument("--bastion", required=True)
    u.add_argument("--registry", required=True, help="host:port the bastion reaches the registry at")
    u.add_argument("--local-port", type=int, default=0)
    a = p.parse_args(argv)
    return stream(a) if a.cmd == "stream" else push(a)


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
