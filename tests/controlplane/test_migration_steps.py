"""The steps of a migration's restore half (stasis.controlplane.migration.next_try), decided on
what is known: the same node while tries are left there, then the alternates that are ready
and were not tried, then nowhere. (What each step does to a real control plane and real nodes:
test_migration_faults.py, test_migrations.py.)"""

from __future__ import annotations

from stasis.controlplane.migration import RESTORE_TRIES_PER_NODE, RETRY_BACKOFF_S, next_try

ARGS = {
    "checkpoint": "c1",
    "migrated_from": "cmd_1",
    "job": "j1",
    "alternates": [{"node": "c", "seal": {"s": "1"}}, {"node": "d", "seal": {"s": "2"}}],
}


def test_the_same_node_again_after_a_backoff_while_tries_are_left() -> None:
    again = next_try(ARGS, "b", set(), node_gone=False)
    assert again is not None and again.node == "b" and again.delay_s == RETRY_BACKOFF_S
    assert again.args["try"] == 2 and again.args["alternates"] == ARGS["alternates"]
    assert again.how == "tried again on node b in 1 s"


def test_then_the_next_ready_alternate_not_tried_with_its_own_seal() -> None:
    spent = {**ARGS, "try": RESTORE_TRIES_PER_NODE}
    again = next_try(spent, "b", {"c", "d"}, node_gone=False)
    assert again is not None and (again.node, again.delay_s) == ("c", 0.0)
    assert again.args["seal"] == {"s": "1"} and again.args["try"] == 1
    assert again.args["tried"] == ["b"] and again.args["alternates"] == [ARGS["alternates"][1]]
    # c not ready: d; c tried already: d too
    assert next_try(spent, "b", {"d"}, node_gone=False).node == "d"  # type: ignore[union-attr]
    tried = {**spent, "tried": ["c"]}
    assert next_try(tried, "b", {"c", "d"}, node_gone=False).node == "d"  # type: ignore[union-attr]


def test_a_lost_node_is_not_tried_again_and_then_nowhere() -> None:
    again = next_try(ARGS, "b", {"b", "c"}, node_gone=True)
    assert again is not None and again.node == "c"
    assert next_try(ARGS, "b", set(), node_gone=True) is None
    assert next_try({**ARGS, "alternates": []}, "b", {"c"}, node_gone=True) is None
