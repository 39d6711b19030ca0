"""`stasis-runc`: what containerd's runc shim runs instead of runc (it finds it as `runc` on
its PATH: stasis.k8s.shim). Every command goes to the real runc unchanged, except for a
container whose environment has STASIS_CHECKPOINT:

    create   restores the label's newest good checkpoint instead (`runc restore --detach`, the
             writable layer put back first), or creates it fresh when there is none, the daemon
             cannot be reached or the restore fails; what happened goes to the container's
             stderr (its log), one line each, prefixed "stasis:"
    start    of a restored container: nothing to do (it runs already); then registered
    kill     with SIGTERM (the kubelet's stop): the daemon checkpoints it first and kills it;
             when that fails or takes too long, the signal goes to runc as usual
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
                self.command, self.args = a, argv[i + 1:]
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
                    return a[len(n) + 1:]
        return None

    def flag(self, *names: str) -> bool:
        return any(a in names for a in self.args)

    def positionals(self) -> list[str]:
        out: list[str] = []
        skip = False
        takes_value = {"--bundle", "-b", "--console-socket", "--pid-file", "--preserve-fds",
                       "--signal", "-s", "--process", "-p", "--format", "-f"}
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


def _label_of(bundle: Path) -> str | None:
    import json

    try:
        env = json.loads((bundle / "config.json").read_text())["process"].get("env") or []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    for item in env:
        name, _, value = item.partition("=")
        if name in ("STASIS_CHECKPOINT", "CEDANA_CHECKPOINT") and value:
            return str(value)
    return None


def main() -> None:
    argv = Argv(sys.argv[1:])
    from stasis.config import load_settings
    from stasis.k8s.runc import real_runc

    settings = load_settings()
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
        r = subprocess.run([runc, "--root", root, "state", cid], capture_output=True, text=True,
                           check=True)
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
    client = _client(settings, 600)
    try:
        plan = client.request("POST", "/k8s/restores", {
            "runc_root": argv.root, "container_id": cid, "bundle": str(bundle)})
    except ContainerRootDamagedError as e:
        say(f"label {label}: {e}; this container does not start (its next create gets a "
            "new root)")
        return 1
    except StasisError as e:
        say(f"cannot ask for a checkpoint of label {label}: {e}; starting fresh")
        return None
    for note in plan["notes"]:
        say(note)
    if plan["checkpoint"] is None:
        say(f"label {label}: starting fresh")
        return None
    import subprocess

    r = Runc(runc, Path(argv.root), argv.globals.get("--criu") or _criu(settings))
    restore = r.restore_argv(cid, bundle, Path(plan["images_dir"]), Path(plan["work_dir"]),
                             argv.option("--pid-file"), argv.option("--console-socket"),
                             argv.flag("--no-pivot"))
    for flag in ("--log", "--log-format"):
        if flag in argv.globals:
            restore[1:1] = [flag, argv.globals[flag]]
    # The restored process takes runc's stdio in place of the pipes it had: those of this
    # process, which the shim gave the new container.
    rc = subprocess.run(restore, check=False).returncode
    error = "" if rc == 0 else _restore_error(Path(plan["work_dir"]))
    try:
        client.request("POST", f"/k8s/restores/{cid}/done",
                       {"ok": rc == 0, "error": error})
    except StasisError:
        pass
    if rc == 0:
        (bundle / _MARKER).write_text(plan["checkpoint"])
        say(f"restored from checkpoint {plan['checkpoint']} (label {label})")
        return 0
    say(f"restore of checkpoint {plan['checkpoint']} failed ({error}); starting fresh")
    subprocess.run([runc, "--root", argv.root, "delete", "--force", cid], check=False,
                   capture_output=True)
    return None


def _restore_error(work: Path) -> str:
    try:
        lines = (work / "restore.log").read_text(errors="replace").splitlines()
    except OSError:
        return "runc restore failed"
    errors = [line for line in lines if "Error" in line]
    return (errors[0] if errors else lines[-1] if lines else "runc restore failed").strip()


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
        _client(settings, 30).request("POST", "/k8s/containers", {
            "runc_root": argv.root, "container_id": cid, "bundle": str(bundle),
            "restored_from": restored})
    except StasisError as e:
        say(f"container {cid} runs unprotected (the stasis daemon did not take it: {e})")
    return rc


def _kill(argv: Argv, runc: str, settings: Settings) -> int | None:
    from stasis.errors import StasisError

    pos = argv.positionals()
    if len(pos) < 1:
        return None
    cid, sig = pos[0], (pos[1] if len(pos) > 1 else "TERM").upper()
    if sig not in _STOP_SIGNALS:
        return None
    state = _state(runc, argv.root, cid)
    if state is None:
        return None
    if state.get("status") not in ("running", "paused") or \
            _label_of(Path(state.get("bundle", ""))) is None:
        return None
    timeout = float(settings.k8s_stop_timeout_s)
    try:
        done = _client(settings, timeout + 10).request(
            "POST", f"/k8s/containers/{cid}/checkpoint",
            {"reason": "stop", "runc_root": argv.root, "timeout_s": timeout})
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
            _client(settings, 10).request(
                "POST", f"/k8s/containers/{pos[-1]}/forget", {})
        except StasisError:
            pass
    return None


_HANDLERS = {"create": _create, "start": _start, "kill": _kill, "delete": _delete}


if __name__ == "__main__":
    main()
