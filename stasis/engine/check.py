"""`stasis check`: is this node able to checkpoint and restore, and if not, what to do."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel

from stasis.config import Settings
from stasis.engine import kdat, netlock
from stasis.engine.criu import CRIU, MIN_VERSION, find_criu
from stasis.errors import StasisError


class Problem(BaseModel):
    what: str
    fix: str


class NetworkLock(BaseModel):
    """A rule of CRIU's network lock in this node's firewall (stasis/engine/netlock.py)."""

    rule: str  # as iptables-save prints it
    remove_with: str  # the command that takes it out by hand
    # The checkpoint it is held for, as the daemon knows it; None: nobody's, or not asked.
    checkpoint: str | None = None
    job: str | None = None
    release_at: str | None = None  # when the daemon lifts it unless a restore or rm does first


class CheckReport(BaseModel):
    ok: bool
    criu_path: str | None = None
    criu_version: str | None = None
    kernel: str
    features: dict[str, bool] = {}
    notes: list[str] = []
    problems: list[Problem] = []
    network_locks: list[NetworkLock] = []


def run_check(settings: Settings) -> CheckReport:
    report = CheckReport(ok=True, kernel=os.uname().release)
    if os.geteuid() != 0:
        report.problems.append(Problem(what="not running as root",
                                       fix="run `stasis check` as root (CRIU needs it)"))
    try:
        path = find_criu(settings.criu)
        report.criu_path = path
        with tempfile.TemporaryDirectory(prefix="stasis-check-") as tmp:
            criu = CRIU(path, Path(tmp))
            version = criu.version()
            report.criu_version = ".".join(str(p) for p in version)
            if version[:2] < MIN_VERSION:
                report.problems.append(Problem(
                    what=f"CRIU {report.criu_version} is too old (need >= 4.2 on kernels >= 6.16)",
                    fix="run `make install` to build CRIU 4.2 from Debian's source"))
            features = criu.features()
            report.features = {"mem_track": features.mem_track, "lazy_pages": features.lazy_pages}
            if not features.mem_track:
                report.notes.append("no dirty-memory tracking (soft-dirty) in this kernel: "
                                    "incremental dumps fall back to full ones")
            if not features.lazy_pages:
                report.notes.append("no userfaultfd lazy pages: restores load all memory first")
            cache = kdat.cache_note()
            if cache:
                report.notes.append(cache)
            if os.geteuid() == 0:
                failure = criu.check("check.log")
                if failure:
                    report.problems.append(Problem(what=f"criu check failed: {failure}",
                                                   fix="see the CRIU log; a newer kernel or "
                                                       "CRIU may be needed"))
    except StasisError as e:
        report.problems.append(Problem(what=str(e), fix="run `make install`"))
    tools = [("tini", settings.tini or "tini"), ("iptables-restore", "iptables-restore")]
    for name, binary in tools:
        if not (os.access(binary, os.X_OK) or shutil.which(binary)):
            report.problems.append(Problem(what=f"{name} is missing",
                                           fix=f"apt-get install {name.split('-')[0]}"))
    inits = [settings.init] if settings.init else [
        "/usr/local/libexec/stasis/stasis-init", str(Path(sys.executable).parent / "stasis-init")]
    if not any(os.access(i, os.X_OK) for i in inits) and not shutil.which("stasis-init"):
        report.problems.append(Problem(what="stasis-init (the jobs' init) is missing",
                                       fix="run `make install`"))
    if os.geteuid() == 0:
        report.network_locks = network_locks()
    report.ok = not report.problems
    return report


def network_locks() -> list[NetworkLock]:
    """CRIU's lock rules in this node's firewall, not yet matched to checkpoints."""
    return [NetworkLock(rule=saved, remove_with=netlock.remove_command(saved))
            for saved in netlock.present()]
