"""What the node agent puts on the host so that containerd's shim can run stasis-runc, and
runc our CRIU, there: the agent's own Python, stasis and CRIU, with every shared library they
link, started through the bundled dynamic loader. Nothing of the host's libraries is used
(any glibc host can run it, whatever its distribution) and nothing goes into the host's system
directories but this one.

    <dest>/lib/            the libraries (ldd's closure) and the loader
    <dest>/python/         Python's executable and standard library (PYTHONHOME), whose
                           sitecustomize adds site-packages
    <dest>/site-packages/  stasis and its dependencies
    <dest>/sbin/criu       our CRIU (4.2 with the patches)
    <dest>/bin/stasis-runc, <dest>/bin/criu, <dest>/bin/python: what the shim and runc run
    <dest>/STAMP           what it was made from; the same stamp: nothing is copied again
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from stasis.errors import ContainerError

LOADER = "ld-linux-x86-64.so.2"


def _ldd(paths: list[Path]) -> set[Path]:
    """The shared libraries `paths` load (the loader included), as resolved here."""
    found: set[Path] = set()
    for p in paths:
        r = subprocess.run(["ldd", str(p)], capture_output=True, text=True, check=False)
        for line in r.stdout.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1:
                lib = parts[parts.index("=>") + 1]
                if lib.startswith("/"):
                    found.add(Path(lib))
            elif parts and parts[0].startswith("/"):
                found.add(Path(parts[0]))  # the loader
    return found


def _runtime_files() -> set[Path]:
    """The installed files of stasis and of what it requires (not its dev tools), relative
    to site-packages."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution

    seen: set[str] = set()
    files: set[Path] = set()
    todo = ["stasis"]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement for another platform or Python
        if name != "stasis":  # stasis itself is copied from where it is imported from
            files.update(Path(str(f)) for f in dist.files or [])
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
            if m:
                todo.append(m.group(0))
    return files


def _stamp(criu: Path) -> str:
    from importlib.metadata import version

    st = criu.stat()
    return (
        f"stasis {version('stasis')} python {sys.version.split()[0]} {sys.executable} "
        f"criu {st.st_size} {int(st.st_mtime)}\n"
    )


def install(dest: Path, criu: Path, seen_as: Path | None = None) -> bool:
    """Make `dest` the bundle (atomically: built beside it, then renamed into place); False
    when it is already the bundle of this very stasis and CRIU. `seen_as`: the path the host
    knows `dest` by (the agent sees the host's root mounted elsewhere)."""
    stamp = _stamp(criu)
    if (dest / "STAMP").exists() and (dest / "STAMP").read_text() == stamp:
        return False
    python = Path(sys.executable).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    tmp = dest.with_name(dest.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pyname = f"python{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copytree(
        stdlib,
        tmp / "python" / "lib" / pyname,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            "test", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages"
        ),
    )
    (tmp / "python" / "bin").mkdir()
    shutil.copy2(python, tmp / "python" / "bin" / pyname)
    for rel in _runtime_files():
        src = site / rel
        if rel.is_absolute() or ".." in rel.parts or not (src.is_file() or src.is_symlink()):
            continue  # console scripts (../../bin), files no longer there
        (tmp / "site-packages" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, tmp / "site-packages" / rel, follow_symlinks=False)
    # The package itself, also when this is an editable install (a checkout).
    import stasis

    shutil.copytree(Path(stasis.__file__).parent, tmp / "site-packages" / "stasis", symlinks=True)
    (tmp / "sbin").mkdir()
    shutil.copy2(criu, tmp / "sbin" / "criu")
    objects = [
        python,
        criu,
        *(tmp / "python").rglob("*.so"),
        *(tmp / "site-packages").rglob("*.so*"),
    ]
    (tmp / "lib").mkdir()
    libs = _ldd([p for p in objects if p.is_file()])
    if not any(lib.name == LOADER for lib in libs):
        raise ContainerError(
            f"no {LOADER} among the libraries of {python}: only x86-64 " "glibc nodes are supported"
        )
    for lib in libs:
        shutil.copy2(lib.resolve(), tmp / "lib" / lib.name)
    # Python finds the packages (and runs their .pth files, as in a venv) through its
    # sitecustomize; Debian's own is a link into /etc, which the host may not have.
    custom = tmp / "python" / "lib" / pyname / "sitecustomize.py"
    custom.unlink(missing_ok=True)
    custom.write_text(
        "# Written by stasis (stasis/k8s/hostbundle.py).\nimport site\n"
        f"site.addsitedir({str((seen_as or dest) / 'site-packages')!r})\n"
    )
    _write_wrappers(tmp, seen_as or dest, pyname)
    (tmp / "STAMP").write_text(stamp)
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _write_wrappers(tmp: Path, dest: Path, pyname: str) -> None:
    q = shlex.quote
    run = f"{q(str(dest / 'lib' / LOADER))} --library-path {q(str(dest / 'lib'))}"
    env = f"PYTHONHOME={q(str(dest / 'python'))} PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1"
    python = f"{env} exec {run} {q(str(dest / 'python' / 'bin' / pyname))}"
    scripts = {
        "python": f'{python} "$@"\n',
        "stasis-runc": f"{python} -c 'from stasis.k8s.runtime import main; main()' \"$@\"\n",
        "criu": f'exec {run} {q(str(dest / "sbin" / "criu"))} "$@"\n',
    }
    (tmp / "bin").mkdir()
    for name, body in scripts.items():
        path = tmp / "bin" / name
        path.write_text("#!/bin/sh\n# Written by stasis (stasis/k8s/hostbundle.py).\n" + body)
        os.chmod(path, 0o755)
