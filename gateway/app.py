"""The gateway's HTTP server (aiohttp): every request names its caller by a credential (the Ray
client's `Authorization: Bearer`, Ray's `X-Ray-Authorization`, or the dashboard's sign-in cookie),
is checked against the allow-list (policy.py) and the job's owner, audited where it changes
something or is refused, and forwarded to Ray's dashboard with the cluster's token instead of the
person's. The person's credential never reaches Ray; the cluster's token never leaves the head.
"""

from __future__ import annotations

import asyncio
import hmac
import pwd
import secrets
import socket
import string
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from gateway import keeper, policy
from gateway.policy import Caller, Kind
from gateway.store import Store, verify

COOKIE = "ray-authentication-token"  # Ray's dashboard's sign-in cookie (its UI sends it)
HOP = {"host", "connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "content-length",
       "proxy-authorization", "proxy-authenticate"}
CREDENTIALS = {"authorization", "x-ray-authorization", "cookie"}
OWNER, TEAM = "dlc_owner", "dlc_team"  # the job's metadata fields the gateway sets
MAX_BODY = 512 * 1024 * 1024  # a working dir's upload (Ray takes 100 MiB; it answers larger itself)


class Refused(Exception):
    """A request refused: its status and one line; who asked, where the credential names a person
    it no longer admits (revoked, expired), and what they asked, where it has a name (stop, delete)."""

    def __init__(self, status: int, line: str, who: str | None = None, action: str | None = None):
        super().__init__(line)
        self.status, self.line, self.who, self.action = status, line, who, action


def source(request: web.Request) -> str:
    """Where a request came from: over the head's Unix socket, the account of the process at the
    other end (the sshd of a person's tunnel); over TCP, the peer's address."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family == socket.AF_UNIX:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        try:
            return f"uid {uid} ({pwd.getpwuid(uid).pw_name}) on the head"
        except KeyError:
            return f"uid {uid} on the head"
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unknown"


def credential(request: web.Request, header_only: bool = False) -> str | None:
    for name in ("Authorization", "X-Ray-Authorization"):
        value = request.headers.get(name, "")
        if value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None if header_only else request.cookies.get(COOKIE)


def submission_id() -> str:
    """As Ray makes one (raysubmit_ and 16 letters and digits): the gateway names each job it
    submits, so its record exists before Ray answers."""
    return "raysubmit_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(16))


def owned_submission(body: dict[str, Any], caller: Caller) -> dict[str, Any]:
    """A submission's body as forwarded: its owner and team the caller's, whatever the client sent,
    in its metadata and its environment (DLC_JOB_OWNER, DLC_JOB_TEAM), and a submission id."""
    out = dict(body)
    out["metadata"] = {**(body.get("metadata") or {}), OWNER: caller.name, TEAM: caller.team}
    runtime_env = dict(body.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), "DLC_JOB_OWNER": caller.name,
                               "DLC_JOB_TEAM": caller.team}
    out["runtime_env"] = runtime_env
    out["submission_id"] = body.get("submission_id") or submission_id()
    return out


class Gateway:
    def __init__(self, store: Store, upstream: str, token: str, poll: float = 2.0,
                 retention_days: float = 90.0):
        self.store = store
        self.upstream = upstream.rstrip("/")
        self.token = token
        self.ray_auth = {"Authorization": f"Bearer {token}"}
        self.poll = poll
        self.retention_days = retention_days
        self.session: aiohttp.ClientSession | None = None
        self.keeper: keeper.Keeper | None = None

    # ---- the application
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{path:.*}", self.handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=10))
        self.keeper = keeper.Keeper(self.store, self.session, self.upstream, self.ray_auth, self.poll,
                                    self.retention_days)
        self.keeper.start()

    async def _stop(self, _: web.Application) -> None:
        if self.keeper:
            await self.keeper.stop()
        if self.session:
            await self.session.close()

    # ---- who
    def caller(self, request: web.Request, given: str | None) -> Caller:
        if not given:
            raise Refused(401, "Unauthorized: Missing authentication token: put your credential where Ray's "
                               "client reads its token (export RAY_AUTH_TOKEN_PATH=<its file>)")
        if hmac.compare_digest(given.encode(), self.token.encode()):
            return policy.OPERATOR
        user = self.store.user_by_credential(given)
        if user is None:
            raise Refused(403, "Forbidden: unknown credential: ask an admin for yours (dlcluster user add)")
        if user.revoked:
            raise Refused(403, f"Forbidden: {user.name}'s credential was revoked on {when(user.revoked)}: "
                               f"ask an admin for a new one (dlcluster user add {user.name} "
                               f"--team {user.team})", user.name)
        if user.expires and user.expires < time.time():
            raise Refused(403, f"Forbidden: {user.name}'s credential expired on {when(user.expires)}: ask an "
                               f"admin for a new one (dlcluster user revoke {user.name}, then user add)",
                          user.name)
        return Caller(user.name, user.team, user.admin)

    # ---- every request
    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind, job_id = policy.classify(request.method, request.path)
        who = "unknown"
        try:
            if kind is Kind.OPEN:
                return await self.forward(request, auth=False)
            if kind is Kind.SIGN_IN:
                return self.sign_in(request)
            caller = self.caller(request, credential(request))
            who = caller.name
            handler: Callable[[web.Request, Caller, str | None], Awaitable[web.StreamResponse]] = {
                Kind.READ: self.read, Kind.SUBMIT: self.submit, Kind.OWNED: self.owned, Kind.JOBS: self.jobs,
                Kind.JOB_READ: self.job_read, Kind.GATEWAY: self.own, Kind.ADMIN: self.admin_only}[kind]
            return await handler(request, caller, job_id)
        except Refused as r:
            self.store.audit(r.who or who, r.action or f"{request.method} {request.path}", job_id or "",
                             r.line, source(request), "refused")
            return web.Response(status=r.status, text=r.line + "\n")

    def sign_in(self, request: web.Request) -> web.Response:
        """The dashboard's sign-in dialog (POST /api/authenticate, the credential in the header):
        answered here, as Ray answers it, the cookie holding the person's own credential."""
        given = credential(request, header_only=True)
        caller = self.caller(request, given)
        self.store.audit(caller.name, "sign-in", "dashboard", "", source(request))
        response = web.json_response({"status": "authenticated", "message": "Token is valid"})
        response.set_cookie(COOKIE, given or "", max_age=30 * 86400, path="/", httponly=True,
                            samesite="Strict", secure=request.secure)
        return response

    async def read(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        return await self.forward(request)

    async def admin_only(self, request: web.Request, caller: Caller,
                         job_id: str | None) -> web.StreamResponse:
        if not caller.admin:
            raise Refused(403, f"{request.method} {request.path}: refused for {caller.name}: only admins may "
                               f"(beyond the job API and the dashboard's views)")
        self.store.audit(caller.name, f"{request.method} {request.path}", "", request.query_string,
                         source(request))
        return await self.forward(request)

    async def submit(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        try:
            body = await request.json()
            assert isinstance(body, dict) and isinstance(body.get("entrypoint"), str)
        except (ValueError, AssertionError):
            raise Refused(400, "a job submission is a JSON object with an entrypoint") from None
        sent = owned_submission(body, caller)
        sid = sent["submission_id"]
        self.store.add_job(sid, caller.name, caller.team, sent["entrypoint"])
        assert self.session
        async with self.session.post(self.upstream + "/api/jobs/", json=sent, headers=self.ray_auth) as r:
            text = await r.text()
            status = r.status
        if status == 200:
            self.store.audit(caller.name, "submit", sid, sent["entrypoint"], source(request))
        else:
            self.store.forget_job(sid)
            self.store.audit(caller.name, "submit", sid, sent["entrypoint"], source(request),
                             f"Ray answered {status}")
        return web.Response(status=status, text=text, content_type="application/json")

    def owner_of(self, job_id: str, details: dict[str, Any] | None) -> tuple[str, str]:
        kept = self.store.job(job_id)
        if kept:
            return kept["owner"], kept["team"]
        meta = (details or {}).get("metadata") or {}
        return meta.get(OWNER, "nobody known"), meta.get(TEAM, "none")

    async def owned(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        assert job_id
        action = "stop" if request.method == "POST" else "delete"
        details = None
        if not self.store.job(job_id):  # a job Ray knows under another id, or from before the gateway
            details = await self.ray_job(job_id)
        owner, team = self.owner_of(job_id, details)
        if not policy.may_change(caller, owner):
            raise Refused(403, policy.not_yours(caller, action, job_id, owner, team), action=action)
        response = await self.forward(request)
        self.store.audit(caller.name, action, job_id, f"owner {owner}", source(request),
                         "done" if response.status == 200 else f"Ray answered {response.status}")
        if action == "delete" and response.status == 200:
            self.store.forget_job(job_id)
        return response

    async def ray_job(self, job_id: str) -> dict[str, Any] | None:
        assert self.session
        async with self.session.get(f"{self.upstream}/api/jobs/{job_id}", headers=self.ray_auth) as r:
            return await r.json() if r.status == 200 else None

    async def jobs(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        """Ray's job list, and the gateway's record of each job Ray no longer knows (a head restart,
        an upgrade, cluster-down then up)."""
        assert self.session
        async with self.session.get(self.upstream + "/api/jobs/", headers=self.ray_auth) as r:
            if r.status != 200:
                return web.Response(status=r.status, text=await r.text())
            listed = await r.json()
        known = {d.get("submission_id") for d in listed}
        for job in self.store.jobs():
            if job["id"] not in known and job["details"]:
                listed.append(job["details"])
        return web.json_response(listed)

    async def job_read(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        """A job's record or log: Ray's while it knows the job, the gateway's after."""
        assert job_id
        kept = self.store.job(job_id)
        if kept is None or kept["details"] is None:
            return await self.forward(request)
        if not request.path.endswith("/logs/tail"):  # Ray's answer, unless it no longer knows the job
            return await self.forward(request, unknown=lambda: self.kept(request, kept))
        if await self.ray_job(job_id) is not None:  # (a websocket: asked first)
            return await self.forward(request)
        return await self.kept(request, kept)

    async def kept(self, request: web.Request, kept: dict[str, Any]) -> web.StreamResponse:
        """A job's record or log as the gateway kept them, in Ray's form."""
        log = self.store.log_path(kept["id"])
        text = log.read_text(errors="replace") if log.exists() else ""
        if request.path.endswith("/logs/tail"):
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            if text:
                await ws.send_str(text)
            await ws.close()
            return ws
        if request.path.endswith("/logs"):
            return web.json_response({"logs": text})
        return web.json_response(kept["details"])

    # ---- the gateway's own API
    async def own(self, request: web.Request, caller: Caller, job_id: str | None) -> web.StreamResponse:
        path = request.path.removeprefix("/gateway/")
        if request.method == "GET" and path == "whoami":
            return web.json_response({"name": caller.name, "team": caller.team, "admin": caller.admin})
        if request.method == "GET" and path == "jobs":
            return web.json_response([{k: v for k, v in j.items() if k != "details"}
                                      for j in self.store.jobs()])
        if request.method == "GET" and path.startswith("jobs/") and path.endswith("/log"):
            job = path.removeprefix("jobs/").removesuffix("/log")
            if self.store.job(job) is None:
                raise Refused(404, f"no job {job} in the gateway's records (dlcluster jobs lists them)")
            log = self.store.log_path(job)
            return web.Response(text=log.read_text(errors="replace") if log.exists() else "")
        if not caller.admin:
            raise Refused(403, f"{request.method} {request.path}: refused for {caller.name}: for admins only")
        if request.method == "GET" and path == "users":
            return web.json_response([u.public() for u in self.store.users()])
        if request.method == "POST" and path == "users":
            return self.add_user(await request.json(), caller, source(request))
        if request.method == "DELETE" and path.startswith("users/"):
            name = path.removeprefix("users/")
            try:
                user = self.store.revoke(name)
            except KeyError:
                raise Refused(404, f"no live credential for {name} (dlcluster user list)") from None
            self.store.audit(caller.name, "user revoke", name, f"team {user.team}", source(request))
            return web.json_response({"revoked": name})
        if request.method == "GET" and path == "audit":
            trail = self.store.trail()
            return web.json_response({"entries": trail, "broken": verify(trail)})
        raise Refused(404, f"{request.method} {request.path}: no such gateway call")

    def add_user(self, body: dict[str, Any], caller: Caller, where: str) -> web.Response:
        name, team = str(body.get("name", "")), str(body.get("team", ""))
        for what, value in (("name", name), ("team", team)):
            if not value or not all(c.isalnum() or c in "-_." for c in value) or len(value) > 64:
                raise Refused(400, f"{what} {value!r}: letters, digits, '-', '_' and '.', at most 64")
        if name == policy.OPERATOR.name:
            raise Refused(400, f"{name}: the name of the cluster token's holder; pick another")
        try:
            lifetime = policy.lifetime(str(body.get("expires", "90d")))
        except ValueError as e:
            raise Refused(400, str(e)) from None
        expires = time.time() + lifetime if lifetime is not None else None
        try:
            made = self.store.add_user(name, team, bool(body.get("admin")), expires)
        except ValueError as e:
            raise Refused(409, str(e)) from None
        self.store.audit(caller.name, "user add", name,
                         f"team {team}{', admin' if body.get('admin') else ''}, "
                         f"expires {when(expires) if expires else 'never'}", where)
        return web.json_response({"name": name, "team": team, "credential": made, "expires": expires})

    # ---- forwarding
    async def forward(self, request: web.Request, auth: bool = True,
                      unknown: Callable[[], Awaitable[web.StreamResponse]] | None = None,
                      ) -> web.StreamResponse:
        """The request as Ray's, with the cluster's token; Ray's answer streamed back (`unknown`'s
        instead where Ray answers 404 and one is given)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP | CREDENTIALS}
        if auth:
            headers.update(self.ray_auth)
        url = self.upstream + request.rel_url.path_qs
        assert self.session
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self.forward_websocket(request, url, headers)
        body = request.content if request.body_exists else None
        async with self.session.request(request.method, url, headers=headers, data=body,
                                        allow_redirects=False) as upstream:
            if upstream.status == 404 and unknown is not None:
                return await unknown()
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP and k.lower() != "set-cookie":
                    response.headers.add(k, v)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(64 * 1024):
                await response.write(chunk)
            await response.write_eof()
            return response

    async def forward_websocket(self, request: web.Request, url: str,
                                headers: dict[str, str]) -> web.StreamResponse:
        """`ray job logs -f`: Ray's websocket, relayed both ways until either end closes."""
        assert self.session
        for k in [k for k in headers if k.lower().startswith("sec-websocket")]:
            del headers[k]
        client = web.WebSocketResponse()
        await client.prepare(request)
        async with self.session.ws_connect(url, headers=headers) as ray:
            async def down() -> None:
                async for msg in ray:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await client.send_str(msg.data)
                    elif msg.type == aiohttp.WSMsgType.BINARY:
                        await client.send_bytes(msg.data)
                await client.close()

            async def up() -> None:
                async for msg in client:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        await ray.send_str(msg.data)
                await ray.close()

            _, pending = await asyncio.wait([asyncio.ensure_future(down()), asyncio.ensure_future(up())],
                                            return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await client.close()
        return client


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))

