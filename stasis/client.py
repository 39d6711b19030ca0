"""A client of the daemon's API over its unix socket: one typed method per route, Slurm's and
Kubernetes' included, each built from the route's declaration (stasis/routes.py; the shapes are
stasis/wire.py's). Not part of the daemon: the CLI, the scheduler hooks, the Kubernetes agent
and runtime wrapper use it, and it imports nothing of the daemon's.

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
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, cast
from urllib.parse import urlencode

from stasis import routes
from stasis.errors import DaemonAPIError, StasisError, error_from_wire
from stasis.routes import Route

if TYPE_CHECKING:  # only the types: creating the ~70 typed dicts costs every command ~3 ms
    from stasis import wire

Req = TypeVar("Req")
Ans = TypeVar("Ans")

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

    def call(
        self,
        route: Route[Req, Ans],
        body: Req,
        *,
        query: dict[str, str] | None = None,
        progress: Callable[[int, int], None] | None = None,
        **args: str,
    ) -> Ans:
        """`route` (a declaration of stasis.routes) with `body` (None: none sent), its path's
        parameters filled from `args`; a streamed route's progress goes to `progress`."""
        path = route.url(**args)
        if route.streamed:
            return cast("Ans", self.stream(path, body, progress))
        return cast("Ans", self.request(route.method, path, body, params=query))

    # -- the API, one method per route (stasis/routes.py declares them) -------------------

    def run(self, **request: Unpack[wire.RunRequest]) -> wire.RunAnswer:
        return self.call(routes.RUN, request)

    def jobs(self) -> list[wire.Job]:
        return self.call(routes.JOBS, None)

    def job(self, job_id: str) -> wire.Job:
        return self.call(routes.JOB, None, job=job_id)

    def intervals(self) -> list[wire.JobInterval]:
        return self.call(routes.INTERVALS, None)

    def kill(self, job_id: str, **request: Unpack[wire.KillRequest]) -> wire.KillAnswer:
        return self.call(routes.KILL, request, job=job_id)

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        return self.call(routes.DUMP, request, progress=progress, job=job_id)

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer:
        return self.call(routes.FREEZE, request, job=job_id)

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer:
        return self.call(routes.THAW, request, job=job_id)

    def dump_check(self, job_id: str) -> wire.DumpCheckAnswer:
        return self.call(routes.DUMP_CHECK, None, job=job_id)

    def restore(
        self,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.RestoreRequest],
    ) -> wire.RestoreAnswer:
        return self.call(routes.RESTORE, request, progress=progress)

    def checkpoints(
        self, label: str | None = None, user: str | None = None
    ) -> list[wire.Checkpoint]:
        query = {k: v for k, v in (("label", label), ("user", user)) if v is not None}
        return self.call(routes.CHECKPOINTS, None, query=query or None)

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        return self.call(routes.DELETE_CHECKPOINT, None, checkpoint=checkpoint_id)

    def check_checkpoint(self, checkpoint_id: str) -> wire.CheckpointCheck:
        return self.call(routes.CHECK_CHECKPOINT, None, checkpoint=checkpoint_id)

    def verify(self, checkpoint_id: str) -> wire.VerifyVerdict:
        return self.call(routes.VERIFY, None, checkpoint=checkpoint_id)

    def collect_garbage(self, **request: Unpack[wire.GcRequest]) -> wire.GcAnswer:
        return self.call(routes.COLLECT_GARBAGE, request)

    def rekey(self) -> wire.RekeyAnswer:
        return self.call(routes.REKEY, None)

    def check(self) -> wire.CheckReport:
        return self.call(routes.CHECK, None)

    def network_locks(self) -> list[wire.NetworkLock]:
        return self.call(routes.NETWORK_LOCKS, None)

    # -- Slurm (stasis.slurm.integration) ------------------------------------------------------

    def slurm_health(self) -> wire.Health:
        return self.call(routes.SLURM_HEALTH, None)

    def slurm_register(self, **request: Unpack[wire.RegisterRequest]) -> wire.Registration:
        return self.call(routes.SLURM_REGISTER, request)

    def slurm_job(self, slurm_job: str) -> wire.Registration:
        return self.call(routes.SLURM_JOB, None, job=slurm_job)

    def slurm_checkpoint(
        self, slurm_job: str, **request: Unpack[wire.SlurmCheckpointRequest]
    ) -> wire.SlurmCheckpointAnswer:
        return self.call(routes.SLURM_CHECKPOINT, request, job=slurm_job)

    def slurm_interval(self, slurm_job: str, requested: str) -> wire.SlurmInterval:
        """How long job `slurm_job` waits for its next periodic checkpoint (`requested`:
        "auto", seconds, or "default": the node's `interval` setting), and why
        (stasis.slurm.intervals)."""
        request: wire.SlurmIntervalRequest = {"requested": requested}
        return self.call(routes.SLURM_INTERVAL, request, job=slurm_job)

    def slurm_intervals(self) -> list[wire.SlurmInterval]:
        return self.call(routes.SLURM_INTERVALS, None)

    def slurm_finish(
        self, slurm_job: str, exit_code: int | None, stopped: bool = False
    ) -> wire.FinishAnswer:
        request: wire.FinishRequest = {"exit_code": exit_code, "stopped": stopped}
        return self.call(routes.SLURM_FINISH, request, job=slurm_job)

    # -- Kubernetes (stasis.k8s.integration; root's) -------------------------------------------

    def k8s_containers(self) -> list[wire.ContainerInfo]:
        return self.call(routes.K8S_CONTAINERS, None)

    def k8s_register(self, **request: Unpack[wire.ContainerRegisterRequest]) -> wire.ContainerInfo:
        return self.call(routes.K8S_REGISTER, request)

    def k8s_checkpoint(
        self, container_id: str, **request: Unpack[wire.ContainerCheckpointRequest]
    ) -> wire.ContainerCheckpointAnswer:
        return self.call(routes.K8S_CHECKPOINT, request, container=container_id)

    def k8s_interval(
        self, container_id: str, interval_s: int | None, auto: bool = False
    ) -> wire.ContainerInfo:
        request: wire.ContainerIntervalRequest = {"interval_s": interval_s, "auto": auto}
        return self.call(routes.K8S_INTERVAL, request, container=container_id)

    def k8s_forget(self, container_id: str) -> wire.Forgotten:
        return self.call(routes.K8S_FORGET, None, container=container_id)

    def k8s_plan_restore(self, **request: Unpack[wire.ContainerRestoreRequest]) -> wire.RestorePlan:
        return self.call(routes.K8S_PLAN_RESTORE, request)

    def k8s_restore_done(
        self, container_id: str, **request: Unpack[wire.RestoreDoneRequest]
    ) -> wire.RestoreDone:
        return self.call(routes.K8S_RESTORE_DONE, request, container=container_id)

    def k8s_export(self, checkpoint_id: str, path: str) -> wire.ExportAnswer:
        request: wire.ExportRequest = {"path": path}
        return self.call(routes.K8S_EXPORT, request, checkpoint=checkpoint_id)

    def k8s_import(self, **request: Unpack[wire.ImportRequest]) -> wire.ContainerCheckpointAnswer:
        return self.call(routes.K8S_IMPORT, request)

    def k8s_node(self) -> wire.NodeInfo:
        return self.call(routes.K8S_NODE, None)

    def k8s_drain(self, **request: Unpack[wire.K8sDrainRequest]) -> wire.K8sDrainAnswer:
        return self.call(routes.K8S_DRAIN, request)


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
