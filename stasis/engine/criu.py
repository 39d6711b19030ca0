"""Dump, restore, version and feature checks on top of one swrk session each."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stasis.engine import jobnetns, privatepts, privatetmp, rpc, streamer
from stasis.engine.criulog import first_error
from stasis.engine.lazylink import PageServerLink
from stasis.errors import CheckpointError, CRIUError, CRIUNotFoundError
from stasis.poll import poll

# Where scripts/install-criu.sh puts the CRIU we build (Debian 12's own criu fails on new kernels).
_CANDIDATES = ("/usr/local/sbin/criu", "/usr/sbin/criu")
MIN_VERSION = (4, 2)
LOG_LEVEL = 4


def connect_unix(path: Path) -> socket.socket:
    """A connection to the unix socket at `path`, however long the path (sun_path holds 107
    bytes: the directory is reached through /proc/self/fd instead). CRIUError if refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{dir_fd}/{path.name}")
    except OSError as e:
        sock.close()
        raise CRIUError(f"cannot reach the page server at {path}: {e.strerror}") from e
    finally:
        os.close(dir_fd)
    return sock


def find_criu(configured: str = "") -> str:
    """The criu binary to use: the configured one, else ours under /usr/local, else PATH."""
    if configured:
        if not os.access(configured, os.X_OK):
            raise CRIUNotFoundError(f"STASIS_CRIU={configured} is not an executable file")
        return configured
    for path in _CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("criu")
    if found:
        return found
    raise CRIUNotFoundError("criu is not installed; run `make install` (builds CRIU >= 4.2)")


CUT_SEIZE_TIMEOUT_S = (
    30  # CRIU's limit on seizing a frozen part of a cut (DumpOptions.freeze_cgroup)
)


@dataclass
class DumpOptions:
    leave_running: bool = False
    # Keep the tree stopped (SIGSTOP) after a successful dump instead of killing it, so that the
    # caller can kill it only once the checkpoint is safely published, or resume it if that fails.
    leave_stopped: bool = False
    tcp_established: bool = True
    file_locks: bool = True
    ext_unix_sk: bool = True
    notify: rpc.NotifyHandler | None = None
    # Told CRIU's pid before the dump starts: whoever must know, should the caller die during
    # the dump, which CRIU may still hold the tree.
    criu_started: Callable[[int], None] | None = None
    # The tree has a mount namespace of its own (`stasis run --private-tmp`): None: found out
    # from /proc (engine/privatetmp.py).
    own_mounts: bool | None = None
    # The tree's mount namespace is the node's but for a devpts of its own: CRIU runs in it
    # and does not dump it (engine/privatepts.py). None: found out from /proc.
    own_pts: bool | None = None
    # The tree lives in its job's network namespace (stasis/daemon/jobnet.py), which the node
    # makes again wherever the tree is restored: left out of the images (engine/jobnetns.py).
    job_netns: bool = False
    # A freezer cgroup holding just the tree, which the caller froze already: a coordinated
    # dump of a job's parts on several nodes freezes every part before it dumps any. CRIU dumps
    # it as it is and, should the dump fail, leaves it frozen for the caller to thaw.
    freeze_cgroup: str | None = None


@dataclass
class DumpResult:
    duration_s: float
    log_path: Path
    # Files the tree holds open outside its own mount namespace, dumped as external (path:
    # CRIU's key; engine/privatetmp.py): the restore of these images hands them over so.
    external_files: dict[str, privatetmp.ExternalFile] = field(default_factory=dict)


@dataclass(frozen=True)
class Owner:
    """Whose rights a restore resolves the job's paths with (files, cwd, root, mappings, unix
    socket addresses): CRIU itself runs as root, and a path swapped for a symlink after the dump
    must not reach what this user could not (our CRIU patch 0003 reads CRIU_RESTORE_FSCREDS)."""

    uid: int
    gid: int
    groups: Sequence[int] = ()

    def environ(self) -> dict[str, str]:
        groups = ",".join(str(g) for g in self.groups)
        return {"CRIU_RESTORE_FSCREDS": f"{self.uid}:{self.gid}:{groups}"}


@dataclass
class RestoreOptions:
    # (key, fd) pairs: CRIU reopens the file whose image path is `key` (no leading '/') as `fd`.
    inherit_fds: Sequence[tuple[str, int]] = ()
    # Resume the tree before its memory is back: `criu lazy-pages` serves page faults over
    # userfaultfd and streams the rest in the background. The images must stay in place until
    # `RestoreResult.lazy_pages` exits. Falls back to a full restore when that fails.
    lazy: bool = False
    # A unix socket the pages not in the local pages-*.img are served on (CRIU's page-server
    # protocol, stasis/engine/pageserver.py): lazy-pages is handed a connection to it
    # (`--page-server --ps-socket`). None: lazy-pages reads them from the images.
    page_server: Path | None = None
    # The images come from an image streamer listening in the images directory
    # (engine/streamer.py), file by file through pipes, instead of from files there.
    stream: bool = False
    # Called with the reason before a tree is killed because its page server went away.
    on_lost: Callable[[str], None] | None = None
    tcp_established: bool = True
    # Every connected TCP socket comes back closed (CRIU's tcp_close), or only those whose
    # inodes `close_tcp` lists (CRIU patch 0005): connections that cannot move (netidentity).
    tcp_close: bool = False
    close_tcp: Sequence[int] = ()
    file_locks: bool = True
    ext_unix_sk: bool = True
    notify: rpc.NotifyHandler | None = None
    # None: paths are resolved with root's rights (only for root's own jobs).
    owner: Owner | None = None
    # The images hold the tree's own mount namespace (engine/privatetmp.py): rebuilt on this
    # node's root, each mount the node has bound from the same path here.
    own_mounts: bool = False
    # A sandboxed restore (`stasis verify`, engine/sandbox.py): the tree is left stopped before
    # it runs an instruction, established TCP connections come back closed, CRIU takes no
    # network lock (no iptables or nft rule anywhere) and none of the job's file locks.
    sandboxed: bool = False
    # The tree comes back in the caller's cgroups (CRIU's manage_cgroups_mode IGNORE), not in
    # those its images name: a Slurm job's task restores it into its own step's cgroups, where
    # the job's memory limit holds and proctrack/cgroup finds it to signal and kill. CRIU's
    # default would put it back into the dumped job's cgroup paths, making them again where
    # they are gone (a job resumed under a new id: outside its limit, out of scancel's reach).
    caller_cgroups: bool = False
    # The job's network namespace on this node, open (engine/jobnetns.py): the tree comes back
    # in it. Only for images dumped with DumpOptions.job_netns.
    job_netns_fd: int | None = None


@dataclass
class RestoreResult:
    pid: int
    duration_s: float
    log_path: Path
    # The `criu lazy-pages` process still filling the tree's memory (lazy restores only).
    lazy_pages: subprocess.Popen[bytes] | None = None
    # Its link to the page server, when the pages come from one (engine/lazylink.py).
    page_link: PageServerLink | None = None
    fallback_reason: str | None = None  # why a lazy restore became a full one
    # What differs from the node that dumped it without stopping the restore (nodefacts).
    notes: list[str] = field(default_factory=list)


@dataclass
class Features:
    mem_track: bool
    lazy_pages: bool
    extra: dict[str, bool] = field(default_factory=dict)


class CRIU:
    """A CRIU binary driven over RPC. Logs go to `log_dir` (one file per operation)."""

    def __init__(self, path: str, log_dir: Path) -> None:
        self.path = path
        self.log_dir = log_dir

    def _opts(self, pb: Any, images_dir: Path, log_name: str) -> tuple[Any, list[int]]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        images_fd = rpc.open_dir(images_dir)
        work_fd = rpc.open_dir(self.log_dir)
        opts = pb.criu_opts(
            images_dir_fd=images_fd, work_dir_fd=work_fd, log_level=LOG_LEVEL, log_file=log_name
        )
        return opts, [images_fd, work_fd]

    def _fail(self, what: str, resp: Any, log_path: Path) -> CRIUError:
        reason = first_error(log_path) or (resp.cr_errmsg if resp.HasField("cr_errmsg") else "")
        if not reason and resp.HasField("cr_errno") and resp.cr_errno:
            reason = os.strerror(resp.cr_errno)
        return CRIUError(f"{what} failed: {reason or 'unknown reason'}", str(log_path))

    def dump(self, pid: int, images_dir: Path, options: DumpOptions, log_name: str) -> DumpResult:
        """Dump the process tree rooted at `pid` into `images_dir`.

        Unless leave_running/leave_stopped is set, CRIU kills the tree after a successful dump.
        On failure CRIU resumes the tree, so the job keeps running.
        """
        pb = rpc.messages()
        opts, fds = self._opts(pb, images_dir, log_name)
        try:
            opts.pid = pid
            opts.leave_running = options.leave_running
            if options.leave_stopped and not options.leave_running:
                opts.leave_stopped = True
            opts.tcp_established = options.tcp_established
            opts.tcp_skip_in_flight = options.tcp_established
            opts.file_locks = options.file_locks
            opts.ext_unix_sk = options.ext_unix_sk
            opts.notify_scripts = options.notify is not None
            pts = options.own_pts if options.own_pts is not None else privatepts.only_own_pts(pid)
            own = options.own_mounts
            external: dict[str, privatetmp.ExternalFile] = {}
            if not pts and (own if own is not None else privatetmp.own_mount_ns(pid)):
                external = privatetmp.dump_options(opts, pid)
            if options.job_netns:
                jobnetns.dump_options(opts, pid)
            if options.freeze_cgroup:
                opts.freeze_cgroup = options.freeze_cgroup
                # CRIU gives up seizing the tree after `timeout` s (10 by default): "Timeout
                # reached. Try to interrupt" was seen for an MPI part whose busy ranks shared
                # two loaded CPUs, and the whole cut was lost. The part is frozen already: a slow seize
                # costs it frozen time, a timeout costs the whole cut.
                opts.timeout = CUT_SEIZE_TIMEOUT_S
            req = pb.criu_req(type=pb.DUMP, opts=opts)
            start = time.monotonic()
            wrapper: list[str] = []
            passed: list[int] = []
            if pts:
                try:
                    passed.append(privatepts.namespace_fd(pid))
                except OSError as e:
                    raise CheckpointError(f"dump of pid {pid} refused: {e.strerror or e}") from e
                fds.extend(passed)
                wrapper = privatepts.nsenter(passed[0])
            resp = rpc.Session(self.path, options.notify, options.criu_started, wrapper).call(
                req, pass_fds=passed
            )
            duration = time.monotonic() - start
        finally:
            for fd in fds:
                os.close(fd)
        log_path = self.log_dir / log_name
        if not resp.success:
            raise self._fail(f"dump of pid {pid}", resp, log_path)
        return DumpResult(duration_s=duration, log_path=log_path, external_files=external)

    def restore(self, images_dir: Path, options: RestoreOptions, log_name: str) -> RestoreResult:
        """Restore the tree in `images_dir` as a child of the calling process (rst_sibling)."""
        if not options.lazy:
            return self._restore(images_dir, options, log_name, None)
        # Each lazy restore talks to its own lazy-pages daemon through a socket in its work dir.
        work = self.log_dir / log_name.removesuffix(".log")
        work.mkdir(parents=True, exist_ok=True)
        try:
            daemon, link = self._start_lazy_pages(
                images_dir, work, options.page_server, options.on_lost
            )
            try:
                result = self._restore(images_dir, options, log_name, work)
            except (CRIUError, OSError):
                daemon.kill()
                daemon.wait()
                if link is not None:
                    link.tree(None)
                raise
            if link is not None:
                link.tree(result.pid)
            result.lazy_pages = daemon
            result.page_link = link
            return result
        except CRIUError as e:
            if options.page_server is not None:
                # The local images lack the lazy pages: a full restore from them would be wrong.
                raise
            result = self._restore(images_dir, options, log_name, None)
            result.fallback_reason = str(e)
            return result

    def _start_lazy_pages(
        self,
        images_dir: Path,
        work: Path,
        page_server: Path | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> tuple[subprocess.Popen[bytes], PageServerLink | None]:
        socket_path = work / "lazy-pages.socket"
        socket_path.unlink(missing_ok=True)
        extra: list[str] = []
        link = None
        if page_server is not None:
            link = PageServerLink(connect_unix(page_server), on_lost)
            extra = ["--page-server", "--ps-socket", str(link.lazy_pages_fd)]
        daemon = None
        try:
            daemon = subprocess.Popen(
                [
                    self.path,
                    "lazy-pages",
                    "-D",
                    str(images_dir),
                    "-W",
                    str(work),
                    "-v4",
                    "-o",
                    "lazy-pages.log",
                    *extra,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=[link.lazy_pages_fd] if link is not None else [],
            )
        finally:
            if link is not None:
                link.spawned(daemon)
                if daemon is None:
                    link.tree(None)
        poll(lambda: socket_path.exists() or daemon.poll() is not None, 5.0, 0.002)
        if not socket_path.exists():
            daemon.kill()
            daemon.wait()
            if link is not None:
                link.tree(None)
            raise CRIUError("criu lazy-pages did not start", str(work / "lazy-pages.log"))
        return daemon, link

    def _restore(
        self, images_dir: Path, options: RestoreOptions, log_name: str, lazy_work: Path | None
    ) -> RestoreResult:
        pb = rpc.messages()
        opts, fds = self._opts(pb, images_dir, log_name)
        if lazy_work is not None:
            os.close(fds.pop())
            work_fd = rpc.open_dir(lazy_work)
            fds.append(work_fd)
            opts.work_dir_fd = work_fd
            opts.lazy_pages = True
        if options.stream:
            # CRIU's RPC takes `stream` only from a config file (criu/cr-service.c).
            opts.config_file = str(self._stream_config())
        try:
            opts.rst_sibling = True
            opts.tcp_established = options.tcp_established
            opts.file_locks = options.file_locks
            opts.ext_unix_sk = options.ext_unix_sk
            opts.notify_scripts = options.notify is not None
            if options.tcp_close:
                opts.tcp_close = True
            if options.sandboxed:
                opts.leave_stopped = True
                opts.tcp_close = True
                opts.network_lock = pb.SKIP
                # Its file locks are not taken again: CRIU would wait on them while the job
                # itself still holds them (seen: a verify hung), and a moment's hold could make
                # the job's peers wait.
                opts.file_locks = False
            for key, fd in options.inherit_fds:
                opts.inherit_fd.add(key=key, fd=fd)
            if options.caller_cgroups:
                opts.manage_cgroups_mode = pb.IGNORE
            if options.own_mounts:
                privatetmp.restore_options(opts)
            inherited = [fd for _, fd in options.inherit_fds]
            if options.job_netns_fd is not None:
                jobnetns.restore_options(opts, options.job_netns_fd)
                inherited.append(options.job_netns_fd)
            req = pb.criu_req(type=pb.RESTORE, opts=opts)
            start = time.monotonic()
            resp = rpc.Session(self.path, options.notify).call(
                req,
                pass_fds=inherited,
                env={
                    **(options.owner.environ() if options.owner else {}),
                    **(
                        {"CRIU_TCP_CLOSE": ",".join(map(str, options.close_tcp))}
                        if options.close_tcp
                        else {}
                    ),
                }
                or None,
            )
            duration = time.monotonic() - start
        finally:
            for fd in fds:
                os.close(fd)
        log_path = (lazy_work or self.log_dir) / log_name
        if not resp.success:
            raise self._fail("restore", resp, log_path)
        return RestoreResult(pid=resp.restore.pid, duration_s=duration, log_path=log_path)

    def _stream_config(self) -> Path:
        path = self.log_dir / "stream.conf"
        if not path.exists() or path.read_text() != streamer.CONFIG:
            tmp = path.with_name(f".stream.conf.{os.getpid()}")
            tmp.write_text(streamer.CONFIG)
            os.replace(tmp, path)
        return path

    def version(self) -> tuple[int, int, int]:
        pb = rpc.messages()
        resp = rpc.Session(self.path).call(pb.criu_req(type=pb.VERSION))
        if not resp.success:
            raise CRIUError(f"{self.path} did not report its version")
        v = resp.version
        return (v.major_number, v.minor_number, v.sublevel if v.HasField("sublevel") else 0)

    def features(self) -> Features:
        pb = rpc.messages()
        req = pb.criu_req(
            type=pb.FEATURE_CHECK, features=pb.criu_features(mem_track=True, lazy_pages=True)
        )
        resp = rpc.Session(self.path).call(req)
        f = resp.features
        return Features(
            mem_track=bool(f.HasField("mem_track") and f.mem_track),
            lazy_pages=bool(f.HasField("lazy_pages") and f.lazy_pages),
        )

    def check(self, log_name: str) -> str | None:
        """Run CRIU's own kernel check; None when it passes, else the reason."""
        pb = rpc.messages()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        work_fd = rpc.open_dir(self.log_dir)
        try:
            opts = pb.criu_opts(
                images_dir_fd=work_fd, work_dir_fd=work_fd, log_level=LOG_LEVEL, log_file=log_name
            )
            resp = rpc.Session(self.path).call(pb.criu_req(type=pb.CHECK, opts=opts))
        finally:
            os.close(work_fd)
        if resp.success:
            return None
        return first_error(self.log_dir / log_name) or "criu check failed"
