"""Every path under the state directory, named once.

<state_dir>/
    jobs.db         the daemon's SQLite database: jobs, network locks, integrations' tables
    logs/           job logs (users traverse to theirs)
    jobs/<id>/      a job's own directory: its supervisor writes exit.json there
    criu-logs/      CRIU's logs, one per dump or restore
    scratch/        checkpoints unpacked or fetched for a restore
    staging/        dumps to a store that is not a local directory, until published
    dumps/          dumps in flight (stasis/daemon/inflight.py)
    keys/node.key   the node's signing key (stasis/store/signing.py)
    stores/<hash>   the local stores this node has used, by id (stasis/store/marker.py)
    slurm/          Slurm registrations of an older daemon (moved into jobs.db at start)
    slurm-held/<job>  Slurm jobs this node requeued held, and why (stasis/slurm/held.py)
    records/<table>/  integrations' rows kept to rebuild jobs.db (daemon/records.py)
"""

from __future__ import annotations

from pathlib import Path


class StateLayout:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir

    @property
    def db(self) -> Path:
        return self.root / "jobs.db"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs / job_id

    @property
    def criu_logs(self) -> Path:
        return self.root / "criu-logs"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def known_stores(self) -> Path:
        return self.root / "stores"

    @property
    def slurm_held(self) -> Path:
        return self.root / "slurm-held"

    @property
    def records(self) -> Path:
        return self.root / "records"

    @property
    def legacy_slurm(self) -> Path:
        return self.root / "slurm"
