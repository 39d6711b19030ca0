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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from stasis.daemon.http import answer, error_body, peer, read_body, wire
from stasis.daemon.integration import Integration
from stasis.daemon.jobs import JobManager
from stasis.daemon.models import DumpRequest, GcRequest, KillRequest, RestoreRequest, RunRequest
from stasis.daemon.stopping import stop
from stasis.engine.check import run_check
from stasis.errors import PermissionDeniedError, StasisError, UsageError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MANAGER = web.AppKey("manager", JobManager)

log = logging.getLogger("stasis.daemon")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except StasisError as e:
        return web.json_response(error_body(e), status=e.http_status)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "request"
        err = UsageError(f"bad request: {where}: {first['msg']}")
        return web.json_response(error_body(err), status=400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own refusals (no such path, body too large, too slow): one JSON line too.
        err = UsageError(f"request refused: {e.status} {e.reason}: {e.text or ''}".strip(": "))
        # A 405 names the methods the path takes (Allow), as HTTP has it.
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return web.json_response(error_body(err), status=e.status, headers=allow)
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client left: nobody to answer
    except Exception as e:
        # A bug: the client gets one line, the traceback goes to the daemon's log only.
        log.exception("internal error answering %s %s", request.method, request.path)
        bug = StasisError(f"internal error: {type(e).__name__}: {e}")
        return web.json_response(error_body(bug), status=500)


async def run_job(request: web.Request) -> web.StreamResponse:
    req = await read_body(request, RunRequest)
    return answer(await asyncio.to_thread(request.app[MANAGER].run, req, peer(request)))


async def list_jobs(request: web.Request) -> web.StreamResponse:
    return answer(await asyncio.to_thread(request.app[MANAGER].jobs, peer(request)))


async def get_job(request: web.Request) -> web.StreamResponse:
    return answer(
        await asyncio.to_thread(request.app[MANAGER].get, request.match_info["job"], peer(request))
    )


async def kill_job(request: web.Request) -> web.StreamResponse:
    req = await read_body(request, KillRequest)
    return answer(await stop(request.app[MANAGER], request.match_info["job"], peer(request), req))


async def dump_check(request: web.Request) -> web.StreamResponse:
    return answer(
        await asyncio.to_thread(
            request.app[MANAGER].dump_check, request.match_info["job"], peer(request)
        )
    )


async def _stream(
    request: web.Request, work: Callable[[Callable[[int, int], None]], Mapping[str, Any]]
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
            result: dict[str, Any] = {"result": wire(work(progress))}
        except StasisError as e:
            result = error_body(e)
        except ValidationError as e:
            result = error_body(UsageError(f"bad request: {e.errors()[0]['msg']}"))
        except Exception as e:  # keep the daemon up and tell the client
            result = error_body(StasisError(f"internal error: {type(e).__name__}: {e}"))
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
    req = await read_body(request, DumpRequest)
    caller = peer(request)
    job_id = request.match_info["job"]
    manager = request.app[MANAGER]
    return await _stream(request, lambda progress: manager.dump(job_id, req, caller, progress))


async def restore(request: web.Request) -> web.StreamResponse:
    req = await read_body(request, RestoreRequest)
    caller = peer(request)
    manager = request.app[MANAGER]
    return await _stream(request, lambda progress: manager.restore(req, caller, progress))


async def list_checkpoints(request: web.Request) -> web.StreamResponse:
    label = request.query.get("label")
    user = request.query.get("user")
    manager = request.app[MANAGER]
    caller = peer(request)
    # Each with its verdict of `stasis verify`, where one is recorded (daemon/verifying.py).
    return answer(
        await asyncio.to_thread(
            lambda: manager.verifier.verdicts(manager.checkpoints(label, caller, user))
        )
    )


async def verify_checkpoint(request: web.Request) -> web.StreamResponse:
    checkpoint = request.match_info["checkpoint"]
    return answer(await asyncio.to_thread(request.app[MANAGER].verify, checkpoint, peer(request)))


async def delete_checkpoint(request: web.Request) -> web.StreamResponse:
    checkpoint = request.match_info["checkpoint"]
    await asyncio.to_thread(request.app[MANAGER].delete_checkpoint, checkpoint, peer(request))
    return web.json_response({"deleted": checkpoint})


async def check_checkpoint(request: web.Request) -> web.StreamResponse:
    checkpoint = request.match_info["checkpoint"]
    return answer(
        await asyncio.to_thread(request.app[MANAGER].check_checkpoint, checkpoint, peer(request))
    )


async def collect_garbage(request: web.Request) -> web.StreamResponse:
    req = await read_body(request, GcRequest)
    return answer(
        await asyncio.to_thread(request.app[MANAGER].collect_garbage, peer(request), req.idle_s)
    )


async def rekey(request: web.Request) -> web.StreamResponse:
    return answer(await asyncio.to_thread(request.app[MANAGER].rekey, peer(request)))


async def network_locks(request: web.Request) -> web.StreamResponse:
    # The addresses and ports of every job's connections: root's to see.
    if not peer(request).is_root:
        raise PermissionDeniedError("permission denied: only root may list network locks")
    return answer(await asyncio.to_thread(request.app[MANAGER].netlocks.present))


async def check(request: web.Request) -> web.StreamResponse:
    manager = request.app[MANAGER]

    def report() -> Any:
        return run_check(manager.settings, manager.readiness_problems())

    return answer(await asyncio.to_thread(report))


def make_app(
    manager: JobManager, integrations: Sequence[Integration] = (), middlewares: Sequence[Any] = ()
) -> web.Application:
    """The API, with the routes of `integrations`; `middlewares` run inside the error handler
    (their refusals are JSON too)."""
    app = web.Application(middlewares=[errors, *middlewares])
    app[MANAGER] = manager
    app.add_routes(
        [
            web.post("/jobs", run_job),
            web.get("/jobs", list_jobs),
            web.get("/jobs/{job}", get_job),
            web.post("/jobs/{job}/kill", kill_job),
            web.post("/jobs/{job}/dump", dump_job),
            web.get("/jobs/{job}/dump-check", dump_check),
            web.post("/restore", restore),
            web.get("/checkpoints", list_checkpoints),
            web.delete("/checkpoints/{checkpoint}", delete_checkpoint),
            web.get("/checkpoints/{checkpoint}/check", check_checkpoint),
            web.post("/checkpoints/{checkpoint}/verify", verify_checkpoint),
            web.post("/checkpoints/gc", collect_garbage),
            web.post("/checkpoints/rekey", rekey),
            web.get("/check", check),
            web.get("/network-locks", network_locks),
        ]
    )
    for integration in integrations:
        integration.check_routes()
        app.add_routes(integration.routes())
    return app
