"""The daemon's HTTP/JSON API, served on a unix socket.

Who calls is taken from the socket (SO_PEERCRED), never from the request. Errors answer
{"error": {"type": <StasisError subclass>, "message": <one line>}} with a fitting status.
Dumps and restores stream NDJSON: {"progress": {...}} lines, then one {"result": ...} or
{"error": ...} line, so that a client on a terminal can draw progress.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from stasis.daemon.jobs import JobManager
from stasis.daemon.models import DumpRequest, KillRequest, RestoreRequest, RunRequest
from stasis.daemon.stopping import stop
from stasis.daemon.users import Caller
from stasis.engine.check import run_check
from stasis.errors import PermissionDeniedError, StasisError, UsageError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MANAGER = web.AppKey("manager", JobManager)

log = logging.getLogger("stasis.daemon")


def peer(request: web.Request) -> Caller:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None:
        raise UsageError("cannot identify the caller")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Caller(pid=pid, uid=uid, gid=gid)


def _error_body(e: StasisError) -> dict[str, Any]:
    return {"error": {"type": type(e).__name__, "message": str(e)}}


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except StasisError as e:
        return web.json_response(_error_body(e), status=e.http_status)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        err = UsageError(f"bad request: {where}: {first['msg']}")
        return web.json_response(_error_body(err), status=400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own refusals (no such path, body too large, too slow): one JSON line too.
        err = UsageError(f"request refused: {e.status} {e.reason}: {e.text or ''}".strip(": "))
        return web.json_response(_error_body(err), status=e.status)
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client left: nobody to answer
    except Exception as e:
        # A bug: the client gets one line, the traceback goes to the daemon's log only.
        log.exception("internal error answering %s %s", request.method, request.path)
        bug = StasisError(f"internal error: {type(e).__name__}: {e}")
        return web.json_response(_error_body(bug), status=500)


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        data = await request.json() if request.body_exists else {}
    except RecursionError:
        raise UsageError("bad request: body is nested too deeply") from None
    except ValueError:  # not JSON, or not UTF-8
        raise UsageError("bad request: body is not JSON") from None
    _refuse_nul(data)
    try:
        return model.model_validate(data)
    except RecursionError:
        raise UsageError("bad request: body is nested too deeply") from None


def _refuse_nul(data: Any) -> None:
    """No command argument, path, variable or name can hold a NUL byte: the kernel would cut it
    there or refuse it. Said here, for every route and field, before anything starts."""
    todo: list[tuple[str, Any]] = [("", data)]
    while todo:  # not recursive: a deep body must not exhaust the stack here either
        where, item = todo.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                path = f"{where}.{key}" if where else str(key)
                if "\0" in key:
                    raise UsageError(f"bad request: a name in {where or 'the request'} contains "
                                     "a NUL character (\\0); no name can hold one")
                todo.append((path, value))
        elif isinstance(item, list):
            todo.extend((f"{where}.{i}" if where else str(i), v) for i, v in enumerate(item))
        elif isinstance(item, str) and "\0" in item:
            raise UsageError(f"bad request: {where or 'request'} contains a NUL character "
                             "(\\0); no argument, path or variable can hold one")


def _dump(model: BaseModel | list[Any]) -> Any:
    if isinstance(model, list):
        return [_dump(m) for m in model]
    return model.model_dump(mode="json")


async def run_job(request: web.Request) -> web.StreamResponse:
    req = await _body(request, RunRequest)
    answer = await asyncio.to_thread(request.app[MANAGER].run, req, peer(request))
    return web.json_response(_dump(answer))


async def list_jobs(request: web.Request) -> web.StreamResponse:
    jobs = await asyncio.to_thread(request.app[MANAGER].jobs, peer(request))
    return web.json_response(_dump(jobs))


async def get_job(request: web.Request) -> web.StreamResponse:
    job = await asyncio.to_thread(request.app[MANAGER].get, request.match_info["job"], peer(request))
    return web.json_response(_dump(job))


async def kill_job(request: web.Request) -> web.StreamResponse:
    req = await _body(request, KillRequest)
    answer = await stop(request.app[MANAGER], request.match_info["job"], peer(request), req)
    return web.json_response(_dump(answer))


async def dump_check(request: web.Request) -> web.StreamResponse:
    answer = await asyncio.to_thread(request.app[MANAGER].dump_check, request.match_info["job"],
                                     peer(request))
    return web.json_response(_dump(answer))


async def _stream(request: web.Request, work: Callable[[Callable[[int, int], None]], BaseModel]
                  ) -> web.StreamResponse:
    """Run `work` in a thread, streaming its progress, then its result or error, as NDJSON."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def progress(done: int, total: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"progress": {"bytes": done, "total": total}})

    def run() -> None:
        try:
            result: dict[str, Any] = {"result": _dump(work(progress))}
        except StasisError as e:
            result = _error_body(e)
        except ValidationError as e:
            result = _error_body(UsageError(f"bad request: {e.errors()[0]['msg']}"))
        except Exception as e:  # keep the daemon up and tell the client
            result = _error_body(StasisError(f"internal error: {type(e).__name__}: {e}"))
        loop.call_soon_threadsafe(queue.put_nowait, result)

    task = asyncio.create_task(asyncio.to_thread(run))
    while True:
        item = await queue.get()
        try:
            await response.write((json.dumps(item) + "\n").encode())
        except ConnectionResetError:
            pass  # the client left; the work itself must still finish cleanly
        if "progress" not in item:
            break
    await task
    return response


async def dump_job(request: web.Request) -> web.StreamResponse:
    req = await _body(request, DumpRequest)
    caller = peer(request)
    job_id = request.match_info["job"]
    manager = request.app[MANAGER]
    return await _stream(request, lambda progress: manager.dump(job_id, req, caller, progress))


async def restore(request: web.Request) -> web.StreamResponse:
    req = await _body(request, RestoreRequest)
    caller = peer(request)
    manager = request.app[MANAGER]
    return await _stream(request, lambda progress: manager.restore(req, caller, progress))


async def list_checkpoints(request: web.Request) -> web.StreamResponse:
    label = request.query.get("label")
    user = request.query.get("user")
    found = await asyncio.to_thread(request.app[MANAGER].checkpoints, label, peer(request), user)
    return web.json_response(_dump(found))


async def delete_checkpoint(request: web.Request) -> web.StreamResponse:
    checkpoint = request.match_info["checkpoint"]
    await asyncio.to_thread(request.app[MANAGER].delete_checkpoint, checkpoint, peer(request))
    return web.json_response({"deleted": checkpoint})


async def network_locks(request: web.Request) -> web.StreamResponse:
    # The addresses and ports of every job's connections: root's to see.
    if not peer(request).is_root:
        raise PermissionDeniedError("permission denied: only root may list network locks")
    found = await asyncio.to_thread(request.app[MANAGER].netlocks.present)
    return web.json_response(_dump(found))


async def check(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]
    report = await asyncio.to_thread(run_check, manager.settings)
    return web.json_response(_dump(report))


def make_app(manager: JobManager, middlewares: Sequence[Any] = ()) -> web.Application:
    """The API; `middlewares` run inside the error handler (their refusals are JSON too)."""
    app = web.Application(middlewares=[errors, *middlewares])
    app[MANAGER] = manager
    app.add_routes([
        web.post("/jobs", run_job),
        web.get("/jobs", list_jobs),
        web.get("/jobs/{job}", get_job),
        web.post("/jobs/{job}/kill", kill_job),
        web.post("/jobs/{job}/dump", dump_job),
        web.get("/jobs/{job}/dump-check", dump_check),
        web.post("/restore", restore),
        web.get("/checkpoints", list_checkpoints),
        web.delete("/checkpoints/{checkpoint}", delete_checkpoint),
        web.get("/check", check),
        web.get("/network-locks", network_locks),
    ])
    from stasis.daemon.slurm import add_routes as add_slurm_routes  # imports this module

    add_slurm_routes(app)
    return app
