"""Measure a committed stasis instead of the working tree (`--stasis-ref REF`).

Others edit stasis/ while a long suite runs; the CLI and every job's shim import stasis afresh,
so a suite against the working tree may measure a mix of versions. A snapshot is `git archive
REF stasis` plus the generated CRIU RPC classes, run by a bare venv whose path holds the snapshot
first and the project venv's site-packages after it: the project's editable install (a meta-path
finder set up by a .pth file) is not loaded there, so nothing resolves to the working tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def snapshot(ref: str, into: Path) -> tuple[str, str]:
    """Build the snapshot under `into`; return (its `stasis` command, the commit measured)."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "stasis"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.copytree(
        ROOT / "stasis" / "engine" / "_proto",
        src / "stasis" / "engine" / "_proto",
        dirs_exist_ok=True,
    )
    # Compiled now: with PYTHONDONTWRITEBYTECODE set (as on these machines) every CLI call and
    # every job supervisor would compile stasis again, ~30 ms that no installed copy pays.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "stasis")], check=True)
    venv = into / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    project_site = Path(sysconfig.get_paths()["purelib"])
    (purelib / "stasis_snapshot.pth").write_text(f"{src}\n{project_site}\n")
    stasis = venv / "bin" / "stasis"
    stasis.write_text(
        f"#!{venv / 'bin' / 'python'}\n"
        "import sys\nfrom stasis.cli.main import main\nsys.exit(main())\n"
    )
    os.chmod(stasis, 0o755)
    return str(stasis), commit
