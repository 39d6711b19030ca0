"""A container's writable layer: what it wrote into its own filesystem, captured with its
checkpoint (a tar of the overlay's upper directory, whiteouts and opaque directories included)
and put back into the new container's root before CRIU restores it.

Putting it back runs in a child chrooted into the new root (`python -m stasis.k8s.rootfs apply
TAR ROOT`): a symlink in the image (`/lib -> /usr/lib`) must resolve inside the container,
never on the node.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

from stasis.errors import ContainerError

DIFF_NAME = "rootfs-diff.tar"
_OPAQUE_XATTR = "trusted.overlay.opaque"
_OPAQUE_PAX = "STASIS.overlay.opaque"


def upper_dir(rootfs: Path) -> Path | None:
    """The upper directory of the overlay mounted at `rootfs`, None when it is not an overlay."""
    target = str(rootfs)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: Path | None = None
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 10 or _unescape(fields[4]) != target:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3]
        found = None  # the last mount at that point is the one seen
        if fstype == "overlay":
            for opt in options.split(","):
                if opt.startswith("upperdir="):
                    found = Path(_unescape(opt.removeprefix("upperdir=")))
    return found


def _unescape(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def capture(rootfs: Path, out: Path) -> int:
    """Write the writable layer of the container rooted at `rootfs` to `out`; its size.

    ContainerError when the root is not an overlay (its writable layer cannot be told apart)."""
    upper = upper_dir(rootfs)
    if upper is None:
        raise ContainerError(f"the root of the container ({rootfs}) is not an overlay mount: its "
                             "writable layer cannot be captured (use the overlayfs snapshotter)")

    def mark(info: tarfile.TarInfo) -> tarfile.TarInfo:
        if info.isdir():
            try:
                if os.getxattr(upper / info.name, _OPAQUE_XATTR, follow_symlinks=False) == b"y":
                    info.pax_headers = {**info.pax_headers, _OPAQUE_PAX: "y"}
            except OSError:
                pass
        return info

    try:
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(os.listdir(upper)):
                tar.add(upper / entry, arcname=entry, filter=mark)
    except OSError as e:
        raise ContainerError(f"cannot capture the writable layer of the container: {e}") from e
    return out.stat().st_size


def apply(diff: Path, rootfs: Path, timeout_s: float = 300.0) -> None:
    """Put the layer captured in `diff` into the container root `rootfs` (chrooted child)."""
    try:
        with diff.open("rb") as f:
            r = subprocess.run([sys.executable, "-m", "stasis.k8s.rootfs", "apply", str(rootfs)],
                               stdin=f, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ContainerError(f"cannot put back the writable layer of the container: {e}") from e
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise ContainerError("cannot put back the writable layer of the container: "
                             + (lines[-1] if lines else f"exit {r.returncode}"))


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _apply_here(tar: tarfile.TarFile) -> None:
    """Inside the chroot: whiteouts delete, opaque directories are emptied, the rest extracts."""
    for member in tar:
        name = "/" + member.name.lstrip("./")
        if member.name in (".", "./"):
            continue
        if member.ischr() and member.devmajor == 0 and member.devminor == 0:
            _remove(name)
            continue
        if member.isdir() and member.pax_headers.get(_OPAQUE_PAX) == "y":
            _remove(name)
        elif not member.isdir():
            _remove(name)
        tar.extract(member, "/", set_attrs=True, numeric_owner=True)


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "apply":
        print("usage: python -m stasis.k8s.rootfs apply ROOT < diff.tar", file=sys.stderr)
        return 2
    stdin = os.fdopen(sys.stdin.fileno(), "rb", closefd=False)
    os.chroot(argv[1])
    os.chdir("/")
    with tarfile.open(fileobj=stdin, mode="r|") as tar:
        _apply_here(tar)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
