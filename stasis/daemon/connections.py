"""Connections to the daemon's socket: how many one user may hold, and how long a request may
take to arrive.

Each accepted connection is counted against its peer's uid (SO_PEERCRED, as the API's `peer`).
A user (not root) beyond `max_connections_per_uid`, or users together beyond half of the
daemon's open-file limit, get a one-line 503 and the connection closed at once: unfinished
requests of one user cannot take the files that root's requests, the job table, the job
supervisors and CRIU need. Root is never refused. Every client, root too, has
`request_timeout_s` from connecting to send its headers, and as long again to send its body;
a connection that has not is closed (a stalled client holds no file for long). The work a
request asks for (a dump streaming for minutes) is not bounded by this.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

log = logging.getLogger("stasis.daemon")

# The 503 a refused connection gets: the client reads it as any other error of the daemon.
_BUSY_HEAD = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\n\r\n"
)


def _peer_uid(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return -1  # nobody we can tell: counted like any user, never as root
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[1])


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (service managers start daemons at 1024);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


class ConnectionGuard:
    """Counts the open connections per uid and arms the request timeouts; `wrap` its protocol
    factory around the HTTP server's, and put `middleware` on the app."""

    def __init__(self, per_uid: int, timeout_s: float, open_files: int) -> None:
        self.per_uid = per_uid
        self.timeout_s = timeout_s
        # The other half stays for root's requests and the daemon's own work.
        self.users_total = max(open_files // 2, 1)
        self._open: dict[int, int] = {}
        self._users = 0
        self._waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}

    def wrap(self, factory: Callable[[], Any]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(factory(), self)

    def _admit(self, uid: int) -> str | None:
        """Count a new connection of `uid`, or say why it is refused."""
        if uid != 0:
            held = self._open.get(uid, 0)
            if self.per_uid and held >= self.per_uid:
                return (
                    f"too many connections to the stasis daemon from uid {uid} "
                    f"({held} open, max_connections_per_uid); retry when some ended"
                )
            if self._users >= self.users_total:
                return "the stasis daemon is at its limit of connections from users; " "retry later"
            self._users += 1
        self._open[uid] = self._open.get(uid, 0) + 1
        return None

    def _release(self, uid: int) -> None:
        left = self._open.get(uid, 0) - 1
        if left > 0:
            self._open[uid] = left
        else:
            self._open.pop(uid, None)
        if uid != 0:
            self._users -= 1

    def _arm(self, transport: asyncio.BaseTransport) -> None:
        if self.timeout_s:
            self._waiting[transport] = asyncio.get_running_loop().call_later(
                self.timeout_s, _cut_off, transport, "headers"
            )

    def _disarm(self, transport: asyncio.BaseTransport | None) -> None:
        timer = self._waiting.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()

    @property
    def middleware(self) -> Any:
        @web.middleware
        async def receive_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
            # The headers are in (the handler was called); now the body, in as long again.
            self._disarm(request.transport)
            if request.can_read_body and self.timeout_s:
                try:
                    await asyncio.wait_for(request.read(), self.timeout_s)
                except ConnectionError:
                    return web.Response(status=400)  # the client left; nobody reads this
                except asyncio.TimeoutError:
                    if request.transport is not None:
                        _cut_off(request.transport, "body")
                    raise web.HTTPRequestTimeout(
                        text="the request's body did not arrive in " "time (request_timeout_s)"
                    ) from None
            return await handler(request)

        return receive_in_time


def _cut_off(transport: asyncio.BaseTransport, what: str) -> None:
    if not transport.is_closing():
        log.info("closed a connection whose request %s did not arrive in time", what)
        transport.close()


class _Guarded(asyncio.Protocol):
    """The HTTP server's protocol for one connection, admitted (or refused) by the guard."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.uid: int | None = None  # counted: admitted, not yet released
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        try:
            uid = _peer_uid(transport)
        except OSError:
            uid = -1
        refusal = self.guard._admit(uid)
        if refusal is not None:
            body = json.dumps({"error": {"type": "StasisError", "message": refusal}})
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_BUSY_HEAD + body.encode() + b"\n")
            transport.close()
            return
        self.uid = uid
        self.transport = transport
        self.guard._arm(transport)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.uid is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.uid is not None else None

    def pause_writing(self) -> None:
        if self.uid is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.uid is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.uid is None:
            return
        self.guard._release(self.uid)
        self.uid = None
        self.guard._disarm(self.transport)
        self.inner.connection_lost(exc)


class GuardedUnixSite(web.UnixSite):
    """aiohttp's UnixSite, with every connection going through a ConnectionGuard."""

    def __init__(
        self, runner: web.BaseRunner, path: str, guard: ConnectionGuard, backlog: int = 128
    ) -> None:
        super().__init__(runner, path, backlog=backlog)
        self._guard = guard

    async def start(self) -> None:
        self._runner._reg_site(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            self._guard.wrap(server), self._path, backlog=self._backlog
        )
