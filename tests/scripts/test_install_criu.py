"""scripts/install-criu.sh picks the CRIU to build for real, against Debian's archive, without
building it (STASIS_CRIU_PREPARE_ONLY=1: fetch, verify, unpack, patch, stop) and into a private
prefix: the pinned version with its sha256, or, where the archive no longer carries the pin,
the newest CRIU >= 4.2 verified by apt's signed Sources index, saying so; a patch that does not
apply to it stops the run with what to do; an installed build that matches its stamp needs no
network."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install-criu.sh"
PATCHES = sorted((ROOT / "patches" / "criu").glob("*.patch"))
PIN = "4.2.1"
RUNDIR = "/run/stasis-criu"
NO_NETWORK = "file:/nonexistent/debian"  # no archive there: a run that goes to it fails
STEP = re.compile(r"^\[install-criu\] (.*)$", re.M)


def install_criu(
    prefix: Path, script: Path = SCRIPT, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STASIS_CRIU_")}
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**base, "STASIS_CRIU_PREFIX": str(prefix), **env},
    )


def steps(result: subprocess.CompletedProcess[str]) -> list[str]:
    return STEP.findall(result.stdout)


def patchset_sha(patches: list[Path]) -> str:
    """What the script hashes: each patch's name and contents, in application order."""
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\n" + p.read_bytes())
    return h.hexdigest()


def fake_install(prefix: Path, version: str, stamp: str) -> None:
    (prefix / "sbin").mkdir(parents=True)
    criu = prefix / "sbin" / "criu"
    criu.write_text(f"#!/bin/sh\necho 'Version: {version}'\n")
    criu.chmod(0o755)
    (prefix / "share" / "criu").mkdir(parents=True)
    (prefix / "share" / "criu" / "rpc.proto").write_text('syntax = "proto2";\n')
    (prefix / "share" / "stasis").mkdir(parents=True)
    (prefix / "share" / "stasis" / "criu.stamp").write_text(stamp + "\n")


def test_a_pin_the_archive_lacks_falls_back_to_the_newest_criu_verified_by_apt(
    tmp_path: Path,
) -> None:
    result = install_criu(tmp_path, STASIS_CRIU_PIN="9.9.9", STASIS_CRIU_PREPARE_ONLY="1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = steps(result)
    summary = [
        m
        for line in lines
        if (
            m := re.fullmatch(
                r"criu 9\.9\.9 is no longer in Debian unstable; building (\S+) instead, verified by "
                r"apt's signed Sources index \(not by the pinned sha256\); "
                rf"all {len(PATCHES)} patches applied",
                line,
            )
        )
    ]
    assert len(summary) == 1, lines
    version = summary[0].group(1)
    assert tuple(map(int, version.split(".")[:2])) >= (4, 2), version
    # apt-helper checked the tarball against the signed index's hash; no pinned sha256 claimed
    assert any(
        re.fullmatch(
            rf"download criu_{re.escape(version)}\.orig\.tar\.\w+ \(apt-helper "
            r"checks it against SHA(256|512) from the signed Sources index\)",
            line,
        )
        for line in lines
    ), lines
    assert any(
        line.startswith(f"verified criu_{version}.orig.tar.")
        and "by apt's signed Sources index only" in line
        for line in lines
    ), lines
    assert lines[-1].startswith(f"STASIS_CRIU_PREPARE_ONLY=1: criu {version} fetched")
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing installed


def test_the_pinned_version_is_held_to_its_sha256(tmp_path: Path) -> None:
    result = install_criu(tmp_path, STASIS_CRIU_PIN_SHA256="0" * 64, STASIS_CRIU_PREPARE_ONLY="1")
    if any("is no longer in Debian unstable" in line for line in steps(result)):
        pytest.skip(f"Debian unstable no longer carries criu {PIN}")
    assert result.returncode != 0, result.stdout
    assert f"Debian unstable carries the pinned criu {PIN}" in result.stdout
    assert re.search(
        rf"ERROR: sha256 mismatch for criu_{re.escape(PIN)}\.orig\.tar\.\w+: "
        rf"got [0-9a-f]{{64}}, want {'0' * 64}",
        result.stderr,
    ), result.stderr


def test_a_patch_that_does_not_apply_to_the_fallback_stops_with_what_to_do(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts")
    shutil.copytree(ROOT / "patches" / "criu", tree / "patches" / "criu")
    (tree / "patches" / "criu" / "0099-does-not-apply.patch").write_text(
        "--- a/criu/cr-dump.c\n+++ b/criu/cr-dump.c\n@@ -1,3 +1,4 @@\n"
        " no such line in criu\n nor this one\n nor this\n+int stasis_never;\n"
    )
    result = install_criu(
        tmp_path / "prefix",
        tree / "scripts" / "install-criu.sh",
        STASIS_CRIU_PIN="9.9.9",
        STASIS_CRIU_PREPARE_ONLY="1",
    )
    assert result.returncode != 0, result.stdout
    error = re.search(
        r"ERROR: patch 0099-does-not-apply\.patch does not apply to criu (\S+), "
        r"which Debian unstable carries instead of criu 9\.9\.9 .*",
        result.stderr,
    )
    assert error, result.stderr
    assert "STASIS_CRIU_MIRROR" in error.group(0) and "snapshot.debian.org" in error.group(0)
    assert "port patches/criu/ to criu " + error.group(1) in error.group(0)
    assert "FAILED" in result.stderr  # patch's own account of the hunk
    assert not (tmp_path / "prefix").exists()


@pytest.mark.parametrize(
    "version,stamp",
    [
        (PIN, "criu={v} patches={p} rundir={r}"),
        ("4.3.0", "criu={v} fallback-for=" + PIN + " patches={p} rundir={r}"),
    ],
    ids=["pinned", "fallback"],
)
def test_an_installed_build_matching_its_stamp_needs_no_network(
    tmp_path: Path, version: str, stamp: str
) -> None:
    fake_install(tmp_path, version, stamp.format(v=version, p=patchset_sha(PATCHES), r=RUNDIR))
    result = install_criu(tmp_path, STASIS_CRIU_MIRROR=NO_NETWORK)
    assert result.returncode == 0, result.stdout + result.stderr
    last = steps(result)[-1]
    assert last.startswith(f"criu {version} ") and last.endswith(
        ("already installed: nothing to do", "nothing to do (STASIS_CRIU_FORCE=1 rebuilds)")
    ), last


@pytest.mark.parametrize(
    "version,stamp",
    [
        ("4.3.0", "criu=4.3.0 fallback-for=4.1 patches={p} rundir={r}"),  # built for another pin
        ("4.3.0", "criu=4.3.0 patches={p} rundir={r}"),  # claims to be the pin
        ("4.3.1", "criu=4.3.0 fallback-for=" + PIN + " patches={p} rundir={r}"),  # binary changed
        (PIN, "criu=" + PIN + " patches=0000 rundir={r}"),  # another patch set
        (PIN, "criu=" + PIN + " patches={p} rundir=/run"),  # another rundir
    ],
)
def test_an_installed_build_that_is_not_the_stamped_one_is_rebuilt(
    tmp_path: Path, version: str, stamp: str
) -> None:
    fake_install(tmp_path, version, stamp.format(p=patchset_sha(PATCHES), r=RUNDIR))
    result = install_criu(tmp_path, STASIS_CRIU_MIRROR=NO_NETWORK)
    # it went to the (unreachable) archive instead of stopping at "nothing to do"
    assert result.returncode != 0, result.stdout
    assert f"(private config: deb-src {NO_NETWORK} unstable main)" in result.stdout
    assert "ERROR: apt-get update of the private source list failed" in result.stderr
