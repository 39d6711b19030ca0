"""Another node's parts of a Slurm job, reached as root over that node's remote listener: what the
coordinator of a cut across nodes (stasis.slurm.cut) asks of each node but its own.

`RemoteParts(settings, node, slurm_job)` has the methods of stasis.client.Client that a cut uses
(`freeze`, `dump` of a frozen part, `thaw`, `delete_checkpoint`), and what it restores on
requeue asks (`listing`, `net`, `restore`, `kill`), each one request to
`POST /slurm/remote/parts/{job}/{part}/...` with a munge credential of the caller (root only:
the node refuses anyone else) binding the operation, the Slurm job, the part, the node, the
cluster and every field of the request. The node acts only on a part it started for that Slurm
job (stasis.slurm.parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Unpack, cast

from stasis import routes, wire
from stasis.errors import UsageError
from stasis.slurm import remote

if TYPE_CHECKING:
    from stasis.config import Settings


class RemoteParts:
    """Slurm job `slurm_job`'s parts on the node `target` (see the module's docstring)."""

    def __init__(self, settings: Settings, target: remote.RemoteNode, slurm_job: str) -> None:
        self.settings = settings
        self.target = target
        self.slurm_job = slurm_job

    def _call(
        self, route: routes.AnyRoute, op: str, part: str, fields: dict[str, object]
    ) -> object:
        args = {"job": self.slurm_job, "part": part}
        return remote.part_call(self.settings, self.target, route, op, args, fields)

    def freeze(self, job_id: str, **request: Unpack[wire.FreezeRequest]) -> wire.FreezeAnswer:
        fields: dict[str, object] = {"timeout_s": float(request.get("timeout_s", 60.0))}
        answer = self._call(routes.SLURM_REMOTE_PART_FREEZE, "part-freeze", job_id, fields)
        return cast("wire.FreezeAnswer", answer)

    def dump(
        self,
        job_id: str,
        progress: Callable[[int, int], None] | None = None,
        **request: Unpack[wire.DumpRequest],
    ) -> wire.DumpAnswer:
        if not request.get("frozen") or not request.get("label"):
            raise UsageError(
                "another node's part is dumped only frozen, for a cut, with the cut's label"
            )
        # Every field the route's model has, None included: the credential binds them all.
        fields: dict[str, object] = {
            "label": request["label"],
            "reason": request.get("reason", "asked"),
            "cut_parts": request.get("cut_parts"),
            "cut_key": request.get("cut_key"),
        }
        answer = self._call(routes.SLURM_REMOTE_PART_DUMP, "part-dump", job_id, fields)
        return cast("wire.DumpAnswer", answer)

    def thaw(self, job_id: str, **request: Unpack[wire.ThawRequest]) -> wire.ThawAnswer:
        fields: dict[str, object] = {"stop": bool(request.get("stop", False))}
        answer = self._call(routes.SLURM_REMOTE_PART_THAW, "part-thaw", job_id, fields)
        return cast("wire.ThawAnswer", answer)

    def listing(self) -> wire.SlurmPartList:
        """The job's live parts on the node."""
        answer = remote.part_call(
            self.settings,
            self.target,
            routes.SLURM_REMOTE_PART_LIST,
            "part-list",
            {"job": self.slurm_job},
            {},
        )
        return cast("wire.SlurmPartList", answer)

    def net(self, held: bool) -> wire.SlurmPartNet:
        """Hold the job's network on the node still, or let it go (a cut being restored)."""
        answer = remote.part_call(
            self.settings,
            self.target,
            routes.SLURM_REMOTE_PART_NET,
            "part-net",
            {"job": self.slurm_job},
            {"held": held},
        )
        return cast("wire.SlurmPartNet", answer)

    def restore(self, checkpoint: str, part: str) -> wire.RestoreAnswer:
        """Restore part `part`'s checkpoint of a cut on the node, as that part again."""
        answer = remote.part_call(
            self.settings,
            self.target,
            routes.SLURM_REMOTE_PART_RESTORE,
            "part-restore",
            {"job": self.slurm_job},
            {"checkpoint": checkpoint, "part": part},
        )
        return cast("wire.RestoreAnswer", answer)

    def kill(self, part: str) -> wire.SlurmPartSignalled:
        """SIGKILL to the part (a restore that could not bring every part back)."""
        return remote.signal_part(self.settings, self.target, self.slurm_job, part, "KILL")

    def delete_checkpoint(self, checkpoint_id: str) -> wire.Deleted:
        args = {"job": self.slurm_job, "checkpoint": checkpoint_id}
        answer = remote.part_call(
            self.settings, self.target, routes.SLURM_REMOTE_PART_DELETE, "part-delete", args, {}
        )
        return cast("wire.Deleted", answer)


__all__ = ["RemoteParts"]
