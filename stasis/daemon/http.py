"""What every route of the daemon, an integration's too, does with a request: who is calling
(from the socket, never from the request), the body read and validated, the answer written."""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from stasis.daemon.users import Caller
from stasis.errors import StasisError, UsageError, wire_name

M = TypeVar("M", bound=BaseModel)


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
