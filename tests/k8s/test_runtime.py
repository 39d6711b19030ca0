"""How stasis-runc reads the command lines containerd's shim gives runc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stasis.k8s.runtime import Argv, _fresh_of


def test_create_as_the_shim_calls_it() -> None:
    a = Argv(
        [
            "--root",
            "/run/containerd/runc/k8s.io",
            "--log",
            "/b/log.json",
            "--log-format",
            "json",
            "create",
            "--bundle",
            "/b",
            "--pid-file",
            "/b/init.pid",
            "c1",
        ]
    )
    assert (a.command, a.root, a.globals["--log-format"]) == (
        "create",
        "/run/containerd/runc/" "k8s.io",
        "json",
    )
    assert a.option("--bundle", "-b") == "/b" and a.option("--pid-file") == "/b/init.pid"
    assert a.positionals() == ["c1"]


def test_kill_and_delete_and_the_default_root() -> None:
    a = Argv(["--root=/r", "kill", "--all", "c1", "15"])
    assert (a.command, a.root, a.positionals(), a.flag("--all")) == (
        "kill",
        "/r",
        ["c1", "15"],
        True,
    )
    d = Argv(["delete", "--force", "c2"])
    assert (d.command, d.root, d.positionals()) == ("delete", "/run/runc", ["c2"])


@pytest.mark.parametrize(
    "value, fresh",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("if-unreachable", True),
        (" True ", True),
        ("", False),
        ("0", False),
        ("false", False),
        ("no", False),
        ("always", False),
        ("sometimes", False),
    ],
)
def test_stasis_fresh_means_what_it_means_for_a_slurm_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], value: str, fresh: bool
) -> None:
    """One meaning everywhere (stasis.config.fresh_if_unreachable): a container's STASIS_FRESH
    starts it fresh only when nobody can tell whether it has a checkpoint; 'always fresh' is
    no value (a restarted container keeps its env: it would throw every stop's checkpoint
    away), and an unknown value is one line in the container's log, then ignored."""
    (tmp_path / "config.json").write_text(
        json.dumps({"process": {"env": ["STASIS_CHECKPOINT=l", f"STASIS_FRESH={value}"]}})
    )
    assert _fresh_of(tmp_path) is fresh
    said = capfd.readouterr().err
    if value.strip().lower() in ("always", "sometimes"):
        assert said.count("\n") == 1 and f"STASIS_FRESH='{value}'" in said and "ignored" in said
    else:
        assert said == ""
