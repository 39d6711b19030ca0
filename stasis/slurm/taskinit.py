"""The root helper the SPANK plugin runs inside an opted-in job's batch task, before the task execs.

    python -I -m stasis.slurm.taskinit --job-id N --uid U --gid G --label L

It decides how the job starts and prints one JSON object for the launcher:
    {"mode": "restored", "pid": P, ...}  exit 0: the newest usable checkpoint the job may resume
                                         from was restored; its namespace init (pid P) was our
                                         child and, once we exit, is the task's (a subreaper)
    {"mode": "fresh", ...}               exit 10: nothing to restore; the plugin unshares a PID
                                         namespace and the launcher starts the batch script
    {"mode": "off", ...}                 exit 11: stasis cannot protect this job (daemon down,
                                         bad label, ...): it runs exactly as without stasis
"messages" are lines for the job's output (why a checkpoint was skipped, what was restored).
A corrupt or unrestorable newest checkpoint falls back to the one before it (up to three are
tried); when none works the job starts fresh. The helper never makes the job fail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, cast

from stasis import wire
from stasis.config import Settings, load_settings
from stasis.engine import CRIU, Owner, credentials, find_criu, nodefacts
from stasis.engine.restoring import restore_tree
from stasis.errors import CorruptCheckpointError, OwnerDeniedError, SlurmError, StasisError
from stasis.client import Client
from stasis.daemon.users import account
from stasis.slurm import scontrol
from stasis.slurm.labels import candidates, resolve_label, slurm_of
from stasis.store import Manifest, Store, node_store

EXIT_RESTORED = 0
EXIT_FRESH = 10
EXIT_OFF = 11
UNPROTECTED = "this job runs WITHOUT checkpoint protection"
# The newest few checkpoints are tried, newest first; a job must not wait on many failures.
_MAX_TRIES = 3
_TINI_CANDIDATES = ("/usr/bin/tini-static", "/usr/bin/tini", "/usr/local/bin/tini")


def find_tini(configured: str) -> str:
    for path in ((configured,) if configured else _TINI_CANDIDATES):
        if os.access(path, os.X_OK):
            return path
    raise SlurmError("tini is not installed on this node (Debian package tini)")


def rewritten_by_slurm(m: Manifest, job_id: str) -> list[str]:
    """The batch script a shell of the job was reading, when the job restarts under its own id:
    slurmd writes the script into its spool again at every start of the job (the same script,
    the same path on every node), so its time is new but not its contents."""
    if m.restore_facts is None or slurm_of(m).get("job_id") != job_id:
        return []
    script = re.compile(rf"/job0*{re.escape(job_id)}/slurm_script$")
    return [f.path for f in m.restore_facts.files or () if script.search(f.path)]


def _restore(settings: Settings, store: Store, m: Manifest, info: scontrol.JobInfo, gid: int
             ) -> int:
    s: dict[str, Any] = m.extra.get("slurm", {})
    old_out = str(s.get("stdout") or m.log_path or "")
    old_err = str(s.get("stderr") or old_out)
    new_out = info.stdout or "/dev/null"
    new_err = info.stderr or new_out
    # Regular output files are re-pointed at this run's files (a new job id may mean a new
    # name); /dev/null and other devices CRIU reopens itself.
    outputs = []
    if old_out and not old_out.startswith("/dev/"):
        outputs.append((old_out, new_out))
    if old_err and old_err != old_out and not old_err.startswith("/dev/"):
        outputs.append((old_err, new_err))
    layout = settings.layout
    criu = CRIU(find_criu(settings.criu), layout.criu_logs)
    acct = account(m.uid)
    owner = Owner(acct.uid, gid, acct.groups)
    if m.restore_facts is not None:
        # As the daemon does: a node that cannot restore it says why before anything is
        # fetched (the caller then tries the next older checkpoint, or runs the job from the
        # start); its files with the owner's rights (this helper is single-threaded).
        nodefacts.require(m.id, cast("wire.RestoreFacts", m.restore_facts.model_dump()), criu,
                          owner, skip=[*(old for old, _ in outputs),
                                       *rewritten_by_slurm(m, info.job_id)])
    with store.open_images(m.id, layout.scratch) as (_, images):
        # CRIU (root) gives every thread the credentials its images record: none may hold more
        # than the job's owner (a setuid program checkpointed mid-run by a stasis that did not
        # refuse it yet).
        beyond = credentials.images_excess(images, owner.uid, [gid, *owner.groups]) \
            if owner.uid != 0 else []
        if beyond:
            raise OwnerDeniedError(
                f"its images hold credentials beyond its owner {acct.name} (uid {acct.uid}): "
                f"{'; '.join(beyond[:3])}; a restore would give them back")
        # The same restore as the daemon's (CRIU as root, every path of the job with its
        # owner's rights), here in the job's task so that the tree is the task's child.
        result = restore_tree(criu, images, owner, outputs,
                              f"restore-slurm-{info.job_id}-{m.id}.log")
    if m.host != settings.node:
        # The node that dumped it may lift CRIU's network lock for it now.
        try:
            store.mark_restored(m.id, settings.node)
        except StasisError:
            pass  # that node lifts it after netlock_timeout_s anyway
    return result.pid


def decide(job_id: str, uid: int, gid: int, label_arg: str,
           settings: Settings | None = None) -> tuple[int, dict[str, Any]]:
    out: dict[str, Any] = {"mode": "off", "messages": []}
    say: list[str] = out["messages"]
    try:
        settings = settings or load_settings()
        scontrol.validate_slurm_job_id(job_id)
        label, explicit = resolve_label(label_arg, job_id)
    except StasisError as e:
        say.append(f"stasis: warning: {e}; {UNPROTECTED}")
        return EXIT_OFF, out
    out.update(socket=str(settings.socket), label=label, explicit_label=explicit)
    try:
        with Client(settings.socket, 10.0) as client:
            client.slurm_health()
        out["tini"] = find_tini(settings.tini)
        info = scontrol.job_info(job_id)
    except StasisError as e:
        say.append(f"stasis: warning: {e}; {UNPROTECTED}")
        return EXIT_OFF, out
    if info.uid != uid:
        say.append(f"stasis: warning: Slurm says job {job_id} belongs to uid {info.uid}, "
                   f"not {uid}; {UNPROTECTED}")
        return EXIT_OFF, out
    try:
        # The node's keys (the daemon made them): only checkpoints signed by a trusted key.
        store = node_store(settings)
        found = candidates(store, label, explicit, uid, job_id, info.token)
    except StasisError as e:
        say.append(f"stasis: warning: cannot list checkpoints: {e}; starting from the beginning")
        found = []
    if not found:
        if explicit:
            say.append(f"stasis: warning: no checkpoint with label {label} to resume from: "
                       "the job runs from the start")
        else:
            say.append(f"stasis: job {job_id} is protected (label {label})")
        out["mode"] = "fresh"
        return EXIT_FRESH, out
    for m in found[:_MAX_TRIES]:
        try:
            pid = _restore(settings, store, m, info, gid)
        except CorruptCheckpointError as e:
            say.append(f"stasis: warning: skipping checkpoint {m.id}: {e}")
            continue
        except (StasisError, OSError) as e:
            say.append(f"stasis: warning: restoring checkpoint {m.id} failed: {e}")
            continue
        say.append(f"stasis: restored checkpoint {m.id} (label {label}, taken "
                   f"{m.created:%Y-%m-%dT%H:%M:%SZ} from job {m.job})")
        out.update(mode="restored", pid=pid, checkpoint=m.id)
        return EXIT_RESTORED, out
    else:
        say.append(f"stasis: warning: no usable checkpoint with label {label}: "
                   "the job runs from the start")
    out["mode"] = "fresh"
    return EXIT_FRESH, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stasis.slurm.taskinit")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--gid", type=int, required=True)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    try:
        code, out = decide(args.job_id, args.uid, args.gid, args.label)
    except Exception as e:  # the job must start whatever happened here
        code, out = EXIT_OFF, {"mode": "off", "messages": [
            f"stasis: warning: internal error ({type(e).__name__}: {e}); {UNPROTECTED}"]}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
