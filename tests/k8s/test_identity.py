"""Which credentials a container's OCI spec gives its processes, and the restore's comparison of
a checkpoint's copy of its spec with the new container's (stasis.k8s.containers.same_identity;
through containerd and runc: tests/e2e/test_containerd.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stasis.errors import ContainerError
from stasis.k8s.containers import identity, same_identity

CAPS = ["CAP_CHOWN", "CAP_KILL", "CAP_NET_BIND_SERVICE"]


def spec(
    uid: int = 1000, gid: int = 1000, caps: list[str] | None = None, **linux: Any
) -> dict[str, Any]:
    sets = {
        name: list(caps if caps is not None else CAPS)
        for name in ("bounding", "effective", "permitted")
    }
    return {
        "process": {
            "user": {"uid": uid, "gid": gid, "additionalGids": [gid, 5]},
            "capabilities": sets,
            "args": ["sh"],
            "env": ["A=1"],
        },
        "linux": linux,
    }


def files(tmp_path: Path, was: dict[str, Any], now: dict[str, Any]) -> tuple[Path, Path]:
    (tmp_path / "spec.dump").write_text(json.dumps(was))
    (tmp_path / "config.json").write_text(json.dumps(now))
    return tmp_path / "spec.dump", tmp_path / "config.json"


def test_the_same_identity_resumes_whatever_else_differs(tmp_path: Path) -> None:
    now = spec()
    now["process"]["env"] = ["A=2"]  # a new pod: other env, args, mounts
    now["process"]["capabilities"]["bounding"].reverse()  # order is not meaning
    same_identity("c1", *files(tmp_path, spec(), now))


@pytest.mark.parametrize(
    "now, says",
    [
        (spec(uid=0), "uid 1000 there, 0 here"),
        (spec(gid=0), "gid 1000 there, 0 here"),
        (
            spec(caps=[*CAPS, "CAP_SYS_ADMIN"]),
            "bounding capabilities [CAP_CHOWN,CAP_KILL,CAP_NET_BIND_SERVICE] there, "
            "[CAP_CHOWN,CAP_KILL,CAP_NET_BIND_SERVICE,CAP_SYS_ADMIN] here",
        ),
        (
            spec(caps=[]),
            "effective capabilities [CAP_CHOWN,CAP_KILL,CAP_NET_BIND_SERVICE] there, " "none here",
        ),
        (
            spec(uidMappings=[{"containerID": 0, "hostID": 100000, "size": 65536}]),
            "uid mappings none there, [0:100000:65536] here",
        ),
    ],
    ids=[
        "runAsUser 0",
        "runAsGroup 0",
        "a capability added",
        "capabilities dropped",
        "a user namespace",
    ],
)
def test_other_credentials_are_refused_in_one_line(
    tmp_path: Path, now: dict[str, Any], says: str
) -> None:
    with pytest.raises(ContainerError) as e:
        same_identity("20261206T000000Z-abcdef", *files(tmp_path, spec(), now))
    text = str(e.value)
    assert text.startswith(
        "checkpoint 20261206T000000Z-abcdef refused: it was taken of a "
        "container with other credentials ("
    )
    assert says in text and "\n" not in text
    # And the reverse: an unprivileged container does not resume a privileged one's.
    with pytest.raises(ContainerError):
        same_identity("x", *files(tmp_path, now, spec()))


def test_a_checkpoint_without_its_spec_or_with_a_hostile_one_is_refused(tmp_path: Path) -> None:
    recorded, config = files(tmp_path, spec(), spec())
    recorded.unlink()
    with pytest.raises(
        ContainerError,
        match=r"^checkpoint c1 refused: it has no copy of its " r"container's spec \(spec.dump\)",
    ):
        same_identity("c1", recorded, config)
    recorded.write_bytes(b"[" * 5_000_000)  # larger than any spec; never parsed whole
    with pytest.raises(ContainerError, match="larger than"):
        same_identity("c1", recorded, config)
    recorded.write_text('{"process": "root"}')  # not the shape of a spec: nobody's identity
    with pytest.raises(ContainerError, match="uid 0 there, 1000 here"):
        same_identity("c1", recorded, config)


def test_identity_reads_only_credentials() -> None:
    assert identity(spec()) == {
        "uid": 1000,
        "gid": 1000,
        "additional gids": [5, 1000],
        "bounding capabilities": CAPS,
        "effective capabilities": CAPS,
        "permitted capabilities": CAPS,
        "inheritable capabilities": [],
        "ambient capabilities": [],
        "uid mappings": [],
        "gid mappings": [],
    }
