"""What every route of the daemon, an integration's too, does with a request: the one adapter
that serves the declarations of stasis.routes (`add_routes`): who is calling (from the socket,
never from the request; or from a credential the route's body carries), refused at once where
the declaration says root only, the body read and validated with the pydantic model paired
with its typed dict, the handler named after the route called (a blocking one in a worker
thread), the answer written, or streamed as NDJSON; every error as one JSON line (`errors`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from stasis.daemon.users import Caller
from stasis.errors import PermissionDeniedError, StasisError, UsageError, wire_name
from stasis.routes import AnyRoute

M = TypeVar("M", bound=BaseModel)
B = TypeVar("B")

log = logging.getLogger("stasis.daemon")

# Who the socket's peer credentials identify (the others carry their identity in the body).
PEER_CALLERS = frozenset({"local", "owner", "launcher", "root"})
# Who must be root, whoever identified them.
ROOT_CALLERS = frozenset({"root", "cluster-root"})


def peer(request: web.Request) -> Caller:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None:
        raise UsageError("cannot identify the caller")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Caller(pid=pid, uid=uid, gid=gid)


async def read_body(request: web.Request, model: type[M]) -> M:
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
                    raise UsageError(
                        f"bad request: a name in {where or 'the request'} contains "
                        "a NUL character (\\0); no name can hold one"
                    )
                todo.append((path, value))
        elif isinstance(item, list):
            todo.extend((f"{where}.{i}" if where else str(i), v) for i, v in enumerate(item))
        elif isinstance(item, str) and "\0" in item:
            raise UsageError(
                f"bad request: {where or 'request'} contains a NUL character "
                "(\\0); no argument, path or variable can hold one"
            )


def error_body(e: StasisError) -> dict[str, Any]:
    """What every route answers for an error: {"error": {"type", "message"}} (one line)."""
    return {"error": {"type": wire_name(e), "message": str(e)}}


def wire(model: BaseModel | Mapping[str, Any] | list[Any]) -> Any:
    """The JSON value of an answer: a model, a typed dict of stasis/wire.py, or a list."""
    if isinstance(model, list):
        return [wire(m) for m in model]
    if isinstance(model, BaseModel):
        return model.model_dump(mode="json")
    return model


def answer(model: BaseModel | Mapping[str, Any] | list[Any]) -> web.Response:
    return web.json_response(wire(model))


# -- the adapter: routes served from their declarations ------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Call(Generic[B]):
    """What a route's handler is given: its declaration, who calls (as the declaration's
    `caller` identifies them), the path's parameters by name, the query, the validated body
    (None for a route that reads none)."""

    route: AnyRoute
    caller: Caller
    args: Mapping[str, str]
    query: Mapping[str, str]
    body: B


# How the callers of routes that carry their identity (munge's "cluster-*") are identified:
# given the route, the request and its validated body (blocking: run in a thread).
Identify = Callable[[AnyRoute, web.Request, Any], Caller]


def _no_identity(route: AnyRoute, request: web.Request, body: Any) -> Caller:
    raise UsageError(f"{route.method} {route.path}: nothing identifies its caller here")


def add_routes(
    app: web.Application,
    routes: Sequence[AnyRoute],
    handlers: object,
    models: Mapping[object, type[BaseModel]],
    identify: Identify = _no_identity,
) -> None:
    """Serve each of `routes` with the method of `handlers` of its name: `(call) -> answer`,
    or `(call, progress) -> answer` for a streamed route; blocking, or a coroutine function.
    `models`: the pydantic model that validates each request typed dict. A route without its
    handler, or a handler without its route, stops the daemon's start."""
    names = {r.name for r in routes}
    if len(names) != len(routes):
        raise ValueError(f"two routes of {type(handlers).__name__} share a name")
    for route in routes:
        fn = getattr(handlers, route.name, None)
        if not callable(fn):
            raise ValueError(f"route {route.name} ({route.method} {route.path}): no handler")
        model = models[route.request] if route.request is not None else None
        app.router.add_route(route.method, route.path, _endpoint(route, fn, model, identify))


async def identify_caller(
    route: AnyRoute, request: web.Request, model: type[BaseModel] | None, identify: Identify
) -> tuple[Caller, Any]:
    """The caller, allowed by the route's declaration, and the request's validated body."""
    if route.caller in PEER_CALLERS:
        caller = peer(request)
        _allow(route, caller)  # before reading anything a stranger sent
        body = await read_body(request, model) if model is not None else None
        return caller, body
    body = await read_body(request, model) if model is not None else None
    caller = await asyncio.to_thread(identify, route, request, body)
    _allow(route, caller)
    return caller, body


def _allow(route: AnyRoute, caller: Caller) -> None:
    if route.caller in ROOT_CALLERS and not caller.is_root:
        asked = "" if route.caller in PEER_CALLERS else f" (uid {caller.uid} asked)"
        raise PermissionDeniedError(f"permission denied: {route.denied}{asked}")


def _endpoint(
    route: AnyRoute,
    fn: Callable[..., Any],
    model: type[BaseModel] | None,
    identify: Identify,
) -> Handler:
    is_async = inspect.iscoroutinefunction(fn)

    async def endpoint(request: web.Request) -> web.StreamResponse:
        caller, body = await identify_caller(route, request, model, identify)
        call = Call(
            route=route,
            caller=caller,
            args=dict(request.match_info),
            query=dict(request.query),
            body=body,
        )
        if route.streamed:
            return await stream(request, lambda progress: fn(call, progress))
        if is_async:
            return answer(await fn(call))
        return answer(await asyncio.to_thread(fn, call))

    endpoint.__name__ = route.name
    return endpoint


async def stream(
    request: web.Request, work: Callable[[Progress], Mapping[str, Any]]
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


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error of every route, as {"error": {"type", "message"}} with a fitting status."""
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
