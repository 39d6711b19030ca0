"""The root helper the SPANK plugin runs inside an opted-in job's batch task, before the task execs.

    python -I -m stasis.slurm.taskinit --job-id N --uid U --gid G --label L

It decides how the job starts and prints one JSON object for the launcher:
    {"mode": "restored", "pid": P, ...}  exit 0: the newest usable checkpoint the job may resume
                                         from was restored; its namespace init (pid P) was our
                                         child and, once we exit, is the task's (a subreaper)
    {"mode": "fresh", ...}               exit 10: nothing to restore; the plugin unshares a PID
                                         namespace and the launcher starts the batch script
    {"mode": "off", ...}                 exit 11: stasis cannot protect this job (daemon down
                                         with nothing to resume, bad label, ...): it runs exactly
                                         as without stasis
    {"mode": "held", ...}                exit 11: stasis cannot tell whether the job has a
                                         checkpoint (store unreachable; node daemon down while
                                         one exists) after waiting `store_wait_s`: the job was
                                         requeued held with the reason in its Comment; the
                                         launcher runs nothing
"messages" are lines for the job's output (why a checkpoint was skipped, what was restored).
A corrupt or unrestorable newest checkpoint falls back to the one before it (up to three are
tried); when none works the job starts fresh. "Cannot tell" is never "no checkpoint" (issue 28):
only a first run of a job labelled by its own id (which cannot have one), or a job submitted with
STASIS_FRESH=1 (or true, yes, if-unreachable: the same values as a container's, with the same
meaning, stasis.config.fresh_if_unreachable), starts from the beginning (or unprotected) when the
store or the daemon cannot be reached. A checkpoint that can be found is resumed whatever
STASIS_FRESH says: a requeued job keeps its environment, and "always fresh" would throw away
every preemption's checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from stasis import wire
from stasis.client import Client
from stasis.config import Settings, fresh_if_unreachable, load_settings
from stasis.daemon import jobnet
from stasis.daemon.users import account
from stasis.engine import (
    CRIU,
    Owner,
    boundtmp,
    credentials,
    find_criu,
    nodefacts,
    nodelocal,
    privatepts,
    privatetmp,
)
from stasis.engine.restoring import restore_tree
from stasis.errors import CorruptCheckpointError, OwnerDeniedError, SlurmError, StasisError
from stasis.slurm import cutrestore, held, scontrol
from stasis.slurm.labels import candidates, cut_candidates, resolve_label, slurm_of
from stasis.store import Manifest, Store, node_store

EXIT_RESTORED = 0
EXIT_FRESH = 10
EXIT_OFF = 11
UNPROTECTED = "this job runs WITHOUT checkpoint protection"
# The newest few checkpoints are tried, newest first; a job must not wait on many failures.
_MAX_TRIES = 3
_TINI_CANDIDATES = ("/usr/bin/tini-static", "/usr/bin/tini", "/usr/local/bin/tini")
_RETRY_S = 2.0  # between tries at the store or the daemon
_HELD = "stasis: held"  # how the Comments this helper writes begin
_WHY_MAX = 200  # of an error's text in a job's Comment


def find_tini(configured: str) -> str:
    for path in (configured,) if configured else _TINI_CANDIDATES:
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


def _restore(
    settings: Settings,
    store: Store,
    m: Manifest,
    info: scontrol.JobInfo,
    gid: int,
    netns_fd: int | None = None,
) -> tuple[int, list[str]]:
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
        nodefacts.require(
            m.id,
            cast("wire.RestoreFacts", m.restore_facts.model_dump()),
            criu,
            owner,
            skip=[*(old for old, _ in outputs), *rewritten_by_slurm(m, info.job_id)],
            travels=nodelocal.travelling(m.extra),
        )
    with store.open_images(m.id, layout.scratch) as (_, images):
        # CRIU (root) gives every thread the credentials its images record: none may hold more
        # than the job's owner (a setuid program checkpointed mid-run by a stasis that did not
        # refuse it yet).
        beyond = (
            credentials.images_excess(images, owner.uid, [gid, *owner.groups])
            if owner.uid != 0
            else []
        )
        if beyond:
            raise OwnerDeniedError(
                f"its images hold credentials beyond its owner {acct.name} (uid {acct.uid}): "
                f"{'; '.join(beyond[:3])}; a restore would give them back"
            )
        # The same restore as the daemon's (CRIU as root, every path of the job with its
        # owner's rights), here in the job's task so that the tree is the task's child.
        # A job in a mount namespace of its own (job_container/tmpfs): rebuilt in this task's,
        # its /tmp bound from this run's private /tmp (engine/privatetmp.py), refilled first
        # with what the checkpoint saved of the old one (engine/boundtmp.py).
        if privatepts.recorded(m.extra):
            # Its terminals come back in a devpts of this helper's own, the tree and its new
            # output files in this mount namespace (engine/privatepts.py).
            _own_pts()
        refilled = boundtmp.unpack(images, owner.uid, gid, owner.groups)
        try:
            # Into this task's own cgroups (slurmstepd put it in the step's before this
            # helper ran): the job's memory limit holds, scancel and the time limit reach it.
            result = restore_tree(
                criu,
                images,
                owner,
                outputs,
                f"restore-slurm-{info.job_id}-{m.id}.log",
                own_mounts=privatetmp.recorded(m.extra),
                external_files=privatetmp.external_files(m.extra),
                caller_cgroups=True,
                # A job on several nodes: its batch tree lives in the job's network here.
                job_netns_fd=netns_fd,
            )
        except BaseException:
            refilled.undo()  # run from the start instead, it finds the /tmp it would have had
            raise
    if m.host != settings.node:
        # The node that dumped it may lift CRIU's network lock for it now.
        try:
            store.mark_restored(m.id, settings.node)
        except StasisError:
            pass  # that node lifts it after netlock_timeout_s anyway
    return result.pid, result.notes


_PTS_ENTERED = False


def _own_pts() -> None:
    """Once per helper, whichever of its checkpoints it tries: a mount namespace with a devpts
    of its own (a second would only stack another devpts on the first)."""
    global _PTS_ENTERED
    if not _PTS_ENTERED:
        privatepts.enter(new_namespace=True)
        _PTS_ENTERED = True


T = TypeVar("T")


def _retrying(deadline: float, attempt: Callable[[], T]) -> tuple[T | None, str]:
    """`attempt()` until it works or `deadline` (monotonic) passes: (its value, "") or (None,
    the last error)."""
    while True:
        try:
            return attempt(), ""
        except (StasisError, OSError) as e:
            why = str(e) or type(e).__name__
        if time.monotonic() + _RETRY_S > deadline:
            return None, why
        time.sleep(_RETRY_S)


def _health(settings: Settings) -> bool:
    with Client(settings.socket, 10.0) as client:
        client.slurm_health()
    return True


def _hold(
    job_id: str,
    out: dict[str, Any],
    why: str,
    waited_s: int,
    settings: Settings,
    cause: held.Cause,
    label: str,
    info: scontrol.JobInfo,
    gid: int,
) -> tuple[int, dict[str, Any]]:
    """Requeue the job held with `why` in its Comment; the launcher runs nothing. This node's
    daemon releases it once `cause` is over (stasis.slurm.held). The job's output says so
    before the requeue (Slurm kills the batch step at once: the launcher may not print it)."""
    say: list[str] = out["messages"]
    out["mode"] = "held"
    why = why if len(why) <= _WHY_MAX else why[: _WHY_MAX - 3] + "..."
    comment = (
        f"{_HELD}: {why}; its checkpoint is kept; released when it is back (or "
        f"scontrol release {job_id}), or resubmit with STASIS_FRESH=1 to start from the "
        "beginning"
    )
    held_dir = settings.layout.slurm_held
    line = (
        f"stasis: error: {why} (waited {waited_s} s): not starting from the beginning; "
        f"the job is requeued held and released once it is back (or `scontrol "
        f"release {job_id}`), or resubmit with STASIS_FRESH=1 to start from the "
        "beginning"
    )
    try:
        held.note(held_dir, job_id, cause, label, info.uid, info.restarts)
        told = cutrestore.tell(info.stdout, info.uid, gid, [*say, line])
        scontrol.requeue_held(job_id, comment)
        if told:
            say.clear()  # said: the launcher, should it live, says nothing twice
        else:
            say.append(line)
    except (StasisError, OSError) as e:
        held.forget(held_dir, job_id)
        say.append(
            f"stasis: error: {why} (waited {waited_s} s), and the job could not be "
            f"requeued held ({e}): it fails without running, its checkpoints are kept; "
            "submit it again"
        )
    return EXIT_OFF, out


def decide(
    job_id: str,
    uid: int,
    gid: int,
    label_arg: str,
    settings: Settings | None = None,
    fresh: bool = False,
) -> tuple[int, dict[str, Any]]:
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
        out["tini"] = find_tini(settings.tini)
        info = scontrol.job_info(job_id)
    except StasisError as e:
        say.append(f"stasis: warning: {e}; {UNPROTECTED}")
        return EXIT_OFF, out
    if info.uid != uid:
        say.append(
            f"stasis: warning: Slurm says job {job_id} belongs to uid {info.uid}, "
            f"not {uid}; {UNPROTECTED}"
        )
        return EXIT_OFF, out
    # A job labelled by its own id that never ran before cannot have a checkpoint: nothing to
    # wait for. Any other job may (a labelled job resumes another job's checkpoints).
    first_run = not explicit and info.restarts == 0
    wait_s = 0 if first_run or fresh else settings.store_wait_s
    deadline = time.monotonic() + wait_s
    daemon, daemon_error = _retrying(deadline, lambda: _health(settings))

    net = cutrestore.job_net(job_id)
    if net is not None:
        out["spans_nodes"] = True  # the launcher points the job's MPI at the launch agent

    def listing() -> list[Manifest]:
        # The node's keys (the daemon made them): only checkpoints signed by a trusted key.
        store = node_store(settings)
        if net is not None:
            # A job on several nodes resumes from a cut of every part (stasis.slurm.cut).
            mine = store.list(uid=uid)
            return cut_candidates(mine, label, explicit, uid, job_id, info.token)
        return candidates(store, label, explicit, uid, job_id, info.token)

    found, store_error = _retrying(deadline, listing)
    if found is None:
        if not (first_run or fresh):
            return _hold(
                job_id,
                out,
                f"checkpoint store unreachable ({store_error})",
                wait_s,
                settings,
                "store",
                label,
                info,
                gid,
            )
        say.append(
            f"stasis: warning: cannot list checkpoints: {store_error}; starting from the "
            "beginning (" + ("STASIS_FRESH=1" if fresh else "its first run") + ")"
        )
        found = []
    if not daemon:
        if found and not fresh:
            return _hold(
                job_id,
                out,
                f"the node daemon does not answer ({daemon_error})",
                wait_s,
                settings,
                "daemon",
                label,
                info,
                gid,
            )
        say.append(
            f"stasis: warning: the node daemon does not answer ({daemon_error}); " f"{UNPROTECTED}"
        )
        _comment(job_id, f"{_HELD.split(':')[0]}: {UNPROTECTED} (node daemon down)")
        return EXIT_OFF, out
    if info.comment.startswith("stasis: "):
        _comment(job_id, "")  # released after a hold: the reason is over
    store = node_store(settings)
    if not found:
        if explicit:
            say.append(
                f"stasis: warning: no checkpoint with label {label} to resume from: "
                "the job runs from the start"
            )
        else:
            say.append(f"stasis: job {job_id} is protected (label {label})")
        out["mode"] = "fresh"
        return EXIT_FRESH, out
    if net is not None:
        return _restore_cut(settings, store, found, label, net, info, gid, out)
    for m in found[:_MAX_TRIES]:
        try:
            pid, notes = _restore(settings, store, m, info, gid)
        except CorruptCheckpointError as e:
            say.append(f"stasis: warning: skipping checkpoint {m.id}: {e}")
            continue
        except (StasisError, OSError) as e:
            say.append(f"stasis: warning: restoring checkpoint {m.id} failed: {e}")
            continue
        say.append(
            f"stasis: restored checkpoint {m.id} (label {label}, taken "
            f"{m.created:%Y-%m-%dT%H:%M:%SZ} from job {m.job})"
        )
        say.extend(f"stasis: note: {note}" for note in notes)
        out.update(mode="restored", pid=pid, checkpoint=m.id)
        return EXIT_RESTORED, out
    else:
        say.append(
            f"stasis: warning: no usable checkpoint with label {label}: "
            "the job runs from the start"
        )
    out["mode"] = "fresh"
    return EXIT_FRESH, out


def _restore_cut(
    settings: Settings,
    store: Store,
    found: list[Manifest],
    label: str,
    net: jobnet.JobNet,
    info: scontrol.JobInfo,
    gid: int,
    out: dict[str, Any],
) -> tuple[int, dict[str, Any]]:
    """A job on several nodes: its newest cut that restores whole on the nodes it has now
    (stasis.slurm.cutrestore); a cut that cannot leaves nothing running, the one before is
    tried; none: the job is requeued held with the reason (never run with a rank missing,
    nor from the beginning over its checkpoints)."""
    say: list[str] = out["messages"]
    job_id = info.job_id
    try:
        nodes = scontrol.job_node_list(job_id)
    except StasisError as e:
        return _hold_cut(info, gid, out, f"cannot tell the job's nodes ({e})")
    plans = cutrestore.plans(found, label, net, nodes)
    if not plans:
        say.append(
            f"stasis: warning: no complete checkpoint of every part of the job with label "
            f"{label} on {len(nodes)} nodes: the job runs from the start"
        )
        out["mode"] = "fresh"
        return EXIT_FRESH, out
    restorer = cutrestore.CutRestore(settings, store, job_id, net, nodes)
    why = ""
    for plan in plans[:_MAX_TRIES]:
        try:
            pid, notes = restorer.restore(
                plan, lambda m, fd: _restore(settings, store, m, info, gid, netns_fd=fd)
            )
        except (StasisError, OSError) as e:
            why = f"cut {plan.label} not restored: {e}"
            say.append(f"stasis: warning: {why}")
            continue
        batch = next(c for (_, c), k in zip(plan.parts, plan.keys, strict=True) if k == "batch")
        say.append(
            f"stasis: restored every part of the job from {plan.label} ({len(plan.parts)} "
            f"checkpoints on {len(set(n for n, _ in plan.parts))} nodes: "
            f"{', '.join(sorted(set(n for n, _ in plan.parts)))})"
        )
        say.extend(f"stasis: note: {note}" for note in notes)
        out.update(mode="restored", pid=pid, checkpoint=batch)
        return EXIT_RESTORED, out
    return _hold_cut(info, gid, out, why)


def _hold_cut(
    info: scontrol.JobInfo, gid: int, out: dict[str, Any], why: str
) -> tuple[int, dict[str, Any]]:
    """Requeue the job held with `why` in its Comment: a cut that could not be restored whole
    is no reason to run the job with a rank missing, nor to start it over its checkpoints. No
    node releases it by itself: `scontrol release` once what `why` says is mended. The job's
    output says so before the requeue (Slurm kills the batch step at once, the launcher may
    not print it)."""
    say: list[str] = out["messages"]
    job_id = info.job_id
    out["mode"] = "held"
    why = why if len(why) <= _WHY_MAX else why[: _WHY_MAX - 3] + "..."
    line = f"stasis: error: {why}: the job is requeued held, nothing of it runs"
    if cutrestore.tell(info.stdout, info.uid, gid, [*say, line]):
        say.clear()  # said: the launcher, should it live, says nothing twice
    try:
        scontrol.requeue_held(
            job_id,
            f"{_HELD}: {why}; its checkpoints are kept; scontrol release {job_id} to try "
            "again, or resubmit with another label to start from the beginning",
        )
        if say:
            say.append(line)
    except (StasisError, OSError) as e:
        say.append(
            f"stasis: error: {why}, and the job could not be requeued held ({e}): it fails "
            "without running, its checkpoints are kept; submit it again"
        )
    return EXIT_OFF, out


def _comment(job_id: str, text: str) -> None:
    try:
        scontrol.set_comment(job_id, text)
    except StasisError:
        pass  # only a note to the user; the job's output says it too


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stasis.slurm.taskinit")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--gid", type=int, required=True)
    parser.add_argument("--label", default="")
    # STASIS_FRESH in the job's environment (the plugin passes it): start from the beginning
    # rather than wait or be held when stasis cannot tell whether a checkpoint exists.
    parser.add_argument("--fresh", default="")
    args = parser.parse_args(argv)
    fresh, warning = fresh_if_unreachable(args.fresh)
    try:
        code, out = decide(args.job_id, args.uid, args.gid, args.label, fresh=fresh)
    except Exception as e:  # the job must start whatever happened here
        code, out = (
            EXIT_OFF,
            {
                "mode": "off",
                "messages": [
                    f"stasis: warning: internal error ({type(e).__name__}: {e}); {UNPROTECTED}"
                ],
            },
        )
    if warning:
        out.setdefault("messages", []).insert(0, f"stasis: warning: {warning}")
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
