"""Each job's record and driver log, kept by the gateway as the job runs, beyond Ray.

Every `poll` seconds it asks Ray for its jobs: a new status is appended to the job's record with
its time, and a job that is running has its driver log followed (Ray's own websocket, as
`ray job logs -f`) into the gateway's logs folder, line by line as it comes; once the job ends the
log is written again from Ray's whole copy. A job the gateway records but Ray no longer knows
(the head restarted: Ray keeps no job history) is marked lost, with its log as it was kept. A
job's record names its run-history page once its log does (`run history: <url>`). Records of
jobs that ended more than `retention_days` ago are pruned, with their logs. Nothing here touches
a training step: a job's driver writes its log to Ray as always; the keeper reads it from Ray.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import aiohttp

from gateway.store import TERMINAL, Store

log = logging.getLogger("gateway.keeper")
RUN_PAGE = re.compile(r"^run history: (\S+)", re.M)


class Keeper:
    def __init__(self, store: Store, session: aiohttp.ClientSession, upstream: str, auth: dict[str, str],
                 poll: float, retention_days: float):
        self.store, self.session, self.upstream, self.auth = store, session, upstream, auth
        self.poll, self.retention_days = poll, retention_days
        self.tails: dict[str, asyncio.Task[None]] = {}
        self.task: asyncio.Task[None] | None = None
        self.pruned = 0.0

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        tasks = [t for t in (self.task, *self.tails.values()) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                log.info("Ray does not answer (%s); asking again", e.__class__.__name__)
            await asyncio.sleep(self.poll)

    async def once(self) -> None:
        async with self.session.get(self.upstream + "/api/jobs/", headers=self.auth,
                                    timeout=aiohttp.ClientTimeout(total=30)) as r:
            if r.status != 200:
                return
            listed: list[dict[str, Any]] = await r.json()
        known = set()
        for details in listed:
            sid = details.get("submission_id")
            if not sid:
                continue  # a driver run on a node by hand, not through the job API
            known.add(sid)
            if self.store.job(sid) is None:  # submitted around the gateway (before it, or on the head)
                meta = details.get("metadata") or {}
                self.store.add_job(sid, meta.get("dlc_owner", "nobody known"), meta.get("dlc_team", "none"),
                                   details.get("entrypoint") or "")
            changed = self.store.update_job(sid, details)
            if sid in self.tails:
                continue
            if details.get("status") not in TERMINAL:
                self.tails[sid] = asyncio.ensure_future(self.follow(sid))
            elif changed:  # it ended since the last pass, maybe before it was ever followed
                self.tails[sid] = asyncio.ensure_future(self.follow(sid, live=False))
        for job in self.store.jobs():
            if job["id"] not in known and job["status"] not in TERMINAL and job["details"] is not None:
                self.lost(job)
        if time.time() - self.pruned > 3600:
            self.pruned = time.time()
            for job_id in self.store.prune(self.retention_days):
                log.info("pruned %s (ended more than %g days ago)", job_id, self.retention_days)

    def lost(self, job: dict[str, Any]) -> None:
        now = time.time()
        details = {**job["details"], "status": "FAILED", "end_time": int(now * 1000),
                   "message": f"lost: Ray no longer knows this job (its head restarted while it was "
                              f"{job['status']}); the gateway kept its record and its log until then"}
        self.store.update_job(job["id"], details)
        if task := self.tails.pop(job["id"], None):
            task.cancel()

    async def follow(self, sid: str, live: bool = True) -> None:
        """A running job's driver log into its file as it comes (`live`); then, the job ended, Ray's
        whole copy of it in its place."""
        path = self.store.log_path(sid)
        try:
            if live:
                with path.open("w") as out:
                    async with self.session.ws_connect(f"{self.upstream}/api/jobs/{sid}/logs/tail",
                                                       headers=self.auth, heartbeat=30) as ws:
                        async for msg in ws:
                            if msg.type != aiohttp.WSMsgType.TEXT:
                                break
                            out.write(msg.data)
                            out.flush()
                            self.note_run_page(sid, msg.data)
            async with self.session.get(f"{self.upstream}/api/jobs/{sid}/logs", headers=self.auth) as r:
                text = (await r.json()).get("logs", "") if r.status == 200 else ""
            if text:
                path.write_text(text)
                self.note_run_page(sid, text)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.info("following %s's log stopped (%s); the next pass follows it again", sid,
                     e.__class__.__name__)
        finally:
            if self.tails.get(sid) is asyncio.current_task():
                del self.tails[sid]

    def note_run_page(self, sid: str, text: str) -> None:
        if m := RUN_PAGE.search(text):
            job = self.store.job(sid)
            if job and not job["run_url"]:
                self.store.set_run_url(sid, m.group(1))
