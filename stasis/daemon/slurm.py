"""The daemon's Slurm endpoints: register a job's workload, checkpoint it, retire its label.

    GET  /slurm/health                      is a daemon here (the SPANK helper asks first)
    POST /slurm/jobs                        the launcher registers its workload's namespace init
    GET  /slurm/jobs/{id}                   the registration (owner or root)
    POST /slurm/jobs/{id}/checkpoint        {"leave_running": bool}; without leave_running the
                                            workload is killed once the checkpoint is published
                                            and the job is requeued (`scontrol requeue`)
    POST /slurm/jobs/{id}/finish            {"exit_code": n}: the workload ended; 0 retires the
                                            label's checkpoints (COMPLETED), anything else keeps them

Who calls is the socket's peer (SO_PEERCRED). A registration is accepted only from the job's own
launcher: the process named must be the caller's child, run as the caller's uid, be the init of a
PID namespace, and `scontrol pidinfo` must put the caller in that Slurm job, which Slurm must say
is the caller's. Afterwards a user may act only on their own jobs (root on all). Registrations
live in <state_dir>/slurm/<job id>.json (root only), so they survive a restart of the daemon.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from stasis.daemon.users import Caller
from stasis.engine import proctree
from stasis.errors import (
    CheckpointError,
    NotFoundError,
    PermissionDeniedError,
    StasisError,
    UsageError,
)
from stasis.store import CheckpointInfo, Manifest, Store, new_checkpoint_id, validate_label

if TYPE_CHECKING:  # the SPANK helper imports this module: keep aiohttp and the job table out
    from aiohttp import web

    from stasis.daemon.jobs import JobManager


# -- what Slurm says (scontrol, on the node; SLURM_CONF picks the cluster) ---------------------

_JOB_ID = re.compile(r"^[0-9]{1,10}$")
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
_TOKEN = re.compile(r"stasis-token=([0-9A-Za-z.-]+)")
_USER = re.compile(r"^(.*)\((\d+)\)$")
_TIMEOUT_S = 30


def validate_slurm_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
        raise UsageError(f"{job_id!r} is not a Slurm job id (digits, as in SLURM_JOB_ID)")
    return job_id


def scontrol(*args: str) -> str:
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise StasisError("scontrol is not installed on this node") from e
    except subprocess.TimeoutExpired as e:
        raise StasisError(f"scontrol {' '.join(args)} did not answer in {_TIMEOUT_S} s") from e
    if result.returncode != 0:
        why = (result.stderr or result.stdout).strip().splitlines()
        raise StasisError(f"scontrol {' '.join(args)} failed: {why[-1] if why else 'no output'}")
    return result.stdout


def parse_record(text: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (one `scontrol -o` record); values may hold spaces."""
    text = text.strip()
    found = list(_KEY.finditer(text))
    fields: dict[str, str] = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        fields.setdefault(m.group(1), text[m.end():end].strip())
    return fields


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    user: str
    uid: int
    state: str
    restarts: int
    stdout: str
    stderr: str
    token: str  # from AdminComment (set by our job_submit.lua); "" without it
    work_dir: str


def job_info(job_id: str) -> JobInfo:
    validate_slurm_job_id(job_id)
    try:
        text = scontrol("show", "job", "-o", job_id)
    except StasisError as e:
        if "Invalid job id" in str(e):
            raise NotFoundError(f"no Slurm job {job_id}") from e
        raise
    fields = parse_record(text.splitlines()[0] if text.strip() else "")
    if fields.get("JobId") != job_id:
        raise NotFoundError(f"no Slurm job {job_id}")
    m = _USER.match(fields.get("UserId", ""))
    if not m:
        raise StasisError(f"scontrol show job {job_id}: no UserId")
    token = _TOKEN.search(fields.get("AdminComment", ""))
    restarts = fields.get("Restarts", "0")
    return JobInfo(
        job_id=job_id, user=m.group(1), uid=int(m.group(2)),
        state=fields.get("JobState", ""), restarts=int(restarts) if restarts.isdigit() else 0,
        stdout=fields.get("StdOut", ""), stderr=fields.get("StdErr", ""),
        token=token.group(1) if token else "", work_dir=fields.get("WorkDir", ""),
    )


def job_of_pid(pid: int) -> str | None:
    """The Slurm job a process of this node belongs to (`scontrol pidinfo`), or None."""
    try:
        text = scontrol("pidinfo", str(int(pid)))
    except StasisError:
        return None
    m = re.search(r"(?:JobId=|job id )(\d+)", text)
    return m.group(1) if m else None


def requeue(job_id: str) -> None:
    scontrol("requeue", validate_slurm_job_id(job_id))


# -- labels: which checkpoints a Slurm job may resume from ------------------------------------
#
# A job labels its checkpoints with STASIS_CHECKPOINT (or CEDANA_CHECKPOINT); without one the label
# is the job id. Labels belong to their owner, as everywhere in stasis: a job looks only among its
# own user's checkpoints of the label (the store lists and retains per (owner, label)), so two
# users may pick the same label without ever seeing, resuming or retiring each other's. An explicit
# label is meant to be resumed by a later job under another id, so any checkpoint of that label
# taken from a Slurm job of the same user qualifies. A default (job id) label only matches
# checkpoints taken by this very job: same id AND the same token (set at submit time in
# AdminComment by our job_submit.lua), so a job that merely reuses the id after slurmctld started
# clean never picks up an old checkpoint.

ENABLE_VARS = ("STASIS_ENABLE", "CEDANA_ENABLE")
LABEL_VARS = ("STASIS_CHECKPOINT", "CEDANA_CHECKPOINT")
INTERVAL_VARS = ("STASIS_INTERVAL", "CEDANA_INTERVAL")


def resolve_label(explicit: str, job_id: str) -> tuple[str, bool]:
    """(label, whether it was given explicitly); raises UsageError for a malformed label."""
    if explicit:
        return validate_label(explicit), True
    return validate_label(job_id), False


def slurm_extra(job_id: str, token: str, explicit: bool, stdout: str, stderr: str
                ) -> dict[str, Any]:
    return {"slurm": {"job_id": job_id, "token": token, "explicit_label": explicit,
                      "stdout": stdout, "stderr": stderr}}


def _slurm(m: Manifest) -> dict[str, Any]:
    value = m.extra.get("slurm")
    return value if isinstance(value, dict) else {}


def candidates(store: Store, label: str, explicit: bool, uid: int, job_id: str, token: str
               ) -> list[Manifest]:
    """Checkpoints this job (of user `uid`) may resume from, newest first."""
    found = []
    for m in store.list(label, uid=uid):
        s = _slurm(m)
        if m.uid != uid or not s:  # the store filtered by owner already; never trust one filter
            continue
        if not explicit and (s.get("job_id") != job_id or s.get("token", "") != token):
            continue
        found.append(m)
    return found


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slurm_job: str
    pid: int = Field(gt=1)
    label: str
    explicit_label: bool = False


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    leave_running: bool = False


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exit_code: int


class Registration(BaseModel):
    slurm_job: str
    pid: int
    pid_start: int | None
    launcher_pid: int
    uid: int
    gid: int
    user: str
    label: str
    explicit_label: bool
    token: str
    stdout: str
    stderr: str
    work_dir: str
    command: list[str]
    state: str = "running"  # running | checkpointed | requeue-failed
    registered: str


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        raise UsageError(f"no process {pid}") from None
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


class SlurmJobs:
    def __init__(self, manager: JobManager) -> None:
        self.manager = manager
        self.dir = manager.settings.state_dir / "slurm"
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._hostname = manager.settings.node

    def _path(self, job_id: str) -> Path:
        return self.dir / f"{validate_slurm_job_id(job_id)}.json"

    def _save(self, reg: Registration) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self._path(reg.slurm_job)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(reg.model_dump_json())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def _load(self, job_id: str, caller: Caller) -> Registration:
        try:
            reg = Registration.model_validate_json(self._path(job_id).read_text())
        except FileNotFoundError:
            raise NotFoundError(f"Slurm job {job_id} is not under stasis on this node") from None
        caller.require(reg.uid, f"Slurm job {job_id}")
        return reg

    def _lock(self, job_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(job_id, threading.Lock())

    # -- endpoints (blocking; run in threads) ---------------------------------------------------

    def register(self, req: RegisterRequest, caller: Caller) -> Registration:
        job_id = validate_slurm_job_id(req.slurm_job)
        validate_label(req.label)
        st = _status(req.pid)
        if int(st.get("PPid", "-1")) != caller.pid:
            raise PermissionDeniedError(f"permission denied: process {req.pid} is not yours "
                                        "(not a child of the caller)")
        if int(st.get("Uid", "-1").split()[0]) != caller.uid:
            raise PermissionDeniedError(f"permission denied: process {req.pid} runs as another "
                                        "user")
        nspid = st.get("NSpid", "").split()
        if len(nspid) < 2 or nspid[-1] != "1":
            raise UsageError(f"process {req.pid} is not the init of a PID namespace")
        if job_of_pid(caller.pid) != job_id:
            raise PermissionDeniedError(f"permission denied: the caller is not part of Slurm job "
                                        f"{job_id}")
        info = job_info(job_id)
        if info.uid != caller.uid:
            raise PermissionDeniedError(f"permission denied: Slurm job {job_id} is not yours")
        if not req.explicit_label and req.label != job_id:
            raise UsageError("without an explicit label the label is the job id")
        try:
            cmdline = Path(f"/proc/{req.pid}/cmdline").read_bytes().split(b"\0")
            command = [c.decode(errors="replace") for c in cmdline if c]
        except OSError:
            command = []
        reg = Registration(
            slurm_job=job_id, pid=req.pid, pid_start=proctree.start_time(req.pid),
            launcher_pid=caller.pid, uid=caller.uid, gid=caller.gid, user=info.user,
            label=req.label, explicit_label=req.explicit_label, token=info.token,
            stdout=info.stdout, stderr=info.stderr or info.stdout, work_dir=info.work_dir,
            command=command or ["(slurm batch job)"],
            registered=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        self._sweep()
        self._save(reg)
        return reg

    def _sweep(self) -> None:
        """Forget registrations of workloads that ended without telling us (scancel, crash)."""
        for path in self.dir.glob("*.json"):
            try:
                old = Registration.model_validate_json(path.read_text())
            except (OSError, ValueError):
                continue
            if old.state == "running" and not proctree.alive(old.pid, old.pid_start):
                path.unlink(missing_ok=True)

    def get(self, job_id: str, caller: Caller) -> Registration:
        return self._load(job_id, caller)

    def checkpoint(self, job_id: str, req: CheckpointRequest, caller: Caller) -> dict[str, Any]:
        lock = self._lock(job_id)
        if not lock.acquire(blocking=False):
            raise UsageError(f"a checkpoint of Slurm job {job_id} is already being taken")
        try:
            return self._checkpoint(job_id, req, caller)
        finally:
            lock.release()

    def _checkpoint(self, job_id: str, req: CheckpointRequest, caller: Caller) -> dict[str, Any]:
        reg = self._load(job_id, caller)
        if reg.state == "checkpointed" or not proctree.alive(reg.pid, reg.pid_start):
            raise UsageError(f"Slurm job {job_id} has no running workload on this node")
        m = self.manager
        created = datetime.now(timezone.utc)
        info = CheckpointInfo(
            id=new_checkpoint_id(created), label=reg.label, job=job_id, host=self._hostname,
            created=created, criu_version=m.criu_version(m.criu), command=reg.command,
            cwd=reg.work_dir or "/", user=reg.user, uid=reg.uid, gid=reg.gid,
            log_path=reg.stdout or None,
            extra=slurm_extra(job_id, reg.token, reg.explicit_label, reg.stdout,
                                     reg.stderr),
        )
        manifest, result, _ = m.checkpoint_tree(reg.pid, info, req.leave_running, "none",
                                                f"Slurm job {job_id}")
        answer: dict[str, Any] = {
            "checkpoint": manifest.id, "label": manifest.label, "slurm_job": job_id,
            "size_bytes": manifest.size_bytes, "duration_s": round(result.duration_s, 4),
            "requeued": False,
        }
        if not req.leave_running:
            reg.state = "checkpointed"
            self._save(reg)
            os.kill(reg.pid, signal.SIGKILL)  # the namespace init: the whole tree goes
            m.dump_settled(manifest.id)
            try:
                requeue(job_id)
            except StasisError as e:
                reg.state = "requeue-failed"
                self._save(reg)
                raise CheckpointError(
                    f"checkpoint {manifest.id} of Slurm job {job_id} was taken but the job could "
                    f"not be requeued ({e}); submit it again with STASIS_CHECKPOINT="
                    f"{reg.label} to resume") from e
            answer["requeued"] = True
        return answer

    def finish(self, job_id: str, req: FinishRequest, caller: Caller) -> dict[str, Any]:
        reg = self._load(job_id, caller)
        if not caller.is_root and caller.pid != reg.launcher_pid:
            raise PermissionDeniedError("permission denied: only the job's launcher reports its "
                                        "end")
        retired: list[str] = []
        if req.exit_code == 0:
            store = self.manager.store
            for m in candidates(store, reg.label, reg.explicit_label, reg.uid, job_id,
                                       reg.token):
                try:
                    store.delete(m.id)
                    retired.append(m.id)
                except NotFoundError:
                    continue
        self._path(job_id).unlink(missing_ok=True)
        return {"retired": retired}


def _dump(model: BaseModel | dict[str, Any]) -> Any:
    return model.model_dump(mode="json") if isinstance(model, BaseModel) else model


def add_routes(app: web.Application) -> None:
    """Register the /slurm routes on the daemon's app (called by api.make_app)."""
    import asyncio

    from aiohttp import web

    from stasis.daemon.api import MANAGER, _body, peer

    jobs = SlurmJobs(app[MANAGER])

    async def health(request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})

    async def register(request: web.Request) -> web.StreamResponse:
        req = await _body(request, RegisterRequest)
        reg = await asyncio.to_thread(jobs.register, req, peer(request))
        return web.json_response(_dump(reg))

    async def get_job(request: web.Request) -> web.StreamResponse:
        reg = await asyncio.to_thread(jobs.get, request.match_info["job"], peer(request))
        return web.json_response(_dump(reg))

    async def checkpoint(request: web.Request) -> web.StreamResponse:
        req = await _body(request, CheckpointRequest)
        answer = await asyncio.to_thread(jobs.checkpoint, request.match_info["job"], req,
                                         peer(request))
        return web.json_response(answer)

    async def finish(request: web.Request) -> web.StreamResponse:
        req = await _body(request, FinishRequest)
        answer = await asyncio.to_thread(jobs.finish, request.match_info["job"], req,
                                         peer(request))
        return web.json_response(answer)

    app.add_routes([
        web.get("/slurm/health", health),
        web.post("/slurm/jobs", register),
        web.get("/slurm/jobs/{job}", get_job),
        web.post("/slurm/jobs/{job}/checkpoint", checkpoint),
        web.post("/slurm/jobs/{job}/finish", finish),
    ])
