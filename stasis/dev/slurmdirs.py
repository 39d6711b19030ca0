"""The directories and state file of a throwaway local Slurm cluster (stasis.dev.slurmcluster),
shared with its accounting (stasis.dev.slurmaccounting)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stasis.dev.nodehost import Net

NODE = "n1"  # the one node of a one-node cluster


@dataclass(frozen=True)
class SlurmClusterDirs:
    """Where a local cluster keeps what (the tree in stasis.dev.slurmcluster's docstring)."""

    root: Path

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def munge(self) -> Path:
        return self.root / "munge"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def stasis(self) -> Path:
        return self.root / "stasis"

    @property
    def stasis_config(self) -> Path:
        """The stasis config a client on this machine uses: the one node's, or the first's."""
        nodes = self.nodes()
        if len(nodes) > 1:
            return self.node_config(nodes[0])
        return self.stasis / "config.toml"

    @property
    def stasis_socket(self) -> Path:
        return self.stasis / "stasis.sock"

    @property
    def store(self) -> Path:
        return self.stasis / "store"

    @property
    def site_key(self) -> Path:
        return self.stasis / "site.key"

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def state_file(self) -> Path:
        return self.root / "cluster.json"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def node_config(self, node: str) -> Path:
        return self.node_dir(node) / "config.toml"

    def node_socket(self, node: str) -> Path:
        return self.node_dir(node) / "stasis.sock"

    def nodes(self) -> list[str]:
        """The cluster's node names (from cluster.json; one node when it says none)."""
        return read_state(self).get("nodes") or [NODE]

    def config_of(self, node: str) -> Path:
        """The stasis config of `node`'s daemon."""
        if len(self.nodes()) > 1:
            return self.node_config(node)
        return self.stasis / "config.toml"

    def host_address(self) -> str:
        """This machine's address as the nodes see it (the bridge's; 127.0.0.1 on one node)."""
        state = read_state(self)
        return Net(int(state["net_id"])).host_addr if "net_id" in state else "127.0.0.1"

    def env(self) -> dict[str, str]:
        """What a client needs to talk to this cluster and its stasis daemon."""
        return {"SLURM_CONF": str(self.slurm_conf), "STASIS_CONFIG": str(self.stasis_config)}


def read_state(lay: SlurmClusterDirs) -> dict[str, Any]:
    """cluster.json: what `up` started, the nodes and their network ({} when there is none)."""
    try:
        data = json.loads(lay.state_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(lay: SlurmClusterDirs, state: dict[str, Any]) -> None:
    tmp = lay.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(lay.state_file)
