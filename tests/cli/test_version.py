"""`stasis --version`: the package's version, and with --json what a bug report needs."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

from tests.conftest import STASIS

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_packages() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = subprocess.run([STASIS, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout == f"stasis {declared}\n"


def test_version_json_names_criu_python_and_kernel_for_any_user() -> None:
    out = subprocess.run(
        ["runuser", "-u", "stasis-test", "--", STASIS, "--version", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    info = json.loads(out.stdout)
    criu = subprocess.run(
        [info["criu_path"], "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"Version: {info['criu']}" in criu
    python = subprocess.run(
        [
            str(Path(STASIS).parent / "python"),
            "-c",
            "import platform; print(platform.python_version())",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert (info["python"], info["kernel"]) == (python, os.uname().release)
