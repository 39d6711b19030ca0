"""A TCP proxy on loopback that carries uploads at a set rate (all its connections together):
a slow link to the store, so that a node's dump takes as long as a test needs, by bytes, not by
luck of timing."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType


class SlowLink:
    def __init__(self, target: tuple[str, int], upload_bytes_per_s: int) -> None:
        self.target = target
        self.rate = upload_bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._closing = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has carried what it was given so far
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _wait_for_room(self, n: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                if slow:
                    self._wait_for_room(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closing = True
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
