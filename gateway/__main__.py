"""python -m gateway: the gateway's server (the local cluster's start runs it; on a cluster's head,
systemd does, from roles/gateway).

    python -m gateway --listen unix:/run/dlc-gateway/gateway.sock \\
        --upstream http://<the head's private address>:8265 --token-file <the cluster's ray_token> \\
        --data /var/lib/dlc-gateway
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from gateway.app import Gateway
from gateway.store import Store


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="unix:PATH (a socket) or HOST:PORT")
    p.add_argument("--upstream", required=True,
                   help="Ray's dashboard on the head, e.g. http://<its private address>:8265")
    p.add_argument("--token-file", required=True, type=Path, help="the cluster's Ray token")
    p.add_argument("--data", required=True, type=Path, help="its database and the jobs' logs")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between two looks at Ray's jobs")
    p.add_argument("--retention-days", type=float, default=90.0,
                   help="days a job's record and log are kept after it ended")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        token = a.token_file.read_text().strip()
    except OSError as e:
        sys.exit(f"gateway: cannot read the cluster's token at {a.token_file} ({e.strerror}): "
                 f"make cluster-up writes it")
    gateway = Gateway(Store(a.data), a.upstream, token, a.poll, a.retention_days)
    asyncio.run(serve(gateway.app(), a.listen))


async def serve(app: web.Application, listen: str) -> None:
    """The server until SIGTERM or SIGINT (systemd's stop). On a Unix socket (a head's), the socket
    is left open to all: its folder (made by the unit, 0750) decides who may enter."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    if listen.startswith("unix:"):
        path = listen.removeprefix("unix:")
        Path(path).unlink(missing_ok=True)
        site: web.BaseSite = web.UnixSite(runner, path)
        await site.start()
        os.chmod(path, 0o666)
    else:
        host, _, port = listen.rpartition(":")
        site = web.TCPSite(runner, host, int(port))
        await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logging.getLogger("gateway").info("serving on %s", listen)
    await stop.wait()
    await runner.cleanup()

if __name__ == "__main__":
    main()
