"""Slurm commands that reach another node's stasis daemon, and how that daemon knows who asks.

Identity across nodes is munge's, as it is for Slurm itself. The CLI, run by the user on any node
of the cluster, has munged encode a credential whose payload is the request itself (what to do,
to which job, on which node of which cluster); munge adds the caller's uid and gid, an encode
time and a time to live, and only root may decode it (`--restrict-uid 0`). The request travels
over HTTP on TCP to the node daemon's remote listener (`slurm_remote_port`, one port for the
whole cluster), which has its own munged decode the credential (`unmunge`): a replayed,
expired, forged or garbled credential is refused there by munge, and a credential made for
another request (another job, another node, another cluster, another operation) by
`check_payload`. The uid and gid are munge's, never the request's; from there the node acts
as its unix socket would for that caller (stasis.slurm.registrations: a user on their own jobs,
root on all), and a drain is root's alone.

    POST /slurm/remote/jobs/{job}/checkpoint  {"credential", "leave_running", "reason"}
                                              -> SlurmCheckpointAnswer
    POST /slurm/remote/drain                  {"credential", "reason"} -> DrainAnswer
    POST /slurm/remote/parts/{job}            {"credential", "command", "cwd"} -> RunAnswer
    POST /slurm/remote/parts/{job}/{part}/output  {"credential", "offset"} -> SlurmPartOutput
    POST /slurm/remote/parts/{job}/{part}/signal  {"credential", "signal"} -> SlurmPartSignalled
    POST /slurm/remote/parts/{job}/{part}/freeze|dump|thaw, .../checkpoints/{id}/delete: a cut's
                                              (root only; stasis.slurm.partclient)

Which munged: the socket slurm.conf names (`AuthInfo=socket=...`), as Slurm's own
auth/munge plugin uses, else munge's compiled-in default. This module owns the credential
(make, verify, match), slurm.conf's few keys it needs, and the client of the remote listener;
the listener itself is stasis.slurm.integration's.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from stasis import routes, wire
from stasis.errors import (
    DaemonAPIError,
    PermissionDeniedError,
    SlurmError,
    StasisError,
    UsageError,
    error_from_wire,
)

if TYPE_CHECKING:
    from stasis.config import Settings

DEFAULT_SLURM_CONF = "/etc/slurm/slurm.conf"
# What a credential looks like, armored: a prefix, base64, a closing colon. Anything else is
# refused before munge sees it.
_CREDENTIAL = re.compile(r"MUNGE:[A-Za-z0-9+/]+={0,2}:")
MAX_CREDENTIAL_CHARS = 4096  # a request's credential is ~400 characters
_MUNGE_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 10.0
# unmunge's exit statuses (munge.h's munge_err_t) that mean "this credential is refused", as
# opposed to munged failing.
_SOCKET_ERROR = 6
_REFUSED = {
    8: "it is not a credential munge can read",
    9: "its version is unknown",
    10: "its cipher is unknown",
    11: "its MAC is unknown",
    12: "its compression is unknown",
    13: "its security realm is unknown",
    14: "it is invalid (forged, or made with another munge key)",
    15: "it expired",
    16: "it was made in the future (the nodes' clocks differ)",
    17: "it was replayed (already used)",
    18: "it is not for this decoder",
}
_PAYLOAD_VERSION = 1


Requeued = wire.Requeued
DrainAnswer = wire.SlurmDrainAnswer


# -- slurm.conf --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmConf:
    cluster: str  # ClusterName; "" when there is none to read
    munge_socket: str | None  # AuthInfo's socket=; None: munge's default


def parse_slurm_conf(text: str) -> SlurmConf:
    """ClusterName and AuthInfo's socket from slurm.conf's text (keys are case-insensitive,
    `#` starts a comment, a line may hold several Key=Value pairs)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        for token in line.split("#", 1)[0].split():
            key, sep, value = token.partition("=")
            if sep:
                values.setdefault(key.lower(), value.strip('"'))
    socket_path = None
    for option in values.get("authinfo", "").split(","):
        key, sep, value = option.partition("=")
        if sep and key.strip().lower() == "socket" and value.strip():
            socket_path = value.strip()
    return SlurmConf(cluster=values.get("clustername", ""), munge_socket=socket_path)


def slurm_conf(settings: Settings) -> SlurmConf:
    """This node's slurm.conf (SLURM_CONF, else Slurm's default path, else a configless
    node's cached copy); none readable: no cluster name and munge's default socket."""
    try:
        return parse_slurm_conf(Path(settings.slurm_conf_path or DEFAULT_SLURM_CONF).read_text())
    except (OSError, UnicodeDecodeError):
        return SlurmConf(cluster="", munge_socket=None)


def this_node(settings: Settings) -> str:
    """This node's NodeName in slurm.conf: slurm_node_name, else the short host name."""
    return settings.slurm_node_name or socket.gethostname().split(".")[0]


# -- munge -------------------------------------------------------------------------------------


def _munge(
    tool: str, munge_socket: str | None, args: list[str], data: bytes
) -> subprocess.CompletedProcess[bytes]:
    argv = [tool, *(["--socket", munge_socket] if munge_socket else []), *args]
    try:
        return subprocess.run(argv, input=data, capture_output=True, timeout=_MUNGE_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError(
            f"{tool} is not installed on this node (munge identifies the caller "
            "of remote Slurm commands)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{tool} did not answer in {_MUNGE_TIMEOUT_S:.0f} s (munged "
            f"at {munge_socket or 'its default socket'})"
        ) from None


def _why(result: subprocess.CompletedProcess[bytes]) -> str:
    text = (result.stderr or result.stdout).decode(errors="replace").strip()
    return text.splitlines()[0] if text else f"exit status {result.returncode}"


def make_credential(payload: bytes, munge_socket: str | None) -> str:
    """A munge credential of the calling user carrying `payload`, decodable by root only."""
    result = _munge("munge", munge_socket, ["--restrict-uid", "0"], payload)
    if result.returncode != 0:
        raise SlurmError(f"cannot make a munge credential: {_why(result)}")
    credential = result.stdout.decode(errors="replace").strip()
    if not _CREDENTIAL.fullmatch(credential):
        raise SlurmError("cannot make a munge credential: munge printed no credential")
    return credential


@dataclass(frozen=True)
class Identity:
    """Who made a credential, as munge says, and what it carries."""

    uid: int
    gid: int
    payload: bytes


def verify_credential(credential: str, munge_socket: str | None) -> Identity:
    """Decode `credential` with munged: a PermissionDeniedError when munge refuses it (replayed,
    expired, forged...), a SlurmError when munged cannot be asked."""
    if (
        not isinstance(credential, str)
        or len(credential) > MAX_CREDENTIAL_CHARS
        or not _CREDENTIAL.fullmatch(credential)
    ):
        raise PermissionDeniedError("permission denied: not a munge credential")
    result = _munge("unmunge", munge_socket, ["--numeric"], credential.encode() + b"\n")
    if result.returncode in _REFUSED:
        raise PermissionDeniedError(
            f"permission denied: munge credential refused: " f"{_REFUSED[result.returncode]}"
        )
    if result.returncode != 0:
        where = munge_socket or "its default socket"
        if result.returncode == _SOCKET_ERROR:
            raise SlurmError(f"cannot reach munged at {where}: {_why(result)}")
        raise SlurmError(f"unmunge failed (munged at {where}): {_why(result)}")
    head, sep, payload = result.stdout.partition(b"\n\n")
    meta = dict(re.findall(r"^([A-Z_]+):\s*(\S*)", head.decode(errors="replace"), re.M))
    if not sep or not meta.get("UID", "").isdigit() or not meta.get("GID", "").isdigit():
        raise SlurmError("unmunge answered without a uid and gid")
    return Identity(uid=int(meta["UID"]), gid=int(meta["GID"]), payload=payload)


# -- what a credential asks --------------------------------------------------------------------


def request_payload(op: str, node: str, cluster: str, **fields: object) -> dict[str, object]:
    """The request a credential stands for: the operation, its target node and cluster, and
    the request's own fields."""
    return {"v": _PAYLOAD_VERSION, "op": op, "node": node, "cluster": cluster, **fields}


def encode_payload(payload: dict[str, object]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()


def check_payload(identity: Identity, expected: dict[str, object]) -> None:
    """Refuse a credential made for another request than the one it came with: munge
    credentials are good on every node sharing the key, so the payload must name this one."""
    try:
        said = json.loads(identity.payload)
    except ValueError:
        said = None
    if not isinstance(said, dict):
        raise PermissionDeniedError(
            "permission denied: the munge credential carries no " "stasis request"
        )
    for key in ("v", "op", "cluster", "node", *sorted(set(expected) | set(said))):
        if said.get(key) != expected.get(key):
            raise PermissionDeniedError(
                f"permission denied: the munge credential was made for another request "
                f"({key} {_show(said.get(key))}, not {_show(expected.get(key))})"
            )


def _show(value: object) -> str:
    return json.dumps(value)[:40]


# -- the client --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteNode:
    """A node's stasis daemon, reached on its remote listener."""

    node: str  # its Slurm NodeName
    address: str  # its NodeAddr
    port: int
    # How long an answer may take once connected (None: no bound, a checkpoint may take
    # minutes); a node that does not accept the connection in _CONNECT_TIMEOUT_S is unreachable.
    timeout_s: float | None = None

    @property
    def where(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"node {self.node} at {host}:{self.port}"

    def call(self, route: routes.AnyRoute, body: object, **args: str) -> Any:
        """`body` to `route` (one of stasis.routes.SLURM_REMOTE) of that node, its path's
        parameters filled from `args`."""
        return self.send(route.method, route.url(**args), body)

    def send(self, method: str, path: str, body: object) -> Any:
        payload = json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.address, self.port, timeout=_CONNECT_TIMEOUT_S)
        try:
            try:
                conn.connect()
                assert conn.sock is not None
                conn.sock.settimeout(self.timeout_s)
                conn.request(
                    method, path, body=payload, headers={"Content-Type": "application/json"}
                )
                resp = conn.getresponse()
                status, raw = resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                raise DaemonAPIError(
                    f"cannot reach the stasis daemon of {self.where} ({_why_unreachable(e)}); "
                    f"is it running there with slurm_remote_port = {self.port}?"
                ) from None
        finally:
            conn.close()
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if status >= 400 or not isinstance(data, dict):
            raise _error(data, status, self.where)
        return data


def _why_unreachable(e: BaseException) -> str:
    """Why another node's daemon could not be reached, in a few words."""
    if isinstance(e, TimeoutError | socket.timeout):
        return "no answer in time"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the address: {e.strerror}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return type(e).__name__


def _error(data: Any, status: int, where: str) -> StasisError:
    try:
        err = data["error"]
        return error_from_wire(str(err["type"]), f"{err['message']} ({where})")
    except (KeyError, TypeError):
        return DaemonAPIError(
            f"unexpected answer from the stasis daemon of {where}: " f"HTTP {status}", status
        )


def remote_node(
    settings: Settings, node: str, address: str, timeout_s: float | None = None
) -> RemoteNode:
    if not settings.slurm_remote_port:
        raise UsageError(
            f"Slurm node {node} is another node, and remote Slurm commands are off here: set "
            "slurm_remote_port (STASIS_SLURM_REMOTE_PORT) to the port the nodes' stasis "
            "daemons listen on"
        )
    return RemoteNode(
        node=node, address=address, port=settings.slurm_remote_port, timeout_s=timeout_s
    )


def checkpoint(
    settings: Settings, target: RemoteNode, job_id: str, leave_running: bool, reason: str = "asked"
) -> wire.SlurmCheckpointAnswer:
    """Checkpoint Slurm job `job_id` on `target` as the calling user (stopped: requeued)."""
    conf = slurm_conf(settings)
    fields: dict[str, object] = {"leave_running": leave_running, "reason": reason}
    credential = make_credential(
        encode_payload(
            request_payload("checkpoint", target.node, conf.cluster, job=job_id, **fields)
        ),
        conf.munge_socket,
    )
    request = wire.SlurmRemoteCheckpointRequest(
        credential=credential, leave_running=leave_running, reason=reason
    )
    answer = target.call(routes.SLURM_REMOTE_CHECKPOINT, request, job=job_id)
    return cast("wire.SlurmCheckpointAnswer", answer)


def drain(settings: Settings, target: RemoteNode, reason: str) -> DrainAnswer:
    """Have `target` drain itself: Slurm's DRAIN, then every protected job checkpointed and
    requeued (root only: the target checks munge's uid)."""
    conf = slurm_conf(settings)
    credential = make_credential(
        encode_payload(request_payload("drain", target.node, conf.cluster, reason=reason)),
        conf.munge_socket,
    )
    request = wire.SlurmRemoteDrainRequest(credential=credential, reason=reason)
    return cast(DrainAnswer, target.call(routes.SLURM_REMOTE_DRAIN, request))


def part_call(
    settings: Settings,
    target: RemoteNode,
    route: routes.AnyRoute,
    op: str,
    args: dict[str, str],
    fields: dict[str, object],
) -> Any:
    """`route` of a job's part on `target`, its credential binding the path's `args` and the
    body's `fields` (stasis.slurm.integration checks them all)."""
    conf = slurm_conf(settings)
    credential = make_credential(
        encode_payload(request_payload(op, target.node, conf.cluster, **args, **fields)),
        conf.munge_socket,
    )
    return target.call(route, {"credential": credential, **fields}, **args)


def start_part(
    settings: Settings, target: RemoteNode, job_id: str, command: list[str], cwd: str
) -> wire.RunAnswer:
    """Have `target`'s daemon start `command` as its part of Slurm job `job_id` (in the job's
    network there, as the job's user); the caller must be the job's user or root."""
    fields: dict[str, object] = {"command": command, "cwd": cwd}
    answer = part_call(
        settings, target, routes.SLURM_REMOTE_PART_START, "part-start", {"job": job_id}, fields
    )
    return cast("wire.RunAnswer", answer)


def part_output(
    settings: Settings, target: RemoteNode, job_id: str, part: str, offset: int
) -> wire.SlurmPartOutput:
    """A part's output from `offset`, its state and exit status."""
    answer = part_call(
        settings,
        target,
        routes.SLURM_REMOTE_PART_OUTPUT,
        "part-output",
        {"job": job_id, "part": part},
        {"offset": offset},
    )
    return cast("wire.SlurmPartOutput", answer)


def signal_part(
    settings: Settings, target: RemoteNode, job_id: str, part: str, signal: str
) -> wire.SlurmPartSignalled:
    """`signal` (TERM, HUP, INT, KILL) to a part."""
    answer = part_call(
        settings,
        target,
        routes.SLURM_REMOTE_PART_SIGNAL,
        "part-signal",
        {"job": job_id, "part": part},
        {"signal": signal},
    )
    return cast("wire.SlurmPartSignalled", answer)


__all__ = [
    "DrainAnswer",
    "Identity",
    "RemoteNode",
    "SlurmConf",
    "check_payload",
    "checkpoint",
    "drain",
    "encode_payload",
    "make_credential",
    "parse_slurm_conf",
    "part_call",
    "part_output",
    "remote_node",
    "request_payload",
    "signal_part",
    "slurm_conf",
    "start_part",
    "this_node",
    "verify_credential",
]
