"""A full restore of compressed or encrypted images through CRIU's image streamer protocol.

CRIU restoring with `--stream` opens no image file: it asks a streamer listening on
`<images>/streamer-serve.sock` for each by name and reads it front to back from a pipe it hands
over (criu/img-streamer.c). So the page images go from the store into the tree's memory decoded
on the way, chunk by chunk, each chunk verified before a byte of it is written, with no plain
copy on any disk and no page-fault round trips (the lazy-pages path costs about twice CRIU's own
restore time per GiB here, this one little more than CRIU's).

The protocol, per image: CRIU sends a length-prefixed `img_streamer_request_entry {filename}`,
we answer `img_streamer_reply_entry {exists}`, and for an image that exists CRIU passes the
write end of a fresh pipe (SCM_RIGHTS) that we fill and close.

Every image but the page files is fetched and verified before CRIU starts (`prepare`): CRIU
reads a protobuf image until its end, so a cut stream would read as a shorter, valid image.
Page files are read by exact length: a stream cut by a chunk that fails its check makes CRIU
fail ("EOF unexpectedly"), and the restore with it; `failure` says why.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
from pathlib import Path

from stasis.errors import StasisError
from stasis.store import Manifest, Store

log = logging.getLogger("stasis.daemon")

SOCKET_NAME = "streamer-serve.sock"
_PAGES = re.compile(r"^pages-[0-9]+\.img$")
_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
_BLOCK = 8 << 20  # plain bytes decoded per store read
_MAX_REQUEST = 4096


def streamable(manifest: Manifest) -> bool:
    """Whether its page files can be read by range (chunked: checkpoints of format 2)."""
    return all(f.chunks is not None for f in manifest.files if _PAGES.match(f.name))


class ImageStream:
    """The images of one restore, served to its CRIU from the store."""

    def __init__(self, store: Store, manifest: Manifest, scratch: Path) -> None:
        self.store = store
        self.manifest = manifest
        scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Root's alone (mkdtemp: 0700): only root's CRIU can reach the socket in it.
        self.images = Path(tempfile.mkdtemp(prefix=f"{manifest.id}-stream-", dir=scratch))
        self._pages = {f.name: f.size_bytes for f in manifest.files if _PAGES.match(f.name)}
        self._listener: socket.socket | None = None
        self._feeders: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.failure: str | None = None
        self.done = threading.Event()

    def prepare(self) -> None:
        """Fetch (verified) every image but the page files, and listen. StasisError if the
        checkpoint cannot be had."""
        self.store.fetch_files(self.manifest, self.images,
                               only=lambda f: f.name not in self._pages)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        dir_fd = os.open(self.images, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Through /proc: sun_path holds 107 bytes, a state directory's path may be longer.
            listener.bind(f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}")
        finally:
            os.close(dir_fd)
        listener.listen(1)
        self._listener = listener
        threading.Thread(target=self._serve, name="stasis-img-stream", daemon=True).start()

    def close(self) -> None:
        """The restore ended (either way): stop serving, wait for the feeders, remove the
        scratch images."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self.done.wait(30.0)
        for feeder in list(self._feeders):
            feeder.join(30.0)
        shutil.rmtree(self.images, ignore_errors=True)

    # -- serving -------------------------------------------------------------------------------

    def _serve(self) -> None:
        assert self._listener is not None
        try:
            self._listener.settimeout(60.0)  # CRIU connects as it starts
            conn, _ = self._listener.accept()
        except OSError:
            self.done.set()
            return
        try:
            conn.settimeout(None)
            while self._answer(conn):
                pass
        except (OSError, ValueError) as e:
            self._fail(f"the image stream to CRIU broke: {e}")
        finally:
            conn.close()
            self.done.set()

    def _answer(self, conn: socket.socket) -> bool:
        """One request: False once CRIU hung up (it does when it has read all it needs)."""
        head = _recv_exact(conn, 4)
        if head is None:
            return False
        (size,) = struct.unpack("<I", head)
        if size > _MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes")
        body = _recv_exact(conn, size)
        if body is None:
            return False
        name = _filename(body)
        path = self.images / name
        exists = "/" not in name and (name in self._pages or path.is_file())
        reply = b"\x08" + (b"\x01" if exists else b"\x00")
        conn.sendall(struct.pack("<I", len(reply)) + reply)
        if not exists:
            return True
        _, fds, _, _ = socket.recv_fds(conn, 1, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError(f"no pipe came for {name}")
        feeder = threading.Thread(target=self._feed, args=(fds[0], name), daemon=True,
                                  name=f"stasis-img-{name}")
        self._feeders.append(feeder)
        feeder.start()
        return True

    def _feed(self, fd: int, name: str) -> None:
        try:
            try:
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
            except OSError:
                pass  # a smaller pipe: slower, not wrong
            if name in self._pages:
                size = self._pages[name]
                for offset in range(0, size, _BLOCK):
                    for view in self.store.read_range_views(self.manifest, name, offset,
                                                            min(_BLOCK, size - offset)):
                        _write_all(fd, view)
            else:
                with open(self.images / name, "rb", buffering=0) as f:
                    while block := f.read(_PIPE_BYTES):
                        _write_all(fd, memoryview(block))
        except BrokenPipeError:
            pass  # CRIU read what it needed
        except StasisError as e:
            self._fail(f"{name}: {e}")
        except OSError as e:
            self._fail(f"{name}: {e}")
        finally:
            os.close(fd)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = reason
                log.error("restore of checkpoint %s: %s", self.manifest.id, reason)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            return None
        data += part
    return data


def _filename(body: bytes) -> str:
    """The `filename` (field 1, a string) of an img_streamer_request_entry."""
    if not body or body[0] != 0x0A:
        raise ValueError("a request without a file name")
    length, shift, i = 0, 0, 1
    while True:
        if i >= len(body) or shift > 28:
            raise ValueError("a malformed request")
        byte = body[i]
        length |= (byte & 0x7F) << shift
        i += 1
        shift += 7
        if not byte & 0x80:
            break
    if i + length > len(body):
        raise ValueError("a truncated request")
    name = body[i:i + length].decode("utf-8", "strict")
    if not name or name in (".", "..") or "\0" in name:
        raise ValueError(f"a request for {name!r}")
    return name


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]
