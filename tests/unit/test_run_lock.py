"""Two runs with the same --name at once: the second is one line before it touches the run's
folder, also when one runs on the head and the other on a worker over NFS; the lock dies with its
process, however it ends, so a resumed run is never refused."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainkit.errors import UserError
from trainkit.store import LOCK, hold_run

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from trainkit.store import hold_run\n"
        "with hold_run(sys.argv[1], 'r'):\n    print('held', flush=True)\n    time.sleep(300)\n")


def test_a_second_run_of_the_same_name_is_one_line_until_the_first_is_gone(tmp_path):
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        (tmp_path / "r" / "checkpoint_000001").mkdir()
        with pytest.raises(UserError) as e, hold_run(str(tmp_path), "r"):
            raise AssertionError("the second run got the folder")
        assert re.fullmatch(rf"run r is running already \({re.escape(socket.gethostname())} pid "
                            rf"{first.pid} since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ\): wait for it to "
                            r"end, or give this one another --name", str(e.value)), str(e.value)
        assert (tmp_path / "r" / "checkpoint_000001").is_dir()  # nothing of the first run touched
    finally:
        os.kill(first.pid, signal.SIGKILL)  # dies holding it: the kernel lets go
        first.wait(timeout=30)
    with hold_run(str(tmp_path), "r"):
        assert f"pid {os.getpid()} " in (tmp_path / "r" / LOCK).read_text()
    assert (tmp_path / "r" / LOCK).read_text() == ""  # emptied on leaving: the folder as it was
    with hold_run(str(tmp_path), "r"):  # released on leaving: the same process again
        pass


# What a worker's lock over NFS is on the head, the NFS server: a POSIX record lock on the file
# (the client's lockd or NFSv4 LOCK becomes one there), taken by another process than the driver.
NFS_CLIENT = ("import fcntl, sys, time\n"
              "f = open(sys.argv[1], 'a+')\n"
              "try:\n    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
              "except OSError:\n    print('refused', flush=True)\n    sys.exit(0)\n"
              "f.write('node-2 pid 4242 since 2026-11-27T00:00:00Z\\n'); f.flush()\n"
              "print('held', flush=True)\ntime.sleep(300)\n")


def test_the_lock_is_the_one_nfs_carries_between_the_head_and_a_worker(tmp_path):
    """A driver on the head holds the run's folder on the export itself, a rank on a worker holds
    it through NFS, which the server turns into a POSIX lock: the two must see each other (an
    flock on the head does not see a POSIX lock, nor it an flock: both would train and publish
    under one name)."""
    (tmp_path / "r").mkdir()
    lock = tmp_path / "r" / LOCK
    worker = subprocess.Popen([sys.executable, "-c", NFS_CLIENT, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as e, hold_run(str(tmp_path), "r"):
            raise AssertionError("the driver got the folder a worker holds")
        assert "run r is running already (node-2 pid 4242 since 2026-11-27T00:00:00Z)" in str(e.value)
    finally:
        worker.kill()
        worker.wait(timeout=30)
    with hold_run(str(tmp_path), "r"):  # and the other way round: the worker is refused
        other = subprocess.run([sys.executable, "-c", NFS_CLIENT, str(lock)], capture_output=True,
                               text=True, timeout=60)
        assert other.stdout.strip() == "refused", other.stdout + other.stderr


def test_uris_are_not_held(tmp_path):
    with hold_run("s3://bucket/runs", "r"), hold_run("s3://bucket/runs", "r"):
        pass
