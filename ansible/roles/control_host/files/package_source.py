"""Can this node reach the package source cluster-up will use? Run on a node, before any change.

usage: python3 - [--proxy URL [--ours]] < package_source.py
  --proxy URL  the apt proxy the base role will point this node at (dlc_apt_proxy);
  --ours       it is the bastion's own proxy, which this run installs: "connection refused"
               (the bastion answers, the proxy is not there yet) counts as reachable.
Without --proxy: a proxy the site configured in apt's own files (not the one cluster-up
wrote, 01dlcluster-proxy, which this run removes), else every mirror in apt's sources, directly.
Prints nothing and exits 0 when the source answers; else one line saying what does not, exit 1.
Python 3 standard library only: it runs on the node's own python3.
"""

from __future__ import annotations

import glob
import os
import re
import socket
import sys
from urllib.parse import urlsplit

TIMEOUT = 5
APT = os.environ.get("DLC_APT_ROOT", "/etc/apt")  # tests point it at a folder of their own
OURS = "01dlcluster-proxy"  # roles/base writes it; not the site's


def mirrors(apt: str = APT) -> list[tuple[str, int]]:
    """(host, port) of every http(s) source in sources.list, *.list and deb822 *.sources."""
    uris = []
    for path in [f"{apt}/sources.list", *sorted(glob.glob(f"{apt}/sources.list.d/*.list"))]:
        for line in _lines(path):
            m = re.match(r"deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?(\S+)", line)
            if m:
                uris.append(m.group(1))
    for path in sorted(glob.glob(f"{apt}/sources.list.d/*.sources")):
        for line in _lines(path):
            m = re.match(r"URIs:\s*(.+)", line, re.I)
            if m:
                uris.extend(m.group(1).split())
    out = []
    for uri in uris:
        u = urlsplit(uri)
        if u.scheme in ("http", "https") and u.hostname:
            hp = (u.hostname, u.port or (443 if u.scheme == "https" else 80))
            if hp not in out:
                out.append(hp)
    return out


def site_proxy(apt: str = APT) -> str | None:
    """Acquire::http::Proxy from apt's configuration files other than cluster-up's own."""
    files = [f"{apt}/apt.conf", *sorted(glob.glob(f"{apt}/apt.conf.d/*"))]
    for path in files:
        if os.path.basename(path) == OURS:
            continue
        for line in _lines(path):
            m = re.match(r'Acquire::https?::Proxy\s+"([^"]+)"', line)
            if m and m.group(1).upper() != "DIRECT" and m.group(1).lower() != "false":
                return m.group(1)
    return None


def _lines(path: str) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith(("#", "//"))]
    except OSError:
        return []


def reach(host: str, port: int, refused_ok: bool = False) -> str | None:
    """None when host:port answers, else why not, in a few words."""
    try:
        socket.create_connection((host, port), timeout=TIMEOUT).close()
        return None
    except socket.gaierror:
        return "the name does not resolve"
    except ConnectionRefusedError:
        return None if refused_ok else "connection refused"
    except TimeoutError:
        return f"no answer within {TIMEOUT} s"
    except OSError as e:
        return e.strerror or str(e)


def check(proxy: str | None, ours: bool, apt: str = APT) -> str | None:
    """None when the node can reach its package source, else one phrase naming it and why not."""
    if proxy:
        u = urlsplit(proxy)
        if not u.hostname:
            return f"the proxy {proxy} is not a URL such as http://host:3142"
        why = reach(u.hostname, u.port or 80, refused_ok=ours)
        return f"proxy {u.hostname}:{u.port or 80}: {why}" if why else None
    site = site_proxy(apt)
    if site:
        return check(site, False, apt)
    found = mirrors(apt)
    if not found:
        return f"no http(s) package source in {apt}/sources.list*"
    for host, port in found:
        why = reach(host, port)
        if why:
            return f"direct to {host}:{port}: {why}"
    return None


def main(argv: list[str]) -> int:
    proxy = argv[argv.index("--proxy") + 1] if "--proxy" in argv else None
    problem = check(proxy or None, "--ours" in argv)
    if problem:
        print(problem)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
