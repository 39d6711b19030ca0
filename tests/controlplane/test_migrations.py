"""The schema's newest revision on a database made by an older one, with its rows: a webhook
policy from before hook tokens keeps working (run by the admin, a hook token given by
rotate-hook), and the revision goes down and up again. On SQLite and PostgreSQL."""

from __future__ import annotations

import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, text

import stasis.controlplane
from tests.controlplane.conftest import ControlPlane


def _to(url: str, revision: str, down: bool = False) -> None:
    cfg = Config()
    cfg.set_main_option(
        "script_location", str(Path(stasis.controlplane.__file__).parent / "migrations")
    )
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)
    finally:
        engine.dispose()


def _columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("policies")}
    finally:
        engine.dispose()


def test_hook_tokens_come_to_a_database_made_before_them(db_url: str, world_tmp: Path) -> None:
    url = db_url if "://" in db_url else f"sqlite:///{db_url}"
    _to(url, "0007")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO policies (name, every_s, action, filters, keep, older_than_s, "
                    "enabled, last_run, created) VALUES ('old-hook', 0, 'checkpoint', '{}', NULL, "
                    "NULL, true, 0, '2026-01-01T00:00:00+00:00')"
                )
            )
    finally:
        engine.dispose()
    assert "hook_sha256" not in _columns(url)

    cp = ControlPlane(Path(tempfile.mkdtemp(prefix="cp-", dir=world_tmp)), db_url)
    cp.start()  # migrated to the newest revision at start
    try:
        (old,) = cp.json("policies", "list")
        assert (old["name"], old["trigger"], old["hook"], old["stop"]) == (
            "old-hook",
            "every",
            False,
            False,
        )
        assert cp.json("policies", "run", "old-hook") == {"name": "old-hook", "queued": 0}
        token = cp.json("policies", "rotate-hook", "old-hook")["hook_token"]
        assert cp.call("POST", "/api/v1/policies/old-hook/run", token) == (
            200,
            {"name": "old-hook", "queued": 0},
        )
    finally:
        cp.stop()
    _to(url, "0007", down=True)
    assert "hook_sha256" not in _columns(url)
    _to(url, "head")
    assert {"hook_sha256", "hook_created"} <= _columns(url)
