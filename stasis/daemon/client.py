"""A client of the daemon's API over its unix socket (httpx with a uds transport)."""

from __future__ import annotations

import json
from urllib.parse import quote
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from stasis.errors import DaemonAPIError, StasisError, error_from_wire

# Dumps and restores of big jobs take minutes; every other call answers at once.
_TIMEOUT = httpx.Timeout(30.0, read=None)


class Client:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=str(socket_path)),
            base_url="http://stasis",
            timeout=_TIMEOUT,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, e: Exception) -> DaemonAPIError:
        if not self.socket_path.exists():
            why = "no socket there"
        elif isinstance(e, httpx.ConnectError) and "ermission" in str(e):
            why = "permission denied on the socket (join its group)"
        else:
            why = "nothing answers on it"
        return DaemonAPIError(
            f"cannot reach the stasis daemon at {self.socket_path} ({why}); "
            "start it with `stasis daemon` or set STASIS_SOCKET"
        )

    def request(self, method: str, path: str, body: Any = None,
                params: dict[str, str] | None = None) -> Any:
        try:
            resp = self._http.request(method, path, json=body, params=params)
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError) as e:
            raise self._unreachable(e) from e
        data = _json(resp)
        if resp.status_code >= 400:
            raise _error(data, resp.status_code)
        return data

    def stream(self, path: str, body: Any,
               progress: Callable[[int, int], None] | None = None) -> Any:
        """POST and read NDJSON: progress lines go to `progress`, the last line is the answer."""
        try:
            with self._http.stream("POST", path, json=body) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise _error(_json(resp), resp.status_code)
                for line in resp.iter_lines():
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
        except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError) as e:
            raise self._unreachable(e) from e
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


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return {"unexpected": resp.text[:200]}


def _error(data: Any, status: int) -> StasisError:
    try:
        err = data["error"]
        e = error_from_wire(err["type"], err["message"])
    except (KeyError, TypeError):
        return DaemonAPIError(f"unexpected answer from the daemon: {data!r}", status)
    return e
