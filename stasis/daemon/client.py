"""A client of the daemon's API over its unix socket.

Built on the standard library's http.client rather than httpx: every `stasis` command (and every
Slurm hook) makes one call, and importing httpx (which pulls in rich and click for its own CLI)
cost ~100 ms of each invocation on these machines, more than the call itself.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from stasis.errors import DaemonAPIError, StasisError, error_from_wire

# Plain calls answer at once; dumps and restores of big jobs stream progress for minutes.
_CONNECT_TIMEOUT_S = 30.0


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("stasis", timeout=_CONNECT_TIMEOUT_S)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)  # a dump may stream for a long time
        self.sock = sock


class Client:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def close(self) -> None:
        pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, e: OSError) -> DaemonAPIError:
        if not self.socket_path.exists():
            why = "no socket there"
        elif isinstance(e, PermissionError):
            why = "permission denied on the socket (join its group)"
        else:
            why = "nothing answers on it"
        return DaemonAPIError(
            f"cannot reach the stasis daemon at {self.socket_path} ({why}); "
            "start it with `stasis daemon` or set STASIS_SOCKET"
        )

    def _send(self, method: str, path: str, body: Any) -> http.client.HTTPResponse:
        conn = _UnixConnection(self.socket_path)
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        try:
            conn.request(method, path, body=payload, headers=headers)
            return conn.getresponse()
        except (ConnectionError, FileNotFoundError, PermissionError, http.client.HTTPException,
                OSError) as e:
            conn.close()
            raise self._unreachable(e if isinstance(e, OSError) else OSError(str(e))) from e

    def request(self, method: str, path: str, body: Any = None,
                params: dict[str, str] | None = None) -> Any:
        if params:
            path = f"{path}?{urlencode(params)}"
        resp = self._send(method, path, body)
        data = _json(resp.read())
        if resp.status >= 400:
            raise _error(data, resp.status)
        return data

    def stream(self, path: str, body: Any,
               progress: Callable[[int, int], None] | None = None) -> Any:
        """POST and read NDJSON: progress lines go to `progress`, the last line is the answer."""
        resp = self._send("POST", path, body)
        if resp.status >= 400:
            raise _error(_json(resp.read()), resp.status)
        while line := resp.readline():
            if not line.strip():
                continue
            item = json.loads(line)
            if "progress" in item:
                if progress:
                    progress(item["progress"]["bytes"], item["progress"]["total"])
            elif "error" in item:
                raise _error(item, 0)
            else:
                return item["result"]
        raise DaemonAPIError("the daemon closed the connection before answering")

    # -- the API, one method per route ----------------------------------------------------------

    def run(self, **request: Any) -> Any:
        return self.request("POST", "/jobs", request)

    def jobs(self) -> Any:
        return self.request("GET", "/jobs")

    def job(self, job_id: str) -> Any:
        return self.request("GET", f"/jobs/{_seg(job_id)}")

    def kill(self, job_id: str) -> Any:
        return self.request("POST", f"/jobs/{_seg(job_id)}/kill")

    def dump(self, job_id: str, progress: Callable[[int, int], None] | None = None,
             **request: Any) -> Any:
        return self.stream(f"/jobs/{_seg(job_id)}/dump", request, progress)

    def restore(self, progress: Callable[[int, int], None] | None = None, **request: Any) -> Any:
        return self.stream("/restore", request, progress)

    def checkpoints(self, label: str | None = None) -> Any:
        return self.request("GET", "/checkpoints", params={"label": label} if label else None)

    def delete_checkpoint(self, checkpoint_id: str) -> Any:
        return self.request("DELETE", f"/checkpoints/{_seg(checkpoint_id)}")


def _seg(value: str) -> str:
    """One URL path segment: ids from the command line never become other paths."""
    return quote(value, safe="")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"unexpected": raw[:200].decode(errors="replace")}


def _error(data: Any, status: int) -> StasisError:
    try:
        err = data["error"]
        return error_from_wire(err["type"], err["message"])
    except (KeyError, TypeError):
        return DaemonAPIError(f"unexpected answer from the daemon: {data!r}", status)
