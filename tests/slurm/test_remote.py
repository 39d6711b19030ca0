"""stasis.slurm.remote and the Slurm integration's remote listener, with a real munged (its own
key and socket) and a real daemon listening on a loopback port; no Slurm is needed for what is
tested here (the credential and the request are checked before Slurm is asked anything).
tests/e2e/test_slurm_remote.py has the same commands on a real Slurm cluster."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stasis.config import Settings, load_settings
from stasis.errors import (
    DaemonAPIError,
    NotFoundError,
    PermissionDeniedError,
    SlurmError,
    UsageError,
)
from stasis.slurm import remote
from tests.conftest import STASIS, TEST_USER, Daemon, new_daemon, wait_for

NODE = "n1"
CLUSTER = "remote-test"


class Munge:
    """A munged of our own: its key, socket and log in a directory of its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = str(root / "munge.sock")
        self.pid = 0

    def start(self) -> None:
        user = pwd.getpwnam("munge")
        self.root.mkdir(exist_ok=True)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        os.chmod(self.root, 0o755)  # munged refuses 0700; other users reach the socket
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chown(key, user.pw_uid, user.pw_gid)
        os.chmod(key, 0o400)
        r = self.root
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--log-file={r}/munged.log",
                f"--pid-file={r}/munged.pid",
                f"--seed-file={r}/munged.seed",
                "--force",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        wait_for(lambda: Path(self.socket).exists() and (r / "munged.pid").exists(), 10, "munged")
        self.pid = int((r / "munged.pid").read_text())

    def stop(self) -> None:
        if self.pid:
            os.kill(self.pid, 15)
            wait_for(lambda: not Path(f"/proc/{self.pid}").exists(), 10, "munged to stop")
            self.pid = 0

    def credential(self, payload: bytes, user: str | None = None, *extra: str) -> str:
        """A credential as `user` makes it with munge (root without)."""
        argv = ["munge", "--socket", self.socket, "--restrict-uid", "0", *extra]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        return (
            subprocess.run(argv, input=payload, capture_output=True, check=True, timeout=30)
            .stdout.decode()
            .strip()
        )


@pytest.fixture(scope="module")
def world() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="stasis-remote-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def munge(world: Path) -> Iterator[Munge]:
    m = Munge(world / "munge")
    m.start()
    yield m
    m.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slurm_conf(world: Path, munge: Munge, cluster: str = CLUSTER) -> Path:
    path = world / f"slurm-{cluster}.conf"
    path.write_text(
        f"# not a cluster: the keys stasis reads\nClusterName={cluster}\n"
        f"AuthType=auth/munge\nAuthInfo=socket={munge.socket},cred_expire=5\n"
    )
    return path


class Node:
    """A daemon standing in for node n1 of CLUSTER, with its remote listener on."""

    def __init__(self, daemon: Daemon, port: int, conf: Path) -> None:
        self.daemon = daemon
        self.port = port
        self.settings = Settings(
            slurm_conf=str(conf), slurm_remote_port=port, slurm_node_name="login"
        )
        self.target = remote.RemoteNode(node=NODE, address="127.0.0.1", port=port, timeout_s=30)

    def payload(self, op: str, **fields: object) -> bytes:
        return remote.encode_payload(remote.request_payload(op, NODE, CLUSTER, **fields))

    def post(self, path: str, body: dict[str, object]) -> Any:
        return self.target.send("POST", path, body)


@pytest.fixture(scope="module")
def node(world: Path, munge: Munge) -> Iterator[Node]:
    port = _free_port()
    conf = _slurm_conf(world, munge)
    d = new_daemon(
        world,
        "node",
        env={
            "STASIS_SLURM_REMOTE_PORT": str(port),
            "STASIS_SLURM_NODE_NAME": NODE,
            "SLURM_CONF": str(conf),
            "STASIS_REQUEST_TIMEOUT_S": "2",
        },
    )
    d.start()
    wait_for(lambda: _connects(port), 20, "the remote listener")
    yield Node(d, port, conf)
    d.stop()


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# -- slurm.conf ---------------------------------------------------------------------------------


def test_slurm_conf_names_the_cluster_and_munge_socket() -> None:
    conf = remote.parse_slurm_conf(
        "# AuthInfo=socket=/not/this\n"
        "clustername=hpc   # a comment\n"
        "NodeName=n1 NodeAddr=10.0.0.1 CPUs=2\n"
        "AUTHINFO=cred_expire=30,socket=/run/munge/other.sock\n"
    )
    assert conf == remote.SlurmConf(cluster="hpc", munge_socket="/run/munge/other.sock")
    assert remote.parse_slurm_conf("AuthInfo=cred_expire=30\n").munge_socket is None
    assert remote.slurm_conf(Settings(slurm_conf="/nonexistent/slurm.conf")) == remote.SlurmConf(
        cluster="", munge_socket=None
    )


def test_port_setting_is_a_port() -> None:
    assert (
        load_settings({"STASIS_SLURM_REMOTE_PORT": "6821", "STASIS_CONFIG": ""}).slurm_remote_port
        == 6821
    )
    with pytest.raises(UsageError, match="not a TCP port"):
        load_settings({"STASIS_SLURM_REMOTE_PORT": "70000"})


# -- credentials --------------------------------------------------------------------------------


def test_credential_says_who_made_it_once(munge: Munge) -> None:
    user = pwd.getpwnam(TEST_USER)
    cred = munge.credential(b'{"op":"x"}', TEST_USER)
    who = remote.verify_credential(cred, munge.socket)
    assert (who.uid, who.gid, who.payload) == (user.pw_uid, user.pw_gid, b'{"op":"x"}')
    with pytest.raises(PermissionDeniedError, match="replayed"):
        remote.verify_credential(cred, munge.socket)
    # Ours: made as root, decoded by root.
    mine = remote.make_credential(b"payload", munge.socket)
    assert remote.verify_credential(mine, munge.socket).uid == 0


def test_expired_forged_and_garbage_credentials_are_refused(munge: Munge, world: Path) -> None:
    old = munge.credential(b"{}", None, "--ttl", "1")
    time.sleep(2.2)
    with pytest.raises(PermissionDeniedError, match="expired"):
        remote.verify_credential(old, munge.socket)
    other = Munge(world / "other-munge")
    other.start()
    try:
        foreign = other.credential(b"{}")
    finally:
        other.stop()
    with pytest.raises(PermissionDeniedError, match="another munge key"):
        remote.verify_credential(foreign, munge.socket)
    for garbage in ("", "MUNGE:", "hello", "MUNGE:AAAA:\nMUNGE:AAAA:", "x" * 5000):
        with pytest.raises(PermissionDeniedError, match="not a munge credential"):
            remote.verify_credential(garbage, munge.socket)
    with pytest.raises(PermissionDeniedError, match="refused: its version is unknown"):
        remote.verify_credential("MUNGE:AAAA:", munge.socket)


def test_munged_gone_is_one_line(world: Path) -> None:
    with pytest.raises(SlurmError, match="cannot make a munge credential: .*nowhere.sock"):
        remote.make_credential(b"{}", str(world / "nowhere.sock"))
    with pytest.raises(SlurmError, match="cannot reach munged at .*nowhere.sock"):
        remote.verify_credential("MUNGE:AAAA:", str(world / "nowhere.sock"))


def test_payload_must_name_this_request() -> None:
    expected = remote.request_payload(
        "checkpoint", "n1", "hpc", job="7", leave_running=False, reason="asked"
    )

    def said(**changes: object) -> remote.Identity:
        return remote.Identity(1000, 1000, remote.encode_payload({**expected, **changes}))

    remote.check_payload(said(), expected)
    for changes, key in (
        ({"node": "n2"}, "node"),
        ({"cluster": "other"}, "cluster"),
        ({"op": "drain"}, "op"),
        ({"job": "8"}, "job"),
        ({"leave_running": True}, "leave_running"),
        ({"extra": 1}, "extra"),
        ({"v": 2}, "v"),
    ):
        with pytest.raises(PermissionDeniedError, match=f"another request \\({key} "):
            remote.check_payload(said(**changes), expected)
    with pytest.raises(PermissionDeniedError, match="no stasis request"):
        remote.check_payload(remote.Identity(0, 0, b"[1]"), expected)


# -- the listener -------------------------------------------------------------------------------


def test_remote_checkpoint_reaches_the_node_as_the_caller(node: Node, munge: Munge) -> None:
    # Root's credential, through the client: the node looked the job up (not under stasis).
    with pytest.raises(
        NotFoundError,
        match=r"Slurm job 4242 is not under stasis on this node " r"\(node n1 at 127.0.0.1:\d+\)",
    ):
        remote.checkpoint(node.settings, node.target, "4242", leave_running=True)
    fields: dict[str, object] = {"leave_running": False, "reason": "asked"}
    cred = munge.credential(node.payload("checkpoint", job="4243", **fields), TEST_USER)
    body = {"credential": cred, **fields}
    with pytest.raises(NotFoundError):
        node.post("/slurm/remote/jobs/4243/checkpoint", body)
    # The same credential again: munge refuses the replay, before anything else.
    with pytest.raises(PermissionDeniedError, match="replayed"):
        node.post("/slurm/remote/jobs/4243/checkpoint", body)
    log = (node.daemon.root / "daemon.log").read_text()
    assert "refused a remote Slurm checkpoint" in log and cred not in log
    assert f"uid {pwd.getpwnam(TEST_USER).pw_uid} from 127.0.0.1" in log


def test_a_credential_for_another_request_is_refused(node: Node, munge: Munge) -> None:
    fields: dict[str, object] = {"leave_running": True, "reason": "asked"}
    cases = [
        # (what the credential says, the path it is sent to, the body's fields, refused key)
        (node.payload("checkpoint", job="1", **fields), "2", fields, "job"),
        (
            node.payload("checkpoint", job="1", leave_running=False, reason="asked"),
            "1",
            fields,
            "leave_running",
        ),
        (
            remote.encode_payload(
                remote.request_payload("checkpoint", "n2", CLUSTER, job="1", **fields)
            ),
            "1",
            fields,
            "node",
        ),
        (
            remote.encode_payload(
                remote.request_payload("checkpoint", NODE, "elsewhere", job="1", **fields)
            ),
            "1",
            fields,
            "cluster",
        ),
        (node.payload("drain", reason="asked"), "1", fields, "op"),
    ]
    for payload, job, body, key in cases:
        cred = munge.credential(payload, TEST_USER)
        with pytest.raises(PermissionDeniedError, match=f"another request \\({key} "):
            node.post(f"/slurm/remote/jobs/{job}/checkpoint", {"credential": cred, **body})


def test_only_root_drains(node: Node, munge: Munge) -> None:
    cred = munge.credential(node.payload("drain", reason="maintenance"), TEST_USER)
    with pytest.raises(PermissionDeniedError, match="only root drains a node"):
        node.post("/slurm/remote/drain", {"credential": cred, "reason": "maintenance"})
    # A credential that is not munge's is no identity at all.
    with pytest.raises(PermissionDeniedError, match="not a munge credential"):
        node.post("/slurm/remote/drain", {"credential": "root, trust me", "reason": "x"})


def test_bad_requests_are_one_line_each(node: Node, munge: Munge) -> None:
    cred = munge.credential(node.payload("checkpoint", job="1"), TEST_USER)
    with pytest.raises(UsageError, match="not a Slurm job id"):
        node.post("/slurm/remote/jobs/..%2F1/checkpoint", {"credential": cred})
    with pytest.raises(UsageError, match="bad request: extra"):
        node.post("/slurm/remote/jobs/1/checkpoint", {"credential": cred, "extra": 1})
    with pytest.raises(UsageError, match="bad request: reason"):
        node.post("/slurm/remote/drain", {"credential": cred, "reason": "a\nb"})
    with pytest.raises(UsageError, match="413"):
        node.post("/slurm/remote/drain", {"credential": "x" * 20000})
    with pytest.raises(UsageError, match="404"):
        node.post("/slurm/jobs/1/checkpoint", {})  # the unix socket's routes are not here


def test_a_stalled_client_is_cut_off(node: Node) -> None:
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(b"POST /slurm/remote/drain HTTP/1.1\r\n")
        start = time.monotonic()
        assert s.recv(100) == b""  # closed by the daemon, headers never finished
        assert time.monotonic() - start < 8


def test_unreachable_node_is_one_line(node: Node) -> None:
    port = _free_port()
    nowhere = remote.RemoteNode(node="n9", address="127.0.0.1", port=port)
    with pytest.raises(DaemonAPIError) as e:
        remote.checkpoint(node.settings, nowhere, "1", leave_running=True)
    assert str(e.value) == (
        f"cannot reach the stasis daemon of node n9 at 127.0.0.1:{port} "
        f"(connection refused); is it running there with "
        f"slurm_remote_port = {port}?"
    )
    with pytest.raises(UsageError, match="remote Slurm commands are off here"):
        remote.remote_node(Settings(), "n9", "127.0.0.1")


def test_a_taken_port_stops_the_daemon_at_start(node: Node, world: Path) -> None:
    d = new_daemon(world, "taken", env={"STASIS_SLURM_REMOTE_PORT": str(node.port)})
    result = subprocess.run(
        [STASIS, "daemon"], env=d.env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert (
        f"cannot listen for remote Slurm commands on *:{node.port} (slurm_remote_port): "
        "Address already in use" in result.stderr
    )


def test_cli_drain_refuses_a_bad_reason() -> None:
    result = subprocess.run(
        [STASIS, "slurm", "drain", "n1", "--reason", "bad\nreason"],
        env={**os.environ, "STASIS_CONFIG": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--reason" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
