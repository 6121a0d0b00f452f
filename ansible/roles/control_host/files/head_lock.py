"""Hold the cluster's lock on its head for as long as this ansible-playbook run lives.

usage: head_lock.py SSH_CONFIG HEAD ACTION WAIT_S

The lock is a flock on the head (/run/dlcluster/ops.lock), taken by a shell that sudo runs over
ssh through the bastion and held while that shell's stdin stays open. This script opens the
connection, reads the head's answer and prints it: `LOCKED`, or `HELD <holder>` (user@host,
pid, action, start time of the run that holds it; exit 3), or the ssh error (exit 1). When it
got the lock it leaves a small process behind that keeps the connection open until the
ansible-playbook run that started it (its topmost ancestor named so) has exited, however it
ended, and then closes it: the flock is released with the connection, so no lock outlives its
run (a laptop that dropped off the network: when the head's sshd drops the connection).
"""

from __future__ import annotations

import getpass
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

REMOTE = r"""
mkdir -p /run/dlcluster && chmod 700 /run/dlcluster
exec 8>>/run/dlcluster/ops.lock
if ! flock -w "$2" 8; then echo "HELD $(cat /run/dlcluster/ops.holder 2>/dev/null)"; exit 3; fi
printf '%s\n' "$1" >/run/dlcluster/ops.holder
echo LOCKED
exec cat >/dev/null
"""


def playbook_pid() -> int:
    """The ansible-playbook process this task belongs to: the topmost ancestor whose command line
    names ansible-playbook (its workers are forks of it with the same command line)."""
    pid, found = os.getppid(), os.getppid()
    while pid > 1:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        if b"ansible-playbook" in cmdline:
            found = pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def hold(ssh_config: str, head: str, holder: str, wait_s: str, owner: int, answer_fd: int) -> None:
    """In the process left behind: open the connection, pass the head's answer up, hold the lock."""
    remote = f"sudo -n sh -c {shlex.quote(REMOTE)} sh {shlex.quote(holder)} {int(wait_s)}"
    ssh = subprocess.Popen(
        ["ssh", "-F", ssh_config, "-o", "BatchMode=yes", "-o", "ServerAliveInterval=15",
         "-o", "ServerAliveCountMax=4", head, remote],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    answer = ssh.stdout.readline().decode(errors="replace").strip()
    if answer != "LOCKED":
        ssh.stdin.close()
        err = ssh.stderr.read().decode(errors="replace").strip()
        ssh.wait()
        answer = answer or "ERROR " + (" ".join(err.split()) or f"ssh exited with {ssh.returncode}")
    os.write(answer_fd, answer.encode())
    os.close(answer_fd)
    while answer == "LOCKED" and ssh.poll() is None:
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    ssh.stdin.close()  # EOF: the head's `cat` ends, its shell exits, the flock is released
    try:
        ssh.wait(timeout=30)
    except subprocess.TimeoutExpired:
        ssh.kill()


def main() -> int:
    ssh_config, head, action, wait_s = sys.argv[1:5]
    owner = playbook_pid()
    holder = (f"{getpass.getuser()}@{socket.gethostname()} pid {owner} ({action}) since "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    read_fd, write_fd = os.pipe()
    if os.fork() == 0:  # the child holds the connection, in a session of its own
        os.close(read_fd)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # Ansible reads the task's output until every writer has closed it
            os.dup2(devnull, fd)
        try:
            hold(ssh_config, head, holder, wait_s, owner, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        answer = f.read().strip()
    if answer == "LOCKED":
        print(f"LOCKED {holder}")
        return 0
    print(answer.removeprefix("ERROR ") or "no answer from the head")
    return 3 if answer.startswith("HELD") else 1


if __name__ == "__main__":
    sys.exit(main())
