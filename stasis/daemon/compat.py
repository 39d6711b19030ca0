"""Checked before restore: what a checkpoint's manifest says its restore depends on (`Requires`,
recorded at dump time), compared with the node that is about to restore it, before CRIU runs.

What refuses, and why (an experienced CRIU user's expectations):
- architecture differs: CRIU restores a process only on the architecture it ran on;
- a CPU flag the dumping CPU had is missing here: the process may use the instruction (CRIU's
  own cpuinfo check refuses the same, but only after fetching and unpacking the images);
- this node's CRIU is older than the dumping one: images may hold what it cannot read;
- the user is unknown here, or has another uid: the process would run as someone else;
- a file the job had open is missing; one it had open read-only has another size or
  modification time (the job would read other contents than it had); one it wrote is now
  shorter than when dumped (its offset would lie past the end).
What is only noted: another kernel (CRIU copies with any it supports), another stasis, another
CRIU that is not older, and a file the job writes that grew or was touched since (a job left
running goes on writing; the restored one resumes at its recorded offset).

There is no --force: every refusal is a restore CRIU would fail or one that would resume the
job on other data than it had.
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass
from typing import Literal

import stasis
from stasis.engine import proctree
from stasis.engine.nodefacts import Node, held_files, this_node
from stasis.errors import UsageError
from stasis.store import Manifest, OpenFile, Requires

Verdict = Literal["ok", "note", "refuses"]
_SHOWN_FLAGS = 8


class IncompatibleNodeError(UsageError):
    """The restoring node differs from the dumping one in a way the restore cannot cope with."""


@dataclass(frozen=True)
class Fact:
    what: str
    recorded: str
    here: str
    verdict: Verdict
    why: str = ""


def record(pid: int, skip: set[str]) -> Requires:
    """The facts of this node and of the tree under `pid`, for the manifest of its dump."""
    node = this_node()
    files = [OpenFile(path=f.path, size_bytes=f.size_bytes, mtime_ns=f.mtime_ns,
                      writable=f.writable) for f in held_files(proctree.tree(pid), skip)]
    return Requires(arch=node.arch, kernel=node.kernel, stasis_version=stasis.__version__,
                    cpu_flags=sorted(node.cpu_flags), files=files)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def compare(manifest: Manifest, criu_version: str, node: Node | None = None) -> list[Fact]:
    """Every recorded fact beside this node's, with its verdict; [] when the manifest records
    none (written by a stasis before these checks)."""
    req = manifest.requires
    if req is None:
        return []
    node = node or this_node()
    facts = [
        Fact("architecture", req.arch, node.arch,
             "ok" if req.arch == node.arch else "refuses",
             "" if req.arch == node.arch else "CRIU restores only on the architecture it ran on"),
        Fact("kernel", req.kernel, node.kernel, "ok" if req.kernel == node.kernel else "note"),
    ]
    missing = sorted(set(req.cpu_flags) - node.cpu_flags)
    shown = ", ".join(missing[:_SHOWN_FLAGS]) + (", ..." if len(missing) > _SHOWN_FLAGS else "")
    facts.append(Fact("CPU flags", f"{len(req.cpu_flags)} flags", f"{len(node.cpu_flags)} flags",
                      "refuses" if missing else "ok",
                      f"this CPU lacks {shown}" if missing else ""))
    older = _version(criu_version) < _version(manifest.criu_version)
    facts.append(Fact("CRIU", manifest.criu_version, criu_version,
                      "refuses" if older else "ok" if criu_version == manifest.criu_version
                      else "note",
                      f"CRIU {criu_version} here is older than {manifest.criu_version}, which "
                      "wrote the images" if older else ""))
    facts.append(Fact("stasis", req.stasis_version, stasis.__version__,
                      "ok" if req.stasis_version == stasis.__version__ else "note"))
    try:
        here_uid: int | None = pwd.getpwnam(manifest.user).pw_uid
    except KeyError:
        here_uid = None
    facts.append(Fact("user", f"{manifest.user} (uid {manifest.uid})",
                      "missing" if here_uid is None else f"{manifest.user} (uid {here_uid})",
                      "ok" if here_uid == manifest.uid else "refuses",
                      "" if here_uid == manifest.uid else
                      f"user {manifest.user} does not exist on this node" if here_uid is None
                      else f"user {manifest.user} has uid {here_uid} here"))
    facts += [_file_fact(f) for f in req.files]
    return facts


def _file_fact(f: OpenFile) -> Fact:
    import os

    recorded = f"{f.size_bytes} bytes"
    try:
        st = os.stat(f.path)
    except OSError:
        return Fact(f"file {f.path}", recorded, "missing", "refuses",
                    f"{f.path} (open in the job) is missing")
    here = f"{st.st_size} bytes"
    if f.writable:
        if st.st_size < f.size_bytes:
            return Fact(f"file {f.path}", recorded, here, "refuses",
                        f"{f.path} is {st.st_size} bytes, was {f.size_bytes} when dumped "
                        "(the job writes it: it would resume past its end)")
        changed = st.st_size != f.size_bytes or st.st_mtime_ns != f.mtime_ns
        return Fact(f"file {f.path}", recorded, here, "note" if changed else "ok")
    if st.st_size != f.size_bytes:
        return Fact(f"file {f.path}", recorded, here, "refuses",
                    f"{f.path} is {st.st_size} bytes, was {f.size_bytes} when dumped")
    if st.st_mtime_ns != f.mtime_ns:
        return Fact(f"file {f.path}", recorded, here + " (modified since)", "refuses",
                    f"{f.path} was modified since the dump")
    return Fact(f"file {f.path}", recorded, here, "ok")


def check_restorable(manifest: Manifest, criu_version: str) -> list[Fact]:
    """`compare`, raising IncompatibleNodeError naming every refusal in one line."""
    facts = compare(manifest, criu_version)
    refusals = [f.why for f in facts if f.verdict == "refuses"]
    if refusals:
        raise IncompatibleNodeError(
            f"cannot restore checkpoint {manifest.id} on this node: {'; '.join(refusals)} "
            f"(`stasis check --checkpoint {manifest.id}` compares everything)")
    return facts
