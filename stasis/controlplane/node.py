"""The node side of the control plane: a daemon integration that joins this node to the control
plane its settings name (`controlplane_url`, `auth_token`, `cluster_id`). It connects out, never
listens: it registers (host, versions, `stasis check`), then heartbeats every
`controlplane_heartbeat_s` with the number of running jobs; registered again whenever the control
plane no longer knows the node (a new database, a restart without it). The token is never logged.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from stasis.controlplane.client import ControlPlaneClient
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.users import Caller
from stasis.errors import NotFoundError, StasisError

log = logging.getLogger("stasis.daemon")
_ROOT = Caller(pid=0, uid=0, gid=0)
# Every this many heartbeats the node's check runs again and is reported (a register).
_CHECK_EVERY = 30


class ControlPlaneNode(Integration):
    name = "controlplane"

    def __init__(self, manager: JobManager) -> None:
        super().__init__(manager)
        s = manager.settings
        self.client = ControlPlaneClient(s.controlplane_url, s.auth_token, timeout_s=10) \
            if s.controlplane_url else None
        self._beats = 0
        self._registered = False
        self._failing: str | None = None

    def tasks(self) -> Sequence[Task]:
        if self.client is None:
            return ()
        return [Task("report to the control plane", self.manager.settings.controlplane_heartbeat_s,
                     self.beat)]

    def report(self) -> dict[str, Any]:
        from stasis.engine.check import run_check

        s = self.manager.settings
        check = run_check(s)
        return {"name": s.node, "cluster_id": s.cluster_id or None,
                "host": socket.gethostname(), "stasis_version": version("stasis"),
                "criu_version": check["criu_version"], "slurm_version": _slurm_version(),
                "check_ok": check["ok"],
                "problems": [f"{p['what']} ({p['fix']})" for p in check["problems"]],
                "jobs": self._running()}

    def _running(self) -> int:
        return sum(1 for j in self.manager.jobs(_ROOT) if j["state"] == "running")

    def beat(self) -> None:
        assert self.client is not None
        try:
            if not self._registered or self._beats % _CHECK_EVERY == 0:
                self.client.request("POST", "/api/v1/nodes/register", self.report())
                if not self._registered:
                    log.info("joined the control plane at %s as node %s", self.client.url,
                             self.manager.settings.node)
                self._registered = True
            else:
                self.client.request("POST", f"/api/v1/nodes/{self.manager.settings.node}"
                                    "/heartbeat", {"jobs": self._running()})
            self._beats += 1
            if self._failing is not None:
                log.info("the control plane answers again")
                self._failing = None
        except NotFoundError:
            self._registered = False  # it forgot us: register at the next beat
        except StasisError as e:
            if str(e) != self._failing:  # once per new problem, not every heartbeat
                log.warning("control plane: %s", e)
                self._failing = str(e)


def _slurm_version() -> str | None:
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    try:
        out = subprocess.run([sinfo, "--version"], capture_output=True, text=True, timeout=5,
                             check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[-1] if out else None
