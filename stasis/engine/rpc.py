"""One `criu swrk` session: CRIU's protobuf RPC over a SOCK_SEQPACKET socket pair.

This is what runc, podman and libcriu do. We spawn `criu swrk <fd>`, send one request, and answer
every NOTIFY message CRIU sends back (pre-dump, post-dump, post-restore, network-lock, ...) until the
final response arrives. NOTIFY handlers are the hook points for GPU and network steps; a handler
that returns False (or raises) makes CRIU abort the operation.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from stasis.errors import CRIUError, CRIUNotFoundError

NotifyHandler = Callable[[str, int], bool]

# A single response carries at most a few KiB; CRIU uses SEQPACKET so one recv is one message.
_MAX_MESSAGE = 1 << 20


def _pb() -> Any:
    """The rpc_pb2 module generated at install time from the installed CRIU's rpc.proto."""
    try:
        from stasis.engine._proto import rpc_pb2
    except ImportError as e:
        raise CRIUNotFoundError(
            "CRIU's RPC classes are not generated; run `make install` (it runs protoc on "
            "/usr/local/share/criu/rpc.proto)"
        ) from e
    return rpc_pb2


def messages() -> Any:
    """The generated protobuf module (criu_req, criu_opts, ...)."""
    return _pb()


class Session:
    """Runs requests against a fresh `criu swrk` process each, answering NOTIFY messages."""

    def __init__(
        self,
        criu_path: str,
        notify: NotifyHandler | None = None,
        started: Callable[[int], None] | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.criu_path = criu_path
        self.notify = notify
        # An argv prefix that execs CRIU elsewhere (nsenter into a tree's mount namespace).
        self.wrapper = list(wrapper)
        # Told the pid of each CRIU process as soon as it runs (before the request is sent).
        self.started = started
        self.criu_pid: int | None = None

    def call(
        self, request: Any, pass_fds: Sequence[int] = (), env: Mapping[str, str] | None = None
    ) -> Any:
        """Send `request` (a criu_req) and return the final criu_resp.

        `pass_fds` are inherited by the swrk process (inherit_fd needs them there); `env` is added
        to its environment. A response with success=false is returned, not raised: the caller
        knows which log explains it.
        """
        pb = _pb()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                proc = subprocess.Popen(
                    [*self.wrapper, self.criu_path, "swrk", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(), *pass_fds),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    close_fds=True,
                    env={**os.environ, **env} if env else None,
                )
            except FileNotFoundError as e:
                raise CRIUNotFoundError(
                    f"criu not found at {self.criu_path}; install it with `make install` "
                    "or set STASIS_CRIU"
                ) from e
            self.criu_pid = proc.pid
            theirs.close()
            if self.started is not None:
                self.started(proc.pid)
            try:
                return self._exchange(pb, ours, request, _exit_fd(proc.pid))
            finally:
                ours.close()
                proc.wait()
        finally:
            ours.close()
            theirs.close()

    def _exchange(self, pb: Any, sock: socket.socket, request: Any, exit_fd: int | None) -> Any:
        try:
            sock.send(request.SerializeToString())
            return self._answer_until_done(pb, sock, exit_fd)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)

    def _answer_until_done(self, pb: Any, sock: socket.socket, exit_fd: int | None) -> Any:
        while True:
            data = _receive(sock, exit_fd)
            if not data:
                raise CRIUError("criu swrk exited without answering (it may have crashed)")
            resp = pb.criu_resp()
            resp.ParseFromString(data)
            if resp.type != pb.NOTIFY:
                return resp
            ok = True
            if self.notify is not None:
                try:
                    ok = bool(self.notify(resp.notify.script, resp.notify.pid))
                except Exception:
                    ok = False
            reply = pb.criu_req(type=pb.NOTIFY, notify_success=ok)
            sock.send(reply.SerializeToString())


def _exit_fd(pid: int) -> int | None:
    """A pidfd of our (not yet reaped, so not reused) child `pid`: readable once it exits."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an old kernel: a killed CRIU is then noticed only when the socket closes


def _receive(sock: socket.socket, exit_fd: int | None) -> bytes:
    """The next message from CRIU; b"" once it exited without sending one.

    The end of the socket does not tell: the tasks a restore forks inherit CRIU's end of it, so
    after a kill -9 of CRIU half-way through a restore they keep it open (and wait forever for
    CRIU). The exit of the swrk process itself does."""
    if exit_fd is None:
        return sock.recv(_MAX_MESSAGE)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(exit_fd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if sock.fileno() in ready:
            return sock.recv(_MAX_MESSAGE)
        if exit_fd in ready:
            # What it sent before exiting is queued already: take that, else it said nothing.
            try:
                return sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return b""


def open_dir(path: str | os.PathLike[str]) -> int:
    """An O_DIRECTORY fd for images_dir_fd / work_dir_fd (CRIU opens it via /proc/<us>/fd/N)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
