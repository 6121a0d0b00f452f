"""Run inside a container: which of the given TCP ports answer at these addresses.

    python3 - ADDR[,ADDR...] PORT [PORT ...]   (the script on stdin) -> JSON ["addr:port", ...]

A refused or unanswered connection is closed; only an accepted one counts."""

import concurrent.futures
import json
import socket
import sys


def answers(target: tuple[str, int]) -> bool:
    try:
        socket.create_connection(target, timeout=2).close()
        return True
    except OSError:
        return False


addrs, ports = sys.argv[1].split(","), [int(p) for p in sys.argv[2:]]
targets = [(a, p) for a in addrs for p in ports]
with concurrent.futures.ThreadPoolExecutor(32) as pool:
    accepted = zip(targets, pool.map(answers, targets), strict=True)
    print(json.dumps([f"{a}:{p}" for (a, p), ok in accepted if ok]))
