"""CRIU's image-streamer protocol, serve side: a restore that reads its images from us, file by
file through pipes, instead of from a directory. What lets a compressed or encrypted checkpoint
be decoded while CRIU reads it, with no plain copy written first.

What CRIU 4.2 speaks (criu/img-streamer.c, images/img-streamer.proto), asked for over RPC with
`stream` in the request's config file: it connects to `streamer-serve.sock` in the images
directory and, for each image it opens, sends a u32 (little-endian) length and a protobuf
img_streamer_request_entry {filename = 1}; we answer img_streamer_reply_entry {exists = 1} the
same way, and when it exists CRIU sends (SCM_RIGHTS) the write end of a pipe it reads the file
from, in order, with read() (page images too: `--stream` reads pages sequentially). There is
no error message: a file we cannot serve is a pipe closed early, on which CRIU fails. CRIU asks
for every file before its post-restore notification and closes the connection at its end.

The caller decides what each name holds (`Source`), and learns whether every file CRIU read was
served whole (`wait`); a restore resumes its tree only then (the daemon's gate).
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import os
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from stasis.engine import protobuf
from stasis.errors import ReaderGone
from stasis.fdio import Iovec, recv_exactly

SOCKET_NAME = "streamer-serve.sock"
# What `stream` in CRIU's RPC config file turns on (criu/config.c).
CONFIG = "stream\n"
_F_SETPIPE_SZ = 1031  # <linux/fcntl.h>; fcntl does not name them on every Python
_F_GETPIPE_SZ = 1032
# CRIU's pipe holds 64 KiB; 1 MiB (pipe-max-size) means 16x fewer wake-ups for its reads.
_PIPE_BYTES = 1 << 20
_MAX_NAME = 4096


class PipeWriter:
    """A Writer (compression.Writer) onto the pipe CRIU reads one image file from.

    bytes objects are not copied into the pipe: vmsplice(2) hands it their pages, which CRIU's
    read() then copies once into the restored memory (measured: 0.13 s/GiB against 0.34 s/GiB
    for write(2), on the core that also decodes). The pipe then refers to those pages until
    CRIU has read them, so each object is kept alive until at least two pipes' worth of bytes
    were handed over after it (the pipe cannot hold more than its size), and `drain` keeps the
    last ones until CRIU read them all or closed its end: memory Python reused meanwhile would
    be read into the job as if it were its own.

    A thread of its own hands them over (vmsplice waits for CRIU without the GIL), so the
    caller decodes up to `ahead` chunks further meanwhile instead of waiting on each: CRIU
    never waits for a chunk that was slow to decode while the pipe held the one before."""

    def __init__(self, fd: int, ahead: int = 4) -> None:
        self.fd = fd
        self.written = 0
        try:
            self._pipe_bytes = fcntl.fcntl(fd, _F_GETPIPE_SZ)
        except OSError:
            self._pipe_bytes = _PIPE_BYTES
        # What the pipe may still refer to: (object, self.written once it was all handed over).
        self._held: deque[tuple[bytes, int]] = deque()
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=ahead)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stasis-streamer-pipe", daemon=True)
        self._thread.start()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._error is not None:
            raise self._error
        if (
            isinstance(data, memoryview)
            and isinstance(data.obj, bytes)
            and data.contiguous
            and len(data) == len(data.obj)
        ):
            data = data.obj
        # Handed over later: only what nobody can change meanwhile (the caller may reuse a
        # bytearray for the next chunk).
        self._queue.put(data if isinstance(data, bytes) else bytes(data))
        return len(data)

    def flush(self) -> None:
        """Wait until everything written was handed to the pipe; raise what stopped that
        (ReaderGone: CRIU closed its end)."""
        self._stop()
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            if self._error is not None:
                continue  # the caller hears of it at its next write
            try:
                if _vmsplice is not None:
                    self._splice(data)
                else:
                    self._copy(memoryview(data))
            except BaseException as e:
                self._error = e

    def _copy(self, view: memoryview) -> None:
        while view:
            try:
                n = os.write(self.fd, view)
            except BrokenPipeError:
                raise ReaderGone() from None
            view = view[n:]
            self.written += n

    def _splice(self, data: bytes) -> None:
        assert _vmsplice is not None
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
        assert base is not None
        done = 0
        while done < len(data):
            iov = Iovec(base + done, len(data) - done)
            n = _vmsplice(self.fd, ctypes.byref(iov), 1, 0)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err == errno.EPIPE:
                    raise ReaderGone()
                raise OSError(err, f"vmsplice: {os.strerror(err)}")
            done += n
            self.written += n
        self._held.append((data, self.written))
        held = self._held
        while held and self.written - held[0][1] >= 2 * self._pipe_bytes:
            held.popleft()

    def drain(self, timeout_s: float = 60.0) -> None:
        """Stop handing over, and keep what the pipe still refers to until CRIU read it all,
        closed its end, or `timeout_s` passed (then the restore is failing anyway). Raises
        nothing: for a `finally`."""
        self._stop()
        if not self._held:
            return
        deadline = time.monotonic() + timeout_s
        pending = array.array("i", [0])
        while time.monotonic() < deadline:
            try:
                fcntl.ioctl(self.fd, termios.FIONREAD, pending)
            except OSError:
                break
            if pending[0] == 0:
                break
            ready = select.poll()
            ready.register(self.fd, select.POLLERR)
            if ready.poll(0):  # no reader left: nobody will read what is in there
                break
            time.sleep(0.001)
        self._held.clear()


def _libc_vmsplice() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(Iovec), ctypes.c_size_t, ctypes.c_uint]
    return fn


# ctypes releases the GIL for the call: decoding the next chunk goes on meanwhile.
_vmsplice = _libc_vmsplice()


# What to send for a file name: None when there is no such file, else a function that writes it
# whole into the writer (raising on anything it cannot serve: the pipe then closes early).
Source = Callable[[str], Callable[[PipeWriter], None] | None]


class ImageServer:
    """Serves one restore's images to CRIU from `source`, on `directory`/streamer-serve.sock
    (a directory only root may enter: whoever connects is the restore's CRIU)."""

    def __init__(self, directory: Path, source: Source, accept_timeout_s: float = 60.0) -> None:
        self._source = source
        self._accept_timeout_s = accept_timeout_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._running = 0
        self._served: set[str] = set()
        self._closed = False  # CRIU's connection ended (or never came)
        self.failure: str | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Through /proc: sun_path holds 107 bytes, a state directory's path may be longer.
            self._listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}")
        finally:
            os.close(dir_fd)
        self._listener.listen(1)
        threading.Thread(target=self._serve, name="stasis-streamer", daemon=True).start()

    def close(self) -> None:
        """Stop accepting, and let `wait` return once no file is being sent (the restore is
        over, or never reached us)."""
        self._listener.close()
        self._ended()

    def wait(self, files: set[str]) -> str | None:
        """Block until each of `files` was served whole, or a file failed, or CRIU went away;
        None when all were served, else why not."""
        with self._changed:
            while True:
                if self.failure is not None:
                    return self.failure
                if files <= self._served and self._running == 0:
                    return None
                if self._closed and self._running == 0:
                    missing = sorted(files - self._served)
                    return f"the restore ended before it read {', '.join(missing)}"
                self._changed.wait()

    def _ended(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _serve(self) -> None:
        try:
            self._listener.settimeout(self._accept_timeout_s)
            conn, _ = self._listener.accept()
        except OSError:
            self._ended()
            return
        finally:
            self._listener.close()
        try:
            with conn:
                while True:
                    name = _read_request(conn)
                    if name is None:
                        return
                    send = self._source(name)
                    conn.sendall(_message(b"\x08" + (b"\x01" if send else b"\x00")))
                    if send is None:
                        continue
                    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                    if len(fds) != 1:
                        for fd in fds:
                            os.close(fd)
                        self._fail(f"CRIU sent no pipe for {name}")
                        return
                    with self._changed:
                        self._running += 1
                    threading.Thread(
                        target=self._send,
                        args=(name, send, fds[0]),
                        name="stasis-streamer-file",
                        daemon=True,
                    ).start()
        except (OSError, ValueError) as e:
            self._fail(f"the image streamer's connection with CRIU failed: {e}")
        finally:
            self._ended()

    def _send(self, name: str, send: Callable[[PipeWriter], None], fd: int) -> None:
        ok = False
        try:
            try:
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                pass  # a smaller pipe only means more wake-ups
            writer = PipeWriter(fd)
            try:
                send(writer)
                writer.flush()
            finally:
                writer.drain()
            ok = True
        except ReaderGone:
            # CRIU stopped reading: it failed (its own answer says why) or needed no more.
            ok = True
        except Exception as e:  # anything: the restore must not resume on a file cut short
            self._fail(str(e) or f"{name}: {type(e).__name__}")
        finally:
            os.close(fd)
            with self._changed:
                self._running -= 1
                if ok:
                    self._served.add(name)
                self._changed.notify_all()

    def _fail(self, why: str) -> None:
        with self._changed:
            if self.failure is None:
                self.failure = why
            self._changed.notify_all()


def _message(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _read_request(conn: socket.socket) -> str | None:
    """The file name of CRIU's next request; None when it closed the connection."""
    head = recv_exactly(conn, 4)
    if head is None:
        return None
    (size,) = struct.unpack("<I", head)
    if size > _MAX_NAME + 8:
        raise ValueError(f"a request of {size} bytes")
    body = recv_exactly(conn, size)
    if body is None or not body or body[0] != 0x0A:  # field 1, length-delimited
        raise ValueError("a request without a file name")
    length, at = protobuf.varint(body, 1)
    name = body[at : at + length]
    if len(name) != length:
        raise ValueError("a cut-off request")
    return name.decode("utf-8", "replace")
