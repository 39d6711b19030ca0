"""The control plane's test nodes as hosts of their own (`new_daemon(..., separate=True)`): one
private network per test session (stasis/dev/nodehost.py), made when the first such node is, and a
node for each separate daemon, which keeps it across the daemon's restarts; all ended at the
session's end (`close_all`, from conftest's session fixture).

Shared with every node, as a real site shares its home directories and its store: the file
system but for /tmp, /var/tmp, /dev/shm and /run, and under those the paths `shared_paths` names
(the test's scratch directories, where the stores, the daemons' sockets and state live, pytest's
base directory, this repository and Python). Services the nodes talk to over TCP (the control
plane) listen on `site_address()`, this machine's address on the nodes' network."""

from __future__ import annotations

import getpass
import sys
import tempfile
import threading
from pathlib import Path

from stasis.dev import nodehost

ROOT = Path(__file__).resolve().parent.parent
# Ids 220..251: the local Slurm clusters take theirs from 20..219.
_FIRST_NET, _LAST_NET = 220, 251

_lock = threading.Lock()
_net: nodehost.Net | None = None
_nodes: list[nodehost.NodeHost] = []


def site_net() -> nodehost.Net:
    """The session's network of nodes (made on first use)."""
    global _net
    with _lock:
        if _net is None:
            _net = nodehost.claim_net(_FIRST_NET, _LAST_NET)
        return _net


def site_address() -> str:
    """This machine's address as the nodes reach it."""
    return site_net().host_addr


def shared_paths(*more: Path) -> list[str]:
    base = Path(tempfile.gettempdir())
    return sorted(
        {
            str(base / f"pytest-of-{getpass.getuser()}"),
            str(ROOT),
            sys.prefix,
            sys.base_prefix,
            *(str(p) for p in more),
        }
    )


def make_node(name: str, state_dir: Path, *shared: Path) -> nodehost.NodeHost:
    """A node of its own named `name` (its host name), on the session's network."""
    net = site_net()
    with _lock:
        index = len(_nodes)
        if index >= nodehost.HOST_OCTET - 1:
            raise RuntimeError("more than 253 separate nodes in one test session")
        node = nodehost.make_node(net, index, name, state_dir, shared_paths(*shared))
        _nodes.append(node)
    return node


def close_all() -> None:
    global _net
    with _lock:
        for node in _nodes:
            node.close()
        _nodes.clear()
        if _net is not None:
            nodehost.release_net(_net)
            _net = None
