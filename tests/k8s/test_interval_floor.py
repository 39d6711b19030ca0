"""The floor on containers' checkpoint intervals, as the daemon reads it (its effect on real
containers: tests/e2e/test_containerd.py and test_k8s_agent.py)."""

from __future__ import annotations

import pytest

from stasis.config import load_settings
from stasis.errors import UsageError
from stasis.k8s.containers import DEFAULT_MIN_INTERVAL_S, min_interval_s


def test_the_floor_is_60_s_unless_the_node_admin_sets_another() -> None:
    settings = load_settings({"STASIS_CONFIG": ""})
    assert DEFAULT_MIN_INTERVAL_S == 60
    assert min_interval_s(settings, {}) == 60
    assert min_interval_s(settings, {"STASIS_K8S_MIN_INTERVAL_S": "300"}) == 300
    assert min_interval_s(settings, {"STASIS_K8S_MIN_INTERVAL_S": "0"}) == 0  # no floor


@pytest.mark.parametrize("raw", ["-1", "1.5", "soon"])
def test_a_bad_floor_is_one_clear_error(raw: str) -> None:
    with pytest.raises(UsageError) as e:
        min_interval_s(load_settings({"STASIS_CONFIG": ""}), {"STASIS_K8S_MIN_INTERVAL_S": raw})
    assert str(e.value) == (f"bad setting STASIS_K8S_MIN_INTERVAL_S: {raw!r} is not a whole "
                            "number of seconds")
