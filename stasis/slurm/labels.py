"""Labels: which checkpoints a Slurm job may resume from, and the variables that opt a job in.

A job labels its checkpoints with STASIS_CHECKPOINT (or CEDANA_CHECKPOINT); without one the label
is the job id. Labels belong to their owner, as everywhere in stasis: a job looks only among its
own user's checkpoints of the label (the store lists and retains per (owner, label)), so two
users may pick the same label without ever seeing, resuming or retiring each other's. An explicit
label is meant to be resumed by a later job under another id, so any checkpoint of that label
taken from a Slurm job of the same user qualifies. A default (job id) label only matches
checkpoints taken by this very job: same id AND the same token (set at submit time in
AdminComment by our job_submit.lua), so a job that merely reuses the id after slurmctld started
clean never picks up an old checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stasis.slurm.cut import cut_of
from stasis.store import Manifest, Store, validate_label

ENABLE_VARS = ("STASIS_ENABLE", "CEDANA_ENABLE")
LABEL_VARS = ("STASIS_CHECKPOINT", "CEDANA_CHECKPOINT")
INTERVAL_VARS = ("STASIS_INTERVAL", "CEDANA_INTERVAL")


def resolve_label(explicit: str, job_id: str) -> tuple[str, bool]:
    """(label, whether it was given explicitly); raises UsageError for a malformed label."""
    if explicit:
        return validate_label(explicit), True
    return validate_label(job_id), False


def slurm_extra(
    job_id: str, token: str, explicit: bool, stdout: str, stderr: str
) -> dict[str, Any]:
    """What a checkpoint of a Slurm job records of it (the manifest's `extra`)."""
    return {
        "slurm": {
            "job_id": job_id,
            "token": token,
            "explicit_label": explicit,
            "stdout": stdout,
            "stderr": stderr,
        }
    }


def slurm_of(m: Manifest) -> dict[str, Any]:
    value = m.extra.get("slurm")
    return value if isinstance(value, dict) else {}


def _may_resume(m: Manifest, explicit: bool, uid: int, job_id: str, token: str) -> bool:
    """Whether this job (of user `uid`) may resume from `m` (the module's docstring)."""
    s = slurm_of(m)
    if m.uid != uid or not s:  # the store filtered by owner already; never trust one filter
        return False
    return explicit or (s.get("job_id") == job_id and s.get("token", "") == token)


def candidates(
    store: Store, label: str, explicit: bool, uid: int, job_id: str, token: str
) -> list[Manifest]:
    """Checkpoints this job (of user `uid`) may resume from, newest first."""
    return [m for m in store.list(label, uid=uid) if _may_resume(m, explicit, uid, job_id, token)]


def cut_candidates(
    manifests: Iterable[Manifest], label: str, explicit: bool, uid: int, job_id: str, token: str
) -> list[Manifest]:
    """The checkpoints of the cuts of the job labelled `label` (stasis.slurm.cut: each cut has a
    label of its own, `<label>.cut-<id>`) this job may resume from, newest first: from
    `manifests`, the user's (`store.list(uid=uid)`). A cut qualifies by the rule of
    `candidates`: each of its checkpoints that records a Slurm job (the batch tree's does; a
    part the launch agent started is a daemon's job, which records none) may be resumed, and
    one at least does; then every checkpoint of it counts (all the user's)."""
    mine = [
        m
        for m in manifests
        if (of := cut_of(m.label)) is not None and of[0] == label and m.uid == uid
    ]
    verdicts: dict[str, set[bool]] = {}
    for m in mine:
        if slurm_of(m):
            verdicts.setdefault(m.label, set()).add(_may_resume(m, explicit, uid, job_id, token))
    found = [m for m in mine if verdicts.get(m.label) == {True}]
    return sorted(found, key=lambda m: (m.created, m.id), reverse=True)
