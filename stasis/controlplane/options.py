"""The control plane service's options, as `stasis controlplane serve` resolved them (flags over
settings): one record handed to the API's and the dashboard's handlers and the policy loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stasis.controlplane import intervals, policies


@dataclass(frozen=True)
class ServerOptions:
    lost_after_s: float  # a node silent this long is lost
    lease_s: float = 60.0  # how long a node holds a command it leased
    session_ttl_s: int = 8 * 3600  # a dashboard session's life
    cache_dir: Path = Path("/var/lib/stasis/controlplane")  # the installers' wheel
    min_interval_s: int = policies.MIN_INTERVAL_S  # the shortest periodic policy
    behind_tls: bool = False  # a TLS proxy in front: its URL is https://
    max_interval_s: int = policies.MAX_INTERVAL_S  # an `every auto` policy's ceiling

    @property
    def bounds(self) -> intervals.Bounds:
        """An `every auto` policy's floor and ceiling (stasis.controlplane.intervals)."""
        return intervals.Bounds(self.min_interval_s, self.max_interval_s)
