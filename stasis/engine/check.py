"""`stasis check`: is this node able to checkpoint and restore, and if not, what to do."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from stasis import wire
from stasis.config import Settings
from stasis.engine import kdat, netlock
from stasis.engine.criu import CRIU, MIN_VERSION, find_criu
from stasis.errors import StasisError


def run_check(settings: Settings, readiness: Sequence[wire.Problem] = ()) -> wire.CheckReport:
    """What this node lacks to checkpoint and restore; `readiness`: what the running daemon
    says keeps it from protecting its jobs now (JobManager.readiness_problems), each a problem
    (the node is not ready: `ok` false, `stasis check` exits non-zero)."""
    report = wire.CheckReport(
        ok=True,
        criu_path=None,
        criu_version=None,
        kernel=os.uname().release,
        features={},
        notes=[],
        problems=[],
        network_locks=[],
    )
    problems, notes = report["problems"], report["notes"]
    if os.geteuid() != 0:
        problems.append(
            wire.Problem(
                what="not running as root", fix="run `stasis check` as root (CRIU needs it)"
            )
        )
    try:
        path = find_criu(settings.criu)
        report["criu_path"] = path
        with tempfile.TemporaryDirectory(prefix="stasis-check-") as tmp:
            criu = CRIU(path, Path(tmp))
            version = criu.version()
            report["criu_version"] = ".".join(str(p) for p in version)
            if version[:2] < MIN_VERSION:
                problems.append(
                    wire.Problem(
                        what=f"CRIU {report['criu_version']} is too old (need >= 4.2 on kernels >= 6.16)",
                        fix="run `make install` to build CRIU 4.2 from Debian's source",
                    )
                )
            features = criu.features()
            report["features"] = {
                "mem_track": features.mem_track,
                "lazy_pages": features.lazy_pages,
            }
            if not features.mem_track:
                notes.append(
                    "no dirty-memory tracking (soft-dirty) in this kernel: "
                    "incremental dumps fall back to full ones"
                )
            if not features.lazy_pages:
                notes.append("no userfaultfd lazy pages: restores load all memory first")
            cache = kdat.cache_note()
            if cache:
                notes.append(cache)
            if os.geteuid() == 0:
                failure = criu.check("check.log")
                if failure:
                    problems.append(
                        wire.Problem(
                            what=f"criu check failed: {failure}",
                            fix="see the CRIU log; a newer kernel or " "CRIU may be needed",
                        )
                    )
    except StasisError as e:
        problems.append(wire.Problem(what=str(e), fix="run `make install`"))
    tools = [("tini", settings.tini or "tini"), ("iptables-restore", "iptables-restore")]
    for name, binary in tools:
        if not (os.access(binary, os.X_OK) or shutil.which(binary)):
            problems.append(
                wire.Problem(what=f"{name} is missing", fix=f"apt-get install {name.split('-')[0]}")
            )
    inits = (
        [settings.init]
        if settings.init
        else [
            "/usr/libexec/stasis/stasis-init",
            "/usr/local/libexec/stasis/stasis-init",
            str(Path(sys.executable).parent / "stasis-init"),
        ]
    )
    if not any(os.access(i, os.X_OK) for i in inits) and not shutil.which("stasis-init"):
        problems.append(
            wire.Problem(what="stasis-init (the jobs' init) is missing", fix="run `make install`")
        )
    if os.geteuid() == 0:
        report["network_locks"] = network_locks()
    problems.extend(readiness)
    report["ok"] = not problems
    return report


def network_locks() -> list[wire.NetworkLock]:
    """CRIU's lock rules in this node's firewall, not yet matched to checkpoints."""
    return [
        wire.NetworkLock(
            rule=saved,
            remove_with=netlock.remove_command(saved),
            checkpoint=None,
            job=None,
            release_at=None,
        )
        for saved in netlock.present()
    ]
