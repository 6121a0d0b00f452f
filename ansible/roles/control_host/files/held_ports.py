"""On the control host, before any server is touched: which of the tunnel's local ports does
something else hold? One line per held port on stdout, nothing when all are free.

usage: python3 held_ports.py PORT=VARIABLE...      e.g. 8265=DASHBOARD_PORT 5000=TRACKING_PORT

  5000 TRACKING_PORT mlflow (pid 4242, user me): the local cluster's run history

A port is held when 127.0.0.1:PORT cannot be bound. Its holder is the process whose socket
listens there (from /proc: the socket's inode among each process's file descriptors), named by
its command and what it most likely is; a process of another user whose descriptors cannot be
read is named as such.
"""

from __future__ import annotations

import os
import pwd
import socket
import sys

KNOWN = (  # a word of the holder's command line -> what it is, and how to free the port
    ("mlflow", "the local cluster's run history", "make cluster-down stops the local cluster"),
    ("prometheus", "Prometheus (the local cluster's?)", "make cluster-down stops the local cluster's"),
    ("grafana", "Grafana", "stop it"),
    ("gateway", "the job gateway (the local cluster's?)", "make cluster-down stops the local cluster"),
    ("dashboard", "Ray's dashboard (the local cluster's?)", "make cluster-down stops the local cluster"),
    ("ray", "a Ray process (the local cluster's?)", "make cluster-down stops the local cluster"),
    ("ssh", "an ssh tunnel (another cluster's, or a run of this one that was stopped)",
     "make cluster-down with that cluster's INVENTORY closes its tunnel"),
)


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listening_inodes(port: int) -> set[str]:
    """The inodes of the sockets listening on `port` (any address), from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])
    return found


def holder(port: int) -> str:
    inodes = listening_inodes(port)
    unreadable = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            unreadable += 1
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                words = " ".join(a.decode(errors="replace") for a in argv if a)
                name = os.path.basename(argv[0].decode(errors="replace")) if argv and argv[0] else "?"
                user = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
                what, fix = next(((w, f) for key, w, f in KNOWN if key in words.lower()),
                                 ("a program", "stop it"))
                return f"{name} (pid {pid}, user {user}): {what}; {fix}"
    if unreadable:
        return "a process this user cannot see (another user's)"
    return "a process that was gone when asked"


def main(argv: list[str]) -> int:
    for item in argv:
        port, variable = item.split("=", 1)
        if not free(int(port)):
            print(f"{port} {variable} {holder(int(port))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
