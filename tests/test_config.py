from __future__ import annotations

import logging
from pathlib import Path

import pytest

from stasis.config import AREAS, Settings, env_name, load_settings
from stasis.errors import UsageError


def test_defaults_file_and_env_precedence(tmp_path: Path) -> None:
    defaults = Settings()
    assert defaults.socket == Path("/run/stasis/stasis.sock") and defaults.keep == 5
    assert defaults.store_url == "/var/lib/stasis/checkpoints"
    conf = tmp_path / "c.toml"
    conf.write_text('state_dir = "/srv/stasis"\nkeep = 9\nsocket = "/tmp/a.sock"\n')
    s = load_settings({"STASIS_CONFIG": str(conf), "STASIS_SOCKET": "/tmp/b.sock"})
    assert s.state_dir == Path("/srv/stasis") and s.keep == 9
    assert s.socket == Path("/tmp/b.sock")  # the environment wins over the file
    assert s.store_url == "/srv/stasis/checkpoints"
    assert (
        load_settings({"STASIS_CONFIG": str(conf), "STASIS_STORE": "memory://x"}).store_url
        == "memory://x"
    )


def test_bad_config_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_settings({"STASIS_CONFIG": str(tmp_path / "missing.toml")})
    bad = tmp_path / "bad.toml"
    bad.write_text("keep = [")
    with pytest.raises(UsageError, match="cannot read config file"):
        load_settings({"STASIS_CONFIG": str(bad)})
    with pytest.raises(UsageError, match="keep"):
        load_settings({"STASIS_KEEP": "lots"})
    with pytest.raises(UsageError, match="unknown_key"):
        (tmp_path / "x.toml").write_text("unknown_key = 1\n")
        load_settings({"STASIS_CONFIG": str(tmp_path / "x.toml")})


def test_pruning_limits(tmp_path: Path) -> None:
    defaults = Settings()
    assert (defaults.keep_finished_jobs, defaults.keep_criu_logs) == (1000, 500)
    conf = tmp_path / "c.toml"
    conf.write_text("keep_criu_logs = 0\nfinished_jobs_max_age_s = 60\n")
    s = load_settings(
        {
            "STASIS_CONFIG": str(conf),
            "STASIS_KEEP_FINISHED_JOBS": "7",
            "STASIS_CRIU_LOGS_MAX_AGE_S": "3600",
        }
    )
    assert (s.keep_finished_jobs, s.finished_jobs_max_age_s) == (7, 60)
    assert (s.keep_criu_logs, s.criu_logs_max_age_s) == (0, 3600)
    with pytest.raises(UsageError, match="keep_finished_jobs"):
        load_settings({"STASIS_KEEP_FINISHED_JOBS": "-1"})


def test_the_control_plane_settings_take_cedana_s_spellings_and_the_token_is_never_shown() -> None:
    env = {
        "STASIS_CONFIG": "/dev/null",
        "CEDANA_URL": "https://cp.example",
        "CEDANA_CLUSTER_ID": "cl_1",
        "CEDANA_AUTH_TOKEN": "stasis_sekrit",
    }
    s = load_settings(env)
    assert (s.controlplane_url, s.cluster_id, s.auth_token) == (
        "https://cp.example",
        "cl_1",
        "stasis_sekrit",
    )
    assert "sekrit" not in repr(s) and "auth_token='***'" in repr(s)
    s = load_settings(
        {
            **env,
            "STASIS_CONTROLPLANE_URL": "https://other.example",
            "STASIS_AUTH_TOKEN": "stasis_mine",
        }
    )
    assert (s.controlplane_url, s.auth_token) == ("https://other.example", "stasis_mine")
    s = load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_CONTROLPLANE_HEARTBEAT_S": "0.5"})
    assert s.controlplane_heartbeat_s == 0.5
    with pytest.raises(UsageError, match="is not above 0"):
        load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_CONTROLPLANE_HEARTBEAT_S": "0"})


def test_the_file_takes_settings_at_the_top_or_in_their_areas_tables(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    assert not {a.key for a in AREAS} & set(Settings._fields)  # a table is never a key too
    conf.write_text(
        'keep_criu_logs = 7\nstore = "/srv/store"\n'
        '[storage]\nkeep = 9\nsite_key = "/etc/stasis/site.key"\n'
        "[slurm]\nslurm_remote_port = 6821\n"
        '[controlplane_server]\ncontrolplane_listen = "0.0.0.0:8470"\n'
    )
    s = load_settings({"STASIS_CONFIG": str(conf)})
    assert (s.keep_criu_logs, s.store, s.keep, s.site_key) == (
        7,
        "/srv/store",
        9,
        "/etc/stasis/site.key",
    )
    assert (s.slurm_remote_port, s.controlplane_listen) == (6821, "0.0.0.0:8470")
    assert load_settings({"STASIS_CONFIG": str(conf), "STASIS_KEEP": "2"}).keep == 2
    for text, says in [
        ("[slurm]\nkeep = 9\n", "'keep' in [slurm] of .*: it is a setting of [storage]; move it"),
        ("[storage]\nkept = 9\n", "'kept' in [storage] of .*: no such setting"),
        ("keep = 1\n[storage]\nkeep = 9\n", "'keep' in [storage] of .*: set at the top .* too"),
        ("[nowhere]\nkeep = 9\n", "'nowhere': no such setting"),
    ]:
        conf.write_text(text)
        with pytest.raises(UsageError, match=says.replace("[", r"\[").replace("]", r"\]")) as e:
            load_settings({"STASIS_CONFIG": str(conf)})
        assert "\n" not in str(e.value)


def test_every_setting_is_read_from_the_variable_its_name_gives(tmp_path: Path) -> None:
    """STASIS_ and the name in capitals, but for the declared exceptions (SLURM_CONF, Slurm's
    own; the S3 credentials, from the file only; `interval`'s, since STASIS_INTERVAL is a job's)."""
    irregular = {n: env_name(n) for n in Settings._fields if env_name(n) != f"STASIS_{n.upper()}"}
    assert irregular == {
        "slurm_conf": "SLURM_CONF",
        "interval": "STASIS_DEFAULT_INTERVAL",
        "s3_endpoint_url": "",
        "s3_region": "",
        "s3_access_key_id": "",
        "s3_secret_access_key": "",
        "s3_secret_access_key_file": "",
    }
    samples = {bool: "true", int: "7", float: "2.5", Path: "/x/y", str: "text", tuple: "/a:/b"}
    for name, default in Settings._field_defaults.items():
        if not env_name(name):
            continue
        kind = next(
            k for k in samples if type(default) is k or (k is Path and isinstance(default, Path))
        )
        value = {"store_id": "0123456789abcdef0123456789abcdef", "interval": "auto"}.get(
            name, samples[kind]
        )
        s = load_settings({"STASIS_CONFIG": "/dev/null", env_name(name): value})
        assert getattr(s, name) != default, name
    s = load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_CONTROLPLANE_LOST_AFTER_S": "5"})
    assert (s.controlplane_lost_after_s, s.controlplane_session_ttl_s) == (5.0, 8 * 3600)


def test_the_old_cedana_variables_are_read_with_a_one_line_deprecation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="stasis.config"):
        s = load_settings({"STASIS_CONFIG": "/dev/null", "CEDANA_URL": "https://cp.example"})
    assert s.controlplane_url == "https://cp.example"
    assert [r.getMessage() for r in caplog.records] == [
        "CEDANA_URL is deprecated: set STASIS_CONTROLPLANE_URL instead (it is read all the same)"
    ]
    caplog.clear()
    load_settings({"STASIS_CONFIG": "/dev/null", "STASIS_CONTROLPLANE_URL": "https://cp.example"})
    assert caplog.records == []


def test_no_secret_is_shown(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('[storage]\ns3_secret_access_key = "hunter2"\n')
    s = load_settings({"STASIS_CONFIG": str(conf), "STASIS_AUTH_TOKEN": "stasis_sekrit"})
    assert s.s3_secret_access_key == "hunter2"
    assert "hunter2" not in repr(s) and "sekrit" not in repr(s)
    assert "s3_secret_access_key='***'" in repr(s) and "s3_region=''" in repr(s)
