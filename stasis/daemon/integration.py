"""How an integration (Slurm today; Kubernetes and the control plane next) plugs into the daemon.

The daemon core knows no scheduler. Its entry point (`stasis daemon`: `stasis.cli.main`) names
the integrations to load and hands them to `serve`; each is a subclass of `Integration`:

    class SlurmIntegration(Integration):
        name = "slurm"                          # its routes live under /slurm/
        def __init__(self, manager): ...        # the JobManager: jobs, store, settings, db
        def tables(self): return [my_table]     # created in the daemon's SQLite database
        def prepare(self): ...                  # at start, after the tables exist (migrations)
        def routes(self): return routes.SLURM   # its declarations (stasis.routes), each
        def slurm_health(self, call): ...       # ...served by the method of its name
        models = {wire.RegisterRequest: RegisterRequest, ...}  # what validates each request
        def tasks(self): return [Task("sweep registrations", 60.0, self.sweep)]
        def job_intervals(self, caller): ...    # its jobs' periodic checkpoint intervals
        def close(self): ...                    # when the daemon stops

Its handlers are given a `stasis.daemon.http.Call` (the caller, as the declaration identifies
and allows them, the path's parameters, the validated body) and return the answer; a
StasisError raised in one becomes the same one-line JSON error as in the core's routes. Tasks
are blocking functions run in a worker thread every `interval_s`; one that raises is logged and
runs again next round. An integration uses the daemon only through the
JobManager's public methods and the modules of `stasis.daemon` (never another integration).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel
from sqlalchemy import Table

from stasis import wire
from stasis.routes import AnyRoute

if TYPE_CHECKING:
    from stasis.daemon.jobs import JobManager
    from stasis.daemon.users import Caller


@dataclass(frozen=True)
class Task:
    """Background work: `run` (blocking) in a thread, then again `interval_s` later."""

    name: str
    interval_s: float
    run: Callable[[], object]


class Integration:
    name: ClassVar[str]
    # The pydantic model validating each request typed dict of its routes.
    models: ClassVar[Mapping[object, type[BaseModel]]] = {}

    def __init__(self, manager: JobManager) -> None:
        self.manager = manager

    def tables(self) -> Sequence[Table]:
        return ()

    def prepare(self) -> None:
        """Called once at the daemon's start, after `tables()` exist, before any request."""

    def routes(self) -> Sequence[AnyRoute]:
        """Its routes (stasis.routes), each served by the method of this object of its name."""
        return ()

    def tasks(self) -> Sequence[Task]:
        return ()

    def job_intervals(self, caller: Caller) -> list[wire.JobInterval]:
        """The periodic checkpoint interval of each of its jobs that has one, as `caller` may
        see them (GET /intervals, `stasis ps`): the core lists them without knowing the
        integration."""
        return []

    def close(self) -> None:
        """Called once when the daemon stops."""

    def check_routes(self) -> None:
        """Every route of an integration lives under /<name>/: integrations never collide."""
        for route in self.routes():
            if not route.path.startswith(f"/{self.name}/"):
                raise ValueError(
                    f"integration {self.name}: route {route.path} is not under " f"/{self.name}/"
                )


__all__ = ["Integration", "Task"]
