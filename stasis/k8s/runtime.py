"""`stasis-runc`: what containerd's runc shim runs instead of runc (it finds it as `runc` on
its PATH: stasis.k8s.shim). Every command goes to the real runc unchanged, except for a
container whose environment has STASIS_CHECKPOINT:

    create   restores the label's newest good checkpoint instead (`runc restore --detach`, the
             writable layer put back first), or creates it fresh when there is none; what
             happened goes to the container's stderr (its log), one line each, prefixed
             "stasis:". A restore that fails on a good checkpoint (a port, file or mount it
             needs taken or missing) never starts it fresh: the create fails, naming the
             checkpoint (runc's log, so the kubelet's event and backoff; and an event of the
             daemon's on the pod), and the checkpoint stays. After `k8s_restore_attempts`
             failures of one checkpoint on the node, the label's previous one is tried; when
             every one was given up, the create fails, unless STASIS_FRESH (below) says to
             start fresh. When nobody can tell whether there is one (the daemon
             or the store cannot be reached), it asks again for up to `store_wait_s` (at most
             CREATE_WAIT_MAX_S), then fails the create, which the kubelet retries (the reason
             in runc's log, which containerd puts into the error and the pod's event), unless
             the container's STASIS_FRESH says otherwise: 1, true, yes or if-unreachable
             start it fresh at once when nobody can tell, or when none of its checkpoints
             can be restored on this node (a checkpoint that can be found is
             resumed all the same: a restarted container keeps its environment, so "always
             fresh" would throw away every stop's checkpoint); the same values mean the same
             for a Slurm job (stasis.config.fresh_if_unreachable)
    start    of a restored container: nothing to do (it runs already); then registered
    kill     with SIGTERM (the kubelet's stop): the daemon checkpoints it first and kills it;
             when that fails or takes too long, the signal goes to runc as usual. Any stop
             signal (TERM, INT, QUIT, KILL) is noted in the bundle first: the container's end
             is then no success that retires its label
    delete   the daemon forgets it

A container without the variable never reaches the daemon.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stasis.client import Client
    from stasis.config import Settings

# runc's global flags that take a value (`--root R` or `--root=R`).
_VALUE_FLAGS = {"--log", "--log-format", "--root", "--criu", "--rootless"}
_STOP_SIGNALS = {"15", "TERM", "SIGTERM"}
# Signals that end a container (a kubelet's stop, its image's STOPSIGNAL, the grace's end).
_ENDING_SIGNALS = _STOP_SIGNALS | {
    "2",
    "INT",
    "SIGINT",
    "3",
    "QUIT",
    "SIGQUIT",
    "9",
    "KILL",
    "SIGKILL",
}
# The kubelet gives a CreateContainer 2 minutes (--runtime-request-timeout): a create that
# waits longer is retried while it still runs.
CREATE_WAIT_MAX_S = 90.0
_FRESH_VARIABLE = "STASIS_FRESH"
_MARKER = "stasis-restored"  # in the bundle: `start` has nothing to do
_DEFAULT_RUNC_ROOT = "/run/runc"


class Argv:
    """runc's command line, split where stasis needs it."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.globals: dict[str, str] = {}
        self.command = ""
        self.args: list[str] = []
        i = 0
        while i < len(argv):
            a = argv[i]
            if not a.startswith("-"):
                self.command, self.args = a, argv[i + 1 :]
                break
            name, eq, value = a.partition("=")
            if name in _VALUE_FLAGS:
                if not eq and i + 1 < len(argv):
                    value = argv[i + 1]
                    i += 1
                self.globals[name] = value
            i += 1

    @property
    def root(self) -> str:
        return self.globals.get("--root") or _DEFAULT_RUNC_ROOT

    def option(self, *names: str) -> str | None:
        for i, a in enumerate(self.args):
            for n in names:
                if a == n and i + 1 < len(self.args):
                    return self.args[i + 1]
                if a.startswith(n + "="):
                    return a[len(n) + 1 :]
        return None

    def flag(self, *names: str) -> bool:
        return any(a in names for a in self.args)

    def positionals(self) -> list[str]:
        out: list[str] = []
        skip = False
        takes_value = {
            "--bundle",
            "-b",
            "--console-socket",
            "--pid-file",
            "--preserve-fds",
            "--signal",
            "-s",
            "--process",
            "-p",
            "--format",
            "-f",
        }
        for a in self.args:
            if skip:
                skip = False
            elif a.startswith("-"):
                skip = a in takes_value and self.command in ("create", "run", "exec")
            else:
                out.append(a)
        return out


def say(message: str) -> None:
    """One line to the container's stderr (create's stdio is the container's) or the shim log."""
    try:
        os.write(2, f"stasis: {message}\n".encode())
    except OSError:
        pass


def _env_of(bundle: Path) -> dict[str, str]:
    import json

    try:
        env = json.loads((bundle / "config.json").read_text())["process"].get("env") or []
        return dict(str(item).partition("=")[::2] for item in env)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _label_of(bundle: Path) -> str | None:
    env = _env_of(bundle)
    for name in ("STASIS_CHECKPOINT", "CEDANA_CHECKPOINT"):
        if env.get(name):
            return env[name]
    return None


def _fresh_of(bundle: Path) -> bool:
    """Whether the container's STASIS_FRESH asks to start it fresh when nobody can tell
    whether it has a checkpoint (else: wait, then fail the create); a value that means nothing
    is said in its log and ignored."""
    from stasis.config import fresh_if_unreachable

    fresh, warning = fresh_if_unreachable(_env_of(bundle).get(_FRESH_VARIABLE, ""))
    if warning:
        say(warning)
    return fresh


def _runtime_error(argv: Argv, message: str) -> None:
    """`message` as runc's own error in its log: containerd's shim reads the last one into the
    create's error, which the kubelet puts into the pod's event."""
    import json
    from datetime import UTC, datetime

    path = argv.globals.get("--log")
    if not path:
        return
    line = json.dumps({"level": "error", "msg": message, "time": datetime.now(UTC).isoformat()})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def main() -> None:
    argv = Argv(sys.argv[1:])
    from stasis.config import load_settings
    from stasis.k8s.runc import real_runc

    settings = load_settings()
    if settings.test_fault_points:
        from stasis import faults

        faults.arm(settings.test_fault_points)
    runc = real_runc(settings.runc)
    command = argv.command
    if command in ("create", "start", "kill", "delete"):
        try:
            handled = _HANDLERS[command](argv, runc, settings)
        except Exception as e:  # never keep a container from its runtime over stasis
            say(f"internal error, handing the container to runc: {type(e).__name__}: {e}")
            handled = None
        if handled is not None:
            sys.exit(handled)
    os.execv(runc, [runc, *argv.argv])


def _client(settings: Settings, timeout_s: float) -> Client:
    from stasis.client import Client

    return Client(settings.socket, timeout_s)


def _state(runc: str, root: str, cid: str) -> dict[str, Any] | None:
    import json
    import subprocess

    try:
        r = subprocess.run(
            [runc, "--root", root, "state", cid], capture_output=True, text=True, check=True
        )
        state: dict[str, Any] = json.loads(r.stdout)
        return state
    except (subprocess.CalledProcessError, ValueError, OSError):
        return None


def _create(argv: Argv, runc: str, settings: Settings) -> int | None:
    from stasis.errors import ContainerRootDamagedError, StasisError
    from stasis.k8s.runc import Runc

    bundle = Path(argv.option("--bundle", "-b") or os.getcwd())
    label = _label_of(bundle)
    pos = argv.positionals()
    if label is None or not pos:
        return None
    cid = pos[-1]
    fresh = _fresh_of(bundle)
    client = _client(settings, 600)
    import time

    deadline = time.monotonic() + min(float(settings.store_wait_s), CREATE_WAIT_MAX_S)
    while True:
        try:
            plan = client.k8s_plan_restore(
                runc_root=argv.root, container_id=cid, bundle=str(bundle)
            )
            break
        except ContainerRootDamagedError as e:
            say(
                f"label {label}: {e}; this container does not start (its next create gets a "
                "new root)"
            )
            return 1
        except StasisError as e:
            # "Cannot tell" is not "no checkpoint": a fresh start would lose the work its
            # checkpoint holds, and later retention would delete that checkpoint.
            if fresh:
                say(
                    f"cannot ask for a checkpoint of label {label}: {e}; starting fresh "
                    f"(as its {_FRESH_VARIABLE} asks when nobody can tell)"
                )
                return None
            if time.monotonic() >= deadline:
                message = (
                    f"label {label}: cannot tell whether it has a checkpoint to resume "
                    f"({e}); the container is not started fresh: its create fails and "
                    f"is retried ({_FRESH_VARIABLE}=if-unreachable on the container "
                    "starts it fresh instead)"
                )
                say(message)
                _runtime_error(argv, "stasis: " + message)
                return 1
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
    for note in plan["notes"]:
        say(note)
    if plan["checkpoint"] is None:
        given_up = ", ".join(plan.get("given_up") or [])
        if not given_up:
            say(f"label {label}: starting fresh")
            return None
        if fresh:
            say(
                f"label {label}: none of its checkpoints can be restored on this node "
                f"({given_up} failed every attempt); starting fresh, as its "
                f"{_FRESH_VARIABLE} asks"
            )
            return None
        message = (
            f"label {label}: none of its checkpoints can be restored on this node: "
            f"checkpoint {given_up} failed every attempt (see the container's log and "
            "the pod's events). The container is not started fresh, and they are kept: "
            "fix the cause and remove their records on the node to try them again, "
            f"or set {_FRESH_VARIABLE}=1 on the container to start it fresh"
        )
        say(message)
        _runtime_error(argv, "stasis: " + message)
        return 1
    import subprocess

    r = Runc(runc, Path(argv.root), argv.globals.get("--criu") or _criu(settings))
    restore = r.restore_argv(
        cid,
        bundle,
        Path(str(plan["images_dir"])),  # a plan with a checkpoint names both
        Path(str(plan["work_dir"])),
        argv.option("--pid-file"),
        argv.option("--console-socket"),
        argv.flag("--no-pivot"),
    )
    for flag in ("--log", "--log-format"):
        if flag in argv.globals:
            restore[1:1] = [flag, argv.globals[flag]]
    # The restored process takes runc's stdio in place of the pipes it had: those of this
    # process, which the shim gave the new container.
    rc = subprocess.run(restore, check=False).returncode
    from stasis import faults

    faults.point("k8s.create.after-restore")
    error = "" if rc == 0 else _restore_error(Path(str(plan["work_dir"])))
    checkpoint = str(plan["checkpoint"])
    if rc != 0:
        # Whatever the failed restore left goes before anyone hears of it.
        subprocess.run(
            [runc, "--root", argv.root, "delete", "--force", cid], check=False, capture_output=True
        )
    done: dict[str, Any] | None = None
    try:
        done = dict(client.k8s_restore_done(cid, ok=rc == 0, error=error, checkpoint=checkpoint))
    except StasisError as e:
        if rc != 0:
            say(f"the stasis daemon did not hear of the failed restore ({e})")
    if rc == 0:
        (bundle / _MARKER).write_text(checkpoint)
        say(f"restored from checkpoint {checkpoint} (label {label})")
        return 0
    # The checkpoint is good (verified): a fresh start would throw its work away, and the
    # cause is often passing (a port or file taken, a mount not there yet).
    from stasis.k8s import restorefails

    message = restorefails.message(
        label,
        checkpoint,
        error,
        int(done["attempts"]) if done else 0,
        int(done["limit"]) if done else int(settings.k8s_restore_attempts),
        str(done["log"]) if done else "",
        str(done["record"]) if done else "",
        settings.node,
    )
    say(message)
    _runtime_error(argv, "stasis: " + message)
    return 1


# CRIU errors that every restore in a container logs and survives: never the cause.
_BENIGN = ("RLIMIT_NOFILE",)


def _restore_error(work: Path) -> str:
    """The cause of a failed restore in its log: CRIU's first error that is not one it always
    survives, without its timestamp and pid."""
    import re

    try:
        lines = (work / "restore.log").read_text(errors="replace").splitlines()
    except OSError:
        return "runc restore failed"
    errors = [line for line in lines if "Error" in line and not any(b in line for b in _BENIGN)]
    found = (errors[0] if errors else lines[-1] if lines else "runc restore failed").strip()
    return re.sub(r"^\(\d+\.\d+\)\s+(\d+:\s+)?", "", found)[:300]


def _criu(settings: Settings) -> str:
    from stasis.engine.criu import find_criu

    return find_criu(settings.criu)


def _start(argv: Argv, runc: str, settings: Settings) -> int | None:
    import subprocess

    from stasis.errors import StasisError

    pos = argv.positionals()
    if not pos:
        return None
    cid = pos[-1]
    state = _state(runc, argv.root, cid)
    if state is None or not state.get("bundle"):
        return None
    bundle = Path(state["bundle"])
    if _label_of(bundle) is None:
        return None
    marker = bundle / _MARKER
    restored = marker.read_text().strip() if marker.exists() else None
    rc: int | None = None
    if restored:
        marker.unlink()
        rc = 0
    else:
        rc = subprocess.run([runc, *argv.argv], check=False).returncode
        if rc != 0:
            return rc
    try:
        _client(settings, 30).k8s_register(
            runc_root=argv.root, container_id=cid, bundle=str(bundle), restored_from=restored
        )
    except StasisError as e:
        say(f"container {cid} runs unprotected (the stasis daemon did not take it: {e})")
    return rc


def _kill(argv: Argv, runc: str, settings: Settings) -> int | None:
    from stasis.errors import StasisError

    pos = argv.positionals()
    if len(pos) < 1:
        return None
    cid, sig = pos[0], (pos[1] if len(pos) > 1 else "TERM").upper()
    if sig not in _ENDING_SIGNALS:
        return None
    state = _state(runc, argv.root, cid)
    if state is None:
        return None
    bundle = Path(state.get("bundle", ""))
    if _label_of(bundle) is None:
        return None
    from stasis.k8s.runc import mark_stop_asked

    mark_stop_asked(bundle)  # before anything: the daemon may be down, or die at the checkpoint
    if sig not in _STOP_SIGNALS or state.get("status") not in ("running", "paused"):
        return None
    timeout = float(settings.k8s_stop_timeout_s)
    try:
        done = _client(settings, timeout + 10).k8s_checkpoint(
            cid, reason="stop", runc_root=argv.root, timeout_s=timeout
        )
    except StasisError as e:
        say(f"no checkpoint of container {cid} at its stop ({e}): stopping it as usual")
        return None
    return 0 if done.get("stopped") else None


def _delete(argv: Argv, runc: str, settings: Settings) -> int | None:
    from stasis.errors import StasisError

    pos = argv.positionals()
    state = _state(runc, argv.root, pos[-1]) if pos else None
    if state is not None and _label_of(Path(state.get("bundle", ""))) is not None:
        try:
            _client(settings, 10).k8s_forget(pos[-1])
        except StasisError:
            pass
    return None


_HANDLERS = {"create": _create, "start": _start, "kill": _kill, "delete": _delete}


if __name__ == "__main__":
    main()
