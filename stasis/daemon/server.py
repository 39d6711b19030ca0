"""`stasis daemon`: serve the API on the unix socket until SIGTERM.

The daemon is a child subreaper, keeps its state under the state directory, and leaves jobs
running when it stops: a restarted daemon finds them again in its database.
"""

from __future__ import annotations

import asyncio
import ctypes
import grp
import logging
import os
import signal
import socket
import threading
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from aiohttp import web

from stasis.config import Settings
from stasis.daemon.api import make_app
from stasis.daemon.connections import ConnectionGuard, GuardedUnixSite, raise_open_files_limit
from stasis.daemon.integration import Integration, Task
from stasis.daemon.jobs import JobManager
from stasis.daemon.logfilter import quiet_repeats
from stasis.daemon.netlocks import SWEEP_INTERVAL_S as NETLOCK_SWEEP_INTERVAL_S
from stasis.daemon.rebuild import (
    match_records,
    open_job_db,
    recover_netlocks,
    restore_records,
    salvage,
)
from stasis.errors import UsageError
from stasis.store import node_keyring, node_store

log = logging.getLogger("stasis.daemon")

PR_SET_CHILD_SUBREAPER = 36
POLL_INTERVAL_S = 0.5
# How often checkpoints nobody can use (a garbage manifest) are looked for; first at the start.
STORE_SWEEP_INTERVAL_S = 3600.0


def _socket_in_use(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def _socket_access(settings: Settings) -> tuple[int, int]:
    """The socket's group and mode: every local user by default (each is authorized by their
    peer credentials), or the members of `socket_group` only. A group that does not exist stops
    the daemon: falling back to gid 0 would silently lock every user out."""
    if not settings.socket_group:
        return 0, 0o666
    try:
        return grp.getgrnam(settings.socket_group).gr_gid, 0o660
    except KeyError:
        raise UsageError(
            f"socket_group {settings.socket_group!r} does not exist: create it "
            f"(groupadd {settings.socket_group}) or set socket_group = \"\" to let "
            "every local user reach the daemon"
        ) from None


def _make_dirs(path: Path) -> None:
    """mkdir -p, the directories it makes 0755 whatever the umask: users reach the socket and
    their logs through them (those that exist are left as they are)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with suppress(FileExistsError):
            d.mkdir()
            os.chmod(d, 0o755)


def core_tasks(manager: JobManager) -> list[Task]:
    def sweep_store() -> None:
        manager.sweep_store()
        manager.prune_history()  # old job rows and CRIU logs

    return [
        Task("follow jobs", POLL_INTERVAL_S, manager.poll),
        # Dumps settled (their trees killed or resumed) whose record the database refused.
        Task("record settled dumps", 1.0, manager.settle_pending),
        # What failed restores leave to us (we are their subreaper) must not stay zombies.
        Task("reap orphans", POLL_INTERVAL_S, manager.reaper.sweep),
        # CRIU's DROP rules of checkpoints deleted, restored elsewhere or held long enough.
        Task("lift network locks", NETLOCK_SWEEP_INTERVAL_S, manager.netlocks.sweep),
        # Reading every manifest of a large store must not delay the socket: in a thread too.
        Task("sweep the store", STORE_SWEEP_INTERVAL_S, sweep_store),
    ]


async def _every(task: Task) -> None:
    while True:
        try:
            await asyncio.to_thread(task.run)
        except Exception as e:  # out of files, say: the next round tries again
            log.warning("cannot %s now: %s: %s", task.name, type(e).__name__, e)
        await asyncio.sleep(task.interval_s)


async def serve(settings: Settings, integrations: Sequence[type[Integration]] = ()) -> None:
    """Serve the API, with the routes, tables and tasks of `integrations` (the entry point
    chooses them; the core knows none)."""
    if os.geteuid() != 0:
        raise UsageError("stasis daemon must run as root")
    sock_gid, sock_mode = _socket_access(settings)  # before anything is made or opened
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    quiet_repeats()
    # A thread that dies (out of files, say) is logged through the same filter, not printed.
    threading.excepthook = lambda a: log.error(
        "thread %s failed", a.thread.name if a.thread else "?", exc_info=a.exc_value
    )
    open_files = raise_open_files_limit()
    # Everything the daemon writes (job table and its WAL, staging, CRIU logs) is root's alone
    # unless it says otherwise (the socket, the job logs, the directories users traverse); the
    # jobs themselves get the umask the daemon was started with.
    job_umask = os.umask(0o077)
    _make_dirs(settings.state_dir)
    # Made at the first start, kept forever: every checkpoint this node signs depends on it.
    keys = node_keyring(settings, create=True)
    log.info(
        "signing checkpoints with key %s; trusting %d key(s)", keys.key_id, len(keys.trusted_ids)
    )
    manager_store = node_store(settings, keys)
    db_path = settings.layout.db
    for name in ("", "-wal", "-shm"):  # made 0644 by an older daemon: SQLite keeps the mode
        with suppress(FileNotFoundError):
            os.chmod(f"{db_path}{name}", 0o600)
    # A corrupt database is moved aside and rebuilt (daemon/rebuild.py), not fatal.
    db, corrupt = open_job_db(db_path, settings.db_busy_timeout_s)
    manager = JobManager(settings, manager_store, db, job_umask=job_umask)
    manager.prepare()
    plugged = [cls(manager) for cls in integrations]
    tables = [t for i in plugged for t in i.tables()]
    db.create_tables(tables)
    if corrupt is not None:  # before the integrations read their tables
        salvage(corrupt, db)
        locks = recover_netlocks(
            db, manager_store, settings.layout.criu_logs, settings.netlock_timeout_s
        )
        if locks:
            log.info("recorded again the network locks of %d checkpoint(s) from CRIU's logs", locks)
        # The integrations' rows whose loss would lose work or do it twice: kept as files.
        restore_records(db, settings.layout.records, tables)
    for integration in plugged:
        integration.prepare()
    match_records(db, settings.layout.records, tables)

    sock_path = str(settings.socket)
    _make_dirs(settings.socket.parent)
    if settings.socket.exists():
        if _socket_in_use(sock_path):
            raise UsageError(f"a daemon is already listening on {sock_path}")
        settings.socket.unlink()

    guard = ConnectionGuard(
        settings.max_connections_per_uid, settings.request_timeout_s, open_files
    )
    # An HTTP/1.1 client's next request on a kept-alive connection has as long as a first one.
    runner = web.AppRunner(
        make_app(manager, plugged, [guard.middleware]),
        access_log=None,
        keepalive_timeout=settings.request_timeout_s or 75.0,
    )
    await runner.setup()
    # No moment in which the socket is open wider than configured: it is created 0700 under our
    # umask (077), then given to its group or to every user.
    site = GuardedUnixSite(runner, sock_path, guard)
    await site.start()
    os.chown(sock_path, 0, sock_gid)
    os.chmod(sock_path, sock_mode)
    log.info(
        "listening on %s, store %s; %d open files at most",
        sock_path,
        settings.store_url,
        open_files,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    tasks = [*core_tasks(manager), *(t for i in plugged for t in i.tasks())]
    background = [asyncio.create_task(_every(task)) for task in tasks]
    await stop.wait()
    for task in background:
        task.cancel()
    for task in background:
        with suppress(asyncio.CancelledError):
            await task
    await runner.cleanup()
    # Lazily restored jobs live on pages this process serves: stopping now would kill them.
    left = await asyncio.to_thread(manager.drain_lazy, settings.lazy_drain_timeout_s)
    if left:
        log.warning(
            "stopping with %d lazy restore(s) still fetching pages after %s s "
            "(lazy_drain_timeout_s): their jobs are killed, their checkpoints stay",
            left,
            settings.lazy_drain_timeout_s,
        )
    for integration in plugged:
        integration.close()
    manager.close()
    db.engine.dispose()  # its SQLite connections closed, not left to the garbage collector
    with suppress(FileNotFoundError):
        os.unlink(sock_path)
    log.info("stopped; jobs keep running")
