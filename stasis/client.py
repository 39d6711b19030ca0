"""A client of the daemon's API over its unix socket: one typed method per route, Slurm's
included (the shapes are stasis/wire.py's). Not part of the daemon: the CLI and the scheduler
hooks use it, and it imports nothing of the daemon's.

It speaks just enough HTTP/1.0 for our own server: one request per connection, the answer read
to EOF (JSON, or NDJSON lines for dumps and restores). Not httpx, not even http.client: every
`stasis` command and every Slurm hook makes one call, and importing httpx cost ~100 ms per
invocation on these machines, http.client (which drags in email and ssl) still ~30 ms; the time
of `stasis dump` is held against the plain `criu dump`, which starts in a millisecond.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from io import BufferedReader
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack, cast
from urllib.parse import quote, urlencode

from stasis.errors import DaemonAPIError, StasisError, error_from_wire

if TYPE_CHECKING:  # only the types: creating the ~30 typed dicts costs every command ~2 ms
    from stasis import wire

_CONNECT_TIMEOUT_S = 30.0


class _Response:
    def __init__(self, status: int, body: BufferedReader, sock: socket.socket) -> None:
        self.status = status
        self.body = body
        self.sock = sock

    def read(self) -> bytes:
        data = bytearray()
        try:
            while chunk := self.body.read1(65536):
                data += chunk
        except ConnectionResetError:
            # A daemon that refuses a connection at once answers, then closes without reading
            # the request: the kernel reports that as a reset after the answer.
            if not data:
                raise
        finally:
            self.close()
        return bytes(data)

    def readline(self) -> bytes:
        return self.body.readline()

    def close(self) -> None:
        self.body.close()
        self.sock.close()


class Client:
    """`timeout_s`: how long an answer may take (None: no bound, a dump may stream for minutes);
    a daemon that does not answer in time is reported as unreachable."""

    def __init__(self, socket_path: Path, timeout_s: float | None = None) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def close(self) -> None:
        pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, e: OSError) -> DaemonAPIError:
        if isinstance(e, PermissionError) and self.socket_path.exists():
            import grp  # only on this error path: every CLI call imports this module

            try:
                group = grp.getgrgid(self.socket_path.stat().st_gid).gr_name
            except (KeyError, OSError):
                group = "its group"
            return DaemonAPIError(
                f"permission denied on the stasis daemon's socket {self.socket_path}: this node "
                f"opens it to the members of {group} only; ask its admin to add you (or to set "
                'socket_group = "" for every local user)'
            )
        if not self.socket_path.exists():
            why = "no socket there"
        elif isinstance(e, TimeoutError):
            why = "no answer in time"
        else:
            why = "nothing answers on it"
        return DaemonAPIError(
            f"cannot reach the stasis daemon at {self.socket_path} ({why}); "
            "start it with `stasis daemon` or set STASIS_SOCKET"
        )

    def _send(self, method: str, path: str, body: Any) -> _Response:
        payload = json.dumps(body).encode() if body is not None else b""
        head = f"{method} {path} HTTP/1.0\r\nHost: stasis\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\n"
        head += f"Content-Length: {len(payload)}\r\n\r\n"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_CONNECT_TIMEOUT_S)
            sock.connect(str(self.socket_path))
            sock.settimeout(self.timeout_s)
            try:
                sock.sendall(head.encode() + payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused us at once (too many connections): it said why
            reader = sock.makefile("rb")
            status_line = reader.readline()
            try:
                status = int(status_line.split()[1])
            except (IndexError, ValueError):
                raise ConnectionError(f"not an HTTP answer: {status_line[:80]!r}") from None
            while reader.readline() not in (b"\r\n", b"\n", b""):
                pass  # the headers: the body runs to EOF, and is JSON whatever they say
            return _Response(status, reader, sock)
        except OSError as e:  # a timeout and a reset connection are OSErrors too
            sock.close()
            raise self._unreachable(e) from e

    def request(
        self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None
    ) -> Any:
        if params:
            path = f"{path}?{urlencode(params)}"
        resp = self._send(method, path, body)
        try:
            raw = resp.read()
        except OSError as e:
            raise self._unreachable(e) from e
        data = _json(raw)
        if resp.status >= 400:
            raise _error(data, resp.status)
        return data

    def stream(
        self, path: str, body: Any, progress: Callable[[int, int], None] | None = None
    ) -> Any:
        """POST and read NDJSON: progress lines go to `progress`, the last line is the answer."""
        resp = self._send("POST", path, body)
        try:
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
        except OSError as e:
            raise self._unreachable(e) from e
        finally:
            resp.close()
        raise DaemonAPIError("the daemon closed the connection before answering")

    # -- the API, one method per route (stasis/wire.py lists them) ------------------------

    def run(self, **request: Unpack[wire.RunRequest]) -> wire.RunAnswer:
        return cast("wire.RunAnswer", self.request("POST", "/jobs", request))

    def jobs(self) -> list[wire.Job]:
        return cast("list[wire.Job]", self.request("GET", "/jobs"))

    def job(self, job_id: str) -> wire.Job:
        return cast("wire.Job", self.request("GET", f"/jobs/{_seg(job_id)}"))

    def kill(self, job_id: str, **request: Unpack[wire.KillRequest]) -> wire.KillAnswer:
        return cast("wire.KillAnswer", self.request("POST", f"/jobs/{_seg(job_id)}/kill", request))

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        return cast("wire.DumpAnswer", self.stream(f"/jobs/{_seg(job_id)}/dump", request, progress))

    def dump_check(self, job_id: str) -> wire.DumpCheckAnswer:
        return cast("wire.DumpCheckAnswer", self.request("GET", f"/jobs/{_seg(job_id)}/dump-check"))

    def restore(
        self,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.RestoreRequest],
    ) -> wire.RestoreAnswer:
        return cast("wire.RestoreAnswer", self.stream("/restore", request, progress))

    def checkpoints(
        self, label: str | None = None, user: str | None = None
    ) -> list[wire.Checkpoint]:
        params = {k: v for k, v in (("label", label), ("user", user)) if v is not None}
        return cast(
            "list[wire.Checkpoint]", self.request("GET", "/checkpoints", params=params or None)
        )

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        return cast("wire.Deleted", self.request("DELETE", f"/checkpoints/{_seg(checkpoint_id)}"))

    def check_checkpoint(self, checkpoint_id: str) -> wire.CheckpointCheck:
        return cast(
            "wire.CheckpointCheck", self.request("GET", f"/checkpoints/{_seg(checkpoint_id)}/check")
        )

    def verify(self, checkpoint_id: str) -> wire.VerifyVerdict:
        return cast(
            "wire.VerifyVerdict",
            self.request("POST", f"/checkpoints/{_seg(checkpoint_id)}/verify", {}),
        )

    def collect_garbage(self, **request: Unpack[wire.GcRequest]) -> wire.GcAnswer:
        return cast("wire.GcAnswer", self.request("POST", "/checkpoints/gc", request))

    def rekey(self) -> wire.RekeyAnswer:
        return cast("wire.RekeyAnswer", self.request("POST", "/checkpoints/rekey"))

    def check(self) -> wire.CheckReport:
        return cast("wire.CheckReport", self.request("GET", "/check"))

    def network_locks(self) -> list[wire.NetworkLock]:
        return cast("list[wire.NetworkLock]", self.request("GET", "/network-locks"))

    # -- Slurm (stasis.slurm.integration) ------------------------------------------------------

    def slurm_health(self) -> wire.Health:
        return cast("wire.Health", self.request("GET", "/slurm/health"))

    def slurm_register(self, **request: Unpack[wire.RegisterRequest]) -> wire.Registration:
        return cast("wire.Registration", self.request("POST", "/slurm/jobs", request))

    def slurm_job(self, slurm_job: str) -> wire.Registration:
        return cast("wire.Registration", self.request("GET", f"/slurm/jobs/{_seg(slurm_job)}"))

    def slurm_checkpoint(
        self, slurm_job: str, **request: Unpack[wire.SlurmCheckpointRequest]
    ) -> wire.SlurmCheckpointAnswer:
        return cast(
            "wire.SlurmCheckpointAnswer",
            self.request("POST", f"/slurm/jobs/{_seg(slurm_job)}/checkpoint", request),
        )

    def slurm_interval(self, slurm_job: str, requested: str) -> dict[str, Any]:
        """How long job `slurm_job` waits for its next periodic checkpoint (`requested`:
        "auto" or seconds), and why (stasis.slurm.intervals)."""
        return cast(
            "dict[str, Any]",
            self.request(
                "POST", f"/slurm/jobs/{_seg(slurm_job)}/interval", {"requested": requested}
            ),
        )

    def slurm_intervals(self) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", self.request("GET", "/slurm/intervals"))

    def slurm_finish(
        self, slurm_job: str, exit_code: int | None, stopped: bool = False
    ) -> wire.FinishAnswer:
        return cast(
            "wire.FinishAnswer",
            self.request(
                "POST",
                f"/slurm/jobs/{_seg(slurm_job)}/finish",
                {"exit_code": exit_code, "stopped": stopped},
            ),
        )


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
