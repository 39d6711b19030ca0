"""A TCP proxy on loopback that can cut a real server off in the middle of a transfer.

Tests put it between the store and the S3 server to make "the server went away mid-upload"
happen at a chosen byte, not by luck of timing:

    with CutProxy(("127.0.0.1", s3.port)) as proxy:
        proxy.cut_after(upload=12 << 20)     # then every connection is dropped, new ones too
        ...                                  # client at proxy.endpoint
        proxy.heal()
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class CutProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._limits: dict[str, int | None] = {"upload": None, "download": None}
        self._moved = {"upload": 0, "download": 0}
        self.cut = False
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, *, upload: int | None = None, download: int | None = None) -> None:
        """Drop everything once this many more bytes went to (upload) or came from (download)
        the server."""
        with self._lock:
            self._limits = {"upload": upload, "download": download}
            self._moved = {"upload": 0, "download": 0}

    def heal(self) -> None:
        with self._lock:
            self.cut = False
            self._limits = {"upload": None, "download": None}

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            threading.Thread(
                target=self._pump, args=(client, server, "upload"), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, "download"), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    limit = self._limits[direction]
                    if limit is not None:
                        room = limit - self._moved[direction]
                        if room <= 0 or self.cut:
                            self._cut_all()
                            return
                        data = data[:room]
                        self._moved[direction] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _cut_all(self) -> None:
        # Under self._lock.
        self.cut = True
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()
        self._conns.clear()

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        with self._lock:
            self._cut_all()

    def __enter__(self) -> CutProxy:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
