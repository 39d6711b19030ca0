"""The verdicts of `stasis verify` that nodes report (stasis.wire.VerifyVerdict), kept with the
checkpoint they speak of and shown by the API, the CLI and the dashboard as `ok`,
`failed: REASON` or `not verified`.

A node reports a verdict in the result of a `verify` command (the checkpoint the control plane
asked it to verify: stasis.controlplane.policies) and in its heartbeats (every verification it
ran, the background ones too). A verdict is kept only for a checkpoint of the reporting node's
own cluster: one about another cluster's checkpoint, or about one the control plane never heard
of, changes nothing and tells the node nothing. The newest verdict (by its time) stands; the
same verdict reported twice counts once.

The control plane cannot check a verdict's signature (it holds no site key): it believes a node
of the cluster about that cluster's checkpoints. `stasis restore --verified` on a node reads the
signed verdict in the store's catalog, never this. Kept by stasis.controlplane.reports.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field

from stasis.controlplane import wire

# A checkpoint id as nodes may report it (the registry and the migration check it too).
CHECKPOINT_ID = r"^[A-Za-z0-9._-]{1,64}$"
_TEXT = r"^[^\x00-\x1f\x7f]*$"
REASON_MAX = 1000
_COLUMNS = (
    "verified_ok",
    "verify_reason",
    "verified_by",
    "verified_at",
    "verify_duration_s",
    "verify_processes",
)


def _one_line(value: object) -> object:
    """A reason as one line, cut to REASON_MAX: the engine's message may be long or wrap,
    which is no cause to refuse a whole heartbeat (control characters still are)."""
    return " ".join(value.split())[:REASON_MAX] if isinstance(value, str) else value


class VerdictReport(BaseModel):
    """A verdict as a node sends it. Fields a newer node adds are ignored, not refused: a
    heartbeat that carries one must not fail on an older control plane."""

    model_config = ConfigDict(extra="ignore")
    checkpoint: str = Field(pattern=CHECKPOINT_ID)
    ok: bool
    reason: Annotated[str, BeforeValidator(_one_line)] = Field(
        default="", max_length=REASON_MAX, pattern=_TEXT
    )
    node: str = Field(default="", max_length=200, pattern=_TEXT)  # the host, as it says
    at: AwareDatetime
    duration_s: float = Field(default=0.0, ge=0, le=366 * 86400)
    processes: int = Field(default=0, ge=0, le=10_000_000)


def said(v: wire.Verdict | None) -> str:
    """One word or line: ok, failed: REASON, not verified."""
    if v is None:
        return "not verified"
    return "ok" if v["ok"] else f"failed: {v['reason']}"


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint row as the API shows it: its verdict as one object (`verdict`, None when
    never verified) and one line (`verified`), in place of the columns that hold it."""
    out = {k: v for k, v in row.items() if k not in _COLUMNS}
    verdict: wire.Verdict | None = None
    if row.get("verified_ok") is not None:
        verdict = {
            "ok": bool(row["verified_ok"]),
            "reason": row["verify_reason"] or "",
            "node": row["verified_by"],
            "at": datetime.fromtimestamp(float(row["verified_at"]), UTC).isoformat(
                timespec="seconds"
            ),
            "duration_s": row["verify_duration_s"],
            "processes": row["verify_processes"],
        }
    return {**out, "verdict": verdict, "verified": said(verdict)}


def event(checkpoint: str, node: str, v: VerdictReport) -> str:
    """The event a new verdict makes."""
    if v.ok:
        return (
            f"checkpoint {checkpoint} verified on node {node}: it restores "
            f"({v.processes} process(es) came back in {v.duration_s:.2f} s)"
        )
    return (
        f"checkpoint {checkpoint} failed verification on node {node}: "
        f"{v.reason or 'no reason given'}"
    )
