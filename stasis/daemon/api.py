"""The daemon's HTTP/JSON API, served on a unix socket: the handlers of the core's routes
(stasis.routes.CORE), one method per route, named after it; stasis.daemon.http serves them.

Who calls is taken from the socket (SO_PEERCRED), never from the request. Errors answer
{"error": {"type": <StasisError subclass>, "message": <one line>}} with a fitting status.
Dumps and restores stream NDJSON: {"progress": {...}} lines, then one {"result": ...} or
{"error": ...} line, so that a client on a terminal can draw progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from stasis import routes, wire
from stasis.daemon import models
from stasis.daemon.http import Call, Progress, add_routes, errors
from stasis.daemon.integration import Integration
from stasis.daemon.jobs import JobManager
from stasis.daemon.stopping import stop
from stasis.engine.check import run_check

__all__ = ["CoreRoutes", "errors", "make_app"]


class CoreRoutes:
    """The core's handlers: `manager`'s work, as each route asks it."""

    def __init__(self, manager: JobManager, integrations: Sequence[Integration] = ()) -> None:
        self.manager = manager
        self.integrations = tuple(integrations)

    def run(self, call: Call[models.RunRequest]) -> wire.RunAnswer:
        return self.manager.run(call.body, call.caller)

    def jobs(self, call: Call[None]) -> list[wire.Job]:
        return self.manager.jobs(call.caller)

    def job(self, call: Call[None]) -> wire.Job:
        return self.manager.get(call.args["job"], call.caller)

    async def kill(self, call: Call[models.KillRequest]) -> wire.KillAnswer:
        return await stop(self.manager, call.args["job"], call.caller, call.body)

    def dump_check(self, call: Call[None]) -> wire.DumpCheckAnswer:
        return self.manager.dump_check(call.args["job"], call.caller)

    def dump(self, call: Call[models.DumpRequest], progress: Progress) -> wire.DumpAnswer:
        return self.manager.dump(call.args["job"], call.body, call.caller, progress)

    def freeze(self, call: Call[models.FreezeRequest]) -> wire.FreezeAnswer:
        return self.manager.dumper.freeze(call.args["job"], call.body, call.caller)

    def thaw(self, call: Call[models.ThawRequest]) -> wire.ThawAnswer:
        return self.manager.dumper.thaw(call.args["job"], call.body, call.caller)

    def restore(self, call: Call[models.RestoreRequest], progress: Progress) -> wire.RestoreAnswer:
        return self.manager.restorer.restore(call.body, call.caller, progress)

    def checkpoints(self, call: Call[None]) -> list[dict[str, Any]]:
        m = self.manager
        found = m.checkpoints(call.query.get("label"), call.caller, call.query.get("user"))
        # Each with its verdict of `stasis verify`, where one is recorded (daemon/verifying.py).
        return m.verifier.verdicts(found)

    def delete_checkpoint(self, call: Call[None]) -> wire.Deleted:
        checkpoint = call.args["checkpoint"]
        self.manager.delete_checkpoint(checkpoint, call.caller)
        return wire.Deleted(deleted=checkpoint)

    def check_checkpoint(self, call: Call[None]) -> wire.CheckpointCheck:
        return self.manager.check_checkpoint(call.args["checkpoint"], call.caller)

    def verify(self, call: Call[None]) -> wire.VerifyVerdict:
        return self.manager.verify(call.args["checkpoint"], call.caller)

    def collect_garbage(self, call: Call[models.GcRequest]) -> wire.GcAnswer:
        return self.manager.collect_garbage(call.caller, call.body.idle_s)

    def rekey(self, call: Call[None]) -> wire.RekeyAnswer:
        return self.manager.rekey(call.caller)

    def check(self, call: Call[None]) -> Any:
        return run_check(self.manager.settings, self.manager.readiness_problems())

    def network_locks(self, call: Call[None]) -> list[wire.NetworkLock]:
        return self.manager.netlocks.present()

    def intervals(self, call: Call[None]) -> list[wire.JobInterval]:
        # Each integration says which of its jobs the caller may see (Integration.job_intervals).
        return [i for n in self.integrations for i in n.job_intervals(call.caller)]


def make_app(
    manager: JobManager, integrations: Sequence[Integration] = (), middlewares: Sequence[Any] = ()
) -> web.Application:
    """The API, with the routes of `integrations`; `middlewares` run inside the error handler
    (their refusals are JSON too)."""
    app = web.Application(middlewares=[errors, *middlewares])
    add_routes(app, routes.CORE, CoreRoutes(manager, integrations), models.BY_WIRE)
    for integration in integrations:
        integration.check_routes()
        add_routes(app, integration.routes(), integration, integration.models)
    return app
