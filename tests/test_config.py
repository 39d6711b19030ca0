from __future__ import annotations

from pathlib import Path

import pytest

from stasis.config import Settings, load_settings
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
