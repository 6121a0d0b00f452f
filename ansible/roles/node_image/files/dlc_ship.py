"""Bring the project's image to a node, from the control host (the node_image role runs this there).

  dlc_ship.py stream NODE SOURCE BYTES   SOURCE is image:NAME (this machine's engine, `docker save`)
                                         or an archive file (`docker save` output, gzip allowed):
                                         piped through ssh into the node's `docker load`, no file
                                         on either end
  dlc_ship.py push IMAGE                 push IMAGE to the push side of the bastion's registry (its
                                         loopback, with the credential) through ssh (-W, one per
                                         connection, bytes counted); prints {"ref":
                                         "<registry>/<repository>@sha256:...", "bytes": ...}, where
                                         <registry> is the nodes' (read-only) side

Common flags: --ssh-config FILE (the generated one), --progress FILE (a line every few seconds:
how far, how fast, how long left; make cluster-up shows it under the running task).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHUNK = 1 << 20
USER = "dlc-push"  # the push side's one user (roles/bastion writes its password's hash)
EVERY_S = 5.0


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    def __init__(self, path: Path, label: str, total: int):
        self.path, self.label, self.total = path, label, total
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write(f"{label}: starting ({gb(total)})" if total else f"{label}: starting")

    def write(self, line: str) -> None:
        with self.lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(line + "\n")
            tmp.replace(self.path)

    def bytes_done(self, done: int) -> None:
        now = time.monotonic()
        with self.lock:
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


class Tunnel:
    """127.0.0.1:<port> -> the registry, one `ssh -W` through the bastion per connection (docker
    opens several), counting the bytes each way: what crossed the bastion for this push."""

    def __init__(self, a, progress: Progress):
        self.a, self.progress = a, progress
        self.sent = self.received = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", a.local_port))
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self.relay, args=(conn,), daemon=True).start()

    def relay(self, conn: socket.socket) -> None:
        hop = subprocess.Popen(ssh(self.a.ssh_config, "-W", self.a.push_to, self.a.bastion),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

        def up() -> None:  # docker -> registry: the layers
            try:
                while chunk := conn.recv(CHUNK):
                    hop.stdin.write(chunk)
                    hop.stdin.flush()
                    with self.lock:
                        self.sent += len(chunk)
                    self.progress.bytes_done(self.sent)
            except OSError:
                pass
            finally:
                try:
                    hop.stdin.close()
                except OSError:
                    pass

        t = threading.Thread(target=up, daemon=True)
        t.start()
        try:
            while chunk := hop.stdout.read1(CHUNK):
                conn.sendall(chunk)
                with self.lock:
                    self.received += len(chunk)
        except OSError:
            pass
        finally:
            t.join(timeout=5)
            conn.close()
            hop.kill()
            hop.wait()

    def close(self) -> None:
        self.server.close()


def password(a) -> tuple[str, str]:
    """(the push side's password, '') read through ssh with sudo from --credential-on-bastion PATH
    (into memory only); else ('', what went wrong)."""
    proc = subprocess.run(ssh(a.ssh_config, a.bastion, f"sudo -n cat {a.credential_on_bastion}"),
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        return "", (f"cannot read the registry's push credential {a.credential_on_bastion} on {a.bastion} "
                    f"(sudo -n cat: {proc.stderr.strip()[-200:] or 'empty'}): run make cluster-up, "
                    "which makes it")
    return proc.stdout.strip(), ""


def login(a, local: str, config: str) -> str:
    """docker login to the push side with the credential, into a docker config folder of this push
    only (removed afterwards): the password never lands in ~/.docker. '' or what went wrong."""
    secret, problem = password(a)
    if problem:
        return problem
    proc = subprocess.run(["docker", "--config", config, "login", "--username", USER, "--password-stdin",
                           local], input=secret + "\n", capture_output=True, text=True)
    return "" if proc.returncode == 0 else "it refused the login: " + " / ".join(
        (proc.stdout + proc.stderr).strip().splitlines()[-3:])


def push(a) -> int:
    """docker push to 127.0.0.1:<port> (Docker trusts a loopback registry over plain HTTP), relayed
    through the bastion to its registry's push side. Only layers the registry lacks move; the printed
    reference is by digest, on the nodes' side, so the nodes get exactly these bytes. The local tag
    is removed afterwards."""
    name = a.image.rsplit("/", 1)[-1]
    repository, _, tag = name.partition(":")
    host = f"127.0.0.1:{a.local_port}"
    local = f"{host}/{repository}:{tag or 'latest'}"
    progress = Progress(a.progress, f"{a.registry}", 0)
    try:
        tunnel = Tunnel(a, progress)
    except OSError as e:
        print(f"cannot listen on 127.0.0.1:{a.local_port} for the push ({e}): free it or set "
              f"docker_push_port", file=sys.stderr)
        return 1
    t0, lines, digest = time.monotonic(), [], ""
    config = tempfile.mkdtemp(prefix="dlc-push-")  # 0700
    try:
        problem = login(a, host, config)
        if problem:
            print(f"no push to the registry ({a.push_to} on {a.bastion}): {problem}",
                  file=sys.stderr)
            return 1
        subprocess.run(["docker", "tag", a.image, local], check=True, capture_output=True)
        proc = subprocess.run(["docker", "--config", config, "push", local], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        lines = proc.stdout.splitlines()
        digests = [m.group(1) for line in lines if (m := re.search(r"digest: (sha256:[0-9a-f]{64})", line))]
        digest = digests[-1] if digests else ""
        if proc.returncode != 0 or not digest:
            print(f"push to the registry at {a.push_to} through {a.bastion} failed: "
                  f"{' / '.join(lines[-5:])}", file=sys.stderr)
            return 1
    finally:
        subprocess.run(["docker", "--config", config, "logout", host], capture_output=True)
        shutil.rmtree(config, ignore_errors=True)
        subprocess.run(["docker", "rmi", local], capture_output=True)
        tunnel.close()
    pushed = sum(line.endswith(": Pushed") for line in lines)
    s = time.monotonic() - t0
    progress.done(f"{pushed} layer(s), {gb(tunnel.sent)} through the bastion in {s:.0f} s")
    print(json.dumps({"ref": f"{a.registry}/{repository}@{digest}", "layers_pushed": pushed,
                      "bytes": tunnel.sent, "seconds": round(s, 1)}))
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
    u.add_argument("--registry", required=True, help="host:port the nodes pull from (in the printed ref)")
    u.add_argument("--push-to", required=True, help="host:port the bastion reaches the push side at")
    u.add_argument("--credential-on-bastion", required=True,
                   help=f"the file on the bastion holding the push side's password (user {USER}), read with "
                        "sudo through ssh")
    u.add_argument("--local-port", type=int, default=35000)
    a = p.parse_args(argv)
    return stream(a) if a.cmd == "stream" else push(a)


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
