"""Containers' `auto` interval as the daemon computes it (stasis.k8s.intervals): Young/Daly's
from the measured frozen time and the site's rate, within the floors and the ceiling; the
bundle's STASIS_INTERVAL=auto; the node's `interval` for a container that asks for none. On a
real node: tests/e2e/test_k8s_auto_interval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stasis.config import load_settings
from stasis.daemon.activity import Activity
from stasis.errors import UsageError
from stasis.interval import choose, mtbi_s
from stasis.k8s.intervals import AUTO, AutoIntervals, container_interval
from stasis.k8s.runc import Bundle, read_bundle

ROW = {"container_id": "c1", "label": "l", "namespace": "ns", "interval_s": AUTO}


def auto(**settings: str) -> AutoIntervals:
    env = {"STASIS_CONFIG": "", **{f"STASIS_{k.upper()}": v for k, v in settings.items()}}
    return AutoIntervals(load_settings(env))


def checkpoint(job: str, frozen_s: float) -> Activity:
    return Activity(
        kind="checkpoint",
        checkpoint="x",
        label="l",
        job=job,
        user="k8s:ns",
        size_bytes=1,
        work_s=0.0,
        duration_s=1.0,
        frozen_s=frozen_s,
    )


def test_the_measured_cost_and_the_site_s_rate_give_young_daly_s_interval() -> None:
    a = auto(k8s_interruption_rate_per_hour="2", interval_min_s="1", k8s_min_interval_s="1")
    a.heard(checkpoint("c1", 4.0))
    a.heard(checkpoint("other", 100.0))  # another container's cost is not this one's
    got = a.job_interval(ROW, lambda: pytest.fail("its memory is not read once a cost is known"))
    expected = choose(4.0, mtbi_s(2.0), 1.0, 86400.0)
    assert got["interval_s"] == expected.interval_s == expected.raw_s
    assert (got["cost_s"], got["cost_measured"], got["mtbi_s"]) == (4.0, True, 1800.0)
    assert (got["requested"], got["kind"], got["user"], got["rate_per_hour"]) == (
        "auto",
        "container",
        "k8s:ns",
        2.0,
    )
    assert got["why"].startswith("auto: checkpoint cost 4.00 s, mean time between interruptions")


def test_before_a_checkpoint_the_cost_is_its_memory_s_estimate_and_the_floors_hold() -> None:
    # The node's container floor is above the auto floor: the higher one holds.
    a = auto(k8s_interruption_rate_per_hour="60", interval_min_s="10", k8s_min_interval_s="90")
    got = a.job_interval(ROW, lambda: 250_000_000)  # 1 s at the estimate's 250 MB/s
    assert (got["cost_s"], got["cost_measured"]) == (1.0, False)
    assert (got["interval_s"], got["bound"]) == (90.0, "floor")
    assert "estimated from its 238 MiB resident memory" in got["why"]


def test_no_rate_set_gives_the_ceiling_and_says_so() -> None:
    a = auto(interval_max_s="7200")
    a.heard(checkpoint("c1", 0.5))
    got = a.job_interval(ROW, lambda: 0)
    assert (got["interval_s"], got["bound"], got["mtbi_s"]) == (7200.0, "ceiling", None)
    assert "k8s_interruption_rate_per_hour is 0" in got["why"]


def test_a_fixed_interval_is_shown_as_asked() -> None:
    got = auto().job_interval({**ROW, "interval_s": 600}, lambda: 0)
    assert (got["interval_s"], got["requested"], got["cost_s"]) == (600.0, "600", None)


@pytest.mark.parametrize(("value", "seconds", "is_auto"), [("auto", 0, True), ("600", 600, False)])
def test_the_bundle_reads_auto(tmp_path: Path, value: str, seconds: int, is_auto: bool) -> None:
    spec = {"process": {"env": [f"STASIS_INTERVAL={value}", "STASIS_CHECKPOINT=l"]}}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    bundle = read_bundle(tmp_path, "c1")
    assert (bundle.interval_s, bundle.interval_auto) == (seconds, is_auto)


def bundle_with(tmp_path: Path, *env: str) -> Bundle:
    spec = {"process": {"env": [*env, "STASIS_CHECKPOINT=l"]}}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    return read_bundle(tmp_path, "c1")


@pytest.mark.parametrize(
    ("own", "node_default", "effective"),
    [
        # Asked for nothing: the node's `interval` (none unless set).
        ((), "", 0),
        ((), "auto", AUTO),
        ((), "90", 90),
        ((), "0.4", 1),  # whole seconds, at least 1
        (("STASIS_INTERVAL=",), "auto", AUTO),  # empty is unset
        (("STASIS_INTERVAL=soon",), "300", 300),  # meaningless: ignored, as unset
        # The container's own wins; off (or 0) is none whatever the node's default.
        (("STASIS_INTERVAL=600",), "auto", 600),
        (("STASIS_INTERVAL=auto",), "90", AUTO),
        (("STASIS_INTERVAL=off",), "auto", 0),
        (("STASIS_INTERVAL=0",), "90", 0),
    ],
)
def test_a_container_that_asks_for_no_interval_gets_the_node_s_default(
    tmp_path: Path, own: tuple[str, ...], node_default: str, effective: int
) -> None:
    settings = load_settings({"STASIS_CONFIG": "", "STASIS_DEFAULT_INTERVAL": node_default})
    assert container_interval(bundle_with(tmp_path, *own), settings.interval) == effective


@pytest.mark.parametrize(
    ("file", "value"),
    [("", ""), ('interval = "auto"', "auto"), ("interval = 3600", "3600"), ('interval = "0"', "")],
)
def test_the_node_s_interval_setting(tmp_path: Path, file: str, value: str) -> None:
    (tmp_path / "config.toml").write_text(f"[jobs]\n{file}\n")
    assert load_settings({"STASIS_CONFIG": str(tmp_path / "config.toml")}).interval == value


def test_a_meaningless_node_interval_is_one_clear_error() -> None:
    with pytest.raises(UsageError) as e:
        load_settings({"STASIS_CONFIG": "", "STASIS_DEFAULT_INTERVAL": "hourly"})
    assert str(e.value) == (
        "bad setting 'interval': 'hourly' is neither \"\" (none), \"auto\" nor seconds "
        '(e.g. "3600")'
    )


def test_the_job_s_own_stasis_interval_is_not_the_node_s_setting() -> None:
    # A `stasis` command run inside a job (whose STASIS_INTERVAL is its own) reads no default.
    env = {"STASIS_CONFIG": "", "STASIS_INTERVAL": "whenever"}
    assert load_settings(env).interval == ""
