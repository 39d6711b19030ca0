"""`stasis --version [--json]`: what a bug report or a compatibility question needs first."""

from __future__ import annotations

import platform
import re
import subprocess

from stasis import __version__
from stasis.cli import output
from stasis.config import Settings
from stasis.engine.criu import find_criu
from stasis.errors import CRIUNotFoundError


def _criu(settings: Settings) -> tuple[str | None, str | None]:
    """CRIU's path and version as `criu --version` says them (no RPC: no root needed)."""
    try:
        path = find_criu(settings.criu)
    except CRIUNotFoundError:
        return None, None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return path, None
    found = re.search(r"Version:\s*(\S+)", out)
    return path, found.group(1) if found else None


def print_version(as_json: bool, settings: Settings) -> None:
    if not as_json:
        output.plain(f"stasis {__version__}")
        return
    criu_path, criu_version = _criu(settings)
    output.emit_json(
        {
            "stasis": __version__,
            "python": platform.python_version(),
            "criu": criu_version,
            "criu_path": criu_path,
            "kernel": platform.release(),
        }
    )
