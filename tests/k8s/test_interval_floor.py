"""The floor on containers' checkpoint intervals, as the daemon reads it (its effect on real
containers: tests/e2e/test_containerd.py and test_k8s_agent.py)."""

from __future__ import annotations

import pytest

from stasis.config import load_settings
from stasis.errors import UsageError
from stasis.k8s.containers import DEFAULT_MIN_INTERVAL_S


def test_the_floor_is_60_s_unless_the_node_admin_sets_another() -> None:
    assert DEFAULT_MIN_INTERVAL_S == 60
    assert load_settings({"STASIS_CONFIG": ""}).k8s_min_interval_s == 60
    for raw, floor in (("300", 300), ("0", 0)):  # 0: no floor
        settings = load_settings({"STASIS_CONFIG": "", "STASIS_K8S_MIN_INTERVAL_S": raw})
        assert settings.k8s_min_interval_s == floor


@pytest.mark.parametrize("raw", ["-1", "1.5", "soon"])
def test_a_bad_floor_is_one_clear_error(raw: str) -> None:
    with pytest.raises(UsageError) as e:
        load_settings({"STASIS_CONFIG": "", "STASIS_K8S_MIN_INTERVAL_S": raw})
    assert str(e.value).startswith("bad setting 'k8s_min_interval_s': ")
