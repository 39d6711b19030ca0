"""Restoring a job's tree as its owner would have it: the one path that prepares and runs CRIU's
restore, for the daemon's job supervisor (stasis/daemon/jobsupervisor.py) and for a Slurm job's
task (stasis/slurm/taskinit.py) alike.

CRIU runs as root. What the job writes its output to is reopened here with the owner's rights
(the path may be the user's choice, and a log may have grown since the dump: CRIU would refuse
it by size) and handed to CRIU as inherit_fd; every other path of the job (its files, cwd,
mappings, socket addresses) CRIU resolves with the owner's rights too (`Owner`, CRIU patch 0003).

Before CRIU runs, the facts the checkpoint recorded at dump time (architecture, CPU flags, CRIU
version, user, open files...) are compared with this node (stasis/engine/nodefacts.py): a
difference CRIU cannot cope with refuses the restore, naming it, with nothing restored.
"""

from __future__ import annotations

import errno
import os
import pwd
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from stasis import wire
from stasis.engine import credentials, netidentity, nodefacts, nodelocal, privatetmp, rpc
from stasis.engine.criu import CRIU, Owner, RestoreOptions, RestoreResult
from stasis.errors import CRIUError, IncompatibleNodeError, OwnerDeniedError, RestoreError


def open_as(path: str, owner: Owner, umask: int = 0o022) -> int:
    """Open `path` for appending with `owner`'s rights (their groups too: root's supplementary
    groups would open what theirs could not); a file it creates is theirs, made under `umask`.
    Returns the fd; the caller closes it."""
    saved = os.getgroups()
    os.setgroups(list(owner.groups))
    os.setegid(owner.gid)
    os.seteuid(owner.uid)
    old_umask = os.umask(umask)
    try:
        return os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOCTTY | os.O_CLOEXEC, 0o644
        )
    finally:
        os.umask(old_umask)
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(saved)


def restore_tree(
    criu: CRIU,
    images: Path,
    owner: Owner,
    outputs: Sequence[tuple[str, str]],
    log_name: str,
    *,
    umask: int = 0o022,
    lazy: bool = False,
    notify: rpc.NotifyHandler | None = None,
    page_server: Path | None = None,
    stream: bool = False,
    on_lost: Callable[[str], None] | None = None,
    expect: wire.RestoreFacts | None = None,
    checkpoint: str = "",
    criu_version: str | None = None,
    sandboxed: bool = False,
    own_mounts: bool = False,
    caller_cgroups: bool = False,
    job_netns_fd: int | None = None,
    external_files: Mapping[str, privatetmp.ExternalFile] | None = None,
) -> RestoreResult:
    """Restore the tree in `images` as a child of the caller (rst_sibling), its paths resolved
    with `owner`'s rights (root's own jobs: root's). `outputs`: (path in the images, path to
    write to now) for each output file to re-point, e.g. a log, or a Slurm job's --output under
    this run's name; each is opened with the owner's rights. RestoreError if one cannot be opened.

    `page_server`: lazily, with the lazy pages served on that unix socket (RestoreOptions);
    `on_lost`: told why before the tree is killed for a page server that went away.
    `stream`: `images` holds an image streamer's socket that serves the images
    (engine/streamer.py).

    `expect`: what checkpoint `checkpoint` recorded of the node that dumped it (its manifest's
    `restore_facts`; None for checkpoints that predate them): IncompatibleNodeError, before
    CRIU runs, when this node differs in a way the restore cannot cope with. The notes among
    the differences come back in `RestoreResult.notes`. `criu_version`: `criu`'s, when the
    caller knows it already. `sandboxed`: for `stasis verify` (RestoreOptions.sandboxed).
    `own_mounts`: the images hold the tree's own mount namespace (a private /tmp,
    engine/privatetmp.py). `caller_cgroups`: the tree comes back in the caller's cgroups
    (RestoreOptions.caller_cgroups). `job_netns_fd`: the job's network namespace on this node,
    open (RestoreOptions.job_netns_fd). `external_files`: the output files its dump declared
    external, by path (engine/privatetmp.py: what its manifest records)."""
    if owner.uid != 0:
        # CRIU (root) gives back whatever credentials the images record: a user's tree must not
        # come back holding more than its owner (a setuid program a dump of older stasis, or
        # of a node this one trusts, let through).
        held = credentials.images_excess(images, owner.uid, [owner.gid, *owner.groups])
        if held:
            raise OwnerDeniedError(
                f"checkpoint {checkpoint or images} refused: {held[0]}"
                f"{f' (and {len(held) - 1} more)' if len(held) > 1 else ''}, more than its "
                f"owner {_name(owner.uid)} has, and a restore would give that back; only root "
                "may restore it"
            )
    # The node-local files the checkpoint carries (engine/nodelocal.py): what this node lacks
    # is decided here, before anything is written, and made before CRIU reopens it.
    try:
        carried = nodelocal.prepare(images / nodelocal.ARCHIVE_NAME, owner.uid)
    except nodelocal.NodeLocalError as e:
        raise IncompatibleNodeError(
            f"cannot restore checkpoint {checkpoint or images} on this node: {e}; nothing "
            "was restored"
        ) from e
    found: list[wire.CompatFact] = []
    if expect is not None:
        # The caller is single-threaded (a supervisor, a Slurm task's helper): the files are
        # looked at with the owner's rights, as CRIU will reopen them.
        found = nodefacts.require(
            checkpoint or str(images),
            expect,
            criu,
            owner,
            skip=[old for old, _ in outputs],
            known_criu_version=criu_version,
            travels=carried.paths if carried else (),
        )
    made: list[str] = []
    if carried is not None:
        try:
            made = carried.apply()
        except nodelocal.NodeLocalError as e:
            raise IncompatibleNodeError(
                f"cannot restore checkpoint {checkpoint or images} on this node: {e}"
            ) from e
    # Its TCP connections on this node: kept, restored closed (a move), or refused (a socket
    # bound to the old node's address). A sandbox has a network of its own: not its concern.
    # Nor is a tree in its job's network: its namespace is made again with the same addresses
    # wherever it goes, and reaches nothing but the job's other parts, which are restored with
    # it (the plan would take those peers, in other parts' images, for the outside world).
    network = (
        netidentity.Plan()
        if sandboxed or job_netns_fd is not None
        else netidentity.plan(images, checkpoint or str(images), criu.path)
    )
    fds: list[int] = []
    try:
        inherit = []
        for old, new in outputs:
            try:
                fds.append(open_as(new, owner, umask))
            except OSError as e:
                raise RestoreError(
                    f"cannot open the job's output {new} as {_name(owner.uid)}: "
                    f"{e.strerror}; nothing was restored"
                ) from e
            key = privatetmp.hand_over(old, fds[-1], external_files or {}, owner.uid)
            inherit.append((key, fds[-1]))
        options = RestoreOptions(
            inherit_fds=inherit,
            lazy=lazy,
            notify=notify,
            page_server=page_server,
            stream=stream,
            on_lost=on_lost,
            owner=owner if owner.uid != 0 else None,
            sandboxed=sandboxed,
            own_mounts=own_mounts,
            caller_cgroups=caller_cgroups,
            job_netns_fd=job_netns_fd,
            tcp_close=network.all_closed,
            close_tcp=[] if network.all_closed else network.close_inodes,
        )
        try:
            result = criu.restore(images, options, log_name)
            result.notes.extend([*nodefacts.notes(found), *network.notes, *made])
            return result
        except CRIUError as e:
            # CRIU's words, read here at the edge: with the owner's rights, EACCES means a path
            # swapped for a symlink, or whose permissions changed since the dump.
            if owner.uid != 0 and os.strerror(errno.EACCES) in str(e):
                raise OwnerDeniedError(
                    f"{e} (a restore reopens the job's paths with the rights of its owner, "
                    f"{_name(owner.uid)}, who may not open that path now)"
                ) from e
            raise
    finally:
        for fd in fds:
            os.close(fd)


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
