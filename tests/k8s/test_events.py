"""How a container ended, read from containerd's events: a 0 only when containerd said 0
(its JSON leaves a 0 out of a whole exit record); anything it did not say is unknown, never 0,
since a 0 retires the label's checkpoints (issue 28)."""

from __future__ import annotations

import json

from stasis.k8s.events import parse_exit

HEAD = "2026-12-06 04:40:00.1 +0000 UTC k8s.io /tasks/exit "
WHOLE = {"container_id": "c1", "id": "c1", "pid": 42, "exited_at": "2026-12-06T04:40:00Z"}


def exit_status(event: dict[str, object]) -> int | None:
    ended = parse_exit(HEAD + json.dumps(event))
    assert ended is not None and ended.container_id == "c1"
    return ended.exit_status


def test_a_whole_exit_record_without_a_status_is_0_and_one_with_a_status_is_it() -> None:
    assert exit_status(WHOLE) == 0  # containerd's omitempty: 0 is left out
    assert exit_status({**WHOLE, "exit_status": 137}) == 137


def test_an_exit_status_containerd_did_not_say_is_unknown_not_0() -> None:
    assert exit_status({k: v for k, v in WHOLE.items() if k != "exited_at"}) is None
    assert exit_status({**WHOLE, "exit_status": None}) is None
    assert exit_status({**WHOLE, "exit_status": "0"}) is None
    assert exit_status({**WHOLE, "exit_status": False}) is None


def test_an_exec_s_exit_and_other_topics_are_not_the_container_s_end() -> None:
    assert parse_exit(HEAD + json.dumps({**WHOLE, "id": "exec-1"})) is None
    assert parse_exit(HEAD.replace("/tasks/exit", "/tasks/start") + json.dumps(WHOLE)) is None
