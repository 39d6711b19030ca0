"""The image streamer's side of CRIU's protocol, and the pipe writer that hands CRIU pages with
vmsplice. The client here speaks CRIU's side (criu/img-streamer.c) byte for byte; real CRIU
reads from this server in tests/daemon/test_streamed_restore.py."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stasis.engine.streamer import SOCKET_NAME, ImageServer, PipeWriter

MiB = 1 << 20


def _drain_slowly(fd: int, into: bytearray, pause_s: float) -> None:
    while True:
        part = os.read(fd, 256 << 10)
        if not part:
            return
        into += part
        time.sleep(pause_s)


def test_spliced_bytes_arrive_intact_though_the_writer_dropped_them_at_once() -> None:
    # Each chunk is made, written and forgotten right away, while the reader lags: memory the
    # pipe still refers to must not be reused for the next chunks (the reader would get those).
    r, w = os.pipe()
    fcntl.fcntl(w, 1031, MiB)
    got = bytearray()
    reader = threading.Thread(target=_drain_slowly, args=(r, got, 0.002))
    reader.start()
    writer = PipeWriter(w)
    expected = bytearray()
    for i in range(48):
        chunk = os.urandom(MiB // 2 + i * 4097)  # odd sizes: pages shared between chunks
        expected += chunk
        writer.write(chunk)
        del chunk
    writer.drain()
    # drain returned only once the reader had it all.
    pending = array.array("i", [0])
    fcntl.ioctl(w, termios.FIONREAD, pending)
    assert pending[0] == 0
    os.close(w)
    reader.join()
    os.close(r)
    assert bytes(got) == bytes(expected)
    assert writer.written == len(expected)


def test_bytearrays_and_views_are_copied_in() -> None:
    r, w = os.pipe()
    writer = PipeWriter(w)
    data = bytearray(os.urandom(10000))
    expected = bytes(data[100:200]) + bytes(data[:5])
    writer.write(memoryview(data)[100:200])
    writer.write(data[:5])
    data[:] = bytes(len(data))  # what the pipe was given must not change with the caller's
    got = b""
    while len(got) < 105:  # read before drain(): it waits for the reader (up to 60 s)
        got += os.read(r, 1000)
    writer.drain()
    os.close(w)
    assert got == expected
    os.close(r)


class _CRIUSide:
    """What CRIU does against the streamer: a request per image, a pipe per file that exists."""

    def __init__(self, directory: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(directory / SOCKET_NAME))

    def open(self, name: str) -> int | None:
        raw = name.encode()
        body = b"\x0a" + bytes([len(raw)]) + raw
        self.sock.sendall(struct.pack("<I", len(body)) + body)
        size = struct.unpack("<I", self.sock.recv(4))[0]
        reply = self.sock.recv(size)
        assert reply[0] == 0x08
        if reply[1] == 0:
            return None
        r, w = os.pipe()
        socket.send_fds(self.sock, [b"\0"], [w])
        os.close(w)
        return r

    def read(self, name: str) -> bytes | None:
        fd = self.open(name)
        if fd is None:
            return None
        out = bytearray()
        while part := os.read(fd, 1 << 16):
            out += part
        os.close(fd)
        return bytes(out)


def _server(tmp_path: Path, files: dict[str, bytes | Exception]) -> ImageServer:
    def source(name: str) -> Callable[[PipeWriter], None] | None:
        if name not in files:
            return None
        content = files[name]

        def send(out: PipeWriter) -> None:
            if isinstance(content, Exception):
                out.write(b"half")
                raise content
            out.write(content)

        return send

    tmp_path.chmod(0o700)
    return ImageServer(tmp_path, source)


def test_files_are_served_and_missing_ones_said_missing(tmp_path: Path) -> None:
    pages = os.urandom(3 * MiB + 5)
    server = _server(tmp_path, {"inventory.img": b"inv", "pages-1.img": pages})
    criu = _CRIUSide(tmp_path)
    assert criu.read("inventory.img") == b"inv"
    assert criu.read("seccomp.img") is None
    assert criu.read("pages-1.img") == pages
    assert server.wait({"pages-1.img"}) is None
    assert server.failure is None
    criu.sock.close()


def test_a_file_that_fails_is_cut_short_and_said(tmp_path: Path) -> None:
    server = _server(tmp_path, {"pages-1.img": ValueError("chunk 3 fails its checksum")})
    criu = _CRIUSide(tmp_path)
    assert criu.read("pages-1.img") == b"half"  # CRIU sees the pipe end early: it fails
    assert server.wait({"pages-1.img"}) == "chunk 3 fails its checksum"
    criu.sock.close()


def test_criu_gone_before_reading_a_file_ends_the_wait(tmp_path: Path) -> None:
    server = _server(tmp_path, {"pages-1.img": b"x" * 10})
    criu = _CRIUSide(tmp_path)
    criu.sock.close()
    assert server.wait({"pages-1.img"}) == "the restore ended before it read pages-1.img"
