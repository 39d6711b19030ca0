"""The control plane's database: a SQLite file or PostgreSQL (an SQLAlchemy URL), opened and
migrated to the newest schema (Alembic, stasis/controlplane/migrations) once, at the start. It
owns the engine: the repositories of the table groups (registry, policies, sessions, events,
migration) each open their transactions here, never on another's."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from stasis.errors import ControlPlaneError


def url_for(db: str) -> str:
    """A bare path is a SQLite file; anything else an SQLAlchemy URL (postgresql+psycopg://)."""
    if "://" in db:
        return db
    return f"sqlite:///{Path(db).absolute()}"


def safe_url(url: str) -> str:
    """A database URL without its password (for messages and logs)."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


class Database:
    def __init__(self, db: str) -> None:
        self.url = url_for(db)
        if "://" not in db:
            # Root's alone: it holds every cluster, node and token hash of the site.
            try:
                os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
                os.chmod(db, 0o600)
            except OSError as e:
                raise ControlPlaneError(
                    f"cannot create the control plane's database {db}: {e.strerror}"
                ) from None
        try:
            self.engine: Engine = create_engine(self.url, pool_pre_ping=True)
            self.migrate()
        except (OperationalError, SQLAlchemyError) as e:
            raise ControlPlaneError(
                f"cannot open the control plane's database "
                f"{safe_url(self.url)}: {e.__class__.__name__}: "
                f"{str(e).splitlines()[0]}"
            ) from None

    def migrate(self) -> None:
        """The schema brought to the newest revision (Alembic), whatever it was."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self.engine.begin() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()
